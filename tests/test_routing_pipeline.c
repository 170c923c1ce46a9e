/* The micro-batch scheduler (routing/pipeline.h) against an in-process fake
 * swarm: random completion order, injected failures, every batch exactly once,
 * and the accumulated parameter gradients equal a sequential reference. */
#include <errno.h>
#include <math.h>

#include "routing/pipeline.h"
#include "routing/swarm.h"
#include "test_util.h"

#define S 3
#define MAXB 8
static const int widths[S + 1] = {5, 7, 4, 3};
static double W[S][8][8];        /* W[s][i][j], i < widths[s], j < widths[s+1] */
static double gW[S][8][8];       /* accumulated by the fake servers */
static double gW_ref[S][8][8];   /* accumulated by the sequential reference */

static void init_weights(uint64_t *rng)
{
    for (int s = 0; s < S; s++)
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 8; j++)
                W[s][i][j] = route_rand01(rng) - 0.5;
}

static void fwd(int s, const float *x, float *y, int rows)
{
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < widths[s + 1]; j++) {
            double acc = 0;
            for (int i = 0; i < widths[s]; i++)
                acc += x[r * widths[s] + i] * W[s][i][j];
            y[r * widths[s + 1] + j] = (float)acc;
        }
}

/* dx = dy W^T (when dx != NULL); g[s] += x^T dy. */
static void bwd(int s, const float *x, const float *dy, float *dx, int rows, double g[8][8])
{
    for (int r = 0; r < rows; r++) {
        for (int i = 0; i < widths[s]; i++) {
            double acc = 0;
            for (int j = 0; j < widths[s + 1]; j++) {
                acc += dy[r * widths[s + 1] + j] * W[s][i][j];
                g[i][j] += (double)x[r * widths[s] + i] * dy[r * widths[s + 1] + j];
            }
            if (dx)
                dx[r * widths[s] + i] = (float)acc;
        }
    }
}

/* Squared error against a one-hot label; "correct" when argmax == label. */
static int loss(void *ctx, const float *logits, const uint8_t *labels, int B, int C, float *dl,
                double *loss_sum, int *correct)
{
    (void)ctx;
    double sum = 0;
    int ok = 0;
    for (int r = 0; r < B; r++) {
        if (labels[r] >= C)
            return -EINVAL;
        int arg = 0;
        for (int c = 0; c < C; c++) {
            double t = c == labels[r] ? 1.0 : 0.0, d = logits[r * C + c] - t;
            sum += 0.5 * d * d;
            dl[r * C + c] = (float)(d / B);
            if (logits[r * C + c] > logits[r * C + arg])
                arg = c;
        }
        ok += arg == labels[r];
    }
    *loss_sum = sum;
    *correct = ok;
    return 0;
}

static void make_batch(uint64_t *rng, float *x, uint8_t *lab, int rows)
{
    for (int i = 0; i < rows * widths[0]; i++)
        x[i] = (float)(route_rand01(rng) * 2 - 1);
    for (int r = 0; r < rows; r++)
        lab[r] = (uint8_t)(route_rand01(rng) * widths[S]);
}

/* The same batch processed directly, for the reference gradients. */
static double reference(const float *x, const uint8_t *lab, int rows)
{
    float a[S + 1][MAXB * 8], g[S + 1][MAXB * 8];
    memcpy(a[0], x, sizeof(float) * (size_t)(rows * widths[0]));
    for (int s = 0; s < S; s++)
        fwd(s, a[s], a[s + 1], rows);
    double l = 0;
    int c = 0;
    assert_int_equal(loss(NULL, a[S], lab, rows, widths[S], g[S], &l, &c), 0);
    for (int s = S - 1; s >= 0; s--)
        bwd(s, a[s], g[s + 1], g[s], rows, gW_ref[s]);
    return l;
}

static void run(uint64_t seed, int inflight, double fail_rate)
{
    uint64_t rng = seed, data_rng = seed ^ 0x9e3779b97f4a7c15ULL;
    route_pipeline_config cfg = {S, widths, MAXB, inflight, loss, NULL, 0};
    route_pipeline *p = route_pipeline_create(&cfg);
    assert_non_null(p);
    memset(gW, 0, sizeof gW);
    memset(gW_ref, 0, sizeof gW_ref);
    init_weights(&rng);

    enum { NB = 60 };
    int seen[NB] = {0};
    double ref_loss[NB], got_loss = 0, want_loss = 0;
    route_call taken[ROUTE_PIPELINE_MAX_INFLIGHT];
    int ntaken = 0, pushed = 0, done = 0, injected = 0, retries = 0;

    for (int iter = 0; iter < 100000 && done < NB; iter++) {
        while (pushed < NB) {
            float x[MAXB * 8];
            uint8_t lab[MAXB];
            int rows = 1 + (int)(route_rand01(&data_rng) * MAXB);
            make_batch(&data_rng, x, lab, rows);
            int64_t seq = route_pipeline_push(p, x, lab, rows);
            if (seq == -EAGAIN)
                break;
            assert_int_equal(seq, pushed);
            ref_loss[pushed++] = reference(x, lab, rows);
        }
        while (ntaken < inflight && route_pipeline_next_call(p, &taken[ntaken]))
            ntaken++;
        assert_int_equal(route_pipeline_outstanding(p), ntaken);
        assert_true(ntaken > 0);
        /* Complete one outstanding call, chosen at random. */
        int k = (int)(route_rand01(&rng) * ntaken);
        route_call c = taken[k];
        taken[k] = taken[--ntaken];
        int status = 0;
        if (route_rand01(&rng) < fail_rate) {
            status = -ETIMEDOUT;
            injected++;
        } else if (c.kind == ROUTE_CALL_FORWARD) {
            assert_null(c.grad_outputs);
            fwd(c.stage, c.inputs, c.outputs, c.rows);
        } else {
            assert_int_equal(c.need_grad_inputs, c.stage > 0);
            bwd(c.stage, c.inputs, c.grad_outputs, c.need_grad_inputs ? c.outputs : NULL, c.rows,
                gW[c.stage]);
        }
        assert_int_equal(route_pipeline_call_done(p, c.token, status), 0);
        assert_int_equal(route_pipeline_call_done(p, c.token, 0), -ENOENT); /* stale */
        /* The running count includes batches not yet finished. */
        assert_int_equal(route_pipeline_retries(p), injected);
        route_batch_result r;
        while (route_pipeline_pop_result(p, &r)) {
            assert_true(r.seq < NB);
            assert_int_equal(seen[r.seq], 0);
            seen[r.seq] = 1;
            got_loss += r.loss_sum;
            want_loss += ref_loss[r.seq];
            retries += r.retries;
            done++;
        }
    }
    assert_int_equal(done, NB);
    assert_int_equal(retries, injected);
    assert_int_equal(route_pipeline_inflight(p), 0);
    assert_int_equal(route_pipeline_failed(p), 0);
    if (fabs(got_loss - want_loss) > 1e-4 * (1 + fabs(want_loss)))
        fail_msg("seed %llu: loss %.6f want %.6f", (unsigned long long)seed, got_loss, want_loss);
    for (int s = 0; s < S; s++)
        for (int i = 0; i < widths[s]; i++)
            for (int j = 0; j < widths[s + 1]; j++)
                if (fabs(gW[s][i][j] - gW_ref[s][i][j]) > 1e-4)
                    fail_msg("seed %llu: gW[%d][%d][%d] = %g want %g", (unsigned long long)seed, s, i,
                             j, gW[s][i][j], gW_ref[s][i][j]);
    route_pipeline_destroy(&p);
    assert_null(p);
}

/* Issue 17: the trainer's JSON said "retries":0 after it had re-sent calls
 * whose holder refused the connection. The trainer reports every call it
 * has to send again (a timeout, an error reply, a connection that could not
 * be made) as failed; route_pipeline_retries counts each one at once, for
 * training and evaluation batches, before and after their batch finishes. */
static void test_retries_counted_at_once(void **state)
{
    (void)state;
    route_pipeline_config cfg = {S, widths, MAXB, 2, loss, NULL, 0};
    route_pipeline *p = route_pipeline_create(&cfg);
    assert_non_null(p);
    float x[MAXB * 8] = {0};
    uint8_t lab[MAXB] = {0};
    assert_int_equal(route_pipeline_push(p, x, lab, 4), 0);
    assert_int_equal(route_pipeline_push_eval(p, x, lab, 4), 1);
    assert_int_equal(route_pipeline_retries(p), 0);
    long fails = 0, batch_retries = 0;
    int finished = 0;
    route_call c;
    for (int iter = 0; iter < 1000 && finished < 2; iter++) {
        assert_int_equal(route_pipeline_next_call(p, &c), 1);
        /* Every call fails twice (once refused, once timed out) first. */
        int status = c.attempt == 0 ? -ECONNREFUSED : c.attempt == 1 ? -ETIMEDOUT : 0;
        if (status == 0) {
            if (c.kind == ROUTE_CALL_FORWARD)
                fwd(c.stage, c.inputs, c.outputs, c.rows);
            else
                bwd(c.stage, c.inputs, c.grad_outputs, c.need_grad_inputs ? c.outputs : NULL, c.rows, gW[c.stage]);
        } else {
            fails++;
        }
        assert_int_equal(route_pipeline_call_done(p, c.token, status), 0);
        assert_int_equal(route_pipeline_retries(p), fails);
        route_batch_result r;
        while (route_pipeline_pop_result(p, &r)) {
            batch_retries += r.retries;
            finished++;
            /* training: S forwards + S backwards; evaluation: S forwards */
            assert_int_equal(r.retries, 2 * (r.forward_only ? S : 2 * S));
        }
    }
    assert_int_equal(finished, 2);
    assert_int_equal(fails, 2 * (2 * S + S));
    assert_int_equal(route_pipeline_retries(p), batch_retries);
    assert_int_equal(route_pipeline_retries(NULL), 0);
    route_pipeline_destroy(&p);
}

/* Completes the next call of p: forwards and backwards computed, or the
 * given status. Returns the call's kind. */
static route_call_kind step(route_pipeline *p, int status)
{
    route_call c;
    assert_int_equal(route_pipeline_next_call(p, &c), 1);
    if (status == 0) {
        if (c.kind == ROUTE_CALL_FORWARD)
            fwd(c.stage, c.inputs, c.outputs, c.rows);
        else
            bwd(c.stage, c.inputs, c.grad_outputs, c.need_grad_inputs ? c.outputs : NULL, c.rows, gW[c.stage]);
    }
    assert_int_equal(route_pipeline_call_done(p, c.token, status), 0);
    return c.kind;
}

/* Issue 18: a backward that every replica refuses (ERANGE: the trainer's
 * gradient failed the holders' checks) was re-sent forever. After
 * max_refusals refusals of one batch's backward calls the batch finishes
 * with `refused` set; the other batches are untouched. */
static void test_refusals_bounded(void **state)
{
    (void)state;
    route_pipeline_config cfg = {S, widths, MAXB, 2, loss, NULL, 0};
    route_pipeline *p = route_pipeline_create(&cfg);
    assert_non_null(p);
    float x[MAXB * 8] = {0.5f};
    uint8_t lab[MAXB] = {1};
    route_batch_result r;

    /* Refused at every attempt: the default bound, 3 refusals. */
    assert_int_equal(route_pipeline_push(p, x, lab, 5), 0);
    for (int s = 0; s < S; s++)
        assert_int_equal(step(p, 0), ROUTE_CALL_FORWARD);
    for (int i = 0; i < ROUTE_PIPELINE_MAX_REFUSALS; i++) {
        assert_int_equal(route_pipeline_pop_result(p, &r), 0);
        assert_int_equal(step(p, -ERANGE), ROUTE_CALL_BACKWARD);
    }
    route_call c;
    assert_int_equal(route_pipeline_next_call(p, &c), 0); /* not re-issued */
    assert_int_equal(route_pipeline_pop_result(p, &r), 1);
    assert_int_equal(r.refused, 1);
    assert_int_equal(r.refusals, ROUTE_PIPELINE_MAX_REFUSALS);
    assert_int_equal(r.rows, 5);
    assert_int_equal(r.retries, ROUTE_PIPELINE_MAX_REFUSALS - 1); /* the last is not re-sent */
    assert_int_equal(route_pipeline_retries(p), ROUTE_PIPELINE_MAX_REFUSALS - 1);
    assert_int_equal(route_pipeline_refusals(p), ROUTE_PIPELINE_MAX_REFUSALS);
    assert_int_equal(route_pipeline_refused_batches(p), 1);
    assert_int_equal(route_pipeline_refused_rows(p), 5);
    assert_int_equal(route_pipeline_inflight(p), 0);

    /* Refusals count over the batch's stages; other failures and an
     * ERANGE answer to a forward are ordinary retries. */
    assert_int_equal(route_pipeline_push(p, x, lab, 3), 1);
    assert_int_equal(step(p, -ERANGE), ROUTE_CALL_FORWARD); /* not a refusal */
    for (int s = 0; s < S; s++)
        assert_int_equal(step(p, 0), ROUTE_CALL_FORWARD);
    assert_int_equal(step(p, -ERANGE), ROUTE_CALL_BACKWARD); /* stage 2 */
    assert_int_equal(step(p, -ETIMEDOUT), ROUTE_CALL_BACKWARD);
    assert_int_equal(step(p, 0), ROUTE_CALL_BACKWARD);
    assert_int_equal(step(p, -ERANGE), ROUTE_CALL_BACKWARD); /* stage 1 */
    assert_int_equal(step(p, 0), ROUTE_CALL_BACKWARD);
    assert_int_equal(step(p, 0), ROUTE_CALL_BACKWARD);        /* stage 0 */
    assert_int_equal(route_pipeline_pop_result(p, &r), 1);
    assert_int_equal(r.seq, 1);
    assert_int_equal(r.refused, 0);
    assert_int_equal(r.refusals, 2);
    assert_int_equal(r.retries, 4);
    assert_int_equal(route_pipeline_refused_batches(p), 1);
    assert_int_equal(route_pipeline_refusals(p), ROUTE_PIPELINE_MAX_REFUSALS + 2);
    route_pipeline_destroy(&p);

    /* max_refusals 1: the first refusal drops the update. */
    cfg.max_refusals = 1;
    p = route_pipeline_create(&cfg);
    assert_non_null(p);
    assert_int_equal(route_pipeline_push(p, x, lab, 2), 0);
    for (int s = 0; s < S; s++)
        step(p, 0);
    assert_int_equal(step(p, 0), ROUTE_CALL_BACKWARD);
    assert_int_equal(step(p, -ERANGE), ROUTE_CALL_BACKWARD);
    assert_int_equal(route_pipeline_pop_result(p, &r), 1);
    assert_int_equal(r.refused, 1);
    assert_int_equal(route_pipeline_retries(p), 0);
    assert_int_equal(route_pipeline_refused_rows(p), 2);
    route_pipeline_destroy(&p);
    assert_int_equal(route_pipeline_refusals(NULL), 0);
}

static int flushed[ROUTE_ERRLOG_KINDS];
static void count_line(void *arg, const route_errlog_kind *k)
{
    int *n = arg;
    assert_true(k->pending > 0);
    flushed[(*n)++] = (int)k->pending;
}

/* The error notes: the first of each (stage, code) at once, then at most
 * one summary every period with what came since. */
static void test_errlog(void **state)
{
    (void)state;
    route_errlog e;
    route_errlog_init(&e, 10, 100);
    assert_int_equal(route_errlog_add(&e, 5, ERANGE, "norm 1e30 above 1e5"), 1);
    assert_int_equal(route_errlog_add(&e, 5, ERANGE, "norm 2e30 above 1e5"), 0);
    assert_int_equal(route_errlog_add(&e, 5, EBUSY, "queue full"), 1);
    assert_int_equal(route_errlog_add(&e, 4, ERANGE, "x"), 1);
    assert_int_equal(route_errlog_add(&e, -1, -ETIMEDOUT, "timed out"), 1);
    assert_int_equal(e.n, 4);
    assert_string_equal(e.k[0].last, "norm 2e30 above 1e5");
    assert_int_equal(e.k[0].total, 2);
    int n = 0;
    assert_int_equal(route_errlog_flush(&e, 105, count_line, &n), 0); /* not due */
    assert_int_equal(route_errlog_flush(&e, 110, count_line, &n), 1); /* stage 5 ERANGE: 1 since */
    assert_int_equal(n, 1);
    assert_int_equal(flushed[0], 1);
    for (int i = 0; i < 50; i++)
        assert_int_equal(route_errlog_add(&e, 5, ERANGE, "again"), 0);
    assert_int_equal(route_errlog_add(&e, 5, EBUSY, "queue full"), 0);
    n = 0;
    assert_int_equal(route_errlog_flush(&e, 119, count_line, &n), 0); /* 10 s after the last line */
    assert_int_equal(route_errlog_flush(&e, 120, count_line, &n), 2);
    assert_int_equal(flushed[0], 50);
    assert_int_equal(flushed[1], 1);
    assert_int_equal(route_errlog_flush(&e, 500, count_line, &n), 0); /* nothing pending */
    /* Bounded: kinds beyond the table are counted, not logged. */
    for (int i = 0; i < 2 * ROUTE_ERRLOG_KINDS; i++)
        route_errlog_add(&e, 10 + i, EIO, "io");
    assert_int_equal(e.n, ROUTE_ERRLOG_KINDS);
    assert_int_equal(e.dropped, 2 * ROUTE_ERRLOG_KINDS - (ROUTE_ERRLOG_KINDS - 4));
}

static void test_no_failures_one_inflight(void **state)
{
    (void)state;
    run(1, 1, 0.0);
}

static void test_failures_and_reordering(void **state)
{
    (void)state;
    for (uint64_t seed = 2; seed < 12; seed++)
        run(seed, 4, 0.25);
    run(99, 16, 0.5);
}

static void test_limits_and_bad_input(void **state)
{
    (void)state;
    route_pipeline_config cfg = {S, widths, MAXB, 2, loss, NULL, 0};
    route_pipeline *p = route_pipeline_create(&cfg);
    assert_non_null(p);
    float x[MAXB * 8] = {0};
    uint8_t lab[MAXB] = {0};
    assert_int_equal(route_pipeline_push(p, x, lab, 0), -EINVAL);
    assert_int_equal(route_pipeline_push(p, x, lab, MAXB + 1), -EINVAL);
    assert_int_equal(route_pipeline_push(p, x, lab, 2), 0);
    assert_int_equal(route_pipeline_push(p, x, lab, 2), 1);
    assert_int_equal(route_pipeline_push(p, x, lab, 2), -EAGAIN);
    assert_int_equal(route_pipeline_call_done(p, 12345, 0), -ENOENT);
    assert_int_equal(route_pipeline_call_done(p, 0, 0), -ENOENT); /* not taken */

    /* A label the loss rejects drops that batch and counts it. */
    route_call c;
    route_pipeline_destroy(&p);
    p = route_pipeline_create(&cfg);
    lab[0] = 200;
    assert_int_equal(route_pipeline_push(p, x, lab, 1), 0);
    for (int s = 0; s < S; s++) {
        assert_int_equal(route_pipeline_next_call(p, &c), 1);
        assert_int_equal(c.kind, ROUTE_CALL_FORWARD);
        assert_int_equal(c.stage, s);
        memset(c.outputs, 0, sizeof(float) * (size_t)c.width_out);
        int rc = route_pipeline_call_done(p, c.token, 0);
        assert_int_equal(rc, s == S - 1 ? -EINVAL : 0);
    }
    assert_int_equal(route_pipeline_failed(p), 1);
    assert_int_equal(route_pipeline_inflight(p), 0);
    assert_int_equal(route_pipeline_next_call(p, &c), 0);
    route_pipeline_destroy(&p);
    route_pipeline_destroy(&p); /* NULL is fine */

    /* An evaluation batch goes forward through every stage, then stops. */
    p = route_pipeline_create(&cfg);
    lab[0] = 1;
    assert_int_equal(route_pipeline_push_eval(p, x, lab, 1), 0);
    for (int s = 0; s < S; s++) {
        assert_int_equal(route_pipeline_next_call(p, &c), 1);
        assert_int_equal(c.kind, ROUTE_CALL_FORWARD);
        memset(c.outputs, 0, sizeof(float) * (size_t)c.width_out);
        assert_int_equal(route_pipeline_call_done(p, c.token, 0), 0);
    }
    assert_int_equal(route_pipeline_next_call(p, &c), 0);
    route_batch_result res;
    assert_int_equal(route_pipeline_pop_result(p, &res), 1);
    assert_int_equal(res.forward_only, 1);
    assert_int_equal(res.rows, 1);
    route_pipeline_destroy(&p);

    int bad_widths[S + 1] = {5, 0, 4, 3};
    route_pipeline_config bad = {S, bad_widths, MAXB, 2, loss, NULL, 0};
    assert_null(route_pipeline_create(&bad));
    bad.widths = widths;
    bad.max_inflight = ROUTE_PIPELINE_MAX_INFLIGHT + 1;
    assert_null(route_pipeline_create(&bad));
    bad.max_inflight = 2;
    bad.loss = NULL;
    assert_null(route_pipeline_create(&bad));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_failures_one_inflight),
        cmocka_unit_test(test_retries_counted_at_once),
        cmocka_unit_test(test_failures_and_reordering),
        cmocka_unit_test(test_limits_and_bad_input),
        cmocka_unit_test(test_refusals_bounded),
        cmocka_unit_test(test_errlog),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
