/* Choosing and moving spans of stages (swarm/balance.h). */
#include <errno.h>

#include "swarm/balance.h"
#include "test_util.h"

static void test_choose(void **state)
{
    (void)state;
    uint64_t rng = 1;
    double t[6] = {100, 100, 0, 0, 100, 100};
    assert_int_equal(route_balance_choose(t, 6, 2, &rng), 2);   /* the uncovered pair */
    assert_int_equal(route_balance_choose(t, 6, 1, &rng) / 2, 1); /* stage 2 or 3 */
    double u[6] = {5, 100, 100, 100, 100, 1};
    assert_int_equal(route_balance_choose(u, 6, 1, &rng), 5);
    assert_int_equal(route_balance_choose(u, 6, 6, &rng), 0);
    assert_int_equal(route_balance_choose(u, 6, 7, &rng), -EINVAL);
    uint64_t zero = 0;
    assert_int_equal(route_balance_choose(u, 6, 1, &zero), -EINVAL);
    /* An empty swarm: only aligned spans, each about equally often. */
    double e[6] = {0};
    int seen[6] = {0};
    for (int i = 0; i < 600; i++)
        seen[route_balance_choose(e, 6, 2, &rng)]++;
    for (int s = 0; s < 6; s += 2)
        if (seen[s] < 150)
            fail_msg("start %d chosen %d times of 600", s, seen[s]);
    assert_int_equal(seen[1] + seen[3] + seen[5], 0);
    /* 7 stages, spans of 3: 0, 3 and the last full span 4. */
    double e7[7] = {0};
    int seen7[7] = {0};
    for (int i = 0; i < 300; i++)
        seen7[route_balance_choose(e7, 7, 3, &rng)]++;
    assert_true(seen7[0] > 0 && seen7[3] > 0 && seen7[4] > 0);
    assert_int_equal(seen7[1] + seen7[2], 0);
}

static void test_move_for_coverage(void **state)
{
    (void)state;
    uint64_t rng = 7;
    int to = -1;
    /* We serve 0-1 alongside another peer; 4-5 are uncovered: move there
     * if we have the higher ID (nobody outranks us), else leave it to the
     * other peer, every time. */
    double t[6] = {100, 100, 100, 100, 0, 0};
    int h[6] = {1, 1, 1, 1, 0, 0};
    for (int i = 0; i < 100; i++) {
        to = -1;
        assert_int_equal(route_balance_should_move(t, h, 6, 2, 0, 0.5, 0, &rng, &to), 1);
        assert_int_equal(to, 4);
        assert_int_equal(route_balance_should_move(t, h, 6, 2, 0, 0.5, 1, &rng, &to), 0);
    }
    /* Overlapping spans 1-3 and 2-4 (we are 1-3) leave 0 and 5 empty:
     * moving to 0-2 covers 0 and gives up nothing the other keeps. */
    double t2[6] = {0, 0, 100, 100, 100, 0};
    int h2[6] = {0, 0, 1, 1, 1, 0};
    assert_int_equal(route_balance_should_move(t2, h2, 6, 3, 1, 0.5, 0, &rng, &to), 1);
    assert_int_equal(to, 0);
    /* Sole holder of stage 1 with nothing better: stay. */
    double t3[6] = {100, 0, 100, 100, 100, 100};
    int h3[6] = {1, 0, 1, 1, 1, 1};
    assert_int_equal(route_balance_should_move(t3, h3, 6, 2, 0, 0.5, 0, &rng, &to), 0);
}

static void test_move_for_throughput(void **state)
{
    (void)state;
    uint64_t rng = 9;
    int to = -1;
    /* Everything covered; 4-5 much weaker than ours: move, unless the other
     * holder of 0-1 outranks us. */
    double t[6] = {100, 100, 100, 100, 10, 10};
    int h[6] = {1, 1, 1, 1, 1, 1};
    assert_int_equal(route_balance_should_move(t, h, 6, 2, 0, 0.5, 1, &rng, &to), 0);
    assert_int_equal(route_balance_should_move(t, h, 6, 2, 0, 0.5, 0, &rng, &to), 1);
    assert_int_equal(to, 4);
    /* Hysteresis: a slightly weaker span is not worth a move. */
    double w[6] = {100, 100, 80, 80, 100, 100};
    assert_int_equal(route_balance_should_move(w, h, 6, 2, 0, 0.5, 0, &rng, &to), 0);
    /* Already the best place; bad arguments. */
    assert_int_equal(route_balance_should_move(t, h, 6, 2, 4, 0.5, 0, &rng, &to), 0);
    assert_int_equal(route_balance_should_move(t, h, 6, 2, 5, 0.5, 0, &rng, &to), -EINVAL);
    assert_int_equal(route_balance_should_move(t, h, 6, 2, 0, 1.5, 0, &rng, &to), -EINVAL);
    assert_int_equal(route_balance_should_move(t, h, 6, 2, 0, 0.5, -1, &rng, &to), -EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_choose),
        cmocka_unit_test(test_move_for_coverage),
        cmocka_unit_test(test_move_for_throughput),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
