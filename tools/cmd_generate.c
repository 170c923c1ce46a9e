/* starling generate: sample text from a language model served by the swarm,
 * while it trains, through the inference path (routing/infer.h). */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "expert/model.h"
#include "routing/routing.h"
#include "tools/cli.h"
#include "tools/client.h"

static const char generate_help[] =
    "Usage: starling generate --initial-peers ADDR[,ADDR...] --model NAME --prompt TEXT\n"
    "                         [--tokens N] [--temperature T] [--replicas K] [--json] ...\n"
    "\n"
    "Samples bytes from a language model (e.g. tiny-lm) whose stages the swarm's\n"
    "peers serve, while they train: each new byte is one forward-only request\n"
    "through every stage (peers serve it ahead of training work, on one\n"
    "consistent version of each stage's weights), on the last `context` bytes of\n"
    "the prompt and what was generated so far. There is no key/value cache:\n"
    "every byte recomputes the whole window, so a byte costs one full forward\n"
    "of a context window plus a round trip to every stage.\n"
    "\n"
    "Options:\n"
    "  --initial-peers LIST   DHT addresses to join through (required)\n"
    "  --model NAME           a language model (default tiny-lm): a built-in, or one\n"
    "                         a peer of the swarm publishes (fetched and checked)\n"
    "  --model-file FILE      a language model described in a model file (docs/models.md)\n"
    "  --prompt TEXT          the start of the text, as UTF-8 bytes (default \"\\n\")\n"
    "  --tokens N             bytes to generate (default 200)\n"
    "  --temperature T        softmax(logits / T) sampling; 0 = the most likely byte\n"
    "                         (default 0.8)\n"
    "  --replicas K           paths through different holders, 1..9 (default 1); at\n"
    "                         temperature 0 each byte is their majority vote, else\n"
    "                         it is sampled from their mean distribution\n"
    "  --seed N               sampling seed (default 0)\n"
    "  --json                 print one JSON line at the end (text, versions, speed)\n"
    "  --timeout S            seconds before a call is retried elsewhere (default 30)\n"
    "  --max-wait S           give up when a stage has no holder this long (default 60)\n"
    "  --identity FILE, --swarm-key FILE, --listen HOST:PORT   as for 'starling train'\n"
    "  -h, --help             this text\n"
    "\n"
    "The text goes to stdout as it is generated (without --json); the weight\n"
    "versions each stage served and the speed go to stderr at the end.\n"
    "Exit status: 0 generated, 1 failed, 2 usage error.\n";

enum { O_INITIAL = 256, O_MODEL, O_MODEL_FILE, O_PROMPT, O_TOKENS, O_TEMP, O_REPLICAS, O_SEED, O_JSON, O_TIMEOUT,
       O_MAXWAIT, O_IDENTITY, O_SWARM, O_LISTEN };

static const struct option generate_opts[] = {
    {"initial-peers", required_argument, NULL, O_INITIAL},
    {"model", required_argument, NULL, O_MODEL},
    {"model-file", required_argument, NULL, O_MODEL_FILE},
    {"prompt", required_argument, NULL, O_PROMPT},
    {"tokens", required_argument, NULL, O_TOKENS},
    {"temperature", required_argument, NULL, O_TEMP},
    {"replicas", required_argument, NULL, O_REPLICAS},
    {"seed", required_argument, NULL, O_SEED},
    {"json", no_argument, NULL, O_JSON},
    {"timeout", required_argument, NULL, O_TIMEOUT},
    {"max-wait", required_argument, NULL, O_MAXWAIT},
    {"identity", required_argument, NULL, O_IDENTITY},
    {"swarm-key", required_argument, NULL, O_SWARM},
    {"listen", required_argument, NULL, O_LISTEN},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

typedef struct gen_args {
    const char *initial, *model, *model_file, *prompt, *identity, *swarm, *listen;
    long tokens, replicas, seed;
    double temperature, timeout, max_wait;
    int json;
} gen_args;

/* Parses one option c. Returns -1 to go on, else the exit status. */
static int parse_generate_option(int c, char **argv, gen_args *a)
{
    int bad = 0;
    switch (c) {
    case 'h': fputs(generate_help, stdout); return CLI_EXIT_OK;
    case O_INITIAL: a->initial = optarg; break;
    case O_MODEL: a->model = optarg; break;
    case O_MODEL_FILE: a->model_file = optarg; break;
    case O_PROMPT: a->prompt = optarg; break;
    case O_IDENTITY: a->identity = optarg; break;
    case O_SWARM: a->swarm = optarg; break;
    case O_LISTEN: a->listen = optarg; break;
    case O_JSON: a->json = 1; break;
    case O_TOKENS: bad = cli_parse_long("generate", "--tokens", optarg, 1, 1 << 20, &a->tokens); break;
    case O_REPLICAS:
        bad = cli_parse_long("generate", "--replicas", optarg, 1, ROUTE_INFER_MAX_REPLICAS, &a->replicas);
        break;
    case O_SEED: bad = cli_parse_long("generate", "--seed", optarg, 0, LONG_MAX, &a->seed); break;
    case O_TEMP: bad = cli_parse_double("generate", "--temperature", optarg, 0, 100, &a->temperature); break;
    case O_TIMEOUT: bad = cli_parse_double("generate", "--timeout", optarg, 0.05, 3600, &a->timeout); break;
    case O_MAXWAIT: bad = cli_parse_double("generate", "--max-wait", optarg, 0.1, 1e7, &a->max_wait); break;
    default: return cli_bad_option("generate", c, argv);
    }
    return bad ? CLI_EXIT_USAGE : -1;
}

static int parse_generate_args(int argc, char **argv, gen_args *a, const struct expert_model_spec **spec)
{
    memset(a, 0, sizeof *a);
    a->prompt = "\n";
    a->tokens = 200;
    a->replicas = 1;
    a->temperature = 0.8;
    a->timeout = 30;
    a->max_wait = 60;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", generate_opts, NULL)) != -1) {
        int st = parse_generate_option(c, argv, a);
        if (st >= 0)
            return st;
    }
    if (cli_no_positional("generate", argc, argv))
        return CLI_EXIT_USAGE;
    int rc = tools_model_select("generate", a->model, a->model_file, "tiny-lm", a->initial, a->swarm, spec);
    if (rc != CLI_EXIT_OK)
        return rc;
    if ((*spec)->task != EXPERT_TASK_BYTES)
        return cli_usage_error("generate", "%s is not a language model: use 'starling infer'", (*spec)->name);
    if ((*spec)->vocab != 256)
        return cli_usage_error("generate", "%s has a vocabulary of %d tokens: generate speaks bytes (256)",
                               (*spec)->name, (*spec)->vocab);
    if (!a->initial)
        return cli_usage_error("generate", "--initial-peers LIST is required");
    if (!a->prompt[0])
        return cli_usage_error("generate", "--prompt must hold at least one byte");
    return -1;
}

static void on_message(void *arg, const char *msg)
{
    (void)arg;
    fprintf(stderr, "starling generate: %s\n", msg);
}

static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* A byte from the mean distribution p (V entries) at temperature t > 0:
 * p^(1/t), renormalised, which is softmax(logits / t). */
static int sample(const float *p, int V, double t, uint64_t *rng)
{
    double w[256], sum = 0, top = -HUGE_VAL;
    for (int c = 0; c < V; c++)
        if (p[c] > 0 && log((double)p[c]) > top)
            top = log((double)p[c]);
    /* Relative to the most likely byte, so no weight underflows to zero
     * at low temperatures (that one's weight is 1). */
    for (int c = 0; c < V; c++) {
        w[c] = p[c] > 0 ? exp((log((double)p[c]) - top) / t) : 0.0;
        sum += w[c];
    }
    double u = (double)(splitmix64(rng) >> 11) * (1.0 / 9007199254740992.0) * sum;
    for (int c = 0; c < V; c++) {
        u -= w[c];
        if (u < 0)
            return c;
    }
    return V - 1;
}

/* What one run produced, for the report. */
typedef struct gen_state {
    unsigned char *text;       /* prompt + generated */
    size_t len, prompt_len;
    uint64_t ver_min[64], ver_max[64];
    double elapsed, lat_sum;
    long retries;
} gen_state;

/* One byte: the window ending at the text's end, forward through the
 * swarm; appends the byte. Returns route_infer_run's result. */
static int next_byte(const gen_args *a, const struct expert_model_spec *spec, tools_client *cl,
                     gen_state *g, float *row, uint64_t *rng, char *err, size_t errlen)
{
    int T = spec->seq, V = spec->vocab;
    size_t from = g->len > (size_t)T ? g->len - (size_t)T : 0;
    int n = (int)(g->len - from);
    for (int i = 0; i < T; i++)
        row[i] = i < n ? (float)g->text[from + (size_t)i] : 0.0f; /* causal: the padding is never seen */
    int pos = n - 1, pred = 0;
    float probs[256];
    uint8_t agree = 0;
    route_infer_result res;
    memset(&res, 0, sizeof res);
    res.pred = &pred;
    res.probs = probs;
    res.agree = &agree;
    route_infer_config ic = {.dht = cl->d, .ident = &cl->ident,
                             .swarm_key = cl->has_swarm_key ? cl->swarm_key : NULL, .model = spec,
                             .inputs = row, .n = 1, .positions = &pos, .batch = 1,
                             .replicas = (int)a->replicas, .inflight = (int)a->replicas,
                             .call_timeout_s = a->timeout, .max_wait_s = a->max_wait,
                             .on_message = on_message};
    int rc = route_infer_run(&cl->loop, &ic, &res);
    if (rc != 0) {
        snprintf(err, errlen, "%s", res.error[0] ? res.error : strerror(-rc));
        return rc;
    }
    g->text[g->len++] = (unsigned char)(a->temperature > 0 ? sample(probs, V, a->temperature, rng) : pred);
    g->lat_sum += res.p50_ms;
    g->retries += res.retries;
    for (int s = 0; s < spec->n_stages && s < 64; s++) {
        g->ver_min[s] = res.ver_min[s] < g->ver_min[s] ? res.ver_min[s] : g->ver_min[s];
        g->ver_max[s] = res.ver_max[s] > g->ver_max[s] ? res.ver_max[s] : g->ver_max[s];
    }
    return 0;
}

/* JSON string body of n bytes (not valid UTF-8 bytes escaped as \u00XX). */
static void json_bytes(FILE *f, const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = s[i];
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch >= 0x20 && ch < 0x7f)
            fputc(ch, f);
        else
            fprintf(f, "\\u%04x", ch);
    }
}

static void report(const gen_args *a, const struct expert_model_spec *spec, const gen_state *g)
{
    size_t gen = g->len - g->prompt_len;
    double bps = g->elapsed > 0 ? (double)gen / g->elapsed : 0;
    if (a->json) {
        printf("{\"model\":\"%s\",\"prompt\":\"", spec->name);
        json_bytes(stdout, g->text, g->prompt_len);
        printf("\",\"text\":\"");
        json_bytes(stdout, g->text + g->prompt_len, gen);
        printf("\",\"tokens\":%zu,\"tokens_per_s\":%.2f,\"ms_per_token\":%.2f,\"retries\":%ld,"
               "\"temperature\":%g,\"replicas\":%ld,\"versions\":[",
               gen, bps, gen ? g->elapsed * 1000.0 / (double)gen : 0.0, g->retries, a->temperature,
               a->replicas);
        for (int s = 0; s < spec->n_stages; s++)
            printf("%s{\"stage\":%d,\"min\":%llu,\"max\":%llu}", s ? "," : "", s,
                   (unsigned long long)g->ver_min[s], (unsigned long long)g->ver_max[s]);
        printf("],\"status\":\"ok\"}\n");
    } else {
        putchar('\n');
    }
    fflush(stdout); /* before the report on stderr, when both go to one file */
    fprintf(stderr, "starling generate: %zu bytes in %.2f s (%.1f bytes/s, %.0f ms each), %ld retries\n",
            gen, g->elapsed, bps, gen ? g->elapsed * 1000.0 / (double)gen : 0.0, g->retries);
    for (int s = 0; s < spec->n_stages; s++)
        fprintf(stderr, "starling generate: stage %s.%d weight versions %llu..%llu\n", spec->name, s,
                (unsigned long long)g->ver_min[s], (unsigned long long)g->ver_max[s]);
}

static int generate(const gen_args *a, const struct expert_model_spec *spec)
{
    gen_state g;
    memset(&g, 0, sizeof g);
    g.prompt_len = strlen(a->prompt);
    g.text = malloc(g.prompt_len + (size_t)a->tokens);
    float *row = malloc((size_t)spec->seq * sizeof *row);
    if (!g.text || !row) {
        free(g.text);
        free(row);
        return cli_fail("generate", "out of memory");
    }
    memcpy(g.text, a->prompt, g.prompt_len);
    g.len = g.prompt_len;
    for (int s = 0; s < 64; s++)
        g.ver_min[s] = UINT64_MAX;
    tools_client cl;
    int st = tools_client_open(&cl, "generate", a->initial, a->listen, a->identity, a->swarm, 15);
    if (st != CLI_EXIT_OK) {
        free(g.text);
        free(row);
        return st;
    }
    if (!a->json) {
        fwrite(g.text, 1, g.len, stdout);
        fflush(stdout);
    }
    uint64_t rng = (uint64_t)a->seed;
    char err[320] = "";
    double t0 = mono();
    int rc = 0;
    for (long i = 0; i < a->tokens && rc == 0; i++) {
        rc = next_byte(a, spec, &cl, &g, row, &rng, err, sizeof err);
        if (rc == 0 && !a->json) {
            putchar(g.text[g.len - 1]);
            fflush(stdout);
        }
    }
    g.elapsed = mono() - t0;
    tools_client_close(&cl);
    st = CLI_EXIT_OK;
    if (rc != 0)
        st = cli_fail("generate", "after %zu bytes: %s", g.len - g.prompt_len, err);
    else
        report(a, spec, &g);
    free(g.text);
    free(row);
    return st;
}

int cmd_generate(int argc, char **argv)
{
    gen_args a;
    const struct expert_model_spec *spec = NULL;
    int st = parse_generate_args(argc, argv, &a, &spec);
    if (st >= 0)
        return st;
    return generate(&a, spec);
}
