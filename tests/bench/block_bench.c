/* tests/bench/block_bench.c: forward and forward+backward throughput of one
 * residual FFN block (y = x + W2·gelu(W1·LN(x)+b1)+b2), measured the way
 * ../shared/bench/torch/compute.py measures PyTorch, so the two compare one
 * to one: warm-up (>= 3 calls and 0.2 s), then 5 timed chunks of about
 * min_time/5 seconds, the median per-iteration time reported. fwd+bwd is
 * expert_block_forward_backward (output, input grad and accumulated param
 * grads: the work of torch's y = blk(x); y.backward(dy)). GFLOP/s counts
 * matmul FLOPs only, fwd+bwd = 3 × fwd, as compute.py does.
 *
 *   block_bench [--d 1024] [--hidden 4d] [--batch 256] [--threads 1]
 *               [--min-time 1.5] [--sgemm]
 * --sgemm also times cblas_sgemm 1024³ (as compute.py's sgemm line and
 * ../shared/bench/torch/sgemm_bench.c) and reports pct_of_sgemm.
 * Last stdout line: one JSON object.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cblas.h>

#include "expert/expert.h"

#include "bench_timing.h"

struct ctx {
    expert_block *b;
    expert_workspace *ws;
    float *x, *y, *dy, *dx;
    int B;
    const float *A, *Bm;
    float *C;
    int n;
};

static void run_fwd(void *p)
{
    struct ctx *c = p;
    if (expert_block_forward(c->b, c->ws, c->y, c->x, c->B, NULL) != 0)
        abort();
}

static void run_fwd_bwd(void *p)
{
    struct ctx *c = p;
    /* An expert serves each request on zeroed grads in the torch baseline
     * (grads reset to None); accumulation onto existing grads is the same
     * cost here (beta=1 GEMMs), so grads are simply left to accumulate. */
    if (expert_block_forward_backward(c->b, c->ws, c->y, c->dx, c->dy, c->x, c->B, NULL) != 0)
        abort();
    if (expert_block_accumulated(c->b) > (1 << 29))
        expert_block_zero_grad(c->b);
}

static void run_sgemm(void *p)
{
    struct ctx *c = p;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, c->n, c->n, c->n, 1.0f, c->A,
                c->n, c->Bm, c->n, 0.0f, c->C, c->n);
}

static void usage(void)
{
    fprintf(stderr, "usage: block_bench [--d D] [--hidden H] [--batch B] [--threads T] "
                    "[--min-time S] [--sgemm]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    expert_blas_prefer_native(argv);
    int d = 1024, hidden = 0, batch = 256, threads = 1, do_sgemm = 0;
    double min_time = 1.5;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--sgemm") == 0) {
            do_sgemm = 1;
            continue;
        }
        if (i + 1 >= argc)
            usage();
        const char *v = argv[++i];
        if (strcmp(a, "--d") == 0)
            d = atoi(v);
        else if (strcmp(a, "--hidden") == 0)
            hidden = atoi(v);
        else if (strcmp(a, "--batch") == 0)
            batch = atoi(v);
        else if (strcmp(a, "--threads") == 0)
            threads = atoi(v);
        else if (strcmp(a, "--min-time") == 0)
            min_time = atof(v);
        else
            usage();
    }
    if (hidden == 0)
        hidden = 4 * d;
    if (d < 1 || hidden < 1 || batch < 1 || threads < 1 || !(min_time > 0))
        usage();
    expert_blas_set_threads(threads);

    struct expert_block_config cfg = { EXPERT_BLOCK_RESFFN, d, d, hidden };
    struct ctx c = { 0 };
    c.b = expert_block_create(&cfg, 1);
    c.ws = expert_workspace_create(&cfg, batch);
    size_t n = (size_t)batch * d;
    c.x = malloc(n * sizeof(float));
    c.y = malloc(n * sizeof(float));
    c.dy = malloc(n * sizeof(float));
    c.dx = malloc(n * sizeof(float));
    if (!c.b || !c.ws || !c.x || !c.y || !c.dy || !c.dx) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    c.B = batch;
    uint64_t s = 42;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        c.x[i] = (float)((double)(s >> 40) / 16777216.0 * 2.0 - 1.0);
        c.dy[i] = c.x[(i * 7919) % n] * 0.5f;
    }
    double fl = expert_block_config_flops(&cfg, batch);
    int chunks = 5;
    double t_fwd = bench(run_fwd, &c, min_time, chunks);
    double t_fb = bench(run_fwd_bwd, &c, min_time, chunks);
    double sgemm_gflops = 0.0;
    if (do_sgemm) {
        c.n = 1024;
        size_t nn = (size_t)c.n * c.n;
        float *A = malloc(nn * sizeof(float)), *Bm = malloc(nn * sizeof(float));
        c.C = malloc(nn * sizeof(float));
        if (!A || !Bm || !c.C)
            return 1;
        for (size_t i = 0; i < nn; i++) {
            A[i] = (float)(i % 17) * 0.01f;
            Bm[i] = (float)(i % 13) * 0.01f;
        }
        c.A = A;
        c.Bm = Bm;
        double t = bench(run_sgemm, &c, min_time, chunks);
        sgemm_gflops = 2.0 * c.n * c.n * (double)c.n / t / 1e9;
        free(A);
        free(Bm);
        free(c.C);
    }
    double fb_gflops = 3.0 * fl / t_fb / 1e9;
    printf("resffn d=%d hidden=%d batch=%d threads=%d core=%s: fwd %.3f ms (%.1f GFLOP/s), "
           "fwd+bwd %.3f ms (%.1f GFLOP/s, %.0f samples/s)\n",
           d, hidden, batch, threads, expert_blas_corename(), t_fwd * 1e3, fl / t_fwd / 1e9,
           t_fb * 1e3, fb_gflops, batch / t_fb);
    printf("{\"bench\":\"block_bench\",\"kind\":\"resffn_fwd_bwd\",\"d\":%d,\"hidden\":%d,"
           "\"batch\":%d,\"threads\":%d,\"openblas_core\":\"%s\",\"ms_per_iter\":%.4f,"
           "\"samples_per_s\":%.1f,\"gflops\":%.2f,\"fwd_ms_per_iter\":%.4f,"
           "\"fwd_samples_per_s\":%.1f,\"fwd_gflops\":%.2f",
           d, hidden, batch, threads, expert_blas_corename(), t_fb * 1e3, batch / t_fb,
           fb_gflops, t_fwd * 1e3, batch / t_fwd, fl / t_fwd / 1e9);
    if (do_sgemm)
        printf(",\"sgemm_gflops\":%.2f,\"pct_of_sgemm\":%.1f", sgemm_gflops,
               100.0 * fb_gflops / sgemm_gflops);
    printf("}\n");
    free(c.x);
    free(c.y);
    free(c.dy);
    free(c.dx);
    expert_workspace_destroy(&c.ws);
    expert_block_destroy(&c.b);
    return 0;
}
