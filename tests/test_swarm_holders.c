/* The holders of a stage in a lookup's entries (swarm/holders.h): which
 * entries are holders, which holders are usable, and that garbage at the
 * key is neither. */
#include <string.h>

#include "swarm/holders.h"
#include "swarm/rng.h"
#include "test_util.h"

#define HASH 0x1234abcdULL

typedef struct {
    uint8_t id[DHT_ID_LEN];
    uint8_t val[PEER_ANNOUNCE_MAX_BYTES];
} slot;

/* Entry i of e: a signed announcement by node i of block, state, hash. */
static void put(dht_entry *e, slot *s, int i, const char *block, peer_state state, uint64_t hash)
{
    memset(s, 0, sizeof *s);
    memset(s->id, i + 1, DHT_ID_LEN);
    peer_announce a = {0};
    snprintf(a.block, sizeof a.block, "%s", block);
    snprintf(a.addr, sizeof a.addr, "127.0.0.1:%d", 4000 + i);
    a.state = state;
    a.stage_hash = hash;
    a.weight_version = (uint64_t)(10 + i);
    a.throughput = 1.0;
    a.time_ms = 1000;
    long len = peer_announce_encode(&a, s->val, sizeof s->val);
    assert_true(len > 0);
    memset(e, 0, sizeof *e);
    e->subkey = s->id;
    e->subkey_len = DHT_ID_LEN;
    e->value = s->val;
    e->value_len = (size_t)len;
    e->expires = 5000 + (uint64_t)i;
    e->is_signed = 1;
}

static void test_read(void **state)
{
    (void)state;
    dht_entry e;
    slot s;
    swarm_holder h;
    put(&e, &s, 0, "m.1", PEER_STATE_ONLINE, HASH);
    assert_int_equal(swarm_holder_read(&h, &e, "m.1", HASH), 1);
    assert_true(h.usable && h.same_hash);
    assert_memory_equal(h.id, s.id, DHT_ID_LEN);
    assert_int_equal(h.expires_ms, 5000);
    assert_int_equal(h.ann.weight_version, 10);
    assert_string_equal(h.ann.addr, "127.0.0.1:4000");
    /* Another model version: a holder, not usable. */
    assert_int_equal(swarm_holder_read(&h, &e, "m.1", HASH + 1), 1);
    assert_false(h.same_hash || h.usable);
    /* Another stage: not a holder of this one, but one of "any". */
    assert_int_equal(swarm_holder_read(&h, &e, "m.2", HASH), 0);
    assert_int_equal(swarm_holder_read(&h, &e, NULL, HASH), 1);
    /* Joining or offline: a holder, not usable. */
    put(&e, &s, 0, "m.1", PEER_STATE_OFFLINE, HASH);
    assert_int_equal(swarm_holder_read(&h, &e, "m.1", HASH), 1);
    assert_true(h.same_hash && !h.usable);
    put(&e, &s, 0, "m.1", PEER_STATE_JOINING, HASH);
    assert_int_equal(swarm_holder_read(&h, &e, "m.1", HASH), 1);
    assert_false(h.usable);
    /* Unsigned, or not under a node ID: nobody's announcement. */
    put(&e, &s, 0, "m.1", PEER_STATE_ONLINE, HASH);
    e.is_signed = 0;
    assert_int_equal(swarm_holder_read(&h, &e, "m.1", HASH), 0);
    e.is_signed = 1;
    e.subkey_len = DHT_ID_LEN - 1;
    assert_int_equal(swarm_holder_read(&h, &e, "m.1", HASH), 0);
}

/* Garbage values at the key: every truncation and random bytes. */
static void test_garbage(void **state)
{
    (void)state;
    dht_entry e;
    slot s;
    swarm_holder h;
    put(&e, &s, 0, "m.1", PEER_STATE_ONLINE, HASH);
    size_t full = e.value_len;
    for (size_t len = 0; len < full; len++) {
        e.value_len = len;
        assert_int_equal(swarm_holder_read(&h, &e, NULL, HASH), 0);
    }
    uint64_t rng = 7;
    int holders = 0;
    for (int round = 0; round < 2000; round++) {
        e.value_len = 1 + (size_t)(route_rand01(&rng) * (sizeof s.val - 1));
        for (size_t i = 0; i < e.value_len; i++)
            s.val[i] = (uint8_t)(route_rand01(&rng) * 256);
        holders += swarm_holder_read(&h, &e, "m.1", HASH);
    }
    assert_int_equal(holders, 0);
}

static void test_usable(void **state)
{
    (void)state;
    dht_entry e[6];
    slot s[6];
    put(&e[0], &s[0], 0, "m.1", PEER_STATE_ONLINE, HASH);
    put(&e[1], &s[1], 1, "m.1", PEER_STATE_OFFLINE, HASH);
    put(&e[2], &s[2], 2, "m.1", PEER_STATE_ONLINE, HASH + 1);
    put(&e[3], &s[3], 3, "m.2", PEER_STATE_ONLINE, HASH);
    put(&e[4], &s[4], 4, "m.1", PEER_STATE_ONLINE, HASH);
    put(&e[5], &s[5], 5, "m.1", PEER_STATE_ONLINE, HASH);
    e[5].value_len = 3; /* garbage */
    swarm_holder h[6];
    assert_int_equal(swarm_holders_usable(h, 6, e, 6, "m.1", HASH, NULL), 2);
    assert_memory_equal(h[0].id, s[0].id, DHT_ID_LEN);
    assert_memory_equal(h[1].id, s[4].id, DHT_ID_LEN);
    /* Ourselves excluded. */
    assert_int_equal(swarm_holders_usable(h, 6, e, 6, "m.1", HASH, s[0].id), 1);
    assert_memory_equal(h[0].id, s[4].id, DHT_ID_LEN);
    /* At most max, in the lookup's order. */
    assert_int_equal(swarm_holders_usable(h, 1, e, 6, "m.1", HASH, NULL), 1);
    assert_memory_equal(h[0].id, s[0].id, DHT_ID_LEN);
    assert_int_equal(swarm_holders_usable(h, 6, e, 0, "m.1", HASH, NULL), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_read),
        cmocka_unit_test(test_garbage),
        cmocka_unit_test(test_usable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
