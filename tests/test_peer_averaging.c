/* peer/averaging.h: the candidates a member reads from the matchmaking
 * entries, and the group it forms from them. Every member must form the same group from the same entries, in
 * whatever order they came back; groups over the size limit split alike
 * everywhere; a different view gives a different digest (which is how the
 * members notice that they must look again). */
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <msgpack.h>

#include "swarm/announce.h"
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

/* Given inputs, the group chosen: the members sorted by node ID with their
 * addresses, self's place, and the digest of exactly those IDs and
 * optimizer kinds for that round. */
static void test_group_for_given_inputs(void **state)
{
    (void)state;
    peer_avg_candidate a[3];
    const uint8_t first[3] = {0x30, 0x10, 0x20};
    for (int k = 0; k < 3; k++) {
        cand_of(&a[k], k, 1);
        memset(a[k].m.id, first[k], DHT_ID_LEN);
    }
    peer_avg_group g;
    assert_int_equal(peer_avg_choose_group(a, 3, a[2].m.id, 5000, &g), 0);
    assert_int_equal(g.n, 3);
    assert_int_equal(g.me, 1);
    assert_true(g.with_optim);
    /* 0x10 (a[1], port 4001), 0x20 (a[2], 4002), 0x30 (a[0], 4000) */
    assert_memory_equal(g.members[0].id, a[1].m.id, DHT_ID_LEN);
    assert_memory_equal(g.members[1].id, a[2].m.id, DHT_ID_LEN);
    assert_memory_equal(g.members[2].id, a[0].m.id, DHT_ID_LEN);
    assert_string_equal(g.members[0].addr, "127.0.0.1:4001");
    assert_string_equal(g.members[1].addr, "127.0.0.1:4002");
    assert_string_equal(g.members[2].addr, "127.0.0.1:4000");
    uint8_t ids[3][DHT_ID_LEN], tags[3] = {1, 1, 1}, want[PEER_AVG_DIGEST_LEN];
    for (int i = 0; i < 3; i++)
        memcpy(ids[i], g.members[i].id, DHT_ID_LEN);
    peer_allreduce_digest(want, 5000, (const uint8_t(*)[DHT_ID_LEN])ids, tags, 3, PEER_AVG_MEAN);
    assert_memory_equal(g.digest, want, PEER_AVG_DIGEST_LEN);
    /* Member 0x30 uses SGD (kind 2): the group averages parameters only,
     * and the digest records each member's kind. */
    a[0].optim = 2;
    tags[2] = 2;
    assert_int_equal(peer_avg_choose_group(a, 3, a[1].m.id, 5000, &g), 0);
    assert_int_equal(g.me, 0);
    assert_false(g.with_optim);
    peer_allreduce_digest(want, 5000, (const uint8_t(*)[DHT_ID_LEN])ids, tags, 3, PEER_AVG_MEAN);
    assert_memory_equal(g.digest, want, PEER_AVG_DIGEST_LEN);
}

/* One over the size limit: two groups, of 8 and 9, that together hold
 * every candidate once. */
static void test_just_over_the_limit(void **state)
{
    (void)state;
    enum { NC = PEER_ALLREDUCE_MAX_MEMBERS + 1 };
    peer_avg_candidate c[NC];
    for (int k = 0; k < NC; k++)
        cand_of(&c[k], k, 1);
    int in_group[NC] = {0}, sizes[2] = {0}, ng = 0;
    uint8_t digests[2][PEER_AVG_DIGEST_LEN];
    for (int k = 0; k < NC; k++) {
        peer_avg_group g;
        assert_int_equal(peer_avg_choose_group(c, NC, c[k].m.id, 9000, &g), 0);
        assert_memory_equal(g.members[g.me].id, c[k].m.id, DHT_ID_LEN);
        int d = 0;
        while (d < ng && memcmp(digests[d], g.digest, PEER_AVG_DIGEST_LEN))
            d++;
        if (d == ng) {
            assert_true(ng < 2);
            memcpy(digests[ng], g.digest, PEER_AVG_DIGEST_LEN);
            sizes[ng++] = g.n;
        }
        assert_int_equal(sizes[d], g.n);
        in_group[k]++;
    }
    assert_int_equal(ng, 2);
    assert_int_equal(sizes[0] + sizes[1], NC);
    assert_true((sizes[0] == 8 && sizes[1] == 9) || (sizes[0] == 9 && sizes[1] == 8));
    for (int k = 0; k < NC; k++)
        assert_int_equal(in_group[k], 1);
}

/* A matchmaking entry as the DHT returns it. */
static void entry_of(dht_entry *e, uint8_t *val, size_t cap, const peer_avg_candidate *c, uint64_t round,
                     uint64_t period_ms)
{
    peer_avg_record r = {0};
    r.round = round;
    snprintf(r.addr, sizeof r.addr, "%.64s", c->m.addr);
    r.optim = c->optim;
    r.period_ms = period_ms;
    long n = peer_avg_record_encode(&r, val, cap);
    assert_true(n > 0);
    memset(e, 0, sizeof *e);
    e->subkey = c->m.id;
    e->subkey_len = DHT_ID_LEN;
    e->value = val;
    e->value_len = (size_t)n;
    e->is_signed = 1;
}

/* From the entries read: this round's signed, well-formed entries of
 * others, then self; the first other period seen is reported. */
/* Averaging modes never mix: a group holds only members of self's mode,
 * the digest of the same members and round differs by mode, entries of
 * another mode (an entry without one is mean) are not candidates, and the
 * non-mean modes match under their own key. */
static void test_modes_apart(void **state)
{
    (void)state;
    peer_avg_candidate c[4];
    for (int k = 0; k < 4; k++)
        cand_of(&c[k], k, 1);
    c[2].mode = c[3].mode = PEER_AVG_DILOCO;
    peer_avg_group gm, gd, gm2, gd2;
    assert_int_equal(peer_avg_choose_group(c, 4, c[0].m.id, 3000, &gm), 0);
    assert_int_equal(peer_avg_choose_group(c, 4, c[3].m.id, 3000, &gd), 0);
    assert_int_equal(gm.n, 2);
    assert_int_equal(gd.n, 2);
    assert_int_equal(gm.mode, PEER_AVG_MEAN);
    assert_int_equal(gd.mode, PEER_AVG_DILOCO);
    for (int i = 0; i < 2; i++) {
        const uint8_t *m = gm.members[i].id, *d = gd.members[i].id;
        assert_true(!memcmp(m, c[0].m.id, DHT_ID_LEN) || !memcmp(m, c[1].m.id, DHT_ID_LEN));
        assert_true(!memcmp(d, c[2].m.id, DHT_ID_LEN) || !memcmp(d, c[3].m.id, DHT_ID_LEN));
    }
    /* The same members in either mode: another digest; mean's is the one
     * peers without modes compute. */
    for (int k = 0; k < 4; k++)
        c[k].mode = PEER_AVG_MEAN;
    assert_int_equal(peer_avg_choose_group(c, 4, c[0].m.id, 3000, &gm2), 0);
    for (int k = 0; k < 4; k++)
        c[k].mode = PEER_AVG_DILOCO;
    assert_int_equal(peer_avg_choose_group(c, 4, c[0].m.id, 3000, &gd2), 0);
    assert_int_equal(gm2.n, 4);
    assert_int_equal(gd2.n, 4);
    assert_memory_equal(gm2.members, gd2.members, sizeof gm2.members);
    assert_memory_not_equal(gm2.digest, gd2.digest, PEER_AVG_DIGEST_LEN);
    uint8_t ids[4][DHT_ID_LEN], tags[4] = {1, 1, 1, 1}, want[PEER_AVG_DIGEST_LEN];
    for (int i = 0; i < 4; i++)
        memcpy(ids[i], gm2.members[i].id, DHT_ID_LEN);
    peer_allreduce_digest(want, 3000, (const uint8_t(*)[DHT_ID_LEN])ids, tags, 4, PEER_AVG_MEAN);
    assert_memory_equal(gm2.digest, want, PEER_AVG_DIGEST_LEN);
    peer_allreduce_digest(want, 3000, (const uint8_t(*)[DHT_ID_LEN])ids, tags, 4, PEER_AVG_DILOCO);
    assert_memory_equal(gd2.digest, want, PEER_AVG_DIGEST_LEN);

    /* Entries: the mode round-trips; mean is not written (older peers'
     * entries read as mean). */
    peer_avg_record r = {0}, back;
    uint8_t val[3][PEER_ANNOUNCE_MAX_BYTES];
    r.round = 3000;
    snprintf(r.addr, sizeof r.addr, "127.0.0.1:4000");
    r.optim = 1;
    long nm = peer_avg_record_encode(&r, val[0], sizeof val[0]);
    r.mode = PEER_AVG_DILOCO;
    long nd = peer_avg_record_encode(&r, val[1], sizeof val[1]);
    assert_true(nm > 0 && nd > nm);
    assert_int_equal(peer_avg_record_decode(&back, val[1], (size_t)nd), 0);
    assert_int_equal(back.mode, PEER_AVG_DILOCO);
    assert_int_equal(peer_avg_record_decode(&back, val[0], (size_t)nm), 0);
    assert_int_equal(back.mode, PEER_AVG_MEAN);
    r.mode = 256;
    assert_int_equal(peer_avg_record_encode(&r, val[2], sizeof val[2]), -EINVAL);
    /* A diloco self reads a mean entry and a diloco one: only the latter
     * is a candidate; a mean self, the reverse. */
    peer_avg_candidate self, out[4];
    cand_of(&self, 9, 1);
    dht_entry e[2];
    memset(e, 0, sizeof e);
    for (int i = 0; i < 2; i++) {
        e[i].subkey = c[i].m.id;
        e[i].subkey_len = DHT_ID_LEN;
        e[i].value = val[i];
        e[i].value_len = (size_t)(i ? nd : nm);
        e[i].is_signed = 1;
    }
    self.mode = PEER_AVG_DILOCO;
    assert_int_equal(peer_avg_candidates(e, 2, 3000, &self, 0, out, 4, NULL), 2);
    assert_memory_equal(out[0].m.id, c[1].m.id, DHT_ID_LEN);
    assert_int_equal(out[0].mode, PEER_AVG_DILOCO);
    self.mode = PEER_AVG_MEAN;
    assert_int_equal(peer_avg_candidates(e, 2, 3000, &self, 0, out, 4, NULL), 2);
    assert_memory_equal(out[0].m.id, c[0].m.id, DHT_ID_LEN);

    /* Keys: mean's is the old key; diloco's another. */
    uint8_t k0[DHT_ID_LEN], km[DHT_ID_LEN], kd[DHT_ID_LEN];
    peer_avg_key(k0, "fmnist-mlp.1", 0x1234);
    peer_avg_mode_key(km, "fmnist-mlp.1", 0x1234, PEER_AVG_MEAN);
    peer_avg_mode_key(kd, "fmnist-mlp.1", 0x1234, PEER_AVG_DILOCO);
    assert_memory_equal(k0, km, DHT_ID_LEN);
    assert_memory_not_equal(k0, kd, DHT_ID_LEN);
}

static void test_candidates_from_entries(void **state)
{
    (void)state;
    peer_avg_candidate c[6], self, out[8];
    for (int k = 0; k < 6; k++)
        cand_of(&c[k], k, 1);
    cand_of(&self, 9, 1);
    static uint8_t vals[7][PEER_ANNOUNCE_MAX_BYTES];
    dht_entry e[7];
    entry_of(&e[0], vals[0], sizeof vals[0], &c[0], 6000, 10000);  /* taken */
    entry_of(&e[1], vals[1], sizeof vals[1], &c[1], 4000, 20000);  /* another round; another period */
    entry_of(&e[2], vals[2], sizeof vals[2], &c[2], 6000, 10000);
    e[2].is_signed = 0;                                             /* unsigned */
    entry_of(&e[3], vals[3], sizeof vals[3], &c[3], 6000, 10000);
    e[3].subkey_len = 5;                                            /* not a node ID */
    entry_of(&e[4], vals[4], sizeof vals[4], &c[4], 6000, 30000);  /* taken; the second other period */
    vals[5][0] = 0xc1;                                              /* not msgpack */
    e[5] = e[0];
    e[5].value = vals[5];
    e[5].value_len = 1;
    entry_of(&e[6], vals[6], sizeof vals[6], &self, 6000, 10000);  /* our own: we come last anyway */
    uint64_t other = 1;
    int n = peer_avg_candidates(e, 7, 6000, &self, 10000, out, 8, &other);
    assert_int_equal(n, 3);
    assert_memory_equal(out[0].m.id, c[0].m.id, DHT_ID_LEN);
    assert_string_equal(out[0].m.addr, c[0].m.addr);
    assert_memory_equal(out[1].m.id, c[4].m.id, DHT_ID_LEN);
    assert_string_equal(out[1].m.addr, c[4].m.addr);
    assert_memory_equal(&out[2], &self, sizeof self);
    assert_true(other == 20000);
    /* Room for self alone; nothing read; bad arguments. */
    assert_int_equal(peer_avg_candidates(e, 7, 6000, &self, 10000, out, 1, NULL), 1);
    assert_memory_equal(&out[0], &self, sizeof self);
    assert_int_equal(peer_avg_candidates(NULL, 0, 6000, &self, 10000, out, 8, &other), 1);
    assert_true(other == 0);
    assert_int_equal(peer_avg_candidates(e, 7, 6000, &self, 10000, out, 0, NULL), -EINVAL);
    assert_int_equal(peer_avg_candidates(e, 7, 6000, NULL, 10000, out, 8, NULL), -EINVAL);
}

/* An entry with the required fields and one more, key k, packed by put. */
static size_t entry_with(uint8_t *out, size_t cap, const char *k, void (*put)(msgpack_packer *))
{
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 5);
    const char *keys[4] = {"v", "r", "a", "o"};
    for (int i = 0; i < 4; i++) {
        msgpack_pack_str(&pk, 1);
        msgpack_pack_str_body(&pk, keys[i], 1);
        if (i == 2) {
            msgpack_pack_str(&pk, 14);
            msgpack_pack_str_body(&pk, "127.0.0.1:4000", 14);
        } else {
            msgpack_pack_uint64(&pk, i == 1 ? 3000 : 1);
        }
    }
    msgpack_pack_str(&pk, strlen(k));
    msgpack_pack_str_body(&pk, k, strlen(k));
    put(&pk);
    assert_true(sb.size <= cap);
    memcpy(out, sb.data, sb.size);
    size_t n = sb.size;
    msgpack_sbuffer_destroy(&sb);
    return n;
}
static void put_str(msgpack_packer *pk) { msgpack_pack_str(pk, 2); msgpack_pack_str_body(pk, "q8", 2); }
static void put_300(msgpack_packer *pk) { msgpack_pack_uint64(pk, 300); }
static void put_70000(msgpack_packer *pk) { msgpack_pack_uint64(pk, 70000); }
static void put_neg(msgpack_packer *pk) { msgpack_pack_int64(pk, -1); }
static void put_3(msgpack_packer *pk) { msgpack_pack_uint64(pk, 3); }

/* The mode and format fields of a matchmaking entry reject garbage. */
static void test_entry_fields_garbage(void **state)
{
    (void)state;
    uint8_t buf[PEER_ANNOUNCE_MAX_BYTES];
    peer_avg_record back;
    struct { const char *k; void (*put)(msgpack_packer *); int ok; } cases[] = {
        {"m", put_str, 0}, {"m", put_300, 0}, {"m", put_neg, 0},
        {"f", put_str, 0}, {"f", put_300, 0}, {"f", put_neg, 0},
        {"fb", put_str, 0}, {"fb", put_70000, 0}, {"fb", put_neg, 0},
        {"f", put_3, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t n = entry_with(buf, sizeof buf, cases[i].k, cases[i].put);
        int rc = peer_avg_record_decode(&back, buf, n);
        if (cases[i].ok ? rc != 0 : rc != -EBADMSG)
            fail_msg("case %zu (%s): %d", i, cases[i].k, rc);
    }
    assert_int_equal(back.fmt, 3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_group_any_order),
        cmocka_unit_test(test_alone_or_absent),
        cmocka_unit_test(test_large_swarm_splits_alike),
        cmocka_unit_test(test_group_for_given_inputs),
        cmocka_unit_test(test_just_over_the_limit),
        cmocka_unit_test(test_candidates_from_entries),
        cmocka_unit_test(test_modes_apart),
        cmocka_unit_test(test_entry_fields_garbage),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
