/* tests/test_routing_versions.c: noticing a holder whose weight version went
 * down (routing/versions.h), per (stage, holder), once per restart, and not
 * for replies that merely arrive out of order over one connection. */
#include <errno.h>

#include "routing/versions.h"
#include "test_util.h"

static void test_rollbacks(void **state)
{
    (void)state;
    route_versions *v = route_versions_create();
    assert_non_null(v);
    uint8_t a[ROUTE_ID_LEN], b[ROUTE_ID_LEN];
    memset(a, 0xaa, sizeof a);
    memset(b, 0xbb, sizeof b);
    uint64_t from = 999;

    /* Holder a serves stage 3 over connection 1, up to version 12. */
    for (uint64_t ver = 0; ver <= 12; ver++)
        assert_int_equal(route_versions_observe(v, 3, a, 1, ver, &from), 0);
    /* Out of order over the same connection (two compute threads): not a
     * rollback, and the highest stays 12. */
    assert_int_equal(route_versions_observe(v, 3, a, 1, 10, &from), 0);
    /* Another replica of the same stage is behind: compared per holder. */
    assert_int_equal(route_versions_observe(v, 3, b, 2, 4, &from), 0);
    /* The same holder on another stage has its own record. */
    assert_int_equal(route_versions_observe(v, 4, a, 1, 2, &from), 0);
    assert_true(from == 999);

    /* a restarted from its initial weights: a new connection, version 0. */
    assert_int_equal(route_versions_observe(v, 3, a, 3, 0, &from), 1);
    assert_true(from == 12);
    /* Reported once: it then climbs again. */
    from = 999;
    for (uint64_t ver = 0; ver <= 5; ver++)
        assert_int_equal(route_versions_observe(v, 3, a, 3, ver, &from), 0);
    assert_true(from == 999);
    /* A reconnection to the same live process: its version did not drop. */
    assert_int_equal(route_versions_observe(v, 3, a, 4, 5, &from), 0);
    assert_int_equal(route_versions_observe(v, 3, a, 5, 7, &from), 0);
    /* Restarted again, from a checkpoint at version 2: a second event. */
    assert_int_equal(route_versions_observe(v, 3, a, 6, 2, &from), 1);
    assert_true(from == 7);

    assert_int_equal(route_versions_observe(NULL, 3, a, 1, 1, &from), -EINVAL);
    assert_int_equal(route_versions_observe(v, -1, a, 1, 1, &from), -EINVAL);
    route_versions_destroy(&v);
    assert_null(v);
    route_versions_destroy(&v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rollbacks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
