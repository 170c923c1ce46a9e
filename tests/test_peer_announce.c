/* Block announcements and model records (swarm/announce.h), and the msgpack
 * reader under them (dht/mp.h): round trips, unknown keys, and hostile bytes. */
#include <errno.h>
#include <math.h>

#include "dht/mp.h"
#include "swarm/announce.h"
#include "peer/averaging.h"
#include "test_util.h"

static peer_announce sample(void)
{
    peer_announce a;
    memset(&a, 0, sizeof a);
    snprintf(a.block, sizeof a.block, "fmnist-mlp.3");
    snprintf(a.addr, sizeof a.addr, "[2001:db8::1]:7001");
    a.state = PEER_STATE_ONLINE;
    a.stage_hash = 0x0123456789abcdefULL;
    a.weight_version = 4242;
    a.throughput = 1234.5;
    a.load = 0.25;
    snprintf(a.device, sizeof a.device, "cuda:0");
    a.time_ms = 1790000000123ULL;
    return a;
}

static void test_round_trip(void **state)
{
    (void)state;
    peer_announce a = sample(), b;
    uint8_t buf[PEER_ANNOUNCE_MAX_BYTES];
    long n = peer_announce_encode(&a, buf, sizeof buf);
    assert_true(n > 0 && n < 200);
    assert_int_equal(peer_announce_decode(&b, buf, (size_t)n), 0);
    assert_memory_equal(&a, &b, sizeof a);
    assert_int_equal(peer_announce_encode(&a, buf, (size_t)n - 1), -EMSGSIZE);

    peer_model_record m = {"fmnist-mlp", 6}, m2;
    n = peer_model_record_encode(&m, buf, sizeof buf);
    assert_true(n > 0);
    assert_int_equal(peer_model_record_decode(&m2, buf, (size_t)n), 0);
    assert_string_equal(m2.model, "fmnist-mlp");
    assert_int_equal(m2.n_stages, 6);
    assert_string_equal(peer_state_name(1), "online");
    assert_string_equal(peer_state_name(7), "unknown");
}

static void test_encode_rejects_bad_fields(void **state)
{
    (void)state;
    uint8_t buf[PEER_ANNOUNCE_MAX_BYTES];
    peer_announce a = sample();
    a.block[0] = '\0';
    assert_int_equal(peer_announce_encode(&a, buf, sizeof buf), -EINVAL);
    a = sample();
    a.addr[3] = '\n';
    assert_int_equal(peer_announce_encode(&a, buf, sizeof buf), -EINVAL);
    a = sample();
    a.state = (peer_state)3;
    assert_int_equal(peer_announce_encode(&a, buf, sizeof buf), -EINVAL);
    a = sample();
    a.throughput = NAN;
    assert_int_equal(peer_announce_encode(&a, buf, sizeof buf), -EINVAL);
    peer_model_record m = {"", 6};
    assert_int_equal(peer_model_record_encode(&m, buf, sizeof buf), -EINVAL);
}

/* A newer peer's value with extra keys (even nested ones) still decodes;
 * one missing a required key does not. Values are written with msgpack-c. */
static void test_unknown_and_missing_keys(void **state)
{
    (void)state;
    uint8_t buf[512];
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, sizeof buf);
    msgpack_pack_map(&w.pk, 7);
    dht_mp_pack_cstr(&w.pk, "future");
    msgpack_pack_array(&w.pk, 2);
    msgpack_pack_map(&w.pk, 1);
    dht_mp_pack_cstr(&w.pk, "x");
    msgpack_pack_float(&w.pk, 1.5f);
    msgpack_pack_nil(&w.pk);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, 1);
    dht_mp_pack_cstr(&w.pk, "b");
    dht_mp_pack_cstr(&w.pk, "m.0");
    dht_mp_pack_cstr(&w.pk, "a");
    dht_mp_pack_cstr(&w.pk, "127.0.0.1:1");
    dht_mp_pack_cstr(&w.pk, "st");
    msgpack_pack_uint64(&w.pk, 0);
    dht_mp_pack_cstr(&w.pk, "h");
    msgpack_pack_uint64(&w.pk, 9);
    dht_mp_pack_cstr(&w.pk, "tp");
    msgpack_pack_float(&w.pk, 1e30f); /* absurd claims are clamped */
    long n = dht_mp_writer_finish(&w);
    assert_true(n > 0);
    peer_announce a;
    assert_int_equal(peer_announce_decode(&a, buf, (size_t)n), 0);
    assert_string_equal(a.block, "m.0");
    assert_true(a.throughput == 1e9);
    assert_int_equal(a.state, PEER_STATE_JOINING);

    /* The same without "h": invalid. */
    dht_mp_writer_init(&w, buf, sizeof buf);
    msgpack_pack_map(&w.pk, 4);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, 1);
    dht_mp_pack_cstr(&w.pk, "b");
    dht_mp_pack_cstr(&w.pk, "m.0");
    dht_mp_pack_cstr(&w.pk, "a");
    dht_mp_pack_cstr(&w.pk, "127.0.0.1:1");
    dht_mp_pack_cstr(&w.pk, "st");
    msgpack_pack_uint64(&w.pk, 0);
    n = dht_mp_writer_finish(&w);
    assert_int_equal(peer_announce_decode(&a, buf, (size_t)n), -EBADMSG);
    assert_int_equal(a.block[0], 0); /* zeroed on failure */
}

static void test_hostile_bytes(void **state)
{
    (void)state;
    peer_announce a = sample(), b;
    uint8_t good[PEER_ANNOUNCE_MAX_BYTES], bad[PEER_ANNOUNCE_MAX_BYTES];
    long n = peer_announce_encode(&a, good, sizeof good);
    assert_true(n > 0);
    /* Every truncation fails. */
    for (long cut = 0; cut < n; cut++)
        assert_int_equal(peer_announce_decode(&b, good, (size_t)cut), -EBADMSG);
    /* Trailing bytes fail. */
    memcpy(bad, good, (size_t)n);
    bad[n] = 0xc0;
    assert_int_equal(peer_announce_decode(&b, bad, (size_t)n + 1), -EBADMSG);
    /* Huge declared counts and deep nesting fail fast, without allocating. */
    const uint8_t huge_map[] = {0xdf, 0xff, 0xff, 0xff, 0xff};
    assert_int_equal(peer_announce_decode(&b, huge_map, sizeof huge_map), -EBADMSG);
    uint8_t deep[64];
    deep[0] = 0x81; /* {"z": [[[[...]]]]} */
    deep[1] = 0xa1;
    deep[2] = 'z';
    memset(deep + 3, 0x91, sizeof deep - 3);
    assert_int_equal(peer_announce_decode(&b, deep, sizeof deep), -EBADMSG);
    const uint8_t huge_str[] = {0x81, 0xa1, 'b', 0xdb, 0x7f, 0xff, 0xff, 0xff, 'x'};
    assert_int_equal(peer_announce_decode(&b, huge_str, sizeof huge_str), -EBADMSG);
    /* Random single-byte mutations: never a crash; a value that still
     * decodes has sane fields. */
    unsigned seed = 4242;
    int accepted = 0;
    for (int k = 0; k < 20000; k++) {
        memcpy(bad, good, (size_t)n);
        int flips = 1 + rand_r(&seed) % 3;
        for (int f = 0; f < flips; f++)
            bad[rand_r(&seed) % n] = (uint8_t)rand_r(&seed);
        if (peer_announce_decode(&b, bad, (size_t)n) == 0) {
            accepted++;
            assert_true(b.block[0] && b.addr[0]);
            assert_true(b.state <= PEER_STATE_OFFLINE);
            assert_true(b.load >= 0 && b.load <= 1);
            assert_true(b.throughput >= 0 && b.throughput <= 1e9);
        }
    }
    assert_true(accepted < 20000); /* the mutations did reach the checks */
    /* Pure noise. */
    for (int k = 0; k < 5000; k++) {
        size_t len = (size_t)(rand_r(&seed) % (int)sizeof bad);
        for (size_t i = 0; i < len; i++)
            bad[i] = (uint8_t)rand_r(&seed);
        (void)peer_announce_decode(&b, bad, len);
        (void)peer_model_record_decode(&(peer_model_record){{0}, 0}, bad, len);
    }
    assert_int_equal(peer_announce_decode(&b, NULL, 3), -EBADMSG);
}

/* The averaging matchmaking record: round trip, bad fields refused, every
 * truncation and random mutation handled, a different key per block and
 * stage hash. */
/* The cold-copy record, the new announcement fields and the averaging
 * period: round trips, truncation and random garbage. */
static void test_keep_record_and_new_fields(void **state)
{
    (void)state;
    peer_keep_record k = {0}, k2;
    snprintf(k.addr, sizeof k.addr, "10.0.0.7:4001");
    k.weight_version = 123456;
    k.time_ms = 1795292477764ULL;
    uint8_t good[PEER_ANNOUNCE_MAX_BYTES], bad[PEER_ANNOUNCE_MAX_BYTES];
    long n = peer_keep_record_encode(&k, good, sizeof good);
    assert_true(n > 0);
    assert_int_equal(peer_keep_record_decode(&k2, good, (size_t)n), 0);
    assert_string_equal(k2.addr, k.addr);
    assert_true(k2.weight_version == k.weight_version && k2.time_ms == k.time_ms);
    for (long cut = 0; cut < n; cut++)
        assert_int_equal(peer_keep_record_decode(&k2, good, (size_t)cut), -EBADMSG);
    peer_keep_record e = k;
    e.addr[0] = '\0';
    assert_int_equal(peer_keep_record_encode(&e, bad, sizeof bad), -EINVAL);
    unsigned seed = 5;
    for (int i = 0; i < 20000; i++) {
        memcpy(bad, good, (size_t)n);
        for (int f = 0; f < 1 + i % 3; f++)
            bad[rand_r(&seed) % n] = (uint8_t)rand_r(&seed);
        if (peer_keep_record_decode(&k2, bad, (size_t)n) == 0)
            assert_true(k2.addr[0] != '\0');
        size_t len = (size_t)(rand_r(&seed) % (int)sizeof bad);
        for (size_t j = 0; j < len; j++)
            bad[j] = (uint8_t)rand_r(&seed);
        (void)peer_keep_record_decode(&k2, bad, len);
    }
    /* Announcement: abandoned rounds and a lost state travel; no loss, no
     * fields. */
    peer_announce a = sample(), b;
    a.avg_abandoned = 7;
    a.lost_from = 52;
    a.lost_to = 40;
    n = peer_announce_encode(&a, good, sizeof good);
    assert_true(n > 0);
    assert_int_equal(peer_announce_decode(&b, good, (size_t)n), 0);
    assert_true(b.avg_abandoned == 7 && b.lost_from == 52 && b.lost_to == 40);
    a.lost_from = a.lost_to = 0;
    n = peer_announce_encode(&a, good, sizeof good);
    assert_int_equal(peer_announce_decode(&b, good, (size_t)n), 0);
    assert_true(b.lost_from == 0 && b.lost_to == 0);
    /* The averaging period round-trips; 0 is left out. */
    peer_avg_record r = {0}, r2;
    r.round = 1795292478000ULL;
    snprintf(r.addr, sizeof r.addr, "127.0.0.1:1");
    r.period_ms = 30000;
    n = peer_avg_record_encode(&r, good, sizeof good);
    assert_int_equal(peer_avg_record_decode(&r2, good, (size_t)n), 0);
    assert_true(r2.period_ms == 30000 && r2.round == r.round);
    r.period_ms = 0;
    long n0 = peer_avg_record_encode(&r, good, sizeof good);
    assert_true(n0 < n);
    assert_int_equal(peer_avg_record_decode(&r2, good, (size_t)n0), 0);
    assert_true(r2.period_ms == 0);
}

/* Training integrity: refused gradients ("gr") and a frozen holder ("fz")
 * travel; 0 is left out, so an older reader sees the same value as before
 * and a reader flags a holder when "fz" is present. Everything at its
 * largest still fits. */
static void test_integrity_fields(void **state)
{
    (void)state;
    peer_announce a = sample(), b;
    uint8_t buf[PEER_ANNOUNCE_MAX_BYTES];
    long n0 = peer_announce_encode(&a, buf, sizeof buf);
    assert_true(n0 > 0);
    a.grads_refused = 17;
    a.frozen_steps = 8;
    long n = peer_announce_encode(&a, buf, sizeof buf);
    assert_true(n > n0);
    assert_int_equal(peer_announce_decode(&b, buf, (size_t)n), 0);
    assert_true(b.grads_refused == 17 && b.frozen_steps == 8);
    assert_memory_equal(&a, &b, sizeof a);
    assert_non_null(memmem(buf, (size_t)n, "\xa2gr", 3));
    assert_non_null(memmem(buf, (size_t)n, "\xa2" "fz", 3));
    a.grads_refused = a.frozen_steps = 0;
    n = peer_announce_encode(&a, buf, sizeof buf);
    assert_true(n == n0);
    assert_null(memmem(buf, (size_t)n, "\xa2" "fz", 3));
    assert_int_equal(peer_announce_decode(&b, buf, (size_t)n), 0);
    assert_true(b.grads_refused == 0 && b.frozen_steps == 0);
    /* The largest announcement: long names, every optional field at 2^64-1. */
    memset(a.block, 'b', 64);
    a.block[64] = '\0';
    memset(a.addr, 'a', 64);
    a.addr[64] = '\0';
    memset(a.device, 'd', 32);
    a.device[32] = '\0';
    a.stage_hash = a.weight_version = a.time_ms = a.avg_rounds = a.avg_abandoned = UINT64_MAX;
    a.avg_group = 4096;
    a.lost_from = UINT64_MAX;
    a.lost_to = UINT64_MAX - 1;
    a.grads_refused = a.frozen_steps = UINT64_MAX;
    n = peer_announce_encode(&a, buf, sizeof buf);
    fprintf(stderr, "  largest announcement: %ld bytes (limit %d)\n", n, PEER_ANNOUNCE_MAX_BYTES);
    assert_true(n > 0 && n <= PEER_ANNOUNCE_MAX_BYTES);
    assert_int_equal(peer_announce_decode(&b, buf, (size_t)n), 0);
    assert_true(b.grads_refused == UINT64_MAX && b.frozen_steps == UINT64_MAX);
}

static void test_avg_record(void **state)
{
    (void)state;
    peer_avg_record a = {0}, b;
    a.round = 884736123;
    snprintf(a.addr, sizeof a.addr, "[2001:db8::7]:7001");
    a.optim = 1;
    uint8_t good[PEER_ANNOUNCE_MAX_BYTES], bad[PEER_ANNOUNCE_MAX_BYTES];
    long n = peer_avg_record_encode(&a, good, sizeof good);
    assert_true(n > 0);
    assert_int_equal(peer_avg_record_decode(&b, good, (size_t)n), 0);
    assert_true(b.round == a.round && b.optim == 1);
    assert_string_equal(b.addr, a.addr);
    peer_avg_record e = a;
    e.optim = 256;
    assert_int_equal(peer_avg_record_encode(&e, good + 200, 100), -EINVAL);
    e = a;
    e.addr[0] = '\0';
    assert_int_equal(peer_avg_record_encode(&e, bad, sizeof bad), -EINVAL);
    e = a;
    e.addr[3] = '\n';
    assert_int_equal(peer_avg_record_encode(&e, bad, sizeof bad), -EINVAL);
    assert_true(peer_avg_record_encode(&a, bad, 8) < 0);
    for (long cut = 0; cut < n; cut++)
        assert_int_equal(peer_avg_record_decode(&b, good, (size_t)cut), -EBADMSG);
    /* An announcement is not a matchmaking record. */
    peer_announce an = sample();
    long an_n = peer_announce_encode(&an, bad, sizeof bad);
    assert_int_equal(peer_avg_record_decode(&b, bad, (size_t)an_n), -EBADMSG);
    unsigned seed = 77;
    for (int k = 0; k < 20000; k++) {
        memcpy(bad, good, (size_t)n);
        for (int f = 0; f < 1 + k % 3; f++)
            bad[rand_r(&seed) % n] = (uint8_t)rand_r(&seed);
        if (peer_avg_record_decode(&b, bad, (size_t)n) == 0)
            assert_true(b.addr[0] && b.optim >= 0 && b.optim <= 255);
        size_t len = (size_t)(rand_r(&seed) % (int)sizeof bad);
        for (size_t i = 0; i < len; i++)
            bad[i] = (uint8_t)rand_r(&seed);
        (void)peer_avg_record_decode(&b, bad, len);
    }
    uint8_t k1[20], k2[20], k3[20];
    peer_avg_key(k1, "fmnist-mlp.1", 0x1234);
    peer_avg_key(k2, "fmnist-mlp.2", 0x1234);
    peer_avg_key(k3, "fmnist-mlp.1", 0x1235);
    assert_memory_not_equal(k1, k2, 20);
    assert_memory_not_equal(k1, k3, 20);
}

static void test_mp_reader(void **state)
{
    (void)state;
    uint8_t buf[64];
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, sizeof buf);
    msgpack_pack_float(&w.pk, 0.5f);
    msgpack_pack_double(&w.pk, -2.25);
    msgpack_pack_uint64(&w.pk, 300);
    msgpack_pack_int64(&w.pk, -1);
    dht_mp_pack_cstr(&w.pk, "a-very-long-key");
    long n = dht_mp_writer_finish(&w);
    assert_true(n > 0);
    dht_mp_reader r;
    dht_mp_reader_init(&r, buf, (size_t)n);
    double d;
    uint64_t u;
    char key[4];
    assert_int_equal(dht_mp_double(&r, &d), 0);
    assert_true(d == 0.5);
    assert_int_equal(dht_mp_double(&r, &d), 0);
    assert_true(d == -2.25);
    assert_int_equal(dht_mp_uint(&r, &u), 0);
    assert_true(u == 300);
    assert_int_equal(dht_mp_uint(&r, &u), -1); /* negative */
    assert_int_equal(dht_mp_key(&r, key, sizeof key), 0);
    assert_string_equal(key, ""); /* too long: unknown */
    assert_true(dht_mp_at_end(&r));
    /* A writer overflow is reported, not grown. */
    dht_mp_writer_init(&w, buf, 3);
    dht_mp_pack_cstr(&w.pk, "too long for three bytes");
    assert_int_equal(dht_mp_writer_finish(&w), -EMSGSIZE);
    /* NaN is not a number we accept. */
    dht_mp_writer_init(&w, buf, sizeof buf);
    msgpack_pack_double(&w.pk, NAN);
    n = dht_mp_writer_finish(&w);
    dht_mp_reader_init(&r, buf, (size_t)n);
    assert_int_equal(dht_mp_double(&r, &d), -1);
    /* 0xc1 is never valid. */
    const uint8_t c1 = 0xc1;
    dht_mp_reader_init(&r, &c1, 1);
    assert_int_equal(dht_mp_skip(&r, 0), -1);
}

/* Writes a minimal valid announcement (v b a st h) plus "wf" with the value
 * written by wf (NULL: no "wf"). Returns the length. */
static long announce_with_wf(uint8_t *buf, size_t cap, void (*wf)(msgpack_packer *))
{
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, cap);
    msgpack_pack_map(&w.pk, wf ? 6 : 5);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, 1);
    if (wf) {
        dht_mp_pack_cstr(&w.pk, "wf");
        wf(&w.pk);
    }
    dht_mp_pack_cstr(&w.pk, "b");
    dht_mp_pack_cstr(&w.pk, "m.0");
    dht_mp_pack_cstr(&w.pk, "a");
    dht_mp_pack_cstr(&w.pk, "127.0.0.1:1");
    dht_mp_pack_cstr(&w.pk, "st");
    msgpack_pack_uint64(&w.pk, 1);
    dht_mp_pack_cstr(&w.pk, "h");
    msgpack_pack_uint64(&w.pk, 9);
    long n = dht_mp_writer_finish(&w);
    assert_true(n > 0);
    return n;
}

static void wf_str(msgpack_packer *pk) { dht_mp_pack_cstr(pk, "q8"); }
static void wf_neg(msgpack_packer *pk) { msgpack_pack_int64(pk, -1); }
static void wf_float(msgpack_packer *pk) { msgpack_pack_double(pk, 8.0); }
static void wf_nil(msgpack_packer *pk) { msgpack_pack_nil(pk); }
static void wf_array(msgpack_packer *pk)
{
    msgpack_pack_array(pk, 1);
    msgpack_pack_uint8(pk, 8);
}
static void wf_bin(msgpack_packer *pk)
{
    msgpack_pack_bin(pk, 1);
    msgpack_pack_bin_body(pk, "\x08", 1);
}
static void wf_true(msgpack_packer *pk) { msgpack_pack_true(pk); }
static void wf_q8(msgpack_packer *pk) { msgpack_pack_uint8(pk, 8); }
static void wf_u64(msgpack_packer *pk) { msgpack_pack_uint64(pk, 9); }
static void wf_zero(msgpack_packer *pk) { msgpack_pack_uint8(pk, 0); }

/* "wf", the tensor formats a peer accepts: round trips, is absent when 0
 * (so older readers see nothing new), decodes as 0 when absent, and a
 * value of another type is refused. */
static void test_wire_formats(void **state)
{
    (void)state;
    uint8_t buf[PEER_ANNOUNCE_MAX_BYTES];
    peer_announce a = sample(), b;
    long n0 = peer_announce_encode(&a, buf, sizeof buf);
    assert_true(n0 > 0);
    assert_null(memmem(buf, (size_t)n0, "\xa2wf", 3));
    memset(&b, 0x77, sizeof b);
    assert_int_equal(peer_announce_decode(&b, buf, (size_t)n0), 0);
    assert_int_equal(b.formats, 0);
    static const uint32_t masks[] = {1, 0x9, 0xF, 0x8, 0x6, 0x10 | 0x1, 0xFFFFFFFFu};
    for (size_t i = 0; i < sizeof masks / sizeof masks[0]; i++) {
        a.formats = masks[i];
        long n = peer_announce_encode(&a, buf, sizeof buf);
        assert_true(n > n0);
        assert_non_null(memmem(buf, (size_t)n, "\xa2wf", 3));
        memset(&b, 0, sizeof b);
        assert_int_equal(peer_announce_decode(&b, buf, (size_t)n), 0);
        assert_true(b.formats == masks[i]); /* bits this build does not know are kept */
        assert_memory_equal(&a, &b, sizeof a);
    }
    /* With every optional field at its largest, "wf" still fits. */
    memset(a.block, 'b', 64);
    a.block[64] = '\0';
    memset(a.addr, 'a', 64);
    a.addr[64] = '\0';
    memset(a.device, 'd', 32);
    a.device[32] = '\0';
    a.stage_hash = a.weight_version = a.time_ms = a.avg_rounds = a.avg_abandoned = UINT64_MAX;
    a.avg_group = 4096;
    a.lost_from = UINT64_MAX;
    a.lost_to = UINT64_MAX - 1;
    a.grads_refused = a.frozen_steps = UINT64_MAX;
    a.formats = 0xFFFFFFFFu;
    long n = peer_announce_encode(&a, buf, sizeof buf);
    assert_true(n > 0 && n <= PEER_ANNOUNCE_MAX_BYTES);
    assert_int_equal(peer_announce_decode(&b, buf, (size_t)n), 0);
    assert_memory_equal(&a, &b, sizeof a);

    /* Written by hand: any uint width, in any position. */
    uint8_t raw[256];
    n = announce_with_wf(raw, sizeof raw, NULL);
    assert_int_equal(peer_announce_decode(&b, raw, (size_t)n), 0);
    assert_int_equal(b.formats, 0);
    n = announce_with_wf(raw, sizeof raw, wf_q8);
    assert_int_equal(peer_announce_decode(&b, raw, (size_t)n), 0);
    assert_int_equal(b.formats, 8);
    assert_string_equal(b.block, "m.0");
    n = announce_with_wf(raw, sizeof raw, wf_u64);
    assert_int_equal(peer_announce_decode(&b, raw, (size_t)n), 0);
    assert_int_equal(b.formats, 9);
    n = announce_with_wf(raw, sizeof raw, wf_zero);
    assert_int_equal(peer_announce_decode(&b, raw, (size_t)n), 0);
    assert_int_equal(b.formats, 0);
    /* Garbage value types: the whole value is refused (and zeroed). */
    void (*const garbage[])(msgpack_packer *) = {wf_str, wf_neg, wf_float, wf_nil, wf_array, wf_bin, wf_true};
    for (size_t i = 0; i < sizeof garbage / sizeof garbage[0]; i++) {
        n = announce_with_wf(raw, sizeof raw, garbage[i]);
        memset(&b, 0x77, sizeof b);
        int rc = peer_announce_decode(&b, raw, (size_t)n);
        if (rc != -EBADMSG)
            fail_msg("garbage \"wf\" value %zu: got %d", i, rc);
        assert_int_equal(b.block[0], 0);
        assert_int_equal(b.formats, 0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_encode_rejects_bad_fields),
        cmocka_unit_test(test_unknown_and_missing_keys),
        cmocka_unit_test(test_hostile_bytes),
        cmocka_unit_test(test_avg_record),
        cmocka_unit_test(test_keep_record_and_new_fields),
        cmocka_unit_test(test_integrity_fields),
        cmocka_unit_test(test_mp_reader),
        cmocka_unit_test(test_wire_formats),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
