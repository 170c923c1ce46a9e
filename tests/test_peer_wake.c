/* tests/test_peer_wake.c: the eventfd loop wake-up (net/wake.h). */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>

#include "test_util.h"

#include "net/wake.h"

typedef struct ctx {
    peer__wake w;
    uv_timer_t deadline;
    atomic_long sent;       /* sends made so far, counted before each send */
    long total;             /* sends the threads will make in all */
    long calls;             /* callbacks on the loop */
    long last_seen;         /* sent as the latest callback saw it */
    int closed;
    int timed_out;
} ctx;

static void on_wake(peer__wake *w)
{
    ctx *c = w->data;
    c->calls++;
    c->last_seen = atomic_load(&c->sent);
    /* Every send happened before this callback or will cause another one,
     * so once the last send is seen the loop can stop waiting. */
    if (c->total && c->last_seen == c->total) {
        uv_timer_stop(&c->deadline);
        uv_stop(w->poll.loop);
    }
}

static void on_deadline(uv_timer_t *t)
{
    ctx *c = t->data;
    c->timed_out = 1;
    uv_stop(t->loop);
}

static void on_closed(peer__wake *w)
{
    ((ctx *)w->data)->closed = 1;
}

static void timer_closed(uv_handle_t *h)
{
    (void)h;
}

static void setup_ctx(ctx *c, uv_loop_t *loop)
{
    memset(c, 0, sizeof *c);
    assert_int_equal(uv_loop_init(loop), 0);
    assert_int_equal(peer__wake_init(&c->w, loop, on_wake, c), 0);
    uv_timer_init(loop, &c->deadline);
    c->deadline.data = c;
}

static void teardown_ctx(ctx *c, uv_loop_t *loop)
{
    int fd = c->w.fd;
    peer__wake_close(&c->w, on_closed);
    peer__wake_close(&c->w, on_closed); /* a second close is a no-op */
    uv_close((uv_handle_t *)&c->deadline, timer_closed);
    assert_int_equal(uv_run(loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(c->closed, 1);
    assert_int_equal(c->w.fd, -1);
    assert_int_equal(fcntl(fd, F_GETFD), -1); /* the eventfd is closed */
    assert_int_equal(uv_loop_close(loop), 0);
}

typedef struct sender_arg {
    ctx *c;
    int n;
} sender_arg;

static void *sender(void *p)
{
    sender_arg *a = p;
    for (int i = 0; i < a->n; i++) {
        atomic_fetch_add(&a->c->sent, 1);
        peer__wake_send(&a->c->w);
    }
    return NULL;
}

/* Four threads send 20,000 times in all while the loop runs: the loop sees
 * every send (the last callback comes after the last send), and sends that
 * arrive together share a callback. */
static void test_threads_wake_the_loop(void **state)
{
    (void)state;
    uv_loop_t loop;
    ctx c;
    setup_ctx(&c, &loop);
    enum { THREADS = 4, EACH = 5000 };
    c.total = THREADS * EACH;
    uv_timer_start(&c.deadline, on_deadline, 20000, 0);
    pthread_t th[THREADS];
    sender_arg a = {&c, EACH};
    for (int i = 0; i < THREADS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, sender, &a), 0);
    uv_run(&loop, UV_RUN_DEFAULT);
    for (int i = 0; i < THREADS; i++)
        pthread_join(th[i], NULL);
    assert_false(c.timed_out);
    assert_int_equal(c.last_seen, c.total);
    assert_true(c.calls >= 1 && c.calls <= c.total);
    teardown_ctx(&c, &loop);
}

/* Sends made before the loop runs coalesce into one callback; without a
 * send there is none. */
static void test_coalesce_and_quiet(void **state)
{
    (void)state;
    uv_loop_t loop;
    ctx c;
    setup_ctx(&c, &loop);
    uv_timer_start(&c.deadline, on_deadline, 50, 0);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_true(c.timed_out);
    assert_int_equal(c.calls, 0);

    for (int i = 0; i < 100; i++)
        peer__wake_send(&c.w);
    c.timed_out = 0;
    uv_timer_start(&c.deadline, on_deadline, 50, 0);
    uv_run(&loop, UV_RUN_DEFAULT);
    assert_true(c.timed_out);
    assert_int_equal(c.calls, 1);
    teardown_ctx(&c, &loop);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_threads_wake_the_loop),
        cmocka_unit_test(test_coalesce_and_quiet),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
