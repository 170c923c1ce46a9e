/* tests/test_expert_modelfile.c: model files (expert/modelfile.h) and the
 * model registry (expert_model_register): round trips through the canonical
 * JSON, equal canonical bytes and stage hashes for differently written files
 * of one model, stage hashes that follow every size, one clear sentence for
 * every kind of bad file, and registration (idempotent, conflicts, names
 * with dots, threads). */
#include "test_util.h"

#include <errno.h>
#include <pthread.h>

#include "expert/model.h"
#include "expert/modelfile.h"

/* Test texts are written with ' for " (JSON needs no ' here). */
static char *unquote(const char *q)
{
    char *t = strdup(q);
    assert_non_null(t);
    for (char *p = t; *p; p++)
        if (*p == '\'')
            *p = '"';
    return t;
}

static struct expert_model_spec *parse_q(const char *q, char *err, size_t errlen)
{
    char *t = unquote(q);
    struct expert_model_spec *m = expert_model_parse(t, strlen(t), "t.json", err, errlen);
    free(t);
    return m;
}

static struct expert_model_spec *parse_ok(const char *q)
{
    char err[512];
    struct expert_model_spec *m = parse_q(q, err, sizeof err);
    if (!m)
        print_error("unexpected error: %s\n", err);
    assert_non_null(m);
    return m;
}

static void expect_bad(const char *q, const char *want)
{
    char err[512];
    struct expert_model_spec *m = parse_q(q, err, sizeof err);
    if (m || !strstr(err, want) || strncmp(err, "t.json: ", 8) != 0)
        print_error("text: %s\n got: %s\nwant: %s\n", q, m ? "(parsed)" : err, want);
    assert_null(m);
    assert_non_null(strstr(err, want));
    assert_int_equal(strncmp(err, "t.json: ", 8), 0);
}

static char *source_path(const char *rel)
{
    const char *root = getenv("STARLING_SOURCE_ROOT");
    char *p = malloc(4096);
    assert_non_null(p);
    snprintf(p, 4096, "%s/%s", root && *root ? root : ".", rel);
    return p;
}

static void assert_same_hashes(const struct expert_model_spec *a, const struct expert_model_spec *b)
{
    assert_int_equal(a->n_stages, b->n_stages);
    for (int i = 0; i < a->n_stages; i++) {
        assert_true(expert_stage_hash(a, i) != 0);
        assert_true(expert_stage_hash(a, i) == expert_stage_hash(b, i));
    }
}

#define HDR(name) "{'format':'starling.model.v1','name':'" name "',"
#define CLS(stages) HDR("m") "'task':{'kind':'classes','inputs':8,'classes':4},'stages':[" stages "]}"
#define LM(stages) HDR("lm") "'task':{'kind':'bytes','context':16,'vocab':32},'stages':[" stages "]}"
#define LIN "{'kind':'linear','in':8,'out':16}"
#define FFN "{'kind':'resffn','dim':16,'hidden':32}"
#define HEAD "{'kind':'head','in':16,'out':4}"
#define EMB "{'kind':'embed','dim':8,'heads':2,'hidden':32}"
#define DEC "{'kind':'decoder','dim':8,'heads':2,'hidden':32}"
#define LMH "{'kind':'lm_head','dim':8,'heads':2,'hidden':32}"

/* ---- round trips ---- */

static void test_builtins_round_trip(void **state)
{
    (void)state;
    int n = 0;
    for (int k = 0; expert_model_at(k); k++, n++) {
        const struct expert_model_spec *b = expert_model_at(k);
        char *j = expert_model_to_json(b);
        assert_non_null(j);
        char err[512];
        struct expert_model_spec *m = expert_model_parse(j, strlen(j), "canon", err, sizeof err);
        if (!m)
            print_error("%s: %s\n%s\n", b->name, err, j);
        assert_non_null(m);
        assert_true(expert_model_equal(m, b));
        assert_same_hashes(m, b);
        char *j2 = expert_model_to_json(m);
        assert_string_equal(j, j2);
        free(j2);
        free(j);
        expert_model_free(m);
    }
    assert_true(n >= 2);
    /* The canonical text is what the DHT will hold: pin its shape. */
    char *j = expert_model_to_json(expert_model_find("tiny-lm"));
    assert_non_null(j);
    assert_int_equal(strncmp(j, "{\"batch\":32,\"description\":\"byte-level GPT", 41), 0);
    assert_non_null(strstr(j, "\"stages\":[{\"dim\":256,\"heads\":8,\"hidden\":1024,\"kind\":\"embed\","
                              "\"layers\":2},"));
    assert_non_null(strstr(j, "\"task\":{\"context\":128,\"kind\":\"bytes\",\"vocab\":256}}"));
    free(j);
}

static void test_doc_examples_are_the_builtins(void **state)
{
    (void)state;
    const char *names[] = { "fmnist-mlp", "tiny-lm" };
    for (int i = 0; i < 2; i++) {
        char rel[64], err[512];
        snprintf(rel, sizeof rel, "docs/models/%s.json", names[i]);
        char *path = source_path(rel);
        struct expert_model_spec *m = expert_model_load_file(path, err, sizeof err);
        if (!m)
            print_error("%s\n", err);
        assert_non_null(m);
        const struct expert_model_spec *b = expert_model_find(names[i]);
        assert_true(expert_model_equal(m, b));
        assert_same_hashes(m, b);
        char *j1 = expert_model_to_json(m), *j2 = expert_model_to_json(b);
        assert_string_equal(j1, j2);
        free(j1);
        free(j2);
        free(path);
        expert_model_free(m);
    }
}

/* Key order, whitespace, defaults left out or written: the same model. */
static void test_formatting_does_not_matter(void **state)
{
    (void)state;
    const char *a_text =
        "{'format':'starling.model.v1','name':'lm','task':{'kind':'bytes','context':16,'vocab':32},"
        "'stages':[" EMB "," DEC "," DEC "," LMH "]}";
    const char *b_text =
        "\n\t{ 'stages' : [ { 'hidden':32, 'heads':2, 'dim':8, 'kind':'embed', 'layers':0 },\n"
        "  { 'repeat': 2, 'layers': 1, 'kind': 'decoder', 'hidden': 32, 'dim': 8, 'heads': 2 },\n"
        "  { 'kind': 'lm_head', 'layers': 0, 'heads': 2, 'dim': 8, 'hidden': 32, 'repeat': 1 } ],\n"
        "  'max_batch': 0, 'batch': 0, 'description': '',\n"
        "  'task': { 'vocab': 32, 'kind': 'bytes', 'context': 16 },\n"
        "  'name': 'lm', 'format': 'starling.model.v1' }\n\n";
    struct expert_model_spec *a = parse_ok(a_text), *b = parse_ok(b_text);
    assert_true(expert_model_equal(a, b));
    assert_int_equal(a->n_stages, 4);
    assert_int_equal(a->stages[1].layers, 1);   /* decoder: 1 layer by default */
    assert_int_equal(a->stages[0].layers, 0);   /* embed, lm_head: 0 */
    assert_int_equal(a->stages[3].out, 16 * 32);
    assert_int_equal(a->n_in, 16);
    assert_int_equal(a->n_out, 16 * 32);
    char *ja = expert_model_to_json(a), *jb = expert_model_to_json(b);
    assert_non_null(ja);
    assert_string_equal(ja, jb);
    assert_same_hashes(a, b);
    free(ja);
    free(jb);
    expert_model_free(a);
    expert_model_free(b);

    a = parse_ok(CLS(LIN "," FFN "," FFN "," HEAD));
    b = parse_ok("{'stages':[" LIN ",{'hidden':32,'repeat':2,'dim':16,'kind':'resffn'}," HEAD "],"
                 "'task':{'classes':4,'inputs':8,'kind':'classes'},'name':'m','batch':0,"
                 "'format':'starling.model.v1'}");
    ja = expert_model_to_json(a);
    jb = expert_model_to_json(b);
    assert_string_equal(ja, jb);
    assert_string_equal(ja, "{\"batch\":0,\"description\":\"\",\"format\":\"starling.model.v1\","
                            "\"max_batch\":0,\"name\":\"m\",\"stages\":[{\"in\":8,\"kind\":\"linear\","
                            "\"out\":16},{\"dim\":16,\"hidden\":32,\"kind\":\"resffn\"},{\"dim\":16,"
                            "\"hidden\":32,\"kind\":\"resffn\"},{\"in\":16,\"kind\":\"head\",\"out\":4}],"
                            "\"task\":{\"classes\":4,\"inputs\":8,\"kind\":\"classes\"}}");
    assert_same_hashes(a, b);
    free(ja);
    free(jb);
    expert_model_free(a);
    expert_model_free(b);
}

/* Stage i's hash changes exactly when stage i's computation does. */
static void expect_hash_change(const char *base_q, const char *var_q, const int *changed, int n)
{
    struct expert_model_spec *a = parse_ok(base_q), *b = parse_ok(var_q);
    assert_int_equal(a->n_stages, n);
    assert_int_equal(b->n_stages, n);
    for (int i = 0; i < n; i++) {
        int differ = expert_stage_hash(a, i) != expert_stage_hash(b, i);
        if (differ != changed[i])
            print_error("stage %d: hash %s\n  %s\n  %s\n", i, differ ? "changed" : "did not change",
                        base_q, var_q);
        assert_int_equal(differ, changed[i]);
    }
    expert_model_free(a);
    expert_model_free(b);
}

static void test_sizes_change_hashes(void **state)
{
    (void)state;
    const char *cls = CLS(LIN "," FFN "," HEAD);
    expect_hash_change(cls, CLS(LIN ",{'kind':'resffn','dim':16,'hidden':33}," HEAD),
                       (const int[]){ 0, 1, 0 }, 3);
    expect_hash_change(cls, CLS("{'kind':'linear','in':8,'out':17},{'kind':'resffn','dim':17,'hidden':32},"
                                "{'kind':'head','in':17,'out':4}"), (const int[]){ 1, 1, 1 }, 3);
    expect_hash_change(cls, "{'format':'starling.model.v1','name':'m','task':{'kind':'classes','inputs':9,"
                            "'classes':4},'stages':[{'kind':'linear','in':9,'out':16}," FFN "," HEAD "]}",
                       (const int[]){ 1, 0, 0 }, 3);
    expect_hash_change(cls, "{'format':'starling.model.v1','name':'m','task':{'kind':'classes','inputs':8,"
                            "'classes':5},'stages':[" LIN "," FFN ",{'kind':'head','in':16,'out':5}]}",
                       (const int[]){ 0, 0, 1 }, 3);
    /* The name is part of every stage hash; the description and batch sizes are not. */
    expect_hash_change(cls, HDR("m2") "'task':{'kind':'classes','inputs':8,'classes':4},'stages':[" LIN
                            "," FFN "," HEAD "]}", (const int[]){ 1, 1, 1 }, 3);
    expect_hash_change(cls, HDR("m") "'description':'x','batch':8,'max_batch':4,'task':{'kind':'classes',"
                            "'inputs':8,'classes':4},'stages':[" LIN "," FFN "," HEAD "]}",
                       (const int[]){ 0, 0, 0 }, 3);
    const char *lm = LM(EMB "," DEC "," LMH);
    expect_hash_change(lm, LM(EMB ",{'kind':'decoder','dim':8,'heads':4,'hidden':32}," LMH),
                       (const int[]){ 0, 1, 0 }, 3);
    expect_hash_change(lm, LM(EMB ",{'kind':'decoder','dim':8,'heads':2,'hidden':32,'layers':2}," LMH),
                       (const int[]){ 0, 1, 0 }, 3);
    expect_hash_change(lm, LM(EMB "," DEC ",{'kind':'lm_head','dim':8,'heads':2,'hidden':64}"),
                       (const int[]){ 0, 0, 1 }, 3);
    expect_hash_change(lm, LM(EMB "," DEC ",{'kind':'lm_head','dim':8,'heads':2,'hidden':32,'layers':1}"),
                       (const int[]){ 0, 0, 1 }, 3);
    expect_hash_change(lm, LM("{'kind':'embed','dim':16,'heads':2,'hidden':32},{'kind':'decoder','dim':16,"
                              "'heads':2,'hidden':32}," "{'kind':'lm_head','dim':16,'heads':2,'hidden':32}"),
                       (const int[]){ 1, 1, 1 }, 3);
    /* The task's sizes reach the stages that use them. */
    expect_hash_change(lm, HDR("lm") "'task':{'kind':'bytes','context':16,'vocab':64},'stages':[" EMB "," DEC
                           "," LMH "]}", (const int[]){ 1, 0, 1 }, 3);
    expect_hash_change(lm, HDR("lm") "'task':{'kind':'bytes','context':32,'vocab':32},'stages':[" EMB "," DEC
                           "," LMH "]}", (const int[]){ 1, 1, 1 }, 3);
}

/* ---- bad files ---- */

static void test_bad_files(void **state)
{
    (void)state;
    /* unknown keys, at every level */
    expect_bad(HDR("m") "'nmae':'x','task':{'kind':'classes','inputs':8,'classes':4},'stages':[" LIN "]}",
               "t.json: nmae: unknown key (known: format, name, description, task, batch, max_batch, stages)");
    expect_bad(HDR("m") "'task':{'kind':'classes','input':8,'classes':4},'stages':[" LIN "]}",
               "t.json: task.input: unknown key (known for classes: kind, inputs, classes)");
    expect_bad(HDR("m") "'task':{'kind':'bytes','context':8,'vocab':4,'classes':3},'stages':[" EMB "]}",
               "task.classes: unknown key (known for bytes: kind, context, vocab)");
    expect_bad(CLS(LIN ",{'kind':'resffn','dim':16,'hiden':32}," HEAD),
               "t.json: stages[1].hiden: unknown key (known for resffn: kind, dim, hidden, repeat)");
    expect_bad(CLS("{'kind':'linear','in':8,'out':16,'hidden':3}," FFN "," HEAD),
               "stages[0].hidden: unknown key (known for linear: kind, in, out, repeat)");
    expect_bad(LM("{'kind':'embed','dim':8,'heads':2,'hidden':32,'vocab':32}," DEC "," LMH),
               "stages[0].vocab: unknown key (known for embed: kind, dim, heads, hidden, layers, repeat)");
    /* unknown kinds */
    expect_bad(CLS(LIN ",{'kind':'mlp','dim':16}," HEAD),
               "stages[1].kind: unknown block kind 'mlp' (known: linear, resffn, head, embed, decoder, lm_head)");
    expect_bad(HDR("m") "'task':{'kind':'images','inputs':8,'classes':4},'stages':[" LIN "]}",
               "task.kind: unknown task 'images' (known: classes, bytes)");
    expect_bad(CLS(LIN ",{'kind':7}," HEAD), "stages[1].kind: expected a block kind: linear, resffn");
    expect_bad(CLS(LIN ",{'dim':16,'hidden':32}," HEAD), "stages[1].kind: missing (a block kind: linear,");
    expect_bad(CLS(LIN "," EMB "," HEAD), "stages[1].kind: a embed stage needs a task of kind bytes");
    expect_bad(LM(LIN), "stages[0].kind: a linear stage needs a task of kind classes");
    /* wrong types and ranges */
    expect_bad(CLS("{'kind':'linear','in':'8','out':16}," FFN "," HEAD),
               "stages[0].in: expected an integer from 1 to 65536, got a string");
    expect_bad(CLS("{'kind':'linear','in':8.5,'out':16}," FFN "," HEAD),
               "stages[0].in: expected an integer from 1 to 65536, got 8.5");
    expect_bad(CLS("{'kind':'linear','in':8.0,'out':16}," FFN "," HEAD),
               "stages[0].in: expected an integer from 1 to 65536, got 8");
    expect_bad(CLS("{'kind':'linear','in':8,'out':1e1}," FFN "," HEAD), "stages[0].out: expected an integer");
    expect_bad(CLS("{'kind':'linear','in':8,'out':true}," FFN "," HEAD),
               "stages[0].out: expected an integer from 1 to 65536, got a boolean");
    expect_bad(CLS("{'kind':'linear','in':8,'out':null}," FFN "," HEAD), "stages[0].out: expected an integer");
    expect_bad(CLS(LIN ",{'kind':'resffn','dim':16,'hidden':-3}," HEAD),
               "stages[1].hidden: must be from 1 to 65536, got -3");
    expect_bad(CLS(LIN ",{'kind':'resffn','dim':16,'hidden':0}," HEAD),
               "stages[1].hidden: must be from 1 to 65536, got 0");
    expect_bad(CLS(LIN ",{'kind':'resffn','dim':16,'hidden':65537}," HEAD),
               "stages[1].hidden: must be from 1 to 65536, got 65537");
    expect_bad(CLS(LIN ",{'kind':'resffn','dim':16,'hidden':99999999999999}," HEAD),
               "stages[1].hidden: must be from 1 to 65536, got 99999999999999");
    expect_bad(CLS(LIN "," FFN "," HEAD) "x", "t.json: line 1, column");
    expect_bad(HDR("m") "'task':{'kind':'classes','inputs':8,'classes':1},'stages':[" LIN "]}",
               "task.classes: must be from 2 to 65536, got 1");
    expect_bad(HDR("m") "'task':[8,4],'stages':[" LIN "]}", "task: expected an object, got an array");
    expect_bad(HDR("m") "'batch':-1,'task':{'kind':'classes','inputs':8,'classes':4},'stages':[" LIN "]}",
               "batch: must be from 0 to 1048576, got -1");
    expect_bad(HDR("m") "'max_batch':'32','task':{'kind':'classes','inputs':8,'classes':4},'stages':[" LIN "]}",
               "max_batch: expected an integer from 0 to 65536, got a string");
    expect_bad(HDR("m") "'description':5,'task':{'kind':'classes','inputs':8,'classes':4},'stages':[" LIN "]}",
               "description: expected a string, got an integer");
    expect_bad(HDR("m") "'description':'a\\u0007b','task':{'kind':'classes','inputs':8,'classes':4},"
               "'stages':[" LIN "]}", "description: contains a control character (byte 1)");
    expect_bad(LM(EMB ",{'kind':'decoder','dim':8,'heads':2,'hidden':32,'layers':0}," LMH),
               "stages[1].layers: must be from 1 to 16, got 0");
    expect_bad(LM(EMB "," DEC ",{'kind':'lm_head','dim':8,'heads':2,'hidden':32,'layers':17}"),
               "stages[2].layers: must be from 0 to 16, got 17");
    expect_bad(LM("{'kind':'embed','dim':8,'heads':3,'hidden':32}," DEC "," LMH),
               "t.json: stages[0].heads: 3 does not divide dim 8");
    expect_bad(LM("{'kind':'embed','dim':8,'heads':16,'hidden':32}," DEC "," LMH),
               "stages[0].heads: 16 does not divide dim 8");
    /* Sizes each in range whose product no peer could hold. */
    expect_bad(HDR("lm") "'task':{'kind':'bytes','context':16,'vocab':32},'stages':["
               "{'kind':'embed','dim':8,'heads':2,'hidden':32},"
               "{'kind':'decoder','dim':16384,'heads':1,'hidden':65536,'layers':1}," LMH "]}",
               "stages[1]: 3221438464 parameters: over the 1073741824 a stage may have");
    expect_bad(HDR("lm") "'task':{'kind':'bytes','context':4096,'vocab':32},'stages':["
               "{'kind':'embed','dim':512,'heads':512,'hidden':32,'layers':16}," LMH "]}",
               "stages[0]: one sequence keeps");
    expect_bad(HDR("lm") "'task':{'kind':'bytes','context':4096,'vocab':4096},'stages':[" EMB "]}",
               "task.vocab: context*vocab = 16777216 logits per row is over the limit of 4194304");
    expect_bad(HDR("lm") "'task':{'kind':'bytes','context':4096,'vocab':256},'stages':["
               "{'kind':'embed','dim':2048,'heads':2,'hidden':32}]}",
               "stages[0].dim: context*dim = 8388608 values per row is over the limit of 4194304");
    /* widths that do not chain */
    expect_bad(CLS(LIN ",{'kind':'resffn','dim':32,'hidden':32}," HEAD),
               "t.json: stages[1].dim: takes 32 values per row, but stages[0] gives 16");
    expect_bad(CLS(LIN "," FFN ",{'kind':'head','in':12,'out':4}"),
               "stages[2].in: takes 12 values per row, but stages[1] gives 16");
    expect_bad(CLS("{'kind':'linear','in':9,'out':16}," FFN "," HEAD),
               "t.json: stages[0].in: the first stage takes 9 values per row, but the task's input is 8 "
               "(task.inputs)");
    expect_bad(CLS(LIN "," FFN ",{'kind':'head','in':16,'out':5}"),
               "t.json: stages[2].out: the last stage gives 5 values per row, but the task's output is 4 "
               "(task.classes)");
    expect_bad(LM(DEC "," LMH), "stages[0].dim: the first stage takes 128 values per row (context*dim), but "
                                "the task's input is 16 (task.context)");
    expect_bad(LM(EMB "," DEC), "stages[1].dim: the last stage gives 128 values per row (context*dim), but "
                                "the task's output is 512 (context*vocab)");
    expect_bad(LM(EMB ",{'kind':'decoder','dim':16,'heads':2,'hidden':32}," LMH),
               "stages[1].dim: takes 256 values per row (context*dim), but stages[0] gives 128");
    expect_bad(LM(EMB "," EMB "," LMH), "stages[1].kind: takes 16 values per row (embed takes context token "
                                        "ids), but stages[0] gives 128");
    expect_bad(CLS("{'kind':'linear','in':8,'out':16,'repeat':2}," FFN "," HEAD),
               "stages[0].repeat: a linear stage that takes 8 values and gives 16 cannot follow itself");
    /* missing keys */
    expect_bad("{'name':'m','task':{'kind':'classes','inputs':8,'classes':4},'stages':[" LIN "]}",
               "t.json: format: missing (a string: \"starling.model.v1\")");
    expect_bad("{'format':'starling.model.v2','name':'m'}",
               "format: 'starling.model.v2' is not starling.model.v1, the only format this build reads");
    expect_bad("{'format':'starling.model.v1','task':{'kind':'classes','inputs':8,'classes':4},'stages':[]}",
               "t.json: name: missing");
    expect_bad(HDR("m") "'stages':[" LIN "]}", "t.json: task: missing");
    expect_bad(HDR("m") "'task':{'inputs':8,'classes':4},'stages':[" LIN "]}", "task.kind: missing");
    expect_bad(HDR("m") "'task':{'kind':'classes','classes':4},'stages':[" LIN "]}",
               "task.inputs: missing (an integer from 1 to 65536)");
    expect_bad(HDR("m") "'task':{'kind':'classes','inputs':8,'classes':4}}", "t.json: stages: missing");
    expect_bad(CLS(LIN ",{'kind':'resffn','dim':16}," HEAD), "stages[1].hidden: missing (an integer from 1");
    expect_bad(LM("{'kind':'embed','dim':8,'hidden':32}," DEC "," LMH), "stages[0].heads: missing");
    expect_bad(CLS(""), "t.json: stages: empty: a model needs at least one stage");
    expect_bad(HDR("m") "'task':{'kind':'classes','inputs':8,'classes':4},'stages':{}}",
               "stages: expected an array of stage objects, got an object");
    expect_bad(CLS(LIN ",16," HEAD), "stages[1]: expected an object, got an integer");
    /* names */
    expect_bad(HDR("Fmnist") "'task':{'kind':'classes','inputs':8,'classes':4},'stages':[" LIN "]}",
               "name: 'Fmnist' is not a model name");
    expect_bad(HDR("m.12") "'task':{'kind':'classes','inputs':8,'classes':4},'stages':[" LIN "]}",
               "name: 'm.12' is not a model name");
    expect_bad("{'format':'starling.model.v1','name':7}", "name: expected a string: the model's name, got an integer");
    /* not JSON, or not a model at all */
    expect_bad("[1,2]", "t.json: the top level must be an object, not an array");
    expect_bad("", "t.json: line 1, column 0: not valid JSON");
    expect_bad("\x01\x02garbage", "t.json: line 1, column 1: not valid JSON");
    expect_bad("{'format':'starling.model.v1',\n 'name':'m',\n 'task':{'kind'", "t.json: line 3, column");
    expect_bad("{'format':'starling.model.v1','name':'m','name':'n'}", "duplicate object key");
    expect_bad("{'format':'starling.model.v1','name':'m\xff\xfe'}", "not valid JSON: unable to decode byte 0xff");
    expect_bad("{'format':'starling.model.v1','name':'a\\u0000b'}", "not valid JSON");
    expect_bad(CLS(LIN "," FFN "," HEAD) CLS(LIN), "not valid JSON: end of file expected");
}

static void test_stage_limit(void **state)
{
    (void)state;
    /* 64 stages are fine, 65 are not; as a list or through "repeat". */
    char *t = malloc(16384);
    assert_non_null(t);
    for (int n = 64; n <= 65; n++) {
        int len = snprintf(t, 16384, "{'format':'starling.model.v1','name':'deep','task':{'kind':'classes',"
                                     "'inputs':8,'classes':8},'stages':[");
        for (int i = 0; i < n; i++)
            len += snprintf(t + len, 16384 - (size_t)len, "%s{'kind':'linear','in':8,'out':8}", i ? "," : "");
        snprintf(t + len, 16384 - (size_t)len, "]}");
        if (n == 64) {
            struct expert_model_spec *m = parse_ok(t);
            assert_int_equal(m->n_stages, 64);
            expert_model_free(m);
        } else {
            expect_bad(t, "t.json: stages: 65 stages, over the limit of 64");
        }
    }
    free(t);
    struct expert_model_spec *m = parse_ok(CLS(LIN ",{'kind':'resffn','dim':16,'hidden':32,'repeat':62}," HEAD));
    assert_int_equal(m->n_stages, 64);
    expert_model_free(m);
    expect_bad(CLS(LIN ",{'kind':'resffn','dim':16,'hidden':32,'repeat':63}," HEAD),
               "stages[2].repeat: makes more than 64 stages, the limit");
    expect_bad(CLS(LIN ",{'kind':'resffn','dim':16,'hidden':32,'repeat':0}," HEAD),
               "stages[1].repeat: must be from 1 to 64, got 0");
}

/* ---- files ---- */

static void write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

static void test_files(void **state)
{
    (void)state;
    char dir[512], path[600], want[700], err[512];
    test_tmpdir(dir, sizeof dir, "modelfile");
    snprintf(path, sizeof path, "%s/none.json", dir);
    assert_null(expert_model_load_file(path, err, sizeof err));
    snprintf(want, sizeof want, "%s: cannot open: No such file or directory", path);
    assert_string_equal(err, want);

    /* Over 1 MiB (valid JSON padded with spaces): refused before parsing. */
    size_t big = EXPERT_MODELFILE_MAX_BYTES + 1;
    char *buf = malloc(big);
    assert_non_null(buf);
    char *ok = unquote(CLS(LIN "," FFN "," HEAD));
    memset(buf, ' ', big);
    memcpy(buf, ok, strlen(ok));
    snprintf(path, sizeof path, "%s/big.json", dir);
    write_file(path, buf, big);
    assert_null(expert_model_load_file(path, err, sizeof err));
    snprintf(want, sizeof want, "%s: larger than 1048576 bytes, the limit of a model file", path);
    assert_string_equal(err, want);
    assert_null(expert_model_parse(buf, big, "dht", err, sizeof err));
    assert_string_equal(err, "dht: 1048577 bytes, over the limit of 1048576 for a model description");
    /* Exactly the limit is fine. */
    write_file(path, buf, big - 1);
    struct expert_model_spec *m = expert_model_load_file(path, err, sizeof err);
    assert_non_null(m);
    expert_model_free(m);
    free(buf);

    /* Not UTF-8 (Latin-1 in the description). */
    snprintf(path, sizeof path, "%s/latin1.json", dir);
    const char latin1[] = "{\"format\":\"starling.model.v1\",\"name\":\"m\",\"description\":\"caf\xe9\"}";
    write_file(path, latin1, sizeof latin1 - 1);
    assert_null(expert_model_load_file(path, err, sizeof err));
    snprintf(want, sizeof want, "%s: line 1, column ", path);
    assert_int_equal(strncmp(err, want, strlen(want)), 0);
    assert_non_null(strstr(err, "unable to decode byte 0xe9"));

    /* In memory: not NUL-terminated, length respected. */
    size_t n = strlen(ok);
    char *copy = malloc(n + 5);
    assert_non_null(copy);
    memcpy(copy, ok, n);
    memcpy(copy + n, "junk", 4);
    m = expert_model_parse(copy, n, NULL, err, sizeof err);
    assert_non_null(m);
    expert_model_free(m);
    assert_null(expert_model_parse(copy, n + 4, NULL, err, sizeof err));
    assert_int_equal(strncmp(err, "model: line 1", 13), 0);
    assert_null(expert_model_parse(NULL, 0, NULL, err, sizeof err));
    assert_null(expert_model_parse(copy, n - 1, NULL, NULL, 0)); /* no err buffer: fine */
    free(copy);
    free(ok);
    test_rmtree(dir);
}

/* ---- names, to_json of invalid specs ---- */

static void test_names_and_invalid_specs(void **state)
{
    (void)state;
    const char *good[] = { "m", "0", "fmnist-mlp", "gpt.v2", "a_b-c.d", "x.1a", "a..b",
                           "abcdefghijklmnopqrstuvwxyz0123456789abcdefghijkl" /* 48 */ };
    const char *bad[] = { "", "A", "-m", ".m", "_m", "m.", "m.1", "m.v2.03", "m/n", "m n", "m:1", "é",
                          "abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklm" /* 49 */ };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        assert_int_equal(expert_model_name_check(good[i]), 0);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(expert_model_name_check(bad[i]), -EINVAL);
    assert_int_equal(expert_model_name_check(NULL), -EINVAL);

    /* A spec no file could describe has no canonical form. */
    const struct expert_model_spec *fm = expert_model_find("fmnist-mlp");
    struct expert_model_spec s = *fm;
    char *j = expert_model_to_json(&s);
    assert_non_null(j);
    free(j);
    s.name = "Bad";
    assert_null(expert_model_to_json(&s));
    s = *fm;
    s.n_out = 11;                 /* the head gives 10 */
    assert_null(expert_model_to_json(&s));
    s = *fm;
    s.seq = 4;                    /* classes tasks have no context */
    assert_null(expert_model_to_json(&s));
    s = *fm;
    struct expert_block_config st[6];
    memcpy(st, fm->stages, sizeof st);
    st[0].hidden = 3;             /* linear has no hidden width */
    s.stages = st;
    assert_null(expert_model_to_json(&s));
    s = *fm;
    s.n_stages = 0;
    assert_null(expert_model_to_json(&s));
    assert_null(expert_model_to_json(NULL));
    assert_false(expert_model_equal(fm, NULL));
    assert_true(expert_model_equal(fm, fm));
    s = *fm;
    s.desc = "other";
    assert_false(expert_model_equal(fm, &s));
}

/* ---- the registry ---- */

static void test_registry(void **state)
{
    (void)state;
    char err[512];
    int before = 0;
    while (expert_model_at(before))
        before++;
    const char *text = HDR("gpt.v2") "'description':'a test model','task':{'kind':'bytes','context':16,"
                       "'vocab':32},'stages':[" EMB "," DEC "," LMH "]}";
    assert_null(expert_model_find("gpt.v2"));
    assert_int_equal(expert_stage_parse("gpt.v2.1", NULL, NULL), -ENOENT);
    struct expert_model_spec *m = parse_ok(text);
    assert_int_equal(expert_model_register(m, err, sizeof err), 0);
    const struct expert_model_spec *r = expert_model_find("gpt.v2");
    assert_non_null(r);
    assert_ptr_equal(expert_model_at(before), r);
    assert_null(expert_model_at(before + 1));
    /* Stage ids of a name with dots split at the last dot. */
    const struct expert_model_spec *pm = NULL;
    int idx = -1;
    assert_int_equal(expert_stage_parse("gpt.v2.1", &pm, &idx), 0);
    assert_ptr_equal(pm, r);
    assert_int_equal(idx, 1);
    assert_int_equal(expert_stage_parse("gpt.v2.3", &pm, &idx), -ENOENT);
    assert_int_equal(expert_stage_parse("gpt.v2", &pm, &idx), -EINVAL); /* model "gpt", stage "v2" */
    char name[EXPERT_STAGE_NAME_MAX];
    assert_int_equal(expert_stage_name(name, sizeof name, r, 2), 8);
    assert_string_equal(name, "gpt.v2.2");

    /* Same definition again (any formatting): fine, nothing added. */
    m = parse_ok(HDR("gpt.v2") "'stages':[" EMB "," DEC "," LMH "],'description':'a test model',"
                 "'task':{'vocab':32,'context':16,'kind':'bytes'},'batch':0}");
    assert_int_equal(expert_model_register(m, err, sizeof err), 1);
    assert_ptr_equal(expert_model_find("gpt.v2"), r);
    assert_null(expert_model_at(before + 1));
    /* Another definition under the same name: refused, whatever differs. */
    m = parse_ok(HDR("gpt.v2") "'description':'another','task':{'kind':'bytes','context':16,"
                 "'vocab':32},'stages':[" EMB "," DEC "," LMH "]}");
    assert_int_equal(expert_model_register(m, err, sizeof err), -EEXIST);
    assert_string_equal(err, "model 'gpt.v2' is already registered with another definition (its canonical "
                             "description differs); give this one another name");
    assert_ptr_equal(expert_model_find("gpt.v2"), r);
    /* The built-ins: an identical file is fine, another one is refused. */
    char *path = source_path("docs/models/fmnist-mlp.json");
    m = expert_model_load_file(path, err, sizeof err);
    free(path);
    assert_non_null(m);
    assert_int_equal(expert_model_register(m, err, sizeof err), 1);
    assert_ptr_equal(expert_model_find("fmnist-mlp"), expert_model_at(0));
    m = parse_ok(HDR("fmnist-mlp") "'task':{'kind':'classes','inputs':8,'classes':4},'stages':[" LIN ","
                 FFN "," HEAD "]}");
    assert_int_equal(expert_model_register(m, err, sizeof err), -EEXIST);
    assert_non_null(strstr(err, "model 'fmnist-mlp' is built in with another definition"));
    /* An invalid spec (not from the parser) is refused and freed. */
    m = parse_ok(CLS(LIN "," FFN "," HEAD));
    m->n_out = 5;
    assert_int_equal(expert_model_register(m, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "model 'm' is not a valid model"));
    assert_null(expert_model_find("m"));
    assert_int_equal(expert_model_register(NULL, err, sizeof err), -EINVAL);
}

#define THREADS 4
#define PER_THREAD 8

static void *register_many(void *arg)
{
    int t = (int)(intptr_t)arg;
    for (int i = 0; i < PER_THREAD; i++) {
        char q[512], nm[32], err[256];
        /* Every thread registers its own models and one shared name. */
        if (i == PER_THREAD - 1)
            snprintf(nm, sizeof nm, "shared");
        else
            snprintf(nm, sizeof nm, "t%d-m%d", t, i);
        snprintf(q, sizeof q, HDR("%s") "'task':{'kind':'classes','inputs':8,'classes':4},'stages':[" LIN
                 "," FFN "," HEAD "]}", nm);
        char *text = unquote(q);
        struct expert_model_spec *m = expert_model_parse(text, strlen(text), "t", err, sizeof err);
        free(text);
        if (!m || expert_model_register(m, err, sizeof err) < 0)
            return (void *)1;
        const struct expert_model_spec *f = expert_model_find(nm);
        if (!f || strcmp(f->name, nm) != 0 || expert_stage_hash(f, 1) == 0)
            return (void *)1;
        for (int k = 0; expert_model_at(k); k++)
            if (!expert_model_at(k)->name)
                return (void *)1;
    }
    return NULL;
}

static void test_registry_threads(void **state)
{
    (void)state;
    int before = 0;
    while (expert_model_at(before))
        before++;
    pthread_t th[THREADS];
    for (int t = 0; t < THREADS; t++)
        assert_int_equal(pthread_create(&th[t], NULL, register_many, (void *)(intptr_t)t), 0);
    for (int t = 0; t < THREADS; t++) {
        void *rv = NULL;
        assert_int_equal(pthread_join(th[t], &rv), 0);
        assert_null(rv);
    }
    int after = 0;
    while (expert_model_at(after))
        after++;
    assert_int_equal(after - before, THREADS * (PER_THREAD - 1) + 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_builtins_round_trip),
        cmocka_unit_test(test_doc_examples_are_the_builtins),
        cmocka_unit_test(test_formatting_does_not_matter),
        cmocka_unit_test(test_sizes_change_hashes),
        cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_stage_limit),
        cmocka_unit_test(test_files),
        cmocka_unit_test(test_names_and_invalid_specs),
        cmocka_unit_test(test_registry),
        cmocka_unit_test(test_registry_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
