/* tests/bench/attn_bench.c: forward and forward+backward time of the CPU
 * causal attention op (expert_attention_forward/backward: the part of a
 * decoder layer between its qkv and proj Linears) at the two shapes of the
 * decoder-layer target, B=8 T=128 C=256 NH=8 and B=8 T=512 C=512 NH=8.
 * Timing as block_bench: warm-up (>= 3 calls and 0.2 s), then 5 chunks,
 * the median per-iteration time. GFLOP/s counts the matmul FLOPs of dense
 * attention, as PyTorch does them (q·kᵀ and att·v: 4·B·T²·C forward,
 * fwd+bwd = 3 × fwd), so it compares with torch's figures; the causal
 * kernels skip about half of that work.
 *
 *   attn_bench [--threads 2] [--min-time 1.0]
 * Last stdout line: one JSON object.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "expert/expert.h"

#include "bench_timing.h"

struct ctx {
    int B, T, C, NH;
    float *qkv, *out, *att, *scratch, *dout, *dqkv;
};

static void run_fwd(void *p)
{
    struct ctx *c = p;
    if (expert_attention_forward(c->out, c->att, c->qkv, c->B, c->T, c->C, c->NH) != 0)
        abort();
}

static void run_fwd_bwd(void *p)
{
    struct ctx *c = p;
    run_fwd(c);
    if (expert_attention_backward(c->dqkv, c->scratch, c->dout, c->qkv, c->att, c->B, c->T,
                                  c->C, c->NH) != 0)
        abort();
}

static void usage(void)
{
    fprintf(stderr, "usage: attn_bench [--threads T] [--min-time S]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    expert_blas_prefer_native(argv);
    int threads = 2;
    double min_time = 1.0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc)
            usage();
        const char *a = argv[i], *v = argv[++i];
        if (strcmp(a, "--threads") == 0)
            threads = atoi(v);
        else if (strcmp(a, "--min-time") == 0)
            min_time = atof(v);
        else
            usage();
    }
    if (threads < 1 || !(min_time > 0))
        usage();
    expert_blas_set_threads(threads);

    static const int shapes[2][4] = { { 8, 128, 256, 8 }, { 8, 512, 512, 8 } };
    double fwd_ms[2], fb_ms[2], fb_gf[2];
    for (int k = 0; k < 2; k++) {
        struct ctx c = { shapes[k][0], shapes[k][1], shapes[k][2], shapes[k][3],
                         NULL, NULL, NULL, NULL, NULL, NULL };
        size_t nqkv = (size_t)c.B * c.T * 3 * c.C, nout = (size_t)c.B * c.T * c.C,
               natt = (size_t)c.B * c.NH * c.T * c.T;
        c.qkv = malloc(nqkv * sizeof(float));
        c.dqkv = malloc(nqkv * sizeof(float));
        c.out = malloc(nout * sizeof(float));
        c.dout = malloc(nout * sizeof(float));
        c.att = malloc(natt * sizeof(float));
        c.scratch = malloc(natt * sizeof(float));
        if (!c.qkv || !c.dqkv || !c.out || !c.dout || !c.att || !c.scratch) {
            fprintf(stderr, "out of memory\n");
            return 1;
        }
        uint64_t s = 42;
        for (size_t i = 0; i < nqkv; i++) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            c.qkv[i] = (float)((double)(s >> 40) / 16777216.0 * 2.0 - 1.0);
        }
        for (size_t i = 0; i < nout; i++)
            c.dout[i] = c.qkv[(i * 7919) % nqkv] * 0.5f;
        double fl = 4.0 * c.B * (double)c.T * c.T * c.C;
        double t_f = bench(run_fwd, &c, min_time, 5), t_fb = bench(run_fwd_bwd, &c, min_time, 5);
        fwd_ms[k] = t_f * 1e3;
        fb_ms[k] = t_fb * 1e3;
        fb_gf[k] = 3.0 * fl / t_fb / 1e9;
        printf("attention B=%d T=%d C=%d NH=%d threads=%d core=%s: fwd %.3f ms (%.1f GFLOP/s), "
               "fwd+bwd %.3f ms (%.1f GFLOP/s)\n",
               c.B, c.T, c.C, c.NH, threads, expert_blas_corename(), fwd_ms[k], fl / t_f / 1e9,
               fb_ms[k], fb_gf[k]);
        free(c.qkv); free(c.dqkv); free(c.out); free(c.dout); free(c.att); free(c.scratch);
    }
    printf("{\"bench\":\"attn_bench\",\"threads\":%d,\"openblas_core\":\"%s\"", threads,
           expert_blas_corename());
    for (int k = 0; k < 2; k++)
        printf(",\"b%d_t%d_c%d_nh%d\":{\"fwd_ms\":%.4f,\"fwd_bwd_ms\":%.4f,\"fwd_bwd_gflops\":%.2f}",
               shapes[k][0], shapes[k][1], shapes[k][2], shapes[k][3], fwd_ms[k], fb_ms[k],
               fb_gf[k]);
    printf("}\n");
    return 0;
}
