/* Replica choice, bans and back-off (routing/swarm.h). */
#include <errno.h>
#include <math.h>

#include "routing/swarm.h"
#include "test_util.h"

static void mkid(uint8_t id[ROUTE_ID_LEN], int k)
{
    memset(id, 0, ROUTE_ID_LEN);
    id[0] = (uint8_t)k;
}

static void init3(route_replica r[3], double t0, double t1, double t2)
{
    uint8_t id[ROUTE_ID_LEN];
    double t[3] = {t0, t1, t2};
    for (int i = 0; i < 3; i++) {
        mkid(id, i);
        route_replica_init(&r[i], id, t[i], 0.0);
    }
}

/* Picks follow the weights: a replica announcing twice the throughput gets
 * about twice the requests, and every replica gets some (once measured:
 * unmeasured claims are capped by the others' median, below). */
static void test_choice_is_proportional(void **state)
{
    (void)state;
    route_replica r[3];
    init3(r, 100, 200, 400);
    for (int i = 0; i < 3; i++)
        route_replica_measured(&r[i], 100, 1.0); /* 100 rows/s: caps at 400 */
    uint64_t rng = 42;
    int counts[3] = {0};
    const int N = 70000;
    for (int k = 0; k < N; k++) {
        int i = route_pick_replica(r, 3, NULL, 0.0, &rng, NULL);
        assert_true(i >= 0 && i < 3);
        counts[i]++;
    }
    double wsum = 0, w[3];
    for (int i = 0; i < 3; i++)
        wsum += (w[i] = route_replica_weight(&r[i], 0.0));
    for (int i = 0; i < 3; i++) {
        double want = w[i] / wsum, got = (double)counts[i] / N;
        if (fabs(got - want) > 0.01)
            fail_msg("replica %d: share %.4f, want %.4f (seed 42)", i, got, want);
    }
    assert_true(counts[2] > counts[1] && counts[1] > counts[0]);
}

/* Issue 18 (6): a holder announcing 10^9 samples/s. Unmeasured, its claim
 * counts as the others' median; measured, as at most 4x what we saw. */
static void test_throughput_cap(void **state)
{
    (void)state;
    route_replica r[3];
    init3(r, 8000, 1e9, 6000);
    assert_true(route_replica_tput(r, 3, 1) == 8000);  /* upper median of 8000, 6000 */
    assert_true(route_replica_tput(r, 3, 0) == 8000);  /* below the median: as claimed */
    assert_true(route_replica_tput(r, 3, 2) == 6000);
    uint64_t rng = 7;
    int counts[3] = {0};
    for (int k = 0; k < 30000; k++)
        counts[route_pick_replica(r, 3, NULL, 0.0, &rng, NULL)]++;
    /* About a third each (8000 : 8000 : 6000), not nearly everything. */
    if (counts[1] > 30000 / 2)
        fail_msg("the 1e9 claim got %d of 30000 picks (seed 7)", counts[1]);
    /* Measured at 500 rows/s: at most 2000. */
    route_replica_measured(&r[1], 50, 0.1);
    assert_true(fabs(route_replica_tput(r, 3, 1) - 4 * 500.0) < 1e-6);
    assert_true(route_replica_weight(&r[1], 0) < route_replica_weight(&r[0], 0));
    /* A replica measured faster than it claims keeps its claim. */
    route_replica_measured(&r[2], 10000, 1.0);
    assert_true(route_replica_tput(r, 3, 2) == 6000);
    /* The EWMA moves toward new samples; bad samples are ignored. */
    double before = r[1].meas_tput;
    route_replica_measured(&r[1], 0, 1.0);
    route_replica_measured(&r[1], 10, 0.0);
    route_replica_measured(&r[1], 10, NAN);
    assert_true(r[1].meas_tput == before);
    route_replica_measured(&r[1], 1000, 1.0);
    assert_true(r[1].meas_tput > before && r[1].meas_tput < 1000);
    /* A lone replica: nothing to compare with, its claim stands. */
    assert_true(route_replica_tput(r, 1, 0) == 8000);
    /* Unknown claims stay unknown (the weight then uses a modest default). */
    r[0].tput = -1;
    assert_true(route_replica_tput(r, 3, 0) == 0);
    assert_true(route_replica_tput(r, 3, 3) == 0 && route_replica_tput(NULL, 3, 0) == 0);
}

static void test_weight_orders(void **state)
{
    (void)state;
    route_replica r[3];
    init3(r, 100, 100, 100);
    double base = route_replica_weight(&r[0], 0);
    r[1].inflight = 3;
    assert_true(route_replica_weight(&r[1], 0) < base / 3);
    r[2].load = 1.0;
    assert_true(route_replica_weight(&r[2], 0) < base / 3);
    /* Hostile announcements never give a non-finite or negative weight. */
    r[0].tput = NAN;
    r[0].load = -5;
    r[0].latency_s = INFINITY;
    double w = route_replica_weight(&r[0], 0);
    assert_true(isfinite(w) && w > 0);
    r[0].tput = 1e300;
    r[0].load = 0;
    r[0].latency_s = 0;
    w = route_replica_weight(&r[0], 0);
    assert_true(isfinite(w) && w > 0);
}

static void test_bans_and_backoff(void **state)
{
    (void)state;
    route_replica r[3];
    init3(r, 100, 100, 100);
    uint64_t rng = 7;
    double now = 1000.0;

    route_replica_failure(&r[1], now, &rng);
    assert_true(r[1].banned_until >= now + ROUTE_BAN_BASE_S);
    assert_true(r[1].banned_until < now + 1.25 * ROUTE_BAN_BASE_S);
    for (int k = 0; k < 2000; k++)
        assert_int_not_equal(route_pick_replica(r, 3, NULL, now + 0.5, &rng, NULL), 1);

    /* Each further failure doubles the ban, up to the cap. */
    double prev = ROUTE_BAN_BASE_S;
    for (int f = 2; f < 12; f++) {
        route_replica_failure(&r[1], now, &rng);
        double want = fmin(prev * 2, ROUTE_BAN_MAX_S);
        double got = r[1].banned_until - now;
        if (!(got >= want && got < want * 1.25))
            fail_msg("failure %d: ban %.3f s, want [%.3f, %.3f)", f, got, want, want * 1.25);
        prev = want;
    }
    /* After the ban it is chosen again; a success clears the record. */
    int seen = 0;
    for (int k = 0; k < 2000 && !seen; k++)
        seen = route_pick_replica(r, 3, NULL, now + ROUTE_BAN_MAX_S * 1.3, &rng, NULL) == 1;
    assert_true(seen);
    route_replica_success(&r[1], 0.010);
    assert_int_equal(r[1].failures, 0);
    assert_true(r[1].banned_until == 0.0);
    assert_true(fabs(r[1].latency_s - 0.010) < 1e-12);
    route_replica_success(&r[1], 0.020);
    assert_true(fabs(r[1].latency_s - (0.8 * 0.010 + 0.2 * 0.020)) < 1e-12);
}

static void test_all_banned_or_skipped(void **state)
{
    (void)state;
    route_replica r[3];
    init3(r, 100, 100, 100);
    uint64_t rng = 99;
    double retry = -1;
    r[0].banned_until = 30;
    r[1].banned_until = 20;
    r[2].banned_until = 25;
    assert_int_equal(route_pick_replica(r, 3, NULL, 10, &rng, &retry), -EAGAIN);
    assert_true(retry == 20);
    assert_int_equal(route_pick_replica(r, 3, NULL, 21, &rng, &retry), 1);

    /* The skip mask is how a retry avoids the replica that just failed. */
    uint8_t skip[3] = {1, 0, 1};
    init3(r, 100, 100, 100);
    for (int k = 0; k < 100; k++)
        assert_int_equal(route_pick_replica(r, 3, skip, 0, &rng, NULL), 1);
    skip[1] = 1;
    assert_int_equal(route_pick_replica(r, 3, skip, 0, &rng, &retry), -EAGAIN);
    assert_true(retry == 0);
    assert_int_equal(route_pick_replica(r, 0, NULL, 0, &rng, &retry), -EAGAIN);
}

/* Issue 17: a holder killed and restarted stayed unused for minutes after
 * its return: its ban had grown to 60 s (75 with jitter) and nothing lifted
 * it. Bans are now capped at ROUTE_BAN_MAX_S (10 s), a sign of life lifts
 * them, and when every replica is banned the one whose ban ends first is
 * probed. */
static void test_ban_cap_unban_and_probe(void **state)
{
    (void)state;
    route_replica r[3];
    init3(r, 100, 100, 100);
    uint64_t rng = 11;
    double now = 50.0;
    for (int f = 0; f < 40; f++)
        route_replica_failure(&r[0], now, &rng);
    if (!(r[0].banned_until - now <= 10.0 * 1.25))
        fail_msg("after 40 failures the ban is %.1f s, want at most 12.5", r[0].banned_until - now);
    assert_true(ROUTE_BAN_MAX_S <= 10.0);

    /* A sign of life ends the ban but keeps the count: the next failure
     * bans for the capped time again, not the first second. */
    route_replica_unban(&r[0]);
    assert_true(route_replica_weight(&r[0], now) > 0);
    assert_int_equal(r[0].failures, 30);
    route_replica_failure(&r[0], now, &rng);
    assert_true(r[0].banned_until - now >= ROUTE_BAN_MAX_S);

    /* Probing: only when every candidate is banned; the earliest ban end. */
    init3(r, 100, 100, 100);
    assert_int_equal(route_pick_probe(r, 3, NULL, now), -EAGAIN); /* none banned */
    r[0].banned_until = now + 9;
    r[1].banned_until = now + 3;
    assert_int_equal(route_pick_probe(r, 3, NULL, now), -EAGAIN); /* r[2] is free */
    r[2].banned_until = now + 5;
    assert_int_equal(route_pick_replica(r, 3, NULL, now, &rng, NULL), -EAGAIN);
    assert_int_equal(route_pick_probe(r, 3, NULL, now), 1);
    uint8_t skip[3] = {0, 1, 0};
    assert_int_equal(route_pick_probe(r, 3, skip, now), 2);
    skip[0] = skip[2] = 1;
    assert_int_equal(route_pick_probe(r, 3, skip, now), -EAGAIN); /* all skipped */
    assert_int_equal(route_pick_probe(r, 0, NULL, now), -EAGAIN);
    assert_int_equal(route_pick_probe(NULL, 3, NULL, now), -EINVAL);
}

static void test_bad_arguments_and_determinism(void **state)
{
    (void)state;
    route_replica r[3];
    init3(r, 100, 200, 300);
    uint64_t zero = 0, a = 5, b = 5;
    assert_int_equal(route_pick_replica(r, 3, NULL, 0, &zero, NULL), -EINVAL);
    assert_int_equal(route_pick_replica(NULL, 3, NULL, 0, &a, NULL), -EINVAL);
    assert_int_equal(route_pick_replica(r, -1, NULL, 0, &a, NULL), -EINVAL);
    for (int k = 0; k < 1000; k++)
        assert_int_equal(route_pick_replica(r, 3, NULL, 0, &a, NULL),
                         route_pick_replica(r, 3, NULL, 0, &b, NULL));
    for (int k = 0; k < 100000; k++) {
        double x = route_rand01(&a);
        assert_true(x >= 0.0 && x < 1.0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_choice_is_proportional),
        cmocka_unit_test(test_throughput_cap),
        cmocka_unit_test(test_weight_orders),
        cmocka_unit_test(test_bans_and_backoff),
        cmocka_unit_test(test_all_banned_or_skipped),
        cmocka_unit_test(test_ban_cap_unban_and_probe),
        cmocka_unit_test(test_bad_arguments_and_determinism),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
