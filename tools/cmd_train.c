/* starling train: train a model through the swarm: an image classifier on
 * Fashion-MNIST, or a byte-level language model on a text file. */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dht/id.h"
#include "expert/expert.h"
#include "expert/model.h"
#include "net/tensorfmt.h"
#include "routing/routing.h"
#include "tools/cli.h"
#include "tools/client.h"
#include "tools/report.h"

static const char train_help[] =
    "Usage: starling train --initial-peers ADDR[,ADDR...] [--model NAME] [--epochs N]\n"
    "                      [--model-file FILE] [--batch B] [--data DIR] [--json] ...\n"
    "       starling train --initial-peers LIST --model tiny-lm [--data FILE] [--steps N]\n"
    "                      [--max-seconds S] [--json] ...\n"
    "\n"
    "Trains a model whose stages are served by the swarm's peers: an image model\n"
    "(fmnist-mlp) on Fashion-MNIST (Debian package dataset-fashion-mnist), a\n"
    "byte-level language model (tiny-lm) on the bytes of a text file (default:\n"
    "the Debian packages fortunes and fortunes-min, as ../shared/bench/torch/\n"
    "train_lm.py uses them). The trainer holds only the data and the loss: it\n"
    "finds each stage's holders in the DHT, keeps several micro-batches\n"
    "in flight, and retries a failed call on another replica, so no batch is lost\n"
    "(except one whose gradient the holders refuse 3 times: its update is dropped).\n"
    "The optimizer runs on the peers (see 'starling peer --lr/--target-batch').\n"
    "\n"
    "Options:\n"
    "  --initial-peers LIST   DHT addresses to join through (required)\n"
    "  --model NAME           model to train (default fmnist-mlp): a built-in, or one\n"
    "                         a peer of the swarm publishes (fetched and checked)\n"
    "  --model-file FILE      train the model a model file describes (docs/models.md)\n"
    "  --epochs N             passes over the training set (default 1)\n"
    "  --batch B              samples per micro-batch (default 64)\n"
    "  --inflight K           micro-batches in flight (default 2). Peers step after\n"
    "                         --target-batch samples (default 128); keeping\n"
    "                         K x B near that keeps gradients fresh: more in flight\n"
    "                         is faster but staler (see docs/benchmarks.md)\n"
    "  --sync S               start each group of S training samples only when the\n"
    "                         previous group has finished everywhere: with S = the\n"
    "                         peers' --target-batch every step is synchronous, as in\n"
    "                         single-process training (0: asynchronous; default 0)\n"
    "  --data DIR             Fashion-MNIST IDX files (default: $FASHION_MNIST_DIR, then\n"
    "                         /usr/share/datasets/fashion-mnist)\n"
    "  --data FILE            a language model's corpus: any file, as bytes; the last\n"
    "                         10% is validation (default: the fortunes packages' files)\n"
    "  --train-samples N      use the first N training samples (default all 60000)\n"
    "  --test-samples N       evaluate on the first N test samples (default all 10000)\n"
    "  --seed N               data order seed (default 0); a language model's windows\n"
    "                         are train_lm.py's for the same seed\n"
    ;
/* In two pieces: C11 compilers need only take 4095-character literals. */
static const char train_help2[] =
    "Language models (their rows are windows of context+1 bytes):\n"
    "  --steps N              optimizer steps of --sync windows each (default 250)\n"
    "  --max-seconds S        stop after the first step that ends S seconds after the\n"
    "                         start, evaluations included (default 0: no limit)\n"
    "  --eval-every N         evaluate every N steps, and before the first and after\n"
    "                         the last (default 50)\n"
    "  --eval-batches N       validation windows: N x 32, the same at every evaluation\n"
    "                         (default 8)\n"
    "  For a language model --batch defaults to 8, --inflight to 4 and --sync to the\n"
    "  model's batch (tiny-lm: 32, which its peers' --target-batch defaults to too).\n"
    "  --timeout S            seconds before a call or a connection attempt gives up\n"
    "                         and is retried elsewhere (default 30)\n"
    "  --max-wait S           give up when a stage has no holder this long (default 120)\n"
    "  --refresh S            look the holders up again every S seconds (default 10)\n"
    "  --wire-format F        activations and gradients on the wire: f32 (default),\n"
    "                         f16, bf16 or q8[:BLOCK] (8-bit, a scale per BLOCK values,\n"
    "                         default 64); gradients are rounded stochastically. Holders\n"
    "                         that do not announce F get f32 (docs/rpc.md)\n"
    "  --metrics-log FILE     JSON lines log (default starling-train.jsonl)\n"
    "  --plot FILE            loss/accuracy plot, SVG (default starling-train.svg)\n"
    "  --json                 print one final JSON line (samples_per_s, test_acc, ...)\n"
    "  --listen HOST:PORT     local DHT address (default: any port)\n"
    "  --identity FILE        identity for the RPC handshakes (default: a new one)\n"
    "  --swarm-key FILE       pre-shared key of a private swarm\n"
    "  --lr X                 not a trainer setting: the error says where it goes\n"
    "  -h, --help             this text\n"
    "\n"
    "A language model's --json line holds tokens_per_s, val_loss (nats/byte),\n"
    "val_bpb (bits/byte), steps, retries and status.\n"
    "The --json line's \"status\" is \"rolled_back\" instead of \"ok\" when a holder\n"
    "went back to older weights during the run (listed in \"rollbacks\"; see\n"
    "docs/operations.md). \"refused\" counts backward calls a holder refused (its\n"
    "gradient checks failed); a micro-batch refused 3 times is not retried again:\n"
    "its samples count as processed, and \"refused_samples\" says how many.\n"
    "\n"
    "Exit status: 0 trained, 1 failed (no holder for a stage, unreachable swarm,\n"
    "bad data), 2 usage error.\n";

#define MAX_POINTS 20000

/* Writes `"rollbacks":[{"stage":N,"holder":"<hex8>","from":A,"to":B},...]`
 * (the kept ones; an empty array when none). */
static void print_rollbacks(FILE *f, const route_train_result *r)
{
    int n = r->n_rollbacks < ROUTE_MAX_ROLLBACKS ? r->n_rollbacks : ROUTE_MAX_ROLLBACKS;
    fputs("\"rollbacks\":[", f);
    for (int i = 0; i < n; i++) {
        const route_rollback *b = &r->rollbacks[i];
        char hex[DHT_ID_HEX_LEN + 1];
        dht_id_to_hex(hex, b->holder);
        fprintf(f, "%s{\"stage\":%d,\"holder\":\"%.8s\",\"from\":%llu,\"to\":%llu}", i ? "," : "", b->stage,
                hex, (unsigned long long)b->from, (unsigned long long)b->to);
    }
    fputc(']', f);
}

/* "ok", "rolled_back" (trained, but some holder went back to older weights)
 * or "failed". */
static const char *train_status(int rc, const route_train_result *r)
{
    return rc != 0 ? "failed" : r->n_rollbacks > 0 ? "rolled_back" : "ok";
}

typedef struct train_ui {
    report_progress prog;
    FILE *jsonl;
    double *px, *py;          /* loss curve (samples, loss) */
    int np;
    long next_point;          /* log a point every ~1% */
    long point_every;
    double ex[1024], eacc[1024];
    int ne;
    int quiet;
    /* A language model: tokens per window, windows per step, and the
     * windows trained so far (the x axis of its evaluations). */
    int T, per_step;
    long windows;
} train_ui;

#define LN2 0.69314718055994530942

static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void on_progress(void *arg, const route_train_progress *p)
{
    train_ui *ui = arg;
    if (!ui->quiet)
        report_progress_update(&ui->prog, p->done, p->loss, mono(), p->done == p->total);
    if (p->done >= ui->next_point && ui->np < MAX_POINTS) {
        ui->px[ui->np] = (double)p->done * (ui->T ? ui->T : 1);
        ui->py[ui->np] = p->loss;
        ui->np++;
        ui->next_point = p->done + ui->point_every;
        if (ui->jsonl && ui->T)
            fprintf(ui->jsonl,
                    "{\"event\":\"step\",\"step\":%ld,\"tokens\":%ld,\"loss\":%.6f,"
                    "\"elapsed_s\":%.3f,\"tokens_per_s\":%.1f,\"retries\":%ld,\"refused\":%ld}\n",
                    p->done / ui->per_step, p->done * ui->T, p->loss, p->elapsed_s,
                    p->elapsed_s > 0 ? (double)p->done * ui->T / p->elapsed_s : 0.0, p->retries,
                    p->refused);
        else if (ui->jsonl)
            fprintf(ui->jsonl,
                    "{\"event\":\"step\",\"epoch\":%d,\"samples\":%ld,\"loss\":%.6f,"
                    "\"elapsed_s\":%.3f,\"samples_per_s\":%.1f,\"retries\":%ld,\"refused\":%ld}\n",
                    p->epoch, p->done, p->loss, p->elapsed_s,
                    p->elapsed_s > 0 ? (double)p->done / p->elapsed_s : 0.0, p->retries, p->refused);
        /* Whole lines, at once: the log is followed while training runs. */
        if (ui->jsonl)
            fflush(ui->jsonl);
    }
}

/* A language model's evaluation (epoch 0 is the one before the first
 * step): validation loss in nats and bits per byte. */
static void on_eval(train_ui *ui, const route_epoch_result *e)
{
    ui->windows += e->samples;
    long step = ui->windows / ui->per_step;
    if (!ui->quiet) {
        report_progress_finish(&ui->prog);
        if (e->epoch == 0)
            fprintf(stderr, "step 0: val loss %.4f nats/byte (%.3f bits/byte), next-byte accuracy %.4f\n",
                    e->test_loss, e->test_loss / LN2, e->test_acc);
        else
            fprintf(stderr,
                    "step %ld: train loss %.4f, val loss %.4f nats/byte (%.3f bits/byte), next-byte "
                    "accuracy %.4f, %.0f tokens/s, %ld retries\n",
                    step, e->train_loss, e->test_loss, e->test_loss / LN2, e->test_acc,
                    e->train_time_s > 0 ? (double)e->samples * ui->T / e->train_time_s : 0.0, e->retries);
        ui->prog.last_draw = -1e30;
    }
    if (ui->ne < 1024) {
        ui->ex[ui->ne] = (double)ui->windows * ui->T;
        ui->eacc[ui->ne] = e->test_loss;
        ui->ne++;
    }
    if (ui->jsonl) {
        fprintf(ui->jsonl,
                "{\"event\":\"eval\",\"step\":%ld,\"tokens\":%ld,\"train_loss\":%.6f,"
                "\"val_loss\":%.6f,\"val_bpb\":%.6f,\"val_acc\":%.6f,\"train_time_s\":%.3f,"
                "\"retries\":%ld,\"refused\":%ld,\"refused_samples\":%ld}\n",
                step, ui->windows * ui->T, e->train_loss, e->test_loss, e->test_loss / LN2, e->test_acc,
                e->train_time_s, e->retries, e->refused, e->refused_samples);
        fflush(ui->jsonl);
    }
}

static void on_epoch(void *arg, const route_epoch_result *e)
{
    train_ui *ui = arg;
    if (ui->T) {
        on_eval(ui, e);
        return;
    }
    if (!ui->quiet) {
        report_progress_finish(&ui->prog);
        fprintf(stderr,
                "epoch %d: train loss %.4f, test loss %.4f, test accuracy %.4f, %.0f samples/s, "
                "%ld retries\n",
                e->epoch, e->train_loss, e->test_loss, e->test_acc,
                e->train_time_s > 0 ? (double)e->samples / e->train_time_s : 0.0, e->retries);
        ui->prog.last_draw = -1e30;
    }
    if (ui->ne < 1024) {
        ui->ex[ui->ne] = (double)e->epoch;
        ui->eacc[ui->ne] = e->test_acc;
        ui->ne++;
    }
    if (ui->jsonl) {
        fprintf(ui->jsonl,
                "{\"event\":\"epoch\",\"epoch\":%d,\"train_loss\":%.6f,\"test_loss\":%.6f,"
                "\"test_acc\":%.6f,\"samples\":%ld,\"train_time_s\":%.3f,\"retries\":%ld,"
                "\"refused\":%ld,\"refused_samples\":%ld}\n",
                e->epoch, e->train_loss, e->test_loss, e->test_acc, e->samples, e->train_time_s,
                e->retries, e->refused, e->refused_samples);
        fflush(ui->jsonl);
    }
}

static void on_message(void *arg, const char *msg)
{
    train_ui *ui = arg;
    if (ui->prog.tty)
        fputc('\n', stderr);
    fprintf(stderr, "starling train: %s\n", msg);
}

enum { O_INITIAL = 256, O_MODEL, O_EPOCHS, O_BATCH, O_INFLIGHT, O_DATA, O_NTRAIN, O_NTEST,
       O_SEED, O_TIMEOUT, O_MAXWAIT, O_REFRESH, O_SYNC_GROUP, O_LOG, O_PLOT, O_JSON, O_LISTEN, O_IDENTITY, O_SWARM,
       O_LR, O_STEPS, O_MAXSEC, O_EVAL_EVERY, O_EVAL_BATCHES, O_MODEL_FILE, O_WIRE };

static const struct option train_opts[] = {
    {"initial-peers", required_argument, NULL, O_INITIAL},
    {"model", required_argument, NULL, O_MODEL},
    {"model-file", required_argument, NULL, O_MODEL_FILE},
    {"epochs", required_argument, NULL, O_EPOCHS},
    {"batch", required_argument, NULL, O_BATCH},
    {"inflight", required_argument, NULL, O_INFLIGHT},
    {"data", required_argument, NULL, O_DATA},
    {"train-samples", required_argument, NULL, O_NTRAIN},
    {"test-samples", required_argument, NULL, O_NTEST},
    {"seed", required_argument, NULL, O_SEED},
    {"timeout", required_argument, NULL, O_TIMEOUT},
    {"max-wait", required_argument, NULL, O_MAXWAIT},
    {"refresh", required_argument, NULL, O_REFRESH},
    {"sync", required_argument, NULL, O_SYNC_GROUP},
    {"metrics-log", required_argument, NULL, O_LOG},
    {"plot", required_argument, NULL, O_PLOT},
    {"json", no_argument, NULL, O_JSON},
    {"listen", required_argument, NULL, O_LISTEN},
    {"identity", required_argument, NULL, O_IDENTITY},
    {"swarm-key", required_argument, NULL, O_SWARM},
    {"lr", required_argument, NULL, O_LR},
    {"steps", required_argument, NULL, O_STEPS},
    {"max-seconds", required_argument, NULL, O_MAXSEC},
    {"eval-every", required_argument, NULL, O_EVAL_EVERY},
    {"eval-batches", required_argument, NULL, O_EVAL_BATCHES},
    {"wire-format", required_argument, NULL, O_WIRE},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* The command line, parsed. */
typedef struct train_args {
    const char *initial, *model, *data, *log_path, *plot_path, *listen, *identity, *swarm;
    long epochs, batch, inflight, ntrain, ntest, seed, sync;   /* -1: not given */
    long steps, eval_every, eval_batches;                       /* -1: not given */
    double timeout, max_wait, refresh, max_seconds;
    int json;
    const char *model_file;
    const char *wire;                 /* --wire-format as given (NULL: f32) */
    int wire_format, wire_block;
} train_args;

/* Parses a numeric option c (its argument in optarg) into a. Returns -1 to
 * go on, else the exit status (a usage error). */
static int parse_train_number(int c, train_args *a)
{
    int bad = 0;
    switch (c) {
    case O_EPOCHS: bad = cli_parse_long("train", "--epochs", optarg, 1, 10000, &a->epochs); break;
    case O_BATCH: bad = cli_parse_long("train", "--batch", optarg, 1, 65536, &a->batch); break;
    case O_INFLIGHT:
        bad = cli_parse_long("train", "--inflight", optarg, 1, ROUTE_PIPELINE_MAX_INFLIGHT, &a->inflight);
        break;
    case O_NTRAIN: bad = cli_parse_long("train", "--train-samples", optarg, 1, INT_MAX, &a->ntrain); break;
    case O_NTEST: bad = cli_parse_long("train", "--test-samples", optarg, 1, INT_MAX, &a->ntest); break;
    case O_SEED: bad = cli_parse_long("train", "--seed", optarg, 0, LONG_MAX, &a->seed); break;
    case O_TIMEOUT: bad = cli_parse_double("train", "--timeout", optarg, 0.05, 3600, &a->timeout); break;
    case O_MAXWAIT: bad = cli_parse_double("train", "--max-wait", optarg, 0.1, 1e7, &a->max_wait); break;
    case O_REFRESH: bad = cli_parse_double("train", "--refresh", optarg, 0.1, 3600, &a->refresh); break;
    case O_SYNC_GROUP: bad = cli_parse_long("train", "--sync", optarg, 0, 1 << 24, &a->sync); break;
    case O_STEPS: bad = cli_parse_long("train", "--steps", optarg, 1, 1L << 30, &a->steps); break;
    case O_MAXSEC: bad = cli_parse_double("train", "--max-seconds", optarg, 0, 1e9, &a->max_seconds); break;
    case O_EVAL_EVERY: bad = cli_parse_long("train", "--eval-every", optarg, 1, 1L << 30, &a->eval_every); break;
    case O_EVAL_BATCHES:
        bad = cli_parse_long("train", "--eval-batches", optarg, 1, 1 << 16, &a->eval_batches);
        break;
    default: return -2;
    }
    return bad ? CLI_EXIT_USAGE : -1;
}

/* Parses one option c into a. Returns -1 to go on, else the exit status
 * (help printed, or a usage error). */
static int parse_train_option(int c, char **argv, train_args *a)
{
    switch (c) {
    case 'h': fputs(train_help, stdout); fputs(train_help2, stdout); return CLI_EXIT_OK;
    case O_INITIAL: a->initial = optarg; break;
    case O_MODEL: a->model = optarg; break;
    case O_MODEL_FILE: a->model_file = optarg; break;
    case O_DATA: a->data = optarg; break;
    case O_LOG: a->log_path = optarg; break;
    case O_PLOT: a->plot_path = optarg; break;
    case O_JSON: a->json = 1; break;
    case O_LISTEN: a->listen = optarg; break;
    case O_IDENTITY: a->identity = optarg; break;
    case O_SWARM: a->swarm = optarg; break;
    case O_WIRE: {
        peer_fmt f;
        if (peer_tensorfmt_spec_parse(optarg, &f, &a->wire_block) != 0)
            return cli_usage_error("train", "--wire-format takes f32, f16, bf16, q8 or q8:BLOCK (BLOCK a power of "
                                            "two from 16 to 4096), not '%s'", optarg);
        a->wire_format = (int)f;
        a->wire = optarg;
        break;
    }
    case O_LR:
        return cli_usage_error("train", "the optimizer runs on the peers: set the learning rate "
                                        "with 'starling peer --lr X' on each peer");
    default: {
        int st = parse_train_number(c, a);
        return st == -2 ? cli_bad_option("train", c, argv) : st;
    }
    }
    return -1;
}

/* Replaces the options not given (-1) by the defaults of the model's
 * kind, refusing the options of the other kind. Returns -1 to go on, else
 * the exit status (a usage error). */
static int fill_defaults(train_args *a, const struct expert_model_spec *spec)
{
    int text = spec->task == EXPERT_TASK_BYTES;
    const char *wrong = NULL;
    if (text)
        wrong = a->epochs >= 0 ? "--epochs" : a->ntrain >= 0 ? "--train-samples"
              : a->ntest >= 0 ? "--test-samples" : NULL;
    else
        wrong = a->steps >= 0 ? "--steps" : a->eval_every >= 0 ? "--eval-every"
              : a->eval_batches >= 0 ? "--eval-batches" : NULL;
    if (wrong)
        return cli_usage_error("train", "%s does not apply to %s, a %s", wrong, spec->name,
                               text ? "language model (it trains for --steps on text)"
                                    : "model of images (it trains for --epochs)");
#define DEF(f, v) if (a->f < 0) a->f = (v)
    DEF(epochs, 1);
    DEF(ntrain, 0);
    DEF(ntest, 0);
    DEF(batch, text ? 8 : 64);
    DEF(inflight, text ? 4 : 2);
    DEF(sync, text ? (spec->batch > 0 ? spec->batch : 32) : 0);
    DEF(steps, 250);
    DEF(eval_every, 50);
    DEF(eval_batches, 8);
#undef DEF
    if (text && a->sync < 1)
        return cli_usage_error("train", "a language model trains in synchronous steps: --sync must be "
                                        "at least 1 (the peers' --target-batch)");
    return -1;
}

/* Parses and checks the command line into a and *spec. Returns -1 to go
 * on, else the exit status. */
static int parse_train_args(int argc, char **argv, train_args *a, const struct expert_model_spec **spec)
{
    memset(a, 0, sizeof *a);
    a->log_path = "starling-train.jsonl";
    a->plot_path = "starling-train.svg";
    a->epochs = a->batch = a->inflight = a->sync = a->ntrain = a->ntest = -1;
    a->steps = a->eval_every = a->eval_batches = -1;
    a->timeout = 30;
    a->max_wait = 120;
    a->refresh = 10;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", train_opts, NULL)) != -1) {
        int st = parse_train_option(c, argv, a);
        if (st >= 0)
            return st;
    }
    if (cli_no_positional("train", argc, argv))
        return CLI_EXIT_USAGE;
    int rc = tools_model_select("train", a->model, a->model_file, "fmnist-mlp", a->initial, a->swarm, spec);
    if (rc != CLI_EXIT_OK)
        return rc;
    if (!a->initial)
        return cli_usage_error("train", "--initial-peers LIST is required");
    return fill_defaults(a, *spec);
}

/* The JSON fields of the traffic (after a comma, ending with one):
 * "wire_format", "bytes_sent", "bytes_received" (tensor bytes of training
 * calls) and "bytes_per_sample" (a language model: "bytes_per_token"). */
static void print_traffic(FILE *f, const train_args *a, const route_train_result *res, int T)
{
    double per = res->samples > 0 ? (double)(res->bytes_sent + res->bytes_received) /
                                        ((double)res->samples * (T ? T : 1))
                                  : 0.0;
    fprintf(f, "\"wire_format\":\"%s\",\"bytes_sent\":%" PRIu64 ",\"bytes_received\":%" PRIu64
               ",\"%s\":%.1f,\"f32_calls\":%" PRIu64 ",",
            a->wire ? a->wire : "f32", res->bytes_sent, res->bytes_received,
            T ? "bytes_per_token" : "bytes_per_sample", per, res->f32_calls);
}

/* The metrics log's end line. */
static void log_end(FILE *f, const train_args *a, int rc, const route_train_result *res, int T)
{
    if (T) {
        fprintf(f,
                "{\"event\":\"end\",\"status\":\"%s\",\"steps\":%ld,\"tokens\":%ld,"
                "\"tokens_per_s\":%.1f,\"val_loss\":%.6f,\"val_bpb\":%.6f,\"retries\":%ld,"
                "\"refused\":%ld,\"refused_samples\":%ld,\"errors\":%ld,\"stopped_early\":%s,",
                train_status(rc, res), res->steps, res->samples * T, res->samples_per_s * T,
                res->test_loss, res->test_loss / LN2, res->retries, res->refused, res->refused_samples,
                res->errors, res->stopped_early ? "true" : "false");
        print_traffic(f, a, res, T);
        print_rollbacks(f, res);
        fputs("}\n", f);
        return;
    }
    fprintf(f,
            "{\"event\":\"end\",\"status\":\"%s\",\"epochs\":%d,\"samples\":%ld,"
            "\"samples_per_s\":%.1f,\"test_acc\":%.6f,\"retries\":%ld,\"refused\":%ld,"
            "\"refused_samples\":%ld,\"errors\":%ld,",
            train_status(rc, res), res->epochs, res->samples, res->samples_per_s, res->test_acc, res->retries,
            res->refused, res->refused_samples, res->errors);
    print_traffic(f, a, res, 0);
    print_rollbacks(f, res);
    fputs("}\n", f);
}

/* The loss and accuracy plot, when asked for and there is something to draw. */
static void write_plot(const char *plot_path, const train_ui *ui, const struct expert_model_spec *spec,
                       long n_train)
{
    if (!plot_path || !*plot_path || (ui->np == 0 && ui->ne == 0))
        return;
    if (ui->T) {
        report_series ls[2] = {
            {"training loss (nats/byte)", "#1f77b4", ui->px, ui->py, ui->np, 0},
            {"validation loss (nats/byte)", "#d62728", ui->ex, ui->eacc, ui->ne, 0},
        };
        char t[128];
        snprintf(t, sizeof t, "starling train: %s", spec->name);
        int lrc = report_plot_svg(plot_path, t, "training tokens", "loss (nats/byte)", "", ls, 2);
        if (lrc != 0)
            fprintf(stderr, "starling train: warning: cannot write %s: %s\n", plot_path, strerror(-lrc));
        return;
    }
    /* Accuracy is drawn at each epoch's end, on the samples axis. */
    double ax[1024];
    for (int i = 0; i < ui->ne; i++)
        ax[i] = ui->ex[i] * (double)n_train;
    report_series s[2] = {
        {"training loss", "#1f77b4", ui->px, ui->py, ui->np, 0},
        {"test accuracy", "#d62728", ax, ui->eacc, ui->ne, 1},
    };
    char title[128];
    snprintf(title, sizeof title, "starling train: %s on Fashion-MNIST", spec->name);
    int prc = report_plot_svg(plot_path, title, "training samples", "loss", "test accuracy", s, 2);
    if (prc != 0)
        fprintf(stderr, "starling train: warning: cannot write %s: %s\n", plot_path, strerror(-prc));
}

/* report_end for a language model of context T. */
static int report_text_end(const train_args *a, int rc, const route_train_result *res, int T)
{
    if (a->json) {
        printf("{\"tokens_per_s\":%.1f,\"val_loss\":%.6f,\"val_bpb\":%.6f,\"val_acc\":%.6f,"
               "\"steps\":%ld,\"tokens\":%ld,\"retries\":%ld,\"refused\":%ld,\"refused_samples\":%ld,"
               "\"errors\":%ld,\"train_time_s\":%.3f,\"stopped_early\":%s,",
               res->samples_per_s * T, res->test_loss, res->test_loss / LN2, res->test_acc, res->steps,
               res->samples * T, res->retries, res->refused, res->refused_samples, res->errors,
               res->train_time_s, res->stopped_early ? "true" : "false");
        print_traffic(stdout, a, res, T);
        print_rollbacks(stdout, res);
        printf(",\"status\":\"%s\"}\n", train_status(rc, res));
    }
    if (rc != 0)
        return cli_fail("train", "%s", res->error[0] ? res->error : strerror(-rc));
    fprintf(stderr,
            "starling train: done: val loss %.4f nats/byte (%.3f bits/byte) after %ld step%s%s, "
            "%.0f tokens/s, %ld retries\n",
            res->test_loss, res->test_loss / LN2, res->steps, res->steps == 1 ? "" : "s",
            res->stopped_early ? " (--max-seconds)" : "", res->samples_per_s * T, res->retries);
    if (res->refused > 0)
        fprintf(stderr, "starling train: holders refused %ld backward call%s (gradients out of bounds)\n",
                res->refused, res->refused == 1 ? "" : "s");
    if (res->n_rollbacks > 0)
        fprintf(stderr, "starling train: %d holder rollback%s: some stages went back to older weights\n",
                res->n_rollbacks, res->n_rollbacks == 1 ? "" : "s");
    return CLI_EXIT_OK;
}

/* The final lines: JSON on stdout when asked, the outcome on stderr.
 * Returns the exit status. */
static int report_end(const train_args *a, int rc, const route_train_result *res, int T)
{
    if (T)
        return report_text_end(a, rc, res, T);
    if (a->json) {
        printf("{\"samples_per_s\":%.1f,\"test_acc\":%.6f,\"test_loss\":%.6f,\"epochs\":%d,"
               "\"samples\":%ld,\"retries\":%ld,\"refused\":%ld,\"refused_batches\":%ld,"
               "\"refused_samples\":%ld,\"errors\":%ld,\"train_time_s\":%.3f,",
               res->samples_per_s, res->test_acc, res->test_loss, res->epochs, res->samples, res->retries,
               res->refused, res->refused_batches, res->refused_samples, res->errors, res->train_time_s);
        print_traffic(stdout, a, res, 0);
        print_rollbacks(stdout, res);
        printf(",\"status\":\"%s\"}\n", train_status(rc, res));
    }
    if (rc != 0)
        return cli_fail("train", "%s", res->error[0] ? res->error : strerror(-rc));
    fprintf(stderr, "starling train: done: test accuracy %.4f after %d epoch%s, %.0f samples/s, %ld retries, "
                    "%.0f tensor bytes/sample (%s)\n",
            res->test_acc, res->epochs, res->epochs == 1 ? "" : "s", res->samples_per_s, res->retries,
            res->samples > 0 ? (double)(res->bytes_sent + res->bytes_received) / (double)res->samples : 0.0,
            a->wire ? a->wire : "f32");
    if (res->refused > 0)
        fprintf(stderr, "starling train: holders refused %ld backward call%s (gradients out of bounds)%s\n",
                res->refused, res->refused == 1 ? "" : "s",
                res->refused_samples > 0 ? "; some micro-batches were refused every time" : "");
    if (res->refused_samples > 0)
        fprintf(stderr, "starling train: %ld sample%s of %ld processed without a full update: their "
                        "backward was refused %d times, so it was dropped\n",
                res->refused_samples, res->refused_samples == 1 ? "" : "s", res->samples,
                ROUTE_PIPELINE_MAX_REFUSALS);
    if (res->n_rollbacks > 0)
        fprintf(stderr, "starling train: %d holder rollback%s: some stages went back to older weights "
                        "(a holder restarted from an older checkpoint or its initial weights)\n",
                res->n_rollbacks, res->n_rollbacks == 1 ? "" : "s");
    return CLI_EXIT_OK;
}

/* Trains through the joined client cl on train/test, with ui's progress
 * output; fills *res. Returns route_train_run's result. */
static int run_training(const train_args *a, const struct expert_model_spec *spec, tools_client *cl,
                        const route_dataset *train, const route_dataset *test, const route_text *text,
                        train_ui *ui, route_train_result *res)
{
    route_train_config tc;
    memset(&tc, 0, sizeof tc);
    tc.dht = cl->d;
    tc.ident = &cl->ident;
    tc.swarm_key = cl->has_swarm_key ? cl->swarm_key : NULL;
    tc.model = spec;
    tc.train = train;
    tc.test = test;
    tc.text = text;
    tc.steps = a->steps;
    tc.eval_every = (int)a->eval_every;
    tc.eval_rows = (int)a->eval_batches * ROUTE_TEXT_EVAL_ROWS;
    tc.max_seconds = a->max_seconds;
    tc.n_train = (int)a->ntrain;
    tc.n_test = (int)a->ntest;
    tc.epochs = (int)a->epochs;
    tc.batch = (int)a->batch;
    tc.inflight = (int)a->inflight;
    tc.seed = (uint64_t)a->seed;
    tc.refresh_s = a->refresh;
    tc.sync_samples = (int)a->sync;
    tc.wire_format = a->wire_format;
    tc.wire_block = a->wire_block;
    tc.call_timeout_s = a->timeout;
    tc.max_wait_s = a->max_wait;
    tc.on_progress = on_progress;
    tc.on_epoch = on_epoch;
    tc.on_message = on_message;
    tc.arg = ui;
    return route_train_run(&cl->loop, &tc, res);
}

/* Joins the swarm, trains, writes the log and plot and reports. Returns
 * the exit status. */
static int train_with(const train_args *a, const struct expert_model_spec *spec, const route_dataset *train,
                      const route_dataset *test, const route_text *text)
{
    tools_client cl;
    int rc = tools_client_open(&cl, "train", a->initial, a->listen, a->identity, a->swarm, 15);
    if (rc != CLI_EXIT_OK)
        return rc;
    train_ui ui;
    memset(&ui, 0, sizeof ui);
    long n_train = text ? a->steps * a->sync : a->ntrain > 0 && a->ntrain < train->n ? a->ntrain : train->n;
    long total = text ? n_train : n_train * a->epochs;
    report_progress_init(&ui.prog, stderr, total, -1, mono());
    if (text) {
        ui.T = spec->seq;
        ui.per_step = (int)a->sync;
        ui.prog.rate_unit = "tokens";
        ui.prog.rate_scale = spec->seq;
    }
    ui.px = calloc(MAX_POINTS, sizeof *ui.px);
    ui.py = calloc(MAX_POINTS, sizeof *ui.py);
    ui.point_every = total / 200 > a->batch ? total / 200 : a->batch;
    if (a->log_path && *a->log_path) {
        ui.jsonl = fopen(a->log_path, "w");
        if (!ui.jsonl)
            fprintf(stderr, "starling train: warning: cannot write %s: %s\n", a->log_path, strerror(errno));
    }
    if (text)
        fprintf(stderr,
                "starling train: %s on %s (%zu bytes: %zu training, %zu validation), %ld steps of %ld "
                "windows of %d bytes, micro-batch %ld\n",
                spec->name, text->source, text->n, text->n_train, text->n_val, a->steps, a->sync,
                spec->seq + 1, a->batch);
    else
        fprintf(stderr, "starling train: %s, %ld training samples x %ld epoch%s, batch %ld\n", spec->name,
                n_train, a->epochs, a->epochs == 1 ? "" : "s", a->batch);
    route_train_result res;
    rc = run_training(a, spec, &cl, train, test, text, &ui, &res);
    tools_client_close(&cl);
    if (ui.jsonl) {
        log_end(ui.jsonl, a, rc, &res, ui.T);
        fclose(ui.jsonl);
    }
    write_plot(a->plot_path, &ui, spec, n_train);
    free(ui.px);
    free(ui.py);
    return report_end(a, rc, &res, ui.T);
}

int cmd_train(int argc, char **argv)
{
    train_args a;
    const struct expert_model_spec *spec = NULL;
    int st = parse_train_args(argc, argv, &a, &spec);
    if (st >= 0)
        return st;
    char dir[4096], err[512];
    if (spec->task == EXPERT_TASK_BYTES) {
        route_text text;
        if (route_text_load(&text, a.data, err, sizeof err) != 0)
            return cli_fail("train", "%s", err);
        if (route_text_check(&text, spec->seq, err, sizeof err) != 0) {
            route_text_free(&text);
            return cli_fail("train", "%s", err);
        }
        st = train_with(&a, spec, NULL, NULL, &text);
        route_text_free(&text);
        return st;
    }
    /* Data first: a missing package is the most likely problem. */
    route_dataset train, test;
    if (route_data_find_dir(a.data, dir, sizeof dir, err, sizeof err) != 0)
        return cli_fail("train", "%s", err);
    if (route_data_load(&train, dir, "train", err, sizeof err) != 0)
        return cli_fail("train", "%s", err);
    if (route_data_load(&test, dir, "t10k", err, sizeof err) != 0) {
        route_data_free(&train);
        return cli_fail("train", "%s", err);
    }
    st = train_with(&a, spec, &train, &test, NULL);
    route_data_free(&train);
    route_data_free(&test);
    return st;
}
