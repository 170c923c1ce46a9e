/* A model's description in the DHT (swarm/modeldesc.h): chunk values round
 * trip, chunks put together in any order and from several publishers, and
 * hostile input refused with a sentence (garbage, wrong types, indices out
 * of range, duplicates that disagree, missing chunks, content that does not
 * hash to the advertised hash, another model's description, JSON that is
 * not canonical); the models index entry with and without "d". */
#include <errno.h>

#include "dht/mp.h"
#include "expert/model.h"
#include "expert/modelfile.h"
#include "swarm/announce.h"
#include "swarm/modeldesc.h"
#include "test_util.h"

/* A model whose canonical JSON spans several chunks: a long description and
 * twelve stages. */
static const char *big_model_json(const char *name, char *buf, size_t cap)
{
    char desc[901];
    for (int i = 0; i < 900; i++)
        desc[i] = (char)('a' + i % 26);
    desc[900] = '\0';
    snprintf(buf, cap,
             "{\"format\":\"starling.model.v1\",\"name\":\"%s\",\"description\":\"%s\","
             "\"task\":{\"kind\":\"classes\",\"inputs\":32,\"classes\":4},"
             "\"stages\":[{\"kind\":\"linear\",\"in\":32,\"out\":16},"
             "{\"kind\":\"resffn\",\"dim\":16,\"hidden\":32,\"repeat\":10},"
             "{\"kind\":\"head\",\"in\":16,\"out\":4}]}",
             name, desc);
    return buf;
}

static struct expert_model_spec *parse_or_fail(const char *text)
{
    char err[512];
    struct expert_model_spec *m = expert_model_parse(text, strlen(text), "test", err, sizeof err);
    if (!m)
        fail_msg("%s", err);
    return m;
}

static const uint8_t SIGNER_A[DHT_ID_LEN] = {0xaa, 0x01, 0x02, 0x03};
static const uint8_t SIGNER_B[DHT_ID_LEN] = {0xbb, 0x01, 0x02, 0x03};
static const uint8_t SIGNER_X[DHT_ID_LEN] = {0xcc, 0xdd, 0xee, 0xff};

/* Adds every chunk of json (hash-addressed as `as` is) from signer in the
 * order given (NULL: 0..n-1). */
static void add_all(peer_modeldesc_asm *as, const uint8_t *signer, const char *json, size_t len, const int *order)
{
    uint8_t val[DHT_MAX_VALUE];
    char err[256];
    int n = peer_modeldesc_chunks(len);
    assert_true(n > 0);
    for (int k = 0; k < n; k++) {
        int i = order ? order[k] : k;
        long vl = peer_modeldesc_chunk_encode(json, len, i, val, sizeof val);
        assert_true(vl > 0 && vl <= DHT_MAX_VALUE);
        int rc = peer_modeldesc_asm_add(as, signer, i, val, (size_t)vl, err, sizeof err);
        if (rc != 0)
            fail_msg("chunk %d: %d %s", i, rc, err);
    }
}

static void test_sizes_and_keys(void **state)
{
    (void)state;
    assert_int_equal(peer_modeldesc_chunks(0), -EINVAL);
    assert_int_equal(peer_modeldesc_chunks(1), 1);
    assert_int_equal(peer_modeldesc_chunks(PEER_MODELDESC_CHUNK), 1);
    assert_int_equal(peer_modeldesc_chunks(PEER_MODELDESC_CHUNK + 1), 2);
    assert_int_equal(peer_modeldesc_chunks(PEER_MODELDESC_MAX_BYTES), PEER_MODELDESC_MAX_CHUNKS);
    assert_int_equal(peer_modeldesc_chunks(PEER_MODELDESC_MAX_BYTES + 1), -EFBIG);
    /* A full chunk's value fits a DHT value. */
    static char big[PEER_MODELDESC_MAX_BYTES + 1];
    memset(big, 'x', sizeof big);
    uint8_t val[DHT_MAX_VALUE];
    long n = peer_modeldesc_chunk_encode(big, PEER_MODELDESC_MAX_BYTES, 63, val, sizeof val);
    assert_true(n > PEER_MODELDESC_CHUNK && n <= PEER_MODELDESC_VALUE_MAX && n <= DHT_MAX_VALUE);
    assert_int_equal(peer_modeldesc_chunk_encode(big, sizeof big, 0, val, sizeof val), -EINVAL);
    assert_int_equal(peer_modeldesc_chunk_encode(big, 100, 1, val, sizeof val), -EINVAL);
    assert_int_equal(peer_modeldesc_chunk_encode(big, 100, -1, val, sizeof val), -EINVAL);
    assert_int_equal(peer_modeldesc_chunk_encode(big, 100, 0, val, 50), -EMSGSIZE);

    /* The hash is SHA-256's first 20 bytes ("abc": ba7816bf...); the key
     * differs per hash and per index. */
    uint8_t h[PEER_MODELDESC_HASH_LEN], h2[PEER_MODELDESC_HASH_LEN], k0[DHT_ID_LEN], k1[DHT_ID_LEN], kx[DHT_ID_LEN];
    peer_modeldesc_hash(h, "abc", 3);
    static const uint8_t abc[4] = {0xba, 0x78, 0x16, 0xbf};
    assert_memory_equal(h, abc, 4);
    peer_modeldesc_hash(h2, "abd", 3);
    peer_modeldesc_key(k0, h, 0);
    peer_modeldesc_key(k1, h, 1);
    peer_modeldesc_key(kx, h2, 0);
    assert_memory_not_equal(k0, k1, DHT_ID_LEN);
    assert_memory_not_equal(k0, kx, DHT_ID_LEN);
    /* The key is BLAKE2b-160 of the documented string. */
    char hex[DHT_ID_HEX_LEN + 1], s[96];
    dht_id_to_hex(hex, h);
    snprintf(s, sizeof s, "starling.model:%s:1", hex);
    uint8_t want[DHT_ID_LEN];
    dht_id_of_bytes(want, s, strlen(s));
    assert_memory_equal(k1, want, DHT_ID_LEN);
}

/* A description of several chunks: encode, decode each, put together in
 * reverse and shuffled order, from two publishers. */
static void test_round_trip(void **state)
{
    (void)state;
    char text[4096];
    struct expert_model_spec *spec = parse_or_fail(big_model_json("big-model", text, sizeof text));
    peer_modeldesc d;
    assert_int_equal(peer_modeldesc_make(&d, spec), 0);
    assert_true(d.n_chunks >= 3);
    assert_int_equal(d.n_chunks, peer_modeldesc_chunks(d.len));
    uint8_t h[PEER_MODELDESC_HASH_LEN];
    peer_modeldesc_hash(h, d.json, d.len);
    assert_memory_equal(h, d.hash, sizeof h);

    size_t total = 0;
    for (int i = 0; i < d.n_chunks; i++) {
        uint8_t val[DHT_MAX_VALUE];
        long n = peer_modeldesc_chunk_encode(d.json, d.len, i, val, sizeof val);
        assert_true(n > 0 && n <= DHT_MAX_VALUE);
        peer_modeldesc_chunk c;
        assert_int_equal(peer_modeldesc_chunk_decode(&c, val, (size_t)n), 0);
        assert_int_equal(c.n, d.n_chunks);
        assert_int_equal(c.i, i);
        assert_memory_equal(c.data, d.json + total, c.len);
        total += c.len;
    }
    assert_int_equal(total, d.len);

    int rev[PEER_MODELDESC_MAX_CHUNKS], shuf[PEER_MODELDESC_MAX_CHUNKS];
    for (int i = 0; i < d.n_chunks; i++) {
        rev[i] = d.n_chunks - 1 - i;
        shuf[i] = (i * 2 + 1) % d.n_chunks; /* n odd or even: a permutation when gcd(2, n) = 1 */
    }
    if (d.n_chunks % 2 == 0)
        for (int i = 0; i < d.n_chunks; i++)
            shuf[i] = (i + d.n_chunks / 2) % d.n_chunks;
    const int *orders[] = {NULL, rev, shuf};
    for (int o = 0; o < 3; o++) {
        peer_modeldesc_asm *as = peer_modeldesc_asm_create(d.hash);
        assert_int_equal(peer_modeldesc_asm_want(as), 0);
        add_all(as, SIGNER_A, d.json, d.len, orders[o]);
        add_all(as, SIGNER_B, d.json, d.len, orders[(o + 1) % 3]);
        add_all(as, SIGNER_A, d.json, d.len, NULL); /* the same chunks again: kept once */
        assert_int_equal(peer_modeldesc_asm_want(as), d.n_chunks);
        char err[512];
        size_t len = 0;
        struct expert_model_spec *m = peer_modeldesc_asm_finish(as, "big-model", spec->n_stages, &len, err, sizeof err);
        if (!m)
            fail_msg("%s", err);
        assert_true(expert_model_equal(m, spec));
        assert_int_equal(len, d.len);
        expert_model_free(m);
        peer_modeldesc_asm_free(as);
    }
    peer_modeldesc_clear(&d);
    assert_null(d.json);
    expert_model_free(spec);
}

/* Packs a chunk-like map with the given fields (-1: left out; c NULL: left
 * out) into buf. */
static long pack_chunk(uint8_t *buf, size_t cap, long v, long n, long i, const char *c, size_t clen)
{
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, cap);
    msgpack_pack_map(&w.pk, (v >= 0) + (n >= 0) + (i >= 0) + (c != NULL));
    if (v >= 0) {
        dht_mp_pack_cstr(&w.pk, "v");
        msgpack_pack_uint64(&w.pk, (uint64_t)v);
    }
    if (n >= 0) {
        dht_mp_pack_cstr(&w.pk, "n");
        msgpack_pack_uint64(&w.pk, (uint64_t)n);
    }
    if (i >= 0) {
        dht_mp_pack_cstr(&w.pk, "i");
        msgpack_pack_uint64(&w.pk, (uint64_t)i);
    }
    if (c) {
        dht_mp_pack_cstr(&w.pk, "c");
        msgpack_pack_bin(&w.pk, clen);
        msgpack_pack_bin_body(&w.pk, c, clen);
    }
    return dht_mp_writer_finish(&w);
}

static void test_garbage(void **state)
{
    (void)state;
    uint8_t buf[DHT_MAX_VALUE + 64], good[DHT_MAX_VALUE];
    peer_modeldesc_chunk c;
    static char full[PEER_MODELDESC_CHUNK + 1];
    memset(full, 'x', sizeof full);
    long n;

    /* Well-formed, then one field wrong at a time. */
    assert_true((n = pack_chunk(buf, sizeof buf, 1, 1, 0, "{}", 2)) > 0);
    assert_int_equal(peer_modeldesc_chunk_decode(&c, buf, (size_t)n), 0);
    struct {
        long v, n, i;
        const char *c;
        size_t clen;
    } bad[] = {
        {2, 1, 0, "{}", 2},                                 /* version */
        {-1, 1, 0, "{}", 2},                                /* no "v" */
        {1, -1, 0, "{}", 2},                                /* no "n" */
        {1, 1, -1, "{}", 2},                                /* no "i" */
        {1, 1, 0, NULL, 0},                                 /* no "c" */
        {1, 0, 0, "{}", 2},                                 /* n = 0 */
        {1, PEER_MODELDESC_MAX_CHUNKS + 1, 0, "{}", 2},     /* n too big */
        {1, 1L << 40, 0, "{}", 2},                          /* n huge */
        {1, 3, 3, "{}", 2},                                 /* i >= n */
        {1, 3, 7, "{}", 2},                                 /* i >= n */
        {1, 1, 0, "", 0},                                   /* empty content */
        {1, 2, 0, "{}", 2},                                 /* a chunk before the last not full */
        {1, 1, 0, full, sizeof full},                       /* content over the chunk size */
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        n = pack_chunk(buf, sizeof buf, bad[k].v, bad[k].n, bad[k].i, bad[k].c, bad[k].clen);
        assert_true(n > 0);
        if (peer_modeldesc_chunk_decode(&c, buf, (size_t)n) != -EBADMSG)
            fail_msg("case %zu decoded", k);
        assert_int_equal(c.n, 0); /* zeroed */
    }
    /* Wrong types: "n" as a string, "c" as a string, "i" negative. */
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, sizeof buf);
    msgpack_pack_map(&w.pk, 4);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, 1);
    dht_mp_pack_cstr(&w.pk, "n");
    dht_mp_pack_cstr(&w.pk, "1");
    dht_mp_pack_cstr(&w.pk, "i");
    msgpack_pack_uint64(&w.pk, 0);
    dht_mp_pack_cstr(&w.pk, "c");
    msgpack_pack_bin(&w.pk, 2);
    msgpack_pack_bin_body(&w.pk, "{}", 2);
    n = dht_mp_writer_finish(&w);
    assert_int_equal(peer_modeldesc_chunk_decode(&c, buf, (size_t)n), -EBADMSG);
    dht_mp_writer_init(&w, buf, sizeof buf);
    msgpack_pack_map(&w.pk, 4);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, 1);
    dht_mp_pack_cstr(&w.pk, "n");
    msgpack_pack_uint64(&w.pk, 1);
    dht_mp_pack_cstr(&w.pk, "i");
    msgpack_pack_int64(&w.pk, -1);
    dht_mp_pack_cstr(&w.pk, "c");
    dht_mp_pack_cstr(&w.pk, "{}");
    n = dht_mp_writer_finish(&w);
    assert_int_equal(peer_modeldesc_chunk_decode(&c, buf, (size_t)n), -EBADMSG);
    /* An array, not a map; unknown keys skipped. */
    dht_mp_writer_init(&w, buf, sizeof buf);
    msgpack_pack_array(&w.pk, 4);
    for (int k = 0; k < 4; k++)
        msgpack_pack_uint64(&w.pk, 1);
    n = dht_mp_writer_finish(&w);
    assert_int_equal(peer_modeldesc_chunk_decode(&c, buf, (size_t)n), -EBADMSG);

    /* Every truncation of a good value, and random mutations and noise:
     * refused or decoded within bounds, never a crash (ASan builds). */
    long gl = peer_modeldesc_chunk_encode(full, sizeof full, 0, good, sizeof good);
    assert_true(gl > 0);
    for (long cut = 0; cut < gl; cut++)
        assert_int_equal(peer_modeldesc_chunk_decode(&c, good, (size_t)cut), -EBADMSG);
    unsigned seed = 11;
    for (int k = 0; k < 20000; k++) {
        memcpy(buf, good, (size_t)gl);
        for (int f = 0; f < 1 + k % 3; f++)
            buf[rand_r(&seed) % gl] = (uint8_t)rand_r(&seed);
        if (peer_modeldesc_chunk_decode(&c, buf, (size_t)gl) == 0)
            assert_true(c.n >= 1 && c.n <= PEER_MODELDESC_MAX_CHUNKS && c.i < c.n && c.len >= 1 &&
                        c.len <= PEER_MODELDESC_CHUNK && c.data >= buf && c.data + c.len <= buf + gl);
    }
    for (int k = 0; k < 5000; k++) {
        size_t len = (size_t)(rand_r(&seed) % (int)sizeof buf);
        for (size_t i = 0; i < len; i++)
            buf[i] = (uint8_t)rand_r(&seed);
        (void)peer_modeldesc_chunk_decode(&c, buf, len);
    }
    assert_int_equal(peer_modeldesc_chunk_decode(&c, NULL, 3), -EBADMSG);
    assert_int_equal(peer_modeldesc_chunk_decode(&c, good, DHT_MAX_VALUE + 1), -EBADMSG);

    /* The assembler refuses the same garbage, and a chunk under another
     * index's key, with a sentence naming the publisher. */
    uint8_t h[PEER_MODELDESC_HASH_LEN] = {0x12, 0x34, 0x56, 0x78};
    peer_modeldesc_asm *as = peer_modeldesc_asm_create(h);
    char err[256];
    assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_X, 0, good, 5, err, sizeof err), -EBADMSG);
    assert_non_null(strstr(err, "ccddeeff"));
    assert_non_null(strstr(err, "12345678"));
    assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_X, 1, good, (size_t)gl, err, sizeof err), -EBADMSG);
    assert_non_null(strstr(err, "says it is chunk 0"));
    assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_X, 64, good, (size_t)gl, err, sizeof err), -EBADMSG);
    assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_X, -1, good, (size_t)gl, err, sizeof err), -EBADMSG);
    assert_null(peer_modeldesc_asm_finish(as, "x", 0, NULL, err, sizeof err));
    assert_non_null(strstr(err, "no chunk found"));
    peer_modeldesc_asm_free(as);
}

/* Content that does not hash to the advertised hash is refused, naming
 * the publisher; an honest publisher's copy still wins over it; a
 * publisher that sends two contents for one chunk is dropped; a missing
 * chunk is said. */
static void test_wrong_content(void **state)
{
    (void)state;
    char text[4096], other[4096], err[512];
    struct expert_model_spec *spec = parse_or_fail(big_model_json("big-model", text, sizeof text));
    struct expert_model_spec *spec2 = parse_or_fail(big_model_json("big-model2", other, sizeof other));
    peer_modeldesc d, d2;
    assert_int_equal(peer_modeldesc_make(&d, spec), 0);
    assert_int_equal(peer_modeldesc_make(&d2, spec2), 0);
    assert_int_equal(d.n_chunks, d2.n_chunks);

    /* Only the forger's chunks (d2's content under d's hash). */
    peer_modeldesc_asm *as = peer_modeldesc_asm_create(d.hash);
    add_all(as, SIGNER_X, d2.json, d2.len, NULL);
    assert_null(peer_modeldesc_asm_finish(as, "big-model", 0, NULL, err, sizeof err));
    assert_non_null(strstr(err, "peer ccddeeff"));
    assert_non_null(strstr(err, "refused"));
    assert_non_null(strstr(err, "hash to"));
    /* The honest copy arrives too: it is the one taken. */
    add_all(as, SIGNER_A, d.json, d.len, NULL);
    struct expert_model_spec *m = peer_modeldesc_asm_finish(as, "big-model", 0, NULL, err, sizeof err);
    if (!m)
        fail_msg("%s", err);
    assert_true(expert_model_equal(m, spec));
    expert_model_free(m);
    peer_modeldesc_asm_free(as);

    /* Mixed: the forger sends one bad chunk in the middle of good ones, and
     * the honest publisher one chunk less: pooling by majority per chunk
     * still gives the right bytes when a second honest copy is there. */
    char *flipped = strdup(d.json); /* d with one byte of chunk 1 changed */
    assert_non_null(flipped);
    flipped[PEER_MODELDESC_CHUNK + 5] ^= 1;
    as = peer_modeldesc_asm_create(d.hash);
    uint8_t val[DHT_MAX_VALUE];
    for (int i = 0; i < d.n_chunks; i++) {
        long vl = peer_modeldesc_chunk_encode(i == 1 ? flipped : d.json, d.len, i, val, sizeof val);
        assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_X, i, val, (size_t)vl, err, sizeof err), 0);
        vl = peer_modeldesc_chunk_encode(d.json, d.len, i, val, sizeof val);
        if (i != 0)
            assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_A, i, val, (size_t)vl, err, sizeof err), 0);
        if (i != 2)
            assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_B, i, val, (size_t)vl, err, sizeof err), 0);
    }
    m = peer_modeldesc_asm_finish(as, "big-model", 0, NULL, err, sizeof err);
    if (!m)
        fail_msg("%s", err);
    expert_model_free(m);
    peer_modeldesc_asm_free(as);

    /* Two different contents for one chunk from one publisher: it is
     * dropped, and alone it leaves nothing. */
    as = peer_modeldesc_asm_create(d.hash);
    add_all(as, SIGNER_X, d.json, d.len, NULL);
    long vl = peer_modeldesc_chunk_encode(flipped, d.len, 1, val, sizeof val);
    assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_X, 1, val, (size_t)vl, err, sizeof err), -EEXIST);
    assert_non_null(strstr(err, "two different copies"));
    vl = peer_modeldesc_chunk_encode(d.json, d.len, 0, val, sizeof val);
    assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_X, 0, val, (size_t)vl, err, sizeof err), -EEXIST);
    assert_null(peer_modeldesc_asm_finish(as, "big-model", 0, NULL, err, sizeof err));
    assert_int_equal(peer_modeldesc_asm_want(as), 0);
    peer_modeldesc_asm_free(as);

    /* A missing chunk. */
    as = peer_modeldesc_asm_create(d.hash);
    for (int i = 0; i < d.n_chunks; i++) {
        if (i == 1)
            continue;
        vl = peer_modeldesc_chunk_encode(d.json, d.len, i, val, sizeof val);
        assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_A, i, val, (size_t)vl, err, sizeof err), 0);
    }
    assert_null(peer_modeldesc_asm_finish(as, "big-model", 0, NULL, err, sizeof err));
    assert_non_null(strstr(err, "chunk 1 not found"));
    peer_modeldesc_asm_free(as);
    as = peer_modeldesc_asm_create(d.hash);
    for (int i = 1; i < d.n_chunks; i++) {
        vl = peer_modeldesc_chunk_encode(d.json, d.len, i, val, sizeof val);
        assert_int_equal(peer_modeldesc_asm_add(as, SIGNER_A, i, val, (size_t)vl, err, sizeof err), 0);
    }
    assert_null(peer_modeldesc_asm_finish(as, "big-model", 0, NULL, err, sizeof err));
    assert_non_null(strstr(err, "chunk 0 not found"));
    peer_modeldesc_asm_free(as);

    /* Too many different contents of one chunk: the extra ones ignored. */
    as = peer_modeldesc_asm_create(d.hash);
    for (int k = 0; k < PEER_MODELDESC_MAX_VARIANTS + 2; k++) {
        char junk[16];
        int jl = snprintf(junk, sizeof junk, "junk%d", k);
        uint8_t who[DHT_ID_LEN] = {(uint8_t)k, 9};
        vl = pack_chunk(val, sizeof val, 1, 1, 0, junk, (size_t)jl);
        int rc = peer_modeldesc_asm_add(as, who, 0, val, (size_t)vl, err, sizeof err);
        assert_int_equal(rc, k < PEER_MODELDESC_MAX_VARIANTS ? 0 : -ENOSPC);
    }
    peer_modeldesc_asm_free(as);

    free(flipped);
    peer_modeldesc_clear(&d);
    peer_modeldesc_clear(&d2);
    expert_model_free(spec);
    expert_model_free(spec2);
}

/* The right bytes, but not what was asked for: another model's name, the
 * wrong number of stages, JSON that is not canonical, not a model at all. */
static void test_refused_descriptions(void **state)
{
    (void)state;
    char text[4096], err[512];
    struct expert_model_spec *spec = parse_or_fail(big_model_json("other-lm", text, sizeof text));
    peer_modeldesc d;
    assert_int_equal(peer_modeldesc_make(&d, spec), 0);
    peer_modeldesc_asm *as = peer_modeldesc_asm_create(d.hash);
    add_all(as, SIGNER_X, d.json, d.len, NULL);
    assert_null(peer_modeldesc_asm_finish(as, "forged-lm", 0, NULL, err, sizeof err));
    assert_non_null(strstr(err, "describes model 'other-lm', not 'forged-lm'"));
    assert_null(peer_modeldesc_asm_finish(as, "other-lm", 3, NULL, err, sizeof err));
    assert_non_null(strstr(err, "has 12 stages"));
    struct expert_model_spec *m = peer_modeldesc_asm_finish(as, NULL, 12, NULL, err, sizeof err);
    assert_non_null(m);
    expert_model_free(m);
    peer_modeldesc_asm_free(as);

    /* The file as written (not canonical) hashes right but is refused. */
    uint8_t h[PEER_MODELDESC_HASH_LEN];
    peer_modeldesc_hash(h, text, strlen(text));
    as = peer_modeldesc_asm_create(h);
    add_all(as, SIGNER_A, text, strlen(text), NULL);
    assert_null(peer_modeldesc_asm_finish(as, "other-lm", 0, NULL, err, sizeof err));
    assert_non_null(strstr(err, "not the canonical JSON"));
    assert_non_null(strstr(err, "aa010203"));
    peer_modeldesc_asm_free(as);

    /* Not a model file: the parser's sentence. */
    static const char junk[] = "{\"format\":\"starling.model.v1\",\"name\":\"x\"}";
    peer_modeldesc_hash(h, junk, strlen(junk));
    as = peer_modeldesc_asm_create(h);
    add_all(as, SIGNER_A, junk, strlen(junk), NULL);
    assert_null(peer_modeldesc_asm_finish(as, "x", 0, NULL, err, sizeof err));
    assert_non_null(strstr(err, "refused"));
    assert_non_null(strstr(err, "description"));
    peer_modeldesc_asm_free(as);

    peer_modeldesc_clear(&d);
    expert_model_free(spec);
}

/* The models index entry with and without "d"; a bad "d" invalidates it;
 * a reader skips keys it does not know. */
static void test_index_entry(void **state)
{
    (void)state;
    uint8_t buf[PEER_ANNOUNCE_MAX_BYTES];
    peer_model_record m = {"micro-lm", 3}, m2;
    long n = peer_model_record_encode(&m, buf, sizeof buf);
    assert_true(n > 0);
    assert_int_equal(peer_model_record_decode(&m2, buf, (size_t)n), 0);
    assert_int_equal(m2.has_desc, 0);
    m.has_desc = 1;
    for (int i = 0; i < 20; i++)
        m.desc_hash[i] = (uint8_t)(0xf0 + i);
    long n2 = peer_model_record_encode(&m, buf, sizeof buf);
    assert_int_equal(n2, n + 2 + 2 + 20);
    assert_int_equal(peer_model_record_decode(&m2, buf, (size_t)n2), 0);
    assert_int_equal(m2.has_desc, 1);
    assert_memory_equal(m2.desc_hash, m.desc_hash, 20);
    assert_string_equal(m2.model, "micro-lm");
    assert_int_equal(m2.n_stages, 3);
    for (long cut = 0; cut < n2; cut++)
        assert_int_equal(peer_model_record_decode(&m2, buf, (size_t)cut), -EBADMSG);

    /* "d" of the wrong size or type; an unknown key besides. */
    dht_mp_writer w;
    for (int variant = 0; variant < 3; variant++) {
        dht_mp_writer_init(&w, buf, sizeof buf);
        msgpack_pack_map(&w.pk, 5);
        dht_mp_pack_cstr(&w.pk, "v");
        msgpack_pack_uint64(&w.pk, 1);
        dht_mp_pack_cstr(&w.pk, "m");
        dht_mp_pack_cstr(&w.pk, "micro-lm");
        dht_mp_pack_cstr(&w.pk, "n");
        msgpack_pack_uint64(&w.pk, 3);
        dht_mp_pack_cstr(&w.pk, "zz");
        msgpack_pack_array(&w.pk, 1);
        msgpack_pack_uint64(&w.pk, 7);
        dht_mp_pack_cstr(&w.pk, "d");
        if (variant == 0) {
            msgpack_pack_bin(&w.pk, 20);
            msgpack_pack_bin_body(&w.pk, m.desc_hash, 20);
        } else if (variant == 1) {
            msgpack_pack_bin(&w.pk, 19);
            msgpack_pack_bin_body(&w.pk, m.desc_hash, 19);
        } else {
            dht_mp_pack_cstr(&w.pk, "f0f1f2");
        }
        n = dht_mp_writer_finish(&w);
        assert_true(n > 0);
        assert_int_equal(peer_model_record_decode(&m2, buf, (size_t)n), variant == 0 ? 0 : -EBADMSG);
        if (variant == 0)
            assert_true(m2.has_desc && !memcmp(m2.desc_hash, m.desc_hash, 20));
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sizes_and_keys),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_garbage),
        cmocka_unit_test(test_wrong_content),
        cmocka_unit_test(test_refused_descriptions),
        cmocka_unit_test(test_index_entry),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
