/* tests/bench/lm_bench.c: forward and forward+backward time of decoder
 * layers (a DECODER block, train_lm.py's Block), measured as block_bench.c
 * and ../shared/bench/torch/compute.py measure: warm-up (>= 3 calls and
 * 0.2 s), then 5 timed chunks of about min_time/5 seconds, the median
 * per-iteration time reported. fwd+bwd is expert_block_forward_backward
 * (output, input grad and accumulated param grads: the work of torch's
 * y = blk(x); y.backward(dy)). GFLOP/s counts matmul FLOPs as train_lm.py
 * does (per token and layer 24·d² + 4·T·d, the full T×T score matrix;
 * fwd+bwd = 3 × fwd). tests/bench/lm_bench.py runs it beside torch.
 *
 *   lm_bench [--d 256] [--seq 128] [--batch 8] [--heads 8] [--layers 1]
 *            [--hidden 4d] [--threads 1] [--min-time 1.5]
 * Last stdout line: one JSON object.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "expert/expert.h"

#include "bench_timing.h"

struct ctx {
    expert_block *b;
    expert_workspace *ws;
    float *x, *y, *dy, *dx;
    int B;
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
    /* Grads accumulate (the same cost as onto zeroed ones: beta=1 GEMMs). */
    if (expert_block_forward_backward(c->b, c->ws, c->y, c->dx, c->dy, c->x, c->B, NULL) != 0)
        abort();
    if (expert_block_accumulated(c->b) > (1 << 29))
        expert_block_zero_grad(c->b);
}

static void usage(void)
{
    fprintf(stderr, "usage: lm_bench [--d D] [--seq T] [--batch B] [--heads H] [--layers L] "
                    "[--hidden F] [--threads N] [--min-time S]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    expert_blas_prefer_native(argv);
    int d = 256, seq = 128, batch = 8, heads = 8, layers = 1, hidden = 0, threads = 1;
    double min_time = 1.5;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc)
            usage();
        const char *v = argv[++i];
        if (strcmp(a, "--d") == 0)
            d = atoi(v);
        else if (strcmp(a, "--seq") == 0)
            seq = atoi(v);
        else if (strcmp(a, "--batch") == 0)
            batch = atoi(v);
        else if (strcmp(a, "--heads") == 0)
            heads = atoi(v);
        else if (strcmp(a, "--layers") == 0)
            layers = atoi(v);
        else if (strcmp(a, "--hidden") == 0)
            hidden = atoi(v);
        else if (strcmp(a, "--threads") == 0)
            threads = atoi(v);
        else if (strcmp(a, "--min-time") == 0)
            min_time = atof(v);
        else
            usage();
    }
    if (hidden == 0)
        hidden = 4 * d;
    if (batch < 1 || threads < 1 || !(min_time > 0))
        usage();
    expert_blas_set_threads(threads);

    struct expert_block_config cfg = { 0 };
    cfg.kind = EXPERT_BLOCK_DECODER;
    cfg.in = cfg.out = seq * d;
    cfg.hidden = hidden;
    cfg.dim = d;
    cfg.heads = heads;
    cfg.seq = seq;
    cfg.layers = layers;
    if (expert_block_config_check(&cfg) != 0) {
        fprintf(stderr, "bad config: d %d seq %d heads %d layers %d hidden %d\n", d, seq, heads,
                layers, hidden);
        return 2;
    }
    struct ctx c = { 0 };
    c.b = expert_block_create(&cfg, 1);
    c.ws = expert_workspace_create(&cfg, batch);
    size_t n = (size_t)batch * (size_t)cfg.in;
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
    /* train_lm.py's count: per token and layer 2·(3d² + d² + 2·d·hidden) + 4·T·d. */
    double tokens = (double)batch * seq;
    double fl = expert_block_config_flops(&cfg, batch);
    int chunks = 5;
    double t_fwd = bench(run_fwd, &c, min_time, chunks);
    double t_fb = bench(run_fwd_bwd, &c, min_time, chunks);
    printf("decoder d=%d seq=%d batch=%d heads=%d layers=%d hidden=%d threads=%d core=%s: "
           "fwd %.3f ms (%.1f GFLOP/s), fwd+bwd %.3f ms (%.1f GFLOP/s, %.0f tokens/s)\n",
           d, seq, batch, heads, layers, hidden, threads, expert_blas_corename(), t_fwd * 1e3,
           fl / t_fwd / 1e9, t_fb * 1e3, 3.0 * fl / t_fb / 1e9, tokens / t_fb);
    printf("{\"bench\":\"lm_bench\",\"kind\":\"decoder_fwd_bwd\",\"d\":%d,\"seq\":%d,\"batch\":%d,"
           "\"heads\":%d,\"layers\":%d,\"hidden\":%d,\"threads\":%d,\"openblas_core\":\"%s\","
           "\"ms_per_iter\":%.4f,\"tokens_per_s\":%.1f,\"gflops\":%.2f,\"fwd_ms_per_iter\":%.4f,"
           "\"fwd_gflops\":%.2f}\n",
           d, seq, batch, heads, layers, hidden, threads, expert_blas_corename(), t_fb * 1e3,
           tokens / t_fb, 3.0 * fl / t_fb / 1e9, t_fwd * 1e3, fl / t_fwd / 1e9);
    free(c.x);
    free(c.y);
    free(c.dy);
    free(c.dx);
    expert_workspace_destroy(&c.ws);
    expert_block_destroy(&c.b);
    return 0;
}
