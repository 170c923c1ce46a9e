/* peer/averaging.h: the group a member forms from the matchmaking entries
 * it read. Every member must form the same group from the same entries, in
 * whatever order they came back; groups over the size limit split alike
 * everywhere; a different view gives a different digest (which is how the
 * members notice that they must look again). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "peer/averaging.h"

static void cand_of(peer_avg_candidate *c, int k, int optim)
{
    memset(c, 0, sizeof *c);
    for (int i = 0; i < DHT_ID_LEN; i++)
        c->m.id[i] = (uint8_t)(k * 37 + i * 11 + 5);
    snprintf(c->m.addr, sizeof c->m.addr, "127.0.0.1:%d", 4000 + k);
    c->optim = (uint8_t)optim;
}

static void test_same_group_any_order(void **state)
{
    (void)state;
    peer_avg_candidate a[3], b[3];
    for (int k = 0; k < 3; k++)
        cand_of(&a[k], k, 1);
    b[0] = a[2];
    b[1] = a[0];
    b[2] = a[1];
    peer_avg_group ga, gb;
    assert_int_equal(peer_avg_choose_group(a, 3, a[0].m.id, 1000, &ga), 0);
    assert_int_equal(peer_avg_choose_group(b, 3, a[2].m.id, 1000, &gb), 0);
    assert_int_equal(ga.n, 3);
    assert_memory_equal(ga.digest, gb.digest, PEER_AVG_DIGEST_LEN);
    assert_memory_equal(ga.members, gb.members, sizeof ga.members);
    assert_true(ga.with_optim);
    /* Sorted by node ID; `me` points at self. */
    for (int i = 1; i < ga.n; i++)
        assert_true(memcmp(ga.members[i - 1].id, ga.members[i].id, DHT_ID_LEN) < 0);
    assert_memory_equal(ga.members[ga.me].id, a[0].m.id, DHT_ID_LEN);
    assert_memory_equal(gb.members[gb.me].id, a[2].m.id, DHT_ID_LEN);
    /* Another round or another view: another digest. */
    peer_avg_group g2;
    assert_int_equal(peer_avg_choose_group(a, 3, a[0].m.id, 2000, &g2), 0);
    assert_memory_not_equal(g2.digest, ga.digest, PEER_AVG_DIGEST_LEN);
    assert_int_equal(peer_avg_choose_group(a, 2, a[0].m.id, 1000, &g2), 0);
    assert_int_equal(g2.n, 2);
    assert_memory_not_equal(g2.digest, ga.digest, PEER_AVG_DIGEST_LEN);
    /* Optimizer kinds differ: parameters only. */
    a[1].optim = 2;
    assert_int_equal(peer_avg_choose_group(a, 3, a[0].m.id, 1000, &g2), 0);
    assert_false(g2.with_optim);
    assert_memory_not_equal(g2.digest, ga.digest, PEER_AVG_DIGEST_LEN);
}

static void test_alone_or_absent(void **state)
{
    (void)state;
    peer_avg_candidate a[2];
    cand_of(&a[0], 0, 1);
    cand_of(&a[1], 1, 1);
    peer_avg_group g;
    assert_int_equal(peer_avg_choose_group(a, 1, a[0].m.id, 1000, &g), -ENOENT);
    assert_int_equal(peer_avg_choose_group(a + 1, 1, a[0].m.id, 1000, &g), -ENOENT);
    assert_int_equal(peer_avg_choose_group(NULL, 1, a[0].m.id, 1000, &g), -EINVAL);
    assert_int_equal(peer_avg_choose_group(a, -1, a[0].m.id, 1000, &g), -EINVAL);
    assert_int_equal(peer_avg_choose_group(a, 100000, a[0].m.id, 1000, &g), -EINVAL);
}

/* 40 candidates: three groups of 13-14, each member in exactly one, every
 * member of a group computing that same group. */
static void test_large_swarm_splits_alike(void **state)
{
    (void)state;
    enum { NC = 40 };
    static peer_avg_candidate c[NC], rev[NC];
    for (int k = 0; k < NC; k++)
        cand_of(&c[k], k, 1);
    for (int k = 0; k < NC; k++)
        rev[k] = c[NC - 1 - k];
    int seen[NC] = {0};
    for (int k = 0; k < NC; k++) {
        peer_avg_group g, h;
        assert_int_equal(peer_avg_choose_group(c, NC, c[k].m.id, 7000, &g), 0);
        assert_true(g.n >= 13 && g.n <= 14);
        assert_int_equal(peer_avg_choose_group(rev, NC, c[k].m.id, 7000, &h), 0);
        assert_memory_equal(g.digest, h.digest, PEER_AVG_DIGEST_LEN);
        for (int i = 0; i < g.n; i++) {
            peer_avg_group o;
            assert_int_equal(peer_avg_choose_group(c, NC, g.members[i].id, 7000, &o), 0);
            assert_memory_equal(o.digest, g.digest, PEER_AVG_DIGEST_LEN);
        }
        seen[k]++;
    }
    for (int k = 0; k < NC; k++)
        assert_int_equal(seen[k], 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_group_any_order),
        cmocka_unit_test(test_alone_or_absent),
        cmocka_unit_test(test_large_swarm_splits_alike),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
