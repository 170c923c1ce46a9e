/* expert/blockcfg.c: blocks as data (expert/blockcfg.h): kinds, config
 * checks, tensor lists, config hashes, row shapes, input checks, FLOP
 * counts and the first weights. No runtime state. */
#include "expert/blockcfg.h"
#include "expert/kinds_internal.h"
#include "expert/ops.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------ config -- */

static const char *const kind_names[] = {
    [EXPERT_BLOCK_LINEAR] = "linear", [EXPERT_BLOCK_RESFFN] = "resffn",
    [EXPERT_BLOCK_HEAD] = "head",     [EXPERT_BLOCK_EMBED] = "embed",
    [EXPERT_BLOCK_DECODER] = "decoder", [EXPERT_BLOCK_LMHEAD] = "lm_head",
};

int expert_block_kind_is_seq(int kind)
{
    return kind == EXPERT_BLOCK_EMBED || kind == EXPERT_BLOCK_DECODER ||
           kind == EXPERT_BLOCK_LMHEAD;
}

const char *expert_block_kind_name(int kind)
{
    if (kind < 1 || (size_t)kind >= sizeof kind_names / sizeof kind_names[0])
        return NULL;
    return kind_names[kind];
}

int expert_block_kind_from_name(const char *name)
{
    for (size_t k = 1; name && k < sizeof kind_names / sizeof kind_names[0]; k++)
        if (strcmp(kind_names[k], name) == 0)
            return (int)k;
    return 0;
}

static int in_range(int v, int lo, int hi)
{
    return v >= lo && v <= hi;
}

/* The transformer kinds: sizes in range and in/out the derived widths. */
static int seq_config_check(const struct expert_block_config *c)
{
    if (!in_range(c->dim, 1, EXPERT_BLOCK_MAX_DIM) || !in_range(c->hidden, 1, EXPERT_BLOCK_MAX_DIM) ||
        !in_range(c->heads, 1, c->dim) || c->dim % c->heads != 0 ||
        !in_range(c->seq, 1, EXPERT_BLOCK_MAX_SEQ) ||
        !in_range(c->layers, c->kind == EXPERT_BLOCK_DECODER ? 1 : 0, EXPERT_BLOCK_MAX_LAYERS))
        return -EINVAL;
    if (c->kind == EXPERT_BLOCK_DECODER ? c->vocab != 0
                                         : !in_range(c->vocab, 1, EXPERT_BLOCK_MAX_VOCAB))
        return -EINVAL;
    long row = (long)c->seq * c->dim;
    long in = c->kind == EXPERT_BLOCK_EMBED ? c->seq : row;
    long out = c->kind == EXPERT_BLOCK_LMHEAD ? (long)c->seq * c->vocab : row;
    if (row > EXPERT_BLOCK_MAX_ROW || out > EXPERT_BLOCK_MAX_ROW || c->in != in || c->out != out)
        return -EINVAL;
    return 0;
}

int expert_block_config_check(const struct expert_block_config *cfg)
{
    if (!cfg)
        return -EINVAL;
    if (expert_block_kind_is_seq(cfg->kind))
        return seq_config_check(cfg);
    if (cfg->dim || cfg->heads || cfg->seq || cfg->layers || cfg->vocab)
        return -EINVAL;
    if (cfg->in < 1 || cfg->in > EXPERT_BLOCK_MAX_DIM || cfg->out < 1 ||
        cfg->out > EXPERT_BLOCK_MAX_DIM)
        return -EINVAL;
    switch (cfg->kind) {
    case EXPERT_BLOCK_LINEAR:
    case EXPERT_BLOCK_HEAD:
        return cfg->hidden == 0 ? 0 : -EINVAL;
    case EXPERT_BLOCK_RESFFN:
        if (cfg->in != cfg->out || cfg->hidden < 1 || cfg->hidden > EXPERT_BLOCK_MAX_DIM)
            return -EINVAL;
        return 0;
    default:
        return -EINVAL;
    }
}

/* The tensor list, written down once (llm.c fill_in_parameter_sizes). */
int expert_block_config_tensors(const struct expert_block_config *cfg,
                                struct expert_tensor_info *t, size_t *total_out)
{
    if (expert_block_config_check(cfg) < 0 || !t)
        return -EINVAL;
    int n = 0, in = cfg->in, out = cfg->out, h = cfg->hidden, d = cfg->dim, V = cfg->vocab;
#define T(nm, r, c, ini, fi) \
    t[n++] = (struct expert_tensor_info){ .name = nm, .rows = (r), .cols = (c), .init = (ini), \
                                          .fan_in = (fi) }
#define LIN(wn, bn, o, i) T(wn, o, i, EXPERT_INIT_FANIN, i); T(bn, o, 1, EXPERT_INIT_FANIN, i)
#define LN(wn, bn, c) T(wn, c, 1, EXPERT_INIT_ONE, 0); T(bn, c, 1, EXPERT_INIT_ZERO, 0)
    switch (cfg->kind) {
    case EXPERT_BLOCK_LINEAR:
        LIN("w", "b", out, in);
        break;
    case EXPERT_BLOCK_RESFFN:
        LN("ln_w", "ln_b", in);
        LIN("fc1_w", "fc1_b", h, in);
        LIN("fc2_w", "fc2_b", in, h);
        break;
    case EXPERT_BLOCK_HEAD:
        LN("ln_w", "ln_b", in);
        LIN("fc_w", "fc_b", out, in);
        break;
    default: /* the transformer kinds (train_lm.py's state_dict order) */
        if (cfg->kind == EXPERT_BLOCK_EMBED) {
            T("tok_emb", V, d, EXPERT_INIT_NORMAL, 0);
            T("pos_emb", cfg->seq, d, EXPERT_INIT_NORMAL, 0);
        }
        for (int l = 0; l < cfg->layers; l++) {
            LN("ln1_w", "ln1_b", d);
            LIN("qkv_w", "qkv_b", 3 * d, d);
            LIN("proj_w", "proj_b", d, d);
            LN("ln2_w", "ln2_b", d);
            LIN("fc1_w", "fc1_b", h, d);
            LIN("fc2_w", "fc2_b", d, h);
        }
        if (cfg->kind == EXPERT_BLOCK_LMHEAD) {
            LN("lnf_w", "lnf_b", d);
            LIN("head_w", "head_b", V, d);
        }
        break;
    }
#undef LN
#undef LIN
#undef T
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        t[i].offset = off;
        t[i].count = (size_t)t[i].rows * (size_t)t[i].cols;
        off += t[i].count;
    }
    if (total_out)
        *total_out = off;
    return n;
}

static uint64_t fnv1a(uint64_t h, const void *data, size_t len)
{
    const uint8_t *p = data;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

uint64_t expert_block_config_hash(const struct expert_block_config *cfg)
{
    if (expert_block_config_check(cfg) < 0)
        return 0;
    int seq = expert_block_kind_is_seq(cfg->kind);
    const char *tag = seq ? "starling.block.v2" : "starling.block.v1";
    uint32_t f[13];
    int n = 0;
    float eps = EXPERT_LN_EPS;
    uint32_t eps_bits;
    memcpy(&eps_bits, &eps, sizeof eps_bits);
    f[n++] = (uint32_t)cfg->kind;
    f[n++] = (uint32_t)cfg->in;
    f[n++] = (uint32_t)cfg->out;
    f[n++] = (uint32_t)cfg->hidden;
    if (seq) {
        f[n++] = (uint32_t)cfg->dim;
        f[n++] = (uint32_t)cfg->heads;
        f[n++] = (uint32_t)cfg->seq;
        f[n++] = (uint32_t)cfg->layers;
        f[n++] = (uint32_t)cfg->vocab;
    }
    f[n++] = eps_bits;
    f[n++] = 1u; /* GELU variant: 1 = exact erf */
    if (seq)
        f[n++] = 1u; /* attention variant: 1 = causal, scale before mask, learned positions */
    uint8_t enc[17 + sizeof f];
    memcpy(enc, tag, 17);
    for (int i = 0; i < n; i++)
        put_u32(enc + 17 + 4 * i, f[i]);
    return fnv1a(0xcbf29ce484222325ULL, enc, 17 + 4 * (size_t)n);
}

int expert_block_row_shape(const struct expert_block_config *cfg, int out, uint64_t dims[2])
{
    if (expert_block_config_check(cfg) < 0 || !dims)
        return -EINVAL;
    if (!expert_block_kind_is_seq(cfg->kind)) {
        dims[0] = (uint64_t)(out ? cfg->out : cfg->in);
        return 1;
    }
    dims[0] = (uint64_t)cfg->seq;
    if (!out && cfg->kind == EXPERT_BLOCK_EMBED)
        return 1;
    dims[1] = (uint64_t)(out && cfg->kind == EXPERT_BLOCK_LMHEAD ? cfg->vocab : cfg->dim);
    return 2;
}

double expert_block_config_flops(const struct expert_block_config *cfg, int B)
{
    if (expert_block_config_check(cfg) < 0 || B < 0)
        return 0.0;
    if (cfg->kind == EXPERT_BLOCK_RESFFN)
        return 2.0 * 2.0 * B * (double)cfg->in * cfg->hidden;
    if (expert_block_kind_is_seq(cfg->kind)) {
        /* train_lm.py's count: the linears, plus q·kᵀ and att·v over the
         * full T×T score matrix. */
        double T = cfg->seq, d = cfg->dim, H = cfg->hidden;
        double layer = 2.0 * T * (3 * d * d + d * d + 2 * d * H) + 2.0 * 2.0 * T * T * d;
        double head = cfg->kind == EXPERT_BLOCK_LMHEAD ? 2.0 * T * d * cfg->vocab : 0.0;
        return B * (cfg->layers * layer + head);
    }
    return 2.0 * B * (double)cfg->in * cfg->out;
}

/* ----------------------------------------------------------- create -- */

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [-bound, bound) with 24 random bits. */
static float uniform_pm(uint64_t *s, float bound)
{
    float u = (float)(splitmix64(s) >> 40) * (1.0f / 16777216.0f);
    return (2.0f * u - 1.0f) * bound;
}

/* ------------------------------------------------------ first weights -- */

/* N(0, 1) by Box-Muller over two 24-bit uniforms (u1 in (0, 1]). */
static float normal01(uint64_t *s)
{
    float u1 = (float)((splitmix64(s) >> 40) + 1) * (1.0f / 16777216.0f);
    float u2 = (float)(splitmix64(s) >> 40) * (1.0f / 16777216.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

int expert_block_init_params(const struct expert_block_config *cfg, uint64_t seed, float *p)
{
    struct expert_tensor_info ts[EXPERT_BLOCK_MAX_TENSORS];
    int nt = expert_block_config_tensors(cfg, ts, NULL);
    if (nt < 0 || !p)
        return -EINVAL;
    uint64_t s = seed;
    for (int i = 0; i < nt; i++) {
        const struct expert_tensor_info *t = &ts[i];
        float *x = p + t->offset;
        switch (t->init) {
        case EXPERT_INIT_ONE:
            for (size_t j = 0; j < t->count; j++)
                x[j] = 1.0f;
            break;
        case EXPERT_INIT_ZERO:
            memset(x, 0, t->count * sizeof *x);
            break;
        case EXPERT_INIT_NORMAL:
            for (size_t j = 0; j < t->count; j++)
                x[j] = normal01(&s);
            break;
        default: {
            /* torch nn.Linear: kaiming_uniform_(a=√5) on w gives bound
             * gain·√(3/fan_in) = √(1/3)·√(3/fan_in) = 1/√fan_in, and the bias
             * is U(±1/√fan_in) too, fan_in being the layer's input width. */
            float bound = 1.0f / sqrtf((float)t->fan_in);
            for (size_t j = 0; j < t->count; j++)
                x[j] = uniform_pm(&s, bound);
            break;
        }
        }
    }
    return 0;
}

/* ------------------------------------------------------------ tokens -- */

static int is_token(float v, int V)
{
    return v >= 0.0f && v < (float)V && v == floorf(v);
}

int expert__seq_tokens(int32_t *tok, const float *inp, long n, int V)
{
    for (long i = 0; i < n; i++) {
        if (!is_token(inp[i], V))
            return -EINVAL;
        tok[i] = (int32_t)inp[i];
    }
    return 0;
}

int expert_block_input_check(const struct expert_block_config *cfg, const float *inp, int B,
                             char *why, size_t why_len)
{
    if (expert_block_config_check(cfg) < 0 || !inp || B < 0)
        return -EINVAL;
    if (cfg->kind != EXPERT_BLOCK_EMBED)
        return 0;
    for (long i = 0; i < (long)B * cfg->seq; i++)
        if (!is_token(inp[i], cfg->vocab)) {
            if (why && why_len)
                snprintf(why, why_len, "input value %g at row %ld, position %ld is not a token "
                         "(an integer in [0, %d))", (double)inp[i], i / cfg->seq, i % cfg->seq, cfg->vocab);
            return -EINVAL;
        }
    return 0;
}
