/* peer/statesync.h, trust: a holder's claimed weight version or
 * throughput is checked against what the other holders of its stage
 * claim. A lone outlier far above the others is suspect; a lagging
 * holder never makes its peers suspect; one claim alone is trusted (trust
 * on first use); a majority of liars makes its claim the median (the
 * documented limit). The newcomer's choice also bounds the version a
 * downloaded state may have. */
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "peer/statesync.h"

static void test_median(void **state)
{
    (void)state;
    uint64_t v[5] = {412, 0, 1000000000, 410, 415};
    /* Zeros (initial weights) are no evidence; the upper median. */
    assert_int_equal(peer_trust_median_u64(v, 5, -1), 415);
    assert_int_equal(peer_trust_median_u64(v, 5, 2), 412);
    assert_int_equal(peer_trust_median_u64(v, 1, 0), 0);
    assert_int_equal(peer_trust_median_u64(NULL, 3, -1), 0);
    uint64_t two[2] = {50, 4900};
    assert_int_equal(peer_trust_median_u64(two, 2, -1), 4900);
    double t[4] = {100, -1, INFINITY, 300};
    assert_true(peer_trust_median(t, 4, -1) == 300);
    assert_true(peer_trust_median(t, 4, 3) == 100);
    assert_true(peer_trust_median(t, 2, 0) == 0);
}

/* The attack of issue 18: one holder claims 10^9 against two at ~412. */
static void test_lone_outlier(void **state)
{
    (void)state;
    uint64_t v[3] = {412, 1000000000, 410};
    uint8_t sus[3];
    uint64_t max = peer_statesync_choose(v, 3, sus);
    assert_int_equal(sus[0], 0);
    assert_int_equal(sus[1], 1);
    assert_int_equal(sus[2], 0);
    assert_int_equal(max, PEER_TRUST_VERSION_FACTOR * 412 + PEER_TRUST_VERSION_SLACK);
    /* One honest holder is enough to compare with. */
    uint64_t w[2] = {1000000000, 12};
    assert_int_equal(peer_statesync_choose(w, 2, sus), PEER_TRUST_VERSION_FACTOR * 12 + PEER_TRUST_VERSION_SLACK);
    assert_int_equal(sus[0], 1);
    assert_int_equal(sus[1], 0);
    /* Near the bound: factor x 412 + slack is still trusted, one more is not. */
    uint64_t b[2] = {412, PEER_TRUST_VERSION_FACTOR * 412 + PEER_TRUST_VERSION_SLACK};
    peer_statesync_choose(b, 2, sus);
    assert_int_equal(sus[1], 0);
    b[1]++;
    peer_statesync_choose(b, 2, sus);
    assert_int_equal(sus[1], 1);
}

/* Honest spreads: replicas that stepped at different rates, one that
 * restarted from fresh weights, and one still at version 0. */
static void test_honest_not_suspect(void **state)
{
    (void)state;
    uint8_t sus[4];
    uint64_t spread[3] = {300, 2900, 410}; /* one replica 7x faster */
    peer_statesync_choose(spread, 3, sus);
    assert_true(!sus[0] && !sus[1] && !sus[2]);
    /* A lagging holder (restarted fresh) beside two advanced ones. */
    uint64_t lag[3] = {5000, 4900, 50};
    uint64_t max = peer_statesync_choose(lag, 3, sus);
    assert_true(!sus[0] && !sus[1] && !sus[2]);
    assert_int_equal(max, PEER_TRUST_VERSION_FACTOR * 5000 + PEER_TRUST_VERSION_SLACK);
    /* Version 0 claims are left out of the comparison. */
    uint64_t zero[3] = {0, 0, 412};
    peer_statesync_choose(zero, 3, sus);
    assert_true(!sus[0] && !sus[1] && !sus[2]);
    /* Small versions early in training: within the slack. */
    uint64_t early[2] = {1, 200};
    peer_statesync_choose(early, 2, sus);
    assert_true(!sus[0] && !sus[1]);
}

/* Trust on first use, and the Sybil limit. */
static void test_limits(void **state)
{
    (void)state;
    uint8_t sus[4];
    uint64_t one[1] = {1000000000};
    uint64_t max = peer_statesync_choose(one, 1, sus);
    assert_int_equal(sus[0], 0);
    /* Even alone, a donor cannot serve a state far newer than it claims. */
    assert_true(max == PEER_TRUST_VERSION_FACTOR * 1000000000ULL + PEER_TRUST_VERSION_SLACK);
    /* Two liars against one honest holder: the liars are the majority. */
    uint64_t maj[3] = {1000000000, 412, 1000000000};
    peer_statesync_choose(maj, 3, sus);
    assert_true(!sus[0] && !sus[2]);
    /* Two against two: the honest median holds (the upper median of the
     * three others of a liar is an honest claim). */
    uint64_t tie[4] = {1000000000, 412, 1000000000, 410};
    peer_statesync_choose(tie, 4, sus);
    assert_true(sus[0] && sus[2] && !sus[1] && !sus[3]);
    /* No claims at all, or only version-0 claims (a young swarm whose
     * announcements lag its holders' first steps): nothing bounds the
     * download. */
    assert_true(peer_statesync_choose(NULL, 0, NULL) == UINT64_MAX);
    uint64_t zeros[3] = {0, 0, 0};
    assert_true(peer_statesync_choose(zeros, 3, sus) == UINT64_MAX);
    assert_true(!sus[0] && !sus[1] && !sus[2]);
    /* The bound never wraps. */
    uint64_t huge[1] = {UINT64_MAX - 1};
    assert_true(peer_statesync_choose(huge, 1, NULL) == UINT64_MAX);
}

static void test_throughput(void **state)
{
    (void)state;
    double t[4] = {9000, 1e9, 7000, 8000};
    assert_int_equal(peer_trust_tput_suspect(t, 4, 1), 1);
    assert_int_equal(peer_trust_tput_suspect(t, 4, 0), 0);
    assert_int_equal(peer_trust_tput_suspect(t, 4, 2), 0);
    /* A replica on a much faster machine: up to 10x is fine. */
    double fast[2] = {5000, 45000};
    assert_int_equal(peer_trust_tput_suspect(fast, 2, 1), 0);
    fast[1] = 55000;
    assert_int_equal(peer_trust_tput_suspect(fast, 2, 1), 1);
    /* Alone, or against holders with no measurement yet: nothing to say. */
    double alone[2] = {1e9, 0};
    assert_int_equal(peer_trust_tput_suspect(alone, 2, 0), 0);
    assert_int_equal(peer_trust_tput_suspect(alone, 1, 0), 0);
    assert_int_equal(peer_trust_tput_suspect(NULL, 1, 0), 0);
    assert_int_equal(peer_trust_tput_suspect(t, 4, 4), 0);
}

/* The version check: the same rule as the newcomer's choice. */
static void test_version_suspect(void **state)
{
    (void)state;
    uint64_t v[3] = {12, 1000000000, 12};
    assert_int_equal(peer_trust_version_suspect(v, 3, 1), 1);
    assert_int_equal(peer_trust_version_suspect(v, 3, 0), 0);
    assert_int_equal(peer_trust_version_suspect(v, 3, -1), 0);
    assert_int_equal(peer_trust_version_suspect(v, 3, 3), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_median),
        cmocka_unit_test(test_lone_outlier),
        cmocka_unit_test(test_honest_not_suspect),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_throughput),
        cmocka_unit_test(test_version_suspect),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
