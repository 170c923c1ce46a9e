/* tests/bench/gpu_gpt_bench.c: a GPT trained on one GPU through Starling's
 * blocks on the CUDA backend, measured as ../shared/bench/torch/gpt_bench.py
 * measures PyTorch (same shape, same step, same FLOP count, same MFU peaks),
 * so the two JSON lines compare field for field.
 *
 *   gpu_gpt_bench [--d 768] [--heads 12] [--layers 12] [--ctx 1024] [--batch 8]
 *                 [--vocab 256] [--precision bf16|fp32] [--steps 20] [--warmup 5]
 *                 [--stages 1|3] [--device N] [--peak-tflops X] [--lr 3e-4]
 *                 [--wd 0.01] [--seed 0] [--check-rows 1]
 *
 * Model: train_lm.py's GPT (pre-LN decoder layers, fused qkv, explicit causal
 * attention, exact GELU, hidden 4d, untied head) as three blocks on the GPU:
 *   --stages 1  EMBED (no layers) -> DECODER (all layers) -> LMHEAD (no layers)
 *   --stages 3  EMBED / DECODER / LMHEAD with a third of the layers each (the
 *               remainder in the DECODER), as three peers would hold it.
 * Step (gpt_bench.py's: forward, loss, backward, AdamW), all on the device:
 *   1. expert_block_forward_dev(keep = 1) through the blocks (device buffers;
 *      EMBED's tokens are host memory, as the block API takes them);
 *   2. the mean cross-entropy over the B·T positions on the device (be->ops,
 *      targets uploaded once as int32);
 *   3. expert_block_backward_dev in reverse order, at the forward's weight
 *      version, so the kept activations are used (no recompute);
 *   4. expert_block_step (AdamW, torch's formulas: betas 0.9/0.999, eps 1e-8,
 *      --lr, --wd decoupled, no clipping) on each block.
 * One fixed batch of random tokens and random targets (splitmix64 from
 * --seed), built before timing, as gpt_bench.py does. --warmup untimed steps,
 * then --steps timed ones, each bracketed by be->sync and clock_gettime.
 *
 * The loss is torch's mean: the blocks take the gradient of a loss SUMMED
 * over rows (sequences) and expert_block_step divides by the rows
 * accumulated (B), so the cross-entropy's dloss is 1/T (each row's loss the
 * mean over its T positions, as routing/trainer.c does); 1/(B·T) here would
 * divide by B twice.
 *
 * Check (--check-rows R, default 1; 0 skips it): after the timed steps, the
 * same model with the same seeds on the CPU (fp32 reference blocks) computes
 * the first R sequences' loss on the initial weights; it must agree with the
 * GPU's first-step loss on those rows (relative 2e-3 in fp32, 3e-2 in bf16).
 *
 * Output: progress on stderr; the last stdout line is one JSON object:
 *   tokens_per_s      B·T·steps / the timed steps' seconds (gpt_bench.py's)
 *   step_ms_median, step_ms_min, step_ms   the timed steps
 *   params            every parameter (86,235,904 at the defaults, as torch)
 *   params_matmul     N = L·12·d² + vocab·d
 *   flops_per_token   6·N + 12·L·T·d (gpt_bench.py's, so both MFUs agree)
 *   achieved_tflops   flops_per_token · tokens_per_s / 1e12
 *   peak_tflops, mfu  achieved / peak (989 bf16, 67 fp32; --peak-tflops)
 *   loss_first        the first warm-up step's loss (initial weights)
 *   loss_after_warmup the last warm-up step's (gpt_bench.py's field; null
 *                     without warm-up)
 *   loss_final        the last timed step's loss; losses: every step's
 *   loss_uniform      ln(vocab), what the first loss should be near
 *   gpu, driver, runtime   cuda_device_describe, cuda_versions
 *   mem_total_mib, mem_free_before_mib   be->mem_info before our blocks
 *   peak_mem_used_mib free before - the least free seen after any step
 *   mem_expected_mib  blocks + workspaces + our buffers, as the sizes say
 *   first_step_s, warmup_s, setup_s, precision, stages, stage_layers,
 *   shape, steps, warmup, seed, lr, wd, device, check {rows, loss_gpu,
 *   loss_cpu, rel_diff, tol, ok, cpu_s}
 * Exit 0; 77 (skipped) without CUDA in the build or without a device; 1 on
 * a failure (a JSON line with "ok":false says at which stage) or a failed
 * check; 2 usage.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda/cuda.h"
#include "expert/expert.h"

#include "bench_timing.h"

#define NBLK 3
#define SKIP 77

static const char *kind_label[NBLK] = { "embed", "decoder", "lm_head" };

struct opts {
    int d, heads, layers, ctx, batch, vocab;
    int precision;
    int steps, warmup, stages, device;
    double peak_tflops; /* <= 0: by precision */
    double lr, wd;
    uint64_t seed;
    int check_rows;
};

/* ---- output helpers ---- */

/* s as a JSON string body (quotes and control characters escaped). */
static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

/* A finite double, or null. */
static void json_num(FILE *f, double v, int digits)
{
    if (isfinite(v))
        fprintf(f, "%.*g", digits, v);
    else
        fputs("null", f);
}

static const char *g_stage = "setup";

/* The failure line and exit 1. */
static void fail(const struct opts *o, const char *what, int rc)
{
    char msg[512];
    const char *be_err = expert_backend_last_error();
    snprintf(msg, sizeof msg, "%s: %s (%d)%s%s", what, strerror(rc < 0 ? -rc : rc), rc,
             be_err && *be_err ? "; backend: " : "", be_err ? be_err : "");
    fprintf(stderr, "gpu_gpt_bench: %s\n", msg);
    printf("{\"bench\":\"gpu_gpt_bench\",\"ok\":false,\"stage\":\"%s\",\"precision\":\"%s\","
           "\"stages\":%d,\"error\":",
           g_stage, expert_precision_name(o->precision), o->stages);
    json_str(stdout, msg);
    printf("}\n");
    fflush(stdout);
    exit(1);
}

static void skip(const char *why)
{
    fprintf(stderr, "gpu_gpt_bench: skipped: %s\n", why);
    printf("{\"bench\":\"gpu_gpt_bench\",\"ok\":false,\"skipped\":true,\"reason\":");
    json_str(stdout, why);
    printf("}\n");
    fflush(stdout);
    exit(SKIP);
}

static void usage_to(FILE *f)
{
    fprintf(f,
            "usage: gpu_gpt_bench [--d 768] [--heads 12] [--layers 12] [--ctx 1024] [--batch 8]\n"
            "                     [--vocab 256] [--precision bf16|fp32] [--steps 20] [--warmup 5]\n"
            "                     [--stages 1|3] [--device N] [--peak-tflops X] [--lr 3e-4]\n"
            "                     [--wd 0.01] [--seed 0] [--check-rows 1]\n"
            "Trains train_lm.py's GPT on one GPU through the blocks on the CUDA backend\n"
            "(EMBED, DECODER, LMHEAD: --stages 1 puts every layer in the DECODER, --stages 3\n"
            "a third in each) and prints one JSON line as gpt_bench.py does. Exit 77 without\n"
            "CUDA in the build or without a device.\n");
}

static void usage(void)
{
    usage_to(stderr);
    exit(2);
}

static int parse_int(const char *v, int lo, int hi)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi)
        usage();
    return (int)x;
}

static double parse_double(const char *v)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(x))
        usage();
    return x;
}

static void parse_args(int argc, char **argv, struct opts *o)
{
    *o = (struct opts){ .d = 768, .heads = 12, .layers = 12, .ctx = 1024, .batch = 8, .vocab = 256,
                        .precision = EXPERT_PRECISION_BF16, .steps = 20, .warmup = 5, .stages = 1,
                        .device = 0, .peak_tflops = 0, .lr = 3e-4, .wd = 0.01, .seed = 0,
                        .check_rows = 1 };
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage_to(stdout);
            exit(0);
        }
        if (i + 1 >= argc)
            usage();
        const char *v = argv[++i];
        if (!strcmp(a, "--d"))
            o->d = parse_int(v, 1, EXPERT_BLOCK_MAX_DIM / 4);
        else if (!strcmp(a, "--heads"))
            o->heads = parse_int(v, 1, EXPERT_BLOCK_MAX_DIM);
        else if (!strcmp(a, "--layers"))
            o->layers = parse_int(v, 1, 3 * EXPERT_BLOCK_MAX_LAYERS);
        else if (!strcmp(a, "--ctx"))
            o->ctx = parse_int(v, 1, EXPERT_BLOCK_MAX_SEQ);
        else if (!strcmp(a, "--batch"))
            o->batch = parse_int(v, 1, 1 << 16);
        else if (!strcmp(a, "--vocab"))
            o->vocab = parse_int(v, 1, EXPERT_BLOCK_MAX_VOCAB);
        else if (!strcmp(a, "--precision")) {
            o->precision = expert_precision_parse(v);
            if (o->precision < 0)
                usage();
        } else if (!strcmp(a, "--steps"))
            o->steps = parse_int(v, 1, 1 << 20);
        else if (!strcmp(a, "--warmup"))
            o->warmup = parse_int(v, 0, 1 << 20);
        else if (!strcmp(a, "--stages")) {
            o->stages = parse_int(v, 1, 3);
            if (o->stages == 2)
                usage();
        } else if (!strcmp(a, "--device"))
            o->device = parse_int(strncmp(v, "cuda:", 5) == 0 ? v + 5 : v, 0, 1023);
        else if (!strcmp(a, "--peak-tflops"))
            o->peak_tflops = parse_double(v);
        else if (!strcmp(a, "--lr"))
            o->lr = parse_double(v);
        else if (!strcmp(a, "--wd"))
            o->wd = parse_double(v);
        else if (!strcmp(a, "--seed"))
            o->seed = (uint64_t)parse_int(v, 0, 1 << 30);
        else if (!strcmp(a, "--check-rows"))
            o->check_rows = parse_int(v, 0, 1 << 16);
        else
            usage();
    }
    if (o->d % o->heads) {
        fprintf(stderr, "gpu_gpt_bench: --d %d is not a multiple of --heads %d\n", o->d, o->heads);
        exit(2);
    }
    if (o->check_rows > o->batch)
        o->check_rows = o->batch;
}

/* ---- the model ---- */

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* The three blocks' configs and their layer counts. */
static int make_configs(const struct opts *o, struct expert_block_config cfg[NBLK], int layers[NBLK])
{
    if (o->stages == 3) {
        layers[0] = layers[2] = o->layers / 3;
        layers[1] = o->layers - 2 * (o->layers / 3);
    } else {
        layers[0] = layers[2] = 0;
        layers[1] = o->layers;
    }
    const int T = o->ctx, d = o->d;
    for (int i = 0; i < NBLK; i++) {
        cfg[i] = (struct expert_block_config){ .hidden = 4 * d, .dim = d, .heads = o->heads,
                                               .seq = T, .layers = layers[i] };
    }
    cfg[0].kind = EXPERT_BLOCK_EMBED;
    cfg[0].in = T;
    cfg[0].out = T * d;
    cfg[0].vocab = o->vocab;
    cfg[1].kind = EXPERT_BLOCK_DECODER;
    cfg[1].in = cfg[1].out = T * d;
    cfg[2].kind = EXPERT_BLOCK_LMHEAD;
    cfg[2].in = T * d;
    cfg[2].out = T * o->vocab;
    cfg[2].vocab = o->vocab;
    for (int i = 0; i < NBLK; i++) {
        if (layers[i] > EXPERT_BLOCK_MAX_LAYERS) {
            fprintf(stderr, "gpu_gpt_bench: %d layers in one block (at most %d): use --stages 3\n",
                    layers[i], EXPERT_BLOCK_MAX_LAYERS);
            return -EINVAL;
        }
        if (expert_block_config_check(&cfg[i]) != 0) {
            fprintf(stderr, "gpu_gpt_bench: bad %s config (d %d heads %d ctx %d layers %d vocab %d)\n",
                    kind_label[i], d, o->heads, T, layers[i], o->vocab);
            return -EINVAL;
        }
    }
    return 0;
}

/* The blocks, workspaces and device tensors of one training step. */
struct model {
    const expert_backend *be;
    int B, T, V;
    expert_block *b[NBLK];
    expert_workspace *ws[NBLK];
    float *act[NBLK];      /* device: each block's output (act[2] = logits) */
    float *grad[NBLK];     /* device: the loss's gradient w.r.t. act[i] */
    float *probs, *losses; /* device: (B·T, V), (B·T) */
    int32_t *targets;      /* device: (B·T) */
    const float *tokens;   /* host: (B, T) token ids as floats */
    struct expert_optim opt;
    struct expert_step_info info[NBLK];
};

/* One training step; returns 0 or fails (exit 1). */
static void train_step(const struct opts *o, struct model *m)
{
    const expert_backend *be = m->be;
    const int BT = m->B * m->T;
    uint64_t ver[NBLK];
    int rc;
    g_stage = "forward";
    for (int i = 0; i < NBLK; i++) {
        const float *inp = i == 0 ? m->tokens : m->act[i - 1];
        rc = expert_block_forward_dev(m->b[i], m->ws[i], m->act[i], inp, m->B, 1, &ver[i]);
        if (rc != 0)
            fail(o, kind_label[i], rc);
    }
    g_stage = "loss";
    rc = be->ops.crossentropy_forward(m->losses, m->probs, m->act[NBLK - 1], m->targets, BT, m->V);
    if (rc != 0)
        fail(o, "crossentropy_forward", rc);
    /* Each row's loss is the mean over its T positions; the step divides
     * the rows' summed gradient by B: torch's mean over B·T. */
    rc = be->ops.crossentropy_backward(m->grad[NBLK - 1], m->probs, m->targets, 1.0f / (float)m->T,
                                       BT, m->V);
    if (rc != 0)
        fail(o, "crossentropy_backward", rc);
    g_stage = "backward";
    for (int i = NBLK - 1; i >= 0; i--) {
        const float *inp = i == 0 ? m->tokens : m->act[i - 1];
        float *dinp = i == 0 ? NULL : m->grad[i - 1];
        uint64_t used = 0;
        rc = expert_block_backward_dev(m->b[i], m->ws[i], dinp, m->grad[i], inp, m->B, ver[i], &used);
        if (rc != 0)
            fail(o, kind_label[i], rc);
        if (used != ver[i])
            fail(o, "backward ran on another weight version than its forward", -ESTALE);
    }
    g_stage = "step";
    for (int i = 0; i < NBLK; i++) {
        rc = expert_block_step(m->b[i], &m->opt, &m->info[i]);
        if (rc != 0) {
            struct expert_block_health h;
            expert_block_health(m->b[i], &h);
            fprintf(stderr, "gpu_gpt_bench: %s step refused: %s\n", kind_label[i], h.last_refusal);
            fail(o, kind_label[i], rc);
        }
    }
}

/* Mean of n floats in double. */
static double mean_f(const float *x, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++)
        s += x[i];
    return n ? s / (double)n : NAN;
}

/* The first rows sequences' mean loss on the CPU (fp32 reference blocks
 * with the same configs and seeds: the initial weights). Returns 0 or
 * -errno; *out the loss, *secs the time taken. */
static int cpu_check(const struct expert_block_config cfg[NBLK], uint64_t seed, int rows, int V,
                     const float *tokens, const int32_t *targets, double *out, double *secs)
{
    double t0 = now();
    int rc = -ENOMEM;
    expert_block *b[NBLK] = { 0 };
    expert_workspace *ws[NBLK] = { 0 };
    float *x[NBLK] = { 0 };
    float *probs = NULL, *losses = NULL;
    const int T = cfg[0].seq;
    const size_t n = (size_t)rows * (size_t)T;
    for (int i = 0; i < NBLK; i++) {
        b[i] = expert_block_create(&cfg[i], seed + (uint64_t)i);
        ws[i] = expert_workspace_create(&cfg[i], rows);
        x[i] = malloc((size_t)rows * (size_t)cfg[i].out * sizeof(float));
        if (!b[i] || !ws[i] || !x[i])
            goto out;
    }
    probs = malloc(n * (size_t)V * sizeof(float));
    losses = malloc(n * sizeof(float));
    if (!probs || !losses)
        goto out;
    for (int i = 0; i < NBLK; i++) {
        rc = expert_block_forward(b[i], ws[i], x[i], i == 0 ? tokens : x[i - 1], rows, NULL);
        if (rc != 0)
            goto out;
    }
    rc = expert_crossentropy_forward(losses, probs, x[NBLK - 1], targets, (int)n, V);
    if (rc == 0)
        *out = mean_f(losses, n);
out:
    for (int i = 0; i < NBLK; i++) {
        free(x[i]);
        expert_workspace_destroy(&ws[i]);
        expert_block_destroy(&b[i]);
    }
    free(probs);
    free(losses);
    *secs = now() - t0;
    return rc;
}

static double mib(size_t bytes)
{
    return (double)bytes / (1024.0 * 1024.0);
}

int main(int argc, char **argv)
{
    expert_blas_prefer_native(argv);
    struct opts o;
    parse_args(argc, argv, &o);
    struct expert_block_config cfg[NBLK];
    int layers[NBLK];
    if (make_configs(&o, cfg, layers) != 0)
        return 2;

    /* The device, or a skip. */
    int ndev = cuda_device_count();
    if (ndev == -ENOSYS)
        skip("no CUDA in this build (meson -Dcuda=enabled on a machine with the CUDA Toolkit)");
    if (ndev <= 0) {
        char why[256];
        snprintf(why, sizeof why, "no CUDA device: %s", cuda_strerror(ndev == 0 ? -ENODEV : ndev));
        skip(why);
    }
    if (o.device >= ndev) {
        fprintf(stderr, "gpu_gpt_bench: --device %d: this machine has %d CUDA device(s)\n", o.device,
                ndev);
        return 2;
    }
    char err[512] = "";
    const expert_backend *be = NULL;
    int rc = cuda_backend_get(o.device, o.precision, &be, err, sizeof err);
    if (rc == -ENOSYS || rc == -ENODEV)
        skip(err[0] ? err : cuda_strerror(rc));
    if (rc != 0 || !be) {
        fprintf(stderr, "gpu_gpt_bench: %s\n", err);
        fail(&o, "cuda_backend_get", rc ? rc : -EINVAL);
    }
    char gpu[256] = "", driver[64] = "", runtime[64] = "";
    (void)cuda_device_describe(o.device, gpu, sizeof gpu);
    (void)cuda_versions(driver, sizeof driver, runtime, sizeof runtime);

    const int B = o.batch, T = o.ctx, V = o.vocab, d = o.d, L = o.layers;
    const size_t BT = (size_t)B * (size_t)T;

    /* Device memory: free before anything of ours, and the least free seen. */
    size_t free0 = 0, total = 0, free_min = 0, f = 0, t = 0;
    g_stage = "mem_info";
    if ((rc = be->mem_info(be, &free0, &total)) != 0)
        fail(&o, "mem_info", rc);
    free_min = free0;

    struct model m = { .be = be, .B = B, .T = T, .V = V };
    size_t expected = 0;
    for (int i = 0; i < NBLK; i++)
        expected += expert_block_bytes(&cfg[i], be) + expert_workspace_bytes(&cfg[i], be, B);
    expected += 2 * BT * (size_t)d * 2 * sizeof(float)          /* act, grad of embed, decoder */
                + 3 * BT * (size_t)V * sizeof(float)             /* logits, dlogits, probs */
                + BT * (sizeof(float) + sizeof(int32_t));        /* losses, targets */
    fprintf(stderr,
            "gpu_gpt_bench: %s, driver %s, runtime %s; %s d=%d H=%d L=%d (%d/%d/%d) T=%d B=%d "
            "vocab=%d; expect %.0f MiB of %.0f MiB free\n",
            gpu, driver, runtime, expert_precision_name(o.precision), d, o.heads, L, layers[0],
            layers[1], layers[2], T, B, V, mib(expected), mib(free0));

    g_stage = "create";
    double t_create = now();
    for (int i = 0; i < NBLK; i++) {
        m.b[i] = expert_block_create_on(&cfg[i], o.seed + (uint64_t)i, be);
        if (!m.b[i]) {
            char w[512];
            snprintf(w, sizeof w, "%s block: needs %.1f MiB of device memory", kind_label[i],
                     mib(expert_block_bytes(&cfg[i], be)));
            fail(&o, w, -ENOMEM);
        }
        m.ws[i] = expert_workspace_create_on(&cfg[i], B, be);
        if (!m.ws[i]) {
            char w[512];
            snprintf(w, sizeof w, "%s workspace: needs %.1f MiB of device memory", kind_label[i],
                     mib(expert_workspace_bytes(&cfg[i], be, B)));
            fail(&o, w, -ENOMEM);
        }
        size_t nout = (size_t)B * (size_t)cfg[i].out;
        m.act[i] = expert_backend_alloc(be, nout * sizeof(float));
        m.grad[i] = expert_backend_alloc(be, nout * sizeof(float));
        if (!m.act[i] || !m.grad[i])
            fail(&o, "activation buffers", -ENOMEM);
    }
    m.probs = expert_backend_alloc(be, BT * (size_t)V * sizeof(float));
    m.losses = expert_backend_alloc(be, BT * sizeof(float));
    m.targets = expert_backend_alloc(be, BT * sizeof(int32_t));
    if (!m.probs || !m.losses || !m.targets)
        fail(&o, "loss buffers", -ENOMEM);

    /* The batch: random tokens and targets, fixed for the run. */
    float *tokens = malloc(BT * sizeof(float));
    int32_t *targets = malloc(BT * sizeof(int32_t));
    float *losses_host = malloc(BT * sizeof(float));
    float *losses_first = malloc(BT * sizeof(float));
    int total_steps = o.warmup + o.steps;
    double *losses = calloc((size_t)total_steps, sizeof(double));
    double *times = calloc((size_t)o.steps, sizeof(double));
    double *sorted = calloc((size_t)o.steps, sizeof(double));
    if (!tokens || !targets || !losses_host || !losses_first || !losses || !times || !sorted)
        fail(&o, "host memory", -ENOMEM);
    uint64_t s = o.seed ^ 0x5EEDB47C0000ULL;
    for (size_t i = 0; i < BT; i++)
        tokens[i] = (float)(splitmix64(&s) % (uint64_t)V);
    for (size_t i = 0; i < BT; i++)
        targets[i] = (int32_t)(splitmix64(&s) % (uint64_t)V);
    m.tokens = tokens;
    g_stage = "upload";
    if ((rc = expert_backend_upload(be, m.targets, targets, BT * sizeof(int32_t))) != 0 ||
        (rc = expert_backend_sync(be)) != 0)
        fail(&o, "targets upload", rc);
    t_create = now() - t_create;

    expert_optim_default_adamw(&m.opt);
    m.opt.lr = (float)o.lr;
    m.opt.weight_decay = (float)o.wd;
    m.opt.clip_norm = 0;
    m.opt.target_batch = B;
    g_stage = "optimizer";
    if ((rc = expert_optim_check(&m.opt)) != 0)
        fail(&o, "bad --lr or --wd", rc);
    /* A benchmark measures: no relative or absolute gradient bounds (a
     * non-finite gradient is refused all the same, and fails the run). */
    struct expert_guard_config gc = { .factor = -1, .max_norm = -1 };
    for (int i = 0; i < NBLK; i++)
        if ((rc = expert_block_set_guard(m.b[i], &gc)) != 0)
            fail(&o, "expert_block_set_guard", rc);

    size_t nparams = 0;
    for (int i = 0; i < NBLK; i++)
        nparams += expert_block_nparams(m.b[i]);
    /* gpt_bench.py's count: N = the matmul weights. */
    const double n_matmul = (double)L * 12.0 * d * d + (double)V * d;
    const double flops_per_token = 6.0 * n_matmul + 12.0 * L * (double)T * d;

    /* Warm-up, then the timed steps. */
    double first_step_s = 0, warmup_s = 0, t_run = now();
    for (int k = 0; k < total_steps; k++) {
        g_stage = "sync";
        if ((rc = be->sync(be)) != 0)
            fail(&o, "sync before a step", rc);
        double t0 = now();
        train_step(&o, &m);
        g_stage = "sync";
        if ((rc = be->sync(be)) != 0)
            fail(&o, "sync after a step", rc);
        double dt = now() - t0;
        if (k == 0)
            first_step_s = dt;
        if (k >= o.warmup)
            times[k - o.warmup] = dt;
        if (k + 1 == o.warmup)
            warmup_s = now() - t_run;
        /* Outside the timer: the step's loss and the memory in use. */
        g_stage = "loss download";
        if ((rc = expert_backend_download(be, losses_host, m.losses, BT * sizeof(float))) != 0)
            fail(&o, "loss download", rc);
        losses[k] = mean_f(losses_host, BT);
        if (k == 0)
            memcpy(losses_first, losses_host, BT * sizeof(float));
        if (be->mem_info(be, &f, &t) == 0 && f < free_min)
            free_min = f;
        fprintf(stderr, "step %d/%d%s: loss %.5f, %.2f ms\n", k + 1, total_steps,
                k < o.warmup ? " (warm-up)" : "", losses[k], dt * 1e3);
        if (!isfinite(losses[k]))
            fail(&o, "non-finite loss", -ERANGE);
    }

    double sum = 0;
    for (int i = 0; i < o.steps; i++)
        sum += times[i];
    memcpy(sorted, times, (size_t)o.steps * sizeof(double));
    qsort(sorted, (size_t)o.steps, sizeof(double), cmp_d);
    double median = o.steps % 2 ? sorted[o.steps / 2]
                                : 0.5 * (sorted[o.steps / 2 - 1] + sorted[o.steps / 2]);
    double tps = (double)BT * o.steps / sum;
    double tflops = flops_per_token * tps / 1e12;
    double peak = o.peak_tflops > 0 ? o.peak_tflops
                  : o.precision == EXPERT_PRECISION_BF16 ? 989.0
                                                          : 67.0;
    const char *peak_src = o.peak_tflops > 0 ? "--peak-tflops"
                           : o.precision == EXPERT_PRECISION_BF16
                               ? "H100 SXM dense BF16 tensor core"
                               : "H100 SXM FP32 non-tensor";

    /* The CPU reference on the first rows, initial weights. */
    double loss_cpu = NAN, loss_gpu_rows = NAN, check_s = 0, rel = NAN;
    double tol = o.precision == EXPERT_PRECISION_BF16 ? 3e-2 : 2e-3;
    int check_ok = 1;
    if (o.check_rows > 0) {
        g_stage = "cpu check";
        fprintf(stderr, "gpu_gpt_bench: CPU reference forward on %d sequence(s)...\n", o.check_rows);
        rc = cpu_check(cfg, o.seed, o.check_rows, V, tokens, targets, &loss_cpu, &check_s);
        if (rc != 0)
            fail(&o, "CPU reference forward", rc);
        loss_gpu_rows = mean_f(losses_first, (size_t)o.check_rows * (size_t)T);
        rel = fabs(loss_gpu_rows - loss_cpu) / fabs(loss_cpu);
        check_ok = rel <= tol;
        fprintf(stderr, "gpu_gpt_bench: first-step loss on %d row(s): GPU %.6f, CPU %.6f (rel %.2e, tol %.0e) %s\n",
                o.check_rows, loss_gpu_rows, loss_cpu, rel, tol, check_ok ? "ok" : "MISMATCH");
    }

    FILE *out = stdout;
    fprintf(out, "{\"bench\":\"gpu_gpt_bench\",\"ok\":%s,\"precision\":\"%s\",\"stages\":%d,"
                 "\"stage_layers\":[%d,%d,%d],",
            check_ok ? "true" : "false", expert_precision_name(o.precision), o.stages, layers[0],
            layers[1], layers[2]);
    fprintf(out, "\"shape\":{\"d\":%d,\"heads\":%d,\"layers\":%d,\"ctx\":%d,\"batch\":%d,\"vocab\":%d,"
                 "\"hidden\":%d},",
            d, o.heads, L, T, B, V, 4 * d);
    fprintf(out, "\"steps\":%d,\"warmup\":%d,\"seed\":%llu,\"lr\":%g,\"wd\":%g,\"device\":%d,\"gpu\":",
            o.steps, o.warmup, (unsigned long long)o.seed, o.lr, o.wd, o.device);
    json_str(out, gpu);
    fputs(",\"driver\":", out);
    json_str(out, driver);
    fputs(",\"runtime\":", out);
    json_str(out, runtime);
    fprintf(out, ",\"params\":%zu,\"params_matmul\":%.0f,\"flops_per_token\":%.0f,"
                 "\"flops_formula\":\"6*N + 12*L*T*d, N = L*12*d^2 + vocab*d (gpt_bench.py)\",",
            nparams, n_matmul, flops_per_token);
    fprintf(out, "\"tokens_per_s\":%.1f,\"time_s\":%.4f,\"step_ms_median\":%.3f,\"step_ms_min\":%.3f,"
                 "\"step_ms\":[",
            tps, sum, median * 1e3, sorted[0] * 1e3);
    for (int i = 0; i < o.steps; i++)
        fprintf(out, "%s%.3f", i ? "," : "", times[i] * 1e3);
    fprintf(out, "],\"achieved_tflops\":%.3f,\"peak_tflops\":%g,\"peak_source\":\"%s\",\"mfu\":%.4f,",
            tflops, peak, peak_src, tflops / peak);
    fprintf(out, "\"first_step_s\":%.3f,\"warmup_s\":%.3f,\"setup_s\":%.3f,", first_step_s,
            warmup_s, t_create);
    fputs("\"loss_first\":", out);
    json_num(out, losses[0], 7);
    fputs(",\"loss_after_warmup\":", out);
    json_num(out, o.warmup > 0 ? losses[o.warmup - 1] : NAN, 7);
    fputs(",\"loss_final\":", out);
    json_num(out, losses[total_steps - 1], 7);
    fprintf(out, ",\"loss_uniform\":%.5f,\"losses\":[", log((double)V));
    for (int i = 0; i < total_steps; i++) {
        if (i)
            fputc(',', out);
        json_num(out, losses[i], 6);
    }
    fprintf(out, "],\"mem_total_mib\":%.1f,\"mem_free_before_mib\":%.1f,\"peak_mem_used_mib\":%.1f,"
                 "\"mem_expected_mib\":%.1f,",
            mib(total), mib(free0), mib(free0 - free_min), mib(expected));
    if (o.check_rows > 0) {
        fprintf(out, "\"check\":{\"rows\":%d,\"loss_gpu\":", o.check_rows);
        json_num(out, loss_gpu_rows, 7);
        fputs(",\"loss_cpu\":", out);
        json_num(out, loss_cpu, 7);
        fputs(",\"rel_diff\":", out);
        json_num(out, rel, 3);
        fprintf(out, ",\"tol\":%g,\"ok\":%s,\"cpu_s\":%.2f}", tol, check_ok ? "true" : "false",
                check_s);
    } else {
        fputs("\"check\":null", out);
    }
    fputs("}\n", out);
    fflush(out);

    for (int i = 0; i < NBLK; i++) {
        expert_backend_free(be, m.act[i]);
        expert_backend_free(be, m.grad[i]);
        expert_workspace_destroy(&m.ws[i]);
        expert_block_destroy(&m.b[i]);
    }
    expert_backend_free(be, m.probs);
    expert_backend_free(be, m.losses);
    expert_backend_free(be, m.targets);
    free(tokens);
    free(targets);
    free(losses_host);
    free(losses_first);
    free(losses);
    free(times);
    free(sorted);
    return check_ok ? 0 : 1;
}
