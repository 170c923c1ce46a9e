/* Record store (dht/store.h): signatures, forgery, expiry, limits, paging. */
#include <errno.h>

#include "dht/store.h"
#include "test_util.h"

#define NOW 1700000000000ull

static uint8_t key[20] = {1, 2, 3, 4};
static dht_identity alice, mallory;

static int setup(void **state)
{
    (void)state;
    uint8_t s1[32] = {1}, s2[32] = {2};
    assert_int_equal(dht_identity_from_seed(&alice, s1), 0);
    assert_int_equal(dht_identity_from_seed(&mallory, s2), 0);
    return 0;
}

static dht_entry signed_entry(const dht_identity *who, const char *val, uint64_t exp)
{
    dht_entry e;
    memset(&e, 0, sizeof e);
    e.subkey = who->id;
    e.subkey_len = 20;
    e.value = (const uint8_t *)val;
    e.value_len = strlen(val);
    e.expires = exp;
    assert_int_equal(dht_entry_sign(&e, key, who), 0);
    return e;
}

static void test_signed_entries_and_forgeries(void **state)
{
    (void)state;
    dht_store *s = dht_store_create(NULL);
    dht_entry got[4];
    dht_entry e = signed_entry(&alice, "v1", NOW + 60000);
    assert_int_equal(dht_store_put(s, key, &e, NOW), 1);

    /* Mallory re-signs Alice's subkey with her own key: subkey != ID(pk). */
    dht_entry f = signed_entry(&mallory, "evil", NOW + 70000);
    f.subkey = alice.id;
    assert_int_equal(dht_entry_check(&f, key, NOW), -EINVAL);
    assert_int_equal(dht_store_put(s, key, &f, NOW), -EINVAL);
    /* Mallory changes Alice's value or expiration: bad signature. */
    f = signed_entry(&alice, "v2", NOW + 80000);
    f.value = (const uint8_t *)"v3";
    assert_int_equal(dht_store_put(s, key, &f, NOW), -EPERM);
    f = signed_entry(&alice, "v2", NOW + 80000);
    f.expires++;
    assert_int_equal(dht_store_put(s, key, &f, NOW), -EPERM);
    /* A signature for another key does not transfer. */
    f = signed_entry(&alice, "v2", NOW + 80000);
    uint8_t other[20] = {9};
    assert_int_equal(dht_store_put(s, other, &f, NOW), -EPERM);
    /* Bit flip in the signature. */
    f.sig[5] ^= 1;
    assert_int_equal(dht_store_put(s, key, &f, NOW), -EPERM);
    /* An unsigned entry with Alice's subkey is a different entry. */
    dht_entry u;
    memset(&u, 0, sizeof u);
    u.subkey = alice.id;
    u.subkey_len = 20;
    u.value = (const uint8_t *)"unsigned";
    u.value_len = 8;
    u.expires = NOW + 90000;
    assert_int_equal(dht_store_put(s, key, &u, NOW), 1);
    size_t total = 0;
    size_t n = dht_store_get(s, key, NOW, 0, got, 4, &total);
    assert_int_equal(n, 2);
    assert_int_equal(total, 2);
    int seen_signed = 0;
    for (size_t i = 0; i < n; i++)
        if (got[i].is_signed) {
            seen_signed = 1;
            assert_memory_equal(got[i].value, "v1", 2);
            assert_int_equal(dht_entry_check(&got[i], key, NOW), 0);
        }
    assert_true(seen_signed);
    dht_store_destroy(&s);
    assert_null(s);
}

static void test_newest_expiration_wins_and_expiry(void **state)
{
    (void)state;
    dht_store *s = dht_store_create(NULL);
    dht_entry got[2];
    dht_entry e1 = signed_entry(&alice, "old", NOW + 10000);
    dht_entry e2 = signed_entry(&alice, "new", NOW + 20000);
    assert_int_equal(dht_store_put(s, key, &e2, NOW), 1);
    assert_int_equal(dht_store_put(s, key, &e1, NOW), 0); /* older: kept newer */
    assert_int_equal(dht_store_get(s, key, NOW, 0, got, 2, NULL), 1);
    assert_memory_equal(got[0].value, "new", 3);
    /* Expired on arrival, or too far ahead. */
    dht_entry ex = signed_entry(&alice, "x", NOW - 1);
    assert_int_equal(dht_store_put(s, key, &ex, NOW), -ESTALE);
    dht_entry far = signed_entry(&alice, "x", NOW + DHT_MAX_TTL_MS + 1);
    assert_int_equal(dht_store_put(s, key, &far, NOW), -ESTALE);
    /* Entries vanish at their expiration, from reads and from memory. */
    assert_int_equal(dht_store_get(s, key, NOW + 20000, 0, got, 2, NULL), 0);
    assert_int_equal(dht_store_count_entries(s), 1);
    assert_int_equal(dht_store_expire(s, NOW + 20000), 1);
    assert_int_equal(dht_store_count_entries(s), 0);
    assert_int_equal(dht_store_count_keys(s), 0);
    assert_int_equal(dht_store_bytes(s), 0);
    dht_store_destroy(&s);
}

static void test_limits_and_paging(void **state)
{
    (void)state;
    /* 160 bytes of bookkeeping are charged per entry: 40 entries fill it.
     * (The unsigned entries used here get the whole store: their own
     * quotas are tested in test_unsigned_quotas.) */
    dht_store_limits lim = {.max_keys = 3, .max_subkeys = 40, .max_bytes = 40 * (200 + 160),
                            .max_unsigned = 1000, .max_unsigned_key_bytes = 1 << 20,
                            .max_unsigned_bytes = 1 << 20};
    dht_store *s = dht_store_create(&lim);
    dht_entry e, got[64];
    uint8_t sub[4], val[200] = {0};
    memset(&e, 0, sizeof e);
    e.subkey = sub;
    e.subkey_len = 4;
    e.value = val;
    e.value_len = sizeof val;
    e.expires = NOW + 1000;
    for (uint32_t i = 0; i < 40; i++) {
        memcpy(sub, &i, 4);
        assert_int_equal(dht_store_put(s, key, &e, NOW), 1);
    }
    uint32_t i = 40;
    memcpy(sub, &i, 4);
    assert_int_equal(dht_store_put(s, key, &e, NOW), -ENOSPC); /* subkeys per key */
    /* Paging walks every entry exactly once in a stable order. */
    size_t total, seen = 0;
    uint8_t firsts[40][4];
    for (size_t off = 0; off < 40; off += 7) {
        size_t n = dht_store_get(s, key, NOW, off, got, 7, &total);
        assert_int_equal(total, 40);
        for (size_t j = 0; j < n; j++)
            memcpy(firsts[seen++], got[j].subkey, 4);
    }
    assert_int_equal(seen, 40);
    for (size_t a = 0; a < 40; a++)
        for (size_t b = a + 1; b < 40; b++)
            assert_memory_not_equal(firsts[a], firsts[b], 4);
    /* Total bytes. */
    uint8_t k2[20] = {7};
    i = 0;
    memcpy(sub, &i, 4);
    assert_int_equal(dht_store_put(s, k2, &e, NOW), -ENOSPC);
    /* Keys. */
    dht_store_destroy(&s);
    lim.max_bytes = 1 << 20;
    s = dht_store_create(&lim);
    for (int k = 0; k < 3; k++) {
        k2[0] = (uint8_t)k;
        assert_int_equal(dht_store_put(s, k2, &e, NOW), 1);
    }
    k2[0] = 3;
    assert_int_equal(dht_store_put(s, k2, &e, NOW), -ENOSPC);
    /* Oversized values and subkeys. */
    e.value_len = DHT_MAX_VALUE + 1;
    assert_int_equal(dht_store_put(s, key, &e, NOW), -EINVAL);
    e.value_len = 1;
    e.subkey_len = DHT_MAX_SUBKEY + 1;
    assert_int_equal(dht_store_put(s, key, &e, NOW), -EINVAL);
    /* Key iteration covers each key once. */
    uint8_t keys[2][20];
    size_t cursor = 0, count = 0;
    do
        count += dht_store_keys(s, &cursor, keys, 2);
    while (cursor);
    assert_int_equal(count, 3);
    dht_store_destroy(&s);
}

static dht_entry unsigned_entry(uint8_t *sub, uint32_t i, const uint8_t *val, size_t len,
                                uint64_t exp)
{
    dht_entry e;
    memcpy(sub, &i, 4);
    memset(&e, 0, sizeof e);
    e.subkey = sub;
    e.subkey_len = 4;
    e.value = val;
    e.value_len = len;
    e.expires = exp;
    return e;
}

static void src4(dht_addr *a, uint8_t b0, uint8_t b1, uint8_t b2, uint8_t b3)
{
    uint8_t ip[4] = {b0, b1, b2, b3};
    dht_addr_v4(a, ip, 4000);
}

/* Issue 18: unsigned entries (anyone with a token writes them) cannot hide
 * or crowd out signed ones. */
static void test_unsigned_quotas(void **state)
{
    (void)state;
    dht_store *s = dht_store_create(NULL);
    uint8_t sub[4], val[700] = {0};
    dht_entry got[8], e;
    dht_addr a;
    size_t ok = 0, total;
    /* 256 unsigned 700-byte entries from many networks: the key's unsigned
     * share (count and bytes) stops them. */
    for (uint32_t i = 0; i < 256; i++) {
        e = unsigned_entry(sub, i, val, sizeof val, NOW + 60000);
        src4(&a, 198, 18, (uint8_t)(i / 8), (uint8_t)(1 + i % 8));
        int rc = dht_store_put_from(s, key, &e, NOW, &a);
        assert_true(rc == 1 || rc == -ENOSPC);
        ok += rc == 1;
    }
    assert_int_equal(ok, DHT_STORE_MAX_UNSIGNED_KEY_BYTES / (700 + 160));
    /* Signed entries still go in, and sort first. */
    dht_entry se = signed_entry(&alice, "alice", NOW + 60000);
    assert_int_equal(dht_store_put_from(s, key, &se, NOW, &a), 1);
    assert_int_equal(dht_store_get(s, key, NOW, 0, got, 1, &total), 1);
    assert_true(got[0].is_signed);
    assert_int_equal(total, ok + 1);
    dht_store_destroy(&s);

    /* Per source network: 8 per key from one public /24 (any of its IPs),
     * from one exact IP when it is private; IPv6 by /48. */
    s = dht_store_create(NULL);
    ok = 0;
    for (uint32_t i = 0; i < 20; i++) {
        e = unsigned_entry(sub, i, val, 10, NOW + 60000);
        src4(&a, 203, 0, 113, (uint8_t)(1 + i));
        ok += dht_store_put_from(s, key, &e, NOW, &a) == 1;
    }
    assert_int_equal(ok, DHT_STORE_MAX_UNSIGNED_PER_SOURCE);
    src4(&a, 203, 0, 114, 1); /* the next /24 is another source */
    e = unsigned_entry(sub, 100, val, 10, NOW + 60000);
    assert_int_equal(dht_store_put_from(s, key, &e, NOW, &a), 1);
    /* Our own entries (no source) are not charged to anyone. */
    e = unsigned_entry(sub, 101, val, 10, NOW + 60000);
    assert_int_equal(dht_store_put(s, key, &e, NOW), 1);
    ok = 0;
    for (uint32_t i = 0; i < 20; i++) {
        e = unsigned_entry(sub, 200 + i, val, 10, NOW + 60000);
        src4(&a, 10, 0, 0, (uint8_t)(1 + i % 2)); /* two private IPs */
        ok += dht_store_put_from(s, key, &e, NOW, &a) == 1;
    }
    assert_int_equal(ok, 2 * DHT_STORE_MAX_UNSIGNED_PER_SOURCE);
    ok = 0;
    for (uint32_t i = 0; i < 20; i++) {
        e = unsigned_entry(sub, 300 + i, val, 10, NOW + 60000);
        memset(&a, 0, sizeof a);
        a.family = 6;
        a.ip[0] = 0x20;
        a.ip[1] = 0x01;
        a.ip[2] = 0x0d;
        a.ip[3] = 0xb8;
        a.ip[6] = (uint8_t)i; /* another /64 of the same /48 */
        a.port = 4000;
        ok += dht_store_put_from(s, key, &e, NOW, &a) == 1;
    }
    assert_int_equal(ok, DHT_STORE_MAX_UNSIGNED_PER_SOURCE);
    /* Replacing one's own entry is not a new one. */
    src4(&a, 203, 0, 113, 50);
    e = unsigned_entry(sub, 0, val, 20, NOW + 70000);
    assert_int_equal(dht_store_put_from(s, key, &e, NOW, &a), 1);
    dht_store_destroy(&s);

    /* A key full of unsigned entries takes a signed one: the unsigned
     * entry that expires first makes room. */
    dht_store_limits lim = {.max_subkeys = 16, .max_unsigned = 16};
    s = dht_store_create(&lim);
    for (uint32_t i = 0; i < 16; i++) {
        e = unsigned_entry(sub, i, val, 10, NOW + 60000 + (i == 5 ? 0 : 1000));
        assert_int_equal(dht_store_put(s, key, &e, NOW), 1);
    }
    e = unsigned_entry(sub, 16, val, 10, NOW + 60000);
    assert_int_equal(dht_store_put(s, key, &e, NOW), -ENOSPC);
    se = signed_entry(&alice, "alice", NOW + 60000);
    assert_int_equal(dht_store_put(s, key, &se, NOW), 1);
    assert_int_equal(dht_store_count_entries(s), 16);
    size_t n = dht_store_get(s, key, NOW, 0, got, 8, &total);
    assert_int_equal(n, 8);
    assert_int_equal(total, 16);
    assert_true(got[0].is_signed);
    for (size_t off = 0; off < total; off += n) {
        n = dht_store_get(s, key, NOW, off, got, 8, NULL);
        for (size_t j = 0; j < n; j++) {
            uint32_t idx;
            memcpy(&idx, got[j].subkey, 4);
            assert_true(got[j].is_signed || idx != 5); /* the first to expire went */
        }
    }
    dht_store_destroy(&s);

    /* A store whose keys or bytes are taken by unsigned entries takes a
     * signed one: a key holding only unsigned entries, or unsigned entries
     * of other keys, make room. */
    uint8_t k1[20] = {0x11}, k2[20] = {0x22}, k3[20] = {0x33};
    dht_entry s3;
    memset(&s3, 0, sizeof s3);
    s3.subkey = alice.id;
    s3.subkey_len = 20;
    s3.value = val;
    s3.value_len = sizeof val;
    s3.expires = NOW + 60000;
    assert_int_equal(dht_entry_sign(&s3, k3, &alice), 0);
    for (int bytes_full = 0; bytes_full < 2; bytes_full++) {
        dht_store_limits lim2 = {.max_keys = bytes_full ? 3 : 2, .max_bytes = 4 * (700 + 160),
                                 .max_unsigned_bytes = 4 * (700 + 160)};
        s = dht_store_create(&lim2);
        for (uint32_t i = 0; i < 2; i++) {
            e = unsigned_entry(sub, i, val, sizeof val, NOW + 60000);
            assert_int_equal(dht_store_put(s, k1, &e, NOW), 1);
            assert_int_equal(dht_store_put(s, k2, &e, NOW), 1);
        }
        assert_int_equal(dht_store_put(s, k3, &e, NOW), -ENOSPC); /* keys or bytes */
        assert_int_equal(dht_store_put(s, k3, &s3, NOW), 1);
        assert_true(dht_store_bytes(s) <= lim2.max_bytes);
        assert_int_equal(dht_store_count_keys(s), bytes_full ? 3 : 2);
        assert_int_equal(dht_store_count_entries(s), bytes_full ? 4 : 3);
        assert_int_equal(dht_store_get(s, k3, NOW, 0, got, 8, &total), 1);
        assert_int_equal(dht_store_unsigned_bytes(s), (bytes_full ? 3 : 2) * (700 + 160));
        dht_store_destroy(&s);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_signed_entries_and_forgeries),
        cmocka_unit_test(test_newest_expiration_wins_and_expiry),
        cmocka_unit_test(test_limits_and_paging),
        cmocka_unit_test(test_unsigned_quotas),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
