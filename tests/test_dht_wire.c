/* DHT wire codec (dht/wire.h): round trips, limits, hostile bytes. */
#include <errno.h>

#include <msgpack.h>

#include "dht/dht.h"
#include "test_util.h"

static uint64_t rng_state = 12345;
static uint64_t rnd(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fill(void *p, size_t n)
{
    uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)rnd();
}

static uint8_t vals[DHT_WIRE_MAX_ENTRIES][DHT_MAX_VALUE];
static uint8_t subs[DHT_WIRE_MAX_ENTRIES][DHT_MAX_SUBKEY];

/* A message of every type with random contents. */
static void make_msg(dht_msg *m, int type, size_t n_nodes, size_t n_entries, size_t vlen)
{
    memset(m, 0, sizeof *m);
    m->type = (uint8_t)type;
    m->tid = (uint32_t)rnd();
    fill(m->id, DHT_ID_LEN);
    fill(m->target, DHT_ID_LEN);
    int base = type & 0x7f, reply = type & DHT_MSG_REPLY;
    if (!reply) {
        m->has_nonce = (int)(rnd() & 1);
        fill(m->nonce, DHT_NONCE_LEN);
        m->read_only = (int)(rnd() & 1);
        if (base == DHT_MSG_GET)
            m->offset = (uint32_t)(rnd() % 300);
    } else {
        m->has_proof = (int)(rnd() & 1);
        fill(m->pk, 32);
        fill(m->sig, 64);
        if (base == DHT_MSG_STORE)
            m->status = (int)(rnd() % 5);
        if (base == DHT_MSG_GET) {
            m->has_next = (int)(rnd() & 1);
            m->next_offset = m->has_next ? (uint32_t)(rnd() % 1000) : 0;
        }
    }
    m->has_token = reply || base == DHT_MSG_STORE;
    fill(m->token, DHT_TOKEN_LEN);
    if (reply && (base == DHT_MSG_FIND_NODE || base == DHT_MSG_GET)) {
        m->n_nodes = n_nodes;
        for (size_t i = 0; i < n_nodes; i++) {
            fill(m->nodes[i].id, DHT_ID_LEN);
            m->nodes[i].addr.family = (i & 1) ? 6 : 4;
            fill(m->nodes[i].addr.ip, m->nodes[i].addr.family == 4 ? 4 : 16);
            m->nodes[i].addr.port = (uint16_t)(1 + rnd() % 65535);
        }
    }
    if ((reply && base == DHT_MSG_GET) || (!reply && base == DHT_MSG_STORE)) {
        m->n_entries = base == DHT_MSG_STORE ? 1 : n_entries;
        for (size_t i = 0; i < m->n_entries; i++) {
            dht_entry *e = &m->entries[i];
            e->subkey_len = rnd() % (DHT_MAX_SUBKEY + 1);
            fill(subs[i], e->subkey_len);
            e->subkey = subs[i];
            e->value_len = vlen;
            fill(vals[i], vlen);
            e->value = vals[i];
            e->expires = rnd() >> (rnd() % 64);
            e->is_signed = (int)(rnd() & 1);
            fill(e->pk, 32);
            fill(e->sig, 64);
        }
    }
}

static void assert_same(const dht_msg *a, const dht_msg *b)
{
    assert_int_equal(a->type, b->type);
    assert_int_equal(a->tid, b->tid);
    assert_memory_equal(a->id, b->id, DHT_ID_LEN);
    int base = a->type & 0x7f, reply = a->type & DHT_MSG_REPLY;
    if (!reply) {
        assert_int_equal(a->has_nonce, b->has_nonce);
        assert_int_equal(a->read_only, b->read_only);
        if (a->has_nonce)
            assert_memory_equal(a->nonce, b->nonce, DHT_NONCE_LEN);
        if (base != DHT_MSG_PING)
            assert_memory_equal(a->target, b->target, DHT_ID_LEN);
        if (base == DHT_MSG_GET)
            assert_int_equal(a->offset, b->offset);
    } else {
        assert_int_equal(a->has_proof, b->has_proof);
        if (a->has_proof) {
            assert_memory_equal(a->pk, b->pk, 32);
            assert_memory_equal(a->sig, b->sig, 64);
        }
        if (base == DHT_MSG_STORE)
            assert_int_equal(a->status, b->status);
        if (base == DHT_MSG_GET) {
            assert_int_equal(a->has_next, b->has_next);
            assert_int_equal(a->next_offset, b->next_offset);
        }
    }
    assert_int_equal(a->has_token, b->has_token);
    if (a->has_token)
        assert_memory_equal(a->token, b->token, DHT_TOKEN_LEN);
    assert_int_equal(a->n_nodes, b->n_nodes);
    for (size_t i = 0; i < a->n_nodes; i++) {
        assert_memory_equal(a->nodes[i].id, b->nodes[i].id, DHT_ID_LEN);
        assert_true(dht_addr_equal(&a->nodes[i].addr, &b->nodes[i].addr));
    }
    assert_int_equal(a->n_entries, b->n_entries);
    for (size_t i = 0; i < a->n_entries; i++) {
        const dht_entry *x = &a->entries[i], *y = &b->entries[i];
        assert_int_equal(x->subkey_len, y->subkey_len);
        assert_memory_equal(x->subkey, y->subkey, x->subkey_len);
        assert_int_equal(x->value_len, y->value_len);
        assert_memory_equal(x->value, y->value, x->value_len);
        assert_true(x->expires == y->expires);
        assert_int_equal(x->is_signed, y->is_signed);
        if (x->is_signed) {
            assert_memory_equal(x->pk, y->pk, 32);
            assert_memory_equal(x->sig, y->sig, 64);
        }
    }
}

static const int types[] = {
    DHT_MSG_PING, DHT_MSG_FIND_NODE, DHT_MSG_GET, DHT_MSG_STORE,
    DHT_MSG_PING | DHT_MSG_REPLY, DHT_MSG_FIND_NODE | DHT_MSG_REPLY,
    DHT_MSG_GET | DHT_MSG_REPLY, DHT_MSG_STORE | DHT_MSG_REPLY,
};

/* The output is standard msgpack: msgpack-c parses it as one map that
 * consumes every byte. */
static void assert_msgpack_map(const uint8_t *buf, size_t len)
{
    msgpack_unpacked u;
    size_t off = 0;
    msgpack_unpacked_init(&u);
    assert_int_equal(msgpack_unpack_next(&u, (const char *)buf, len, &off), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(off, len);
    assert_int_equal(u.data.type, MSGPACK_OBJECT_MAP);
    msgpack_unpacked_destroy(&u);
}

static void test_round_trip_every_type(void **state)
{
    (void)state;
    uint8_t buf[DHT_MAX_DATAGRAM];
    for (int rep = 0; rep < 200; rep++) {
        for (size_t t = 0; t < sizeof types / sizeof *types; t++) {
            dht_msg m, d;
            make_msg(&m, types[t], rnd() % 12, 1 + rnd() % 3, rnd() % 120);
            int len = dht_wire_encode(&m, buf, sizeof buf);
            if (len == -EMSGSIZE)
                continue;
            assert_true(len > 0);
            assert_true(len <= DHT_MAX_DATAGRAM - DHT_TAG_LEN);
            assert_msgpack_map(buf, (size_t)len);
            assert_int_equal(dht_wire_decode(&d, buf, (size_t)len), 0);
            assert_same(&m, &d);
        }
    }
}

static void test_largest_messages_fit(void **state)
{
    (void)state;
    uint8_t buf[DHT_MAX_DATAGRAM];
    dht_msg m, d;
    /* A find_node reply with k IPv6 nodes, proof and token. */
    make_msg(&m, DHT_MSG_FIND_NODE | DHT_MSG_REPLY, DHT_WIRE_MAX_NODES, 0, 0);
    for (size_t i = 0; i < m.n_nodes; i++)
        m.nodes[i].addr.family = 6;
    m.has_proof = 1;
    int len = dht_wire_encode(&m, buf, sizeof buf);
    assert_true(len > 0 && len + DHT_TAG_LEN < 1200);
    assert_int_equal(dht_wire_decode(&d, buf, (size_t)len), 0);
    /* A store of a signed maximal entry with nonce. */
    make_msg(&m, DHT_MSG_STORE, 0, 1, DHT_MAX_VALUE);
    m.has_nonce = 1;
    m.read_only = 1;
    m.entries[0].subkey_len = DHT_MAX_SUBKEY;
    m.entries[0].is_signed = 1;
    m.entries[0].expires = UINT64_MAX;
    len = dht_wire_encode(&m, buf, sizeof buf);
    assert_true(len > 0 && len + DHT_TAG_LEN < 1200);
    /* Too much for one datagram is refused, not truncated. */
    make_msg(&m, DHT_MSG_GET | DHT_MSG_REPLY, 20, 3, DHT_MAX_VALUE);
    assert_int_equal(dht_wire_encode(&m, buf, sizeof buf), -EMSGSIZE);
    /* Limits are enforced by the encoder too. */
    make_msg(&m, DHT_MSG_STORE, 0, 1, 10);
    m.entries[0].value_len = DHT_MAX_VALUE + 1;
    assert_int_equal(dht_wire_encode(&m, buf, sizeof buf), -EINVAL);
}

static int encode_some(uint8_t *buf, dht_msg *m)
{
    make_msg(m, types[rnd() % 8], rnd() % 8, 1 + rnd() % 2, rnd() % 64);
    return dht_wire_encode(m, buf, DHT_MAX_DATAGRAM);
}

static void test_every_truncation_is_rejected(void **state)
{
    (void)state;
    uint8_t buf[DHT_MAX_DATAGRAM];
    for (int rep = 0; rep < 100; rep++) {
        dht_msg m, d;
        int len = encode_some(buf, &m);
        assert_true(len > 0);
        for (int cut = 0; cut < len; cut++)
            assert_int_equal(dht_wire_decode(&d, buf, (size_t)cut), -EBADMSG);
    }
}

static void test_random_garbage_and_mutations(void **state)
{
    (void)state;
    uint8_t buf[DHT_MAX_DATAGRAM], g[DHT_MAX_DATAGRAM];
    dht_msg m, d;
    size_t ok = 0;
    for (int rep = 0; rep < 20000; rep++) {
        size_t n = rnd() % sizeof g;
        fill(g, n);
        (void)dht_wire_decode(&d, g, n); /* must not crash (ASan watches) */
    }
    for (int rep = 0; rep < 3000; rep++) {
        int len = encode_some(buf, &m);
        memcpy(g, buf, (size_t)len);
        int flips = 1 + (int)(rnd() % 4);
        for (int f = 0; f < flips; f++)
            g[rnd() % (size_t)len] = (uint8_t)rnd();
        if (dht_wire_decode(&d, g, (size_t)len) == 0) {
            ok++;
            /* Whatever decodes must re-encode within limits. */
            uint8_t again[DHT_MAX_DATAGRAM];
            int l2 = dht_wire_encode(&d, again, sizeof again);
            assert_true(l2 > 0 || l2 == -EMSGSIZE || l2 == -EINVAL);
            for (size_t i = 0; i < d.n_entries; i++) {
                assert_true(d.entries[i].subkey_len <= DHT_MAX_SUBKEY);
                assert_true(d.entries[i].value_len <= DHT_MAX_VALUE);
            }
        }
    }
    printf("mutations still decoding: %zu of 3000 (seed 12345)\n", ok);
}

/* Hand-built inputs via msgpack-c: unknown keys ignored, wrong types,
 * duplicate keys, huge declared counts, deep nesting, trailing bytes. */
static size_t pack_ping(uint8_t *out, int extra, int dup, int bad_type)
{
    msgpack_sbuffer sb;
    msgpack_packer pk;
    uint8_t id[20] = {1, 2, 3};
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, (size_t)(4 + (extra ? 1 : 0) + (dup ? 1 : 0)));
    msgpack_pack_str_with_body(&pk, "v", 1);
    msgpack_pack_uint8(&pk, 1);
    if (extra) {
        msgpack_pack_str_with_body(&pk, "future_field", 12);
        msgpack_pack_array(&pk, 2);
        msgpack_pack_double(&pk, 1.5);
        msgpack_pack_map(&pk, 1);
        msgpack_pack_nil(&pk);
        msgpack_pack_str_with_body(&pk, "x", 1);
    }
    msgpack_pack_str_with_body(&pk, "t", 1);
    if (bad_type)
        msgpack_pack_str_with_body(&pk, "1", 1);
    else
        msgpack_pack_uint8(&pk, 1);
    msgpack_pack_str_with_body(&pk, "x", 1);
    msgpack_pack_uint32(&pk, 77);
    msgpack_pack_str_with_body(&pk, "id", 2);
    msgpack_pack_bin_with_body(&pk, id, 20);
    if (dup) {
        msgpack_pack_str_with_body(&pk, "x", 1);
        msgpack_pack_uint32(&pk, 78);
    }
    memcpy(out, sb.data, sb.size);
    size_t n = sb.size;
    msgpack_sbuffer_destroy(&sb);
    return n;
}

static void test_hand_built_inputs(void **state)
{
    (void)state;
    uint8_t buf[512];
    dht_msg d;
    size_t n = pack_ping(buf, 0, 0, 0);
    assert_int_equal(dht_wire_decode(&d, buf, n), 0);
    assert_int_equal(d.tid, 77);
    n = pack_ping(buf, 1, 0, 0);
    assert_int_equal(dht_wire_decode(&d, buf, n), 0); /* unknown key skipped */
    assert_int_equal(d.type, DHT_MSG_PING);
    n = pack_ping(buf, 0, 1, 0);
    assert_int_equal(dht_wire_decode(&d, buf, n), -EBADMSG); /* duplicate key */
    n = pack_ping(buf, 0, 0, 1);
    assert_int_equal(dht_wire_decode(&d, buf, n), -EBADMSG); /* wrong type */
    n = pack_ping(buf, 0, 0, 0);
    buf[n] = 0xc0;
    assert_int_equal(dht_wire_decode(&d, buf, n + 1), -EBADMSG); /* trailing byte */
    /* A map claiming 2^32-1 pairs, an array claiming 2^32-1 elements. */
    const uint8_t huge_map[] = {0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, 'v', 0x01};
    assert_int_equal(dht_wire_decode(&d, huge_map, sizeof huge_map), -EBADMSG);
    const uint8_t huge_arr[] = {0x81, 0xa2, 'z', 'z', 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0};
    assert_int_equal(dht_wire_decode(&d, huge_arr, sizeof huge_arr), -EBADMSG);
    /* 600 nested arrays under an unknown key: depth-limited, not recursed. */
    uint8_t deep[700];
    size_t k = 0;
    deep[k++] = 0x81;
    deep[k++] = 0xa1;
    deep[k++] = 'q';
    for (int i = 0; i < 600; i++)
        deep[k++] = 0x91;
    deep[k++] = 0xc0;
    assert_int_equal(dht_wire_decode(&d, deep, k), -EBADMSG);
    /* Empty and oversized inputs. */
    assert_int_equal(dht_wire_decode(&d, buf, 0), -EBADMSG);
    static uint8_t big[4000];
    assert_int_equal(dht_wire_decode(&d, big, sizeof big), -EBADMSG);
}

static void test_addr_pack_and_tag(void **state)
{
    (void)state;
    dht_addr a, b;
    uint8_t p[18], key[32] = {9}, t1[16], t2[16];
    const uint8_t ip[4] = {127, 0, 0, 1};
    dht_addr_v4(&a, ip, 4000);
    assert_int_equal(dht_wire_addr_pack(p, &a), 6);
    assert_int_equal(dht_wire_addr_unpack(&b, p, 6), 0);
    assert_true(dht_addr_equal(&a, &b));
    assert_int_equal(dht_wire_addr_unpack(&b, p, 5), -EBADMSG);
    p[4] = p[5] = 0;
    assert_int_equal(dht_wire_addr_unpack(&b, p, 6), -EBADMSG); /* port 0 */
    dht_wire_tag(t1, key, (const uint8_t *)"abc", 3);
    key[1] = 1;
    dht_wire_tag(t2, key, (const uint8_t *)"abc", 3);
    assert_memory_not_equal(t1, t2, 16);
}

/* The "not in this swarm" notice: round trip, strictness, and it is never
 * taken for a message (nor a message for it). */
static void test_swarm_reject_notice(void **state)
{
    (void)state;
    uint8_t buf[64], big[DHT_MAX_DATAGRAM];
    uint32_t tid = 0;
    int len = dht_wire_encode_reject(0xdeadbeefu, buf, sizeof buf);
    assert_true(len > 0 && len < 24);
    assert_int_equal(dht_wire_decode_reject(buf, (size_t)len, &tid), 0);
    assert_int_equal(tid, 0xdeadbeefu);
    dht_msg m;
    assert_int_equal(dht_wire_decode(&m, buf, (size_t)len), -EBADMSG);
    for (int i = 0; i < len; i++)
        assert_int_equal(dht_wire_decode_reject(buf, (size_t)i, &tid), -EBADMSG);
    buf[len] = 0;
    assert_int_equal(dht_wire_decode_reject(buf, (size_t)len + 1, &tid), -EBADMSG); /* trailing */
    assert_int_equal(dht_wire_encode_reject(1, buf, 4), -EMSGSIZE);
    /* A ping is not a notice. */
    memset(&m, 0, sizeof m);
    m.type = DHT_MSG_PING;
    m.tid = 7;
    len = dht_wire_encode(&m, big, sizeof big);
    assert_true(len > 0);
    assert_int_equal(dht_wire_decode_reject(big, (size_t)len, &tid), -EBADMSG);
    /* {v:1, t:0xff, x:5} with an unknown key is still one; v:2 is not. */
    const uint8_t extra[] = {0x84, 0xa1, 'v', 1, 0xa1, 't', 0xcc, 0xff, 0xa1, 'x', 5, 0xa1, 'q', 0xc0};
    assert_int_equal(dht_wire_decode_reject(extra, sizeof extra, &tid), 0);
    assert_int_equal(tid, 5);
    const uint8_t v2[] = {0x83, 0xa1, 'v', 2, 0xa1, 't', 0xcc, 0xff, 0xa1, 'x', 5};
    assert_int_equal(dht_wire_decode_reject(v2, sizeof v2, &tid), -EBADMSG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_every_type),
        cmocka_unit_test(test_largest_messages_fit),
        cmocka_unit_test(test_every_truncation_is_rejected),
        cmocka_unit_test(test_random_garbage_and_mutations),
        cmocka_unit_test(test_hand_built_inputs),
        cmocka_unit_test(test_addr_pack_and_tag),
        cmocka_unit_test(test_swarm_reject_notice),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
