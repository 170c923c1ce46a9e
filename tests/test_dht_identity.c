/* Identity files and 160-bit IDs (dht/identity.h, dht/id.h). */
#include <errno.h>
#include <sys/stat.h>

#include <sodium.h>

#include "dht/dht.h"
#include "test_util.h"

static char dir[256];
static char path[512];

static int setup(void **state)
{
    (void)state;
    test_tmpdir(dir, sizeof dir, "ident");
    snprintf(path, sizeof path, "%s/id.key", dir);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    test_rmtree(dir);
    return 0;
}

static void test_node_id_is_blake2b160_of_pubkey(void **state)
{
    (void)state;
    dht_identity a;
    uint8_t want[20];
    assert_int_equal(dht_identity_generate(&a), 0);
    crypto_generichash(want, sizeof want, a.pk, sizeof a.pk, NULL, 0);
    assert_memory_equal(a.id, want, 20);
}

static void test_key_of_string_known_answer(void **state)
{
    (void)state;
    /* BLAKE2b with a 20-byte digest of "abc", computed independently with
     * Python's hashlib.blake2b(b"abc", digest_size=20). */
    uint8_t id[20];
    char hex[41];
    dht_id_of_bytes(id, "abc", 3);
    dht_id_to_hex(hex, id);
    assert_string_equal(hex, "384264f676f39536840523f284921cdc68b6846b");
}

static void test_hex_round_trip_and_garbage(void **state)
{
    (void)state;
    uint8_t id[20], back[20];
    char hex[41];
    for (int i = 0; i < 20; i++)
        id[i] = (uint8_t)(i * 37 + 1);
    dht_id_to_hex(hex, id);
    assert_int_equal(strlen(hex), 40);
    assert_int_equal(dht_id_from_hex(back, hex), 0);
    assert_memory_equal(id, back, 20);

    memset(back, 0xAA, sizeof back);
    assert_int_equal(dht_id_from_hex(back, ""), -EINVAL);
    assert_int_equal(dht_id_from_hex(back, "abc"), -EINVAL);
    assert_int_equal(dht_id_from_hex(back, "zz4264f676f39536840523f284921cdc68b6846b"), -EINVAL);
    assert_int_equal(dht_id_from_hex(back, "384264f676f39536840523f284921cdc68b6846b0"), -EINVAL);
    assert_int_equal(dht_id_from_hex(back, "384264f676f39536840523f284921cdc68b6846 "), -EINVAL);
    assert_int_equal(dht_id_from_hex(back, NULL), -EINVAL);
    for (int i = 0; i < 20; i++)
        assert_int_equal(back[i], 0xAA); /* untouched on failure */
}

static void test_save_load_round_trip(void **state)
{
    (void)state;
    dht_identity a, b;
    struct stat st;
    assert_int_equal(dht_identity_generate(&a), 0);
    assert_int_equal(dht_identity_save(&a, path, 0), 0);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_int_equal(dht_identity_load(&b, path), 0);
    assert_memory_equal(&a, &b, sizeof a);

    /* The loaded key signs, and the signature verifies with the public key. */
    uint8_t sig[crypto_sign_BYTES];
    assert_int_equal(crypto_sign_detached(sig, NULL, (const uint8_t *)"m", 1, b.sk), 0);
    assert_int_equal(crypto_sign_verify_detached(sig, (const uint8_t *)"m", 1, a.pk), 0);
}

static void test_save_refuses_overwrite_unless_asked(void **state)
{
    (void)state;
    dht_identity a, b, c;
    assert_int_equal(dht_identity_generate(&a), 0);
    assert_int_equal(dht_identity_generate(&b), 0);
    assert_int_equal(dht_identity_save(&a, path, 0), 0);
    assert_int_equal(dht_identity_save(&b, path, 0), -EEXIST);
    assert_int_equal(dht_identity_load(&c, path), 0);
    assert_memory_equal(c.id, a.id, 20); /* the first key is intact */
    assert_int_equal(dht_identity_save(&b, path, 1), 0);
    assert_int_equal(dht_identity_load(&c, path), 0);
    assert_memory_equal(c.id, b.id, 20);
}

static void test_seeded_identity_is_deterministic(void **state)
{
    (void)state;
    uint8_t seed[32] = {1, 2, 3};
    dht_identity a, b;
    assert_int_equal(dht_identity_from_seed(&a, seed), 0);
    assert_int_equal(dht_identity_from_seed(&b, seed), 0);
    assert_memory_equal(&a, &b, sizeof a);
    seed[31] = 9;
    assert_int_equal(dht_identity_from_seed(&b, seed), 0);
    assert_memory_not_equal(a.id, b.id, 20);
}

static void test_load_rejects_world_readable(void **state)
{
    (void)state;
    dht_identity a, b;
    assert_int_equal(dht_identity_generate(&a), 0);
    assert_int_equal(dht_identity_save(&a, path, 0), 0);
    assert_int_equal(chmod(path, 0644), 0);
    assert_int_equal(dht_identity_load(&b, path), -EPERM);
    assert_int_equal(chmod(path, 0640), 0);
    assert_int_equal(dht_identity_load(&b, path), -EPERM);
    assert_int_equal(chmod(path, 0400), 0);
    assert_int_equal(dht_identity_load(&b, path), 0);
}

static void test_load_missing_file(void **state)
{
    (void)state;
    dht_identity b;
    char missing[600];
    snprintf(missing, sizeof missing, "%s/nope.key", dir);
    assert_int_equal(dht_identity_load(&b, missing), -ENOENT);
    assert_int_equal(dht_identity_load(&b, ""), -EINVAL);
    assert_int_equal(dht_identity_load(&b, dir), -EBADMSG); /* a directory */
}

/* Every single-byte corruption of a valid file must be detected. */
static void test_load_rejects_every_byte_flip(void **state)
{
    (void)state;
    dht_identity a, b;
    char good[256], bad[256];
    assert_int_equal(dht_identity_generate(&a), 0);
    assert_int_equal(dht_identity_save(&a, path, 0), 0);
    size_t n = test_read_file(path, good, sizeof good);
    assert_true(n > 100);
    int misses = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(bad, good, n);
        /* Flip to another character of the same class where possible, so
         * the test exercises the key check and not only the hex parser. */
        bad[i] = (good[i] >= '0' && good[i] <= '8') ? (char)(good[i] + 1)
                 : (good[i] == '9') ? 'a'
                 : (char)(good[i] ^ 0x01);
        test_write_file(path, bad, n, 0600);
        if (dht_identity_load(&b, path) != -EBADMSG) {
            fprintf(stderr, "byte %zu flip not detected\n", i);
            misses++;
        }
    }
    assert_int_equal(misses, 0);
}

static void test_load_rejects_truncated_and_garbage(void **state)
{
    (void)state;
    dht_identity a, b;
    char good[256], buf[600];
    assert_int_equal(dht_identity_generate(&a), 0);
    assert_int_equal(dht_identity_save(&a, path, 0), 0);
    size_t n = test_read_file(path, good, sizeof good);
    for (size_t cut = 0; cut < n; cut += 7) {
        test_write_file(path, good, cut, 0600);
        assert_int_equal(dht_identity_load(&b, path), -EBADMSG);
    }
    /* Trailing junk after a valid line. */
    memcpy(buf, good, n);
    memcpy(buf + n, "x\n", 2);
    test_write_file(path, buf, n + 2, 0600);
    assert_int_equal(dht_identity_load(&b, path), -EBADMSG);
    /* Random bytes, seeded. */
    srand(12345);
    for (int r = 0; r < 50; r++) {
        size_t len = (size_t)(rand() % (int)sizeof buf);
        for (size_t i = 0; i < len; i++)
            buf[i] = (char)rand();
        test_write_file(path, buf, len, 0600);
        assert_int_equal(dht_identity_load(&b, path), -EBADMSG);
        for (size_t i = 0; i < sizeof b; i++)
            assert_int_equal(((uint8_t *)&b)[i], 0); /* zeroed on failure */
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_node_id_is_blake2b160_of_pubkey),
        cmocka_unit_test(test_key_of_string_known_answer),
        cmocka_unit_test(test_hex_round_trip_and_garbage),
        cmocka_unit_test(test_seeded_identity_is_deterministic),
        cmocka_unit_test_setup_teardown(test_save_load_round_trip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_save_refuses_overwrite_unless_asked, setup, teardown),
        cmocka_unit_test_setup_teardown(test_load_rejects_world_readable, setup, teardown),
        cmocka_unit_test_setup_teardown(test_load_missing_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_load_rejects_every_byte_flip, setup, teardown),
        cmocka_unit_test_setup_teardown(test_load_rejects_truncated_and_garbage, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
