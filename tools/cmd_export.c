/* starling export: every stage's newest weights, collected from the swarm's
 * holders, written as a Hugging Face model directory. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "expert/atomicfile.h"
#include "expert/block.h"
#include "expert/hfweights.h"
#include "expert/model.h"
#include "peer/catchup.h"
#include "peer/statesync.h"
#include "tools/cli.h"
#include "tools/client.h"

static const char export_help[] =
    "Usage: starling export --initial-peers ADDR[,ADDR...] --out DIR\n"
    "                       [--model NAME | --model-file FILE] ...\n"
    "\n"
    "Downloads every stage's newest weights from the swarm (from one of its\n"
    "online holders, the newest trusted weight version, as a newcomer peer\n"
    "does) and writes DIR/model.safetensors under GPT-2's Hugging Face names\n"
    "and DIR/config.json (transformers' GPT2Config), which a peer's\n"
    "--init-weights DIR/model.safetensors reads back. The weight version of\n"
    "each stage goes into the file's metadata and is printed. Only the\n"
    "optimizer-free weights leave: the file holds no optimizer state.\n"
    "\n"
    "Options:\n"
    "  --initial-peers LIST   DHT addresses to join through (required)\n"
    "  --out DIR              where to write (created if missing; its model.safetensors\n"
    "                         and config.json are replaced only once complete)\n"
    "  --model NAME           a GPT-style model (default tiny-lm): a built-in, or one a\n"
    "                         peer of the swarm publishes (fetched and checked)\n"
    "  --model-file FILE      the model a model file describes (docs/models.md)\n"
    "  --timeout S            bound on each stage's lookup and download (default 60)\n"
    "  --identity FILE, --swarm-key FILE, --listen HOST:PORT   as for 'starling train'\n"
    "  -h, --help             this text\n"
    "\n"
    "Exit status: 0 written, 1 failed (a stage without an online holder, a\n"
    "download that failed, a model without Hugging Face names), 2 usage error.\n";

enum { O_INITIAL = 256, O_MODEL, O_MODEL_FILE, O_OUT, O_TIMEOUT, O_IDENTITY, O_SWARM, O_LISTEN };

static const struct option export_opts[] = {
    {"initial-peers", required_argument, NULL, O_INITIAL},
    {"model", required_argument, NULL, O_MODEL},
    {"model-file", required_argument, NULL, O_MODEL_FILE},
    {"out", required_argument, NULL, O_OUT},
    {"timeout", required_argument, NULL, O_TIMEOUT},
    {"identity", required_argument, NULL, O_IDENTITY},
    {"swarm-key", required_argument, NULL, O_SWARM},
    {"listen", required_argument, NULL, O_LISTEN},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

typedef struct export_args {
    const char *initial, *model, *model_file, *out, *identity, *swarm, *listen;
    double timeout;
} export_args;

/* The collection: one stage after another, on the client's loop. */
typedef struct collect {
    tools_client *cl;
    const struct expert_model_spec *m;
    double timeout;
    int stage;                   /* the stage being fetched */
    int busy;                    /* a lookup or download is out */
    int failed;
    float **params;              /* per stage */
    uint64_t *version;
    uint64_t rng;
    uv_timer_t deadline;
    uint64_t hold_max;           /* a state claiming a newer version is refused */
    char stage_name[80];
    char err[400];
} collect;

static void next_stage(collect *x);

/* The collection fails at the current stage: what happened, and why
 * (NULL: nothing more to say). A lookup or download still out keeps
 * x->busy until its callback, which the loop waits for. */
static void fail_stage(collect *x, const char *what, const char *why)
{
    if (x->failed)
        return;
    snprintf(x->err, sizeof x->err, "stage %s: %s%s%s", x->stage_name, what, why ? ": " : "", why ? why : "");
    x->failed = 1;
}

static void on_state(void *arg, int status, const uint8_t *buf, size_t len, uint64_t version)
{
    collect *x = arg;
    x->busy = 0;
    if (x->failed)
        return;
    if (status != 0) {
        fail_stage(x, "the state download failed", strerror(-status));
        return;
    }
    if (version > x->hold_max) {
        char why[120];
        snprintf(why, sizeof why, "the holder sent weight version %llu, far above what the stage's holders "
                                  "announce (refused)", (unsigned long long)version);
        fail_stage(x, why, NULL);
        return;
    }
    struct expert_block_config c;
    expert_model_stage(x->m, x->stage, &c);
    expert_block *b = expert_block_create(&c, 0);
    int rc = b ? expert_block_deserialize(b, buf, len) : -ENOMEM;
    size_t n = b ? expert_block_nparams(b) : 0;
    if (rc == 0 && !(x->params[x->stage] = malloc(n * sizeof(float))))
        rc = -ENOMEM;
    if (rc == 0)
        rc = expert_block_read_params(b, x->params[x->stage], NULL);
    expert_block_destroy(&b);
    if (rc != 0) {
        fail_stage(x, "the downloaded state does not load", strerror(-rc));
        return;
    }
    x->version[x->stage] = version;
    fprintf(stderr, "starling export: stage %s: weight version %llu (%zu bytes)\n", x->stage_name,
            (unsigned long long)version, len);
    x->stage++;
    next_stage(x);
}

static void on_holders(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    collect *x = ud;
    (void)d;
    x->busy = 0;
    if (x->failed)
        return;
    if (status != 0) {
        fail_stage(x, "the holder lookup failed", strerror(-status));
        return;
    }
    peer_catchup_view v;
    peer_catchup_read_holders(&v, e, n, x->cl->ident.id, x->stage_name, expert_stage_hash(x->m, x->stage));
    int k = peer_catchup_pick_holder(&v, &x->rng);
    x->hold_max = v.hold_max;
    if (k < 0) {
        fail_stage(x, "no online holder announces it (is a peer serving it?)", NULL);
        return;
    }
    int rc = peer_statesync_start(&x->cl->loop, &x->cl->ident, x->cl->has_swarm_key ? x->cl->swarm_key : NULL,
                                  v.ids[k], v.cand[k].addr, x->stage_name, x->timeout, on_state, x);
    if (rc != 0) {
        fail_stage(x, "cannot start the state download", strerror(-rc));
        return;
    }
    x->busy = 1;
}

static void next_stage(collect *x)
{
    if (x->failed || x->stage == x->m->n_stages)
        return;
    expert_stage_name(x->stage_name, sizeof x->stage_name, x->m, x->stage);
    uint8_t key[DHT_ID_LEN];
    dht_id_of_bytes(key, x->stage_name, strlen(x->stage_name));
    uv_timer_again(&x->deadline);
    if (dht_get(x->cl->d, key, on_holders, x) != 0) {
        fail_stage(x, "cannot start the holder lookup", NULL);
        return;
    }
    x->busy = 1;
}

static void on_deadline(uv_timer_t *t)
{
    collect *x = t->data;
    if (x->failed || x->stage == x->m->n_stages)
        return;
    char what[80];
    snprintf(what, sizeof what, "no answer within %g s", x->timeout);
    fail_stage(x, what, NULL);
}

/* Downloads every stage into x->params. Returns 0 or -1 (x->err says). */
static int collect_all(collect *x)
{
    uv_timer_init(&x->cl->loop, &x->deadline);
    x->deadline.data = x;
    uv_timer_start(&x->deadline, on_deadline, (uint64_t)(x->timeout * 1000), (uint64_t)(x->timeout * 1000));
    next_stage(x);
    /* A download in flight when the deadline passes finishes (bounded by
     * its own per-request timeout) before the loop is left. */
    while (x->stage < x->m->n_stages && (!x->failed || x->busy))
        uv_run(&x->cl->loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&x->deadline, NULL);
    uv_run(&x->cl->loop, UV_RUN_NOWAIT);
    return x->failed ? -1 : 0;
}

/* DIR/name into buf. */
static void join(char *buf, size_t len, const char *dir, const char *name)
{
    snprintf(buf, len, "%s/%s", dir, name);
}

/* Writes the weights and config into a->out. Returns the exit status. */
static int write_out(const export_args *a, const struct expert_model_spec *m, collect *x)
{
    if (mkdir(a->out, 0755) != 0 && errno != EEXIST)
        return cli_fail("export", "cannot create %s: %s", a->out, strerror(errno));
    char path[4096], cfgpath[4096], msg[400], versions[512] = "";
    join(path, sizeof path, a->out, "model.safetensors");
    join(cfgpath, sizeof cfgpath, a->out, "config.json");
    for (int s = 0; s < m->n_stages; s++) {
        size_t at = strlen(versions);
        snprintf(versions + at, sizeof versions - at, "%s%llu", s ? "," : "", (unsigned long long)x->version[s]);
    }
    const char *meta[] = {"format", "pt", "producer", "starling export", "model", m->name, "weight_versions",
                          versions};
    if (expert_hf_write(m, (const float *const *)x->params, path, meta, 4, msg, sizeof msg) != 0)
        return cli_fail("export", "%s", msg);
    char *cfg = expert_hf_config_json(m);
    if (!cfg)
        return cli_fail("export", "out of memory for %s", cfgpath);
    expert_atomic_file af;
    int rc = expert_atomic_open(&af, cfgpath);
    if (rc == 0) {
        expert_atomic_write(&af, cfg, strlen(cfg));
        rc = expert_atomic_commit(&af);
    }
    free(cfg);
    if (rc != 0)
        return cli_fail("export", "cannot write %s: %s", cfgpath, strerror(-rc));
    fprintf(stderr, "starling export: wrote %s and %s (weight versions %s)\n", path, cfgpath, versions);
    return CLI_EXIT_OK;
}

static int parse_export_args(int argc, char **argv, export_args *a, const struct expert_model_spec **spec)
{
    memset(a, 0, sizeof *a);
    a->timeout = 60;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", export_opts, NULL)) != -1) {
        switch (c) {
        case 'h': fputs(export_help, stdout); return CLI_EXIT_OK;
        case O_INITIAL: a->initial = optarg; break;
        case O_MODEL: a->model = optarg; break;
        case O_MODEL_FILE: a->model_file = optarg; break;
        case O_OUT: a->out = optarg; break;
        case O_IDENTITY: a->identity = optarg; break;
        case O_SWARM: a->swarm = optarg; break;
        case O_LISTEN: a->listen = optarg; break;
        case O_TIMEOUT:
            if (cli_parse_double("export", "--timeout", optarg, 0.1, 3600, &a->timeout))
                return CLI_EXIT_USAGE;
            break;
        default: return cli_bad_option("export", c, argv);
        }
    }
    if (cli_no_positional("export", argc, argv))
        return CLI_EXIT_USAGE;
    if (!a->initial)
        return cli_usage_error("export", "--initial-peers LIST is required");
    if (!a->out || !*a->out)
        return cli_usage_error("export", "--out DIR is required");
    int rc = tools_model_select("export", a->model, a->model_file, "tiny-lm", a->initial, a->swarm, spec);
    if (rc != 0)
        return rc;
    char *cfg = expert_hf_config_json(*spec);
    if (!cfg)
        return cli_usage_error("export", "model %s has stages without Hugging Face names (only GPT-style models, "
                                         "embed/decoder/lm_head, are exported)", (*spec)->name);
    free(cfg);
    return -1;
}

int cmd_export(int argc, char **argv)
{
    export_args a;
    const struct expert_model_spec *m = NULL;
    int st = parse_export_args(argc, argv, &a, &m);
    if (st >= 0)
        return st;
    tools_client cl;
    st = tools_client_open(&cl, "export", a.initial, a.listen, a.identity, a.swarm, 15);
    if (st != CLI_EXIT_OK)
        return st;
    collect x = {.cl = &cl, .m = m, .timeout = a.timeout, .rng = 0x9e3779b97f4a7c15ULL};
    x.params = calloc((size_t)m->n_stages, sizeof *x.params);
    x.version = calloc((size_t)m->n_stages, sizeof *x.version);
    if (!x.params || !x.version) {
        snprintf(x.err, sizeof x.err, "out of memory");
        x.failed = 1;
    }
    int rc = x.failed ? -1 : collect_all(&x);
    tools_client_close(&cl);
    st = rc != 0 ? cli_fail("export", "%s", x.err) : write_out(&a, m, &x);
    for (int s = 0; x.params && s < m->n_stages; s++)
        free(x.params[s]);
    free(x.params);
    free(x.version);
    return st;
}
