/* expert/block.c: what every block kind shares, on the CPU backend:
 * configs (kinds, checks, hash, tensor lists, row shapes, flops), flat
 * parameter/gradient/optimizer arrays, per-thread workspaces,
 * double-buffered weights with pinned snapshots, the generic forward and
 * backward drivers (recomputing or from kept rows), optimizer steps, flat
 * export/apply and the stage identity. Each kind's own forward and
 * backward is its own file (dense, resffn, head, embed, decoder, lmhead),
 * and its workspace views are laid out by ffnws.c or seqws.c, all behind
 * expert/kinds_internal.h; block.c dispatches to them. A block's bytes
 * (the checkpoint format) are expert/serialize.c's, through
 * expert/block_internal.h. */
#include "expert/block.h"
#include "expert/block_internal.h"
#include "expert/guard.h"
#include "expert/model.h"
#include "expert/pool.h"
#include "expert/ops.h"
#include "expert/kinds_internal.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct expert_block {
    struct expert_block_config cfg;
    struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
    int nt;
    size_t n;              /* floats per parameter set */

    float *params;         /* 2*n: slot 0 then slot 1 */
    float *grads;          /* n */
    float *m;              /* n: AdamW first moment / SGD momentum */
    float *v;              /* n: AdamW second moment */

    /* Snapshot state, under mu. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int cur;
    int refs[2];
    uint64_t slot_version[2]; /* the weight version each slot holds */
    int slot_valid[2];
    uint64_t version;

    /* Gradient / optimizer state, under grad_mu (taken before mu). */
    pthread_mutex_t grad_mu;
    int accum;
    uint64_t steps;
    int optim_kind;        /* 0 until the first step */
    uint64_t dropped_steps; /* steps refused (expert_block_step) */
    struct expert_guard_config guard_cfg; /* resolved */
    struct expert_guard guard;  /* accepted step gradient norms */

    /* Health of the steps (expert_block_health), under health_mu: a leaf
     * lock, so a reader never waits for a backward that holds grad_mu. */
    pthread_mutex_t health_mu;
    struct expert_block_health health;

    /* Stage identity (expert_block_set_stage): "" / 0 when none. */
    char model[EXPERT_CKPT_NAME_LEN];
    char stage[EXPERT_CKPT_NAME_LEN];
    uint64_t stage_hash;
};

struct expert_workspace {
    struct expert_block_config cfg;
    int max_batch;
    float *buf;            /* the one allocation; views below */
    struct expert__ffn_ws ffn;  /* LINEAR, RESFFN, HEAD (expert/ffnws.c) */
    struct expert__seq_ws *seq; /* the transformer kinds' views (expert/seqws.c); NULL otherwise */
};

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

static void *alloc_floats(size_t n)
{
    void *p = NULL;
    /* 64-byte alignment: full cache lines and AVX-512 vectors. */
    if (posix_memalign(&p, 64, (n ? n : 1) * sizeof(float)) != 0)
        return NULL;
    return p;
}

/* N(0, 1) by Box-Muller over two 24-bit uniforms (u1 in (0, 1]). */
static float normal01(uint64_t *s)
{
    float u1 = (float)((splitmix64(s) >> 40) + 1) * (1.0f / 16777216.0f);
    float u2 = (float)(splitmix64(s) >> 40) * (1.0f / 16777216.0f);
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
}

static void init_params(const struct expert_block *b, float *p, uint64_t seed)
{
    uint64_t s = seed;
    for (int i = 0; i < b->nt; i++) {
        const struct expert_tensor_info *t = &b->t[i];
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
}

expert_block *expert_block_create(const struct expert_block_config *cfg, uint64_t seed)
{
    if (expert_block_config_check(cfg) < 0)
        return NULL;
    expert_block *b = calloc(1, sizeof *b);
    if (!b)
        return NULL;
    b->cfg = *cfg;
    b->slot_valid[0] = 1; /* slot 0 holds version 0 */
    b->nt = expert_block_config_tensors(cfg, b->t, &b->n);
    b->params = alloc_floats(2 * b->n);
    b->grads = alloc_floats(b->n);
    b->m = alloc_floats(b->n);
    b->v = alloc_floats(b->n);
    if (!b->params || !b->grads || !b->m || !b->v)
        goto fail;
    if (pthread_mutex_init(&b->mu, NULL) != 0)
        goto fail;
    if (pthread_cond_init(&b->cv, NULL) != 0) {
        pthread_mutex_destroy(&b->mu);
        goto fail;
    }
    if (pthread_mutex_init(&b->grad_mu, NULL) != 0) {
        pthread_cond_destroy(&b->cv);
        pthread_mutex_destroy(&b->mu);
        goto fail;
    }
    if (pthread_mutex_init(&b->health_mu, NULL) != 0) {
        pthread_mutex_destroy(&b->grad_mu);
        pthread_cond_destroy(&b->cv);
        pthread_mutex_destroy(&b->mu);
        goto fail;
    }
    b->guard_cfg = expert_guard_resolve(NULL);
    init_params(b, b->params, seed);
    memcpy(b->params + b->n, b->params, b->n * sizeof(float));
    memset(b->grads, 0, b->n * sizeof(float));
    memset(b->m, 0, b->n * sizeof(float));
    memset(b->v, 0, b->n * sizeof(float));
    return b;
fail:
    free(b->params);
    free(b->grads);
    free(b->m);
    free(b->v);
    free(b);
    return NULL;
}

void expert_block_destroy(expert_block **p)
{
    if (!p || !*p)
        return;
    expert_block *b = *p;
    pthread_mutex_destroy(&b->health_mu);
    pthread_mutex_destroy(&b->grad_mu);
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    free(b->params);
    free(b->grads);
    free(b->m);
    free(b->v);
    free(b);
    *p = NULL;
}

const struct expert_block_config *expert_block_config(const expert_block *b)
{
    return &b->cfg;
}

const struct expert_tensor_info *expert_block_tensors(const expert_block *b, int *n_out,
                                                      size_t *total_out)
{
    if (n_out)
        *n_out = b->nt;
    if (total_out)
        *total_out = b->n;
    return b->t;
}

size_t expert_block_nparams(const expert_block *b)
{
    return b->n;
}

/* -------------------------------------------------------- workspace -- */

expert_workspace *expert_workspace_create(const struct expert_block_config *cfg,
                                          int max_batch)
{
    if (expert_block_config_check(cfg) < 0 || max_batch < 1 || max_batch > (1 << 20))
        return NULL;
    expert_workspace *ws = calloc(1, sizeof *ws);
    if (!ws)
        return NULL;
    ws->cfg = *cfg;
    ws->max_batch = max_batch;
    if (expert_block_kind_is_seq(cfg->kind)) {
        ws->seq = calloc(1, sizeof *ws->seq);
        if (!ws->seq || expert__seq_ws_init(ws->seq, cfg, max_batch, &ws->buf) != 0) {
            free(ws->seq);
            free(ws);
            return NULL;
        }
        return ws;
    }
    if (expert__ffn_ws_init(&ws->ffn, cfg, max_batch, &ws->buf) != 0) {
        free(ws);
        return NULL;
    }
    return ws;
}

void expert_workspace_destroy(expert_workspace **p)
{
    if (!p || !*p)
        return;
    free((*p)->buf);
    free((*p)->seq);
    free(*p);
    *p = NULL;
}

int expert_workspace_max_batch(const expert_workspace *ws)
{
    return ws ? ws->max_batch : 0;
}

/* -------------------------------------------------------- snapshots -- */

void expert_block_snapshot_acquire(expert_block *b, struct expert_snapshot *s)
{
    pthread_mutex_lock(&b->mu);
    s->slot = b->cur;
    b->refs[s->slot]++;
    s->version = b->version;
    s->params = b->params + (size_t)s->slot * b->n;
    pthread_mutex_unlock(&b->mu);
}

void expert_block_snapshot_release(expert_block *b, struct expert_snapshot *s)
{
    pthread_mutex_lock(&b->mu);
    if (--b->refs[s->slot] == 0)
        pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    s->params = NULL;
}

uint64_t expert_block_version(expert_block *b)
{
    pthread_mutex_lock(&b->mu);
    uint64_t v = b->version;
    pthread_mutex_unlock(&b->mu);
    return v;
}

/* Writers hold grad_mu, so there is one at a time and cur only changes under
 * them. Returns the spare slot once no reader pins it; new readers pin cur,
 * so it stays unpinned until publish(). */
static float *spare_begin(expert_block *b)
{
    pthread_mutex_lock(&b->mu);
    int back = 1 - b->cur;
    while (b->refs[back] > 0)
        pthread_cond_wait(&b->cv, &b->mu);
    pthread_mutex_unlock(&b->mu);
    return b->params + (size_t)back * b->n;
}

static void spare_publish(expert_block *b, uint64_t version)
{
    pthread_mutex_lock(&b->mu);
    b->cur = 1 - b->cur;
    b->version = version;
    b->slot_version[b->cur] = version;
    b->slot_valid[b->cur] = 1;
    pthread_mutex_unlock(&b->mu);
}

/* The current slot, for a writer holding grad_mu (cur cannot change). */
static const float *current_params(expert_block *b)
{
    pthread_mutex_lock(&b->mu);
    const float *p = b->params + (size_t)b->cur * b->n;
    pthread_mutex_unlock(&b->mu);
    return p;
}

/* ---------------------------------------------------- forward/backward -- */

static int check_call(const expert_block *b, const expert_workspace *ws, int B)
{
    if (!ws || B < 1 || B > ws->max_batch)
        return -EINVAL;
    if (memcmp(&ws->cfg, &b->cfg, sizeof b->cfg) != 0)
        return -EINVAL;
    return 0;
}

/* Returns 0, or -EINVAL for input a kind refuses (EMBED: a token that is
 * not an integer in [0, vocab)). The transformer kinds always keep what a
 * backward reads. */
static int forward_params(const expert_block *b, const float *params, expert_workspace *ws,
                          float *out, const float *inp, int B, int want_dgelu)
{
    const struct expert_block_config *c = &b->cfg;
    switch (c->kind) {
    case EXPERT_BLOCK_EMBED:
        return expert__embed_forward(c, b->t, params, ws->seq, out, inp, B);
    case EXPERT_BLOCK_DECODER:
        expert__decoder_forward(c, b->t, params, ws->seq, out, inp, B);
        break;
    case EXPERT_BLOCK_LMHEAD:
        expert__lmhead_forward(c, b->t, params, ws->seq, out, inp, B);
        break;
    case EXPERT_BLOCK_LINEAR:
        expert__dense_forward(c, b->t, params, out, inp, B);
        break;
    case EXPERT_BLOCK_RESFFN:
        expert__resffn_forward(c, b->t, params, &ws->ffn, out, inp, B, want_dgelu);
        break;
    case EXPERT_BLOCK_HEAD:
        expert__head_forward(c, b->t, params, &ws->ffn, out, inp, B);
        break;
    }
    return 0;
}

int expert_block_forward_snapshot(expert_block *b, const struct expert_snapshot *s,
                                  expert_workspace *ws, float *out,
                                  const float *inp, int B)
{
    if (!b || !s || !s->params || !out || !inp)
        return -EINVAL;
    int rc = check_call(b, ws, B);
    if (rc < 0)
        return rc;
    return forward_params(b, s->params, ws, out, inp, B, 0);
}

/* A forward on the current weights; want_dgelu: keep gelu' for a backward. */
static int forward_current(expert_block *b, expert_workspace *ws, float *out, const float *inp,
                           int B, int want_dgelu, uint64_t *version_out)
{
    if (!b || !out || !inp)
        return -EINVAL;
    int rc = check_call(b, ws, B);
    if (rc < 0)
        return rc;
    struct expert_snapshot s;
    expert_block_snapshot_acquire(b, &s);
    rc = forward_params(b, s.params, ws, out, inp, B, want_dgelu);
    if (version_out)
        *version_out = s.version;
    expert_block_snapshot_release(b, &s);
    return rc;
}

int expert_block_forward(expert_block *b, expert_workspace *ws, float *out,
                         const float *inp, int B, uint64_t *version_out)
{
    return forward_current(b, ws, out, inp, B, 0, version_out);
}

/* recompute == 0: the workspace already holds the forward of inp on these
 * params (expert_block_forward_train, or rows loaded back into it). */
static int backward_params(expert_block *b, const float *params, expert_workspace *ws,
                           float *out, float *dinp, const float *dout,
                           const float *inp, int B, int recompute)
{
    const struct expert_block_config *c = &b->cfg;
    if (recompute) {
        int rc = forward_params(b, params, ws, out, inp, B, 1);
        if (rc != 0)
            return rc;
    }
    switch (c->kind) {
    case EXPERT_BLOCK_EMBED:
        return expert__embed_backward(c, b->t, params, b->grads, ws->seq, dinp, dout, inp, B);
    case EXPERT_BLOCK_DECODER:
        expert__decoder_backward(c, b->t, params, b->grads, ws->seq, dinp, dout, B);
        break;
    case EXPERT_BLOCK_LMHEAD:
        expert__lmhead_backward(c, b->t, params, b->grads, ws->seq, dinp, dout, B);
        break;
    case EXPERT_BLOCK_LINEAR:
        expert__dense_backward(c, b->t, params, b->grads, dinp, dout, inp, B);
        break;
    case EXPERT_BLOCK_RESFFN:
        expert__resffn_backward(c, b->t, params, b->grads, &ws->ffn, dinp, dout, inp, B);
        break;
    case EXPERT_BLOCK_HEAD:
        expert__head_backward(c, b->t, params, b->grads, &ws->ffn, dinp, dout, inp, B);
        break;
    }
    return 0;
}

int expert_block_backward(expert_block *b, expert_workspace *ws, float *dinp,
                          const float *dout, const float *inp, int B,
                          uint64_t *version_out)
{
    return expert_block_forward_backward(b, ws, NULL, dinp, dout, inp, B, version_out);
}

int expert_block_forward_backward(expert_block *b, expert_workspace *ws, float *out,
                                  float *dinp, const float *dout, const float *inp,
                                  int B, uint64_t *version_out)
{
    return expert_block_backward_at(b, ws, out, dinp, dout, inp, B, EXPERT_VERSION_CURRENT,
                                    version_out);
}

static int backward_common(expert_block *b, expert_workspace *ws, float *out, float *dinp,
                           const float *dout, const float *inp, int B, uint64_t at_version,
                           int recompute, uint64_t *version_out)
{
    if (!b || !dout || !inp)
        return -EINVAL;
    int rc = check_call(b, ws, B);
    if (rc < 0)
        return rc;
    pthread_mutex_lock(&b->grad_mu);
    if (b->accum > (1 << 30) - B) {
        pthread_mutex_unlock(&b->grad_mu);
        return -EOVERFLOW;
    }
    struct expert_snapshot s;
    expert_block_snapshot_acquire(b, &s);
    if (at_version != EXPERT_VERSION_CURRENT && at_version != s.version) {
        /* The forward ran on the previous version: when the other slot still
         * holds it, recompute on exactly those weights (no step can replace
         * that slot while we hold grad_mu). */
        pthread_mutex_lock(&b->mu);
        int other = 1 - s.slot;
        if (b->slot_valid[other] && b->slot_version[other] == at_version) {
            if (--b->refs[s.slot] == 0)
                pthread_cond_broadcast(&b->cv);
            b->refs[other]++;
            s.slot = other;
            s.version = at_version;
            s.params = b->params + (size_t)other * b->n;
        }
        pthread_mutex_unlock(&b->mu);
    }
    if (!recompute && s.version != at_version) {
        /* The kept activations are of a version the block no longer holds. */
        expert_block_snapshot_release(b, &s);
        pthread_mutex_unlock(&b->grad_mu);
        return -ESTALE;
    }
    rc = backward_params(b, s.params, ws, out, dinp, dout, inp, B, recompute);
    if (version_out)
        *version_out = s.version;
    expert_block_snapshot_release(b, &s);
    if (rc == 0)
        b->accum += B;
    pthread_mutex_unlock(&b->grad_mu);
    return rc;
}

int expert_block_backward_at(expert_block *b, expert_workspace *ws, float *out, float *dinp,
                             const float *dout, const float *inp, int B, uint64_t at_version,
                             uint64_t *version_out)
{
    return backward_common(b, ws, out, dinp, dout, inp, B, at_version, 1, version_out);
}

int expert_block_backward_kept(expert_block *b, expert_workspace *ws, float *dinp,
                               const float *dout, const float *inp, int B, uint64_t version,
                               uint64_t *version_out)
{
    if (version == EXPERT_VERSION_CURRENT)
        return -EINVAL;
    return backward_common(b, ws, NULL, dinp, dout, inp, B, version, 0, version_out);
}

int expert_block_forward_train(expert_block *b, expert_workspace *ws, float *out,
                               const float *inp, int B, uint64_t *version_out)
{
    return forward_current(b, ws, out, inp, B, 1, version_out);
}

/* The views of a workspace that a backward reads after the forward, in the
 * order rows are packed: for each its pointer and floats per row (the
 * kind's workspace file lists them: expert/ffnws.c, expert/seqws.c).
 * Returns the count. */
#define KEPT_MAX EXPERT__SEQ_MAX_VIEWS
_Static_assert(EXPERT__FFN_MAX_VIEWS <= KEPT_MAX, "KEPT_MAX holds every kind's kept views");
static int kept_views(const expert_workspace *ws, float *v[KEPT_MAX], size_t w[KEPT_MAX])
{
    if (ws->seq)
        return expert__seq_kept_views(&ws->cfg, ws->seq, v, w);
    return expert__ffn_kept_views(&ws->cfg, &ws->ffn, v, w);
}

size_t expert_workspace_kept_floats(const expert_workspace *ws)
{
    if (!ws)
        return 0;
    float *v[KEPT_MAX];
    size_t w[KEPT_MAX], sum = 0;
    int n = kept_views(ws, v, w);
    for (int i = 0; i < n; i++)
        sum += w[i];
    return sum;
}

/* Copies rows [row0, row0 + rows) between the workspace views and a packed
 * buffer: out of the views into dst (save), or from src into them (load).
 * The views' floats are writable through a const workspace: the struct
 * holds only pointers to them. */
static int kept_copy(const expert_workspace *ws, int row0, int rows, const float *src, float *dst)
{
    if (!ws || !(src || dst) || row0 < 0 || rows < 1 || row0 > ws->max_batch - rows)
        return -EINVAL;
    float *v[KEPT_MAX];
    size_t w[KEPT_MAX], done = 0;
    int n = kept_views(ws, v, w);
    for (int i = 0; i < n; i++) {
        float *view = v[i] + (size_t)row0 * w[i];
        size_t len = (size_t)rows * w[i];
        if (dst)
            memcpy(dst + done, view, len * sizeof(float));
        else
            memcpy(view, src + done, len * sizeof(float));
        done += len;
    }
    return 0;
}

int expert_workspace_save_rows(const expert_workspace *ws, int row0, int rows, float *dst)
{
    return dst ? kept_copy(ws, row0, rows, NULL, dst) : -EINVAL;
}

int expert_workspace_load_rows(expert_workspace *ws, int row0, int rows, const float *src)
{
    return src ? kept_copy(ws, row0, rows, src, NULL) : -EINVAL;
}

/* ------------------------------------------------------------- steps -- */

struct step_ctx {
    expert_block *b;
    const struct expert_optim *o;
    float *dst;
    const float *src;
    float gscale;
    uint64_t t;
    double sums[EXPERT__POOL_MAX_PARTS][2]; /* per part (expert__parallel's n): Σ Δp², Σ p'² (+ 0·(m + v)) */
};

/* Σ grads² over the thread budget. The gradient is cut into at most
 * SQ_CHUNKS chunks whose size depends on n alone; each chunk's sum is
 * computed whole by one thread and the sums are added in chunk order, so
 * the result is the same for any number of threads. */
#define SQ_CHUNKS 256
struct sq_ctx {
    const float *g;
    size_t n, chunk, chunks;
    double part[SQ_CHUNKS];
};

static void sq_part(void *ctx, int i, int n)
{
    struct sq_ctx *c = ctx;
    size_t lo, hi;
    expert__split(c->chunks, i, n, 1, &lo, &hi);
    for (size_t k = lo; k < hi; k++) {
        size_t a = k * c->chunk, e = a + c->chunk < c->n ? a + c->chunk : c->n;
        c->part[k] = expert_sqnorm(c->g + a, e - a);
    }
}

static double grads_sqnorm(const float *g, size_t n)
{
    struct sq_ctx c;
    c.g = g;
    c.n = n;
    c.chunk = (n + SQ_CHUNKS - 1) / SQ_CHUNKS;
    if (c.chunk < 4096)
        c.chunk = 4096;
    c.chunks = (n + c.chunk - 1) / c.chunk;
    expert__parallel(sq_part, &c, n);
    double s = 0.0;
    for (size_t k = 0; k < c.chunks; k++)
        s += c.part[k];
    return s;
}

/* Each part also sums what its update did (expert_adamw_update_checked):
 * the checks of the step cost no extra pass over memory. */
static void step_part(void *ctx, int i, int n)
{
    struct step_ctx *c = ctx;
    size_t lo, hi;
    expert__split(c->b->n, i, n, 16, &lo, &hi);
    c->sums[i][0] = c->sums[i][1] = 0;
    if (hi <= lo)
        return;
    expert_block *b = c->b;
    if (c->o->kind == EXPERT_OPTIM_ADAMW)
        expert_adamw_update_checked(c->dst + lo, c->src + lo, b->grads + lo, b->m + lo, b->v + lo, hi - lo,
                                    c->gscale, c->o, c->t, c->sums[i]);
    else
        expert_sgd_update_checked(c->dst + lo, c->src + lo, b->grads + lo, b->m + lo, hi - lo, c->gscale, c->o,
                                  c->sums[i]);
}

int expert_block_accumulated(expert_block *b)
{
    pthread_mutex_lock(&b->grad_mu);
    int n = b->accum;
    pthread_mutex_unlock(&b->grad_mu);
    return n;
}

uint64_t expert_block_dropped_steps(expert_block *b)
{
    pthread_mutex_lock(&b->grad_mu);
    uint64_t n = b->dropped_steps;
    pthread_mutex_unlock(&b->grad_mu);
    return n;
}

uint64_t expert_block_steps(expert_block *b)
{
    pthread_mutex_lock(&b->grad_mu);
    uint64_t n = b->steps;
    pthread_mutex_unlock(&b->grad_mu);
    return n;
}

void expert_block_zero_grad(expert_block *b)
{
    pthread_mutex_lock(&b->grad_mu);
    memset(b->grads, 0, b->n * sizeof(float));
    b->accum = 0;
    pthread_mutex_unlock(&b->grad_mu);
}

/* A refused step: drops the accumulation, counts it, keeps the sentence. */
static int step_refused(expert_block *b, const char *why)
{
    memset(b->grads, 0, b->n * sizeof(float));
    b->accum = 0;
    b->dropped_steps++;
    pthread_mutex_lock(&b->health_mu);
    b->health.refused_steps = b->dropped_steps;
    snprintf(b->health.last_refusal, sizeof b->health.last_refusal, "%s", why);
    pthread_mutex_unlock(&b->health_mu);
    return -ERANGE;
}

static int step_locked(expert_block *b, const struct expert_optim *o,
                       struct expert_step_info *info)
{
    if (expert_optim_check(o) < 0)
        return -EINVAL;
    if (b->optim_kind && b->optim_kind != o->kind)
        return -EINVAL; /* m/v hold the other optimizer's state */
    if (b->accum <= 0)
        return -EAGAIN;
    float gscale = 1.0f / (float)b->accum;
    double norm = sqrt(grads_sqnorm(b->grads, b->n)) * gscale;
    char why[sizeof b->health.last_refusal];
    /* A NaN/Inf gradient would poison every weight for good; a finite but
     * huge one (a grad_output of 1e30) overflows AdamW's v, after which
     * the weights never move again. Either is refused before it touches
     * the moments, and the whole accumulation is dropped (guard.h). */
    if (expert_guard_check(&b->guard, &b->guard_cfg, norm, "averaged gradient", why, sizeof why) < 0) {
        expert_guard_observe(&b->guard, &b->guard_cfg, norm); /* guard.h: refused norms lift it too */
        return step_refused(b, why);
    }
    if (o->clip_norm > 0.0f && norm > o->clip_norm)
        gscale *= (float)(o->clip_norm / (norm + 1e-6)); /* torch clip_grad_norm_ */
    const float *src = current_params(b);
    float *dst = spare_begin(b);
    uint64_t t = b->steps + 1;
    /* The update is elementwise and memory bound (it streams parameters,
     * gradients and moments once), so it is split over the BLAS thread
     * budget; every element is computed exactly as in one pass. */
    struct step_ctx sc = {b, o, dst, src, gscale, t, {{0}}};
    expert__parallel(step_part, &sc, b->n * 7);
    double dd = 0, pp = 0;
    for (int i = 0; i < EXPERT__POOL_MAX_PARTS; i++) {
        dd += sc.sums[i][0];
        pp += sc.sums[i][1];
    }
    if (!isfinite(dd) || !isfinite(pp)) {
        /* The new weights or moments are not finite although the gradient
         * passed (the bounds were turned off, or SGD's momentum grew
         * without bound). The new weights are in the spare slot, which
         * is not published: forget that it held the version before last.
         * The moments were updated in place and cannot be recovered, so
         * they start again from zero. */
        pthread_mutex_lock(&b->mu);
        b->slot_valid[1 - b->cur] = 0;
        pthread_mutex_unlock(&b->mu);
        memset(b->m, 0, b->n * sizeof(float));
        memset(b->v, 0, b->n * sizeof(float));
        snprintf(why, sizeof why,
                 "the step from an averaged gradient of norm %.3g would have made weights or optimizer "
                 "state non-finite; rolled back (optimizer moments reset)", norm);
        return step_refused(b, why);
    }
    expert_guard_accept(&b->guard, &b->guard_cfg, norm);
    uint64_t version = b->version + 1; /* only writers change it; we are one */
    spare_publish(b, version);
    b->steps = t;
    b->optim_kind = o->kind;
    /* A step that applied a non-zero gradient at lr > 0 but changed no
     * weight: the block is frozen (e.g. a second moment that a huge
     * gradient made enormous). Counted while it lasts. */
    double rel = pp > 0 ? sqrt(dd / pp) : dd > 0 ? 1.0 : 0.0;
    int still = o->lr > 0 && norm > 0 && rel <= EXPERT_GUARD_STILL_REL;
    pthread_mutex_lock(&b->health_mu);
    b->health.last_change = rel;
    b->health.grad_ref = b->guard.ref;
    b->health.still_steps = still ? b->health.still_steps + 1 : 0;
    b->health.frozen = b->health.still_steps >= (uint64_t)b->guard_cfg.frozen_steps;
    pthread_mutex_unlock(&b->health_mu);
    if (info) {
        info->grad_norm = norm;
        info->version = version;
        info->samples = b->accum;
    }
    memset(b->grads, 0, b->n * sizeof(float));
    b->accum = 0;
    return 0;
}

int expert_block_set_guard(expert_block *b, const struct expert_guard_config *c)
{
    if (!b)
        return -EINVAL;
    pthread_mutex_lock(&b->grad_mu);
    b->guard_cfg = expert_guard_resolve(c);
    pthread_mutex_unlock(&b->grad_mu);
    return 0;
}

void expert_block_health(expert_block *b, struct expert_block_health *out)
{
    pthread_mutex_lock(&b->health_mu);
    *out = b->health;
    pthread_mutex_unlock(&b->health_mu);
}

int expert_block_step(expert_block *b, const struct expert_optim *o,
                      struct expert_step_info *info)
{
    if (!b)
        return -EINVAL;
    pthread_mutex_lock(&b->grad_mu);
    int rc = step_locked(b, o, info);
    pthread_mutex_unlock(&b->grad_mu);
    return rc;
}

int expert_block_maybe_step(expert_block *b, const struct expert_optim *o,
                            struct expert_step_info *info)
{
    if (!b || expert_optim_check(o) < 0)
        return -EINVAL;
    pthread_mutex_lock(&b->grad_mu);
    int rc = 0;
    if (b->accum >= o->target_batch) {
        rc = step_locked(b, o, info);
        if (rc == 0)
            rc = 1;
    }
    pthread_mutex_unlock(&b->grad_mu);
    return rc;
}

void expert_block_copy_grads(expert_block *b, float *out)
{
    pthread_mutex_lock(&b->grad_mu);
    memcpy(out, b->grads, b->n * sizeof(float));
    pthread_mutex_unlock(&b->grad_mu);
}

int expert_block_set_params(expert_block *b, const float *params)
{
    if (!b || !params)
        return -EINVAL;
    pthread_mutex_lock(&b->grad_mu);
    float *dst = spare_begin(b);
    memcpy(dst, params, b->n * sizeof(float));
    spare_publish(b, b->version + 1);
    pthread_mutex_unlock(&b->grad_mu);
    return 0;
}

size_t expert_block_flat_len(const expert_block *b)
{
    return b ? 3 * b->n : 0;
}

int expert_block_flat_export(expert_block *b, float *out)
{
    if (!b || !out)
        return -EINVAL;
    pthread_mutex_lock(&b->grad_mu);
    memcpy(out, current_params(b), b->n * sizeof(float));
    memcpy(out + b->n, b->m, b->n * sizeof(float));
    memcpy(out + 2 * b->n, b->v, b->n * sizeof(float));
    pthread_mutex_unlock(&b->grad_mu);
    return 0;
}

int expert_block_flat_apply(expert_block *b, const float *avg, const float *base, int with_optim,
                            double *dist_before, double *dist_after)
{
    if (!b || !avg || !base)
        return -EINVAL;
    const size_t n = b->n;
    double d0 = 0, d1 = 0;
    int rc = 0;
    pthread_mutex_lock(&b->grad_mu);
    const float *ps = current_params(b);
    /* Check everything first: nothing changes unless all of it is finite. */
    for (size_t i = 0; i < (with_optim ? 3 : 1) * n && rc == 0; i++) {
        float cur = i < n ? ps[i] : i < 2 * n ? b->m[i - n] : b->v[i - 2 * n];
        if (!isfinite(cur + (avg[i] - base[i])))
            rc = -ERANGE;
    }
    if (rc == 0) {
        float *dst = spare_begin(b);
        for (size_t i = 0; i < n; i++) {
            float v = ps[i] + (avg[i] - base[i]);
            double e0 = (double)base[i] - avg[i], e1 = (double)v - avg[i];
            d0 += e0 * e0;
            d1 += e1 * e1;
            dst[i] = v;
        }
        if (with_optim) {
            for (size_t i = 0; i < n; i++) {
                b->m[i] += avg[n + i] - base[n + i];
                float v = b->v[i] + (avg[2 * n + i] - base[2 * n + i]);
                b->v[i] = v > 0.0f ? v : 0.0f;
            }
        }
        spare_publish(b, b->version + 1);
    }
    pthread_mutex_unlock(&b->grad_mu);
    if (rc == 0) {
        if (dist_before)
            *dist_before = sqrt(d0);
        if (dist_after)
            *dist_after = sqrt(d1);
    }
    return rc;
}

/* ---------------------------------------------------- stage identity -- */

int expert_block_set_stage(expert_block *b, const struct expert_model_spec *m, int index)
{
    struct expert_block_config cfg;
    char stage[EXPERT_CKPT_NAME_LEN];
    if (!b || !m || expert_model_stage(m, index, &cfg) != 0 || cfg.kind != b->cfg.kind ||
        cfg.in != b->cfg.in || cfg.out != b->cfg.out || cfg.hidden != b->cfg.hidden ||
        strlen(m->name) >= sizeof b->model || expert_stage_name(stage, sizeof stage, m, index) < 0)
        return -EINVAL;
    memcpy(b->stage, stage, sizeof stage);
    snprintf(b->model, sizeof b->model, "%s", m->name);
    b->stage_hash = expert_stage_hash(m, index);
    return 0;
}

const char *expert_block_stage(const expert_block *b, uint64_t *stage_hash_out)
{
    if (stage_hash_out)
        *stage_hash_out = b ? b->stage_hash : 0;
    return b ? b->stage : "";
}

/* ------------------------------------- for the checkpoint format -- */

void expert__block_state_lock(expert_block *b, struct expert__block_state *out)
{
    pthread_mutex_lock(&b->grad_mu);
    out->params = current_params(b);
    out->m = b->m;
    out->v = b->v;
    out->version = b->version;
    out->steps = b->steps;
    out->optim_kind = b->optim_kind;
    out->model = b->model;
    out->stage = b->stage;
    out->stage_hash = b->stage_hash;
}

void expert__block_state_unlock(expert_block *b)
{
    pthread_mutex_unlock(&b->grad_mu);
}

const char *expert__block_model(const expert_block *b)
{
    return b->model;
}

void expert__block_restore(expert_block *b, const void *params, const void *m, const void *v,
                           uint64_t version, uint64_t steps, int optim_kind)
{
    pthread_mutex_lock(&b->grad_mu);
    float *dst = spare_begin(b);
    memcpy(dst, params, b->n * sizeof(float));
    if (m && v) {
        memcpy(b->m, m, b->n * sizeof(float));
        memcpy(b->v, v, b->n * sizeof(float));
        b->steps = steps;
        b->optim_kind = optim_kind;
    } else {
        memset(b->m, 0, b->n * sizeof(float));
        memset(b->v, 0, b->n * sizeof(float));
        b->steps = 0;
        b->optim_kind = 0;
    }
    spare_publish(b, version);
    memset(b->grads, 0, b->n * sizeof(float));
    b->accum = 0;
    pthread_mutex_unlock(&b->grad_mu);
}
