/* expert/modelfile.c: model files (JSON) to specs and back (docs/models.md). */
#include "expert/modelfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#define MAX_BATCH_ROWS (1 << 20) /* "batch": rows per optimizer step */
#define MAX_JOIN_ROWS (1 << 16)  /* "max_batch": a peer's --max-batch range */

/* ------------------------------------------------------------- errors -- */

struct ctx {
    const char *label;
    char *err;
    size_t errlen;
    int failed;
};

/* Copies s into out (cap bytes) for an error message: at most max bytes,
 * control characters as '?', and when quoted single quotes (s goes between
 * single quotes) else bytes over 0x7f (jansson's "near" text may hold part
 * of a bad UTF-8 sequence) too; "..." when cut. */
static void safe_text_q(char *out, size_t cap, const char *s, size_t max, int quoted)
{
    size_t n = 0, i = 0;
    for (; s[i] && i < max && n + 4 < cap; i++) {
        unsigned char ch = (unsigned char)s[i];
        out[n++] = (ch < 0x20 || ch == 0x7f || (quoted ? ch == '\'' : ch > 0x7f)) ? '?' : (char)ch;
    }
    if (s[i] && n + 4 < cap) {
        memcpy(out + n, "...", 3);
        n += 3;
    }
    out[n] = '\0';
}

static void safe_text(char *out, size_t cap, const char *s, size_t max)
{
    safe_text_q(out, cap, s, max, 1);
}

/* "LABEL: PATH: message" (just "LABEL: message" when path is NULL). Only the
 * first failure is kept. */
__attribute__((format(printf, 3, 4)))
static void fail(struct ctx *c, const char *path, const char *fmt, ...)
{
    if (c->failed)
        return;
    c->failed = 1;
    if (!c->err || c->errlen == 0)
        return;
    int n = path ? snprintf(c->err, c->errlen, "%s: %s: ", c->label, path)
                 : snprintf(c->err, c->errlen, "%s: ", c->label);
    if (n < 0 || (size_t)n >= c->errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err + n, c->errlen - (size_t)n, fmt, ap);
    va_end(ap);
}

static const char *type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number with a fraction or exponent";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "something else";
}

/* ---------------------------------------------------------- key sets -- */

static int in_list(const char *key, const char *const *known)
{
    for (int i = 0; known[i]; i++)
        if (strcmp(key, known[i]) == 0)
            return 1;
    return 0;
}

/* Fails on the first key of obj that is not in known (NULL-terminated). */
static int check_keys(struct ctx *c, const json_t *obj, const char *path, const char *what,
                      const char *const *known)
{
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)obj, key, v) {
        if (in_list(key, known))
            continue;
        char list[256] = "", kp[160], sk[48];
        for (int i = 0; known[i]; i++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", known[i]);
        safe_text(sk, sizeof sk, key, 32);
        if (path)
            snprintf(kp, sizeof kp, "%s.%s", path, sk);
        else
            snprintf(kp, sizeof kp, "%s", sk);
        fail(c, kp, "unknown key (known%s%s: %s)", what ? " for " : "", what ? what : "", list);
        return -1;
    }
    return 0;
}

static void key_path(char *out, size_t cap, const char *path, const char *key)
{
    if (path)
        snprintf(out, cap, "%s.%s", path, key);
    else
        snprintf(out, cap, "%s", key);
}

/* obj[key] as an int in [lo, hi] into *out; when absent, dflt if !required. */
static int get_int(struct ctx *c, const json_t *obj, const char *path, const char *key, int required,
                   long lo, long hi, int dflt, int *out)
{
    char kp[160];
    key_path(kp, sizeof kp, path, key);
    const json_t *v = json_object_get(obj, key);
    if (!v) {
        if (required) {
            fail(c, kp, "missing (an integer from %ld to %ld)", lo, hi);
            return -1;
        }
        *out = dflt;
        return 0;
    }
    if (!json_is_integer(v)) {
        if (json_is_real(v))
            fail(c, kp, "expected an integer from %ld to %ld, got %g", lo, hi, json_real_value(v));
        else
            fail(c, kp, "expected an integer from %ld to %ld, got %s", lo, hi, type_name(v));
        return -1;
    }
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi) {
        fail(c, kp, "must be from %ld to %ld, got %lld", lo, hi, (long long)x);
        return -1;
    }
    *out = (int)x;
    return 0;
}

/* obj[key] as a string; NULL (and *present = 0) when absent. */
static const char *get_str(struct ctx *c, const json_t *obj, const char *path, const char *key,
                           int required, const char *what)
{
    char kp[160];
    key_path(kp, sizeof kp, path, key);
    const json_t *v = json_object_get(obj, key);
    if (!v) {
        if (required)
            fail(c, kp, "missing (%s)", what);
        return NULL;
    }
    if (!json_is_string(v)) {
        fail(c, kp, "expected %s, got %s", what, type_name(v));
        return NULL;
    }
    return json_string_value(v);
}

/* -------------------------------------------------------------- names -- */

int expert_model_name_check(const char *name)
{
    if (!name)
        return -EINVAL;
    size_t n = strlen(name);
    if (n < 1 || n > EXPERT_MODEL_NAME_MAX)
        return -EINVAL;
    for (size_t i = 0; i < n; i++) {
        char ch = name[i];
        int alnum = (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9');
        if (!alnum && (i == 0 || (ch != '.' && ch != '_' && ch != '-')))
            return -EINVAL;
    }
    if (name[n - 1] == '.')
        return -EINVAL;
    /* "x.12" would read as stage 12 of model "x". */
    const char *dot = strrchr(name, '.');
    if (dot && strspn(dot + 1, "0123456789") == strlen(dot + 1))
        return -EINVAL;
    return 0;
}

/* -------------------------------------------------------------- parse -- */

static const char *const top_keys[] = { "format", "name", "description", "task", "batch",
                                        "max_batch", "stages", NULL };
static const char *const classes_keys[] = { "kind", "inputs", "classes", NULL };
static const char *const bytes_keys[] = { "kind", "context", "vocab", NULL };
static const char *const io_keys[] = { "kind", "in", "out", "repeat", NULL };
static const char *const resffn_keys[] = { "kind", "dim", "hidden", "repeat", NULL };
static const char *const seq_keys[] = { "kind", "dim", "heads", "hidden", "layers", "repeat", NULL };

static void known_kinds(char *out, size_t cap)
{
    out[0] = '\0';
    for (int k = 1; expert_block_kind_name(k); k++)
        snprintf(out + strlen(out), cap - strlen(out), "%s%s", k > 1 ? ", " : "",
                 expert_block_kind_name(k));
}

/* The task object into m. */
static int parse_task(struct ctx *c, const json_t *t, struct expert_model_spec *m)
{
    if (!t) {
        fail(c, "task", "missing (an object: {\"kind\": \"classes\" or \"bytes\", ...})");
        return -1;
    }
    if (!json_is_object(t)) {
        fail(c, "task", "expected an object, got %s", type_name(t));
        return -1;
    }
    const char *kind = get_str(c, t, "task", "kind", 1, "a string: classes or bytes");
    if (!kind)
        return -1;
    if (strcmp(kind, "classes") == 0) {
        if (check_keys(c, t, "task", "classes", classes_keys) < 0 ||
            get_int(c, t, "task", "inputs", 1, 1, EXPERT_BLOCK_MAX_DIM, 0, &m->n_in) < 0 ||
            get_int(c, t, "task", "classes", 1, 2, EXPERT_BLOCK_MAX_DIM, 0, &m->n_out) < 0)
            return -1;
        m->task = EXPERT_TASK_CLASSES;
        m->seq = m->vocab = 0;
        return 0;
    }
    if (strcmp(kind, "bytes") == 0) {
        if (check_keys(c, t, "task", "bytes", bytes_keys) < 0 ||
            get_int(c, t, "task", "context", 1, 1, EXPERT_BLOCK_MAX_SEQ, 0, &m->seq) < 0 ||
            get_int(c, t, "task", "vocab", 1, 2, EXPERT_BLOCK_MAX_VOCAB, 0, &m->vocab) < 0)
            return -1;
        if ((long)m->seq * m->vocab > EXPERT_BLOCK_MAX_ROW) {
            fail(c, "task.vocab", "context*vocab = %ld logits per row is over the limit of %d",
                 (long)m->seq * m->vocab, EXPERT_BLOCK_MAX_ROW);
            return -1;
        }
        m->task = EXPERT_TASK_BYTES;
        m->n_in = m->seq;
        m->n_out = m->seq * m->vocab;
        return 0;
    }
    char sk[48];
    safe_text(sk, sizeof sk, kind, 32);
    fail(c, "task.kind", "unknown task '%s' (known: classes, bytes)", sk);
    return -1;
}

/* Every size may be in range and their product still be more than any
 * peer holds: a stage's parameters at most MAX_STAGE_PARAMS floats (4 GiB),
 * and what one row keeps for its backward (a transformer stage: every
 * layer's activations, attention maps included) at most MAX_ROW_KEPT. */
#define MAX_STAGE_PARAMS ((size_t)1 << 30)
#define MAX_ROW_KEPT ((double)(1 << 28))
static int check_stage_size(struct ctx *c, const char *path, const struct expert_block_config *cfg)
{
    struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
    size_t n = 0;
    expert_block_config_tensors(cfg, t, &n);
    if (n > MAX_STAGE_PARAMS) {
        fail(c, path, "%zu parameters: over the %zu a stage may have (4 GiB)", n, MAX_STAGE_PARAMS);
        return -1;
    }
    double T = cfg->seq, kept = 0;
    if (expert_block_kind_is_seq(cfg->kind))
        kept = cfg->layers * T * (8.0 * cfg->dim + 2.0 * cfg->hidden + (double)cfg->heads * T + 4);
    if (kept > MAX_ROW_KEPT) {
        fail(c, path, "one sequence keeps %.0f activations for its backward (layers x context x "
             "(8 dim + 2 hidden + heads x context)): over the limit of %.0f", kept, MAX_ROW_KEPT);
        return -1;
    }
    return 0;
}

/* One stage object (stages[i]) into *cfg; *repeat = its "repeat". */
static int parse_stage(struct ctx *c, const json_t *s, int i, const struct expert_model_spec *m,
                       struct expert_block_config *cfg, int *repeat)
{
    char path[32], kp[64];
    snprintf(path, sizeof path, "stages[%d]", i);
    if (!json_is_object(s)) {
        fail(c, path, "expected an object, got %s", type_name(s));
        return -1;
    }
    char kinds[128];
    known_kinds(kinds, sizeof kinds);
    char what[160];
    snprintf(what, sizeof what, "a block kind: %s", kinds);
    const char *kname = get_str(c, s, path, "kind", 1, what);
    if (!kname)
        return -1;
    int kind = expert_block_kind_from_name(kname);
    snprintf(kp, sizeof kp, "%s.kind", path);
    if (!kind) {
        char sk[48];
        safe_text(sk, sizeof sk, kname, 32);
        fail(c, kp, "unknown block kind '%s' (known: %s)", sk, kinds);
        return -1;
    }
    int seq = expert_block_kind_is_seq(kind);
    if (seq != (m->task == EXPERT_TASK_BYTES)) {
        fail(c, kp, "a %s stage needs a task of kind %s", kname, seq ? "bytes" : "classes");
        return -1;
    }
    memset(cfg, 0, sizeof *cfg);
    cfg->kind = kind;
    const int D = EXPERT_BLOCK_MAX_DIM;
    switch (kind) {
    case EXPERT_BLOCK_LINEAR:
    case EXPERT_BLOCK_HEAD:
        if (check_keys(c, s, path, kname, io_keys) < 0 ||
            get_int(c, s, path, "in", 1, 1, D, 0, &cfg->in) < 0 ||
            get_int(c, s, path, "out", 1, 1, D, 0, &cfg->out) < 0)
            return -1;
        break;
    case EXPERT_BLOCK_RESFFN:
        if (check_keys(c, s, path, kname, resffn_keys) < 0 ||
            get_int(c, s, path, "dim", 1, 1, D, 0, &cfg->in) < 0 ||
            get_int(c, s, path, "hidden", 1, 1, D, 0, &cfg->hidden) < 0)
            return -1;
        cfg->out = cfg->in;
        break;
    default: {
        int min_layers = kind == EXPERT_BLOCK_DECODER ? 1 : 0;
        if (check_keys(c, s, path, kname, seq_keys) < 0 ||
            get_int(c, s, path, "dim", 1, 1, D, 0, &cfg->dim) < 0 ||
            get_int(c, s, path, "heads", 1, 1, D, 0, &cfg->heads) < 0 ||
            get_int(c, s, path, "hidden", 1, 1, D, 0, &cfg->hidden) < 0 ||
            get_int(c, s, path, "layers", 0, min_layers, EXPERT_BLOCK_MAX_LAYERS, min_layers,
                    &cfg->layers) < 0)
            return -1;
        if (cfg->dim % cfg->heads != 0) {
            snprintf(kp, sizeof kp, "%s.heads", path);
            fail(c, kp, "%d does not divide dim %d", cfg->heads, cfg->dim);
            return -1;
        }
        cfg->seq = m->seq;
        cfg->vocab = kind == EXPERT_BLOCK_DECODER ? 0 : m->vocab;
        long row = (long)m->seq * cfg->dim;
        if (row > EXPERT_BLOCK_MAX_ROW) {
            snprintf(kp, sizeof kp, "%s.dim", path);
            fail(c, kp, "context*dim = %ld values per row is over the limit of %d", row,
                 EXPERT_BLOCK_MAX_ROW);
            return -1;
        }
        cfg->in = kind == EXPERT_BLOCK_EMBED ? m->seq : (int)row;
        cfg->out = kind == EXPERT_BLOCK_LMHEAD ? m->seq * m->vocab : (int)row;
        break;
    }
    }
    if (get_int(c, s, path, "repeat", 0, 1, EXPERT_MODEL_MAX_STAGES, 1, repeat) < 0)
        return -1;
    if (expert_block_config_check(cfg) < 0) { /* every rule above should have caught it */
        fail(c, path, "not a valid %s block", kname);
        return -1;
    }
    return check_stage_size(c, path, cfg);
}

/* The key that sets a stage's input (or output) width, for messages. */
static const char *width_key(int kind, int output)
{
    switch (kind) {
    case EXPERT_BLOCK_LINEAR:
    case EXPERT_BLOCK_HEAD: return output ? "out" : "in";
    case EXPERT_BLOCK_EMBED: return output ? "dim" : "kind";
    case EXPERT_BLOCK_LMHEAD: return output ? "kind" : "dim";
    default: return "dim";
    }
}

static const char *width_how(int kind, int output)
{
    if (!expert_block_kind_is_seq(kind))
        return "";
    if (!output)
        return kind == EXPERT_BLOCK_EMBED ? " (embed takes context token ids)" : " (context*dim)";
    return kind == EXPERT_BLOCK_LMHEAD ? " (context*vocab)" : " (context*dim)";
}

/* The stages array into m->stages (allocated). */
static int parse_stages(struct ctx *c, const json_t *arr, struct expert_model_spec *m)
{
    if (!arr) {
        fail(c, "stages", "missing (an array of stage objects)");
        return -1;
    }
    if (!json_is_array(arr)) {
        fail(c, "stages", "expected an array of stage objects, got %s", type_name(arr));
        return -1;
    }
    size_t n = json_array_size(arr);
    if (n == 0) {
        fail(c, "stages", "empty: a model needs at least one stage");
        return -1;
    }
    if (n > EXPERT_MODEL_MAX_STAGES) {
        fail(c, "stages", "%zu stages, over the limit of %d", n, EXPERT_MODEL_MAX_STAGES);
        return -1;
    }
    struct expert_block_config *st = calloc(EXPERT_MODEL_MAX_STAGES, sizeof *st);
    if (!st) {
        fail(c, NULL, "out of memory");
        return -1;
    }
    int ns = 0;
    const char *task_in = m->task == EXPERT_TASK_BYTES ? "task.context" : "task.inputs";
    const char *task_out = m->task == EXPERT_TASK_BYTES ? "context*vocab" : "task.classes";
    for (size_t i = 0; i < n; i++) {
        struct expert_block_config cfg;
        int repeat = 1;
        char kp[64];
        if (parse_stage(c, json_array_get(arr, i), (int)i, m, &cfg, &repeat) < 0)
            goto bad;
        if (ns + repeat > EXPERT_MODEL_MAX_STAGES) {
            snprintf(kp, sizeof kp, "stages[%zu].repeat", i);
            fail(c, kp, "makes more than %d stages, the limit", EXPERT_MODEL_MAX_STAGES);
            goto bad;
        }
        snprintf(kp, sizeof kp, "stages[%zu].%s", i, width_key(cfg.kind, 0));
        if (ns == 0 && cfg.in != m->n_in) {
            fail(c, kp, "the first stage takes %d values per row%s, but the task's input is %d (%s)",
                 cfg.in, width_how(cfg.kind, 0), m->n_in, task_in);
            goto bad;
        }
        if (ns > 0 && cfg.in != st[ns - 1].out) {
            fail(c, kp, "takes %d values per row%s, but stages[%zu] gives %d", cfg.in,
                 width_how(cfg.kind, 0), i - 1, st[ns - 1].out);
            goto bad;
        }
        if (repeat > 1 && cfg.in != cfg.out) {
            snprintf(kp, sizeof kp, "stages[%zu].repeat", i);
            fail(c, kp, "a %s stage that takes %d values and gives %d cannot follow itself",
                 expert_block_kind_name(cfg.kind), cfg.in, cfg.out);
            goto bad;
        }
        for (int r = 0; r < repeat; r++)
            st[ns++] = cfg;
    }
    const struct expert_block_config *last = &st[ns - 1];
    if (last->out != m->n_out) {
        char kp[64];
        snprintf(kp, sizeof kp, "stages[%zu].%s", n - 1, width_key(last->kind, 1));
        fail(c, kp, "the last stage gives %d values per row%s, but the task's output is %d (%s)",
             last->out, width_how(last->kind, 1), m->n_out, task_out);
        goto bad;
    }
    m->stages = st;
    m->n_stages = ns;
    return 0;
bad:
    free(st);
    return -1;
}

static int check_text(struct ctx *c, const char *path, const char *s, size_t max)
{
    size_t n = strlen(s);
    if (n > max) {
        fail(c, path, "%zu bytes, over the limit of %zu", n, max);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch < 0x20 || ch == 0x7f) {
            fail(c, path, "contains a control character (byte %zu)", i);
            return -1;
        }
    }
    return 0;
}

static struct expert_model_spec *parse_root(struct ctx *c, const json_t *root)
{
    if (!json_is_object(root)) {
        fail(c, NULL, "the top level must be an object, not %s", type_name(root));
        return NULL;
    }
    if (check_keys(c, root, NULL, NULL, top_keys) < 0)
        return NULL;
    const char *format = get_str(c, root, NULL, "format", 1, "a string: \"" EXPERT_MODELFILE_FORMAT "\"");
    if (!format)
        return NULL;
    if (strcmp(format, EXPERT_MODELFILE_FORMAT) != 0) {
        char sk[48];
        safe_text(sk, sizeof sk, format, 32);
        fail(c, "format", "'%s' is not %s, the only format this build reads", sk,
             EXPERT_MODELFILE_FORMAT);
        return NULL;
    }
    const char *name = get_str(c, root, NULL, "name", 1, "a string: the model's name");
    if (!name)
        return NULL;
    if (expert_model_name_check(name) < 0) {
        char sk[64];
        safe_text(sk, sizeof sk, name, 52);
        fail(c, "name", "'%s' is not a model name (1 to %d of a-z 0-9 . _ -, starting with a "
             "letter or digit, not ending in '.' or in '.' and digits)", sk, EXPERT_MODEL_NAME_MAX);
        return NULL;
    }
    const char *desc = "";
    if (json_object_get(root, "description")) {
        desc = get_str(c, root, NULL, "description", 0, "a string");
        if (!desc || check_text(c, "description", desc, EXPERT_MODEL_DESC_MAX) < 0)
            return NULL;
    }
    struct expert_model_spec m;
    memset(&m, 0, sizeof m);
    if (parse_task(c, json_object_get(root, "task"), &m) < 0 ||
        get_int(c, root, NULL, "batch", 0, 0, MAX_BATCH_ROWS, 0, &m.batch) < 0 ||
        get_int(c, root, NULL, "max_batch", 0, 0, MAX_JOIN_ROWS, 0, &m.max_batch) < 0 ||
        parse_stages(c, json_object_get(root, "stages"), &m) < 0)
        return NULL;
    struct expert_model_spec *out = calloc(1, sizeof *out);
    char *nm = strdup(name), *ds = strdup(desc);
    if (!out || !nm || !ds) {
        free(out);
        free(nm);
        free(ds);
        free((void *)m.stages);
        fail(c, NULL, "out of memory");
        return NULL;
    }
    *out = m;
    out->name = nm;
    out->desc = ds;
    return out;
}

struct expert_model_spec *expert_model_parse(const char *text, size_t len, const char *label,
                                             char *err, size_t errlen)
{
    struct ctx c = { label ? label : "model", err, errlen, 0 };
    if (err && errlen)
        err[0] = '\0';
    if (!text) {
        fail(&c, NULL, "no text");
        return NULL;
    }
    if (len > EXPERT_MODELFILE_MAX_BYTES) {
        fail(&c, NULL, "%zu bytes, over the limit of %d for a model description", len,
             EXPERT_MODELFILE_MAX_BYTES);
        return NULL;
    }
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root) {
        char msg[200];
        safe_text_q(msg, sizeof msg, je.text, 160, 0);
        fail(&c, NULL, "line %d, column %d: not valid JSON: %s", je.line, je.column, msg);
        return NULL;
    }
    struct expert_model_spec *m = parse_root(&c, root);
    json_decref(root);
    return m;
}

struct expert_model_spec *expert_model_load_file(const char *path, char *err, size_t errlen)
{
    struct ctx c = { path ? path : "model", err, errlen, 0 };
    if (err && errlen)
        err[0] = '\0';
    if (!path) {
        fail(&c, NULL, "no file name");
        return NULL;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fail(&c, NULL, "cannot open: %s", strerror(errno));
        return NULL;
    }
    size_t cap = EXPERT_MODELFILE_MAX_BYTES + 1, len = 0;
    char *buf = malloc(cap);
    if (!buf) {
        close(fd);
        fail(&c, NULL, "out of memory");
        return NULL;
    }
    while (len < cap) {
        ssize_t r = read(fd, buf + len, cap - len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int e = errno;
            close(fd);
            free(buf);
            fail(&c, NULL, "cannot read: %s", strerror(e));
            return NULL;
        }
        if (r == 0)
            break;
        len += (size_t)r;
    }
    close(fd);
    if (len > EXPERT_MODELFILE_MAX_BYTES) {
        free(buf);
        fail(&c, NULL, "larger than %d bytes, the limit of a model file", EXPERT_MODELFILE_MAX_BYTES);
        return NULL;
    }
    struct expert_model_spec *m = expert_model_parse(buf, len, path, err, errlen);
    free(buf);
    return m;
}

void expert_model_free(struct expert_model_spec *m)
{
    if (!m)
        return;
    free((void *)m->name);
    free((void *)m->desc);
    free((void *)m->stages);
    free(m);
}

/* ---------------------------------------------------------- canonical -- */

int expert_model_equal(const struct expert_model_spec *a, const struct expert_model_spec *b)
{
    if (!a || !b || !a->name || !b->name || strcmp(a->name, b->name) != 0)
        return 0;
    if (strcmp(a->desc ? a->desc : "", b->desc ? b->desc : "") != 0)
        return 0;
    if (a->n_stages != b->n_stages || a->n_in != b->n_in || a->n_out != b->n_out ||
        a->task != b->task || a->seq != b->seq || a->vocab != b->vocab || a->batch != b->batch ||
        a->max_batch != b->max_batch)
        return 0;
    if (a->n_stages > 0 && (!a->stages || !b->stages))
        return 0;
    for (int i = 0; i < a->n_stages; i++) {
        const struct expert_block_config *x = &a->stages[i], *y = &b->stages[i];
        if (x->kind != y->kind || x->in != y->in || x->out != y->out || x->hidden != y->hidden ||
            x->dim != y->dim || x->heads != y->heads || x->seq != y->seq || x->layers != y->layers ||
            x->vocab != y->vocab)
            return 0;
    }
    return 1;
}

static int set_int(json_t *o, const char *key, int v)
{
    return json_object_set_new(o, key, json_integer(v));
}

static json_t *stage_json(const struct expert_block_config *cfg)
{
    const char *kname = expert_block_kind_name(cfg->kind);
    json_t *o = json_object();
    if (!kname || !o) {
        json_decref(o);
        return NULL;
    }
    int rc = json_object_set_new(o, "kind", json_string(kname));
    switch (cfg->kind) {
    case EXPERT_BLOCK_LINEAR:
    case EXPERT_BLOCK_HEAD:
        rc |= set_int(o, "in", cfg->in) | set_int(o, "out", cfg->out);
        break;
    case EXPERT_BLOCK_RESFFN:
        rc |= set_int(o, "dim", cfg->in) | set_int(o, "hidden", cfg->hidden);
        break;
    default:
        rc |= set_int(o, "dim", cfg->dim) | set_int(o, "heads", cfg->heads) |
              set_int(o, "hidden", cfg->hidden) | set_int(o, "layers", cfg->layers);
        break;
    }
    if (rc) {
        json_decref(o);
        return NULL;
    }
    return o;
}

static json_t *spec_json(const struct expert_model_spec *m)
{
    json_t *root = json_object(), *task = json_object(), *stages = json_array();
    int rc = !root || !task || !stages;
    if (!rc && m->task == EXPERT_TASK_CLASSES) {
        rc |= json_object_set_new(task, "kind", json_string("classes"));
        rc |= set_int(task, "inputs", m->n_in) | set_int(task, "classes", m->n_out);
    } else if (!rc && m->task == EXPERT_TASK_BYTES) {
        rc |= json_object_set_new(task, "kind", json_string("bytes"));
        rc |= set_int(task, "context", m->seq) | set_int(task, "vocab", m->vocab);
    } else {
        rc = 1;
    }
    for (int i = 0; !rc && i < m->n_stages; i++) {
        json_t *s = stage_json(&m->stages[i]);
        rc |= !s || json_array_append_new(stages, s);
    }
    if (!rc) {
        rc |= json_object_set_new(root, "format", json_string(EXPERT_MODELFILE_FORMAT));
        rc |= json_object_set_new(root, "name", json_string(m->name));
        rc |= json_object_set_new(root, "description", json_string(m->desc ? m->desc : ""));
        rc |= set_int(root, "batch", m->batch) | set_int(root, "max_batch", m->max_batch);
        rc |= json_object_set(root, "task", task) | json_object_set(root, "stages", stages);
    }
    json_decref(task);
    json_decref(stages);
    if (rc) {
        json_decref(root);
        return NULL;
    }
    return root;
}

char *expert_model_to_json(const struct expert_model_spec *m)
{
    if (!m || !m->name || m->n_stages < 1 || m->n_stages > EXPERT_MODEL_MAX_STAGES || !m->stages)
        return NULL;
    json_t *root = spec_json(m);
    if (!root)
        return NULL;
    char *text = json_dumps(root, JSON_SORT_KEYS | JSON_COMPACT);
    json_decref(root);
    if (!text)
        return NULL;
    /* The text must mean m exactly: parse it back (this is the validity check). */
    struct expert_model_spec *back = expert_model_parse(text, strlen(text), "canonical", NULL, 0);
    int same = expert_model_equal(back, m);
    expert_model_free(back);
    if (!same) {
        free(text);
        return NULL;
    }
    return text;
}
