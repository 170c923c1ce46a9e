/* Deterministic simulation: 500 nodes, 1 % loss, 10-80 ms latency, then 30 %
 * of the nodes killed. Lookups must find their targets, stored records must
 * be found before and after the churn (after republishing). */
#include "test_dht_simnet.h"
#include "test_util.h"

#define SEED 20261121u

static void test_500_nodes(void **state)
{
    (void)state;
    sim_report r;
    assert_int_equal(sim_scenario(500, 0.30, SEED, 300, 60, NULL, &r), 0);
    printf("seed %u: nodes %zu lookups %zu success %.4f median_hops %u p99_hops %u "
           "msgs/lookup %.1f records %zu stored %zu found_before %zu found_after %zu "
           "bytes/node %.0f\n",
           SEED, r.nodes, r.lookups, r.success_rate, r.median_hops, r.p99_hops,
           r.msgs_per_lookup, r.records, r.stored, r.found_before, r.found_after,
           r.bytes_per_node);
    assert_true(r.success_rate >= 0.98);
    assert_true(r.median_hops >= 1 && r.median_hops <= 4);
    assert_int_equal(r.stored, r.records);
    assert_int_equal(r.found_before, r.records);
    assert_true(r.found_after >= r.records - 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_500_nodes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
