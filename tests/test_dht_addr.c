/* Peer address strings (dht/addr.h). */
#include <errno.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "dht/dht.h"
#include "test_util.h"

static const char *hexid = "0123456789abcdef0123456789abcdef01234567";

static void test_round_trips(void **state)
{
    (void)state;
    const char *good[] = {
        "127.0.0.1:4000", "[::1]:1", "[2001:db8::7]:65535", "10.0.0.255:80",
    };
    char buf[DHT_ADDR_STRLEN], in[DHT_ADDR_STRLEN];
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) {
        dht_peer_addr p;
        assert_int_equal(dht_peer_addr_parse(&p, good[i]), 0);
        assert_int_equal(p.has_id, 0);
        assert_int_equal(dht_peer_addr_format(buf, sizeof buf, &p), (int)strlen(good[i]));
        assert_string_equal(buf, good[i]);
        snprintf(in, sizeof in, "%s/%s", good[i], hexid);
        assert_int_equal(dht_peer_addr_parse(&p, in), 0);
        assert_int_equal(p.has_id, 1);
        assert_true(dht_peer_addr_format(buf, sizeof buf, &p) > 0);
        assert_string_equal(buf, in);
    }
    dht_addr a;
    assert_int_equal(dht_addr_parse(&a, "[::1]:9"), 0);
    assert_int_equal(a.family, 6);
    assert_int_equal(a.port, 9);
    assert_int_equal(dht_addr_parse_listen(&a, "0.0.0.0:0"), 0);
    assert_int_equal(dht_addr_parse(&a, "0.0.0.0:0"), -EINVAL);
}

static void test_garbage_is_rejected(void **state)
{
    (void)state;
    const char *bad[] = {
        "", ":", "127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:+80",
        "127.0.0.1: 80", "127.0.0.1:80x", "localhost:80", "::1:80", "[::1]80", "[::1:80",
        "[127.0.0.1]:80", "1.2.3.4.5:6", "256.1.1.1:1", "127.0.0.1:80/", "127.0.0.1:80/abc",
        "127.0.0.1:80/0123456789abcdef0123456789abcdef0123456g",
        "127.0.0.1:80/0123456789abcdef0123456789abcdef012345678",
        "[::1]:80/0123456789abcdef0123456789abcdef01234567/x",
        "[]:80", "[::1]:080808", "127.0.0.1:80\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        dht_peer_addr p;
        memset(&p, 0x5a, sizeof p);
        if (dht_peer_addr_parse(&p, bad[i]) != -EINVAL)
            fail_msg("accepted '%s'", bad[i]);
    }
    /* Random bytes never crash the parser. */
    uint64_t x = 99;
    for (int rep = 0; rep < 5000; rep++) {
        char s[64];
        size_t n = (size_t)(rep % 63);
        for (size_t i = 0; i < n; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            s[i] = "0123456789abcdef:.[]/x "[(x >> 33) % 23];
        }
        s[n] = '\0';
        dht_peer_addr p;
        (void)dht_peer_addr_parse(&p, s);
    }
    dht_peer_addr list[4];
    assert_int_equal(dht_peer_list_parse(list, 4, "127.0.0.1:1,[::1]:2"), 2);
    assert_int_equal(dht_peer_list_parse(list, 4, "127.0.0.1:1,"), -EINVAL);
    assert_int_equal(dht_peer_list_parse(list, 1, "127.0.0.1:1,127.0.0.1:2"), -E2BIG);
}

static void test_sockaddr_conversion(void **state)
{
    (void)state;
    dht_addr a, b;
    struct sockaddr_storage ss;
    assert_int_equal(dht_addr_parse(&a, "[::ffff:1.2.3.4]:77"), 0);
    assert_true(dht_addr_to_sockaddr(&a, &ss) > 0);
    assert_int_equal(dht_addr_from_sockaddr(&b, (struct sockaddr *)&ss), 0);
    assert_int_equal(b.family, 4); /* mapped addresses become IPv4 */
    assert_int_equal(b.port, 77);
    assert_int_equal(b.ip[0], 1);
    assert_int_equal(dht_addr_parse(&a, "[2001:db8::1]:5"), 0);
    assert_true(dht_addr_to_sockaddr(&a, &ss) > 0);
    assert_int_equal(dht_addr_from_sockaddr(&b, (struct sockaddr *)&ss), 0);
    assert_true(dht_addr_equal(&a, &b));
}

/* Networks for the per-network limits (issue 18). */
static void test_networks(void **state)
{
    (void)state;
    static const char *local[] = {"127.0.0.1:1", "10.1.2.3:1", "172.16.0.1:1", "172.31.255.1:1",
                                  "192.168.1.1:1", "100.64.0.1:1", "169.254.1.1:1", "[::1]:1",
                                  "[fd00::1]:1", "[fe80::1]:1", "[::ffff:10.0.0.1]:1"};
    static const char *pub[] = {"8.8.8.8:1", "172.32.0.1:1", "100.128.0.1:1", "198.51.100.7:1",
                                "[2001:db8::1]:1", "[::ffff:8.8.8.8]:1"};
    dht_addr a, b, pa, pb;
    for (size_t i = 0; i < sizeof local / sizeof *local; i++) {
        assert_int_equal(dht_addr_parse(&a, local[i]), 0);
        assert_int_equal(dht_addr_is_local(&a), 1);
        assert_int_equal(dht_addr_limited(&a, DHT_DIVERSITY_PUBLIC), 0);
        assert_int_equal(dht_addr_limited(&a, DHT_DIVERSITY_ALL), 1);
    }
    for (size_t i = 0; i < sizeof pub / sizeof *pub; i++) {
        assert_int_equal(dht_addr_parse(&a, pub[i]), 0);
        assert_int_equal(dht_addr_is_local(&a), 0);
        assert_int_equal(dht_addr_limited(&a, DHT_DIVERSITY_PUBLIC), 1);
        assert_int_equal(dht_addr_limited(&a, DHT_DIVERSITY_OFF), 0);
    }
    /* /24, /48, and a mapped address's IPv4 /24. */
    static const char *same[][2] = {{"198.51.100.7:1", "198.51.100.200:9"},
                                    {"[2001:db8:1:2::1]:1", "[2001:db8:1:ffff::9]:2"},
                                    {"[::ffff:8.8.8.8]:1", "[::ffff:8.8.8.9]:1"}};
    static const char *other[][2] = {{"198.51.100.7:1", "198.51.101.7:1"},
                                     {"[2001:db8:1::1]:1", "[2001:db8:2::1]:1"},
                                     {"[::ffff:8.8.8.8]:1", "[::ffff:8.8.9.8]:1"}};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(dht_addr_parse(&a, same[i][0]), 0);
        assert_int_equal(dht_addr_parse(&b, same[i][1]), 0);
        dht_addr_prefix(&pa, &a, dht_addr_net_bits(&a));
        dht_addr_prefix(&pb, &b, dht_addr_net_bits(&b));
        assert_true(dht_addr_equal(&pa, &pb));
        assert_int_equal(pa.port, 0);
        assert_int_equal(dht_addr_parse(&a, other[i][0]), 0);
        assert_int_equal(dht_addr_parse(&b, other[i][1]), 0);
        dht_addr_prefix(&pa, &a, dht_addr_net_bits(&a));
        dht_addr_prefix(&pb, &b, dht_addr_net_bits(&b));
        assert_false(dht_addr_equal(&pa, &pb));
    }
    assert_int_equal(dht_addr_parse(&a, "198.51.100.7:1"), 0);
    dht_addr_prefix(&pa, &a, 128);
    assert_int_equal(pa.ip[3], 7);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trips),
        cmocka_unit_test(test_garbage_is_rejected),
        cmocka_unit_test(test_sockaddr_conversion),
        cmocka_unit_test(test_networks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
