/* The per-block request queue (peer/batcher.h): joined batches compute the
 * same as direct calls, backpressure, inference priority, draining. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdatomic.h>

#include "expert/block.h"
#include "peer/batcher.h"
#include "peer/timeslice.h"
#include "test_util.h"

#define D 16
#define H 32

static const struct expert_block_config cfg = {EXPERT_BLOCK_RESFFN, D, D, H};

static void fill(float *x, size_t n, unsigned seed)
{
    srand(seed);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)rand() / (float)RAND_MAX * 2.0f - 1.0f;
}

typedef struct rec {
    peer_task t;
    sem_t *done_sem;
    atomic_int *order;
    int finished_at;
    int status;
    sem_t *gate;      /* when set, the callback waits on it (holds the worker) */
} rec;

static void on_done(peer_task *t, int status)
{
    rec *r = (rec *)t;
    r->status = status;
    r->finished_at = atomic_fetch_add(r->order, 1);
    if (r->gate)
        sem_wait(r->gate);
    sem_post(r->done_sem);
}

static peer_batcher_config bcfg(int threads, int max_batch, int max_queue)
{
    peer_batcher_config c;
    memset(&c, 0, sizeof c);
    c.threads = threads;
    c.max_batch = max_batch;
    c.max_queue_rows = max_queue;
    expert_optim_default_adamw(&c.optim);
    c.optim.target_batch = 1 << 30; /* no steps unless a test asks */
    return c;
}

static int close_enough(const float *a, const float *b, size_t n, const char *what)
{
    int miss = 0;
    for (size_t i = 0; i < n; i++)
        if (!(fabsf(a[i] - b[i]) <= 1e-5f + 1e-4f * fabsf(b[i]))) {
            if (miss++ < 5)
                fprintf(stderr, "%s[%zu]: %g vs %g\n", what, i, (double)a[i], (double)b[i]);
        }
    return miss == 0;
}

/* Tasks submitted together are joined; every output equals the direct call
 * and the gradients equal those of direct backwards. */
/* The backend the batchers' blocks are on: the CPU, or (the *_sim tests)
 * the simulated device, whose batches go through the workers' pinned
 * buffers and whose kept activations stay in device memory. */
static const expert_backend *g_be;

static void test_joined_equals_direct(void **state)
{
    (void)state;
    expert_block *blk = expert_block_create_on(&cfg, 7, g_be ? g_be : expert_backend_cpu());
    expert_block *ref = expert_block_create(&cfg, 7);
    assert_non_null(blk);
    assert_non_null(ref);
    expert_workspace *ws = expert_workspace_create(&cfg, 64);
    sem_t done, gate;
    sem_init(&done, 0, 0);
    sem_init(&gate, 0, 0);
    atomic_int order = 0;

    enum { N = 6 };
    static float x[N][8 * D], gy[N][8 * D], y[N][8 * D], gx[N][8 * D], want[8 * D];
    rec r[N + 1];
    peer_batcher *b;
    peer_batcher_config c = bcfg(1, 64, 256);
    assert_non_null(b = peer_batcher_create(blk, &c));

    /* A first task holds the only worker, so the next N queue up and join. */
    float hx[D], hy[D];
    fill(hx, D, 1);
    memset(&r[N], 0, sizeof r[N]);
    r[N].t = (peer_task){.kind = PEER_TASK_INFER, .rows = 1, .inputs = hx, .outputs = hy, .done = on_done};
    r[N].done_sem = &done;
    r[N].order = &order;
    r[N].gate = &gate;
    assert_int_equal(peer_batcher_submit(b, &r[N].t), 0);
    for (int k = 0; k < 2000 && atomic_load(&order) == 0; k++)
        usleep(1000); /* until the worker is inside the holder's callback */
    assert_int_equal(atomic_load(&order), 1);
    for (int i = 0; i < N; i++) {
        int rows = 1 + i;
        fill(x[i], (size_t)rows * D, 10 + (unsigned)i);
        fill(gy[i], (size_t)rows * D, 20 + (unsigned)i);
        memset(&r[i], 0, sizeof r[i]);
        r[i].t.kind = i % 2 ? PEER_TASK_BACKWARD : PEER_TASK_FORWARD;
        r[i].t.rows = rows;
        r[i].t.inputs = x[i];
        r[i].t.grad_outputs = i % 2 ? gy[i] : NULL;
        r[i].t.outputs = i % 2 ? gx[i] : y[i];
        r[i].t.done = on_done;
        r[i].done_sem = &done;
        r[i].order = &order;
        assert_int_equal(peer_batcher_submit(b, &r[i].t), 0);
    }
    sem_post(&gate);
    for (int i = 0; i <= N; i++)
        sem_wait(&done);
    peer_batcher_stats st;
    peer_batcher_get_stats(b, &st);
    assert_int_equal(st.batches, 3); /* the holder, 3 forwards joined, 3 backwards joined */
    peer_batcher_destroy(&b);
    assert_null(b);

    for (int i = 0; i < N; i++) {
        assert_int_equal(r[i].status, 0);
        int rows = 1 + i;
        if (i % 2 == 0) {
            assert_int_equal(expert_block_forward(ref, ws, want, x[i], rows, NULL), 0);
            assert_true(close_enough(y[i], want, (size_t)rows * D, "forward"));
        } else {
            assert_int_equal(expert_block_backward(ref, ws, want, gy[i], x[i], rows, NULL), 0);
            assert_true(close_enough(gx[i], want, (size_t)rows * D, "grad_inputs"));
        }
    }
    size_t np = expert_block_nparams(blk);
    float *g1 = malloc(np * sizeof(float)), *g2 = malloc(np * sizeof(float));
    expert_block_copy_grads(blk, g1);
    expert_block_copy_grads(ref, g2);
    assert_true(close_enough(g1, g2, np, "param grads"));
    free(g1);
    free(g2);
    expert_workspace_destroy(&ws);
    expert_block_destroy(&blk);
    expert_block_destroy(&ref);
    sem_destroy(&done);
    sem_destroy(&gate);
}

/* A full queue refuses training work with -EAGAIN but still admits
 * inference, and inference is served before queued training tasks. */
static void test_backpressure_and_priority(void **state)
{
    (void)state;
    expert_block *blk = expert_block_create(&cfg, 3);
    sem_t done, gate;
    sem_init(&done, 0, 0);
    sem_init(&gate, 0, 0);
    atomic_int order = 0;
    peer_batcher_config c = bcfg(1, 4, 8);
    peer_batcher *b = peer_batcher_create(blk, &c);
    assert_non_null(b);
    static float x[4 * D], y[16][4 * D];
    fill(x, 4 * D, 5);
    rec r[16];
    memset(r, 0, sizeof r);
    for (int i = 0; i < 16; i++) {
        r[i].t = (peer_task){.kind = PEER_TASK_FORWARD, .rows = 4, .inputs = x, .outputs = y[i], .done = on_done};
        r[i].done_sem = &done;
        r[i].order = &order;
    }
    r[0].gate = &gate;
    assert_int_equal(peer_batcher_submit(b, &r[0].t), 0);
    /* Wait until the worker holds task 0 (its callback is blocked). */
    for (int k = 0; k < 2000 && atomic_load(&order) == 0; k++)
        usleep(1000);
    assert_int_equal(atomic_load(&order), 1);
    assert_int_equal(peer_batcher_submit(b, &r[1].t), 0);
    assert_int_equal(peer_batcher_submit(b, &r[2].t), 0);
    assert_int_equal(peer_batcher_submit(b, &r[3].t), -EAGAIN); /* 8 rows queued */
    r[4].t.kind = PEER_TASK_INFER;
    assert_int_equal(peer_batcher_submit(b, &r[4].t), 0);       /* inference still fits */
    peer_batcher_stats st;
    peer_batcher_get_stats(b, &st);
    assert_int_equal(st.queued_rows, 12);
    assert_int_equal(st.rejected, 1);
    sem_post(&gate);
    for (int i = 0; i < 4; i++)
        sem_wait(&done);
    assert_int_equal(r[4].finished_at, 1); /* right after the holder */
    assert_true(r[1].finished_at > 1 && r[2].finished_at > 1);
    peer_batcher_destroy(&b);
    expert_block_destroy(&blk);
    sem_destroy(&done);
    sem_destroy(&gate);
}

/* The inference lane: with the only training thread busy (held inside a
 * training task's callback), an inference task is still served. */
static void test_inference_lane(void **state)
{
    (void)state;
    expert_block *blk = expert_block_create(&cfg, 5);
    sem_t done, gate;
    sem_init(&done, 0, 0);
    sem_init(&gate, 0, 0);
    atomic_int order = 0;
    peer_batcher_config c = bcfg(1, 4, 16);
    c.infer_threads = 1;
    peer_batcher *b = peer_batcher_create(blk, &c);
    assert_non_null(b);
    static float x[4 * D], y[3][4 * D];
    fill(x, 4 * D, 9);
    rec r[3];
    memset(r, 0, sizeof r);
    for (int i = 0; i < 3; i++) {
        r[i].t = (peer_task){.kind = PEER_TASK_FORWARD, .rows = 4, .inputs = x, .outputs = y[i], .done = on_done};
        r[i].done_sem = &done;
        r[i].order = &order;
    }
    r[0].gate = &gate; /* holds the training thread */
    assert_int_equal(peer_batcher_submit(b, &r[0].t), 0);
    for (int k = 0; k < 2000 && atomic_load(&order) == 0; k++)
        usleep(1000);
    assert_int_equal(atomic_load(&order), 1);
    assert_int_equal(peer_batcher_submit(b, &r[1].t), 0); /* training: must wait */
    r[2].t.kind = PEER_TASK_INFER;
    assert_int_equal(peer_batcher_submit(b, &r[2].t), 0);
    sem_wait(&done); /* the inference one, served by the lane */
    assert_int_equal(r[2].finished_at, 1);
    assert_int_equal(r[1].finished_at, 0); /* still queued */
    usleep(20000);
    assert_int_equal(atomic_load(&order), 2); /* the lane never took the training task */
    sem_post(&gate);
    sem_wait(&done);
    sem_wait(&done);
    assert_int_equal(r[1].finished_at, 2);
    peer_batcher_destroy(&b);
    expert_block_destroy(&blk);
    sem_destroy(&done);
    sem_destroy(&gate);
}

static void test_bad_submits(void **state)
{
    (void)state;
    expert_block *blk = expert_block_create(&cfg, 3);
    peer_batcher_config c = bcfg(1, 4, 8);
    peer_batcher *b = peer_batcher_create(blk, &c);
    float x[8 * D], y[8 * D];
    memset(x, 0, sizeof x);
    peer_task t = {.kind = PEER_TASK_FORWARD, .rows = 5, .inputs = x, .outputs = y, .done = NULL};
    assert_int_equal(peer_batcher_submit(b, &t), -EINVAL); /* no callback */
    t.done = on_done;
    assert_int_equal(peer_batcher_submit(b, &t), -EINVAL); /* rows > max_batch */
    t.rows = 0;
    assert_int_equal(peer_batcher_submit(b, &t), -EINVAL);
    t.rows = 1;
    t.kind = PEER_TASK_BACKWARD;
    assert_int_equal(peer_batcher_submit(b, &t), -EINVAL); /* no grad_outputs */
    t.kind = (peer_task_kind)9;
    assert_int_equal(peer_batcher_submit(b, &t), -EINVAL);
    peer_batcher_destroy(&b);
    peer_batcher_config bad = bcfg(0, 4, 8);
    assert_null(peer_batcher_create(blk, &bad));
    bad = bcfg(1, 4, 2);
    assert_null(peer_batcher_create(blk, &bad));
    bad = bcfg(1, 4, 8);
    bad.optim.lr = NAN;
    assert_null(peer_batcher_create(blk, &bad));
    assert_null(peer_batcher_create(NULL, &c));
    expert_block_destroy(&blk);
}

/* Several threads submit training work at once; everything completes, the
 * optimizer steps at the target batch, and destroy drains the queue. */
typedef struct submitter {
    peer_batcher *b;
    int id;
    atomic_int *completed;
    atomic_int *order;
} submitter;

typedef struct count_rec {
    peer_task t;
    atomic_int *completed;
    float x[2 * D], y[2 * D];
} count_rec;

static void on_count(peer_task *t, int status)
{
    count_rec *r = (count_rec *)t;
    assert_int_equal(status, 0);
    atomic_fetch_add(r->completed, 1);
}

static void *submit_many(void *arg)
{
    submitter *s = arg;
    enum { PER = 200 };
    count_rec *recs = calloc(PER, sizeof *recs);
    int i = 0;
    for (int tries = 0; i < PER && tries < 1000000; tries++) {
        count_rec *r = &recs[i];
        fill(r->x, 2 * D, (unsigned)(s->id * 1000 + i));
        r->t = (peer_task){.kind = i % 2 ? PEER_TASK_BACKWARD : PEER_TASK_FORWARD, .rows = 2,
                           .inputs = r->x, .grad_outputs = r->x, .outputs = r->y, .done = on_count};
        r->completed = s->completed;
        int rc = peer_batcher_submit(s->b, &r->t);
        if (rc == 0)
            i++;
        else if (rc == -EAGAIN)
            usleep(100);
        else
            break;
    }
    return recs; /* freed by the test after destroy */
}

static void test_concurrent_and_steps(void **state)
{
    (void)state;
    expert_block *blk = expert_block_create(&cfg, 11);
    peer_batcher_config c = bcfg(2, 16, 64);
    c.optim.target_batch = 32;
    peer_batcher *b = peer_batcher_create(blk, &c);
    assert_non_null(b);
    atomic_int completed = 0, order = 0;
    enum { T = 4 };
    pthread_t th[T];
    submitter s[T];
    void *recs[T];
    for (int i = 0; i < T; i++) {
        s[i] = (submitter){b, i, &completed, &order};
        assert_int_equal(pthread_create(&th[i], NULL, submit_many, &s[i]), 0);
    }
    for (int i = 0; i < T; i++)
        pthread_join(th[i], &recs[i]);
    peer_batcher_destroy(&b); /* drains */
    assert_int_equal(atomic_load(&completed), T * 200);
    /* 400 backward tasks of 2 rows = 800 samples; target 32 -> about 25 steps
     * (joined batches may overshoot a target a little). */
    uint64_t steps = expert_block_steps(blk);
    if (!(steps >= 12 && steps <= 25))
        fail_msg("steps %llu, want 12..25", (unsigned long long)steps);
    assert_true(expert_block_version(blk) == steps);
    for (int i = 0; i < T; i++)
        free(recs[i]);
    expert_block_destroy(&blk);
}

/* The network thread may ask for a long time slice (peer/timeslice.h);
 * compute threads it creates run with the kernel's default slice, not an
 * inherited one. */
static uint64_t slice_seen[2];

static void on_done_slice(peer_task *t, int status)
{
    rec *r = (rec *)t;
    slice_seen[r->t.kind == PEER_TASK_INFER] = peer_sched_get_slice();
    on_done(t, status);
}

static void test_compute_threads_default_slice(void **state)
{
    (void)state;
    if (peer_sched_set_slice(PEER_LOOP_SLICE_NS) != 0 || peer_sched_get_slice() != PEER_LOOP_SLICE_NS) {
        (void)peer_sched_set_slice(0);
        skip(); /* no custom slices on this kernel (before Linux 6.12) */
    }
    expert_block *blk = expert_block_create(&cfg, 6);
    sem_t done;
    sem_init(&done, 0, 0);
    atomic_int order = 0;
    peer_batcher_config c = bcfg(1, 4, 16);
    c.infer_threads = 1;
    peer_batcher *b = peer_batcher_create(blk, &c); /* threads start with our slice */
    assert_non_null(b);
    static float x[4 * D], y[2][4 * D];
    fill(x, 4 * D, 10);
    rec r[2];
    memset(r, 0, sizeof r);
    slice_seen[0] = slice_seen[1] = UINT64_MAX;
    for (int i = 0; i < 2; i++) {
        r[i].t = (peer_task){.kind = i ? PEER_TASK_INFER : PEER_TASK_FORWARD, .rows = 4, .inputs = x,
                             .outputs = y[i], .done = on_done_slice};
        r[i].done_sem = &done;
        r[i].order = &order;
        assert_int_equal(peer_batcher_submit(b, &r[i].t), 0);
    }
    sem_wait(&done);
    sem_wait(&done);
    assert_int_equal(peer_sched_get_slice(), PEER_LOOP_SLICE_NS); /* ours is kept */
    assert_int_equal(peer_sched_set_slice(0), 0);
    uint64_t dflt = peer_sched_get_slice(); /* the kernel's default, e.g. 1.4 ms */
    assert_true(dflt > 0 && dflt < PEER_LOOP_SLICE_NS);
    assert_int_equal(slice_seen[0], dflt); /* training thread */
    assert_int_equal(slice_seen[1], dflt); /* inference lane */
    peer_batcher_destroy(&b);
    expert_block_destroy(&blk);
    sem_destroy(&done);
}

/* Kept activations: a backward whose forward ran here (same input, the
 * forward's version) skips the recompute and computes the same gradients
 * as a stateless block; another input, or a backward without a version,
 * recomputes. */
static void test_kept_activations(void **state)
{
    (void)state;
    expert_block *blk = expert_block_create_on(&cfg, 7, g_be ? g_be : expert_backend_cpu());
    expert_block *ref = expert_block_create(&cfg, 7);
    expert_workspace *ws = expert_workspace_create(&cfg, 4);
    sem_t done;
    sem_init(&done, 0, 0);
    atomic_int order = 0;
    peer_batcher_config c = bcfg(1, 8, 32);
    c.keep = 2;
    peer_batcher *b = peer_batcher_create(blk, &c);
    assert_non_null(b);
    static float x[4 * D], x2[4 * D], dy[4 * D], y[4 * D], dx[4 * D], dx_ref[4 * D];
    fill(x, 4 * D, 21);
    fill(x2, 4 * D, 22);
    fill(dy, 4 * D, 23);
    rec r;
    memset(&r, 0, sizeof r);
    r.done_sem = &done;
    r.order = &order;
    r.t = (peer_task){.kind = PEER_TASK_FORWARD, .rows = 4, .inputs = x, .outputs = y, .done = on_done};
    assert_int_equal(peer_batcher_submit(b, &r.t), 0);
    sem_wait(&done);
    assert_int_equal(r.status, 0);
    uint64_t v = r.t.version;
    r.t = (peer_task){.kind = PEER_TASK_BACKWARD, .rows = 4, .inputs = x, .grad_outputs = dy,
                      .outputs = dx, .done = on_done, .has_at_version = 1, .at_version = v};
    assert_int_equal(peer_batcher_submit(b, &r.t), 0);
    sem_wait(&done);
    assert_int_equal(r.status, 0);
    peer_batcher_stats st;
    peer_batcher_get_stats(b, &st);
    assert_int_equal(st.kept_hits, 4);
    assert_int_equal(st.kept_misses, 0);
    assert_int_equal(expert_block_backward(ref, ws, dx_ref, dy, x, 4, NULL), 0);
    assert_true(close_enough(dx, dx_ref, 4 * D, "dx from kept activations"));
    size_t n = expert_block_nparams(blk);
    float *g = malloc(n * sizeof *g), *g_ref = malloc(n * sizeof *g_ref);
    expert_block_copy_grads(blk, g);
    expert_block_copy_grads(ref, g_ref);
    assert_true(close_enough(g, g_ref, n, "grads from kept activations"));

    /* The slot was used up: the same backward again recomputes; so do one
     * for an input never forwarded here, and one without a version. */
    for (int i = 0; i < 3; i++) {
        r.t = (peer_task){.kind = PEER_TASK_BACKWARD, .rows = 4, .inputs = i == 1 ? x2 : x,
                          .grad_outputs = dy, .outputs = dx, .done = on_done,
                          .has_at_version = i != 2, .at_version = v};
        assert_int_equal(peer_batcher_submit(b, &r.t), 0);
        sem_wait(&done);
        assert_int_equal(r.status, 0);
    }
    peer_batcher_get_stats(b, &st);
    assert_int_equal(st.kept_hits, 4);
    assert_int_equal(st.kept_misses, 12);
    free(g);
    free(g_ref);
    peer_batcher_destroy(&b);
    expert_block_destroy(&blk);
    expert_block_destroy(&ref);
    expert_workspace_destroy(&ws);
    sem_destroy(&done);
}

static void test_on_sim(void **state)
{
    expert_backend *be = expert_backend_sim_create(0);
    assert_non_null(be);
    g_be = be;
    test_joined_equals_direct(state);
    test_kept_activations(state);
    g_be = NULL;
    assert_int_equal(expert_backend_sim_used(be), 0);
    expert_backend_sim_destroy(&be);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_joined_equals_direct),
        cmocka_unit_test(test_backpressure_and_priority),
        cmocka_unit_test(test_inference_lane),
        cmocka_unit_test(test_bad_submits),
        cmocka_unit_test(test_concurrent_and_steps),
        cmocka_unit_test(test_compute_threads_default_slice),
        cmocka_unit_test(test_kept_activations),
        cmocka_unit_test(test_on_sim),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
