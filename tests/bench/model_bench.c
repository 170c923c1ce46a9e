/* tests/bench/model_bench.c: the whole model trained in one process on one
 * core with the swarm's own block code, the per-core reference for the
 * swarm's training throughput.
 *
 * Each iteration is what torch's train_local.py does per batch, split into
 * micro-batches as the swarm's trainer splits it: forward through every
 * stage keeping the activations (expert_block_forward_train), softmax
 * cross-entropy on the head's logits, backward through the stages in
 * reverse from the kept activations (expert_block_backward_kept, as a peer
 * that kept them), and an AdamW step (lr 1e-3) of every block once
 * --target-batch samples have accumulated: the peers' compute without the
 * network. Inputs and labels are random (the work does not depend on them).
 *
 * Side by side: `python3 train_local.py --threads 1:1` in ../shared/bench/
 * torch measures torch on one core with the same model; the swarm on N
 * cores cannot beat N times this figure. docs/benchmarks.md has the runs.
 *
 *   model_bench [--model fmnist-mlp] [--batch 64] [--target-batch 128]
 *               [--threads 1] [--min-time 5]
 * Last stdout line: one JSON object.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "expert/expert.h"

#define MAX_STAGES 16

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void usage(void)
{
    fprintf(stderr, "usage: model_bench [--model NAME] [--batch B] [--target-batch T] "
                    "[--threads N] [--min-time S]\n");
    exit(2);
}

static long parse_long(const char *flag, const char *v, long lo, long hi)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi) {
        fprintf(stderr, "model_bench: %s wants an integer in [%ld, %ld], got '%s'\n", flag, lo,
                hi, v);
        exit(2);
    }
    return x;
}

typedef struct model {
    int n;
    expert_block *b[MAX_STAGES];
    expert_workspace *ws[MAX_STAGES];
    float *act[MAX_STAGES + 1];   /* act[i] = input of stage i */
    float *grad[MAX_STAGES + 1];  /* grad[i] = gradient at act[i] */
    uint64_t ver[MAX_STAGES];
    float *losses, *probs;
    int32_t *targets;
    int B, classes;
} model;

/* One micro-batch: forward, loss, backward. Returns 0 or a negative errno. */
static int micro_batch(model *m)
{
    int rc;
    for (int i = 0; i < m->n; i++)
        if ((rc = expert_block_forward_train(m->b[i], m->ws[i], m->act[i + 1], m->act[i], m->B,
                                             &m->ver[i])) != 0)
            return rc;
    if ((rc = expert_crossentropy_forward(m->losses, m->probs, m->act[m->n], m->targets, m->B,
                                          m->classes)) != 0 ||
        (rc = expert_crossentropy_backward(m->grad[m->n], m->probs, m->targets, 1.0f, m->B,
                                           m->classes)) != 0)
        return rc;
    for (int i = m->n - 1; i >= 0; i--)
        if ((rc = expert_block_backward_kept(m->b[i], m->ws[i], i ? m->grad[i] : NULL,
                                             m->grad[i + 1], m->act[i], m->B, m->ver[i],
                                             NULL)) != 0)
            return rc;
    return 0;
}

int main(int argc, char **argv)
{
    expert_blas_prefer_native(argv);
    const char *name = "fmnist-mlp";
    long batch = 64, target = 128, threads = 1;
    double min_time = 5.0;
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc)
            usage();
        const char *a = argv[i], *v = argv[++i];
        if (strcmp(a, "--model") == 0)
            name = v;
        else if (strcmp(a, "--batch") == 0)
            batch = parse_long(a, v, 1, 4096);
        else if (strcmp(a, "--target-batch") == 0)
            target = parse_long(a, v, 1, 1 << 20);
        else if (strcmp(a, "--threads") == 0)
            threads = parse_long(a, v, 1, 256);
        else if (strcmp(a, "--min-time") == 0) {
            char *end;
            errno = 0;
            min_time = strtod(v, &end);
            if (errno || end == v || *end || !(min_time > 0 && min_time < 3600)) {
                fprintf(stderr, "model_bench: --min-time wants seconds in (0, 3600), got '%s'\n", v);
                exit(2);
            }
        } else
            usage();
    }
    const struct expert_model_spec *spec = expert_model_find(name);
    if (!spec) {
        fprintf(stderr, "model_bench: unknown model '%s'\n", name);
        return 2;
    }
    if (spec->n_stages > MAX_STAGES)
        return 2;
    if (spec->task != EXPERT_TASK_CLASSES) {
        /* The transformer kinds cannot run forward yet, and their loss is
         * per position: only classifier models are measured here. */
        fprintf(stderr, "model_bench: model '%s' is not a classifier; only classes tasks are benchmarked\n",
                name);
        return 2;
    }
    expert_blas_set_threads((int)threads);

    model m = { .n = spec->n_stages, .B = (int)batch, .classes = spec->n_out };
    uint64_t s = 7;
    for (int i = 0; i < m.n; i++) {
        struct expert_block_config c;
        if (expert_model_stage(spec, i, &c) != 0)
            return 2;
        m.b[i] = expert_block_create(&c, (uint64_t)i + 1);
        m.ws[i] = expert_workspace_create(&c, m.B);
        if (i == 0) {
            m.act[0] = malloc((size_t)m.B * (size_t)c.in * sizeof(float));
            m.grad[0] = NULL;
        }
        m.act[i + 1] = malloc((size_t)m.B * (size_t)c.out * sizeof(float));
        m.grad[i + 1] = malloc((size_t)m.B * (size_t)c.out * sizeof(float));
        if (!m.b[i] || !m.ws[i] || !m.act[0] || !m.act[i + 1] || !m.grad[i + 1]) {
            fprintf(stderr, "model_bench: out of memory\n");
            return 1;
        }
    }
    m.losses = malloc((size_t)m.B * sizeof(float));
    m.probs = malloc((size_t)m.B * (size_t)m.classes * sizeof(float));
    m.targets = malloc((size_t)m.B * sizeof(int32_t));
    if (!m.losses || !m.probs || !m.targets) {
        fprintf(stderr, "model_bench: out of memory\n");
        return 1;
    }
    for (long i = 0; i < m.B * (long)spec->n_in; i++) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        m.act[0][i] = (float)((double)(s >> 40) / 16777216.0 * 2.0 - 1.0);
    }
    for (int i = 0; i < m.B; i++)
        m.targets[i] = (int32_t)((unsigned)i * 7u % (unsigned)m.classes);

    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.target_batch = (int)target;
    /* Warm-up: a few steps' worth, then whole steps until min_time. */
    long per_step = (target + batch - 1) / batch, done = 0, steps = 0;
    double t0 = 0;
    for (long it = 0;; it++) {
        if (it == 3 * per_step)
            t0 = now();
        int rc = micro_batch(&m);
        for (int i = 0; rc == 0 && i < m.n; i++) {
            int st = expert_block_maybe_step(m.b[i], &o, NULL);
            if (st < 0)
                rc = st;
            else if (i == 0 && st == 1 && it >= 3 * per_step)
                steps++;
        }
        if (rc != 0) {
            fprintf(stderr, "model_bench: %s\n", strerror(-rc));
            return 1;
        }
        if (it >= 3 * per_step) {
            done += m.B;
            if ((it + 1) % per_step == 0 && now() - t0 >= min_time)
                break;
        }
    }
    double t = now() - t0;
    printf("model %s, micro-batch %ld, step every %ld samples, %ld thread(s), core %s: "
           "%.1f samples/s (%ld samples, %ld steps, %.2f s)\n",
           name, batch, target, threads, expert_blas_corename(), (double)done / t, done, steps,
           t);
    printf("{\"bench\":\"model_bench\",\"model\":\"%s\",\"batch\":%ld,\"target_batch\":%ld,"
           "\"threads\":%ld,\"openblas_core\":\"%s\",\"samples\":%ld,\"steps\":%ld,"
           "\"seconds\":%.3f,\"samples_per_s\":%.1f}\n",
           name, batch, target, threads, expert_blas_corename(), done, steps, t,
           (double)done / t);
    for (int i = 0; i < m.n; i++) {
        expert_block_destroy(&m.b[i]);
        expert_workspace_destroy(&m.ws[i]);
        free(m.act[i]);
        free(m.grad[i + 1]);
    }
    free(m.act[m.n]);
    free(m.losses);
    free(m.probs);
    free(m.targets);
    return 0;
}
