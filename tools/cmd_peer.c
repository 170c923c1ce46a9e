/* starling peer: host model blocks, serve them over the tensor RPC and
 * announce them in the DHT, until SIGINT/SIGTERM. */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>
#include <uv.h>

#include "dht/dht.h"
#include "expert/expert.h"
#include "expert/model.h"
#include "peer/daemon.h"
#include "peer/peer.h"
#include "tools/cli.h"

static const char peer_help[] =
    "Usage: starling peer --blocks LIST [--initial-peers ADDR[,ADDR...]] [--model NAME]\n"
    "                     [--listen HOST:PORT] [--announce HOST] [--identity FILE]\n"
    "                     [--checkpoint-dir DIR] [--swarm-key FILE] [--device cpu|cuda:N] ...\n"
    "\n"
    "Hosts blocks (stages) of a model, serves forward/backward requests over the\n"
    "encrypted tensor RPC and announces the blocks in the DHT. The DHT (UDP) and\n"
    "the RPC (TCP) share --listen's port. SIGINT or SIGTERM stops it gracefully:\n"
    "it announces itself offline, finishes queued work and writes checkpoints.\n"
    "\n"
    "Options:\n"
    "  --blocks LIST          stage indices to host: 1,2 or 1-3 (required)\n"
    "  --initial-peers LIST   DHT peers to join through (from 'starling bootstrap');\n"
    "                         without it this peer starts a new swarm\n"
    "  --model NAME           model to serve (default fmnist-mlp)\n"
    "  --listen HOST:PORT     address to listen on (default 127.0.0.1:0, any free port)\n"
    "  --announce HOST        address other machines reach this peer at (needed when\n"
    "                         --listen is 0.0.0.0 or [::])\n"
    "  --identity FILE        ed25519 identity from 'starling keygen' (default: a new\n"
    "                         one for this run)\n"
    "  --checkpoint-dir DIR   keep checkpoints of the hosted blocks in DIR; restores\n"
    "                         from them at start\n"
    "  --checkpoint-every S   seconds between periodic checkpoints (default 300; 0 off)\n"
    "  --swarm-key FILE       pre-shared key of a private swarm (64 hex digits)\n"
    "  --device DEV           cpu (default); cuda:N is refused until GPU blocks land\n"
    "  --threads N            compute threads per block (default 1)\n"
    "  --blas-threads N       OpenBLAS threads (default: one per core)\n"
    "  --max-batch N          largest request and joined batch, rows (default 256)\n"
    "  --target-batch N       samples accumulated per optimizer step (default 128)\n"
    "  --optimizer NAME       adamw (default) or sgd\n"
    "  --lr X                 learning rate (default 1e-3 adamw, 1e-2 sgd)\n"
    "  --seed N               initial weights seed when no checkpoint exists (default 0)\n"
    "  --metrics HOST:PORT    serve Prometheus metrics at http://HOST:PORT/metrics\n"
    "  --no-state-download    serve our own checkpoint or initial weights even when\n"
    "                         other holders have newer ones (by default a joining\n"
    "                         peer first downloads the newest state from a holder)\n"
    "  --announce-every S     seconds between announcements (default 20)\n"
    "  --announce-ttl S       announcements expire this long after they are written\n"
    "                         (default 60): how fast a dead peer disappears\n"
    "  -h, --help             this text\n"
    "\n"
    "Example (second machine of a swarm):\n"
    "  starling peer --initial-peers 10.0.0.1:4000/3f0c... --blocks 1,2 \\\n"
    "                --listen 0.0.0.0:4001 --announce 10.0.0.2 --checkpoint-dir ckpt\n";

/* Parses "1,2", "1-3", "0,2-4" into out; returns the count or -1. */
static int parse_blocks(const char *s, int *out, int max)
{
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long a = strtol(p, &end, 10), b;
        if (end == p || errno || a < 0 || a > 4095)
            return -1;
        b = a;
        p = end;
        if (*p == '-') {
            p++;
            b = strtol(p, &end, 10);
            if (end == p || errno || b < a || b > 4095)
                return -1;
            p = end;
        }
        for (long i = a; i <= b; i++) {
            if (n >= max)
                return -1;
            out[n++] = (int)i;
        }
        if (*p == ',')
            p++;
        else if (*p)
            return -1;
        if (*p == '\0' && p[-1] == ',')
            return -1;
    }
    return n;
}

typedef struct run_ctx {
    uv_loop_t loop;
    uv_signal_t sigint, sigterm;
    peer_daemon *daemon;
    int stopping;
    int status;
} run_ctx;

static void on_stopped(int status, void *arg)
{
    run_ctx *r = arg;
    r->status = status == 0 ? CLI_EXIT_OK : CLI_EXIT_FAIL;
    r->daemon = NULL;
    uv_close((uv_handle_t *)&r->sigint, NULL);
    uv_close((uv_handle_t *)&r->sigterm, NULL);
    fprintf(stderr, "starling peer: stopped\n");
}

static void on_signal(uv_signal_t *h, int signum)
{
    run_ctx *r = h->data;
    if (r->stopping) {
        fprintf(stderr, "starling peer: second signal, exiting at once\n");
        exit(CLI_EXIT_FAIL);
    }
    r->stopping = 1;
    fprintf(stderr, "starling peer: %s received, stopping (announcing offline, writing checkpoints)\n",
            signum == SIGINT ? "SIGINT" : "SIGTERM");
    peer_daemon_stop(r->daemon, on_stopped, r);
}

int cmd_peer(int argc, char **argv)
{
    enum { O_INITIAL = 256, O_MODEL, O_BLOCKS, O_DEVICE, O_LISTEN, O_ANNOUNCE, O_IDENTITY,
           O_CKPT_DIR, O_CKPT_EVERY, O_SWARM_KEY, O_THREADS, O_BLAS, O_MAX_BATCH, O_TARGET,
           O_OPT, O_LR, O_SEED, O_METRICS, O_ANN_EVERY, O_ANN_TTL, O_NO_SYNC };
    static const struct option opts[] = {
        {"initial-peers", required_argument, NULL, O_INITIAL},
        {"model", required_argument, NULL, O_MODEL},
        {"blocks", required_argument, NULL, O_BLOCKS},
        {"device", required_argument, NULL, O_DEVICE},
        {"listen", required_argument, NULL, O_LISTEN},
        {"announce", required_argument, NULL, O_ANNOUNCE},
        {"identity", required_argument, NULL, O_IDENTITY},
        {"checkpoint-dir", required_argument, NULL, O_CKPT_DIR},
        {"checkpoint-every", required_argument, NULL, O_CKPT_EVERY},
        {"swarm-key", required_argument, NULL, O_SWARM_KEY},
        {"threads", required_argument, NULL, O_THREADS},
        {"blas-threads", required_argument, NULL, O_BLAS},
        {"max-batch", required_argument, NULL, O_MAX_BATCH},
        {"target-batch", required_argument, NULL, O_TARGET},
        {"optimizer", required_argument, NULL, O_OPT},
        {"lr", required_argument, NULL, O_LR},
        {"seed", required_argument, NULL, O_SEED},
        {"metrics", required_argument, NULL, O_METRICS},
        {"announce-every", required_argument, NULL, O_ANN_EVERY},
        {"announce-ttl", required_argument, NULL, O_ANN_TTL},
        {"no-state-download", no_argument, NULL, O_NO_SYNC},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *initial = NULL, *model = "fmnist-mlp", *blocks_s = NULL, *device = "cpu";
    const char *listen = "127.0.0.1:0", *announce_host = NULL, *identity = NULL;
    const char *ckpt_dir = NULL, *swarm_key_file = NULL, *metrics = NULL, *optimizer = "adamw";
    long threads = 1, blas = 0, max_batch = 256, target = 128, seed = 0;
    double ckpt_every = 300, lr = -1, ann_every = 20, ann_ttl = 60;
    int c, no_sync = 0;

    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        switch (c) {
        case 'h': fputs(peer_help, stdout); return CLI_EXIT_OK;
        case O_NO_SYNC: no_sync = 1; break;
        case O_INITIAL: initial = optarg; break;
        case O_MODEL: model = optarg; break;
        case O_BLOCKS: blocks_s = optarg; break;
        case O_DEVICE: device = optarg; break;
        case O_LISTEN: listen = optarg; break;
        case O_ANNOUNCE: announce_host = optarg; break;
        case O_IDENTITY: identity = optarg; break;
        case O_CKPT_DIR: ckpt_dir = optarg; break;
        case O_SWARM_KEY: swarm_key_file = optarg; break;
        case O_METRICS: metrics = optarg; break;
        case O_OPT: optimizer = optarg; break;
        case O_CKPT_EVERY:
            if (cli_parse_double("peer", "--checkpoint-every", optarg, 0, 1e7, &ckpt_every))
                return CLI_EXIT_USAGE;
            break;
        case O_ANN_EVERY:
            if (cli_parse_double("peer", "--announce-every", optarg, 0.1, 3600, &ann_every))
                return CLI_EXIT_USAGE;
            break;
        case O_ANN_TTL:
            if (cli_parse_double("peer", "--announce-ttl", optarg, 1, 86400, &ann_ttl))
                return CLI_EXIT_USAGE;
            break;
        case O_THREADS:
            if (cli_parse_long("peer", "--threads", optarg, 1, 64, &threads))
                return CLI_EXIT_USAGE;
            break;
        case O_BLAS:
            if (cli_parse_long("peer", "--blas-threads", optarg, 1, 256, &blas))
                return CLI_EXIT_USAGE;
            break;
        case O_MAX_BATCH:
            if (cli_parse_long("peer", "--max-batch", optarg, 1, 65536, &max_batch))
                return CLI_EXIT_USAGE;
            break;
        case O_TARGET:
            if (cli_parse_long("peer", "--target-batch", optarg, 1, 1 << 24, &target))
                return CLI_EXIT_USAGE;
            break;
        case O_LR:
            if (cli_parse_double("peer", "--lr", optarg, 1e-12, 10, &lr))
                return CLI_EXIT_USAGE;
            break;
        case O_SEED:
            if (cli_parse_long("peer", "--seed", optarg, 0, LONG_MAX, &seed))
                return CLI_EXIT_USAGE;
            break;
        default: return cli_bad_option("peer", c, argv);
        }
    }
    if (cli_no_positional("peer", argc, argv))
        return CLI_EXIT_USAGE;

    /* Check everything before touching the network. */
    char err[512];
    peer_device dev;
    int rc = peer_device_parse(device, &dev, err, sizeof err);
    if (rc == -EINVAL)
        return cli_usage_error("peer", "%s", err);
    if (rc != 0)
        return cli_fail("peer", "%s", err);
    if (dev.kind != PEER_DEVICE_CPU)
        return cli_fail("peer", "hosting blocks on %s is not available in this build yet; use --device cpu",
                        device);
    const struct expert_model_spec *spec = expert_model_find(model);
    if (!spec) {
        char names[256] = "";
        for (int i = 0; expert_model_at(i); i++)
            snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "",
                     expert_model_at(i)->name);
        return cli_usage_error("peer", "unknown model '%s' (known: %s)", model, names);
    }
    if (!blocks_s)
        return cli_usage_error("peer", "--blocks is required (e.g. --blocks 1,2; stages 0..%d)",
                               spec->n_stages - 1);
    int blocks[PEER_SERVICE_MAX_BLOCKS];
    int nb = parse_blocks(blocks_s, blocks, PEER_SERVICE_MAX_BLOCKS);
    if (nb <= 0)
        return cli_usage_error("peer", "--blocks '%s' is not a list like 1,2 or 1-3", blocks_s);
    for (int i = 0; i < nb; i++)
        if (blocks[i] >= spec->n_stages)
            return cli_usage_error("peer", "model %s has stages 0..%d, not %d", spec->name,
                                   spec->n_stages - 1, blocks[i]);
    dht_peer_addr peers[64];
    int np = 0;
    if (initial) {
        np = dht_peer_list_parse(peers, 64, initial);
        if (np < 0)
            return cli_usage_error("peer", "--initial-peers '%s' is not a list of HOST:PORT[/ID]", initial);
    }
    dht_addr la;
    if (dht_addr_parse_listen(&la, listen) != 0)
        return cli_usage_error("peer", "--listen '%s' is not HOST:PORT (numeric host)", listen);
    struct expert_optim optim;
    if (!strcmp(optimizer, "adamw"))
        expert_optim_default_adamw(&optim);
    else if (!strcmp(optimizer, "sgd"))
        expert_optim_default_sgd(&optim);
    else
        return cli_usage_error("peer", "--optimizer must be adamw or sgd, not '%s'", optimizer);
    if (ann_ttl <= ann_every)
        return cli_usage_error("peer", "--announce-ttl (%g s) must be longer than --announce-every (%g s)",
                               ann_ttl, ann_every);
    if (lr > 0)
        optim.lr = (float)lr;
    optim.target_batch = (int)target;

    dht_identity ident;
    if (identity) {
        rc = dht_identity_load(&ident, identity);
        if (rc != 0)
            return cli_fail("peer", "cannot load identity '%s': %s", identity, dht_identity_strerror(rc));
    } else if (dht_identity_generate(&ident) != 0) {
        return cli_fail("peer", "cannot create an identity");
    }
    uint8_t swarm_key[32];
    if (swarm_key_file) {
        rc = dht_swarm_key_load(swarm_key, swarm_key_file);
        if (rc != 0)
            return cli_fail("peer", "cannot load swarm key '%s': %s", swarm_key_file,
                            rc == -EPERM ? "readable by group or others; chmod 600 it"
                            : rc == -EBADMSG ? "expected 64 hex digits"
                                             : strerror(-rc));
    }
    if (blas > 0)
        expert_blas_set_threads((int)blas);

    run_ctx r;
    memset(&r, 0, sizeof r);
    if (uv_loop_init(&r.loop) != 0)
        return cli_fail("peer", "cannot create the event loop");
    peer_daemon_config dc;
    memset(&dc, 0, sizeof dc);
    dc.ident = &ident;
    dc.swarm_key = swarm_key_file ? swarm_key : NULL;
    dc.listen = listen;
    dc.announce_host = announce_host;
    dc.initial = peers;
    dc.n_initial = (size_t)np;
    dc.svc.model = spec->name;
    dc.svc.blocks = blocks;
    dc.svc.n_blocks = nb;
    dc.svc.threads = (int)threads;
    dc.svc.max_batch = (int)max_batch;
    dc.svc.max_queue_rows = (int)max_batch * 8;
    dc.svc.optim = optim;
    dc.svc.seed = (uint64_t)seed;
    dc.svc.checkpoint_dir = ckpt_dir;
    dc.device = "cpu";
    dc.checkpoint_every_s = ckpt_dir ? ckpt_every : 0;
    dc.metrics_listen = metrics;
    dc.announce_every_s = ann_every;
    dc.no_state_download = no_sync;
    dc.ttl_s = ann_ttl;
    r.daemon = peer_daemon_start(&r.loop, &dc, err, sizeof err);
    sodium_memzero(&ident, sizeof ident);
    sodium_memzero(swarm_key, sizeof swarm_key);
    if (!r.daemon) {
        uv_run(&r.loop, UV_RUN_DEFAULT); /* let failed handles close */
        uv_loop_close(&r.loop);
        return cli_fail("peer", "%s", err);
    }
    char addr[128];
    peer_daemon_peer_string(r.daemon, addr, sizeof addr);
    printf("starling peer: serving %s stages %s on %s (%s)\n", spec->name, blocks_s, addr, dev.desc);
    printf("starling peer: address %s\n", addr);
    fflush(stdout);

    uv_signal_init(&r.loop, &r.sigint);
    uv_signal_init(&r.loop, &r.sigterm);
    r.sigint.data = r.sigterm.data = &r;
    uv_signal_start(&r.sigint, on_signal, SIGINT);
    uv_signal_start(&r.sigterm, on_signal, SIGTERM);
    uv_run(&r.loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&r.loop) != 0)
        fprintf(stderr, "starling peer: warning: handles left open at exit\n");
    return r.status;
}
