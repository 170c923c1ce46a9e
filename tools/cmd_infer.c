/* starling infer: predictions through the swarm, while it trains. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "expert/model.h"
#include "routing/routing.h"
#include "tools/cli.h"
#include "tools/client.h"

static const char infer_help[] =
    "Usage: starling infer --initial-peers ADDR[,ADDR...] (--data test | --input FILE)\n"
    "                      [--model NAME | --model-file FILE] [--replicas K] [--json] ...\n"
    "\n"
    "Sends forward-only requests through the swarm, which peers serve ahead of\n"
    "training work and which never change weights, and prints the predicted\n"
    "classes, the accuracy when labels are known, and latency p50/p99. Every\n"
    "reply is computed on one consistent version of each block's weights; the\n"
    "versions used are reported. With --replicas K each input goes along K\n"
    "paths through different holders and the answer is the majority vote (ties\n"
    "broken by the mean probability).\n"
    "\n"
    "Options:\n"
    "  --initial-peers LIST   DHT addresses to join through (required)\n"
    "  --model NAME           model (default fmnist-mlp): a built-in, or one a peer of\n"
    "                         the swarm publishes (fetched and checked)\n"
    "  --model-file FILE      the model a model file describes (docs/models.md)\n"
    "  --data test            the Fashion-MNIST test set (labels known)\n"
    "  --data-dir DIR         where Fashion-MNIST is (default: the Debian package's)\n"
    "  --input FILE           inputs: an IDX file of 28x28 unsigned-byte images\n"
    "                         (gzip or plain), as in Fashion-MNIST\n"
    "  --labels FILE          IDX labels for --input (optional: accuracy)\n"
    "  --samples N            use the first N inputs\n"
    "  --replicas K           paths per input, 1..9 (default 1)\n"
    "  --batch B              inputs per request (default 64)\n"
    "  --inflight K           requests in flight (default 8)\n"
    "  --output FILE          write one line per input: index class agreement\n"
    "  --json                 print one JSON document instead of text\n"
    "  --timeout S            seconds before a call is retried elsewhere (default 30)\n"
    "  --max-wait S           give up when a stage has no holder this long (default 60)\n"
    "  --identity FILE, --swarm-key FILE, --listen HOST:PORT   as for 'starling train'\n"
    "  -h, --help             this text\n"
    "\n"
    "Without --json or --output, --input prints the predictions on stdout (one\n"
    "line per input) and --data test prints only the summary (on stderr).\n"
    "Exit status: 0 answered, 1 failed, 2 usage error.\n";

static void on_message(void *arg, const char *msg)
{
    (void)arg;
    fprintf(stderr, "starling infer: %s\n", msg);
}

static void write_predictions(FILE *f, const route_infer_result *r, int n, int K)
{
    for (int i = 0; i < n; i++)
        fprintf(f, "%d %d %d/%d\n", i, r->pred[i], r->agree[i], K);
}

enum { O_INITIAL = 256, O_MODEL, O_DATA, O_DATADIR, O_INPUT, O_LABELS, O_SAMPLES, O_REPLICAS,
       O_BATCH, O_INFLIGHT, O_OUTPUT, O_JSON, O_TIMEOUT, O_MAXWAIT, O_IDENTITY, O_SWARM, O_LISTEN,
       O_MODEL_FILE };

static const struct option infer_opts[] = {
    {"initial-peers", required_argument, NULL, O_INITIAL},
    {"model", required_argument, NULL, O_MODEL},
    {"model-file", required_argument, NULL, O_MODEL_FILE},
    {"data", required_argument, NULL, O_DATA},
    {"data-dir", required_argument, NULL, O_DATADIR},
    {"input", required_argument, NULL, O_INPUT},
    {"labels", required_argument, NULL, O_LABELS},
    {"samples", required_argument, NULL, O_SAMPLES},
    {"replicas", required_argument, NULL, O_REPLICAS},
    {"batch", required_argument, NULL, O_BATCH},
    {"inflight", required_argument, NULL, O_INFLIGHT},
    {"output", required_argument, NULL, O_OUTPUT},
    {"json", no_argument, NULL, O_JSON},
    {"timeout", required_argument, NULL, O_TIMEOUT},
    {"max-wait", required_argument, NULL, O_MAXWAIT},
    {"identity", required_argument, NULL, O_IDENTITY},
    {"swarm-key", required_argument, NULL, O_SWARM},
    {"listen", required_argument, NULL, O_LISTEN},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* The command line, parsed. */
typedef struct infer_args {
    const char *initial, *model, *data, *data_dir, *input, *labels, *output, *identity, *swarm, *listen;
    long samples, replicas, batch, inflight;
    double timeout, max_wait;
    int json;
    const char *model_file;
} infer_args;

/* Parses one option c (its argument in optarg) into a. Returns -1 to go on,
 * else the exit status (help printed, or a usage error). */
static int parse_infer_option(int c, char **argv, infer_args *a)
{
    switch (c) {
    case 'h': fputs(infer_help, stdout); return CLI_EXIT_OK;
    case O_INITIAL: a->initial = optarg; break;
    case O_MODEL: a->model = optarg; break;
    case O_MODEL_FILE: a->model_file = optarg; break;
    case O_DATA: a->data = optarg; break;
    case O_DATADIR: a->data_dir = optarg; break;
    case O_INPUT: a->input = optarg; break;
    case O_LABELS: a->labels = optarg; break;
    case O_OUTPUT: a->output = optarg; break;
    case O_JSON: a->json = 1; break;
    case O_IDENTITY: a->identity = optarg; break;
    case O_SWARM: a->swarm = optarg; break;
    case O_LISTEN: a->listen = optarg; break;
    case O_SAMPLES:
        return cli_parse_long("infer", "--samples", optarg, 1, INT_MAX, &a->samples) ? CLI_EXIT_USAGE : -1;
    case O_REPLICAS:
        return cli_parse_long("infer", "--replicas", optarg, 1, ROUTE_INFER_MAX_REPLICAS, &a->replicas)
                   ? CLI_EXIT_USAGE
                   : -1;
    case O_BATCH:
        return cli_parse_long("infer", "--batch", optarg, 1, 65536, &a->batch) ? CLI_EXIT_USAGE : -1;
    case O_INFLIGHT:
        return cli_parse_long("infer", "--inflight", optarg, 1, 1024, &a->inflight) ? CLI_EXIT_USAGE : -1;
    case O_TIMEOUT:
        return cli_parse_double("infer", "--timeout", optarg, 0.05, 3600, &a->timeout) ? CLI_EXIT_USAGE : -1;
    case O_MAXWAIT:
        return cli_parse_double("infer", "--max-wait", optarg, 0.1, 1e7, &a->max_wait) ? CLI_EXIT_USAGE : -1;
    default: return cli_bad_option("infer", c, argv);
    }
    return -1;
}

/* Parses and checks the command line into a and *spec. Returns -1 to go
 * on, else the exit status. */
static int parse_infer_args(int argc, char **argv, infer_args *a, const struct expert_model_spec **spec)
{
    memset(a, 0, sizeof *a);
    a->replicas = 1;
    a->batch = 64;
    a->inflight = 8;
    a->timeout = 30;
    a->max_wait = 60;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", infer_opts, NULL)) != -1) {
        int st = parse_infer_option(c, argv, a);
        if (st >= 0)
            return st;
    }
    if (cli_no_positional("infer", argc, argv))
        return CLI_EXIT_USAGE;
    if (!a->data == !a->input)
        return cli_usage_error("infer", "give exactly one of --data test or --input FILE");
    if (a->data && strcmp(a->data, "test") != 0)
        return cli_usage_error("infer", "--data takes 'test' (the Fashion-MNIST test set), not '%s'", a->data);
    if (a->labels && !a->input)
        return cli_usage_error("infer", "--labels goes with --input");
    int rc = tools_model_select("infer", a->model, a->model_file, "fmnist-mlp", a->initial, a->swarm, spec);
    if (rc != CLI_EXIT_OK)
        return rc;
    if ((*spec)->task != EXPERT_TASK_CLASSES)
        return cli_usage_error("infer", "%s is a language model: sample from it with 'starling generate'",
                               (*spec)->name);
    if (!a->initial)
        return cli_usage_error("infer", "--initial-peers LIST is required");
    return -1;
}

/* Loads the inputs into *ds and checks they fit spec. Returns -1 to go on
 * (ds then the caller's to free), else the exit status. */
static int load_inputs(const infer_args *a, const struct expert_model_spec *spec, route_dataset *ds)
{
    char dir[4096], err[512];
    if (a->data) {
        if (route_data_find_dir(a->data_dir, dir, sizeof dir, err, sizeof err) != 0 ||
            route_data_load(ds, dir, "t10k", err, sizeof err) != 0)
            return cli_fail("infer", "%s", err);
    } else if (route_data_load_files(ds, a->input, a->labels, err, sizeof err) != 0) {
        return cli_fail("infer", "%s", err);
    }
    if (ds->rows * ds->cols == spec->n_in)
        return -1;
    /* The shape is read before route_data_free, which zeroes it. */
    int rows = ds->rows, cols = ds->cols, side = 1;
    route_data_free(ds);
    while ((side + 1) * (side + 1) <= spec->n_in)
        side++;
    const char *what = a->input ? a->input : "the test set";
    if (side * side == spec->n_in)
        return cli_fail("infer", "%s: images are %dx%d (%d values); %s expects %dx%d (%d)", what, rows, cols,
                        rows * cols, spec->name, side, side, spec->n_in);
    return cli_fail("infer", "%s: images are %dx%d (%d values); %s expects %d values", what, rows, cols,
                    rows * cols, spec->name, spec->n_in);
}

static void print_json(const infer_args *a, const struct expert_model_spec *spec, const route_infer_result *res,
                       int n, double acc, long unanimous)
{
    printf("{\"samples\":%d,\"replicas\":%ld,\"accuracy\":", n, a->replicas);
    if (acc >= 0)
        printf("%.6f", acc);
    else
        printf("null");
    printf(",\"unanimous\":%.6f,\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"requests_per_s\":%.1f,"
           "\"samples_per_s\":%.1f,\"retries\":%ld,\"versions\":[",
           (double)unanimous / n, res->p50_ms, res->p99_ms, res->requests_per_s, res->samples_per_s,
           res->retries);
    for (int s = 0; s < spec->n_stages; s++)
        printf("%s{\"stage\":%d,\"min\":%llu,\"max\":%llu}", s ? "," : "", s,
               (unsigned long long)res->ver_min[s], (unsigned long long)res->ver_max[s]);
    printf("],\"predictions\":[");
    for (int i = 0; i < n; i++)
        printf("%s%d", i ? "," : "", res->pred[i]);
    printf("]}\n");
}

static void print_text(const infer_args *a, const struct expert_model_spec *spec, const route_infer_result *res,
                       int n, double acc, long unanimous)
{
    if (a->input && !a->output)
        write_predictions(stdout, res, n, (int)a->replicas);
    fprintf(stderr, "starling infer: %d inputs", n);
    if (acc >= 0)
        fprintf(stderr, ", accuracy %.4f", acc);
    fprintf(stderr, ", latency p50 %.2f ms p99 %.2f ms, %.0f requests/s, %.0f samples/s", res->p50_ms,
            res->p99_ms, res->requests_per_s, res->samples_per_s);
    if (a->replicas > 1)
        fprintf(stderr, ", %ld paths agreed on %.1f%% of inputs", a->replicas, 100.0 * (double)unanimous / n);
    fprintf(stderr, "\nstarling infer: weight versions used:");
    for (int s = 0; s < spec->n_stages; s++)
        fprintf(stderr, " %d:%llu-%llu", s, (unsigned long long)res->ver_min[s],
                (unsigned long long)res->ver_max[s]);
    fputc('\n', stderr);
}

/* The answers: the output file, then JSON or text. Returns the exit status. */
static int report_results(const infer_args *a, const struct expert_model_spec *spec, const route_dataset *ds,
                          const route_infer_result *res, int n)
{
    int status = CLI_EXIT_OK;
    long correct = 0, unanimous = 0;
    for (int i = 0; i < n; i++) {
        if (ds->labels)
            correct += res->pred[i] == ds->labels[i];
        unanimous += res->agree[i] == a->replicas;
    }
    double acc = ds->labels ? (double)correct / n : -1;
    if (a->output) {
        FILE *f = fopen(a->output, "w");
        if (!f) {
            status = cli_fail("infer", "cannot write %s: %s", a->output, strerror(errno));
        } else {
            write_predictions(f, res, n, (int)a->replicas);
            fclose(f);
        }
    }
    if (a->json)
        print_json(a, spec, res, n, acc, unanimous);
    else
        print_text(a, spec, res, n, acc, unanimous);
    return status;
}

/* Joins the swarm, runs the inference on ds's first n inputs and reports.
 * Returns the exit status. */
static int run_infer(const infer_args *a, const struct expert_model_spec *spec, const route_dataset *ds, int n)
{
    tools_client cl;
    int rc = tools_client_open(&cl, "infer", a->initial, a->listen, a->identity, a->swarm, 15);
    if (rc != CLI_EXIT_OK)
        return rc;
    route_infer_result res;
    memset(&res, 0, sizeof res);
    res.pred = calloc((size_t)n, sizeof *res.pred);
    res.prob = calloc((size_t)n, sizeof *res.prob);
    res.agree = calloc((size_t)n, sizeof *res.agree);
    route_infer_config ic;
    memset(&ic, 0, sizeof ic);
    ic.dht = cl.d;
    ic.ident = &cl.ident;
    ic.swarm_key = cl.has_swarm_key ? cl.swarm_key : NULL;
    ic.model = spec;
    ic.inputs = ds->images;
    ic.n = n;
    ic.batch = (int)a->batch;
    ic.replicas = (int)a->replicas;
    ic.inflight = (int)a->inflight;
    ic.call_timeout_s = a->timeout;
    ic.max_wait_s = a->max_wait;
    ic.on_message = on_message;
    if (!res.pred || !res.prob || !res.agree) {
        rc = -ENOMEM;
        snprintf(res.error, sizeof res.error, "out of memory");
    } else {
        rc = route_infer_run(&cl.loop, &ic, &res);
    }
    tools_client_close(&cl);
    int status = rc != 0 ? cli_fail("infer", "%s", res.error[0] ? res.error : strerror(-rc))
                         : report_results(a, spec, ds, &res, n);
    free(res.pred);
    free(res.prob);
    free(res.agree);
    return status;
}

int cmd_infer(int argc, char **argv)
{
    infer_args a;
    const struct expert_model_spec *spec = NULL;
    int st = parse_infer_args(argc, argv, &a, &spec);
    if (st >= 0)
        return st;
    route_dataset ds;
    st = load_inputs(&a, spec, &ds);
    if (st >= 0)
        return st;
    int n = a.samples > 0 && a.samples < ds.n ? (int)a.samples : ds.n;
    st = run_infer(&a, spec, &ds, n);
    route_data_free(&ds);
    return st;
}
