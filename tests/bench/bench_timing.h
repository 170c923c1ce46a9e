/* tests/bench/bench_timing.h: the timing loop the compute benchmarks share
 * (block_bench, lm_bench, attn_bench), as ../shared/bench/torch/compute.py
 * times torch: a warm-up of at least 3 calls and 0.2 s, then `chunks`
 * chunks of about min_time/chunks seconds each; the median per-call time. */
#ifndef BENCH_TIMING_H
#define BENCH_TIMING_H

#include <stdlib.h>
#include <time.h>

static inline double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef void (*bench_fn)(void *ctx);

static inline int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static inline double bench(bench_fn fn, void *ctx, double min_time, int chunks)
{
    double t0 = now();
    long n = 0;
    while (n < 3 || now() - t0 < 0.2) {
        fn(ctx);
        n++;
    }
    double per = (now() - t0) / (double)n;
    long iters = (long)(min_time / chunks / per);
    if (iters < 1)
        iters = 1;
    double ts[16];
    for (int c = 0; c < chunks; c++) {
        double t = now();
        for (long i = 0; i < iters; i++)
            fn(ctx);
        ts[c] = (now() - t) / (double)iters;
    }
    qsort(ts, (size_t)chunks, sizeof ts[0], cmp_d);
    return ts[chunks / 2];
}

#endif
