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
#include "peer/allreduce.h"
#include "peer/daemon.h"
#include "peer/peer.h"
#include "net/tensorfmt.h"
#include "peer/timeslice.h"
#include "peer/rebalance.h"
#include "tools/cli.h"
#include "tools/client.h"

static const char peer_help[] =
    "Usage: starling peer [--blocks LIST | --num-blocks K] [--initial-peers ADDR[,ADDR...]]\n"
    "                     [--model NAME | --model-file FILE]\n"
    "                     [--listen HOST:PORT] [--announce HOST] [--identity FILE]\n"
    "                     [--checkpoint-dir DIR] [--swarm-key FILE] [--device DEV] ...\n"
    "\n"
    "Hosts blocks (stages) of a model, serves forward/backward requests over the\n"
    "encrypted tensor RPC and announces the blocks in the DHT. The DHT (UDP) and\n"
    "the RPC (TCP) share --listen's port. SIGINT or SIGTERM stops it gracefully:\n"
    "it announces itself offline, finishes queued work and writes checkpoints.\n"
    "\n"
    "Options:\n"
    "  --blocks LIST          stage indices to host: 1,2 or 1-3\n"
    "  --num-blocks K         without --blocks: host the K contiguous stages the swarm\n"
    "                         serves least (default: a third of the model's stages,\n"
    "                         rounded up: fmnist-mlp 2, tiny-lm 1), re-checked every\n"
    "                         --rebalance-every S seconds (default 60; 0 off); a peer\n"
    "                         first covers stages that have no holder, otherwise\n"
    "                         moves only to a span served less than half as well\n"
    "                         (holder-equivalents: throughput / fastest holder's)\n"
    "  --initial-peers LIST   DHT peers to join through (from 'starling bootstrap');\n"
    "                         without it this peer starts a new swarm\n"
    "  --model NAME           model to serve (default fmnist-mlp): a built-in, or one\n"
    "                         whose description the swarm's peers publish\n"
    "  --model-file FILE      serve the model a model file describes (docs/models.md);\n"
    "                         others may then join with --model NAME alone\n"
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
    "  --device DEV           where the blocks live and compute: cpu (default), cuda\n"
    "                         (= cuda:0), cuda:N (an NVIDIA GPU), or auto (the first\n"
    "                         GPU when there is one, else the CPU). A stage that\n"
    "                         does not fit in the GPU's free memory is refused\n"
    "                         with the bytes it needs; several stages and several\n"
    "                         peers may share one GPU\n"
    "  --precision P          fp32, or bf16 (a GPU's default): bf16 matrix products\n"
    "                         with fp32 accumulation, fp32 master weights, optimizer\n"
    "                         state, checkpoints and averaging (so state moves freely\n"
    "                         between GPU and CPU peers)\n";
static const char peer_help1b[] =
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
    "                         same peer skips recomputing its forward (default 16,\n"
    "                         a language model 8; 0: stateless, every backward\n"
    "                         recomputes)\n"
    "  --wire-formats LIST    tensor formats accepted from trainers, comma separated:\n"
    "                         f32, f16, bf16, q8 (default all; f32 always); the\n"
    "                         announcement lists them, trainers choose (--wire-format)\n"
    "  --max-batch N          largest request and joined batch, rows (default 256;\n"
    "                         a language model's rows are sequences: tiny-lm 32)\n";
/* In two pieces: C11 compilers need only take 4095-character literals. */
static const char peer_help2[] =
    "  --target-batch N       samples accumulated per optimizer step (default 128;\n"
    "                         tiny-lm 32 sequences, train_lm.py's batch)\n"
    "  --optimizer NAME       adamw (default) or sgd\n"
    "  --lr X                 learning rate (default 1e-3 adamw, 1e-2 sgd)\n"
    "  --grad-factor X        refuse a backward or step whose gradient norm is over X\n"
    "                         times the block's recent norm (default 100; 0 off)\n"
    "  --grad-max-norm X      refuse any gradient norm over X (default 1e5; 0 off)\n"
    "  --grad-warmup N        accepted gradients before --grad-factor applies (20)\n"
    "  --frozen-steps N       steps that change no weight before a block is reported\n"
    "                         frozen (log line, announcement) (default 8)\n"
    "  --seed N               initial weights seed when no checkpoint exists (default 0)\n"
    "  --init-weights FILE    start from a weight file of the whole model instead: a\n"
    "                         FILE.safetensors under GPT-2's Hugging Face names (only\n"
    "                         this peer's tensors are read; F32, BF16, F16, F64), or a\n"
    "                         flat file (float32, stage after stage: train_lm.py\n"
    "                         --save-init's layout); a checkpoint, when there is one, wins\n"
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
    "  --average-every S      average each stage with all its replicas every S\n"
    "                         seconds (default 30; 0 off)\n"
    "  --average-mode MODE    mean (default: the weighted mean of weights and\n"
    "                         optimizer state replaces them) or diloco (average\n"
    "                         only the change since the last round and take an\n"
    "                         outer Nesterov step: 3x less traffic, moments stay\n"
    "                         local); replicas average only with the same mode\n"
    "  --average-format F     how averaging slices travel: f32 (default, exact),\n"
    "                         f16, bf16 or q8[:BLOCK] (2x, 2x, 3.8x fewer bytes;\n"
    "                         rounding error, error feedback in diloco; f16 and\n"
    "                         q8 with diloco only); replicas average only with\n"
    "                         the same format\n"
    "  --outer-lr X           diloco's outer learning rate (default 0.7)\n"
    "  --outer-momentum X     diloco's outer Nesterov momentum (default 0.9)\n"
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

enum {
    O_INITIAL = 256, O_MODEL, O_BLOCKS, O_DEVICE, O_LISTEN, O_ANNOUNCE, O_IDENTITY, O_CKPT_DIR, O_CKPT_EVERY,
    O_SWARM_KEY, O_THREADS, O_BLAS, O_TPRIO, O_INLINE, O_KEEP, O_MAX_BATCH, O_TARGET, O_OPT, O_LR, O_SEED, O_INIT_WEIGHTS,
    O_METRICS, O_ANN_EVERY, O_ANN_TTL, O_NO_SYNC, O_NUM_BLOCKS, O_REBALANCE, O_AVERAGE, O_KEEP_EVERY,
    O_KEEP_COPIES, O_KEEP_MB, O_GRAD_FACTOR, O_GRAD_MAX, O_GRAD_WARMUP, O_FROZEN, O_MAX_CONNS_IP, O_MAX_CONNS,
    O_IDLE, O_DHT_LIMITS, O_MODEL_FILE, O_AVG_MODE, O_OUTER_LR, O_OUTER_MOM,
    O_WIRE_FORMATS, O_AVG_FORMAT, O_PRECISION,
};

static const struct option peer_opts_table[] = {
    {"initial-peers", required_argument, NULL, O_INITIAL},
    {"model", required_argument, NULL, O_MODEL},
    {"model-file", required_argument, NULL, O_MODEL_FILE},
    {"wire-formats", required_argument, NULL, O_WIRE_FORMATS},
    {"blocks", required_argument, NULL, O_BLOCKS},
    {"device", required_argument, NULL, O_DEVICE},
    {"precision", required_argument, NULL, O_PRECISION},
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
    {"init-weights", required_argument, NULL, O_INIT_WEIGHTS},
    {"metrics", required_argument, NULL, O_METRICS},
    {"announce-every", required_argument, NULL, O_ANN_EVERY},
    {"announce-ttl", required_argument, NULL, O_ANN_TTL},
    {"no-state-download", no_argument, NULL, O_NO_SYNC},
    {"num-blocks", required_argument, NULL, O_NUM_BLOCKS},
    {"rebalance-every", required_argument, NULL, O_REBALANCE},
    {"average-every", required_argument, NULL, O_AVERAGE},
    {"average-mode", required_argument, NULL, O_AVG_MODE},
    {"average-format", required_argument, NULL, O_AVG_FORMAT},
    {"outer-lr", required_argument, NULL, O_OUTER_LR},
    {"outer-momentum", required_argument, NULL, O_OUTER_MOM},
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

/* What the flags say, before it is checked. */
typedef struct peer_opts {
    const char *initial, *model, *blocks, *device, *precision, *listen, *announce_host, *identity;
    const char *ckpt_dir, *swarm_key_file, *metrics, *optimizer;
    long threads, blas, max_batch, target, seed, inline_rows, keep;
    long num_blocks, keep_copies, keep_mb, max_conns_ip, max_conns;
    double ckpt_every, lr, ann_every, ann_ttl, rebalance, average, keep_every, idle_timeout;
    struct expert_guard_config guard; /* zeros: the defaults (expert/guard.h) */
    int train_idle;
    int dht_limits;                   /* -1: STARLING_DHT_LIMITS, else public (dht_config_default) */
    int no_sync;
    const char *model_file;
    const char *init_weights;
    peer_fmt_mask wire_formats;       /* 0: all */
    int avg_mode;                     /* enum peer_avg_mode */
    peer_fmt avg_fmt;                 /* --average-format (f32) */
    int avg_fmt_block;                /* its q8 block, else 0 */
    double outer_lr, outer_mom;       /* -1: not given (the defaults) */
} peer_opts;

static const peer_opts peer_opts_default = {
    .device = "cpu", .listen = "127.0.0.1:0", .optimizer = "adamw",
    .threads = 1, .max_batch = 0, .target = 0, .keep = -1, /* 0, -1: the model's defaults */
    .keep_copies = 2, .keep_mb = 2048, .max_conns_ip = 64, .max_conns = 1024,
    .ckpt_every = 300, .lr = -1, .ann_every = 20, .ann_ttl = 60, .rebalance = 60, .average = 30,
    .keep_every = 60, .idle_timeout = 120,
    .dht_limits = -1, .outer_lr = -1, .outer_mom = -1,
};

/* A flag with a numeric value. Returns 0, CLI_EXIT_USAGE (said why), or -1
 * when c is not such a flag. */
static int parse_number_flag(int c, const char *arg, peer_opts *o)
{
    switch (c) {
    case O_CKPT_EVERY: return cli_parse_double("peer", "--checkpoint-every", arg, 0, 1e7, &o->ckpt_every);
    case O_NUM_BLOCKS:
        return cli_parse_long("peer", "--num-blocks", arg, 1, PEER_SERVICE_MAX_BLOCKS, &o->num_blocks);
    case O_AVERAGE: return cli_parse_double("peer", "--average-every", arg, 0, 86400, &o->average);
    case O_OUTER_LR: return cli_parse_double("peer", "--outer-lr", arg, 1e-6, 100, &o->outer_lr);
    case O_OUTER_MOM: return cli_parse_double("peer", "--outer-momentum", arg, 0, 0.999, &o->outer_mom);
    case O_KEEP_EVERY: return cli_parse_double("peer", "--keep-every", arg, 0, 86400, &o->keep_every);
    case O_KEEP_COPIES: return cli_parse_long("peer", "--keep-copies", arg, 1, 64, &o->keep_copies);
    case O_KEEP_MB: return cli_parse_long("peer", "--keep-mb", arg, 1, 1L << 20, &o->keep_mb);
    case O_REBALANCE: return cli_parse_double("peer", "--rebalance-every", arg, 0, 86400, &o->rebalance);
    case O_ANN_EVERY: return cli_parse_double("peer", "--announce-every", arg, 0.1, 3600, &o->ann_every);
    case O_ANN_TTL: return cli_parse_double("peer", "--announce-ttl", arg, 1, 86400, &o->ann_ttl);
    case O_THREADS: return cli_parse_long("peer", "--threads", arg, 1, 64, &o->threads);
    case O_BLAS: return cli_parse_long("peer", "--blas-threads", arg, 1, 256, &o->blas);
    case O_KEEP: return cli_parse_long("peer", "--keep-activations", arg, 0, PEER_BATCHER_MAX_KEEP, &o->keep);
    case O_INLINE: return cli_parse_long("peer", "--infer-inline-rows", arg, 0, 256, &o->inline_rows);
    case O_MAX_BATCH: return cli_parse_long("peer", "--max-batch", arg, 1, 65536, &o->max_batch);
    case O_TARGET: return cli_parse_long("peer", "--target-batch", arg, 1, 1 << 24, &o->target);
    case O_LR: return cli_parse_double("peer", "--lr", arg, 1e-12, 10, &o->lr);
    case O_GRAD_FACTOR:
    case O_GRAD_MAX: {
        double x;
        if (cli_parse_double("peer", c == O_GRAD_FACTOR ? "--grad-factor" : "--grad-max-norm", arg, 0, 1e30, &x))
            return CLI_EXIT_USAGE;
        *(c == O_GRAD_FACTOR ? &o->guard.factor : &o->guard.max_norm) = x > 0 ? x : -1; /* 0: off */
        return 0;
    }
    case O_GRAD_WARMUP:
    case O_FROZEN: {
        long x;
        if (cli_parse_long("peer", c == O_FROZEN ? "--frozen-steps" : "--grad-warmup", arg, 1, 1 << 30, &x))
            return CLI_EXIT_USAGE;
        *(c == O_FROZEN ? &o->guard.frozen_steps : &o->guard.warmup) = (int)x;
        return 0;
    }
    case O_SEED: return cli_parse_long("peer", "--seed", arg, 0, LONG_MAX, &o->seed);
    case O_MAX_CONNS_IP: return cli_parse_long("peer", "--max-conns-per-ip", arg, 1, 65536, &o->max_conns_ip);
    case O_MAX_CONNS: return cli_parse_long("peer", "--max-conns", arg, 1, 65536, &o->max_conns);
    case O_IDLE: return cli_parse_double("peer", "--idle-timeout", arg, 1, 86400, &o->idle_timeout);
    default: return -1;
    }
}

/* Fills o from the command line. Returns -1 to go on, or the exit status:
 * CLI_EXIT_OK after --help, CLI_EXIT_USAGE for a bad flag (said why). */
static int parse_peer_flags(int argc, char **argv, peer_opts *o)
{
    int c;
    *o = peer_opts_default;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", peer_opts_table, NULL)) != -1) {
        int rc = parse_number_flag(c, optarg, o);
        if (rc > 0)
            return rc;
        if (rc == 0)
            continue;
        switch (c) {
        case 'h': fputs(peer_help, stdout); fputs(peer_help1b, stdout); fputs(peer_help2, stdout); return CLI_EXIT_OK;
        case O_NO_SYNC: o->no_sync = 1; break;
        case O_INITIAL: o->initial = optarg; break;
        case O_MODEL: o->model = optarg; break;
        case O_MODEL_FILE: o->model_file = optarg; break;
        case O_INIT_WEIGHTS: o->init_weights = optarg; break;
        case O_BLOCKS: o->blocks = optarg; break;
        case O_DEVICE: o->device = optarg; break;
        case O_PRECISION: o->precision = optarg; break;
        case O_LISTEN: o->listen = optarg; break;
        case O_ANNOUNCE: o->announce_host = optarg; break;
        case O_IDENTITY: o->identity = optarg; break;
        case O_CKPT_DIR: o->ckpt_dir = optarg; break;
        case O_SWARM_KEY: o->swarm_key_file = optarg; break;
        case O_METRICS: o->metrics = optarg; break;
        case O_OPT: o->optimizer = optarg; break;
        case O_WIRE_FORMATS:
            if (peer_tensorfmt_mask_parse(optarg, &o->wire_formats) != 0)
                return cli_usage_error("peer", "--wire-formats takes a comma-separated list of f32, f16, bf16 and q8, "
                                       "not '%s'", optarg);
            break;
        case O_TPRIO:
            if (!strcmp(optarg, "low"))
                o->train_idle = 0;
            else if (!strcmp(optarg, "idle"))
                o->train_idle = 1;
            else
                return cli_usage_error("peer", "--training-priority takes low or idle, not '%s'", optarg);
            break;
        case O_DHT_LIMITS:
            if ((o->dht_limits = parse_dht_limits(optarg)) < 0)
                return cli_usage_error("peer", "--dht-limits takes public, all or off, not '%s'", optarg);
            break;
        case O_AVG_MODE:
            if (!strcmp(optarg, "mean"))
                o->avg_mode = PEER_AVG_MEAN;
            else if (!strcmp(optarg, "diloco"))
                o->avg_mode = PEER_AVG_DILOCO;
            else
                return cli_usage_error("peer", "--average-mode takes mean or diloco, not '%s'", optarg);
            break;
        case O_AVG_FORMAT:
            if (peer_tensorfmt_spec_parse(optarg, &o->avg_fmt, &o->avg_fmt_block) != 0)
                return cli_usage_error("peer", "--average-format takes f32, f16, bf16, q8 or q8:BLOCK (BLOCK a power "
                                       "of two from 16 to 4096), not '%s'", optarg);
            break;
        default: return cli_bad_option("peer", c, argv);
        }
    }
    if (cli_no_positional("peer", argc, argv))
        return CLI_EXIT_USAGE;
    if (o->avg_mode != PEER_AVG_DILOCO && (o->outer_lr >= 0 || o->outer_mom >= 0))
        return cli_usage_error("peer", "--outer-lr and --outer-momentum apply to --average-mode diloco only");
    /* Mean mode averages AdamW's second moments too: f16 flushes the small
     * ones to 0 and q8 rounds those under 1/254 of their block's largest
     * to 0, and a zero second moment next to a nonzero first one makes a
     * step of up to lr * m / eps. bf16 keeps float32's range. */
    if (o->avg_mode != PEER_AVG_DILOCO && (o->avg_fmt == PEER_FMT_F16 || o->avg_fmt == PEER_FMT_Q8))
        return cli_usage_error("peer", "--average-format %s needs --average-mode diloco: mean mode averages AdamW's "
                               "second moments, which %s rounds to 0 when small; use bf16 (or f32) with mean",
                               peer_tensorfmt_name(o->avg_fmt), peer_tensorfmt_name(o->avg_fmt));
    return -1;
}

typedef struct run_ctx {
    uv_loop_t loop;
    uv_signal_t sigint, sigterm;
    peer_daemon *daemon;          /* with --blocks: the daemon */
    route_rebalance *rb;          /* without: the rebalancer, which owns the daemon */
    peer_daemon_config dc;
    const struct expert_model_spec *spec;
    peer_device dev;
    const expert_backend *be;     /* dev's, at --precision */
    struct expert_optim optim;
    dht_identity ident;
    uint8_t swarm_key[32];
    int blocks[PEER_SERVICE_MAX_BLOCKS];
    int n_blocks;                 /* --blocks given: how many */
    int auto_k;                   /* 0: --blocks given; else span length */
    long max_batch, target, keep; /* the flags, or the model's defaults */
    dht_peer_addr peers[64];
    int n_peers;
    char listen[96];
    uint64_t rng;
    int stopping;
    int refused;                  /* the daemon would not go on (it said why) */
    int status;
} run_ctx;

/* --blocks or --num-blocks against the model, into r. Returns -1 to go on,
 * or CLI_EXIT_USAGE (said why). */
static int check_blocks(const peer_opts *o, run_ctx *r)
{
    const struct expert_model_spec *spec = r->spec;
    if (o->blocks) {
        if (o->num_blocks)
            return cli_usage_error("peer", "give --blocks or --num-blocks, not both");
        r->n_blocks = parse_blocks(o->blocks, r->blocks, PEER_SERVICE_MAX_BLOCKS);
        if (r->n_blocks <= 0)
            return cli_usage_error("peer", "--blocks '%s' is not a list like 1,2 or 1-3", o->blocks);
        for (int i = 0; i < r->n_blocks; i++)
            if (r->blocks[i] >= spec->n_stages)
                return cli_usage_error("peer", "model %s has stages 0..%d, not %d", spec->name,
                                       spec->n_stages - 1, r->blocks[i]);
        return -1;
    }
    /* By default a third of the model (rounded up), so three peers hold it
     * all: fmnist-mlp 2 of 6 stages, tiny-lm 1 of 3. */
    r->auto_k = o->num_blocks ? (int)o->num_blocks : (spec->n_stages + 2) / 3;
    if (r->auto_k > spec->n_stages)
        return cli_usage_error("peer", "--num-blocks %d: model %s has only %d stages", r->auto_k, spec->name,
                               spec->n_stages);
    return -1;
}

/* Checks everything the flags say before touching the network, filling r.
 * Returns -1 to go on, or the exit status (said why). */
static int check_peer_opts(const peer_opts *o, run_ctx *r)
{
    const char *env_limits = getenv("STARLING_DHT_LIMITS");
    if (o->dht_limits < 0 && env_limits && parse_dht_limits(env_limits) < 0)
        fprintf(stderr, "starling peer: warning: STARLING_DHT_LIMITS='%s' is not public, all or off; using public\n",
                env_limits);
    char err[512];
    int rc = peer_device_parse(o->device, &r->dev, err, sizeof err);
    if (rc == -EINVAL)
        return cli_usage_error("peer", "%s", err);
    if (rc != 0)
        return cli_fail("peer", "%s", err);
    int precision = peer_device_precision(&r->dev, o->precision, err, sizeof err);
    if (precision < 0)
        return cli_usage_error("peer", "%s", err);
    if ((rc = peer_device_open(&r->dev, precision, &r->be, err, sizeof err)) != 0)
        return cli_fail("peer", "%s", err);
    if ((rc = tools_model_select("peer", o->model, o->model_file, "fmnist-mlp", o->initial, o->swarm_key_file,
                                 &r->spec)) != CLI_EXIT_OK)
        return rc;
    if ((rc = check_blocks(o, r)) >= 0)
        return rc;
    /* A language model's rows are whole sequences: fewer per batch, and
     * fewer kept forwards (each holds every layer's activations). */
    int seq = r->spec->task == EXPERT_TASK_BYTES;
    r->max_batch = o->max_batch ? o->max_batch : r->spec->max_batch > 0 ? r->spec->max_batch : 256;
    r->target = o->target ? o->target : r->spec->batch > 0 ? r->spec->batch : 128;
    r->keep = o->keep >= 0 ? o->keep : seq ? 8 : 16;
    if (o->initial) {
        r->n_peers = dht_peer_list_parse(r->peers, 64, o->initial);
        if (r->n_peers < 0)
            return cli_usage_error("peer", "--initial-peers '%s' is not a list of HOST:PORT[/ID]", o->initial);
    }
    dht_addr la;
    if (dht_addr_parse_listen(&la, o->listen) != 0)
        return cli_usage_error("peer", "--listen '%s' is not HOST:PORT (numeric host)", o->listen);
    if (!strcmp(o->optimizer, "adamw"))
        expert_optim_default_adamw(&r->optim);
    else if (!strcmp(o->optimizer, "sgd"))
        expert_optim_default_sgd(&r->optim);
    else
        return cli_usage_error("peer", "--optimizer must be adamw or sgd, not '%s'", o->optimizer);
    if (o->ann_ttl <= o->ann_every)
        return cli_usage_error("peer", "--announce-ttl (%g s) must be longer than --announce-every (%g s)",
                               o->ann_ttl, o->ann_every);
    if (o->inline_rows > r->max_batch)
        return cli_usage_error("peer", "--infer-inline-rows (%ld) cannot exceed --max-batch (%ld)",
                               o->inline_rows, r->max_batch);
    if (o->lr > 0)
        r->optim.lr = (float)o->lr;
    r->optim.target_batch = (int)r->target;
    return -1;
}

static void wipe_keys(run_ctx *r)
{
    sodium_memzero(&r->ident, sizeof r->ident);
    sodium_memzero(r->swarm_key, sizeof r->swarm_key);
}

/* --identity (or a new one) and --swarm-key into r. Returns -1 to go on, or
 * CLI_EXIT_FAIL (said why; nothing left in memory). */
static int load_keys(const peer_opts *o, run_ctx *r)
{
    int rc;
    if (o->identity) {
        rc = dht_identity_load(&r->ident, o->identity);
        if (rc != 0)
            return cli_fail("peer", "cannot load identity '%s': %s", o->identity, dht_identity_strerror(rc));
    } else if (dht_identity_generate(&r->ident) != 0) {
        return cli_fail("peer", "cannot create an identity");
    }
    if (o->swarm_key_file) {
        rc = dht_swarm_key_load(r->swarm_key, o->swarm_key_file);
        if (rc != 0) {
            sodium_memzero(&r->ident, sizeof r->ident);
            return cli_fail("peer", "cannot load swarm key '%s': %s", o->swarm_key_file,
                            dht_swarm_key_strerror(rc));
        }
    }
    return -1;
}

/* The daemon's configuration from the checked flags. */
static void fill_daemon_config(const peer_opts *o, run_ctx *r)
{
    peer_daemon_config *dc = &r->dc;
    dc->ident = &r->ident;
    dc->listen = r->listen;
    dc->swarm_key = o->swarm_key_file ? r->swarm_key : NULL;
    dc->announce_host = o->announce_host;
    dc->initial = r->peers;
    dc->n_initial = (size_t)r->n_peers;
    dc->svc.model = r->spec->name;
    dc->svc.blocks = r->blocks;
    dc->svc.n_blocks = r->n_blocks;
    dc->svc.threads = (int)o->threads;
    dc->svc.max_batch = (int)r->max_batch;
    dc->svc.max_queue_rows = (int)r->max_batch * 8;
    dc->svc.train_idle = o->train_idle;
    dc->svc.infer_inline_rows = (int)o->inline_rows;
    dc->svc.keep_activations = (int)r->keep;
    dc->svc.formats = o->wire_formats;
    dc->svc.optim = r->optim;
    dc->svc.guard = o->guard;
    dc->svc.seed = (uint64_t)o->seed;
    dc->svc.init_weights = o->init_weights;
    dc->svc.checkpoint_dir = o->ckpt_dir;
    dc->svc.rpc_max_conns = (int)o->max_conns;
    dc->svc.rpc_max_conns_per_ip = (int)o->max_conns_ip;
    dc->svc.rpc_idle_timeout_ms = (uint64_t)(o->idle_timeout * 1000);
    dc->dht_diversity_given = o->dht_limits >= 0;
    dc->dht_diversity = o->dht_limits >= 0 ? o->dht_limits : DHT_DIVERSITY_PUBLIC;
    dc->device = r->dev.name;
    dc->precision = r->be->precision;
    dc->svc.backend = r->be;
    dc->checkpoint_every_s = o->ckpt_dir ? o->ckpt_every : 0;
    dc->metrics_listen = o->metrics;
    dc->announce_every_s = o->ann_every;
    dc->no_state_download = o->no_sync;
    dc->average_every_s = o->average;
    dc->average_mode = o->avg_mode;
    dc->average_format = (int)o->avg_fmt;
    dc->average_format_block = o->avg_fmt_block;
    dc->outer_lr = o->outer_lr >= 0 ? o->outer_lr : PEER_AVG_OUTER_LR;
    dc->outer_momentum = o->outer_mom >= 0 ? o->outer_mom : PEER_AVG_OUTER_MOMENTUM;
    dc->keep_every_s = o->keep_every;
    dc->keep_copies = (int)o->keep_copies;
    dc->keep_max_bytes = (size_t)o->keep_mb << 20;
    dc->ttl_s = o->ann_ttl;
}

static void close_handles(run_ctx *r)
{
    uv_close((uv_handle_t *)&r->sigint, NULL);
    uv_close((uv_handle_t *)&r->sigterm, NULL);
}

/* The daemon (or the rebalancer with it) has stopped with status. */
static void serving_stopped(run_ctx *r, int status)
{
    r->status = status == 0 && !r->refused ? CLI_EXIT_OK : CLI_EXIT_FAIL;
    close_handles(r);
    fprintf(stderr, "starling peer: stopped\n");
}

static void on_daemon_stopped(int status, void *arg)
{
    run_ctx *r = arg;
    peer_daemon_destroy(&r->daemon);
    serving_stopped(r, status);
}

static void on_rebalance_stopped(void *arg, int status)
{
    run_ctx *r = arg;
    route_rebalance_destroy(&r->rb);
    if (status == ROUTE_REBALANCE_RESTART_FAILED) { /* it said why */
        r->status = CLI_EXIT_FAIL;
        close_handles(r);
        return;
    }
    serving_stopped(r, status);
}

/* Graceful stop of whatever serves: announcing offline, writing checkpoints. */
static void stop_serving(run_ctx *r)
{
    r->stopping = 1;
    if (r->rb)
        route_rebalance_stop(r->rb);
    else if (r->daemon)
        peer_daemon_stop(r->daemon, on_daemon_stopped, r);
}

static void on_signal(uv_signal_t *h, int signum)
{
    run_ctx *r = h->data;
    if (r->stopping) {
        fprintf(stderr, "starling peer: second signal, exiting at once\n");
        exit(CLI_EXIT_FAIL);
    }
    fprintf(stderr, "starling peer: %s received, stopping (announcing offline, writing checkpoints)\n",
            signum == SIGINT ? "SIGINT" : "SIGTERM");
    stop_serving(r);
}

/* The daemon will not go on (another peer runs with our identity): stop as
 * for a signal, and exit 1. */
static void on_refused(void *arg)
{
    run_ctx *r = arg;
    r->refused = 1;
    if (!r->stopping)
        stop_serving(r);
}

/* Prints where the daemon serves (after every start, a move's included). */
static void print_serving(run_ctx *r, peer_daemon *d, const int *blocks, int n_blocks)
{
    char addr[128], span[32];
    peer_daemon_peer_string(d, addr, sizeof addr);
    if (r->auto_k)
        route_rebalance_span_name(span, sizeof span, blocks[0], n_blocks);
    printf("starling peer: serving %s stages %s on %s (%s)\n", r->spec->name, r->auto_k ? span : "(as listed)",
           addr, r->dev.desc);
    printf("starling peer: address %s\n", addr);
    fflush(stdout);
}

static void on_rebalance_started(void *arg, peer_daemon *d, const int *blocks, int n_blocks)
{
    print_serving(arg, d, blocks, n_blocks);
}

/* The first span of a peer without --blocks: join as a light client and
 * take the least served span (peer/rebalance.h); stage 0 on in a new
 * swarm. Returns -1 to go on, or the exit status. */
static int choose_first_span(run_ctx *r, const peer_opts *o, int *start)
{
    *start = 0;
    if (!o->initial)
        return -1;
    tools_client cl;
    int rc = tools_client_open(&cl, "peer", o->initial, NULL, NULL, o->swarm_key_file, 15);
    if (rc != CLI_EXIT_OK)
        return rc;
    *start = route_rebalance_first_span(cl.d, &cl.loop, r->spec, r->auto_k, &r->rng, r->dc.log);
    tools_client_close(&cl);
    return *start < 0 ? CLI_EXIT_FAIL : -1;
}

/* Starts the daemon, or the rebalancer that starts it at `start`. */
static int start_serving(run_ctx *r, const peer_opts *o, int start, char *err, size_t errlen)
{
    if (!r->auto_k) {
        r->daemon = peer_daemon_start(&r->loop, &r->dc, err, errlen);
        if (!r->daemon)
            return -1;
        print_serving(r, r->daemon, r->blocks, r->n_blocks);
        return 0;
    }
    route_rebalance_config rc = {
        .dc = &r->dc,
        .spec = r->spec,
        .k = r->auto_k,
        .start = start,
        .every_s = o->rebalance,
        .rng = r->rng,
        .on_started = on_rebalance_started,
        .on_stopped = on_rebalance_stopped,
        .arg = r,
    };
    r->rb = route_rebalance_start(&r->loop, &rc, err, errlen);
    return r->rb ? 0 : -1;
}

/* Serves until a signal, or the daemon refuses to go on. Returns the exit
 * status. */
static int run_peer(run_ctx *r, const peer_opts *o)
{
    char err[512];
    int start = 0, rc;
    if (r->auto_k && (rc = choose_first_span(r, o, &start)) >= 0) {
        wipe_keys(r);
        return rc;
    }
    if (uv_loop_init(&r->loop) != 0)
        return cli_fail("peer", "cannot create the event loop");
    if (start_serving(r, o, start, err, sizeof err) != 0) {
        wipe_keys(r);
        uv_run(&r->loop, UV_RUN_DEFAULT); /* let failed handles close */
        uv_loop_close(&r->loop);
        return cli_fail("peer", "%s", err);
    }
    uv_signal_init(&r->loop, &r->sigint);
    uv_signal_init(&r->loop, &r->sigterm);
    r->sigint.data = r->sigterm.data = r;
    uv_signal_start(&r->sigint, on_signal, SIGINT);
    uv_signal_start(&r->sigterm, on_signal, SIGTERM);
    /* With idle-priority training, a longer time slice for this (network)
     * thread keeps inference's tail under load down (peer/timeslice.h);
     * best effort: a kernel without the call just keeps its default. */
    if (o->train_idle)
        (void)peer_sched_set_slice(PEER_LOOP_SLICE_NS);
    uv_run(&r->loop, UV_RUN_DEFAULT);
    /* The loop ends while handles are open only when the daemon stopped it
     * (uv_stop): it refuses to go on, e.g. another peer is online with our
     * identity (it has said so). Stop it as for a signal; exit 1. */
    while (uv_loop_alive(&r->loop)) {
        r->refused = 1;
        if (!r->stopping)
            stop_serving(r);
        uv_run(&r->loop, UV_RUN_DEFAULT);
    }
    if (r->refused)
        r->status = CLI_EXIT_FAIL;
    wipe_keys(r);
    if (uv_loop_close(&r->loop) != 0)
        fprintf(stderr, "starling peer: warning: handles left open at exit\n");
    return r->status;
}

int cmd_peer(int argc, char **argv)
{
    static peer_opts o;
    static run_ctx r;
    int rc = parse_peer_flags(argc, argv, &o);
    if (rc >= 0)
        return rc;
    memset(&r, 0, sizeof r);
    if ((rc = check_peer_opts(&o, &r)) >= 0 || (rc = load_keys(&o, &r)) >= 0) {
        peer_device_close();
        return rc;
    }
    if (o.blas > 0)
        expert_blas_set_threads((int)o.blas);
    r.rng = ((uint64_t)r.ident.id[0] << 24 | (uint64_t)r.ident.id[1] << 16 | (uint64_t)r.ident.id[2] << 8 |
             r.ident.id[3]) + 1;
    snprintf(r.listen, sizeof r.listen, "%s", o.listen);
    fill_daemon_config(&o, &r);
    r.dc.on_refused = on_refused;
    r.dc.refused_arg = &r;
    if (r.dev.kind != PEER_DEVICE_CPU)
        fprintf(stderr, "starling peer: blocks on %s in %s\n", r.dev.desc,
                expert_precision_name(r.be->precision));
    rc = run_peer(&r, &o);
    peer_device_close();
    return rc;
}
