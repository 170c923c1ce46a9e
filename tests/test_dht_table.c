/* Routing table (dht/table.h): buckets, eviction rules, closest-k. */
#include <errno.h>

#include "dht/table.h"
#include "test_util.h"

static uint64_t rs = 7;
static void rid(uint8_t id[DHT_ID_LEN])
{
    for (int i = 0; i < DHT_ID_LEN; i++) {
        rs = rs * 6364136223846793005ull + 1442695040888963407ull;
        id[i] = (uint8_t)(rs >> 33);
    }
}

static void addr_of(dht_addr *a, uint32_t i)
{
    uint8_t ip[4] = {10, (uint8_t)(i >> 16), (uint8_t)(i >> 8), (uint8_t)i};
    dht_addr_v4(a, ip, 4000);
}

static void test_prefix_and_distance(void **state)
{
    (void)state;
    uint8_t a[20] = {0}, b[20] = {0}, t[20] = {0};
    assert_int_equal(dht_id_common_prefix(a, b), -1);
    b[0] = 0x80;
    assert_int_equal(dht_id_common_prefix(a, b), 0);
    b[0] = 0x01;
    assert_int_equal(dht_id_common_prefix(a, b), 7);
    b[0] = 0;
    b[19] = 1;
    assert_int_equal(dht_id_common_prefix(a, b), 159);
    a[0] = 0x10; /* distance 0x10.. */
    b[0] = 0x08; /* distance 0x08.. */
    assert_int_equal(dht_id_distance_cmp(t, b, a), -1);
    assert_int_equal(dht_id_distance_cmp(t, a, b), 1);
    assert_int_equal(dht_id_distance_cmp(t, a, a), 0);
}

/* IDs that land in bucket 0 of self = all-zero: first bit set. */
static void far_id(uint8_t id[20], uint32_t i)
{
    memset(id, 0, 20);
    id[0] = 0x80;
    id[16] = (uint8_t)(i >> 24);
    id[17] = (uint8_t)(i >> 16);
    id[18] = (uint8_t)(i >> 8);
    id[19] = (uint8_t)i;
}

static void test_full_bucket_keeps_live_nodes(void **state)
{
    (void)state;
    uint8_t self[20] = {0}, id[20];
    dht_addr a;
    dht_table_entry *ping;
    dht_table *t = dht_table_create(self, 4);
    assert_non_null(t);
    for (uint32_t i = 0; i < 4; i++) {
        far_id(id, i);
        addr_of(&a, i);
        assert_int_equal(dht_table_insert(t, id, &a, NULL, 100 + i, &ping), DHT_TABLE_ADDED);
    }
    assert_int_equal(dht_table_insert(t, self, &a, NULL, 1, NULL), -EINVAL);
    /* Known ID at another address: refused, entry kept. */
    far_id(id, 2);
    addr_of(&a, 99);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 200, NULL), -EEXIST);
    /* A fifth node: cached, and the least recently seen (node 0) is to be pinged. */
    far_id(id, 4);
    addr_of(&a, 4);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 300, &ping), DHT_TABLE_CACHED);
    assert_non_null(ping);
    uint8_t id0[20];
    far_id(id0, 0);
    assert_memory_equal(ping->id, id0, 20);
    assert_int_equal(dht_table_size(t), 4);
    assert_null(dht_table_find(t, id));
    /* A sixth while the ping is outstanding: no second ping. */
    far_id(id, 5);
    addr_of(&a, 5);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 301, &ping), DHT_TABLE_CACHED);
    assert_null(ping);
    /* One failure is not enough without force; a failed eviction ping is. */
    assert_int_equal(dht_table_failed(t, id0, 0), 0);
    assert_non_null(dht_table_find(t, id0));
    assert_int_equal(dht_table_failed(t, id0, 1), 1);
    assert_null(dht_table_find(t, id0));
    far_id(id, 5); /* newest replacement promoted */
    assert_non_null(dht_table_find(t, id));
    assert_int_equal(dht_table_size(t), 4);
    /* Two plain failures evict too; then node 4 (next replacement) comes in. */
    uint8_t id1[20];
    far_id(id1, 1);
    assert_int_equal(dht_table_failed(t, id1, 0), 0);
    assert_int_equal(dht_table_failed(t, id1, 0), 1);
    far_id(id, 4);
    assert_non_null(dht_table_find(t, id));
    dht_table_destroy(&t);
    assert_null(t);
    dht_table_destroy(&t); /* NULL is fine */
}

static void test_closest_matches_brute_force(void **state)
{
    (void)state;
    uint8_t self[20];
    enum { N = 3000 };
    static uint8_t ids[N][20];
    rid(self);
    dht_table *t = dht_table_create(self, 20);
    for (uint32_t i = 0; i < N; i++) {
        dht_addr a;
        rid(ids[i]);
        addr_of(&a, i);
        (void)dht_table_insert(t, ids[i], &a, NULL, i, NULL);
    }
    assert_true(dht_table_size(t) > 100);
    assert_true(dht_table_depth(t) > 5);
    for (int rep = 0; rep < 200; rep++) {
        uint8_t target[20];
        dht_table_entry got[20];
        rid(target);
        if (rep == 0)
            memcpy(target, self, 20);
        size_t n = dht_table_closest(t, target, 20, got);
        assert_int_equal(n, 20);
        /* Brute force over the table's own entries: the result must be
         * sorted and no table member outside it may be closer than the last. */
        for (size_t i = 1; i < n; i++)
            assert_true(dht_id_distance_cmp(target, got[i - 1].id, got[i].id) < 0);
        for (uint32_t i = 0; i < N; i++) {
            if (!dht_table_find(t, ids[i]))
                continue;
            int inside = 0;
            for (size_t j = 0; j < n; j++)
                inside |= memcmp(got[j].id, ids[i], 20) == 0;
            if (!inside)
                assert_true(dht_id_distance_cmp(target, got[n - 1].id, ids[i]) < 0);
        }
    }
    dht_table_destroy(&t);
}

/* An ID in bucket b of self = all-zero (b leading zero bits, then a 1),
 * distinct per i. */
static void id_in_bucket(uint8_t id[20], int b, uint32_t i)
{
    memset(id, 0, 20);
    id[b / 8] = (uint8_t)(0x80 >> (b % 8));
    id[16] = (uint8_t)(i >> 24);
    id[17] = (uint8_t)(i >> 16);
    id[18] = (uint8_t)(i >> 8);
    id[19] = (uint8_t)i;
}

static void v4(dht_addr *a, uint8_t b0, uint8_t b1, uint8_t b2, uint8_t b3, uint16_t port)
{
    uint8_t ip[4] = {b0, b1, b2, b3};
    dht_addr_v4(a, ip, port);
}

/* Issue 18: cheap identities from one network fill at most a few slots of
 * each bucket and of the table (go-libp2p-kad-dht's diversity filter,
 * S/Kademlia); loopback and private addresses are exempt by default. */
static void test_per_network_limits(void **state)
{
    (void)state;
    uint8_t self[20] = {0}, id[20];
    dht_addr a;
    dht_table_entry *ping;
    dht_table *t = dht_table_create(self, 20);
    /* One public /24, one bucket: DHT_TABLE_PER_BUCKET_NET, then refused
     * (not even as a replacement). */
    for (uint32_t i = 0; i < 10; i++) {
        id_in_bucket(id, 0, i);
        v4(&a, 198, 51, 100, (uint8_t)(1 + i), 4000);
        int rc = dht_table_insert(t, id, &a, NULL, 1, &ping);
        assert_int_equal(rc, i < DHT_TABLE_PER_BUCKET_NET ? DHT_TABLE_ADDED : -EDQUOT);
        assert_int_equal(dht_table_has_room(t, id, &a), 0);
    }
    /* Known entries are still refreshed. */
    id_in_bucket(id, 0, 0);
    v4(&a, 198, 51, 100, 1, 4000);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 2, NULL), DHT_TABLE_UPDATED);
    /* Across buckets: DHT_TABLE_PER_NET in the table. */
    size_t added = 0;
    for (int b = 1; b < 20; b++) {
        id_in_bucket(id, b, 0);
        v4(&a, 198, 51, 100, (uint8_t)(50 + b), 4000);
        added += dht_table_insert(t, id, &a, NULL, 1, NULL) == DHT_TABLE_ADDED;
    }
    assert_int_equal(added + DHT_TABLE_PER_BUCKET_NET, DHT_TABLE_PER_NET);
    /* One exact IP (many ports) gets DHT_TABLE_PER_IP. */
    added = 0;
    for (int b = 1; b < 20; b++) {
        id_in_bucket(id, b, 1);
        v4(&a, 192, 0, 2, 7, (uint16_t)(4000 + b));
        added += dht_table_insert(t, id, &a, NULL, 1, NULL) == DHT_TABLE_ADDED;
    }
    assert_int_equal(added, DHT_TABLE_PER_IP);
    /* IPv6: by /48. */
    added = 0;
    for (uint32_t i = 0; i < 10; i++) {
        id_in_bucket(id, 0, 100 + i);
        memset(&a, 0, sizeof a);
        a.family = 6;
        a.ip[0] = 0x20;
        a.ip[1] = 0x01;
        a.ip[2] = 0x0d;
        a.ip[3] = 0xb8;
        a.ip[7] = (uint8_t)i; /* another /64, same /48 */
        a.ip[15] = 1;
        a.port = 4000;
        added += dht_table_insert(t, id, &a, NULL, 1, NULL) == DHT_TABLE_ADDED;
    }
    assert_int_equal(added, DHT_TABLE_PER_BUCKET_NET);
    /* Other networks are unaffected. */
    id_in_bucket(id, 0, 200);
    v4(&a, 203, 0, 113, 1, 4000);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 1, NULL), DHT_TABLE_ADDED);
    /* Loopback and private: a local swarm (every process on 127.0.0.1)
     * fills a bucket... */
    for (uint32_t i = 0; i < 10; i++) {
        id_in_bucket(id, 1, 300 + i);
        v4(&a, 127, 0, 0, 1, (uint16_t)(5000 + i));
        assert_int_equal(dht_table_insert(t, id, &a, NULL, 1, NULL), DHT_TABLE_ADDED);
        v4(&a, 10, 0, 0, 1, (uint16_t)(5000 + i));
        id_in_bucket(id, 2, 300 + i);
        assert_int_equal(dht_table_insert(t, id, &a, NULL, 1, NULL), DHT_TABLE_ADDED);
    }
    /* ...unless the limits are asked for everywhere. */
    dht_table_set_diversity(t, DHT_DIVERSITY_ALL);
    id_in_bucket(id, 1, 400);
    v4(&a, 127, 0, 0, 2, 5000);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 1, NULL), -EDQUOT);
    dht_table_set_diversity(t, DHT_DIVERSITY_OFF);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 1, NULL), DHT_TABLE_ADDED);
    dht_table_destroy(&t);

    /* Replacements count against the limits, and a promoted one is still
     * within them. */
    t = dht_table_create(self, 2);
    id_in_bucket(id, 0, 1);
    v4(&a, 203, 0, 113, 1, 4000);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 1, NULL), DHT_TABLE_ADDED);
    id_in_bucket(id, 0, 2);
    v4(&a, 192, 0, 2, 1, 4000);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 1, NULL), DHT_TABLE_ADDED);
    id_in_bucket(id, 0, 3); /* same /24 as entry 1: cached (2 of its net) */
    v4(&a, 203, 0, 113, 2, 4000);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 1, NULL), DHT_TABLE_CACHED);
    id_in_bucket(id, 0, 4); /* a third of that /24: refused */
    v4(&a, 203, 0, 113, 3, 4000);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 1, NULL), -EDQUOT);
    id_in_bucket(id, 0, 5); /* another net, newest replacement */
    v4(&a, 198, 51, 100, 1, 4000);
    assert_int_equal(dht_table_insert(t, id, &a, NULL, 1, NULL), DHT_TABLE_CACHED);
    /* Entry 2 fails: the newest replacement (5) takes its place. */
    id_in_bucket(id, 0, 2);
    assert_int_equal(dht_table_failed(t, id, 1), 1);
    id_in_bucket(id, 0, 5);
    assert_non_null(dht_table_find(t, id));
    /* Entry 5 fails: replacement 3 (same /24 as entry 1) may come in, two of
     * its network in the bucket. */
    assert_int_equal(dht_table_failed(t, id, 1), 1);
    id_in_bucket(id, 0, 3);
    assert_non_null(dht_table_find(t, id));
    assert_int_equal(dht_table_size(t), 2);
    dht_table_destroy(&t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefix_and_distance),
        cmocka_unit_test(test_full_bucket_keeps_live_nodes),
        cmocka_unit_test(test_closest_matches_brute_force),
        cmocka_unit_test(test_per_network_limits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
