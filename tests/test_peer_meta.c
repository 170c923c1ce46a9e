/* tests/test_peer_meta.c: the compute methods' meta bytes (net/stagecall.h):
 * round trips, the exact wire bytes (u64le), and malformed meta refused. */
#include <errno.h>

#include "net/stagecall.h"
#include "test_util.h"

static void test_versions(void **state)
{
    (void)state;
    uint64_t v[3] = {0, 0x0102030405060708ULL, UINT64_MAX}, got[4] = {0};
    uint8_t buf[32];
    assert_int_equal(peer_meta_versions_encode(buf, sizeof buf, v, 3), 24);
    static const uint8_t want[16] = {0, 0, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1};
    assert_memory_equal(buf, want, sizeof want);
    assert_int_equal(peer_meta_versions_decode(buf, 24, got, 4), 3);
    assert_memory_equal(got, v, sizeof v);
    /* exactly max fits; one more does not (got untouched) */
    assert_int_equal(peer_meta_versions_decode(buf, 24, got, 3), 3);
    got[0] = 42;
    assert_int_equal(peer_meta_versions_decode(buf, 24, got, 2), -EINVAL);
    assert_true(got[0] == 42);
    /* no meta: no versions */
    assert_int_equal(peer_meta_versions_decode(NULL, 0, got, 4), 0);
    assert_int_equal(peer_meta_versions_encode(buf, sizeof buf, v, 0), 0);
    /* odd lengths, NULL bytes, a buffer too small, a negative count */
    for (size_t len = 1; len < 24; len++)
        if (len % 8 != 0)
            assert_int_equal(peer_meta_versions_decode(buf, len, got, 4), -EINVAL);
    assert_int_equal(peer_meta_versions_decode(NULL, 8, got, 4), -EINVAL);
    assert_int_equal(peer_meta_versions_decode(buf, 8, NULL, 4), -EINVAL);
    assert_int_equal(peer_meta_versions_decode(buf, 8, got, -1), -EINVAL);
    assert_int_equal(peer_meta_versions_encode(buf, 23, v, 3), 0);
    assert_int_equal(peer_meta_versions_encode(buf, sizeof buf, v, -1), 0);
}

static void test_at_version(void **state)
{
    (void)state;
    uint8_t buf[PEER_META_U64_LEN];
    uint64_t got = 0;
    assert_int_equal(peer_meta_at_version_encode(buf, 0x1122334455667788ULL), 8);
    static const uint8_t want[8] = {0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11};
    assert_memory_equal(buf, want, 8);
    assert_int_equal(peer_meta_at_version_decode(buf, 8, &got), 1);
    assert_true(got == 0x1122334455667788ULL);
    got = 7;
    assert_int_equal(peer_meta_at_version_decode(NULL, 0, &got), 0);
    assert_true(got == 7);
    for (size_t len = 1; len < 8; len++)
        assert_int_equal(peer_meta_at_version_decode(buf, len, &got), -EINVAL);
    assert_int_equal(peer_meta_at_version_decode(buf, 16, &got), -EINVAL);
    assert_int_equal(peer_meta_at_version_decode(NULL, 8, &got), -EINVAL);
    assert_true(got == 7);
}

static void test_span(void **state)
{
    (void)state;
    uint8_t buf[PEER_META_U64_LEN];
    int span = 0;
    /* a span of 1 is sent as no meta */
    assert_int_equal(peer_meta_span_encode(buf, 1), 0);
    assert_int_equal(peer_meta_span_encode(buf, 0), 0);
    assert_int_equal(peer_meta_span_decode(NULL, 0, 6, &span), 0);
    assert_int_equal(span, 1);
    assert_int_equal(peer_meta_span_encode(buf, 3), 8);
    static const uint8_t want[8] = {3, 0, 0, 0, 0, 0, 0, 0};
    assert_memory_equal(buf, want, 8);
    assert_int_equal(peer_meta_span_decode(buf, 8, 6, &span), 0);
    assert_int_equal(span, 3);
    assert_int_equal(peer_meta_span_decode(buf, 8, 3, &span), 0);
    /* out of range: zero, above max, huge; and odd lengths */
    span = -5;
    assert_int_equal(peer_meta_span_decode(buf, 8, 2, &span), -EINVAL);
    static const uint64_t bad[] = {0, 7, 1ULL << 31, 1ULL << 32, UINT64_MAX};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint8_t b[8];
        for (int k = 0; k < 8; k++)
            b[k] = (uint8_t)(bad[i] >> (8 * k));
        assert_int_equal(peer_meta_span_decode(b, 8, 6, &span), -EINVAL);
    }
    for (size_t len = 1; len < 8; len++)
        assert_int_equal(peer_meta_span_decode(buf, len, 6, &span), -EINVAL);
    assert_int_equal(peer_meta_span_decode(buf, 9, 6, &span), -EINVAL);
    assert_int_equal(peer_meta_span_decode(NULL, 8, 6, &span), -EINVAL);
    assert_int_equal(peer_meta_span_decode(NULL, 0, 0, &span), -EINVAL);
    assert_int_equal(span, -5);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_versions),
        cmocka_unit_test(test_at_version),
        cmocka_unit_test(test_span),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
