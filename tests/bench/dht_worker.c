/* dht_worker: a worker for ../shared/bench/opendht/dht_bench.py, so the
 * OpenDHT loopback scenario runs unchanged against our DHT.
 *
 *   python3 dht_bench.py -n 50 --label ours-n50 \
 *       --worker-cmd "build/tests/bench/dht_worker --max-life 4000"
 *
 * JSON lines on stdin/stdout (see the README's "Worker protocol"). Each node
 * is a dht (dht/dht.h) on 127.0.0.1:0; all nodes of a worker share one libuv
 * loop and thread. Differences from the OpenDHT worker, by design:
 *   - puts are signed (ed25519, subkey = node ID) as the peer layer does;
 *     --unsigned stores unsigned entries (subkey = the request id);
 *   - the per-IP rate limit is lifted (every node is 127.0.0.1), as the
 *     OpenDHT worker does for its own;
 *   - rt "good" and "total" are both the routing-table size: every entry
 *     answered an identity challenge; replacements are not counted;
 *   - a get completes when the quorum (8) nearest nodes have answered, and
 *     reports nothing before, so first = lat;
 *   - a put completes when the quorum nearest have stored the value (the
 *     stores to the rest of the k = 20 nearest go on).
 * --quorum N sets the quorum (default 8, at most k).
 * Only 127.0.0.1 is accepted for bind and bootstrap addresses.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>
#include <uv.h>

#include "dht/dht.h"

#define MAX_NODES 256

static uv_loop_t *loop;
static uv_pipe_t in;
static uv_timer_t life;
static dht *nodes[MAX_NODES];
static int n_nodes, sign_puts = 1, quitting;
static long quorum; /* 0: the default (DHT_QUORUM) */
static char line[1 << 20];
static size_t line_len;
static uint64_t last_sent[5];

typedef struct op {
    long rid;
    int is_get, done;
    uint64_t t0;
    uv_timer_t timer;
    uint8_t val[DHT_MAX_VALUE];
    size_t val_len;
} op;

static double now_s(void)
{
    return (double)uv_hrtime() * 1e-9;
}

static void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void emit(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
}

/* ---- tiny JSON field readers (the coordinator's lines are flat) ---- */

static const char *field(const char *s, const char *name)
{
    /* A key is "name" followed by a colon; "name" as a value (as in
     * "cmd":"op") does not count. */
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\"", name);
    for (const char *p = strstr(s, pat); p; p = strstr(p + 1, pat)) {
        const char *q = p + strlen(pat);
        while (*q == ' ')
            q++;
        if (*q != ':')
            continue;
        q++;
        while (*q == ' ')
            q++;
        return q;
    }
    return NULL;
}

static long field_long(const char *s, const char *name, long dflt)
{
    const char *p = field(s, name);
    return p ? strtol(p, NULL, 10) : dflt;
}

static double field_double(const char *s, const char *name, double dflt)
{
    const char *p = field(s, name);
    return p ? strtod(p, NULL) : dflt;
}

static int field_str(const char *s, const char *name, char *out, size_t cap)
{
    const char *p = field(s, name);
    if (!p || *p != '"')
        return -1;
    p++;
    size_t n = 0;
    while (p[n] && p[n] != '"' && n + 1 < cap)
        n++;
    memcpy(out, p, n);
    out[n] = '\0';
    return 0;
}

static void on_closed(dht *d, void *ud)
{
    (void)d;
    (void)ud;
}

static void shutdown_all(void)
{
    if (quitting)
        return;
    quitting = 1;
    for (int i = 0; i < n_nodes; i++)
        dht_close(nodes[i], on_closed, NULL);
    uv_close((uv_handle_t *)&in, NULL);
    uv_close((uv_handle_t *)&life, NULL);
}

static void cmd_start(const char *s)
{
    char bind[64] = "127.0.0.1";
    long k = field_long(s, "nodes", 0);
    field_str(s, "bind", bind, sizeof bind);
    if (strcmp(bind, "127.0.0.1") != 0 || k < 1 || k > MAX_NODES || n_nodes) {
        emit("{\"ev\":\"error\",\"cmd\":\"start\",\"msg\":\"bad bind, count or repeated start\"}");
        return;
    }
    dht_config cfg;
    dht_config_default(&cfg);
    cfg.rate_per_s = 1000000;
    cfg.rate_burst = 1000000;
    cfg.quorum = (size_t)quorum;
    printf("{\"ev\":\"started\",\"nodes\":[");
    for (int i = 0; i < k; i++) {
        dht_identity id;
        dht_addr a;
        char hex[DHT_ID_HEX_LEN + 1];
        dht_identity_generate(&id);
        nodes[i] = dht_create(loop, &id, &cfg);
        if (!nodes[i] || dht_start(nodes[i], "127.0.0.1:0") != 0 || dht_local_addr(nodes[i], &a)) {
            fprintf(stderr, "dht_worker: node %d failed to start\n", i);
            exit(1);
        }
        dht_id_to_hex(hex, id.id);
        printf("%s{\"i\":%d,\"id\":\"%s\",\"port\":%u}", i ? "," : "", i, hex, (unsigned)a.port);
        n_nodes = i + 1;
    }
    emit("]}");
}

static void cmd_bootstrap(const char *s)
{
    /* pairs: [[i,"127.0.0.1",port],...]; one join per node with all its peers. */
    static dht_peer_addr peers[MAX_NODES][16];
    static int np[MAX_NODES];
    memset(np, 0, sizeof np);
    const char *p = field(s, "pairs");
    while (p && (p = strchr(p, '[')) != NULL) {
        int i;
        char host[64];
        unsigned port;
        p++;
        if (*p == '[')
            continue;
        if (sscanf(p, "%d , \"%63[^\"]\" , %u", &i, host, &port) != 3)
            break;
        if (i >= 0 && i < n_nodes && np[i] < 16 && strcmp(host, "127.0.0.1") == 0 && port &&
            port < 65536) {
            const uint8_t ip[4] = {127, 0, 0, 1};
            memset(&peers[i][np[i]], 0, sizeof peers[i][np[i]]);
            dht_addr_v4(&peers[i][np[i]].addr, ip, (uint16_t)port);
            np[i]++;
        }
    }
    for (int i = 0; i < n_nodes; i++)
        if (np[i])
            (void)dht_join(nodes[i], peers[i], (size_t)np[i], NULL, NULL);
    emit("{\"ev\":\"bootstrapped\"}");
}

static void cmd_rt(void)
{
    char buf[16];
    printf("{\"ev\":\"rt\",\"good\":[");
    for (int pass = 0; pass < 3; pass++) {
        if (pass == 1)
            printf("],\"total\":[");
        if (pass == 2)
            printf("],\"depth\":[");
        for (int i = 0; i < n_nodes; i++) {
            dht_node_stats st;
            dht_get_stats(nodes[i], &st);
            snprintf(buf, sizeof buf, "%d", pass < 2 ? (int)st.table_size : st.table_depth + 1);
            printf("%s%s", i ? "," : "", buf);
        }
    }
    emit("]}");
}

static void cmd_msgs(void)
{
    uint64_t sum[5] = {0};
    for (int i = 0; i < n_nodes; i++) {
        dht_node_stats st;
        dht_get_stats(nodes[i], &st);
        for (int t = 0; t < 5; t++)
            sum[t] += st.req_sent[t];
    }
    emit("{\"ev\":\"msgs\",\"sent\":{\"ping\":%llu,\"find\":%llu,\"get\":%llu,\"listen\":0,\"put\":%llu}}",
         (unsigned long long)(sum[DHT_MSG_PING] - last_sent[DHT_MSG_PING]),
         (unsigned long long)(sum[DHT_MSG_FIND_NODE] - last_sent[DHT_MSG_FIND_NODE]),
         (unsigned long long)(sum[DHT_MSG_GET] - last_sent[DHT_MSG_GET]),
         (unsigned long long)(sum[DHT_MSG_STORE] - last_sent[DHT_MSG_STORE]));
    memcpy(last_sent, sum, sizeof sum);
}

static void op_free(uv_handle_t *h)
{
    free(h->data);
}

static void op_finish(op *o, int ok, size_t nvals, const char *err)
{
    double lat = now_s() - (double)o->t0 * 1e-9;
    o->done = 1;
    if (err)
        emit("{\"ev\":\"res\",\"rid\":%ld,\"ok\":false,\"lat\":null,\"first\":null,\"nvals\":0,"
             "\"done_ok\":false,\"err\":\"%s\"}", o->rid, err);
    else
        emit("{\"ev\":\"res\",\"rid\":%ld,\"ok\":%s,\"lat\":%.6f,\"first\":%s%.6f,\"nvals\":%zu,"
             "\"done_ok\":true}", o->rid, ok ? "true" : "false", lat, "", lat, nvals);
    uv_timer_stop(&o->timer);
}

static void on_op_timeout(uv_timer_t *t)
{
    op *o = t->data;
    if (!o->done)
        op_finish(o, 0, 0, "timeout");
    /* The op's callback may still come: it frees nothing, the close does. */
}

static void on_put(dht *d, int status, void *ud)
{
    op *o = ud;
    (void)d;
    if (!o->done)
        op_finish(o, status > 0, 0, NULL);
    uv_close((uv_handle_t *)&o->timer, op_free);
}

static void on_get(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    op *o = ud;
    (void)d;
    int ok = 0;
    for (size_t i = 0; status == 0 && i < n; i++)
        if (e[i].value_len == o->val_len && memcmp(e[i].value, o->val, o->val_len) == 0)
            ok = 1;
    if (!o->done)
        op_finish(o, ok, n, NULL);
    uv_close((uv_handle_t *)&o->timer, op_free);
}

static void cmd_op(const char *s)
{
    char kind[8], keyhex[64], valhex[2 * DHT_MAX_VALUE + 2];
    long rid = field_long(s, "rid", -1), i = field_long(s, "i", -1);
    double timeout = field_double(s, "timeout", 10);
    uint8_t key[DHT_ID_LEN];
    if (field_str(s, "op", kind, sizeof kind) || field_str(s, "key", keyhex, sizeof keyhex) ||
        i < 0 || i >= n_nodes || dht_id_from_hex(key, keyhex) != 0) {
        emit("{\"ev\":\"error\",\"cmd\":\"op\",\"msg\":\"bad op\"}");
        return;
    }
    op *o = calloc(1, sizeof *o);
    o->rid = rid;
    o->t0 = uv_hrtime();
    valhex[0] = '\0';
    field_str(s, "val", valhex, sizeof valhex);
    if (sodium_hex2bin(o->val, sizeof o->val, valhex, strlen(valhex), NULL, &o->val_len, NULL) != 0)
        o->val_len = 0;
    uv_timer_init(loop, &o->timer);
    o->timer.data = o;
    int rc;
    if (strcmp(kind, "put") == 0) {
        uint8_t sub[8];
        memcpy(sub, &rid, sizeof sub);
        rc = dht_put(nodes[i], key, sub, sizeof sub, o->val, o->val_len, dht_now_ms() + 3600 * 1000,
                     sign_puts, on_put, o);
    } else {
        o->is_get = 1;
        rc = dht_get(nodes[i], key, on_get, o);
    }
    if (rc != 0) {
        op_finish(o, 0, 0, "start failed");
        uv_close((uv_handle_t *)&o->timer, op_free);
        return;
    }
    uv_timer_start(&o->timer, on_op_timeout, (uint64_t)(timeout * 1000), 0);
}

static void handle(char *s)
{
    char cmd[32];
    if (field_str(s, "cmd", cmd, sizeof cmd))
        return;
    if (!strcmp(cmd, "start"))
        cmd_start(s);
    else if (!strcmp(cmd, "bootstrap"))
        cmd_bootstrap(s);
    else if (!strcmp(cmd, "rt"))
        cmd_rt();
    else if (!strcmp(cmd, "msgs"))
        cmd_msgs();
    else if (!strcmp(cmd, "op"))
        cmd_op(s);
    else if (!strcmp(cmd, "dump"))
        emit("{\"ev\":\"dump\",\"running\":1,\"log\":\"\"}");
    else if (!strcmp(cmd, "quit")) {
        emit("{\"ev\":\"bye\"}");
        shutdown_all();
    } else
        emit("{\"ev\":\"error\",\"cmd\":\"%s\",\"msg\":\"unknown command\"}", cmd);
}

static void on_alloc(uv_handle_t *h, size_t sz, uv_buf_t *b)
{
    static char buf[65536];
    (void)h;
    (void)sz;
    *b = uv_buf_init(buf, sizeof buf);
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *b)
{
    (void)st;
    if (n < 0) { /* EOF: the coordinator is gone */
        shutdown_all();
        return;
    }
    for (ssize_t k = 0; k < n; k++) {
        char c = b->base[k];
        if (c == '\n') {
            line[line_len] = '\0';
            handle(line);
            line_len = 0;
        } else if (line_len + 1 < sizeof line) {
            line[line_len++] = c;
        }
    }
}

static void on_life(uv_timer_t *t)
{
    (void)t;
    fprintf(stderr, "dht_worker: --max-life reached\n");
    shutdown_all();
}

int main(int argc, char **argv)
{
    double max_life = 3600;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--max-life") && i + 1 < argc)
            max_life = strtod(argv[++i], NULL);
        else if (!strcmp(argv[i], "--unsigned"))
            sign_puts = 0;
        else if (!strcmp(argv[i], "--quorum") && i + 1 < argc)
            quorum = strtol(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: dht_worker [--max-life S] [--unsigned] [--quorum N]\n");
            return 2;
        }
    }
    if (dht_crypto_init() != 0)
        return 1;
    loop = uv_default_loop();
    uv_pipe_init(loop, &in, 0);
    if (uv_pipe_open(&in, 0) != 0)
        return 1;
    uv_read_start((uv_stream_t *)&in, on_alloc, on_read);
    uv_timer_init(loop, &life);
    uv_timer_start(&life, on_life, (uint64_t)(max_life * 1000), 0);
    emit("{\"ev\":\"ready\",\"impl\":\"starling-dht 0.1 (%s)\",\"pid\":%d}",
         sign_puts ? "signed" : "unsigned", (int)getpid());
    uv_run(loop, UV_RUN_DEFAULT);
    return 0;
}
