/* peer/catchup.h, the choice of a joining block's source (pure): which
 * announcements and cold-copy records count, this node's own entry from
 * before a restart, suspect claims left out, the holder picked among the
 * newest, the copies tried newest first. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "peer/catchup.h"

#define BLOCK "fmnist-mlp.1"
#define HASH 0x1234abcdULL

static uint8_t ids[8][DHT_ID_LEN];
static uint8_t vals[8][PEER_ANNOUNCE_MAX_BYTES];

static void make_ids(void)
{
    for (int i = 0; i < 8; i++) {
        memset(ids[i], 0, DHT_ID_LEN);
        ids[i][0] = (uint8_t)(i + 1);
    }
}

/* Entry j: an announcement by node j of BLOCK (state, version). */
static dht_entry holder(int j, peer_state state, uint64_t version)
{
    peer_announce a;
    memset(&a, 0, sizeof a);
    snprintf(a.block, sizeof a.block, "%s", BLOCK);
    snprintf(a.addr, sizeof a.addr, "127.0.0.1:%d", 7000 + j);
    a.state = state;
    a.stage_hash = HASH;
    a.weight_version = version;
    snprintf(a.device, sizeof a.device, "cpu");
    long n = peer_announce_encode(&a, vals[j], sizeof vals[j]);
    assert_true(n > 0);
    dht_entry e = {.subkey = ids[j], .subkey_len = DHT_ID_LEN, .value = vals[j], .value_len = (size_t)n,
                   .is_signed = 1};
    return e;
}

/* Entry j: a cold copy kept by node j at version. */
static dht_entry copy(int j, uint64_t version)
{
    peer_keep_record r;
    memset(&r, 0, sizeof r);
    snprintf(r.addr, sizeof r.addr, "127.0.0.1:%d", 7000 + j);
    r.weight_version = version;
    r.time_ms = 1;
    long n = peer_keep_record_encode(&r, vals[j], sizeof vals[j]);
    assert_true(n > 0);
    dht_entry e = {.subkey = ids[j], .subkey_len = DHT_ID_LEN, .value = vals[j], .value_len = (size_t)n,
                   .is_signed = 1};
    return e;
}

/* Online holders count; joining and offline ones, unsigned entries and
 * other stages do not; our own entry gives the version we had. */
static void test_holders(void **state)
{
    (void)state;
    make_ids();
    dht_entry e[6];
    e[0] = holder(0, PEER_STATE_ONLINE, 40);   /* self: from before a restart */
    e[1] = holder(1, PEER_STATE_ONLINE, 30);
    e[2] = holder(2, PEER_STATE_JOINING, 99);
    e[3] = holder(3, PEER_STATE_ONLINE, 31);
    e[4] = holder(4, PEER_STATE_ONLINE, 500);
    e[4].is_signed = 0;
    e[5] = holder(5, PEER_STATE_OFFLINE, 77);
    peer_catchup_view v;
    peer_catchup_read_holders(&v, e, 6, ids[0], BLOCK, HASH);
    assert_int_equal(v.prev, 40);
    assert_int_equal(v.found, 1);
    assert_int_equal(v.nc, 2);
    assert_int_equal(v.best, 31);
    assert_memory_equal(v.ids[0], ids[1], DHT_ID_LEN);
    assert_memory_equal(v.ids[1], ids[3], DHT_ID_LEN);
    /* Another stage hash: nobody. */
    peer_catchup_read_holders(&v, e, 6, ids[0], BLOCK, HASH + 1);
    assert_int_equal(v.found, 0);
    assert_int_equal(v.prev, 0);
    /* Our own joining entry says nothing about what we had. */
    e[0] = holder(0, PEER_STATE_JOINING, 40);
    peer_catchup_read_holders(&v, e, 1, ids[0], BLOCK, HASH);
    assert_int_equal(v.prev, 0);
}

/* A holder claiming far above the others is never picked; the pick is
 * among the trusted holders at most one version behind the newest, and
 * each of them is picked sometimes. */
static void test_pick_holder(void **state)
{
    (void)state;
    make_ids();
    dht_entry e[4];
    e[0] = holder(1, PEER_STATE_ONLINE, 412);
    e[1] = holder(2, PEER_STATE_ONLINE, 1000000000);
    e[2] = holder(3, PEER_STATE_ONLINE, 411);
    e[3] = holder(4, PEER_STATE_ONLINE, 300);
    peer_catchup_view v;
    peer_catchup_read_holders(&v, e, 4, ids[0], BLOCK, HASH);
    assert_int_equal(v.nc, 4);
    assert_int_equal(v.suspect[1], 1);
    assert_int_equal(v.best, 412);
    assert_true(v.hold_max >= 412 && v.hold_max < 1000000000);
    int picked[4] = {0};
    uint64_t rng = 7;
    for (int t = 0; t < 200; t++) {
        int p = peer_catchup_pick_holder(&v, &rng);
        assert_true(p == 0 || p == 2);
        picked[p]++;
    }
    assert_true(picked[0] > 0 && picked[2] > 0);
    /* Nobody online: no pick. */
    peer_catchup_read_holders(&v, NULL, 0, ids[0], BLOCK, HASH);
    assert_int_equal(peer_catchup_pick_holder(&v, &rng), -1);
}

/* Copies are tried newest first, only when newer than ours, never a
 * suspect one; with no holder online the newest trusted copy is known to
 * have existed. */
static void test_copies(void **state)
{
    (void)state;
    make_ids();
    peer_catchup_view v;
    dht_entry own = holder(0, PEER_STATE_ONLINE, 20);
    peer_catchup_read_holders(&v, &own, 1, ids[0], BLOCK, HASH);
    assert_int_equal(v.found, 0);
    dht_entry e[6];
    e[0] = copy(1, 50);
    e[1] = copy(2, 900000000);  /* far above the others */
    e[2] = copy(3, 60);
    e[3] = copy(4, 0);          /* withdrawn */
    e[4] = copy(0, 70);         /* our own: not a source */
    e[5] = copy(5, 10);
    peer_catchup_read_keepers(&v, e, 6, ids[0]);
    assert_int_equal(v.nk, 4);
    assert_int_equal(v.keep[0].weight_version, 900000000);
    assert_int_equal(v.keep_suspect[0], 1);
    assert_int_equal(v.known, 60);
    /* Ours is at version 15: 60, then 50; 10 is older. */
    int k = peer_catchup_next_copy(&v, 15);
    assert_int_equal(k, 1);
    assert_memory_equal(v.kid[k], ids[3], DHT_ID_LEN);
    k = peer_catchup_next_copy(&v, 15);
    assert_int_equal(k, 2);
    assert_memory_equal(v.kid[k], ids[1], DHT_ID_LEN);
    assert_int_equal(peer_catchup_next_copy(&v, 15), -1);
    /* A holder online supersedes the copies: only our own version is
     * known to have existed. */
    dht_entry h[2] = {holder(0, PEER_STATE_ONLINE, 20), holder(6, PEER_STATE_ONLINE, 25)};
    peer_catchup_read_holders(&v, h, 2, ids[0], BLOCK, HASH);
    e[0] = copy(1, 50);
    e[1] = copy(3, 60);
    peer_catchup_read_keepers(&v, e, 2, ids[0]);
    assert_int_equal(v.known, 20);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_holders),
        cmocka_unit_test(test_pick_holder),
        cmocka_unit_test(test_copies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
