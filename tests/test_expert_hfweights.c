/* A GPT's weights under GPT-2's Hugging Face names (expert/hfweights.h):
 * every stage of tiny-lm loads from a safetensors file exactly what it
 * loads from the flat file of the same weights. The file is written here
 * from this test's own copy of the name table (the specification), with
 * Conv1D weights transposed by hand; also without the "transformer."
 * prefix, without the head (tied to the embedding, as GPT-2 is) and
 * without its bias; and refused with a sentence: a tensor missing, a
 * weight not transposed (the wrong shape), a value not finite, a file that
 * is not safetensors, no file, and a model kind without names. */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "expert/block.h"
#include "expert/hfweights.h"
#include "expert/model.h"
#include "expert/safetensors.h"
#include "test_util.h"

enum { NO_PREFIX = 1, NO_HEAD_W = 2, NO_HEAD_B = 4, DROP_FC2B = 8, QKV_UNTRANSPOSED = 16, NAN_IN_LNF = 32 };

static const struct {
    const char *ours, *theirs;
    int transposed;
} layer_spec[12] = {
    {"ln1_w", "ln_1.weight", 0},         {"ln1_b", "ln_1.bias", 0},
    {"qkv_w", "attn.c_attn.weight", 1},  {"qkv_b", "attn.c_attn.bias", 0},
    {"proj_w", "attn.c_proj.weight", 1}, {"proj_b", "attn.c_proj.bias", 0},
    {"ln2_w", "ln_2.weight", 0},         {"ln2_b", "ln_2.bias", 0},
    {"fc1_w", "mlp.c_fc.weight", 1},     {"fc1_b", "mlp.c_fc.bias", 0},
    {"fc2_w", "mlp.c_proj.weight", 1},   {"fc2_b", "mlp.c_proj.bias", 0},
};

static char dir[256];

/* The model's flat parameters: stage after stage. */
static float *flat_params(const struct expert_model_spec *m, size_t *total)
{
    size_t n = 0;
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config c;
        size_t k = 0;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        expert_model_stage(m, s, &c);
        expert_block_config_tensors(&c, t, &k);
        n += k;
    }
    float *p = malloc(n * sizeof *p);
    assert_non_null(p);
    uint64_t r = 12345;
    for (size_t i = 0; i < n; i++) {
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        p[i] = (float)((double)(r >> 40) / (double)(1ULL << 24) - 0.5);
    }
    *total = n;
    return p;
}

/* Writes the whole model's weights p under GPT-2's names (with the
 * variations in flags) to path. */
static void write_gpt2(const char *path, const struct expert_model_spec *m, const float *p, int flags)
{
    static expert_st_out out[EXPERT_BLOCK_MAX_TENSORS * 4];
    static char names[EXPERT_BLOCK_MAX_TENSORS * 4][96];
    static float *bufs[EXPERT_BLOCK_MAX_TENSORS * 4];
    int n = 0, layer = 0;
    size_t base = 0;
    const char *pre = flags & NO_PREFIX ? "" : "transformer.";
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config c;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        size_t total = 0;
        expert_model_stage(m, s, &c);
        int k = expert_block_config_tensors(&c, t, &total), first = c.kind == EXPERT_BLOCK_EMBED ? 2 : 0;
        for (int i = 0; i < k; i++) {
            const float *src = p + base + t[i].offset;
            int tr = 0;
            char *nm = names[n];
            if (!strcmp(t[i].name, "tok_emb"))
                snprintf(nm, 96, "%swte.weight", pre);
            else if (!strcmp(t[i].name, "pos_emb"))
                snprintf(nm, 96, "%swpe.weight", pre);
            else if (!strcmp(t[i].name, "lnf_w"))
                snprintf(nm, 96, "%sln_f.weight", pre);
            else if (!strcmp(t[i].name, "lnf_b"))
                snprintf(nm, 96, "%sln_f.bias", pre);
            else if (!strcmp(t[i].name, "head_w"))
                snprintf(nm, 96, "lm_head.weight");
            else if (!strcmp(t[i].name, "head_b"))
                snprintf(nm, 96, "lm_head.bias");
            else {
                int j = (i - first) % 12;
                assert_string_equal(t[i].name, layer_spec[j].ours);
                snprintf(nm, 96, "%sh.%d.%s", pre, layer + (i - first) / 12, layer_spec[j].theirs);
                tr = layer_spec[j].transposed && !(flags & QKV_UNTRANSPOSED && j == 2);
            }
            if ((flags & NO_HEAD_W && !strcmp(nm, "lm_head.weight")) ||
                (flags & NO_HEAD_B && !strcmp(nm, "lm_head.bias")) ||
                (flags & DROP_FC2B && strstr(nm, "h.1.mlp.c_proj.bias")))
                continue;
            float *d = malloc(t[i].count * sizeof *d);
            assert_non_null(d);
            if (tr) /* Conv1D: [in][out] */
                for (int a = 0; a < t[i].rows; a++)
                    for (int b = 0; b < t[i].cols; b++)
                        d[(size_t)b * (size_t)t[i].rows + (size_t)a] = src[(size_t)a * (size_t)t[i].cols + (size_t)b];
            else
                memcpy(d, src, t[i].count * sizeof *d);
            if (flags & NAN_IN_LNF && !strcmp(t[i].name, "lnf_w"))
                d[1] = NAN;
            expert_st_out *o = &out[n];
            o->name = nm;
            o->data = d;
            bufs[n] = d;
            if (t[i].cols == 1) {
                o->ndim = 1;
                o->shape[0] = (uint64_t)t[i].rows;
            } else {
                o->ndim = 2;
                o->shape[0] = (uint64_t)(tr ? t[i].cols : t[i].rows);
                o->shape[1] = (uint64_t)(tr ? t[i].rows : t[i].cols);
            }
            n++;
        }
        layer += c.layers;
        base += total;
    }
    char err[300];
    const char *meta[] = {"format", "pt"};
    assert_int_equal(expert_st_write(path, out, n, meta, 1, err, sizeof err), 0);
    for (int i = 0; i < n; i++)
        free(bufs[i]);
}

/* Stage s's part of p, loaded from the safetensors file at path: 0 with its
 * parameters in got (and the note), or the loader's error. */
static int load(const struct expert_model_spec *m, int s, const char *path, float *got, char *msg, size_t msglen,
                char *note, size_t notelen)
{
    struct expert_block_config c;
    expert_model_stage(m, s, &c);
    expert_block *b = expert_block_create(&c, 3);
    assert_non_null(b);
    int rc = expert_block_load_safetensors(b, m, s, path, msg, msglen, note, notelen);
    if (rc == 0)
        assert_int_equal(expert_block_read_params(b, got, NULL), 0);
    expert_block_destroy(&b);
    return rc;
}

static void test_names(void **state)
{
    (void)state;
    const struct expert_model_spec *m = expert_model_find("tiny-lm");
    assert_non_null(m);
    char name[EXPERT_HF_NAME_MAX];
    int tr = -1;
    assert_int_equal(expert_hf_name(m, 0, 0, name, sizeof name, &tr), 0);
    assert_string_equal(name, "transformer.wte.weight");
    assert_int_equal(tr, 0);
    /* The second stage's first layer is numbered after the first stage's. */
    struct expert_block_config c0;
    expert_model_stage(m, 0, &c0);
    char want[64];
    snprintf(want, sizeof want, "transformer.h.%d.ln_1.weight", c0.layers);
    assert_int_equal(expert_hf_name(m, 1, 0, name, sizeof name, &tr), 0);
    assert_string_equal(name, want);
    assert_int_equal(expert_hf_name(m, 1, 2, name, sizeof name, &tr), 0);
    assert_true(strstr(name, "attn.c_attn.weight") && tr == 1);
    assert_int_equal(expert_hf_name(m, 1, 9999, name, sizeof name, &tr), -EINVAL);
    assert_int_equal(expert_hf_name(m, m->n_stages, 0, name, sizeof name, &tr), -EINVAL);
    assert_int_equal(expert_hf_name(expert_model_find("fmnist-mlp"), 0, 0, name, sizeof name, &tr), -ENOENT);
}

static void test_same_as_flat(void **state)
{
    (void)state;
    const struct expert_model_spec *m = expert_model_find("tiny-lm");
    size_t total = 0;
    float *p = flat_params(m, &total);
    char flat[300], st[300], msg[400], note[600];
    snprintf(flat, sizeof flat, "%s/init.bin", dir);
    snprintf(st, sizeof st, "%s/model.safetensors", dir);
    FILE *f = fopen(flat, "wb");
    assert_int_equal(fwrite(p, sizeof *p, total, f), total);
    fclose(f);
    float *got = malloc(total * sizeof *got), *ref = malloc(total * sizeof *ref);
    assert_true(got && ref);
    for (int variant = 0; variant < 2; variant++) {
        write_gpt2(st, m, p, variant ? NO_PREFIX : 0);
        size_t off = 0;
        for (int s = 0; s < m->n_stages; s++) {
            struct expert_block_config c;
            expert_model_stage(m, s, &c);
            expert_block *b = expert_block_create(&c, 3);
            assert_int_equal(expert_block_load_flat(b, m, s, flat, msg, sizeof msg), 0);
            size_t n = expert_block_nparams(b);
            assert_int_equal(expert_block_read_params(b, ref, NULL), 0);
            expert_block_destroy(&b);
            assert_int_equal(load(m, s, st, got, msg, sizeof msg, note, sizeof note), 0);
            assert_string_equal(note, "");
            assert_memory_equal(got, ref, n * sizeof *got);
            assert_memory_equal(got, p + off, n * sizeof *got);
            off += n;
        }
        assert_int_equal(off, total);
    }
    free(got);
    free(ref);
    free(p);
}

/* GPT-2's own files: the head tied to the embedding, no head bias. */
static void test_tied_head(void **state)
{
    (void)state;
    const struct expert_model_spec *m = expert_model_find("tiny-lm");
    size_t total = 0;
    float *p = flat_params(m, &total);
    char st[300], msg[400], note[600];
    snprintf(st, sizeof st, "%s/tied.safetensors", dir);
    write_gpt2(st, m, p, NO_HEAD_W | NO_HEAD_B);
    int last = m->n_stages - 1;
    struct expert_block_config c, c0;
    struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
    expert_model_stage(m, last, &c);
    expert_model_stage(m, 0, &c0);
    int k = expert_block_config_tensors(&c, t, NULL);
    float *got = malloc(total * sizeof *got);
    assert_int_equal(load(m, last, st, got, msg, sizeof msg, note, sizeof note), 0);
    assert_non_null(strstr(note, "no lm_head.weight"));
    assert_non_null(strstr(note, "no lm_head.bias"));
    const struct expert_tensor_info *hw = &t[k - 2], *hb = &t[k - 1];
    assert_string_equal(hw->name, "head_w");
    assert_memory_equal(got + hw->offset, p, hw->count * sizeof *got); /* = tok_emb, stage 0's first tensor */
    for (size_t i = 0; i < hb->count; i++)
        assert_true(got[hb->offset + i] == 0.0f);
    free(got);
    free(p);
}

static void test_refused(void **state)
{
    (void)state;
    const struct expert_model_spec *m = expert_model_find("tiny-lm");
    size_t total = 0;
    float *p = flat_params(m, &total), *got = malloc(total * sizeof *got);
    char st[300], msg[400], note[600];
    int last = m->n_stages - 1;
    snprintf(st, sizeof st, "%s/bad.safetensors", dir);
    /* A layer's tensor missing: named. */
    write_gpt2(st, m, p, DROP_FC2B);
    struct expert_block_config c0;
    expert_model_stage(m, 0, &c0);
    int stage_of_layer1 = c0.layers > 1 ? 0 : 1;
    assert_int_equal(load(m, stage_of_layer1, st, got, msg, sizeof msg, note, sizeof note), -ENOENT);
    assert_non_null(strstr(msg, "has no tensor transformer.h.1.mlp.c_proj.bias"));
    /* c_attn stored as the block holds it, not as Conv1D: the wrong shape. */
    write_gpt2(st, m, p, QKV_UNTRANSPOSED);
    assert_int_equal(load(m, 1, st, got, msg, sizeof msg, note, sizeof note), -EBADMSG);
    assert_non_null(strstr(msg, "attn.c_attn.weight"));
    assert_non_null(strstr(msg, "needs"));
    /* A NaN. */
    write_gpt2(st, m, p, NAN_IN_LNF);
    assert_int_equal(load(m, last, st, got, msg, sizeof msg, note, sizeof note), -EBADMSG);
    assert_non_null(strstr(msg, "not finite"));
    /* Not a safetensors file; no file. */
    FILE *f = fopen(st, "wb");
    fputs("not weights at all", f);
    fclose(f);
    assert_int_equal(load(m, 0, st, got, msg, sizeof msg, note, sizeof note), -EBADMSG);
    assert_non_null(strstr(msg, st));
    snprintf(st, sizeof st, "%s/absent.safetensors", dir);
    assert_int_equal(load(m, 0, st, got, msg, sizeof msg, note, sizeof note), -ENOENT);
    /* An MLP block has no Hugging Face names. */
    const struct expert_model_spec *mlp = expert_model_find("fmnist-mlp");
    assert_int_equal(load(mlp, 0, st, got, msg, sizeof msg, note, sizeof note), -EINVAL);
    assert_non_null(strstr(msg, "no Hugging Face names"));
    free(got);
    free(p);
}

/* The writer gives the bytes this test's own table gives, and a GPT2Config
 * of the model's sizes. */
static void test_write(void **state)
{
    (void)state;
    const struct expert_model_spec *m = expert_model_find("tiny-lm");
    size_t total = 0;
    float *p = flat_params(m, &total);
    const float *per[64];
    size_t off = 0;
    int layers = 0;
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config c;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        size_t k = 0;
        expert_model_stage(m, s, &c);
        expert_block_config_tensors(&c, t, &k);
        per[s] = p + off;
        off += k;
        layers += c.layers;
    }
    char a[300], b[300], msg[300];
    snprintf(a, sizeof a, "%s/ours.safetensors", dir);
    snprintf(b, sizeof b, "%s/theirs.safetensors", dir);
    const char *meta[] = {"format", "pt"};
    assert_int_equal(expert_hf_write(m, per, a, meta, 1, msg, sizeof msg), 0);
    write_gpt2(b, m, p, 0);
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    assert_true(fa && fb);
    int ca, cb;
    long at = 0;
    do {
        ca = fgetc(fa);
        cb = fgetc(fb);
        if (ca != cb)
            fail_msg("the files differ at byte %ld", at);
        at++;
    } while (ca != EOF);
    fclose(fa);
    fclose(fb);
    char *cfg = expert_hf_config_json(m);
    assert_non_null(cfg);
    char want[64];
    snprintf(want, sizeof want, "\"n_layer\": %d", layers);
    assert_non_null(strstr(cfg, want));
    assert_non_null(strstr(cfg, "\"GPT2LMHeadModel\""));
    assert_non_null(strstr(cfg, "\"activation_function\": \"gelu\""));
    free(cfg);
    assert_null(expert_hf_config_json(expert_model_find("fmnist-mlp")));
    assert_int_equal(expert_hf_write(expert_model_find("fmnist-mlp"), per, a, NULL, 0, msg, sizeof msg), -EINVAL);
    free(p);
}

static int setup(void **state)
{
    (void)state;
    test_tmpdir(dir, sizeof dir, "hfweights");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    test_rmtree(dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_same_as_flat),
        cmocka_unit_test(test_tied_head),
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_write),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
