/* starling dht: debugging commands against a running swarm. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <sodium.h>

#include "dht/dht.h"
#include "tools/cli.h"
#include "tools/client.h"

static const char dht_help[] =
    "Usage: starling dht get KEY --initial-peers LIST [OPTIONS]\n"
    "       starling dht put KEY VALUE --initial-peers LIST [--ttl S] [OPTIONS]\n"
    "\n"
    "Joins the swarm as a short-lived node, then reads or writes one key.\n"
    "KEY is a string (hashed with BLAKE2b-160, like block names) or, with\n"
    "--raw-key, 40 hex digits. put stores VALUE signed by the identity (subkey =\n"
    "its node ID); get prints one line per live entry:\n"
    "\n"
    "    SUBKEY_HEX signed|unsigned EXPIRES_IN_S VALUE\n"
    "\n"
    "(VALUE as text when printable, else as hex).\n"
    "\n"
    "Options:\n"
    "  -p, --initial-peers LIST   comma-separated address strings (see 'starling\n"
    "                             bootstrap --help'); required\n"
    "  -t, --ttl S                put: seconds until the value expires (default 600,\n"
    "                             at most 86400)\n"
    "  -I, --identity FILE        put: sign with this identity (default: a fresh one)\n"
    "  -k, --swarm-key FILE       pre-shared key of a private swarm\n"
    "  -l, --listen HOST:PORT     local UDP address (default 0.0.0.0:0 or [::]:0)\n"
    "  -w, --timeout S            give up after S seconds (default 10)\n"
    "  -r, --raw-key              KEY is 40 hex digits\n"
    "  -x, --value-hex            put: VALUE is hex digits (binary values, e.g. an\n"
    "                             announcement's msgpack map)\n"
    "  -h, --help                 this text\n"
    "\n"
    "Exit status: 0 on success (put: stored on >= 1 node; get: >= 1 entry), 1 on\n"
    "failure or timeout, 2 on usage errors.\n";

typedef struct dht_cli {
    dht *d;
    uv_timer_t timeout;
    int is_put, exit_code, closing;
    uint8_t key[DHT_ID_LEN];
    const char *value;
    size_t value_len;
    uint8_t value_buf[DHT_MAX_VALUE];
    uint64_t ttl_ms;
} dht_cli;

static void cli_stop(dht_cli *c, int code)
{
    if (c->closing)
        return;
    c->closing = 1;
    c->exit_code = code;
    uv_close((uv_handle_t *)&c->timeout, NULL);
    dht_close(c->d, NULL, NULL);
}

static void on_timeout(uv_timer_t *t)
{
    dht_cli *c = t->data;
    fprintf(stderr, "starling dht: timed out\n");
    cli_stop(c, CLI_EXIT_FAIL);
}

static void print_value(const uint8_t *v, size_t n)
{
    int text = 1;
    for (size_t i = 0; i < n; i++)
        if (!isprint(v[i]))
            text = 0;
    if (text)
        fwrite(v, 1, n, stdout);
    else
        for (size_t i = 0; i < n; i++)
            printf("%02x", v[i]);
}

static void on_get(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    dht_cli *c = ud;
    uint64_t now = dht_now_ms();
    (void)d;
    if (status < 0) {
        if (status != -ECANCELED)
            fprintf(stderr, "starling dht: get failed: %s\n", strerror(-status));
        cli_stop(c, CLI_EXIT_FAIL);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; j < e[i].subkey_len; j++)
            printf("%02x", e[i].subkey[j]);
        if (!e[i].subkey_len)
            printf("-");
        printf(" %s %llu ", e[i].is_signed ? "signed" : "unsigned",
               (unsigned long long)(e[i].expires > now ? (e[i].expires - now) / 1000 : 0));
        print_value(e[i].value, e[i].value_len);
        printf("\n");
    }
    fflush(stdout);
    if (n == 0)
        fprintf(stderr, "starling dht: no entries\n");
    cli_stop(c, n ? CLI_EXIT_OK : CLI_EXIT_FAIL);
}

static void on_put(dht *d, int status, void *ud)
{
    dht_cli *c = ud;
    (void)d;
    if (status < 0) {
        if (status != -ECANCELED)
            fprintf(stderr, "starling dht: put failed: %s\n", strerror(-status));
        cli_stop(c, CLI_EXIT_FAIL);
        return;
    }
    printf("stored on %d node%s\n", status, status == 1 ? "" : "s");
    fflush(stdout);
    cli_stop(c, CLI_EXIT_OK);
}

static void on_join(dht *d, int status, void *ud)
{
    dht_cli *c = ud;
    int rc;
    if (status < 0) {
        if (status != -ECANCELED) {
            char msg[256];
            tools_join_error(d, status, msg, sizeof msg);
            fprintf(stderr, "starling dht: cannot join: %s\n", msg);
        }
        cli_stop(c, CLI_EXIT_FAIL);
        return;
    }
    if (c->is_put)
        rc = dht_put(d, c->key, NULL, 0, c->value, c->value_len, dht_now_ms() + c->ttl_ms, 1,
                     on_put, c);
    else
        rc = dht_get(d, c->key, on_get, c);
    if (rc < 0) {
        fprintf(stderr, "starling dht: %s: %s\n", c->is_put ? "put" : "get", strerror(-rc));
        cli_stop(c, CLI_EXIT_FAIL);
    }
}

/* The action and its operands (args[0..npos): get KEY | put KEY VALUE)
 * into st: the key as an ID (hashed, or --raw-key hex) and the value
 * (--value-hex decoded). Returns 0, or the exit code after saying why. */
static int parse_action(dht_cli *st, int npos, char **args, int raw, int value_hex)
{
    if (npos < 1)
        return cli_usage_error("dht", "expected 'get KEY' or 'put KEY VALUE'");
    const char *verb = args[0];
    if (strcmp(verb, "get") == 0) {
        if (npos != 2)
            return cli_usage_error("dht", "usage: starling dht get KEY --initial-peers LIST");
    } else if (strcmp(verb, "put") == 0) {
        if (npos != 3)
            return cli_usage_error("dht", "usage: starling dht put KEY VALUE --initial-peers LIST");
        st->is_put = 1;
        st->value = args[2];
        st->value_len = strlen(st->value);
        if (value_hex) {
            size_t bin = 0;
            if (st->value_len % 2 != 0 || st->value_len / 2 > DHT_MAX_VALUE ||
                sodium_hex2bin(st->value_buf, sizeof st->value_buf, st->value, st->value_len, NULL, &bin,
                               NULL) != 0 ||
                bin != st->value_len / 2)
                return cli_usage_error("dht", "--value-hex: VALUE must be an even number of hex digits, at most "
                                              "%d bytes", DHT_MAX_VALUE);
            st->value = (const char *)st->value_buf;
            st->value_len = bin;
        } else if (st->value_len > DHT_MAX_VALUE) {
            return cli_usage_error("dht", "VALUE is longer than %d bytes", DHT_MAX_VALUE);
        }
    } else {
        return cli_usage_error("dht", "unknown action '%s' (expected get or put)", verb);
    }
    const char *key = args[1];
    if (raw) {
        if (dht_id_from_hex(st->key, key) != 0)
            return cli_usage_error("dht", "--raw-key: KEY must be 40 hex digits, got '%s'", key);
    } else {
        dht_id_of_bytes(st->key, key, strlen(key));
    }
    return 0;
}

int cmd_dht(int argc, char **argv)
{
    static const struct option opts[] = {
        {"initial-peers", required_argument, NULL, 'p'},
        {"ttl", required_argument, NULL, 't'},
        {"identity", required_argument, NULL, 'I'},
        {"swarm-key", required_argument, NULL, 'k'},
        {"listen", required_argument, NULL, 'l'},
        {"timeout", required_argument, NULL, 'w'},
        {"raw-key", no_argument, NULL, 'r'},
        {"value-hex", no_argument, NULL, 'x'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *peers_s = NULL, *identity = NULL, *swarm_key = NULL, *listen = NULL;
    long ttl = 600, timeout = 10;
    int raw = 0, value_hex = 0, c, rc, n_peers;
    dht_peer_addr peers[16];
    dht_identity ident;
    dht_config cfg;
    dht_cli st;

    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":p:t:I:k:l:w:rxh", opts, NULL)) != -1) {
        switch (c) {
        case 'p': peers_s = optarg; break;
        case 't':
            if (cli_parse_long("dht", "--ttl", optarg, 1, 86400, &ttl))
                return CLI_EXIT_USAGE;
            break;
        case 'I': identity = optarg; break;
        case 'k': swarm_key = optarg; break;
        case 'l': listen = optarg; break;
        case 'w':
            if (cli_parse_long("dht", "--timeout", optarg, 1, 3600, &timeout))
                return CLI_EXIT_USAGE;
            break;
        case 'r': raw = 1; break;
        case 'x': value_hex = 1; break;
        case 'h': fputs(dht_help, stdout); return CLI_EXIT_OK;
        default: return cli_bad_option("dht", c, argv);
        }
    }
    memset(&st, 0, sizeof st);
    rc = parse_action(&st, argc - optind, argv + optind, raw, value_hex);
    if (rc != 0)
        return rc;
    if (!peers_s)
        return cli_usage_error("dht", "--initial-peers LIST is required");
    n_peers = dht_peer_list_parse(peers, 16, peers_s);
    if (n_peers < 0)
        return cli_usage_error("dht", "--initial-peers: bad address list '%s'", peers_s);
    if (listen) {
        dht_addr la;
        if (dht_addr_parse_listen(&la, listen) != 0)
            return cli_usage_error("dht", "--listen expects a numeric HOST:PORT, got '%s'", listen);
    } else {
        listen = peers[0].addr.family == 6 ? "[::]:0" : "0.0.0.0:0";
    }
    st.ttl_ms = (uint64_t)ttl * 1000;
    dht_config_default(&cfg);
    cfg.client_only = 1; /* we leave in a moment: stay out of routing tables */
    if (swarm_key) {
        rc = dht_swarm_key_load(cfg.swarm_key, swarm_key);
        if (rc)
            return cli_fail("dht", "cannot load swarm key '%s': %s", swarm_key,
                            rc == -EBADMSG ? "not 64 hex digits" : strerror(-rc));
        cfg.has_swarm_key = 1;
    }
    rc = identity ? dht_identity_load(&ident, identity) : dht_identity_generate(&ident);
    if (rc)
        return cli_fail("dht", "cannot load identity '%s': %s", identity ? identity : "(new)",
                        dht_identity_strerror(rc));
    uv_loop_t *loop = uv_default_loop();
    st.d = dht_create(loop, &ident, &cfg);
    sodium_memzero(&ident, sizeof ident);
    if (!st.d)
        return cli_fail("dht", "cannot create the DHT node");
    rc = dht_start(st.d, listen);
    if (rc == 0)
        rc = dht_join(st.d, peers, (size_t)n_peers, on_join, &st);
    if (rc) {
        dht_close(st.d, NULL, NULL);
        uv_run(loop, UV_RUN_DEFAULT);
        return cli_fail("dht", "cannot start: %s", rc == -EINVAL ? "bad address" : uv_strerror(rc));
    }
    uv_timer_init(loop, &st.timeout);
    st.timeout.data = &st;
    uv_timer_start(&st.timeout, on_timeout, (uint64_t)timeout * 1000, 0);
    uv_run(loop, UV_RUN_DEFAULT);
    if (uv_loop_close(loop) != 0)
        return CLI_EXIT_FAIL;
    return st.exit_code;
}
