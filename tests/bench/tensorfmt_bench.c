/* tests/bench/tensorfmt_bench.c: encode and decode throughput of the
 * compressed tensor formats (net/tensorfmt.h) on one thread.
 *
 * n float32 values (default 1M = 2^20, random, magnitudes 1e-6..1e4 as
 * activations and gradients have) are encoded and decoded in each format,
 * Q8 with its default block of 64; Q8 and BF16 also with error feedback.
 * Throughput is GB/s (1e9 bytes/s) of float32 input, 4n bytes per call,
 * timed as the other benchmarks do (bench_timing.h: warm-up, then the
 * median of `chunks` chunks); "rt" is one encode plus one decode.
 *
 *   tensorfmt_bench [--n N] [--min-time S]
 * stdout: one JSON line.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/tensorfmt.h"

#include "bench_timing.h"

struct ctx {
    peer_fmt fmt;
    int block;
    size_t n, len;
    const float *x;
    float *y, *r;
    void *buf;
};

static void run_enc(void *p)
{
    struct ctx *c = p;
    if (peer_tensorfmt_encode(c->fmt, c->block, c->x, c->n, c->buf, c->len) != (long)c->len)
        abort();
}

static void run_dec(void *p)
{
    struct ctx *c = p;
    if (peer_tensorfmt_decode(c->fmt, c->block, c->buf, c->len, c->n, c->y) != 0)
        abort();
}

static void run_ef(void *p)
{
    struct ctx *c = p;
    if (peer_tensorfmt_encode_ef(c->fmt, c->block, c->x, c->n, c->r, c->buf, c->len) !=
        (long)c->len)
        abort();
}

static void run_sr(void *p)
{
    struct ctx *c = p;
    if (peer_tensorfmt_encode_sr(c->fmt, c->block, c->x, c->n, 42, c->buf, c->len) != (long)c->len)
        abort();
}

static void usage(void)
{
    fprintf(stderr, "usage: tensorfmt_bench [--n N] [--min-time S]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    size_t n = (size_t)1 << 20;
    double min_time = 0.5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--n") && i + 1 < argc)
            n = (size_t)strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--min-time") && i + 1 < argc)
            min_time = atof(argv[++i]);
        else
            usage();
    }
    if (n < 1 || min_time <= 0)
        usage();
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y), *r = calloc(n, sizeof *r);
    void *buf = malloc(4 * n + 4 * (n / 16 + 1));
    if (!x || !y || !r || !buf) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    uint32_t s = 12345u;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        double u = (double)(s >> 8) * 0x1.0p-24;
        double m = exp(log(1e-6) + u * (log(1e4) - log(1e-6)));
        x[i] = (float)((s & 1) ? -m : m);
    }

    const int chunks = 5;
    double gb = 4.0 * (double)n / 1e9;
    printf("{\"bench\":\"tensorfmt_bench\",\"n\":%zu,\"q8_block\":%d", n, PEER_FMT_Q8_BLOCK);
    for (int f = 0; f < PEER_FMT_COUNT; f++) {
        struct ctx c = {.fmt = (peer_fmt)f, .block = f == PEER_FMT_Q8 ? PEER_FMT_Q8_BLOCK : 0,
                        .n = n, .x = x, .y = y, .r = r, .buf = buf};
        c.len = peer_tensorfmt_size(c.fmt, c.block, n);
        const char *name = peer_tensorfmt_name(c.fmt);
        double te = bench(run_enc, &c, min_time, chunks);
        double td = bench(run_dec, &c, min_time, chunks);
        printf(",\"%s_bytes_per_value\":%.4f,\"%s_enc_gbs\":%.2f,\"%s_dec_gbs\":%.2f,"
               "\"%s_rt_gbs\":%.2f",
               name, (double)c.len / (double)n, name, gb / te, name, gb / td, name,
               gb / (te + td));
        if (c.fmt == PEER_FMT_Q8 || c.fmt == PEER_FMT_BF16) {
            memset(r, 0, n * sizeof *r);
            double tf = bench(run_ef, &c, min_time, chunks);
            printf(",\"%s_ef_enc_gbs\":%.2f", name, gb / tf);
        }
        if (c.fmt == PEER_FMT_Q8) {
            double ts = bench(run_sr, &c, min_time, chunks);
            printf(",\"%s_sr_enc_gbs\":%.2f", name, gb / ts);
        }
    }
    printf("}\n");
    free(x);
    free(y);
    free(r);
    free(buf);
    return 0;
}
