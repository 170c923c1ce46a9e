/* tests/test_expert_lm.c: the transformer blocks (embed, decoder, lm_head)
 * against one training step of ../shared/bench/torch/train_lm.py's ByteGPT
 * (fixture tests/ref/lm.bin, written by tests/ref/gen_lm.py).
 *
 * The 2-layer model is cut into pipeline stages in several ways; each split
 * must give torch's activations at its stage boundaries, its logits and mean
 * loss, its parameter gradients (of the mean loss over the B·T positions:
 * the blocks accumulate the gradient of a loss summed over rows, so the test
 * feeds dlogits = (probs − onehot)/T per position and divides the
 * accumulated gradients by B, as a step does), and, after one AdamW step
 * through expert_block_step, torch's updated parameters and loss. The kept-
 * activations backward must equal the recomputing one, inference must equal
 * the training forward, a bad token must be refused, and a checkpoint must
 * round-trip. Every comparison prints its worst element. */
#include "test_expert_util.h"

#include <errno.h>

#include "expert/block.h"
#include "expert/ops.h"
#include "expert/optim.h"
#include "expert/model.h"

#define MAX_STAGES 4

/* ---- the fixture (format: tests/ref/gen_lm.py) ---- */

struct lm_fix {
    int d, layers, heads, T, V, hidden, B;
    size_t np;
    float *params, *logits, *grads, *acts, *params_after;
    int32_t *x, *y;
    float loss, loss_after;
};

static int32_t *read_i32(struct tx_file *f, size_t n)
{
    float *raw = tx_file_f32(f, n); /* 4 bytes each, copied as they are */
    int32_t *v = calloc(n, sizeof *v);
    assert_non_null(v);
    memcpy(v, raw, n * sizeof *v);
    free(raw);
    return v;
}

static float read_f32(struct tx_file *f)
{
    float *p = tx_file_f32(f, 1), v = *p;
    free(p);
    return v;
}

static void fix_load(struct lm_fix *fx)
{
    struct tx_file f;
    tx_file_open(&f, "lm.bin");
    assert_int_equal(tx_file_u32(&f), 1);
    assert_int_equal(tx_file_u32(&f), 200);
    fx->d = (int)tx_file_u32(&f);
    fx->layers = (int)tx_file_u32(&f);
    fx->heads = (int)tx_file_u32(&f);
    fx->T = (int)tx_file_u32(&f);
    fx->V = (int)tx_file_u32(&f);
    fx->hidden = (int)tx_file_u32(&f);
    fx->B = (int)tx_file_u32(&f);
    fx->np = tx_file_u32(&f);
    assert_int_equal(fx->layers, 2); /* the splits below assume it */
    size_t bt = (size_t)fx->B * (size_t)fx->T, np = fx->np;
    fx->params = tx_file_f32(&f, np);
    fx->x = read_i32(&f, bt);
    fx->y = read_i32(&f, bt);
    fx->logits = tx_file_f32(&f, bt * (size_t)fx->V);
    fx->loss = read_f32(&f);
    fx->grads = tx_file_f32(&f, np);
    fx->acts = tx_file_f32(&f, (size_t)(fx->layers + 1) * bt * (size_t)fx->d);
    fx->loss_after = read_f32(&f);
    fx->params_after = tx_file_f32(&f, np);
    tx_file_close(&f);
}

static void fix_free(struct lm_fix *fx)
{
    free(fx->params); free(fx->logits); free(fx->grads); free(fx->acts);
    free(fx->params_after); free(fx->x); free(fx->y);
}

/* The activation after k decoder layers (k = 0: the embedding), (B,T,d). */
static const float *fix_act(const struct lm_fix *fx, int k)
{
    return fx->acts + (size_t)k * (size_t)fx->B * (size_t)fx->T * (size_t)fx->d;
}

/* ---- a model cut into stages ---- */

struct split {
    const char *name;
    int n;
    int kind[MAX_STAGES], layers[MAX_STAGES];
};

struct chain {
    const struct lm_fix *fx;
    const struct split *sp;
    struct expert_block_config cfg[MAX_STAGES];
    expert_block *b[MAX_STAGES];
    expert_workspace *ws[MAX_STAGES];
    size_t off[MAX_STAGES];       /* the stage's first float in the flat vector */
    float *act[MAX_STAGES + 1];   /* act[0] = tokens as floats; act[s+1] = stage s's out */
    float *grad[MAX_STAGES + 1];  /* grad[s] = d loss / d act[s] (s >= 1) */
    float *probs, *losses;
};

static struct expert_block_config stage_config(const struct lm_fix *fx, int kind, int layers)
{
    struct expert_block_config c = { 0 };
    int row = fx->T * fx->d;
    c.kind = kind;
    c.in = kind == EXPERT_BLOCK_EMBED ? fx->T : row;
    c.out = kind == EXPERT_BLOCK_LMHEAD ? fx->T * fx->V : row;
    c.hidden = fx->hidden;
    c.dim = fx->d;
    c.heads = fx->heads;
    c.seq = fx->T;
    c.layers = layers;
    c.vocab = kind == EXPERT_BLOCK_DECODER ? 0 : fx->V;
    return c;
}

static void chain_build(struct chain *ch, const struct lm_fix *fx, const struct split *sp)
{
    memset(ch, 0, sizeof *ch);
    ch->fx = fx;
    ch->sp = sp;
    size_t bt = (size_t)fx->B * (size_t)fx->T, off = 0;
    ch->act[0] = tx_alloc(bt);
    for (size_t i = 0; i < bt; i++)
        ch->act[0][i] = (float)fx->x[i];
    for (int s = 0; s < sp->n; s++) {
        ch->cfg[s] = stage_config(fx, sp->kind[s], sp->layers[s]);
        assert_int_equal(expert_block_config_check(&ch->cfg[s]), 0);
        ch->b[s] = expert_block_create(&ch->cfg[s], 1000u + (uint64_t)s);
        assert_non_null(ch->b[s]);
        ch->ws[s] = expert_workspace_create(&ch->cfg[s], fx->B + 1);
        assert_non_null(ch->ws[s]);
        ch->off[s] = off;
        off += expert_block_nparams(ch->b[s]);
        assert_true(off <= fx->np);
        assert_int_equal(expert_block_set_params(ch->b[s], fx->params + ch->off[s]), 0);
        ch->act[s + 1] = tx_alloc((size_t)fx->B * (size_t)ch->cfg[s].out);
        ch->grad[s + 1] = tx_alloc((size_t)fx->B * (size_t)ch->cfg[s].out);
    }
    if (off != fx->np)
        fprintf(stderr, "split %s: the stages hold %zu parameters, torch's model %zu\n",
                sp->name, off, fx->np);
    assert_int_equal(off, fx->np);
    ch->probs = tx_alloc(bt * (size_t)fx->V);
    ch->losses = tx_alloc(bt);
}

static void chain_free(struct chain *ch)
{
    for (int s = 0; s < ch->sp->n; s++) {
        expert_block_destroy(&ch->b[s]);
        expert_workspace_destroy(&ch->ws[s]);
    }
    for (int s = 0; s <= ch->sp->n; s++) {
        free(ch->act[s]);
        free(ch->grad[s]);
    }
    free(ch->probs);
    free(ch->losses);
}

/* "stage 1 (decoder) tensor 14 fc1_w [3]" for flat index i of the model. */
static void describe(const struct chain *ch, size_t i, char *buf, size_t len)
{
    snprintf(buf, len, "?");
    for (int s = ch->sp->n - 1; s >= 0; s--) {
        if (i < ch->off[s])
            continue;
        int nt;
        const struct expert_tensor_info *t = expert_block_tensors(ch->b[s], &nt, NULL);
        size_t r = i - ch->off[s];
        for (int k = 0; k < nt; k++)
            if (r >= t[k].offset && r < t[k].offset + t[k].count) {
                snprintf(buf, len, "stage %d (%s) tensor %d %s [%zu]", s,
                         expert_block_kind_name(ch->cfg[s].kind), k, t[k].name,
                         r - t[k].offset);
                return;
            }
        return;
    }
}

/* Compares got with want: miss when !(|got-want| <= atol + rtol·|want|)
 * (NaN-safe). Always prints one line: misses, max abs and rel error (rel
 * over |want| > 1e-6) and the worst element (largest error / tolerance),
 * named through ch when given (flat parameter index). Returns misses. */
static double worst_abs_seen, worst_rel_seen;

static int compare(const char *what, const float *got, const float *want, size_t n,
                   double atol, double rtol, const struct chain *named)
{
    int miss = 0;
    size_t worst = 0;
    double worst_ratio = -1.0, maxabs = 0.0, maxrel = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        double tol = atol + rtol * fabs((double)want[i]);
        double ratio = isnan(d) ? INFINITY : d / (tol > 0.0 ? tol : 1e-30);
        if (!(d <= tol))
            miss++;
        if (ratio > worst_ratio) {
            worst_ratio = ratio;
            worst = i;
        }
        if (!(d <= maxabs))
            maxabs = d;
        if (fabs((double)want[i]) > 1e-6 && !(d / fabs((double)want[i]) <= maxrel))
            maxrel = d / fabs((double)want[i]);
    }
    char where[128] = "";
    if (named && n)
        describe(named, worst, where, sizeof where);
    fprintf(stderr, "  %-44s %s: %d/%zu miss, max abs %.3g, max rel %.3g; worst [%zu]%s%s "
            "got %.8g want %.8g\n", what, miss ? "FAIL" : "ok", miss, n, maxabs, maxrel, worst,
            *where ? " " : "", where, n ? (double)got[worst] : 0.0,
            n ? (double)want[worst] : 0.0);
    if (maxabs > worst_abs_seen)
        worst_abs_seen = maxabs;
    if (maxrel > worst_rel_seen)
        worst_rel_seen = maxrel;
    return miss;
}

static int compare_scalar(const char *what, double got, double want, double rtol)
{
    double d = fabs(got - want);
    int miss = !(d <= rtol * fabs(want));
    fprintf(stderr, "  %-44s %s: got %.8g want %.8g (rel %.3g)\n", what, miss ? "FAIL" : "ok",
            got, want, d / fabs(want));
    return miss;
}

/* The forward through every stage. mode 0: expert_block_forward_train,
 * 1: expert_block_forward (inference). Checks each stage boundary against
 * torch's activations, the logits and the mean loss. Returns misses. */
static int chain_forward(struct chain *ch, int mode, const char *tag)
{
    const struct lm_fix *fx = ch->fx;
    int miss = 0, B = fx->B, done = 0;
    size_t bt = (size_t)B * (size_t)fx->T;
    char what[96];
    for (int s = 0; s < ch->sp->n; s++) {
        int rc = mode == 0
                     ? expert_block_forward_train(ch->b[s], ch->ws[s], ch->act[s + 1], ch->act[s], B, NULL)
                     : expert_block_forward(ch->b[s], ch->ws[s], ch->act[s + 1], ch->act[s], B, NULL);
        if (rc != 0)
            fprintf(stderr, "%s: stage %d forward returned %d\n", tag, s, rc);
        assert_int_equal(rc, 0);
        done += ch->cfg[s].layers;
        if (ch->cfg[s].kind != EXPERT_BLOCK_LMHEAD) {
            snprintf(what, sizeof what, "%s: stage %d out = torch act %d", tag, s, done);
            miss += compare(what, ch->act[s + 1], fix_act(fx, done), bt * (size_t)fx->d, 1e-5, 1e-4,
                            NULL);
        }
    }
    const float *logits = ch->act[ch->sp->n];
    snprintf(what, sizeof what, "%s: logits", tag);
    miss += compare(what, logits, fx->logits, bt * (size_t)fx->V, 1e-5, 1e-4, NULL);
    assert_int_equal(expert_crossentropy_forward(ch->losses, ch->probs, logits, fx->y, (int)bt, fx->V), 0);
    double sum = 0.0;
    for (size_t i = 0; i < bt; i++)
        sum += ch->losses[i];
    snprintf(what, sizeof what, "%s: mean loss", tag);
    miss += compare_scalar(what, sum / (double)bt, fx->loss, 1e-4);
    return miss;
}

/* dlogits for the mean loss as the blocks want it (see the top). */
static void chain_dlogits(struct chain *ch)
{
    const struct lm_fix *fx = ch->fx;
    int bt = fx->B * fx->T;
    assert_int_equal(expert_crossentropy_backward(ch->grad[ch->sp->n], ch->probs, fx->y,
                                                  1.0f / (float)fx->T, bt, fx->V), 0);
}

/* Stage s's input gradient buffer, or NULL for the first stage. */
static float *dinp_of(struct chain *ch, int s)
{
    return s == 0 ? NULL : ch->grad[s];
}

/* All stages' accumulated gradients / B into g (np floats). */
static void chain_grads(struct chain *ch, float *g)
{
    const struct lm_fix *fx = ch->fx;
    for (int s = 0; s < ch->sp->n; s++) {
        assert_int_equal(expert_block_accumulated(ch->b[s]), fx->B);
        expert_block_copy_grads(ch->b[s], g + ch->off[s]);
    }
    for (size_t i = 0; i < fx->np; i++)
        g[i] /= (float)fx->B;
}

/* One split, every check. */
static void run_split(const struct split *sp)
{
    struct lm_fix fx;
    fix_load(&fx);
    struct chain ch;
    chain_build(&ch, &fx, sp);
    fprintf(stderr, "split %s:\n", sp->name);
    int miss = 0, B = fx.B, n = sp->n;
    size_t np = fx.np;
    float *g = tx_alloc(np), *g_kept = tx_alloc(np);
    uint64_t ver[MAX_STAGES];

    /* Training forward, then the recomputing backward. */
    miss += chain_forward(&ch, 0, "forward_train");
    float *logits_train = tx_alloc((size_t)B * (size_t)ch.cfg[n - 1].out);
    memcpy(logits_train, ch.act[n], (size_t)B * (size_t)ch.cfg[n - 1].out * sizeof(float));
    chain_dlogits(&ch);
    for (int s = n - 1; s >= 0; s--) {
        int rc = expert_block_backward(ch.b[s], ch.ws[s], dinp_of(&ch, s), ch.grad[s + 1],
                                       ch.act[s], B, NULL);
        if (rc != 0)
            fprintf(stderr, "stage %d backward returned %d\n", s, rc);
        assert_int_equal(rc, 0);
    }
    chain_grads(&ch, g);
    miss += compare("grads (recomputing backward) / B", g, fx.grads, np, 5e-7, 1e-3, &ch);

    /* Kept activations: forward_train, save the rows, load them into fresh
     * workspaces, backward_kept: the same gradients. */
    for (int s = 0; s < n; s++)
        expert_block_zero_grad(ch.b[s]);
    miss += chain_forward(&ch, 0, "forward_train again");
    expert_workspace *ws2[MAX_STAGES] = { 0 };
    float *saved[MAX_STAGES] = { 0 };
    for (int s = 0; s < n; s++) {
        /* the versions the forward used (none changes in between) */
        ver[s] = expert_block_version(ch.b[s]);
        size_t kf = expert_workspace_kept_floats(ch.ws[s]); /* (embed(0) may keep nothing) */
        saved[s] = tx_alloc((size_t)B * kf);
        assert_int_equal(expert_workspace_save_rows(ch.ws[s], 0, B, saved[s]), 0);
        ws2[s] = expert_workspace_create(&ch.cfg[s], B + 1);
        assert_non_null(ws2[s]);
        assert_int_equal(expert_workspace_kept_floats(ws2[s]), kf);
        assert_int_equal(expert_workspace_load_rows(ws2[s], 0, B, saved[s]), 0);
    }
    chain_dlogits(&ch);
    for (int s = n - 1; s >= 0; s--) {
        uint64_t v = 99;
        int rc = expert_block_backward_kept(ch.b[s], ws2[s], dinp_of(&ch, s), ch.grad[s + 1],
                                            ch.act[s], B, ver[s], &v);
        if (rc != 0)
            fprintf(stderr, "stage %d backward_kept returned %d\n", s, rc);
        assert_int_equal(rc, 0);
        assert_true(v == ver[s]);
    }
    chain_grads(&ch, g_kept);
    miss += compare("grads kept vs recomputing", g_kept, g, np, 1e-6, 1e-5, &ch);
    for (int s = 0; s < n; s++) {
        expert_workspace_destroy(&ws2[s]);
        free(saved[s]);
    }

    /* Inference gives the training forward's logits (and torch's). */
    miss += chain_forward(&ch, 1, "forward (inference)");
    miss += compare("inference logits vs forward_train", ch.act[n], logits_train,
                    (size_t)B * (size_t)ch.cfg[n - 1].out, 1e-6, 1e-5, NULL);
    /* One row alone gives the same row as in the batch. */
    {
        struct chain *c = &ch;
        const float *in = c->act[0] + (size_t)(B - 1) * (size_t)c->cfg[0].in;
        float *cur = tx_alloc((size_t)c->cfg[0].in), *nxt;
        memcpy(cur, in, (size_t)c->cfg[0].in * sizeof(float));
        for (int s = 0; s < n; s++) {
            nxt = tx_alloc((size_t)c->cfg[s].out);
            assert_int_equal(expert_block_forward(c->b[s], c->ws[s], nxt, cur, 1, NULL), 0);
            free(cur);
            cur = nxt;
        }
        size_t o = (size_t)c->cfg[n - 1].out;
        miss += compare("last row alone vs in the batch", cur, logits_train + (size_t)(B - 1) * o,
                        o, 1e-6, 1e-5, NULL);
        free(cur);
    }

    /* One AdamW step (lr 1e-3, no decay, no clipping) on the gradients of
     * the kept backward (= the recomputing one's, checked above). */
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.lr = 1e-3f;
    o.beta1 = 0.9f;
    o.beta2 = 0.999f;
    o.eps = 1e-8f;
    o.weight_decay = 0.0f;
    o.clip_norm = 0.0f;
    o.target_batch = B;
    float *p_after = tx_alloc(np);
    for (int s = 0; s < n; s++) {
        struct expert_step_info info;
        int rc = expert_block_step(ch.b[s], &o, &info);
        if (rc != 0)
            fprintf(stderr, "stage %d step returned %d\n", s, rc);
        assert_int_equal(rc, 0);
        assert_int_equal(info.samples, B);
        struct expert_snapshot snap;
        expert_block_snapshot_acquire(ch.b[s], &snap);
        memcpy(p_after + ch.off[s], snap.params, expert_block_nparams(ch.b[s]) * sizeof(float));
        expert_block_snapshot_release(ch.b[s], &snap);
    }
    /* At t = 1 torch's AdamW moves p by −(lr/(1−β1))·m/(√v/√(1−β2) + eps)
     * with m = (1−β1)·g, v = (1−β2)·g², about lr·g/(|g| + eps). First the
     * step itself: that formula (in double) on OUR averaged gradients g must
     * give the block's new weights to a few ulps. */
    {
        float *want = tx_alloc(np);
        for (size_t i = 0; i < np; i++) {
            double gi = (double)g_kept[i], m = 0.1 * gi, v = 0.001 * gi * gi;
            want[i] = (float)((double)fx.params[i] -
                              (1e-3 / 0.1) * m / (sqrt(v) / sqrt(0.001) + 1e-8));
        }
        miss += compare("step = AdamW formula on our grads", p_after, want, np, 1e-7, 2e-6, &ch);
        free(want);
    }
    /* Then torch's new weights. Where |g| is near eps the update depends on
     * g itself, so there the gradient error checked above shows through:
     * each weight may differ from torch's by lr·|u(g) − u(g_torch)| more,
     * u(g) = g/(|g| + eps) (the t = 1 update per unit lr; at most 2·lr). */
    {
        float *got = tx_alloc(np);
        int widened = 0, wmiss = 0;
        for (size_t i = 0; i < np; i++) {
            double go = (double)g_kept[i], gt = (double)fx.grads[i];
            double extra = 1e-3 * fabs(go / (fabs(go) + 1e-8) - gt / (fabs(gt) + 1e-8));
            got[i] = p_after[i];
            if (extra > 1e-7) {
                widened++;
                double d = fabs((double)p_after[i] - (double)fx.params_after[i]);
                if (d <= 2e-6 + 1e-5 * fabs((double)fx.params_after[i]) + 1.01 * extra)
                    got[i] = fx.params_after[i]; /* within its wider bound */
                else
                    wmiss++;
            }
        }
        fprintf(stderr, "  (%d weights, with |grad| near eps, allowed the gradient error's effect: "
                "%d miss)\n", widened, wmiss);
        miss += compare("params after one AdamW step vs torch", got, fx.params_after, np, 2e-6,
                        1e-5, &ch);
        free(got);
    }
    /* ... and the loss on the same batch after the step. */
    {
        int bt = B * fx.T;
        for (int s = 0; s < n; s++)
            assert_int_equal(expert_block_forward(ch.b[s], ch.ws[s], ch.act[s + 1], ch.act[s], B, NULL), 0);
        assert_int_equal(expert_crossentropy_forward(ch.losses, ch.probs, ch.act[n], fx.y, bt, fx.V), 0);
        double sum = 0.0;
        for (int i = 0; i < bt; i++)
            sum += ch.losses[i];
        miss += compare_scalar("loss after the step", sum / bt, fx.loss_after, 1e-4);
    }

    /* Checkpoint round trip (format 3), with the optimizer state the step
     * left: a block of the same config from another seed takes it exactly. */
    for (int s = 0; s < n; s++) {
        for (int with_optim = 0; with_optim <= 1; with_optim++) {
            size_t len = expert_block_serialized_size(ch.b[s], with_optim);
            unsigned char *buf = malloc(len);
            assert_non_null(buf);
            assert_int_equal(expert_block_serialize(ch.b[s], with_optim, buf, len), (long)len);
            struct expert_ckpt_info info;
            assert_int_equal(expert_ckpt_peek(buf, len, &info), 0);
            assert_int_equal(info.format, with_optim ? 4 : 3);
            assert_int_equal(info.cfg.kind, ch.cfg[s].kind);
            assert_int_equal(info.cfg.layers, ch.cfg[s].layers);
            assert_true(info.config_hash == expert_block_config_hash(&ch.cfg[s]));
            assert_int_equal(info.total_len, len);
            expert_block *c = expert_block_create(&ch.cfg[s], 5u);
            assert_non_null(c);
            assert_int_equal(expert_block_deserialize(c, buf, len), 0);
            assert_true(expert_block_version(c) == expert_block_version(ch.b[s]));
            size_t fl = expert_block_flat_len(c), pn = expert_block_nparams(c);
            float *fa = tx_alloc(fl), *fb = tx_alloc(fl);
            assert_int_equal(expert_block_flat_export(ch.b[s], fa), 0);
            assert_int_equal(expert_block_flat_export(c, fb), 0);
            size_t cmp = with_optim ? fl : pn;
            if (memcmp(fa, fb, cmp * sizeof(float)) != 0) {
                fprintf(stderr, "stage %d: checkpoint (optim %d) did not restore the state\n", s,
                        with_optim);
                miss += compare("checkpoint round trip", fb, fa, cmp, 0, 0, NULL);
            }
            if (with_optim)
                assert_true(expert_block_steps(c) == 1);
            /* A truncated or corrupted copy is refused, the block unchanged. */
            assert_true(expert_block_deserialize(c, buf, len - 1) < 0);
            buf[len / 2] ^= 0x40;
            assert_true(expert_block_deserialize(c, buf, len) < 0);
            assert_int_equal(expert_block_flat_export(c, fb), 0);
            assert_memory_equal(fa, fb, cmp * sizeof(float));
            free(fa);
            free(fb);
            free(buf);
            expert_block_destroy(&c);
        }
    }

    if (miss)
        fprintf(stderr, "split %s: %d misses (see FAIL lines above)\n", sp->name, miss);
    fprintf(stderr, "split %s: worst errors so far: abs %.3g, rel %.3g\n", sp->name,
            worst_abs_seen, worst_rel_seen);
    assert_int_equal(miss, 0);
    free(g);
    free(g_kept);
    free(p_after);
    free(logits_train);
    chain_free(&ch);
    fix_free(&fx);
}

static const struct split split_a = {
    "a: embed(2) + lm_head(0)", 2, { EXPERT_BLOCK_EMBED, EXPERT_BLOCK_LMHEAD }, { 2, 0 } };
static const struct split split_b = {
    "b: embed(0) + decoder(2) + lm_head(0)", 3,
    { EXPERT_BLOCK_EMBED, EXPERT_BLOCK_DECODER, EXPERT_BLOCK_LMHEAD }, { 0, 2, 0 } };
static const struct split split_c = {
    "c: embed(1) + lm_head(1)", 2, { EXPERT_BLOCK_EMBED, EXPERT_BLOCK_LMHEAD }, { 1, 1 } };
static const struct split split_d = {
    "d: embed(0) + decoder(1) + decoder(1) + lm_head(0)", 4,
    { EXPERT_BLOCK_EMBED, EXPERT_BLOCK_DECODER, EXPERT_BLOCK_DECODER, EXPERT_BLOCK_LMHEAD },
    { 0, 1, 1, 0 } };
static const struct split split_e = {
    "e: embed(0) + lm_head(2)", 2, { EXPERT_BLOCK_EMBED, EXPERT_BLOCK_LMHEAD }, { 0, 2 } };

static void test_split_a(void **state) { (void)state; run_split(&split_a); }
static void test_split_b(void **state) { (void)state; run_split(&split_b); }
static void test_split_c(void **state) { (void)state; run_split(&split_c); }
static void test_split_d(void **state) { (void)state; run_split(&split_d); }
static void test_split_e(void **state) { (void)state; run_split(&split_e); }

/* The widths a config must carry, and the tensor count 2 + 12·layers + 4. */
static void test_configs(void **state)
{
    (void)state;
    struct lm_fix fx;
    fix_load(&fx);
    const int kinds[3] = { EXPERT_BLOCK_EMBED, EXPERT_BLOCK_DECODER, EXPERT_BLOCK_LMHEAD };
    for (int k = 0; k < 3; k++) {
        struct expert_block_config c = stage_config(&fx, kinds[k], 1);
        assert_int_equal(expert_block_config_check(&c), 0);
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        size_t total = 0;
        int nt = expert_block_config_tensors(&c, t, &total);
        assert_int_equal(nt, 12 + (kinds[k] == EXPERT_BLOCK_DECODER ? 0 : 2) +
                                 (kinds[k] == EXPERT_BLOCK_LMHEAD ? 2 : 0));
        struct expert_block_config bad = c;
        bad.in++;
        assert_int_equal(expert_block_config_check(&bad), -EINVAL);
        bad = c;
        bad.out--;
        assert_int_equal(expert_block_config_check(&bad), -EINVAL);
        bad = c;
        bad.heads = 5; /* does not divide 32 */
        assert_int_equal(expert_block_config_check(&bad), -EINVAL);
    }
    fix_free(&fx);
}

/* Tokens that are not integers in [0, V) are refused by every entry point
 * that reads them, with nothing accumulated; good rows still work after. */
static void test_bad_tokens(void **state)
{
    (void)state;
    struct lm_fix fx;
    fix_load(&fx);
    struct expert_block_config c = stage_config(&fx, EXPERT_BLOCK_EMBED, 1);
    expert_block *b = expert_block_create(&c, 3);
    expert_workspace *ws = expert_workspace_create(&c, 2);
    assert_non_null(b);
    assert_non_null(ws);
    int T = fx.T;
    float *tok = tx_alloc(2 * (size_t)T), *out = tx_alloc(2 * (size_t)c.out);
    float *dout = tx_alloc(2 * (size_t)c.out);
    size_t np = expert_block_nparams(b);
    float *g = tx_alloc(np);
    for (int i = 0; i < 2 * T; i++)
        tok[i] = (float)fx.x[i];
    for (size_t i = 0; i < 2 * (size_t)c.out; i++)
        dout[i] = 0.01f * (float)(i % 7);
    const float bad[] = { 256.0f, -1.0f, 3.5f, NAN, INFINITY, -INFINITY, 1e10f, -0.5f, 255.5f };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        int pos = (int)(k * 5 % (size_t)(2 * T));
        float keep = tok[pos];
        tok[pos] = bad[k];
        int rc1 = expert_block_forward(b, ws, out, tok, 2, NULL);
        int rc2 = expert_block_forward_train(b, ws, out, tok, 2, NULL);
        int rc3 = expert_block_backward(b, ws, NULL, dout, tok, 2, NULL);
        int rc4 = expert_block_forward_backward(b, ws, out, NULL, dout, tok, 2, NULL);
        if (rc1 != -EINVAL || rc2 != -EINVAL || rc3 != -EINVAL || rc4 != -EINVAL)
            fprintf(stderr, "token %g at %d: forward %d, forward_train %d, backward %d, "
                    "forward_backward %d (want %d)\n", (double)bad[k], pos, rc1, rc2, rc3, rc4,
                    -EINVAL);
        assert_int_equal(rc1, -EINVAL);
        assert_int_equal(rc2, -EINVAL);
        assert_int_equal(rc3, -EINVAL);
        assert_int_equal(rc4, -EINVAL);
        /* The check a server runs per request names the value and where. */
        char why[160], want[64];
        assert_int_equal(expert_block_input_check(&c, tok, 2, why, sizeof why), -EINVAL);
        snprintf(want, sizeof want, "at row %d, position %d is not a token", pos / T, pos % T);
        if (!strstr(why, want))
            fprintf(stderr, "input check said \"%s\", want \"%s\"\n", why, want);
        assert_non_null(strstr(why, want));
        assert_int_equal(expert_block_accumulated(b), 0);
        expert_block_copy_grads(b, g);
        for (size_t i = 0; i < np; i++)
            if (g[i] != 0.0f) {
                fprintf(stderr, "token %g: gradient %zu changed to %g\n", (double)bad[k], i,
                        (double)g[i]);
                fail();
            }
        tok[pos] = keep;
    }
    assert_int_equal(expert_block_input_check(&c, tok, 2, NULL, 0), 0);
    assert_int_equal(expert_block_forward(b, ws, out, tok, 2, NULL), 0);
    assert_int_equal(expert_block_backward(b, ws, NULL, dout, tok, 2, NULL), 0);
    assert_int_equal(expert_block_accumulated(b), 2);
    /* Tokens have no gradient, but a wanted dinp is written (zeros), never
     * left as it was: a server sends it back. */
    float *dinp = tx_alloc(2 * (size_t)T);
    for (int i = 0; i < 2 * T; i++)
        dinp[i] = NAN;
    assert_int_equal(expert_block_backward(b, ws, dinp, dout, tok, 2, NULL), 0);
    for (int i = 0; i < 2 * T; i++)
        assert_true(dinp[i] == 0.0f);
    free(dinp);
    free(tok);
    free(out);
    free(dout);
    free(g);
    expert_workspace_destroy(&ws);
    expert_block_destroy(&b);
    fix_free(&fx);
}

/* A flat weight file of the whole model (train_lm.py's --save-init
 * layout): every stage loads its slice; a file of the wrong size, a
 * non-finite value in a stage's slice, a missing file, a directory and a
 * block of another stage are refused with a sentence, the block unchanged. */
static void test_flat_weights(void **state)
{
    (void)state;
    struct lm_fix fx;
    fix_load(&fx);
    struct expert_block_config st[3] = { stage_config(&fx, EXPERT_BLOCK_EMBED, 0),
                                         stage_config(&fx, EXPERT_BLOCK_DECODER, fx.layers),
                                         stage_config(&fx, EXPERT_BLOCK_LMHEAD, 0) };
    struct expert_model_spec m = { "flat-test", "", 3, st, st[0].in, st[2].out, EXPERT_TASK_BYTES,
                                   fx.T, fx.V, 0, 0 };
    char dir[256], path[512], msg[256];
    test_tmpdir(dir, sizeof dir, "flat");
    snprintf(path, sizeof path, "%s/init.bin", dir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(fx.params, sizeof(float), fx.np, f), fx.np);
    fclose(f);
    size_t off = 0;
    for (int i = 0; i < 3; i++) {
        expert_block *b = expert_block_create(&st[i], 9);
        assert_non_null(b);
        size_t n = expert_block_nparams(b);
        assert_int_equal(expert_block_load_flat(b, &m, i, path, msg, sizeof msg), 0);
        struct expert_snapshot sn;
        expert_block_snapshot_acquire(b, &sn);
        assert_memory_equal(sn.params, fx.params + off, n * sizeof(float));
        expert_block_snapshot_release(b, &sn);
        /* Another stage's block: a mismatch, not a load. */
        assert_int_equal(expert_block_load_flat(b, &m, (i + 1) % 3, path, msg, sizeof msg), -EINVAL);
        off += n;
        expert_block_destroy(&b);
    }
    assert_int_equal(off, fx.np);
    expert_block *b = expert_block_create(&st[1], 9);
    uint64_t v0 = expert_block_version(b);
    /* One value short. */
    assert_int_equal(truncate(path, (off_t)((fx.np - 1) * sizeof(float))), 0);
    assert_int_equal(expert_block_load_flat(b, &m, 1, path, msg, sizeof msg), -EBADMSG);
    assert_non_null(strstr(msg, "must hold exactly"));
    assert_non_null(strstr(msg, path));
    /* A NaN inside stage 1's slice. */
    size_t at = expert_block_nparams(b) / 2;
    struct expert_tensor_info t0[EXPERT_BLOCK_MAX_TENSORS];
    size_t n0 = 0;
    expert_block_config_tensors(&st[0], t0, &n0);
    float *bad = malloc(fx.np * sizeof *bad);
    assert_non_null(bad);
    memcpy(bad, fx.params, fx.np * sizeof *bad);
    bad[n0 + at] = NAN;
    f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(bad, sizeof(float), fx.np, f), fx.np);
    fclose(f);
    assert_int_equal(expert_block_load_flat(b, &m, 1, path, msg, sizeof msg), -EBADMSG);
    assert_non_null(strstr(msg, "not finite"));
    /* The NaN is in stage 1's slice only: stage 0 still loads its own. */
    expert_block *b0 = expert_block_create(&st[0], 9);
    assert_int_equal(expert_block_load_flat(b0, &m, 0, path, msg, sizeof msg), 0);
    expert_block_destroy(&b0);
    /* No file, a directory. */
    snprintf(path, sizeof path, "%s/none.bin", dir);
    assert_true(expert_block_load_flat(b, &m, 1, path, msg, sizeof msg) < 0);
    assert_non_null(strstr(msg, "cannot open"));
    assert_int_equal(expert_block_load_flat(b, &m, 1, dir, msg, sizeof msg), -EBADMSG);
    assert_true(expert_block_version(b) == v0); /* nothing was installed */
    free(bad);
    expert_block_destroy(&b);
    test_rmtree(dir);
    fix_free(&fx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_configs),
        cmocka_unit_test(test_split_a),
        cmocka_unit_test(test_split_b),
        cmocka_unit_test(test_split_c),
        cmocka_unit_test(test_split_d),
        cmocka_unit_test(test_split_e),
        cmocka_unit_test(test_bad_tokens),
        cmocka_unit_test(test_flat_weights),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    fprintf(stderr, "worst errors against torch and between paths: abs %.3g, rel %.3g\n",
            worst_abs_seen, worst_rel_seen);
    return rc;
}
