/* Where a peer without --blocks starts and when it moves, from views of the
 * swarm (peer/rebalance.h); no process, no network. */
#include <errno.h>

#include "peer/rebalance.h"
#include "test_util.h"

#define N 6

/* A swarm view of n stages, holders added by add(). */
typedef struct view {
    route_stage *stages;
    const route_stage *ptr[ROUTE_SWARM_MAX_STAGES];
    int n;
} view;

static void view_init(view *v, int n)
{
    v->stages = calloc((size_t)n, sizeof *v->stages);
    assert_non_null(v->stages);
    v->n = n;
    for (int i = 0; i < n; i++) {
        v->stages[i].index = i;
        v->ptr[i] = &v->stages[i];
    }
}

static void view_free(view *v)
{
    free(v->stages);
    v->stages = NULL;
}

static void make_id(uint8_t id[DHT_ID_LEN], uint8_t b)
{
    memset(id, b, DHT_ID_LEN);
}

/* Peer `idb` (its ID: every byte idb) holds [start, start+k) with
 * throughput tput, in state st. */
static void add(view *v, uint8_t idb, int start, int k, double tput, peer_state st)
{
    for (int i = start; i < start + k; i++) {
        route_stage *s = &v->stages[i];
        assert_true(s->n_holders < ROUTE_MAX_HOLDERS);
        route_holder *h = &s->holders[s->n_holders++];
        make_id(h->rep.id, idb);
        h->ann.state = st;
        h->ann.throughput = tput;
    }
}

static void test_scores(void **state)
{
    (void)state;
    view v;
    view_init(&v, 3);
    uint8_t self[DHT_ID_LEN];
    make_id(self, 0x10);
    add(&v, 0x10, 0, 3, 500, PEER_STATE_ONLINE);   /* us: left out of our own view */
    add(&v, 0x20, 0, 1, 100, PEER_STATE_ONLINE);
    add(&v, 0x21, 0, 1, 50, PEER_STATE_ONLINE);
    add(&v, 0x22, 0, 1, 100, PEER_STATE_OFFLINE);  /* not counted */
    add(&v, 0x23, 1, 1, 0, PEER_STATE_ONLINE);     /* no throughput announced */
    add(&v, 0x24, 1, 1, 0, PEER_STATE_JOINING);
    double score[3];
    int holders[3];
    route_rebalance_scores(v.ptr, 3, self, score, holders);
    /* Holder-equivalents: 150 / 100; the holder count without throughput. */
    assert_int_equal(holders[0], 2);
    assert_true(score[0] > 1.499 && score[0] < 1.501);
    assert_int_equal(holders[1], 1);
    assert_true(score[1] == 1.0);
    assert_int_equal(holders[2], 0);
    assert_true(score[2] == 0.0);
    /* Every holder (a newcomer's view): we count too. */
    route_rebalance_scores(v.ptr, 3, NULL, score, holders);
    assert_int_equal(holders[0], 3);
    assert_true(score[0] > 1.299 && score[0] < 1.301); /* 650 / 500 */
    /* No view at all: nothing served. */
    route_rebalance_scores(NULL, 3, self, score, holders);
    for (int i = 0; i < 3; i++)
        assert_true(score[i] == 0.0 && holders[i] == 0);
    view_free(&v);
}

static void test_outranking(void **state)
{
    (void)state;
    view v;
    view_init(&v, N);
    uint8_t self[DHT_ID_LEN];
    make_id(self, 0x10);
    add(&v, 0x10, 0, 2, 100, PEER_STATE_ONLINE);   /* us: 0-1 */
    add(&v, 0x05, 0, 2, 100, PEER_STATE_ONLINE);   /* lower ID: does not outrank */
    add(&v, 0x20, 0, 2, 100, PEER_STATE_ONLINE);   /* outranks */
    add(&v, 0x30, 0, 1, 100, PEER_STATE_ONLINE);   /* higher, but only stage 0 */
    add(&v, 0x31, 1, 1, 100, PEER_STATE_ONLINE);   /* higher, but only stage 1 */
    add(&v, 0x40, 0, 2, 100, PEER_STATE_OFFLINE);  /* higher, offline */
    assert_int_equal(route_rebalance_outranking(v.ptr, N, self, 0, 2), 1);
    add(&v, 0x50, 0, 2, 100, PEER_STATE_ONLINE);
    assert_int_equal(route_rebalance_outranking(v.ptr, N, self, 0, 2), 2);
    assert_int_equal(route_rebalance_outranking(NULL, N, self, 0, 2), 0);
    assert_int_equal(route_rebalance_outranking(v.ptr, N, self, 5, 2), -EINVAL);
    assert_int_equal(route_rebalance_outranking(v.ptr, N, NULL, 0, 2), -EINVAL);
    view_free(&v);
}

static void test_choose_start(void **state)
{
    (void)state;
    uint64_t rng = 3;
    double served = -1;
    /* No data yet: an aligned span, nothing served. */
    for (int i = 0; i < 50; i++) {
        int s = route_rebalance_choose_start(NULL, N, 2, &rng, &served);
        assert_true(s == 0 || s == 2 || s == 4);
        assert_true(served == 0.0);
    }
    /* A lopsided swarm: 0-2 once, 3-5 twice: the newcomer of three takes 0-2. */
    view v;
    view_init(&v, N);
    add(&v, 0x01, 0, 3, 100, PEER_STATE_ONLINE);
    add(&v, 0x02, 3, 3, 100, PEER_STATE_ONLINE);
    add(&v, 0x03, 3, 3, 100, PEER_STATE_ONLINE);
    assert_int_equal(route_rebalance_choose_start(v.ptr, N, 3, &rng, &served), 0);
    assert_true(served == 3.0);
    /* Holder-equivalents, not throughput: one fast holder of 3-5 serves them
     * less than three slow ones serve 0-2. */
    view w;
    view_init(&w, N);
    add(&w, 0x01, 0, 3, 10, PEER_STATE_ONLINE);
    add(&w, 0x02, 0, 3, 10, PEER_STATE_ONLINE);
    add(&w, 0x03, 0, 3, 10, PEER_STATE_ONLINE);
    add(&w, 0x04, 3, 3, 1000, PEER_STATE_ONLINE);
    assert_int_equal(route_rebalance_choose_start(w.ptr, N, 3, &rng, NULL), 3);
    assert_int_equal(route_rebalance_choose_start(w.ptr, N, 7, &rng, NULL), -EINVAL);
    assert_int_equal(route_rebalance_choose_start(w.ptr, ROUTE_SWARM_MAX_STAGES + 1, 1, &rng, NULL), -EINVAL);
    view_free(&v);
    view_free(&w);
}

static void test_decide_no_data(void **state)
{
    (void)state;
    uint64_t rng = 5;
    uint8_t self[DHT_ID_LEN];
    make_id(self, 0x10);
    int yielded = 0, to = -1;
    /* Nothing looked up yet, or only ourselves seen: stay. */
    assert_int_equal(route_rebalance_decide(NULL, N, self, 0, 2, &yielded, &rng, &to), 0);
    view v;
    view_init(&v, N);
    assert_int_equal(route_rebalance_decide(v.ptr, N, self, 2, 2, &yielded, &rng, &to), 0);
    add(&v, 0x10, 2, 2, 100, PEER_STATE_ONLINE);
    assert_int_equal(route_rebalance_decide(v.ptr, N, self, 2, 2, &yielded, &rng, &to), 0);
    assert_int_equal(to, -1);
    assert_int_equal(yielded, 0);
    /* Bad arguments. */
    assert_int_equal(route_rebalance_decide(v.ptr, N, self, 5, 2, &yielded, &rng, &to), -EINVAL);
    assert_int_equal(route_rebalance_decide(v.ptr, N, NULL, 0, 2, &yielded, &rng, &to), -EINVAL);
    assert_int_equal(route_rebalance_decide(v.ptr, N, self, 0, 2, NULL, &rng, &to), -EINVAL);
    view_free(&v);
}

/* We share 0-1 with peer `other`; peer 0x30 holds 2-3; 4-5 have no holder. */
static void shared_span(view *v, uint8_t other)
{
    view_init(v, N);
    add(v, 0x10, 0, 2, 100, PEER_STATE_ONLINE);
    add(v, other, 0, 2, 100, PEER_STATE_ONLINE);
    add(v, 0x30, 2, 2, 100, PEER_STATE_ONLINE);
}

static void test_decide_outranked(void **state)
{
    (void)state;
    uint64_t rng = 11;
    uint8_t self[DHT_ID_LEN], other[DHT_ID_LEN];
    make_id(self, 0x10);
    make_id(other, 0x20);
    view v;
    shared_span(&v, 0x20);
    /* The other sharer has the higher ID: it moves to the gap at once. */
    int yielded = 0, to = -1;
    assert_int_equal(route_rebalance_decide(v.ptr, N, other, 0, 2, &yielded, &rng, &to), 1);
    assert_int_equal(to, 4);
    /* We leave it the move on ROUTE_REBALANCE_MAX_YIELDS - 1 checks in a
     * row, then go anyway (it may be a --blocks peer that never moves). */
    yielded = 0;
    for (int i = 1; i < ROUTE_REBALANCE_MAX_YIELDS; i++) {
        to = -1;
        assert_int_equal(route_rebalance_decide(v.ptr, N, self, 0, 2, &yielded, &rng, &to), 0);
        assert_int_equal(yielded, i);
    }
    to = -1;
    assert_int_equal(route_rebalance_decide(v.ptr, N, self, 0, 2, &yielded, &rng, &to), 1);
    assert_int_equal(to, 4);
    assert_int_equal(yielded, 0);
    /* A check with nothing to do resets the count. */
    yielded = 2;
    add(&v, 0x40, 4, 2, 100, PEER_STATE_ONLINE);
    assert_int_equal(route_rebalance_decide(v.ptr, N, self, 0, 2, &yielded, &rng, &to), 0);
    assert_int_equal(yielded, 0);
    view_free(&v);
    /* The sharer has a lower ID: we are the one to move. */
    shared_span(&v, 0x05);
    yielded = 0;
    assert_int_equal(route_rebalance_decide(v.ptr, N, self, 0, 2, &yielded, &rng, &to), 1);
    assert_int_equal(to, 4);
    view_free(&v);
}

static void test_decide_lone_holder(void **state)
{
    (void)state;
    uint64_t rng = 13;
    uint8_t self[DHT_ID_LEN];
    make_id(self, 0x10);
    int yielded = 0, to = -1;
    /* We alone hold stage 0; stage 3 has no holder. Moving would open one
     * gap to close another: stay, every time. */
    view v;
    view_init(&v, 4);
    add(&v, 0x10, 0, 1, 100, PEER_STATE_ONLINE);
    add(&v, 0x20, 1, 1, 100, PEER_STATE_ONLINE);
    add(&v, 0x21, 1, 1, 100, PEER_STATE_ONLINE);
    add(&v, 0x22, 2, 1, 100, PEER_STATE_ONLINE);
    for (int i = 0; i < 50; i++)
        assert_int_equal(route_rebalance_decide(v.ptr, 4, self, 0, 1, &yielded, &rng, &to), 0);
    /* Every other stage covered but much better served than ours: still
     * stay, since leaving would uncover stage 0. */
    add(&v, 0x23, 3, 1, 100, PEER_STATE_ONLINE);
    for (int i = 0; i < 50; i++)
        assert_int_equal(route_rebalance_decide(v.ptr, 4, self, 0, 1, &yielded, &rng, &to), 0);
    /* Three more holders of stage 0, none outranking us: stage 3 is now
     * served less than half as well as ours (1 against 3 holder-equivalents). */
    add(&v, 0x24, 2, 1, 100, PEER_STATE_ONLINE);
    add(&v, 0x05, 0, 1, 100, PEER_STATE_ONLINE);
    add(&v, 0x06, 0, 1, 100, PEER_STATE_ONLINE);
    add(&v, 0x07, 0, 1, 100, PEER_STATE_ONLINE);
    assert_int_equal(route_rebalance_decide(v.ptr, 4, self, 0, 1, &yielded, &rng, &to), 1);
    assert_int_equal(to, 3);
    view_free(&v);
}

static void test_decide_throughput(void **state)
{
    (void)state;
    uint64_t rng = 17;
    uint8_t self[DHT_ID_LEN];
    make_id(self, 0x10);
    int yielded = 0, to = -1;
    /* Every stage covered. 0-1 (ours) has three slow other holders, 2-3 and
     * 4-5 one fast holder each: in holder-equivalents 2-3 and 4-5 are served
     * a third as well as 0-1 (raw throughput would say the opposite). */
    view v;
    view_init(&v, N);
    add(&v, 0x10, 0, 2, 10, PEER_STATE_ONLINE);
    add(&v, 0x01, 0, 2, 10, PEER_STATE_ONLINE);
    add(&v, 0x02, 0, 2, 10, PEER_STATE_ONLINE);
    add(&v, 0x03, 0, 2, 10, PEER_STATE_ONLINE);
    add(&v, 0x04, 2, 2, 1000, PEER_STATE_ONLINE);
    add(&v, 0x05, 4, 2, 1000, PEER_STATE_ONLINE);
    assert_int_equal(route_rebalance_decide(v.ptr, N, self, 0, 2, &yielded, &rng, &to), 1);
    assert_true(to == 2 || to == 4);
    /* Hysteresis: one other holder of ours (2 against 1+1) is not "less
     * than half": stay. */
    view w;
    view_init(&w, N);
    add(&w, 0x10, 0, 2, 10, PEER_STATE_ONLINE);
    add(&w, 0x01, 0, 2, 10, PEER_STATE_ONLINE);
    add(&w, 0x04, 2, 2, 1000, PEER_STATE_ONLINE);
    add(&w, 0x05, 4, 2, 1000, PEER_STATE_ONLINE);
    assert_int_equal(route_rebalance_decide(w.ptr, N, self, 0, 2, &yielded, &rng, &to), 0);
    view_free(&v);
    view_free(&w);
}

static void test_span_name(void **state)
{
    (void)state;
    char buf[32];
    route_rebalance_span_name(buf, sizeof buf, 3, 1);
    assert_string_equal(buf, "3");
    route_rebalance_span_name(buf, sizeof buf, 2, 3);
    assert_string_equal(buf, "2-4");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scores),
        cmocka_unit_test(test_outranking),
        cmocka_unit_test(test_choose_start),
        cmocka_unit_test(test_decide_no_data),
        cmocka_unit_test(test_decide_outranked),
        cmocka_unit_test(test_decide_lone_holder),
        cmocka_unit_test(test_decide_throughput),
        cmocka_unit_test(test_span_name),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
