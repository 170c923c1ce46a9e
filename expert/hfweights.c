/* expert/hfweights.c: Hugging Face names of the blocks' tensors, and a
 * stage's weights loaded from a safetensors file under them (see
 * hfweights.h). */
#include "expert/hfweights.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "expert/safetensors.h"

#include <jansson.h>

static int say(char *buf, size_t len, int rc, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static int say(char *buf, size_t len, int rc, const char *fmt, ...)
{
    if (buf && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(buf, len, fmt, ap);
        va_end(ap);
    }
    return rc;
}

static int is_gpt_kind(int kind)
{
    return kind == EXPERT_BLOCK_EMBED || kind == EXPERT_BLOCK_DECODER || kind == EXPERT_BLOCK_LMHEAD;
}

/* Decoder layers in the stages before `index`. */
static int layers_before(const struct expert_model_spec *m, int index)
{
    int n = 0;
    for (int s = 0; s < index; s++) {
        struct expert_block_config c;
        if (expert_model_stage(m, s, &c) == 0 && is_gpt_kind(c.kind))
            n += c.layers;
    }
    return n;
}

/* A decoder layer's tensors, in the blocks' order, and GPT-2's names. */
static const struct {
    const char *ours, *theirs;
    int transposed;
} layer_names[12] = {
    {"ln1_w", "ln_1.weight", 0},         {"ln1_b", "ln_1.bias", 0},
    {"qkv_w", "attn.c_attn.weight", 1},  {"qkv_b", "attn.c_attn.bias", 0},
    {"proj_w", "attn.c_proj.weight", 1}, {"proj_b", "attn.c_proj.bias", 0},
    {"ln2_w", "ln_2.weight", 0},         {"ln2_b", "ln_2.bias", 0},
    {"fc1_w", "mlp.c_fc.weight", 1},     {"fc1_b", "mlp.c_fc.bias", 0},
    {"fc2_w", "mlp.c_proj.weight", 1},   {"fc2_b", "mlp.c_proj.bias", 0},
};

static const struct {
    const char *ours, *theirs;
} other_names[] = {
    {"tok_emb", "transformer.wte.weight"}, {"pos_emb", "transformer.wpe.weight"},
    {"lnf_w", "transformer.ln_f.weight"},  {"lnf_b", "transformer.ln_f.bias"},
    {"head_w", "lm_head.weight"},          {"head_b", "lm_head.bias"},
};

int expert_hf_name(const struct expert_model_spec *m, int index, int ti, char *name, size_t len, int *transposed)
{
    struct expert_block_config c;
    struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
    if (!m || !name || !transposed || expert_model_stage(m, index, &c) != 0)
        return -EINVAL;
    if (!is_gpt_kind(c.kind))
        return -ENOENT;
    int n = expert_block_config_tensors(&c, t, NULL);
    if (n < 0 || ti < 0 || ti >= n)
        return -EINVAL;
    *transposed = 0;
    for (size_t i = 0; i < sizeof other_names / sizeof *other_names; i++)
        if (!strcmp(t[ti].name, other_names[i].ours)) {
            snprintf(name, len, "%s", other_names[i].theirs);
            return 0;
        }
    int first = c.kind == EXPERT_BLOCK_EMBED ? 2 : 0, k = (ti - first) % 12;
    if (ti < first || strcmp(t[ti].name, layer_names[k].ours) != 0)
        return -EINVAL;
    snprintf(name, len, "transformer.h.%d.%s", layers_before(m, index) + (ti - first) / 12, layer_names[k].theirs);
    *transposed = layer_names[k].transposed;
    return 0;
}

/* The entry for name in f: itself, or without "transformer.". */
static const expert_st_tensor *find(const expert_st_file *f, const char *name)
{
    const expert_st_tensor *e = expert_st_find(f, name);
    if (!e && !strncmp(name, "transformer.", 12))
        e = expert_st_find(f, name + 12);
    return e;
}

/* Whether e's shape is the block tensor's [rows, cols] (vectors: [rows]),
 * transposed when stored so. */
static int shape_ok(const expert_st_tensor *e, const struct expert_tensor_info *ti, int transposed)
{
    if (ti->cols == 1)
        return e->ndim == 1 && e->shape[0] == (uint64_t)ti->rows;
    uint64_t r = transposed ? (uint64_t)ti->cols : (uint64_t)ti->rows, c = transposed ? (uint64_t)ti->rows : (uint64_t)ti->cols;
    return e->ndim == 2 && e->shape[0] == r && e->shape[1] == c;
}

/* Tensor ti of stage `index` into dst (ti->count floats) from f. */
static int load_one(expert_st_file *f, const char *path, const struct expert_model_spec *m, int index, int ti,
                    const struct expert_tensor_info *info, float *dst, float *tmp, char *msg, size_t msglen,
                    char *note, size_t notelen)
{
    char name[EXPERT_HF_NAME_MAX];
    int transposed = 0;
    expert_hf_name(m, index, ti, name, sizeof name, &transposed);
    const expert_st_tensor *e = find(f, name);
    if (!e && !strcmp(name, "lm_head.weight") && (e = find(f, "transformer.wte.weight")) != NULL) {
        size_t at = strlen(note);
        snprintf(note + at, notelen - at, "%s%s has no lm_head.weight: the head starts from the token embedding "
                                          "(GPT-2 ties them)", at ? "; " : "", path);
    }
    if (!e && !strcmp(name, "lm_head.bias")) {
        memset(dst, 0, info->count * sizeof *dst);
        size_t at = strlen(note);
        snprintf(note + at, notelen - at, "%s%s has no lm_head.bias: the head's bias starts at zero",
                 at ? "; " : "", path);
        return 0;
    }
    if (!e)
        return say(msg, msglen, -ENOENT, "%s has no tensor %s (stage %s.%d's %s)", path, name, m->name, index,
                   info->name);
    if (!shape_ok(e, info, transposed))
        return say(msg, msglen, -EBADMSG, "%s: tensor %s has %d dimension%s [%llu, ...], stage %s.%d needs [%d, %d]%s",
                   path, e->name, e->ndim, e->ndim == 1 ? "" : "s", e->ndim ? (unsigned long long)e->shape[0] : 0ULL,
                   m->name, index, transposed ? info->cols : info->rows, transposed ? info->rows : info->cols,
                   info->cols == 1 ? " as a vector" : "");
    char err[300];
    int rc = expert_st_read(f, e, transposed ? tmp : dst, info->count, err, sizeof err);
    if (rc != 0)
        return say(msg, msglen, -EBADMSG, "%s", err);
    if (transposed)
        for (int i = 0; i < info->cols; i++)      /* stored [cols][rows] */
            for (int j = 0; j < info->rows; j++)
                dst[(size_t)j * (size_t)info->cols + (size_t)i] = tmp[(size_t)i * (size_t)info->rows + (size_t)j];
    for (size_t i = 0; i < info->count; i++)
        if (!isfinite(dst[i]))
            return say(msg, msglen, -EBADMSG, "%s: tensor %s: value %zu is not finite", path, e->name, i);
    return 0;
}

int expert_block_load_safetensors(expert_block *b, const struct expert_model_spec *m, int index, const char *path,
                                  char *msg, size_t msglen, char *note, size_t notelen)
{
    char scratch[2];
    if (!note || !notelen) {
        note = scratch;
        notelen = sizeof scratch;
    }
    note[0] = '\0';
    if (msg && msglen)
        msg[0] = '\0';
    struct expert_block_config c;
    struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
    size_t total = 0;
    if (!b || !m || !path || expert_model_stage(m, index, &c) != 0 ||
        memcmp(&c, expert_block_config(b), sizeof c) != 0)
        return say(msg, msglen, -EINVAL, "the block is not stage %d of %s", index, m ? m->name : "?");
    if (!is_gpt_kind(c.kind))
        return say(msg, msglen, -EINVAL, "%s: stage %s.%d is a %s block, which has no Hugging Face names (a flat "
                                         "weight file loads it)", path, m->name, index, expert_block_kind_name(c.kind));
    int n = expert_block_config_tensors(&c, t, &total);
    expert_st_file *f = NULL;
    int rc = expert_st_open(&f, path, msg, msglen);
    if (rc != 0)
        return rc == -EINVAL ? -EBADMSG : rc;
    size_t widest = 0;
    for (int i = 0; i < n; i++)
        widest = t[i].count > widest ? t[i].count : widest;
    float *p = malloc((total ? total : 1) * sizeof *p), *tmp = malloc((widest ? widest : 1) * sizeof *tmp);
    rc = p && tmp ? 0 : say(msg, msglen, -ENOMEM, "out of memory reading %s", path);
    for (int i = 0; rc == 0 && i < n; i++)
        rc = load_one(f, path, m, index, i, &t[i], p + t[i].offset, tmp, msg, msglen, note, notelen);
    expert_st_close(&f);
    if (rc == 0)
        rc = expert_block_set_params(b, p);
    free(tmp);
    free(p);
    return rc;
}

/* ---- writing ---- */

int expert_hf_write(const struct expert_model_spec *m, const float *const *params, const char *path,
                    const char *const *meta, int n_meta, char *msg, size_t msglen)
{
    if (!m || !params || !path)
        return say(msg, msglen, -EINVAL, "nothing to write");
    size_t nt = 0;
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config c;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        expert_model_stage(m, s, &c);
        if (!is_gpt_kind(c.kind))
            return say(msg, msglen, -EINVAL, "stage %s.%d is a %s block, which has no Hugging Face names", m->name,
                       s, expert_block_kind_name(c.kind));
        nt += (size_t)expert_block_config_tensors(&c, t, NULL);
    }
    expert_st_out *out = calloc(nt ? nt : 1, sizeof *out);
    char (*names)[EXPERT_HF_NAME_MAX] = calloc(nt ? nt : 1, sizeof *names);
    float **bufs = calloc(nt ? nt : 1, sizeof *bufs);
    int rc = out && names && bufs ? 0 : say(msg, msglen, -ENOMEM, "out of memory writing %s", path);
    int n = 0;
    for (int s = 0; rc == 0 && s < m->n_stages; s++) {
        struct expert_block_config c;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        expert_model_stage(m, s, &c);
        int k = expert_block_config_tensors(&c, t, NULL);
        for (int i = 0; rc == 0 && i < k; i++, n++) {
            int tr = 0;
            expert_hf_name(m, s, i, names[n], sizeof names[n], &tr);
            const float *src = params[s] + t[i].offset;
            out[n].name = names[n];
            out[n].data = src;
            out[n].ndim = t[i].cols == 1 ? 1 : 2;
            out[n].shape[0] = (uint64_t)(tr ? t[i].cols : t[i].rows);
            out[n].shape[1] = (uint64_t)(tr ? t[i].rows : t[i].cols);
            if (!tr)
                continue;
            if (!(bufs[n] = malloc(t[i].count * sizeof(float)))) {
                rc = say(msg, msglen, -ENOMEM, "out of memory writing %s", path);
                break;
            }
            for (int a = 0; a < t[i].rows; a++) /* Conv1D: [in][out] */
                for (int b = 0; b < t[i].cols; b++)
                    bufs[n][(size_t)b * (size_t)t[i].rows + (size_t)a] = src[(size_t)a * (size_t)t[i].cols + (size_t)b];
            out[n].data = bufs[n];
        }
    }
    if (rc == 0)
        rc = expert_st_write(path, out, n, meta, n_meta, msg, msglen);
    for (size_t i = 0; bufs && i < nt; i++)
        free(bufs[i]);
    free(bufs);
    free(names);
    free(out);
    return rc;
}

char *expert_hf_config_json(const struct expert_model_spec *m)
{
    int layers = 0;
    struct expert_block_config c, first;
    for (int s = 0; m && s < m->n_stages; s++) {
        expert_model_stage(m, s, &c);
        if (!is_gpt_kind(c.kind))
            return NULL;
        layers += c.layers;
    }
    if (!m || expert_model_stage(m, 0, &first) != 0)
        return NULL;
    json_t *j = json_pack("{s:[s],s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:s,s:f,s:b,s:s,s:f,s:f,s:f,s:f}",
                          "architectures", "GPT2LMHeadModel", "model_type", "gpt2", "vocab_size", first.vocab,
                          "n_positions", first.seq, "n_ctx", first.seq, "n_embd", first.dim, "n_layer", layers,
                          "n_head", first.heads, "n_inner", first.hidden, "activation_function", "gelu",
                          "layer_norm_epsilon", 1e-5, "tie_word_embeddings", 0, "torch_dtype", "float32",
                          "resid_pdrop", 0.0, "embd_pdrop", 0.0, "attn_pdrop", 0.0, "summary_first_dropout", 0.0);
    if (!j)
        return NULL;
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(j);
    if (!s)
        return NULL;
    size_t len = strlen(s);
    char *out = realloc(s, len + 2);
    if (!out) {
        free(s);
        return NULL;
    }
    out[len] = '\n';
    out[len + 1] = '\0';
    return out;
}
