/* starling bootstrap: a DHT-only node that others join through. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "dht/dht.h"
#include "tools/cli.h"
#include "tools/client.h"

static const char bootstrap_help[] =
    "Usage: starling bootstrap --listen HOST:PORT [--identity FILE] [--swarm-key FILE]\n"
    "                          [--initial-peers LIST] [--dht-limits public|all|off]\n"
    "\n"
    "Runs a DHT-only node and prints, on one line of stdout, the address string\n"
    "that peers, trainers and monitors pass to --initial-peers:\n"
    "\n"
    "    HOST:PORT/NODEID        e.g. 127.0.0.1:4000/5f1c...(40 hex digits)\n"
    "    [IPV6]:PORT/NODEID      e.g. [::1]:4000/5f1c...\n"
    "\n"
    "NODEID is the BLAKE2b-160 hash of the node's public key; a node given it\n"
    "refuses a node that answers from that address with another ID (answers are\n"
    "signed). HOST must be numeric. Port 0 picks a free port (the printed string\n"
    "has the real one). The node runs until SIGINT or SIGTERM.\n"
    "\n"
    "Options:\n"
    "  -l, --listen HOST:PORT     UDP address to listen on (IPv4 or [IPv6])\n"
    "  -I, --identity FILE        ed25519 identity from 'starling keygen' (default:\n"
    "                             a fresh identity, so a new node ID each run)\n"
    "  -k, --swarm-key FILE       pre-shared key of a private swarm: 64 hex digits,\n"
    "                             mode 0600; datagrams without its tag are dropped\n"
    "  -p, --initial-peers LIST   comma-separated address strings to join through\n"
    "      --dht-limits MODE      which addresses the per-network limits of the\n"
    "                             routing table and of lookups apply to: public\n"
    "                             (default: all but loopback and private ones), all,\n"
    "                             or off; overrides STARLING_DHT_LIMITS\n"
    "  -h, --help                 this text\n"
    "\n"
    "Exit status: 0 after SIGINT/SIGTERM, 1 on runtime errors, 2 on usage errors.\n";

typedef struct bs_state {
    dht *d;
    uv_signal_t sigint, sigterm;
    dht_peer_addr peers[16];
    int n_peers;
    uv_timer_t retry;
    int stopping;
} bs_state;

static void bs_join(bs_state *s);
static void on_retry(uv_timer_t *t);

static void on_join(dht *d, int status, void *ud)
{
    bs_state *s = ud;
    (void)d;
    if (status == -ECANCELED || s->stopping)
        return;
    if (status == -EADDRINUSE) {
        /* Joined, but a node with our identity is online elsewhere. */
        char msg[256];
        tools_join_error(d, status, msg, sizeof msg);
        fprintf(stderr, "starling bootstrap: warning: %s\n", msg);
    } else if (status < 0) {
        char msg[256];
        tools_join_error(d, status, msg, sizeof msg);
        fprintf(stderr, "starling bootstrap: join failed (%s), retrying in 2 s\n", msg);
        uv_timer_start(&s->retry, on_retry, 2000, 0);
    }
}

static void on_retry(uv_timer_t *t)
{
    bs_join(t->data);
}

static void bs_join(bs_state *s)
{
    int rc = dht_join(s->d, s->peers, (size_t)s->n_peers, on_join, s);
    if (rc < 0)
        fprintf(stderr, "starling bootstrap: join: %s\n", strerror(-rc));
}

static void on_signal(uv_signal_t *h, int signum)
{
    bs_state *s = h->data;
    (void)signum;
    if (s->stopping)
        return;
    s->stopping = 1;
    dht_close(s->d, NULL, NULL);
    uv_close((uv_handle_t *)&s->sigint, NULL);
    uv_close((uv_handle_t *)&s->sigterm, NULL);
    uv_close((uv_handle_t *)&s->retry, NULL);
}

/* --dht-limits: enum dht_diversity, or -1. */
static int parse_dht_limits(const char *s)
{
    return !strcmp(s, "public") ? DHT_DIVERSITY_PUBLIC
           : !strcmp(s, "all")  ? DHT_DIVERSITY_ALL
           : !strcmp(s, "off")  ? DHT_DIVERSITY_OFF
                                : -1;
}

int cmd_bootstrap(int argc, char **argv)
{
    enum { O_DHT_LIMITS = 256 };
    static const struct option opts[] = {
        {"listen", required_argument, NULL, 'l'},
        {"identity", required_argument, NULL, 'I'},
        {"swarm-key", required_argument, NULL, 'k'},
        {"initial-peers", required_argument, NULL, 'p'},
        {"dht-limits", required_argument, NULL, O_DHT_LIMITS},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *listen = NULL, *identity = NULL, *swarm_key = NULL, *peers = NULL;
    dht_identity ident;
    dht_config cfg;
    dht_addr la;
    bs_state s;
    char line[DHT_ADDR_STRLEN];
    int c, rc, dht_limits = -1; /* -1: STARLING_DHT_LIMITS, else public (dht_config_default) */

    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":l:I:k:p:h", opts, NULL)) != -1) {
        switch (c) {
        case 'l': listen = optarg; break;
        case 'I': identity = optarg; break;
        case 'k': swarm_key = optarg; break;
        case 'p': peers = optarg; break;
        case O_DHT_LIMITS:
            if ((dht_limits = parse_dht_limits(optarg)) < 0)
                return cli_usage_error("bootstrap", "--dht-limits takes public, all or off, not '%s'", optarg);
            break;
        case 'h': fputs(bootstrap_help, stdout); return CLI_EXIT_OK;
        default: return cli_bad_option("bootstrap", c, argv);
        }
    }
    if (cli_no_positional("bootstrap", argc, argv))
        return CLI_EXIT_USAGE;
    const char *env_limits = getenv("STARLING_DHT_LIMITS");
    if (dht_limits < 0 && env_limits && parse_dht_limits(env_limits) < 0)
        fprintf(stderr, "starling bootstrap: warning: STARLING_DHT_LIMITS='%s' is not public, all or off; using public\n",
                env_limits);
    if (!listen)
        return cli_usage_error("bootstrap", "--listen HOST:PORT is required");
    if (dht_addr_parse_listen(&la, listen) != 0)
        return cli_usage_error("bootstrap", "--listen expects a numeric HOST:PORT or [IPV6]:PORT, got '%s'", listen);
    memset(&s, 0, sizeof s);
    if (peers) {
        s.n_peers = dht_peer_list_parse(s.peers, 16, peers);
        if (s.n_peers < 0)
            return cli_usage_error("bootstrap", "--initial-peers: bad address list '%s'", peers);
    }
    dht_config_default(&cfg);
    if (dht_limits >= 0)
        cfg.diversity = dht_limits;
    if (swarm_key) {
        rc = dht_swarm_key_load(cfg.swarm_key, swarm_key);
        if (rc)
            return cli_fail("bootstrap", "cannot load swarm key '%s': %s", swarm_key,
                            rc == -EBADMSG ? "not 64 hex digits"
                            : rc == -EPERM ? "readable by group or others (chmod 600)"
                                           : strerror(-rc));
        cfg.has_swarm_key = 1;
    }
    rc = identity ? dht_identity_load(&ident, identity) : dht_identity_generate(&ident);
    if (rc)
        return cli_fail("bootstrap", "cannot load identity '%s': %s", identity ? identity : "(new)",
                        dht_identity_strerror(rc));

    uv_loop_t *loop = uv_default_loop();
    s.d = dht_create(loop, &ident, &cfg);
    sodium_memzero(&ident, sizeof ident);
    sodium_memzero(cfg.swarm_key, sizeof cfg.swarm_key);
    if (!s.d)
        return cli_fail("bootstrap", "cannot create the DHT node");
    rc = dht_start(s.d, listen);
    if (rc) {
        dht_close(s.d, NULL, NULL);
        uv_run(loop, UV_RUN_DEFAULT);
        return cli_fail("bootstrap", "cannot listen on %s: %s", listen, uv_strerror(rc));
    }
    if (dht_peer_string(s.d, line, sizeof line) < 0) {
        dht_close(s.d, NULL, NULL);
        uv_run(loop, UV_RUN_DEFAULT);
        return cli_fail("bootstrap", "cannot format the address");
    }
    printf("%s\n", line);
    fflush(stdout);

    uv_signal_init(loop, &s.sigint);
    uv_signal_init(loop, &s.sigterm);
    uv_timer_init(loop, &s.retry);
    s.sigint.data = s.sigterm.data = s.retry.data = &s;
    uv_signal_start(&s.sigint, on_signal, SIGINT);
    uv_signal_start(&s.sigterm, on_signal, SIGTERM);
    if (s.n_peers)
        bs_join(&s);
    uv_run(loop, UV_RUN_DEFAULT);
    rc = uv_loop_close(loop);
    return rc == 0 ? CLI_EXIT_OK : CLI_EXIT_FAIL;
}
