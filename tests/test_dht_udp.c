/* The libuv binding (dht/dht.h) on real loopback sockets: IPv4 and IPv6
 * nodes join, put and get; garbage and mutated datagrams hit a live node,
 * which keeps answering; everything closes and the loop closes clean. */
#include <errno.h>

#include <uv.h>

#include "dht/dht.h"
#include "test_util.h"

#define N4 4

typedef struct ctx {
    uv_loop_t loop;
    dht *d[N4 + 1];
    int joined, put_status, got, get_status, closed;
    size_t n_entries;
    int value_ok;
} ctx;

static ctx C;

static void on_join(dht *d, int status, void *ud)
{
    (void)d;
    (void)ud;
    if (status == 0)
        C.joined++;
}

static void on_put(dht *d, int status, void *ud)
{
    (void)d;
    (void)ud;
    C.put_status = status;
}

static void on_get(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)d;
    (void)ud;
    C.got++;
    C.get_status = status;
    C.n_entries = n;
    for (size_t i = 0; i < n; i++)
        if (e[i].is_signed && e[i].value_len == 5 && memcmp(e[i].value, "hello", 5) == 0)
            C.value_ok = 1;
}

static void on_closed(dht *d, void *ud)
{
    (void)d;
    (void)ud;
    C.closed++;
}

/* Runs the loop until *flag >= want or ms pass. */
static void run_until(const int *flag, int want, int ms)
{
    uint64_t end = uv_now(&C.loop) + (uint64_t)ms;
    while (*flag < want && uv_now(&C.loop) < end)
        uv_run(&C.loop, UV_RUN_ONCE);
}

static int put_done(void)
{
    return C.put_status != 0;
}

static dht *start(const char *listen, int i)
{
    dht_identity id;
    assert_int_equal(dht_identity_generate(&id), 0);
    dht *d = dht_create(&C.loop, &id, NULL);
    assert_non_null(d);
    int rc = dht_start(d, listen);
    if (rc != 0) {
        dht_close(d, NULL, NULL);
        return NULL;
    }
    C.d[i] = d;
    return d;
}

static void test_udp_swarm(void **state)
{
    (void)state;
    memset(&C, 0, sizeof C);
    assert_int_equal(uv_loop_init(&C.loop), 0);
    for (int i = 0; i < N4; i++)
        assert_non_null(start("127.0.0.1:0", i));
    char boot[DHT_ADDR_STRLEN];
    assert_true(dht_peer_string(C.d[0], boot, sizeof boot) > 0);
    dht_peer_addr pa;
    assert_int_equal(dht_peer_addr_parse(&pa, boot), 0);
    assert_int_equal(pa.has_id, 1);
    assert_memory_equal(pa.id, dht_self_id(C.d[0]), 20);
    for (int i = 1; i < N4; i++)
        assert_int_equal(dht_join(C.d[i], &pa, 1, on_join, NULL), 0);
    run_until(&C.joined, N4 - 1, 5000);
    assert_int_equal(C.joined, N4 - 1);

    uint8_t key[20];
    dht_id_of_bytes(key, "fmnist-mlp.2", 12);
    assert_int_equal(dht_put(C.d[1], key, NULL, 0, "hello", 5, dht_now_ms() + 60000, 1, on_put, NULL), 0);
    for (int i = 0; i < 300 && !put_done(); i++)
        uv_run(&C.loop, UV_RUN_ONCE);
    assert_true(C.put_status >= 2);
    /* Failing calls never call back. */
    assert_int_equal(dht_put(C.d[1], key, NULL, 0, "x", 1, 1, 1, on_put, NULL), -EINVAL);
    assert_int_equal(dht_get(C.d[1], key, NULL, NULL), -EINVAL);

    /* Hostile datagrams at node 0 from a plain socket. */
    dht_addr a0;
    struct sockaddr_storage ss;
    assert_int_equal(dht_local_addr(C.d[0], &a0), 0);
    assert_true(dht_addr_to_sockaddr(&a0, &ss) > 0);
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    assert_true(fd >= 0);
    uint8_t g[1500];
    uint64_t x = 77;
    for (int i = 0; i < 2000; i++) {
        size_t len = 1 + (size_t)(i * 131 % 1400);
        for (size_t j = 0; j < len; j++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            g[j] = (uint8_t)(x >> 40);
        }
        if (i & 1)
            g[0] = 0x86;
        (void)sendto(fd, g, len, 0, (struct sockaddr *)&ss, sizeof(struct sockaddr_in));
        if (i % 50 == 0)
            uv_run(&C.loop, UV_RUN_NOWAIT);
    }
    close(fd);
    for (int i = 0; i < 50; i++)
        uv_run(&C.loop, UV_RUN_NOWAIT);
    dht_node_stats st;
    dht_get_stats(C.d[0], &st);
    assert_true(st.drop_malformed >= 1000);

    /* Node 0 still answers: a get from node 3 goes through it. */
    assert_int_equal(dht_get(C.d[3], key, on_get, NULL), 0);
    run_until(&C.got, 1, 5000);
    assert_int_equal(C.got, 1);
    assert_int_equal(C.get_status, 0);
    assert_true(C.value_ok);

    /* IPv6 (skipped quietly where ::1 is unavailable). */
    dht *d6a = start("[::1]:0", N4);
    if (d6a) {
        dht_identity id;
        assert_int_equal(dht_identity_generate(&id), 0);
        dht *d6b = dht_create(&C.loop, &id, NULL);
        assert_int_equal(dht_start(d6b, "[::1]:0"), 0);
        char s6[DHT_ADDR_STRLEN];
        assert_true(dht_peer_string(d6a, s6, sizeof s6) > 0);
        assert_true(s6[0] == '[');
        assert_int_equal(dht_peer_addr_parse(&pa, s6), 0);
        int before = C.joined;
        assert_int_equal(dht_join(d6b, &pa, 1, on_join, NULL), 0);
        run_until(&C.joined, before + 1, 5000);
        assert_int_equal(C.joined, before + 1);
        C.put_status = 0;
        assert_int_equal(dht_put(d6b, key, NULL, 0, "hello", 5, dht_now_ms() + 60000, 1, on_put, NULL), 0);
        for (int i = 0; i < 300 && !put_done(); i++)
            uv_run(&C.loop, UV_RUN_ONCE);
        assert_true(C.put_status >= 2);
        dht_close(d6b, on_closed, NULL);
    } else {
        C.closed++; /* keep the count below uniform */
        printf("IPv6 loopback unavailable: IPv6 part skipped\n");
    }

    /* Close with an operation in flight: it is cancelled. */
    C.got = 0;
    assert_int_equal(dht_get(C.d[2], key, on_get, NULL), 0);
    for (int i = 0; i <= N4; i++)
        if (C.d[i])
            dht_close(C.d[i], on_closed, NULL);
    assert_int_equal(C.got, 1);
    assert_int_equal(C.get_status, -ECANCELED);
    run_until(&C.closed, N4 + 2, 5000);
    assert_int_equal(C.closed, N4 + 2);
    assert_int_equal(uv_run(&C.loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(uv_loop_close(&C.loop), 0);
}

typedef struct diag_wait {
    int done, status;
} diag_wait;

static void on_diag_join(dht *d, int status, void *ud)
{
    (void)d;
    diag_wait *w = ud;
    w->done = 1;
    w->status = status;
}

static dht *start_with(const dht_identity *id, const dht_config *cfg)
{
    dht *d = dht_create(&C.loop, id, cfg);
    assert_non_null(d);
    assert_int_equal(dht_start(d, "127.0.0.1:0"), 0);
    return d;
}

/* Joins d through peer; returns the status (bounded wait). */
static int join_status_of(dht *d, const dht_peer_addr *peer)
{
    diag_wait w = {0, 0};
    assert_int_equal(dht_join(d, peer, 1, on_diag_join, &w), 0);
    run_until(&w.done, 1, 8000);
    assert_int_equal(w.done, 1);
    return w.status;
}

/* A join that fails says why when the node answered: a wrong node ID, a
 * swarm key mismatch (either way round), or a second node with our
 * identity; dht_join_strerror words it. */
static void test_udp_join_diagnostics(void **state)
{
    (void)state;
    memset(&C, 0, sizeof C);
    assert_int_equal(uv_loop_init(&C.loop), 0);
    dht_identity boot_id, twin, other;
    assert_int_equal(dht_identity_generate(&boot_id), 0);
    assert_int_equal(dht_identity_generate(&twin), 0);
    assert_int_equal(dht_identity_generate(&other), 0);
    dht *boot = start_with(&boot_id, NULL);
    char bs[DHT_ADDR_STRLEN], addr[DHT_ADDR_STRLEN], msg[256], hex[DHT_ID_HEX_LEN + 1];
    dht_peer_addr pa, wrong;
    assert_true(dht_peer_string(boot, bs, sizeof bs) > 0);
    assert_int_equal(dht_peer_addr_parse(&pa, bs), 0);
    dht_addr ba;
    assert_int_equal(dht_local_addr(boot, &ba), 0);
    assert_true(dht_addr_format(addr, sizeof addr, &ba) > 0);

    /* The right address with another node's ID. */
    wrong = pa;
    memcpy(wrong.id, other.id, 20);
    dht_identity a_id;
    assert_int_equal(dht_identity_generate(&a_id), 0);
    dht *a = start_with(&a_id, NULL);
    assert_int_equal(join_status_of(a, &wrong), -EADDRNOTAVAIL);
    dht_join_strerror(a, -EADDRNOTAVAIL, msg, sizeof msg);
    dht_id_to_hex(hex, boot_id.id);
    assert_non_null(strstr(msg, addr));
    assert_non_null(strstr(msg, "answered as node"));
    assert_non_null(strstr(msg, hex));
    dht_id_to_hex(hex, other.id);
    assert_non_null(strstr(msg, hex));
    dht_close(a, NULL, NULL);

    /* A keyed node joining a keyless one, and the other way round. */
    dht_config keyed;
    dht_config_default(&keyed);
    keyed.has_swarm_key = 1;
    memset(keyed.swarm_key, 0x3c, 32);
    dht *k = start_with(&other, &keyed);
    assert_int_equal(join_status_of(k, &pa), -EKEYREJECTED);
    dht_join_strerror(k, -EKEYREJECTED, msg, sizeof msg);
    assert_non_null(strstr(msg, addr));
    assert_non_null(strstr(msg, "not under our swarm key"));
    dht_peer_addr kp;
    assert_true(dht_peer_string(k, addr, sizeof addr) > 0);
    assert_int_equal(dht_peer_addr_parse(&kp, addr), 0);
    dht_identity plain_id;
    assert_int_equal(dht_identity_generate(&plain_id), 0);
    dht *plain = start_with(&plain_id, NULL);
    assert_int_equal(join_status_of(plain, &kp), -EKEYREJECTED);
    dht_join_strerror(plain, -EKEYREJECTED, msg, sizeof msg);
    assert_non_null(strstr(msg, "(we have none)"));
    dht_node_stats st;
    dht_get_stats(k, &st);
    assert_true(st.rejects_sent >= 1);
    dht_close(k, NULL, NULL);
    dht_close(plain, NULL, NULL);

    /* Two nodes with one identity: the second one's join reports the
     * first one's address. */
    dht_node_stats bst;
    dht_get_stats(boot, &bst);
    size_t boot_before = bst.table_size;
    dht *t1 = start_with(&twin, NULL);
    assert_int_equal(join_status_of(t1, &pa), 0);
    /* The bootstrap node puts t1 in its table once t1 has answered its
     * identity challenge, which can come after t1's join has finished:
     * wait for that (bounded), or t2 may find nobody with its ID yet. */
    uint64_t end = uv_now(&C.loop) + 5000;
    for (dht_get_stats(boot, &bst); bst.table_size <= boot_before && uv_now(&C.loop) < end;
         dht_get_stats(boot, &bst))
        uv_run(&C.loop, UV_RUN_ONCE);
    assert_true(bst.table_size > boot_before);
    dht *t2 = start_with(&twin, NULL);
    assert_int_equal(join_status_of(t2, &pa), -EADDRINUSE);
    dht_addr t1a;
    char want[DHT_ADDR_STRLEN];
    assert_int_equal(dht_local_addr(t1, &t1a), 0);
    assert_true(dht_addr_format(want, sizeof want, &t1a) > 0);
    assert_true(dht_collision_addr(t2, addr, sizeof addr) > 0);
    assert_string_equal(addr, want);
    assert_int_equal(dht_collision_addr(t1, addr, sizeof addr), -ENOENT);
    dht_join_strerror(t2, -EADDRINUSE, msg, sizeof msg);
    dht_id_to_hex(hex, twin.id);
    assert_non_null(strstr(msg, hex));
    assert_non_null(strstr(msg, want));
    dht_close(t1, NULL, NULL);
    dht_close(t2, NULL, NULL);
    dht_close(boot, NULL, NULL);
    assert_int_equal(uv_run(&C.loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(uv_loop_close(&C.loop), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_udp_swarm),
        cmocka_unit_test(test_udp_join_diagnostics),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
