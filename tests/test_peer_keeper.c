/* peer/keeper.h: who keeps cold copies of which stage. Every peer must
 * reach the same choice from the same view; holders never keep their own
 * stage; each stage gets exactly `replicas` keepers among its non-holders
 * (all of them when there are fewer); and a peer leaving moves only the
 * copies it kept. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "peer/keeper.h"

enum { NP = 7, NS = 6 };
static uint8_t ids[NP][DHT_ID_LEN];
static const char *names[NS] = {"m.0", "m.1", "m.2", "m.3", "m.4", "m.5"};
static uint8_t holds[NS * NP];

static void setup_view(void)
{
    for (int j = 0; j < NP; j++)
        for (int i = 0; i < DHT_ID_LEN; i++)
            ids[j][i] = (uint8_t)(j * 53 + i * 7 + 1);
    memset(holds, 0, sizeof holds);
    /* Peer j holds stages 2j and 2j+1 for j < 3; peers 3..6 hold nothing. */
    for (int j = 0; j < 3; j++) {
        holds[(2 * j) * NP + j] = 1;
        holds[(2 * j + 1) * NP + j] = 1;
    }
}

static void keepers_of(int n, int replicas, uint8_t keep[NP][NS])
{
    for (int j = 0; j < n; j++) {
        /* The same view in another order: only the holds matrix follows it. */
        assert_int_equal(peer_keeper_choose((const uint8_t(*)[DHT_ID_LEN])ids, n, ids[j], names, NS, holds,
                                            replicas, keep[j]),
                         0);
    }
}

static void test_choice(void **state)
{
    (void)state;
    setup_view();
    uint8_t keep[NP][NS];
    keepers_of(NP, 2, keep);
    for (int s = 0; s < NS; s++) {
        int n = 0;
        for (int j = 0; j < NP; j++) {
            if (holds[s * NP + j])
                assert_int_equal(keep[j][s], 0);
            n += keep[j][s];
        }
        assert_int_equal(n, 2);
    }
    /* With 3 replicas wanted but only two non-holders (view of 3 peers),
     * both keep. */
    uint8_t k3[NP][NS];
    uint8_t h3[NS * 3];
    for (int s = 0; s < NS; s++)
        for (int j = 0; j < 3; j++)
            h3[s * 3 + j] = holds[s * NP + j];
    for (int j = 0; j < 3; j++)
        assert_int_equal(peer_keeper_choose((const uint8_t(*)[DHT_ID_LEN])ids, 3, ids[j], names, NS, h3, 3, k3[j]),
                         0);
    for (int s = 0; s < NS; s++) {
        int n = 0;
        for (int j = 0; j < 3; j++)
            n += k3[j][s];
        assert_int_equal(n, 2);
    }
}

/* A keeper leaving the view hands its stages to one other peer each; no
 * other copy moves. */
static void test_leaving_moves_little(void **state)
{
    (void)state;
    setup_view();
    uint8_t before[NP][NS], after[NP][NS];
    keepers_of(NP, 1, before);
    /* Peer 6 leaves: the view has peers 0..5 (the holds rows are laid out
     * per NP, so rebuild them for 6). */
    uint8_t h6[NS * 6];
    for (int s = 0; s < NS; s++)
        for (int j = 0; j < 6; j++)
            h6[s * 6 + j] = holds[s * NP + j];
    for (int j = 0; j < 6; j++)
        assert_int_equal(
            peer_keeper_choose((const uint8_t(*)[DHT_ID_LEN])ids, 6, ids[j], names, NS, h6, 1, after[j]), 0);
    for (int s = 0; s < NS; s++)
        for (int j = 0; j < 6; j++)
            if (!before[6][s])
                assert_int_equal(after[j][s], before[j][s]);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    setup_view();
    uint8_t keep[NS], stranger[DHT_ID_LEN] = {0xee};
    const uint8_t(*idv)[DHT_ID_LEN] = (const uint8_t(*)[DHT_ID_LEN])ids;
    assert_int_equal(peer_keeper_choose(idv, NP, stranger, names, NS, holds, 1, keep), -EINVAL);
    assert_int_equal(peer_keeper_choose(NULL, NP, ids[0], names, NS, holds, 1, keep), -EINVAL);
    assert_int_equal(peer_keeper_choose(idv, 0, ids[0], names, NS, holds, 1, keep), -EINVAL);
    assert_int_equal(peer_keeper_choose(idv, NP, ids[0], names, NS, holds, 0, keep), -EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_choice),
        cmocka_unit_test(test_leaving_moves_little),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
