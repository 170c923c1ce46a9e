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
#include "peer/timeslice.h"
#include "routing/balance.h"
#include "routing/replica.h"
#include "routing/swarm.h"
#include "tools/cli.h"
#include "tools/client.h"

static const char peer_help[] =
    "Usage: starling peer [--blocks LIST | --num-blocks K] [--initial-peers ADDR[,ADDR...]]\n"
    "                     [--model NAME]\n"
    "                     [--listen HOST:PORT] [--announce HOST] [--identity FILE]\n"
    "                     [--checkpoint-dir DIR] [--swarm-key FILE] [--device cpu|cuda:N] ...\n"
    "\n"
    "Hosts blocks (stages) of a model, serves forward/backward requests over the\n"
    "encrypted tensor RPC and announces the blocks in the DHT. The DHT (UDP) and\n"
    "the RPC (TCP) share --listen's port. SIGINT or SIGTERM stops it gracefully:\n"
    "it announces itself offline, finishes queued work and writes checkpoints.\n"
    "\n"
    "Options:\n"
    "  --blocks LIST          stage indices to host: 1,2 or 1-3\n"
    "  --num-blocks K         without --blocks: host the K contiguous stages the swarm\n"
    "                         serves least (default 2), re-checked every\n"
    "                         --rebalance-every S seconds (default 60; 0 off); a peer\n"
    "                         first covers stages that have no holder, otherwise\n"
    "                         moves only to a span served less than half as well\n"
    "                         (holder-equivalents: throughput / fastest holder's)\n"
    "  --initial-peers LIST   DHT peers to join through (from 'starling bootstrap');\n"
    "                         without it this peer starts a new swarm\n"
    "  --model NAME           model to serve (default fmnist-mlp)\n"
    "  --listen HOST:PORT     address to listen on (default 127.0.0.1:0, any free port)\n"
    "  --announce HOST        address other machines reach this peer at (needed when\n"
    "                         --listen is 0.0.0.0 or [::])\n"
    "  --identity FILE        ed25519 identity from 'starling keygen' (default: a new\n"
    "                         one for this run); one file per running peer: a peer\n"
    "                         that finds another online with its identity exits 1\n"
    "  --checkpoint-dir DIR   keep checkpoints of the hosted blocks in DIR; restores\n"
    "                         from them at start\n"
    "  --checkpoint-every S   seconds between periodic checkpoints (default 300; 0 off)\n"
    "  --swarm-key FILE       pre-shared key of a private swarm (64 hex digits)\n"
    "  --device DEV           cpu (default); cuda:N is refused until GPU blocks land\n"
    "  --threads N            compute threads per block (default 1)\n"
    "  --blas-threads N       OpenBLAS threads (default: one per core)\n"
    "  --training-priority P  low (default: training threads at nice 10) or idle\n"
    "                         (SCHED_IDLE, and a 10 ms time slice for the network\n"
    "                         thread: least inference delay; for serving machines)\n"
    "  --infer-inline-rows N  compute inference requests of at most N rows at once on\n"
    "                         the network thread, skipping the hand-off to the\n"
    "                         inference thread: lower latency one request at a time\n"
    "                         under training load, but no joining of concurrent\n"
    "                         requests (default 0: always the inference thread)\n"
    "  --keep-activations N   per block, keep the activations of N training forwards\n"
    "                         for their backward, so a backward that reaches the\n"
    "                         same peer skips recomputing its forward (default 16;\n"
    "                         0: stateless, every backward recomputes)\n"
    "  --max-batch N          largest request and joined batch, rows (default 256)\n";
/* In two pieces: C11 compilers need only take 4095-character literals. */
static const char peer_help2[] =
    "  --target-batch N       samples accumulated per optimizer step (default 128)\n"
    "  --optimizer NAME       adamw (default) or sgd\n"
    "  --lr X                 learning rate (default 1e-3 adamw, 1e-2 sgd)\n"
    "  --grad-factor X        refuse a backward or step whose gradient norm is over X\n"
    "                         times the block's recent norm (default 100; 0 off)\n"
    "  --grad-max-norm X      refuse any gradient norm over X (default 1e5; 0 off)\n"
    "  --grad-warmup N        accepted gradients before --grad-factor applies (20)\n"
    "  --frozen-steps N       steps that change no weight before a block is reported\n"
    "                         frozen (log line, announcement) (default 8)\n"
    "  --seed N               initial weights seed when no checkpoint exists (default 0)\n"
    "  --metrics HOST:PORT    serve Prometheus metrics at http://HOST:PORT/metrics\n"
    "  --max-conns-per-ip N   tensor RPC connections one address (IPv4, IPv6 /64) may\n"
    "                         hold; its next one is closed at once (default 64)\n"
    "  --max-conns N          tensor RPC connections in all; when full, one of the\n"
    "                         address that holds the most is closed (default 1024)\n"
    "  --idle-timeout S       close an RPC connection with nothing in flight (or\n"
    "                         whose replies are not read) after S seconds (120)\n"
    "  --dht-limits MODE      which addresses the DHT's per-network limits (routing\n"
    "                         table, lookups) apply to: public (default: all but\n"
    "                         loopback and private ones), all, or off; overrides\n"
    "                         the STARLING_DHT_LIMITS environment variable\n"
    "  --no-state-download    serve our own checkpoint or initial weights even when\n"
    "                         other holders have newer ones (by default a joining\n"
    "                         peer first downloads the newest state from a holder)\n"
    "  --average-every S      average each stage with all its replicas (weights and\n"
    "                         optimizer state) every S seconds (default 30; 0 off)\n"
    "  --keep-every S         keep cold copies of other stages' state, refreshed\n"
    "                         every S seconds, so a stage whose only holder dies\n"
    "                         keeps its training (default 60; 0 off)\n"
    "  --keep-copies N        keepers per stage (default 2)\n"
    "  --keep-mb MB           memory for cold copies (default 2048)\n"
    "  --announce-every S     seconds between announcements (default 20)\n"
    "  --announce-ttl S       announcements expire this long after they are written\n"
    "                         (default 60): how fast a dead peer disappears\n"
    "  -h, --help             this text\n"
    "\n"
    "Example (second machine of a swarm):\n"
    "  starling peer --initial-peers 10.0.0.1:4000/3f0c... --blocks 1,2 \\\n"
    "                --listen 0.0.0.0:4001 --announce 10.0.0.2 --checkpoint-dir ckpt\n";

/* --dht-limits: enum dht_diversity, or -1. */
static int parse_dht_limits(const char *s)
{
    return !strcmp(s, "public") ? DHT_DIVERSITY_PUBLIC
           : !strcmp(s, "all")  ? DHT_DIVERSITY_ALL
           : !strcmp(s, "off")  ? DHT_DIVERSITY_OFF
                                : -1;
}

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
    uv_timer_t rebalance;
    peer_daemon *daemon;
    peer_daemon_config dc;
    const struct expert_model_spec *spec;
    const char *device_desc;
    dht_identity ident;
    uint8_t swarm_key[32];
    int blocks[PEER_SERVICE_MAX_BLOCKS];
    char listen[96];              /* listen address, with the bound port after the first start */
    int auto_k;                   /* 0: --blocks given; else span length */
    int cur;                      /* start of the current span (auto mode) */
    int next;                     /* start to move to */
    int yielded;                  /* checks in a row that left a warranted move to a higher ID */
    double rebalance_every;
    route_swarm *sw;
    int eval_pending;
    uint64_t rng;
    int stopping, moving;
    int refused;                  /* the daemon would not go on (it said why) */
    int status;
} run_ctx;

static void close_handles(run_ctx *r)
{
    uv_close((uv_handle_t *)&r->sigint, NULL);
    uv_close((uv_handle_t *)&r->sigterm, NULL);
    uv_close((uv_handle_t *)&r->rebalance, NULL);
}

static void on_stopped(int status, void *arg)
{
    run_ctx *r = arg;
    r->status = status == 0 && !r->refused ? CLI_EXIT_OK : CLI_EXIT_FAIL;
    r->daemon = NULL;
    close_handles(r);
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
    uv_timer_stop(&r->rebalance);
    route_swarm_destroy(&r->sw);
    if (r->daemon)
        peer_daemon_stop(r->daemon, on_stopped, r);
    /* else: a move is in progress; on_moved sees `stopping` */
}

/* The daemon will not go on (another peer runs with our identity): stop as
 * for a signal, and exit 1. */
static void on_refused(void *arg)
{
    run_ctx *r = arg;
    r->refused = 1;
    if (r->stopping)
        return;
    r->stopping = 1;
    uv_timer_stop(&r->rebalance);
    route_swarm_destroy(&r->sw);
    if (r->daemon)
        peer_daemon_stop(r->daemon, on_stopped, r);
}

static void span_string(char *buf, size_t len, const int *blocks, int n)
{
    if (n == 1)
        snprintf(buf, len, "%d", blocks[0]);
    else
        snprintf(buf, len, "%d-%d", blocks[0], blocks[n - 1]);
}

/* Starts the daemon with r->dc; prints where it serves. */
static int start_daemon(run_ctx *r, char *err, size_t errlen)
{
    r->dc.ident = &r->ident;
    r->dc.listen = r->listen;
    r->daemon = peer_daemon_start(&r->loop, &r->dc, err, errlen);
    if (!r->daemon)
        return -1;
    /* Keep the port: a move restarts on the same one. */
    dht_addr bound;
    if (dht_local_addr(peer_daemon_dht(r->daemon), &bound) == 0) {
        char *colon = strrchr(r->listen, ':');
        if (colon)
            snprintf(colon, sizeof r->listen - (size_t)(colon - r->listen), ":%u", (unsigned)bound.port);
    }
    char addr[128], span[32];
    peer_daemon_peer_string(r->daemon, addr, sizeof addr);
    if (r->auto_k)
        span_string(span, sizeof span, r->dc.svc.blocks, r->dc.svc.n_blocks);
    printf("starling peer: serving %s stages %s on %s (%s)\n", r->spec->name,
           r->auto_k ? span : "(as listed)", addr, r->device_desc);
    printf("starling peer: address %s\n", addr);
    fflush(stdout);
    return 0;
}

static void set_span(run_ctx *r, int start)
{
    for (int i = 0; i < r->auto_k; i++)
        r->blocks[i] = start + i;
    r->dc.svc.blocks = r->blocks;
    r->dc.svc.n_blocks = r->auto_k;
    r->cur = start;
}

/* How well each stage is served by the OTHER online holders (self_id NULL:
 * every holder), in holder-equivalents: the stage's total announced
 * throughput divided by its fastest holder's. Throughput alone would make
 * intrinsically cheap stages (a small input projection) look well served
 * and expensive ones look starved however many holders they have. */
static void stage_scores(route_swarm *sw, const struct expert_model_spec *spec, const uint8_t *self_id,
                         double *score, int *holders)
{
    for (int i = 0; i < spec->n_stages; i++) {
        route_stage *st = route_swarm_stage(sw, i);
        double total = 0, best = 0;
        score[i] = 0;
        holders[i] = 0;
        for (int h = 0; st && h < st->n_holders; h++) {
            const route_holder *ho = &st->holders[h];
            if (ho->ann.state != PEER_STATE_ONLINE || (self_id && !memcmp(ho->rep.id, self_id, DHT_ID_LEN)))
                continue;
            holders[i]++;
            total += ho->ann.throughput;
            if (ho->ann.throughput > best)
                best = ho->ann.throughput;
        }
        score[i] = best > 0 ? total / best : holders[i];
    }
}

/* Other online peers that serve all of [cur, cur+k) and have a higher node
 * ID than ours: among the peers sharing a span, the highest ID moves. */
static int count_outranking(route_swarm *sw, const uint8_t *self_id, int cur, int k)
{
    route_stage *st = route_swarm_stage(sw, cur);
    int n = 0;
    for (int h = 0; st && h < st->n_holders; h++) {
        const route_holder *ho = &st->holders[h];
        if (ho->ann.state != PEER_STATE_ONLINE || memcmp(ho->rep.id, self_id, DHT_ID_LEN) <= 0)
            continue;
        int all = 1;
        for (int i = cur + 1; i < cur + k && all; i++) {
            const route_holder *o = route_swarm_find_holder(sw, i, ho->rep.id);
            all = o && o->ann.state == PEER_STATE_ONLINE;
        }
        n += all;
    }
    return n;
}

static void on_rebalance(uv_timer_t *t);

static void schedule_rebalance(run_ctx *r, double seconds)
{
    /* +-50% jitter so peers that started together do not re-check together. */
    double s = seconds * (0.5 + route_rand01(&r->rng));
    uv_timer_start(&r->rebalance, on_rebalance, (uint64_t)(s * 1000), 0);
}

static void on_moved(int status, void *arg)
{
    run_ctx *r = arg;
    char err[512];
    r->daemon = NULL;
    r->moving = 0;
    if (status != 0)
        fprintf(stderr, "starling peer: warning: checkpoints before the move failed\n");
    if (r->stopping) {
        close_handles(r);
        fprintf(stderr, "starling peer: stopped\n");
        return;
    }
    set_span(r, r->next);
    if (start_daemon(r, err, sizeof err) != 0) {
        fprintf(stderr, "starling peer: cannot restart after the move: %s\n", err);
        r->status = CLI_EXIT_FAIL;
        close_handles(r);
        return;
    }
    schedule_rebalance(r, r->rebalance_every);
}

/* Every rebalance_every seconds: look up every stage again, then decide
 * whether our span should move (routing/balance.h). */
static void on_rebalance(uv_timer_t *t)
{
    run_ctx *r = t->data;
    if (r->stopping || r->moving || !r->daemon)
        return;
    double now = (double)uv_now(&r->loop) / 1000.0;
    if (!r->eval_pending) {
        if (!r->sw)
            r->sw = route_swarm_create(peer_daemon_dht(r->daemon), r->spec, 1e9);
        if (!r->sw) {
            schedule_rebalance(r, r->rebalance_every);
            return;
        }
        for (int i = 0; i < r->spec->n_stages; i++)
            route_swarm_invalidate(r->sw, i);
        route_swarm_refresh(r->sw, now);
        r->eval_pending = 1;
        uv_timer_start(&r->rebalance, on_rebalance, 1000, 0);
        return;
    }
    double tput[64] = {0};
    int holders[64] = {0};
    for (int i = 0; i < r->spec->n_stages; i++)
        if (route_swarm_stage(r->sw, i)->pending) {
            uv_timer_start(&r->rebalance, on_rebalance, 1000, 0);
            return;
        }
    stage_scores(r->sw, r->spec, r->ident.id, tput, holders);
    r->eval_pending = 0;
    int to = -1;
    /* A warranted move is left to the highest ID among the peers sharing
     * our span; but a peer with --blocks never moves, so after yielding on
     * three checks in a row we go anyway. */
    int outranked = count_outranking(r->sw, r->ident.id, r->cur, r->auto_k);
    int go = route_balance_should_move(tput, holders, r->spec->n_stages, r->auto_k, r->cur, 0.5, outranked,
                                       &r->rng, &to);
    if (go != 1 && outranked > 0 &&
        route_balance_should_move(tput, holders, r->spec->n_stages, r->auto_k, r->cur, 0.5, 0, &r->rng, &to) == 1)
        go = ++r->yielded >= 3;
    else
        r->yielded = 0;
    if (go == 1) {
        r->yielded = 0;
        char from_s[32], to_s[32];
        int nb[PEER_SERVICE_MAX_BLOCKS];
        for (int i = 0; i < r->auto_k; i++)
            nb[i] = to + i;
        span_string(from_s, sizeof from_s, r->blocks, r->auto_k);
        span_string(to_s, sizeof to_s, nb, r->auto_k);
        fprintf(stderr, "starling peer: moving from stages %s to %s, which the swarm serves much less\n",
                from_s, to_s);
        r->next = to;
        r->moving = 1;
        route_swarm_destroy(&r->sw);
        peer_daemon_stop(r->daemon, on_moved, r);
        return;
    }
    schedule_rebalance(r, r->rebalance_every);
}

/* The first choice of a peer without --blocks: join as a light client, look
 * at every stage, take the least served span. */
static int choose_first_span(run_ctx *r, const char *initial, const char *swarm_key_file, int *start)
{
    if (!initial) {
        *start = 0;
        return 0;
    }
    tools_client cl;
    int rc = tools_client_open(&cl, "peer", initial, NULL, NULL, swarm_key_file, 15);
    if (rc != CLI_EXIT_OK)
        return rc;
    route_swarm *sw = route_swarm_create(cl.d, r->spec, 1e9);
    double tput[64] = {0};
    int holders[64] = {0};
    if (sw) {
        route_swarm_refresh(sw, 0);
        for (int waited = 0; waited < 1000; waited++) {
            int pending = 0;
            for (int i = 0; i < r->spec->n_stages; i++)
                pending |= route_swarm_stage(sw, i)->pending;
            if (!pending)
                break;
            uv_run(&cl.loop, UV_RUN_ONCE);
        }
        stage_scores(sw, r->spec, NULL, tput, holders);
        route_swarm_destroy(&sw);
    }
    tools_client_close(&cl);
    *start = route_balance_choose(tput, r->spec->n_stages, r->auto_k, &r->rng);
    double served = 0;
    for (int i = *start; *start >= 0 && i < *start + r->auto_k; i++)
        served += tput[i];
    fprintf(stderr, "starling peer: chose stages %d-%d, the least served span (%.1f holder-equivalents)\n",
            *start, *start + r->auto_k - 1, served);
    return *start < 0 ? CLI_EXIT_FAIL : 0;
}

int cmd_peer(int argc, char **argv)
{
    enum { O_INITIAL = 256, O_MODEL, O_BLOCKS, O_DEVICE, O_LISTEN, O_ANNOUNCE, O_IDENTITY,
           O_CKPT_DIR, O_CKPT_EVERY, O_SWARM_KEY, O_THREADS, O_BLAS, O_TPRIO, O_INLINE, O_KEEP, O_MAX_BATCH, O_TARGET,
           O_OPT, O_LR, O_SEED, O_METRICS, O_ANN_EVERY, O_ANN_TTL, O_NO_SYNC, O_NUM_BLOCKS, O_REBALANCE, O_AVERAGE,
           O_KEEP_EVERY, O_KEEP_COPIES, O_KEEP_MB, O_GRAD_FACTOR, O_GRAD_MAX, O_GRAD_WARMUP, O_FROZEN,
           O_MAX_CONNS_IP, O_MAX_CONNS, O_IDLE, O_DHT_LIMITS };
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
        {"training-priority", required_argument, NULL, O_TPRIO},
        {"infer-inline-rows", required_argument, NULL, O_INLINE},
        {"keep-activations", required_argument, NULL, O_KEEP},
        {"max-batch", required_argument, NULL, O_MAX_BATCH},
        {"target-batch", required_argument, NULL, O_TARGET},
        {"optimizer", required_argument, NULL, O_OPT},
        {"lr", required_argument, NULL, O_LR},
        {"grad-factor", required_argument, NULL, O_GRAD_FACTOR},
        {"grad-max-norm", required_argument, NULL, O_GRAD_MAX},
        {"grad-warmup", required_argument, NULL, O_GRAD_WARMUP},
        {"frozen-steps", required_argument, NULL, O_FROZEN},
        {"seed", required_argument, NULL, O_SEED},
        {"metrics", required_argument, NULL, O_METRICS},
        {"announce-every", required_argument, NULL, O_ANN_EVERY},
        {"announce-ttl", required_argument, NULL, O_ANN_TTL},
        {"no-state-download", no_argument, NULL, O_NO_SYNC},
        {"num-blocks", required_argument, NULL, O_NUM_BLOCKS},
        {"rebalance-every", required_argument, NULL, O_REBALANCE},
        {"average-every", required_argument, NULL, O_AVERAGE},
        {"keep-every", required_argument, NULL, O_KEEP_EVERY},
        {"keep-copies", required_argument, NULL, O_KEEP_COPIES},
        {"keep-mb", required_argument, NULL, O_KEEP_MB},
        {"max-conns-per-ip", required_argument, NULL, O_MAX_CONNS_IP},
        {"max-conns", required_argument, NULL, O_MAX_CONNS},
        {"idle-timeout", required_argument, NULL, O_IDLE},
        {"dht-limits", required_argument, NULL, O_DHT_LIMITS},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *initial = NULL, *model = "fmnist-mlp", *blocks_s = NULL, *device = "cpu";
    const char *listen = "127.0.0.1:0", *announce_host = NULL, *identity = NULL;
    const char *ckpt_dir = NULL, *swarm_key_file = NULL, *metrics = NULL, *optimizer = "adamw";
    long threads = 1, blas = 0, max_batch = 256, target = 128, seed = 0, inline_rows = 0, keep = 16;
    int train_idle = 0;
    double ckpt_every = 300, lr = -1, ann_every = 20, ann_ttl = 60, rebalance = 60, average = 30;
    struct expert_guard_config guard = {0}; /* zeros: the defaults (expert/guard.h) */
    long num_blocks = 0, keep_copies = 2, keep_mb = 2048;
    double keep_every = 60;
    long max_conns_ip = 64, max_conns = 1024;
    double idle_timeout = 120;
    int dht_limits = -1; /* -1: STARLING_DHT_LIMITS, else public (dht_config_default) */
    int c, no_sync = 0;

    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        switch (c) {
        case 'h': fputs(peer_help, stdout); fputs(peer_help2, stdout); return CLI_EXIT_OK;
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
        case O_NUM_BLOCKS:
            if (cli_parse_long("peer", "--num-blocks", optarg, 1, PEER_SERVICE_MAX_BLOCKS, &num_blocks))
                return CLI_EXIT_USAGE;
            break;
        case O_AVERAGE:
            if (cli_parse_double("peer", "--average-every", optarg, 0, 86400, &average))
                return CLI_EXIT_USAGE;
            break;
        case O_KEEP_EVERY:
            if (cli_parse_double("peer", "--keep-every", optarg, 0, 86400, &keep_every))
                return CLI_EXIT_USAGE;
            break;
        case O_KEEP_COPIES:
            if (cli_parse_long("peer", "--keep-copies", optarg, 1, 64, &keep_copies))
                return CLI_EXIT_USAGE;
            break;
        case O_KEEP_MB:
            if (cli_parse_long("peer", "--keep-mb", optarg, 1, 1L << 20, &keep_mb))
                return CLI_EXIT_USAGE;
            break;
        case O_REBALANCE:
            if (cli_parse_double("peer", "--rebalance-every", optarg, 0, 86400, &rebalance))
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
        case O_TPRIO:
            if (!strcmp(optarg, "low"))
                train_idle = 0;
            else if (!strcmp(optarg, "idle"))
                train_idle = 1;
            else
                return cli_usage_error("peer", "--training-priority takes low or idle, not '%s'", optarg);
            break;
        case O_KEEP:
            if (cli_parse_long("peer", "--keep-activations", optarg, 0, PEER_BATCHER_MAX_KEEP, &keep))
                return CLI_EXIT_USAGE;
            break;
        case O_INLINE:
            if (cli_parse_long("peer", "--infer-inline-rows", optarg, 0, 256, &inline_rows))
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
        case O_GRAD_FACTOR:
        case O_GRAD_MAX: {
            double x;
            if (cli_parse_double("peer", c == O_GRAD_FACTOR ? "--grad-factor" : "--grad-max-norm", optarg,
                                 0, 1e30, &x))
                return CLI_EXIT_USAGE;
            *(c == O_GRAD_FACTOR ? &guard.factor : &guard.max_norm) = x > 0 ? x : -1; /* 0: off */
            break;
        }
        case O_GRAD_WARMUP:
        case O_FROZEN: {
            long x;
            if (cli_parse_long("peer", c == O_FROZEN ? "--frozen-steps" : "--grad-warmup", optarg, 1, 1 << 30, &x))
                return CLI_EXIT_USAGE;
            *(c == O_FROZEN ? &guard.frozen_steps : &guard.warmup) = (int)x;
            break;
        }
        case O_SEED:
            if (cli_parse_long("peer", "--seed", optarg, 0, LONG_MAX, &seed))
                return CLI_EXIT_USAGE;
            break;
        case O_MAX_CONNS_IP:
            if (cli_parse_long("peer", "--max-conns-per-ip", optarg, 1, 65536, &max_conns_ip))
                return CLI_EXIT_USAGE;
            break;
        case O_MAX_CONNS:
            if (cli_parse_long("peer", "--max-conns", optarg, 1, 65536, &max_conns))
                return CLI_EXIT_USAGE;
            break;
        case O_IDLE:
            if (cli_parse_double("peer", "--idle-timeout", optarg, 1, 86400, &idle_timeout))
                return CLI_EXIT_USAGE;
            break;
        case O_DHT_LIMITS:
            if ((dht_limits = parse_dht_limits(optarg)) < 0)
                return cli_usage_error("peer", "--dht-limits takes public, all or off, not '%s'", optarg);
            break;
        default: return cli_bad_option("peer", c, argv);
        }
    }
    if (cli_no_positional("peer", argc, argv))
        return CLI_EXIT_USAGE;
    const char *env_limits = getenv("STARLING_DHT_LIMITS");
    if (dht_limits < 0 && env_limits && parse_dht_limits(env_limits) < 0)
        fprintf(stderr, "starling peer: warning: STARLING_DHT_LIMITS='%s' is not public, all or off; using public\n",
                env_limits);

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
    static run_ctx r;
    memset(&r, 0, sizeof r);
    r.spec = spec;
    r.device_desc = dev.desc;
    int nb = 0;
    if (blocks_s) {
        if (num_blocks)
            return cli_usage_error("peer", "give --blocks or --num-blocks, not both");
        nb = parse_blocks(blocks_s, r.blocks, PEER_SERVICE_MAX_BLOCKS);
        if (nb <= 0)
            return cli_usage_error("peer", "--blocks '%s' is not a list like 1,2 or 1-3", blocks_s);
        for (int i = 0; i < nb; i++)
            if (r.blocks[i] >= spec->n_stages)
                return cli_usage_error("peer", "model %s has stages 0..%d, not %d", spec->name,
                                       spec->n_stages - 1, r.blocks[i]);
    } else {
        r.auto_k = num_blocks ? (int)num_blocks : (spec->n_stages < 2 ? spec->n_stages : 2);
        if (r.auto_k > spec->n_stages)
            return cli_usage_error("peer", "--num-blocks %d: model %s has only %d stages", r.auto_k,
                                   spec->name, spec->n_stages);
    }
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
    if (inline_rows > max_batch)
        return cli_usage_error("peer", "--infer-inline-rows (%ld) cannot exceed --max-batch (%ld)", inline_rows,
                               max_batch);
    if (lr > 0)
        optim.lr = (float)lr;
    optim.target_batch = (int)target;

    if (identity) {
        rc = dht_identity_load(&r.ident, identity);
        if (rc != 0)
            return cli_fail("peer", "cannot load identity '%s': %s", identity, dht_identity_strerror(rc));
    } else if (dht_identity_generate(&r.ident) != 0) {
        return cli_fail("peer", "cannot create an identity");
    }
    if (swarm_key_file) {
        rc = dht_swarm_key_load(r.swarm_key, swarm_key_file);
        if (rc != 0) {
            sodium_memzero(&r.ident, sizeof r.ident);
            return cli_fail("peer", "cannot load swarm key '%s': %s", swarm_key_file,
                            rc == -EPERM ? "readable by group or others; chmod 600 it"
                            : rc == -EBADMSG ? "expected 64 hex digits"
                                             : strerror(-rc));
        }
    }
    if (blas > 0)
        expert_blas_set_threads((int)blas);
    r.rng = ((uint64_t)r.ident.id[0] << 24 | (uint64_t)r.ident.id[1] << 16 | (uint64_t)r.ident.id[2] << 8 |
             r.ident.id[3]) + 1;
    r.rebalance_every = rebalance;
    snprintf(r.listen, sizeof r.listen, "%s", listen);

    peer_daemon_config *dc = &r.dc;
    dc->swarm_key = swarm_key_file ? r.swarm_key : NULL;
    dc->announce_host = announce_host;
    dc->initial = peers;
    dc->n_initial = (size_t)np;
    dc->svc.model = spec->name;
    dc->svc.blocks = r.blocks;
    dc->svc.n_blocks = nb;
    dc->svc.threads = (int)threads;
    dc->svc.max_batch = (int)max_batch;
    dc->svc.max_queue_rows = (int)max_batch * 8;
    dc->svc.train_idle = train_idle;
    dc->svc.infer_inline_rows = (int)inline_rows;
    dc->svc.keep_activations = (int)keep;
    dc->svc.optim = optim;
    dc->svc.guard = guard;
    dc->svc.seed = (uint64_t)seed;
    dc->svc.checkpoint_dir = ckpt_dir;
    dc->svc.rpc_max_conns = (int)max_conns;
    dc->svc.rpc_max_conns_per_ip = (int)max_conns_ip;
    dc->svc.rpc_idle_timeout_ms = (uint64_t)(idle_timeout * 1000);
    dc->dht_diversity_given = dht_limits >= 0;
    dc->dht_diversity = dht_limits >= 0 ? dht_limits : DHT_DIVERSITY_PUBLIC;
    dc->device = "cpu";
    dc->checkpoint_every_s = ckpt_dir ? ckpt_every : 0;
    dc->metrics_listen = metrics;
    dc->announce_every_s = ann_every;
    dc->no_state_download = no_sync;
    dc->average_every_s = average;
    dc->keep_every_s = keep_every;
    dc->keep_copies = (int)keep_copies;
    dc->keep_max_bytes = (size_t)keep_mb << 20;
    dc->ttl_s = ann_ttl;
    dc->on_refused = on_refused;
    dc->refused_arg = &r;
    if (r.auto_k) {
        int start = 0;
        rc = choose_first_span(&r, initial, swarm_key_file, &start);
        if (rc != 0) {
            sodium_memzero(&r.ident, sizeof r.ident);
            sodium_memzero(r.swarm_key, sizeof r.swarm_key);
            return rc;
        }
        set_span(&r, start);
    }
    if (uv_loop_init(&r.loop) != 0)
        return cli_fail("peer", "cannot create the event loop");
    if (start_daemon(&r, err, sizeof err) != 0) {
        sodium_memzero(&r.ident, sizeof r.ident);
        sodium_memzero(r.swarm_key, sizeof r.swarm_key);
        uv_run(&r.loop, UV_RUN_DEFAULT); /* let failed handles close */
        uv_loop_close(&r.loop);
        return cli_fail("peer", "%s", err);
    }
    uv_signal_init(&r.loop, &r.sigint);
    uv_signal_init(&r.loop, &r.sigterm);
    uv_timer_init(&r.loop, &r.rebalance);
    r.sigint.data = r.sigterm.data = r.rebalance.data = &r;
    uv_signal_start(&r.sigint, on_signal, SIGINT);
    uv_signal_start(&r.sigterm, on_signal, SIGTERM);
    if (r.auto_k && r.rebalance_every > 0)
        schedule_rebalance(&r, r.rebalance_every);
    /* With idle-priority training, a longer time slice for this (network)
     * thread keeps inference's tail under load down (peer/timeslice.h);
     * best effort: a kernel without the call just keeps its default. */
    if (train_idle)
        (void)peer_sched_set_slice(PEER_LOOP_SLICE_NS);
    uv_run(&r.loop, UV_RUN_DEFAULT);
    /* The loop ends while handles are open only when the daemon stopped it
     * (uv_stop): it refuses to go on, e.g. another peer is online with our
     * identity (it has said so). Stop it as for a signal; exit 1. */
    while (uv_loop_alive(&r.loop)) {
        r.refused = 1;
        if (!r.stopping) {
            r.stopping = 1;
            uv_timer_stop(&r.rebalance);
            route_swarm_destroy(&r.sw);
            if (r.daemon)
                peer_daemon_stop(r.daemon, on_stopped, &r);
        }
        uv_run(&r.loop, UV_RUN_DEFAULT);
    }
    if (r.refused)
        r.status = CLI_EXIT_FAIL;
    route_swarm_destroy(&r.sw);
    sodium_memzero(&r.ident, sizeof r.ident);
    sodium_memzero(r.swarm_key, sizeof r.swarm_key);
    if (uv_loop_close(&r.loop) != 0)
        fprintf(stderr, "starling peer: warning: handles left open at exit\n");
    return r.status;
}
