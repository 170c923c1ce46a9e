/* expert/simdev.c: the simulated device (expert_backend_sim_create): the
 * CPU ops on memory that host code cannot touch.
 *
 * Its memory is real host memory, but the addresses it hands out are the
 * real ones plus SIM_OFF, which lies outside the canonical x86-64 (and
 * AArch64) user range: a direct dereference by host code faults at once.
 * Every op translates its pointer arguments back before it calls the CPU
 * op, and aborts with a message when handed a pointer that is not the
 * device's (a host pointer passed where device memory belongs). So a block
 * on this device proves that the block runtime reaches its memory only
 * through the backend: the uploads, downloads and copies a GPU needs, on a
 * machine without one. Each allocation carries a header with its size, so
 * the device keeps a budget (mem_info's total) that alloc refuses to
 * exceed, as a full GPU would. */
#include "expert/backend.h"
#include "expert/optim.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SIM_OFF ((uintptr_t)1 << 62)
#define SIM_HDR 256 /* keeps the 256-byte alignment of the contract */
#define SIM_MAGIC 0x5354524c53494d31ULL /* "STRLSIM1" */

struct sim_state {
    pthread_mutex_t mu;
    size_t limit, used;
};

static struct sim_state *state_of(const expert_backend *be)
{
    return be->impl;
}

/* The real address behind device pointer p (NULL stays NULL). */
static void *dev(const void *p)
{
    if (!p)
        return NULL;
    uintptr_t u = (uintptr_t)p;
    if (u < SIM_OFF || u - SIM_OFF < 4096) {
        fprintf(stderr, "sim device: host pointer %p used as device memory\n", p);
        abort();
    }
    return (void *)(u - SIM_OFF);
}

/* A host pointer that must not be the device's (the embedding's tokens,
 * results returned to the host). */
static void *host(const void *p)
{
    if (p && (uintptr_t)p >= SIM_OFF) {
        fprintf(stderr, "sim device: device pointer %p used as host memory\n", p);
        abort();
    }
    return (void *)(uintptr_t)p;
}

#define D(p) dev(p)

static void *sim_alloc(const expert_backend *be, size_t bytes)
{
    struct sim_state *s = state_of(be);
    if (bytes > SIZE_MAX - SIM_HDR)
        return NULL;
    pthread_mutex_lock(&s->mu);
    int over = s->limit && (bytes > s->limit || s->used > s->limit - bytes);
    if (!over)
        s->used += bytes;
    pthread_mutex_unlock(&s->mu);
    if (over)
        return NULL;
    void *p = NULL;
    if (posix_memalign(&p, SIM_HDR, SIM_HDR + (bytes ? bytes : 1)) != 0) {
        pthread_mutex_lock(&s->mu);
        s->used -= bytes;
        pthread_mutex_unlock(&s->mu);
        return NULL;
    }
    uint64_t hdr[2] = { SIM_MAGIC, bytes };
    memcpy(p, hdr, sizeof hdr);
    /* Fresh device memory is not zero on a GPU either: make a read of
     * memory nobody wrote visible. */
    memset((char *)p + SIM_HDR, 0xff, bytes);
    return (void *)((uintptr_t)p + SIM_HDR + SIM_OFF);
}

static void sim_free(const expert_backend *be, void *p)
{
    if (!p)
        return;
    char *real = (char *)dev(p) - SIM_HDR;
    uint64_t hdr[2];
    memcpy(hdr, real, sizeof hdr);
    if (hdr[0] != SIM_MAGIC) {
        fprintf(stderr, "sim device: free of %p, which it did not allocate\n", p);
        abort();
    }
    struct sim_state *s = state_of(be);
    pthread_mutex_lock(&s->mu);
    s->used -= hdr[1];
    pthread_mutex_unlock(&s->mu);
    memset(real, 0, sizeof hdr);
    free(real);
}

static int sim_upload(const expert_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if (bytes)
        memcpy(D(dst), host(src), bytes);
    return 0;
}

static int sim_download(const expert_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if (bytes)
        memcpy(host(dst), D(src), bytes);
    return 0;
}

static int sim_copy(const expert_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if (bytes)
        memmove(D(dst), D(src), bytes);
    return 0;
}

static int sim_zero(const expert_backend *be, void *dst, size_t bytes)
{
    (void)be;
    if (bytes)
        memset(D(dst), 0, bytes);
    return 0;
}

static int sim_sync(const expert_backend *be)
{
    (void)be;
    return 0;
}

static void *sim_host_alloc(const expert_backend *be, size_t bytes)
{
    (void)be;
    void *p = NULL;
    if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0)
        return NULL;
    return p;
}

static void sim_host_free(const expert_backend *be, void *p)
{
    (void)be;
    free(p);
}

static int sim_mem_info(const expert_backend *be, size_t *free_out, size_t *total_out)
{
    struct sim_state *s = state_of(be);
    pthread_mutex_lock(&s->mu);
    size_t total = s->limit ? s->limit : (size_t)1 << 40, used = s->used;
    pthread_mutex_unlock(&s->mu);
    if (free_out)
        *free_out = used < total ? total - used : 0;
    if (total_out)
        *total_out = total;
    return 0;
}

/* ---- the ops: the CPU's, on translated pointers ---- */

static int s_linear_fwd(float *out, const float *inp, const float *w, const float *bias, int B, int C, int OC)
{
    return expert_linear_forward(D(out), D(inp), D(w), D(bias), B, C, OC);
}
static int s_linear_bwd(float *dinp, float *dw, float *dbias, const float *dout, const float *inp,
                        const float *w, int B, int C, int OC)
{
    return expert_linear_backward(D(dinp), D(dw), D(dbias), D(dout), D(inp), D(w), B, C, OC);
}
static int s_bias_fwd(float *out, const float *inp, const float *bias, int B, int C)
{
    return expert_bias_forward(D(out), D(inp), D(bias), B, C);
}
static int s_bias_bwd(float *dbias, const float *dout, int B, int C)
{
    return expert_bias_backward(D(dbias), D(dout), B, C);
}
static int s_ln_fwd(float *out, float *mean, float *rstd, const float *inp, const float *w, const float *b,
                    int N, int C)
{
    return expert_layernorm_forward(D(out), D(mean), D(rstd), D(inp), D(w), D(b), N, C);
}
static int s_ln_bwd(float *dinp, float *dw, float *db, const float *dout, const float *inp, const float *w,
                    const float *mean, const float *rstd, int N, int C)
{
    return expert_layernorm_backward(D(dinp), D(dw), D(db), D(dout), D(inp), D(w), D(mean), D(rstd), N, C);
}
static int s_gelu_fwd(float *out, const float *inp, long N)
{
    return expert_gelu_forward(D(out), D(inp), N);
}
static int s_gelu_bwd(float *dinp, const float *dout, const float *inp, long N)
{
    return expert_gelu_backward(D(dinp), D(dout), D(inp), N);
}
static int s_bias_gelu_fwd(float *out, float *dgelu, float *pre, const float *bias, int B, int C)
{
    return expert_bias_gelu_forward(D(out), D(dgelu), D(pre), D(bias), B, C);
}
static int s_bias_gelu_bwd(float *dpre, float *dbias, const float *dout, const float *dgelu, int B, int C)
{
    return expert_bias_gelu_backward(D(dpre), D(dbias), D(dout), D(dgelu), B, C);
}
static int s_res_fwd(float *out, const float *a, const float *b, long N)
{
    return expert_residual_forward(D(out), D(a), D(b), N);
}
static int s_res_bwd(float *da, float *db, const float *dout, long N)
{
    return expert_residual_backward(D(da), D(db), D(dout), N);
}
static int s_ce_fwd(float *losses, float *probs, const float *logits, const int32_t *targets, int B, int V)
{
    return expert_crossentropy_forward(D(losses), D(probs), D(logits), D(targets), B, V);
}
static int s_ce_bwd(float *dlogits, const float *probs, const int32_t *targets, float dloss, int B, int V)
{
    return expert_crossentropy_backward(D(dlogits), D(probs), D(targets), dloss, B, V);
}
static int s_softmax_fwd(float *out, const float *inp, int N, int V)
{
    return expert_softmax_forward(D(out), D(inp), N, V);
}
static int s_softmax_bwd(float *dinp, const float *dout, const float *out, int N, int V)
{
    return expert_softmax_backward(D(dinp), D(dout), D(out), N, V);
}
static int s_att_fwd(float *out, float *att, const float *qkv, int B, int T, int C, int NH)
{
    return expert_attention_forward(D(out), D(att), D(qkv), B, T, C, NH);
}
static int s_att_bwd2(float *dqkv, float *scratch, const float *dout, const float *out, const float *qkv,
                      const float *saved, int B, int T, int C, int NH)
{
    return expert_attention_backward2(D(dqkv), D(scratch), D(dout), D(out), D(qkv), D(saved), B, T, C, NH);
}
static int s_emb_fwd(float *out, const int32_t *tok, const float *wte, const float *wpe, int B, int T, int C,
                     int V)
{
    return expert_embedding_forward(D(out), host(tok), D(wte), D(wpe), B, T, C, V);
}
static int s_emb_bwd(float *dwte, float *dwpe, const float *dout, const int32_t *tok, int B, int T, int C, int V)
{
    return expert_embedding_backward(D(dwte), D(dwpe), D(dout), host(tok), B, T, C, V);
}
static int s_mm_fwd(float *out, const float *res, const float *inp, const float *w, const uint16_t *w16,
                    const float *bias, int B, int C, int OC)
{
    return expert_matmul_forward(D(out), D(res), D(inp), D(w), D(w16), D(bias), B, C, OC);
}
static int s_mm_bwd(float *dinp, float *dw, float *dbias, const float *dout, const float *inp, const float *w,
                    const uint16_t *w16, int B, int C, int OC)
{
    return expert_matmul_backward(D(dinp), D(dw), D(dbias), D(dout), D(inp), D(w), D(w16), B, C, OC);
}
static int s_sqnorm(double *out, const float *x, size_t n)
{
    return expert_sqnorm_op(host(out), D(x), n);
}
static int s_adamw(float *p_out, const float *p_in, const float *g, float *m, float *v, size_t n, float gscale,
                   const struct expert_optim *o, uint64_t t, double sums[2])
{
    return expert_adamw_op(D(p_out), D(p_in), D(g), D(m), D(v), n, gscale, host(o), t, host(sums));
}
static int s_sgd(float *p_out, const float *p_in, const float *g, float *buf, size_t n, float gscale,
                 const struct expert_optim *o, double sums[2])
{
    return expert_sgd_op(D(p_out), D(p_in), D(g), D(buf), n, gscale, host(o), host(sums));
}
static int s_cast_bf16(uint16_t *dst, const float *src, size_t n)
{
    return expert_cast_bf16(D(dst), D(src), n);
}

expert_backend *expert_backend_sim_create(size_t mem_limit)
{
    expert_backend *be = calloc(1, sizeof *be);
    struct sim_state *s = calloc(1, sizeof *s);
    if (!be || !s || pthread_mutex_init(&s->mu, NULL) != 0) {
        free(be);
        free(s);
        return NULL;
    }
    s->limit = mem_limit;
    snprintf(be->name, sizeof be->name, "sim");
    be->device = EXPERT_DEVICE_SIM;
    be->precision = EXPERT_PRECISION_FP32;
    be->host_memory = 0;
    be->impl = s;
    be->alloc = sim_alloc;
    be->free = sim_free;
    be->upload = sim_upload;
    be->download = sim_download;
    be->copy = sim_copy;
    be->zero = sim_zero;
    be->sync = sim_sync;
    be->host_alloc = sim_host_alloc;
    be->host_free = sim_host_free;
    be->mem_info = sim_mem_info;
    struct expert_ops *o = &be->ops;
    o->name = "sim";
    o->linear_forward = s_linear_fwd;
    o->linear_backward = s_linear_bwd;
    o->bias_forward = s_bias_fwd;
    o->bias_backward = s_bias_bwd;
    o->layernorm_forward = s_ln_fwd;
    o->layernorm_backward = s_ln_bwd;
    o->gelu_forward = s_gelu_fwd;
    o->gelu_backward = s_gelu_bwd;
    o->bias_gelu_forward = s_bias_gelu_fwd;
    o->bias_gelu_backward = s_bias_gelu_bwd;
    o->residual_forward = s_res_fwd;
    o->residual_backward = s_res_bwd;
    o->crossentropy_forward = s_ce_fwd;
    o->crossentropy_backward = s_ce_bwd;
    o->softmax_forward = s_softmax_fwd;
    o->softmax_backward = s_softmax_bwd;
    o->attention_forward = s_att_fwd;
    o->attention_backward = s_att_bwd2;
    o->embedding_forward = s_emb_fwd;
    o->embedding_backward = s_emb_bwd;
    o->matmul_forward = s_mm_fwd;
    o->matmul_backward = s_mm_bwd;
    o->attention_sizes = expert_attention_sizes;
    o->sqnorm = s_sqnorm;
    o->adamw_update = s_adamw;
    o->sgd_update = s_sgd;
    o->cast_bf16 = s_cast_bf16;
    return be;
}

void expert_backend_sim_destroy(expert_backend **p)
{
    if (!p || !*p)
        return;
    struct sim_state *s = (*p)->impl;
    pthread_mutex_destroy(&s->mu);
    free(s);
    free(*p);
    *p = NULL;
}

size_t expert_backend_sim_used(const expert_backend *be)
{
    if (!be || be->device != EXPERT_DEVICE_SIM)
        return 0;
    struct sim_state *s = state_of(be);
    pthread_mutex_lock(&s->mu);
    size_t used = s->used;
    pthread_mutex_unlock(&s->mu);
    return used;
}
