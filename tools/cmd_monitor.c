/* starling monitor: the operator's view of a swarm that nobody configured. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "expert/model.h"
#include "swarm/announce.h"
#include "peer/keeper.h"
#include "net/tensorfmt.h"
#include "peer/statesync.h"
#include "routing/swarm.h"
#include "tools/cli.h"
#include "tools/client.h"

static const char monitor_help[] =
    "Usage: starling monitor --initial-peers ADDR[,ADDR...] [--model NAME] [--watch SECONDS]\n"
    "                        [--model-file FILE] [--json] [--min-throughput X]\n"
    "\n"
    "Joins the DHT as a light client, finds the models announced in the swarm\n"
    "(or just --model) and shows, for every stage, its holders: short peer ID,\n"
    "address, state, announced throughput, load, age of the announcement and\n"
    "weight version. Stages with no online holder, or whose total throughput is\n"
    "below --min-throughput, stand out, and so do holders whose announced version\n"
    "or throughput is far above their replicas' (SUSPECT), holders whose weights\n"
    "stopped moving (FROZEN) and holders that refused gradients. Totals: peers,\n"
    "blocks, throughput per stage and the bottleneck stage.\n"
    "\n"
    "Options:\n"
    "  --initial-peers LIST   DHT addresses to join through (required)\n"
    "  --model NAME           show only this model\n"
    "  --model-file FILE      show only the model a model file describes\n"
    "                         (docs/models.md)\n"
    "  --watch SECONDS        redraw every SECONDS until interrupted\n"
    "  --json                 print one JSON document (schema in docs/operations.md)\n"
    "  --min-throughput X     flag stages serving fewer than X samples/s (default 0)\n"
    "  --timeout S            seconds to join and look up (default 10)\n"
    "  --swarm-key FILE       pre-shared key of a private swarm\n"
    "  --listen HOST:PORT     local DHT address (default: any port)\n"
    "  -h, --help             this text\n"
    "\n"
    "Exit status: 0 every stage of every shown model has an online holder,\n"
    "1 some stage has none, 2 usage or connection error (unreachable initial\n"
    "peers, wrong swarm key, no model announced).\n";

#define MAX_MODELS 16

typedef struct view {
    const struct expert_model_spec *specs[MAX_MODELS];
    route_swarm *sw[MAX_MODELS];
    int n;
    char unknown[MAX_MODELS][49];   /* announced models this build does not know */
    int n_unknown;
    int models_done;                /* the models index lookup finished */
    int models_status;
    struct cold {                   /* cold copies per stage (peer/keeper.h) */
        struct view *v;
        int copies, pending;
        uint64_t version;           /* the newest copy's weight version */
    } cold[MAX_MODELS][PEER_KEEPER_MAX_STAGES];
    int cold_pending;
} view;

static void on_keepers(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)d;
    struct cold *c = ud;
    c->pending = 0;
    c->v->cold_pending--;
    c->copies = 0;
    c->version = 0;
    for (size_t i = 0; status == 0 && i < n; i++) {
        peer_keep_record r;
        if (!e[i].is_signed || peer_keep_record_decode(&r, e[i].value, e[i].value_len) != 0 ||
            r.weight_version == 0)
            continue; /* version 0: a withdrawn copy */
        c->copies++;
        if (r.weight_version > c->version)
            c->version = r.weight_version;
    }
}

/* Starts the cold-copy lookups of every shown stage. */
static void look_up_copies(dht *d, view *v)
{
    for (int k = 0; k < v->n; k++)
        for (int i = 0; i < v->specs[k]->n_stages && i < PEER_KEEPER_MAX_STAGES; i++) {
            struct cold *c = &v->cold[k][i];
            if (c->pending)
                continue;
            char name[80];
            uint8_t key[DHT_ID_LEN];
            expert_stage_name(name, sizeof name, v->specs[k], i);
            peer_keep_key(key, name, expert_stage_hash(v->specs[k], i));
            c->v = v;
            if (dht_get(d, key, on_keepers, c) == 0) {
                c->pending = 1;
                v->cold_pending++;
            }
        }
}

static volatile sig_atomic_t g_stop;
static void on_sigint(int s)
{
    (void)s;
    g_stop = 1;
}

static void on_models(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)d;
    view *v = ud;
    v->models_done = 1;
    v->models_status = status;
    for (size_t i = 0; status == 0 && i < n; i++) {
        peer_model_record m;
        if (!e[i].is_signed || peer_model_record_decode(&m, e[i].value, e[i].value_len) != 0)
            continue;
        const struct expert_model_spec *spec = expert_model_find(m.model);
        int dup = 0;
        for (int k = 0; k < v->n; k++)
            dup |= spec && v->specs[k] == spec;
        for (int k = 0; k < v->n_unknown; k++)
            dup |= !strcmp(v->unknown[k], m.model);
        if (dup)
            continue;
        if (spec && v->n < MAX_MODELS)
            v->specs[v->n++] = spec;
        else if (!spec && v->n_unknown < MAX_MODELS)
            snprintf(v->unknown[v->n_unknown++], sizeof v->unknown[0], "%s", m.model);
    }
}

static int lookups_pending(view *v)
{
    if (v->cold_pending > 0)
        return 1;
    for (int k = 0; k < v->n; k++)
        for (int i = 0; i < route_swarm_n_stages(v->sw[k]); i++) {
            route_stage *st = route_swarm_stage(v->sw[k], i);
            if (st->pending || st->lookups == 0)
                return 1;
        }
    return 0;
}

/* What the online holders of a stage claim, in holder order (offline
 * holders claim 0: no evidence either way). */
static void stage_claims(const route_stage *st, uint64_t *version, double *tput)
{
    for (int i = 0; i < st->n_holders; i++) {
        int on = st->holders[i].ann.state == PEER_STATE_ONLINE;
        version[i] = on ? st->holders[i].ann.weight_version : 0;
        tput[i] = on ? st->holders[i].ann.throughput : 0;
    }
}

/* Why holder h's claims look false (far above its replicas':
 * peer_trust_version_suspect, peer_trust_tput_suspect), or NULL. */
static const char *holder_suspect(const route_stage *st, int h)
{
    uint64_t version[ROUTE_MAX_HOLDERS];
    double tput[ROUTE_MAX_HOLDERS];
    stage_claims(st, version, tput);
    int v = peer_trust_version_suspect(version, st->n_holders, h);
    int t = peer_trust_tput_suspect(tput, st->n_holders, h);
    return v && t ? "version and throughput far above its replicas"
           : v    ? "version far above its replicas"
           : t    ? "throughput far above its replicas"
                  : NULL;
}

/* The stage's total throughput; a claim far above the other replicas'
 * counts as their median, so one false claim cannot hide a bottleneck. */
static double stage_tput(const route_stage *st)
{
    uint64_t version[ROUTE_MAX_HOLDERS];
    double tput[ROUTE_MAX_HOLDERS], t = 0;
    stage_claims(st, version, tput);
    for (int i = 0; i < st->n_holders; i++)
        t += peer_trust_tput_suspect(tput, st->n_holders, i) ? peer_trust_median(tput, st->n_holders, i) : tput[i];
    return t;
}

/* Counts distinct peers over every shown stage. */
static int count_peers(view *v, int *blocks_out)
{
    uint8_t ids[1024][DHT_ID_LEN];
    int n = 0, blocks = 0;
    for (int k = 0; k < v->n; k++)
        for (int i = 0; i < route_swarm_n_stages(v->sw[k]); i++) {
            route_stage *st = route_swarm_stage(v->sw[k], i);
            for (int h = 0; h < st->n_holders; h++) {
                if (st->holders[h].ann.state != PEER_STATE_ONLINE)
                    continue;
                blocks++;
                int seen = 0;
                for (int j = 0; j < n && !seen; j++)
                    seen = !memcmp(ids[j], st->holders[h].rep.id, DHT_ID_LEN);
                if (!seen && n < 1024)
                    memcpy(ids[n++], st->holders[h].rep.id, DHT_ID_LEN);
            }
        }
    *blocks_out = blocks;
    return n;
}

static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            fprintf(f, "\\%c", *s);
        else if ((unsigned char)*s < 0x20)
            fprintf(f, "\\u%04x", *s);
        else
            fputc(*s, f);
    }
    fputc('"', f);
}

/* The wire formats a holder announced ("wf"; none: float32 only, which
 * every peer takes, so it is listed also when "wf" holds only formats this
 * build does not know). */
static void formats_text(const peer_announce *a, char *buf, size_t cap)
{
    peer_fmt_mask m = (a->formats & PEER_FMT_MASK_ALL) | PEER_FMT_BIT(PEER_FMT_F32);
    if (peer_tensorfmt_mask_format(m, buf, cap) < 0)
        buf[0] = '\0';
}

/* Returns 1 if every stage is covered. */
static int render_json(FILE *f, view *v, double min_tput)
{
    uint64_t now = dht_now_ms();
    int blocks, peers = count_peers(v, &blocks), all = 1;
    fprintf(f, "{\"schema\":\"starling.monitor.v1\",\"time_ms\":%llu,\"peers\":%d,\"blocks\":%d,\"models\":[",
            (unsigned long long)now, peers, blocks);
    for (int k = 0; k < v->n; k++) {
        int covered = 1, bottleneck = -1;
        double bt = 0;
        fprintf(f, "%s{\"name\":", k ? "," : "");
        json_str(f, v->specs[k]->name);
        fprintf(f, ",\"stages\":[");
        for (int i = 0; i < route_swarm_n_stages(v->sw[k]); i++) {
            route_stage *st = route_swarm_stage(v->sw[k], i);
            double t = stage_tput(st);
            int online = route_stage_usable(st);
            covered &= online > 0;
            if (bottleneck < 0 || t < bt) {
                bottleneck = i;
                bt = t;
            }
            fprintf(f, "%s{\"name\":", i ? "," : "");
            json_str(f, st->name);
            const struct cold *cc = &v->cold[k][i < PEER_KEEPER_MAX_STAGES ? i : 0];
            fprintf(f, ",\"index\":%d,\"online\":%d,\"throughput\":%.1f,\"covered\":%s,\"slow\":%s,"
                       "\"wrong_version_holders\":%d,\"cold_copies\":%d,\"cold_version\":%llu,\"holders\":[",
                    i, online, t, online ? "true" : "false", online && t < min_tput ? "true" : "false",
                    st->wrong_hash, cc->copies, (unsigned long long)cc->version);
            for (int h = 0; h < st->n_holders; h++) {
                const route_holder *ho = &st->holders[h];
                char hex[DHT_ID_HEX_LEN + 1];
                dht_id_to_hex(hex, ho->rep.id);
                double age = ho->ann.time_ms && now > ho->ann.time_ms ? (double)(now - ho->ann.time_ms) / 1000 : 0;
                fprintf(f, "%s{\"id\":\"%s\",\"addr\":", h ? "," : "", hex);
                json_str(f, ho->ann.addr);
                fprintf(f, ",\"state\":\"%s\",\"throughput\":%.1f,\"load\":%.3f,\"age_s\":%.1f,"
                           "\"weight_version\":%llu,\"avg_rounds\":%llu,\"avg_abandoned\":%llu,"
                           "\"avg_group\":%d,\"grads_refused\":%llu,\"frozen_steps\":%llu,",
                        peer_state_name(ho->ann.state), ho->ann.throughput, ho->ann.load, age,
                        (unsigned long long)ho->ann.weight_version, (unsigned long long)ho->ann.avg_rounds,
                        (unsigned long long)ho->ann.avg_abandoned, ho->ann.avg_group,
                        (unsigned long long)ho->ann.grads_refused, (unsigned long long)ho->ann.frozen_steps);
                if (ho->ann.lost_from > ho->ann.lost_to)
                    fprintf(f, "\"state_lost\":{\"from\":%llu,\"to\":%llu},",
                            (unsigned long long)ho->ann.lost_from, (unsigned long long)ho->ann.lost_to);
                else
                    fputs("\"state_lost\":null,", f);
                const char *why = holder_suspect(st, h);
                fputs("\"suspect\":", f);
                if (why)
                    json_str(f, why);
                else
                    fputs("null", f);
                fputs(",\"device\":", f);
                json_str(f, ho->ann.device);
                fputs(",\"precision\":", f);
                json_str(f, ho->ann.precision[0] ? ho->ann.precision : "fp32");
                char wf[64];
                formats_text(&ho->ann, wf, sizeof wf);
                fprintf(f, ",\"wire_formats\":\"%s\",\"bytes_per_sample\":%.1f}", wf, ho->ann.bytes_per_sample);
            }
            fprintf(f, "]}");
        }
        fprintf(f, "],\"covered\":%s,\"bottleneck\":", covered ? "true" : "false");
        if (bottleneck >= 0)
            json_str(f, route_swarm_stage(v->sw[k], bottleneck)->name);
        else
            fputs("null", f);
        fputc('}', f);
        all &= covered;
    }
    fprintf(f, "],\"unknown_models\":[");
    for (int k = 0; k < v->n_unknown; k++) {
        fputs(k ? "," : "", f);
        json_str(f, v->unknown[k]);
    }
    fprintf(f, "]}\n");
    fflush(f);
    return all;
}

static int render_text(FILE *f, view *v, double min_tput, int color)
{
    const char *red = color ? "\033[1;31m" : "", *yel = color ? "\033[33m" : "",
               *bold = color ? "\033[1m" : "", *off = color ? "\033[0m" : "";
    uint64_t now = dht_now_ms();
    int blocks, peers = count_peers(v, &blocks), all = 1;
    for (int k = 0; k < v->n; k++) {
        int covered = 1, bottleneck = -1;
        double bt = 0;
        fprintf(f, "%smodel %s%s (%d stages)\n", bold, v->specs[k]->name, off, v->specs[k]->n_stages);
        fprintf(f, "  %-14s %-9s %-22s %-8s %-12s %10s %5s %7s %8s %9s %5s %8s %s\n", "stage", "peer", "address",
                "state", "device", "samples/s", "load", "age", "version", "avg", "group", "B/sample", "formats");
        for (int i = 0; i < route_swarm_n_stages(v->sw[k]); i++) {
            route_stage *st = route_swarm_stage(v->sw[k], i);
            double t = stage_tput(st);
            int online = route_stage_usable(st);
            covered &= online > 0;
            if (bottleneck < 0 || t < bt) {
                bottleneck = i;
                bt = t;
            }
            if (!online)
                fprintf(f, "%s! %-14s UNCOVERED: no online holder%s%s\n", red, st->name,
                        st->wrong_hash ? " (some holders run another model version)" : "", off);
            for (int h = 0; h < st->n_holders; h++) {
                const route_holder *ho = &st->holders[h];
                char hex[DHT_ID_HEX_LEN + 1];
                dht_id_to_hex(hex, ho->rep.id);
                double age = ho->ann.time_ms && now > ho->ann.time_ms ? (double)(now - ho->ann.time_ms) / 1000 : 0;
                char avg[32];
                snprintf(avg, sizeof avg, "%llu/%llu", (unsigned long long)ho->ann.avg_rounds,
                         (unsigned long long)ho->ann.avg_abandoned);
                char wf[64];
                formats_text(&ho->ann, wf, sizeof wf);
                char dev[48];
                snprintf(dev, sizeof dev, "%s/%s", ho->ann.device[0] ? ho->ann.device : "?",
                         ho->ann.precision[0] ? ho->ann.precision : "fp32");
                fprintf(f, "  %-14s %-9.8s %-22s %-8s %-12s %10.0f %5.2f %6.0fs %8llu %9s %5d %8.0f %s\n",
                        h ? "" : st->name, hex, ho->ann.addr, peer_state_name(ho->ann.state), dev,
                        ho->ann.throughput, ho->ann.load,
                        age, (unsigned long long)ho->ann.weight_version, avg, ho->ann.avg_group,
                        ho->ann.bytes_per_sample, wf);
                if (ho->ann.lost_from > ho->ann.lost_to)
                    fprintf(f, "%s! %-14s STATE LOST: peer %.8s went back from weight version %llu to %llu%s\n", red,
                            st->name, hex, (unsigned long long)ho->ann.lost_from,
                            (unsigned long long)ho->ann.lost_to, off);
                const char *why = holder_suspect(st, h);
                if (why) {
                    uint64_t version[ROUTE_MAX_HOLDERS];
                    double tput[ROUTE_MAX_HOLDERS];
                    stage_claims(st, version, tput);
                    fprintf(f, "%s! %-14s SUSPECT: peer %.8s: %s (weight version %llu, %.0f samples/s; "
                               "its replicas' median: %llu, %.0f)%s\n", red, st->name, hex, why,
                            (unsigned long long)version[h], tput[h],
                            (unsigned long long)peer_trust_median_u64(version, st->n_holders, h),
                            peer_trust_median(tput, st->n_holders, h), off);
                }
                if (ho->ann.frozen_steps)
                    fprintf(f, "%s! %-14s FROZEN: peer %.8s: weights have not moved in %llu steps (weight version "
                               "%llu): its gradients change nothing%s\n", red, st->name, hex,
                            (unsigned long long)ho->ann.frozen_steps, (unsigned long long)ho->ann.weight_version,
                            off);
                if (ho->ann.grads_refused)
                    fprintf(f, "%s* %-14s peer %.8s refused %llu gradient%s (training-integrity checks; its log "
                               "says why)%s\n", yel, st->name, hex, (unsigned long long)ho->ann.grads_refused,
                            ho->ann.grads_refused == 1 ? "" : "s", off);
            }
            const struct cold *cc = &v->cold[k][i < PEER_KEEPER_MAX_STAGES ? i : 0];
            if (cc->copies)
                fprintf(f, "  %-14s cold copies: %d (newest: weight version %llu)\n", "", cc->copies,
                        (unsigned long long)cc->version);
            else if (online == 1)
                fprintf(f, "%s* %-14s no cold copy: its training state is on one peer only%s\n", yel, st->name,
                        off);
            if (online > 1)
                fprintf(f, "  %-14s replica group of %d (avg: averaging rounds done/abandoned; group: size of the last one)\n", "",
                        online);
            if (online && t < min_tput)
                fprintf(f, "%s* %-14s SLOW: %.0f samples/s < %.0f%s\n", yel, st->name, t, min_tput, off);
        }
        fprintf(f, "  stage throughput (samples/s):");
        for (int i = 0; i < route_swarm_n_stages(v->sw[k]); i++)
            fprintf(f, " %.0f", stage_tput(route_swarm_stage(v->sw[k], i)));
        fputc('\n', f);
        if (bottleneck >= 0)
            fprintf(f, "  bottleneck: %s\n", route_swarm_stage(v->sw[k], bottleneck)->name);
        fprintf(f, "  %s%s%s\n\n", covered ? "" : red, covered ? "every stage covered" : "SOME STAGES UNCOVERED",
                off);
        all &= covered;
    }
    for (int k = 0; k < v->n_unknown; k++)
        fprintf(f, "model %s: announced, but not known to this build of starling\n", v->unknown[k]);
    fprintf(f, "peers: %d   blocks served: %d\n", peers, blocks);
    fflush(f);
    return all;
}

static int wait_lookups(tools_client *cl, view *v, double timeout_s)
{
    double waited = 0;
    while (lookups_pending(v) && waited < timeout_s && !g_stop) {
        uv_run(&cl->loop, UV_RUN_NOWAIT);
        usleep(10000);
        waited += 0.01;
    }
    return !lookups_pending(v);
}

int cmd_monitor(int argc, char **argv)
{
    enum { O_INITIAL = 256, O_MODEL, O_WATCH, O_JSON, O_MIN, O_TIMEOUT, O_SWARM, O_LISTEN, O_MODEL_FILE };
    static const struct option opts[] = {
        {"initial-peers", required_argument, NULL, O_INITIAL},
        {"model", required_argument, NULL, O_MODEL},
        {"model-file", required_argument, NULL, O_MODEL_FILE},
        {"watch", required_argument, NULL, O_WATCH},
        {"json", no_argument, NULL, O_JSON},
        {"min-throughput", required_argument, NULL, O_MIN},
        {"timeout", required_argument, NULL, O_TIMEOUT},
        {"swarm-key", required_argument, NULL, O_SWARM},
        {"listen", required_argument, NULL, O_LISTEN},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *initial = NULL, *model = NULL, *swarm = NULL, *listen = NULL;
    const char *model_file = NULL;
    double watch = 0, min_tput = 0, timeout = 10;
    int json = 0, c;

    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        switch (c) {
        case 'h': fputs(monitor_help, stdout); return CLI_EXIT_OK;
        case O_INITIAL: initial = optarg; break;
        case O_MODEL: model = optarg; break;
        case O_MODEL_FILE: model_file = optarg; break;
        case O_JSON: json = 1; break;
        case O_SWARM: swarm = optarg; break;
        case O_LISTEN: listen = optarg; break;
        case O_WATCH:
            if (cli_parse_double("monitor", "--watch", optarg, 0.2, 86400, &watch))
                return CLI_EXIT_USAGE;
            break;
        case O_MIN:
            if (cli_parse_double("monitor", "--min-throughput", optarg, 0, 1e12, &min_tput))
                return CLI_EXIT_USAGE;
            break;
        case O_TIMEOUT:
            if (cli_parse_double("monitor", "--timeout", optarg, 0.1, 3600, &timeout))
                return CLI_EXIT_USAGE;
            break;
        default: return cli_bad_option("monitor", c, argv);
        }
    }
    if (cli_no_positional("monitor", argc, argv))
        return CLI_EXIT_USAGE;
    view v;
    memset(&v, 0, sizeof v);
    if (tools_model_select("monitor", model, model_file, NULL, initial, swarm, &v.specs[0]))
        return CLI_EXIT_USAGE;
    if (v.specs[0]) {
        model = v.specs[0]->name;
        v.n = 1;
    }
    tools_client cl;
    int rc = tools_client_open(&cl, "monitor", initial, listen, NULL, swarm, timeout);
    if (rc != CLI_EXIT_OK)
        return CLI_EXIT_USAGE; /* usage or connection error: 2 */

    if (!model) {
        uint8_t key[DHT_ID_LEN];
        dht_id_of_bytes(key, PEER_MODELS_KEY, strlen(PEER_MODELS_KEY));
        if (dht_get(cl.d, key, on_models, &v) == 0) {
            double waited = 0;
            while (!v.models_done && waited < timeout) {
                uv_run(&cl.loop, UV_RUN_NOWAIT);
                usleep(10000);
                waited += 0.01;
            }
        }
        if (v.n == 0 && v.n_unknown == 0) {
            tools_client_close(&cl);
            fprintf(stderr, "starling monitor: no model is announced in this swarm (no peer online?)\n");
            return CLI_EXIT_USAGE;
        }
    }
    for (int k = 0; k < v.n; k++)
        v.sw[k] = route_swarm_create(cl.d, v.specs[k], watch > 0 ? watch : 1e9);

    signal(SIGINT, on_sigint);
    signal(SIGTERM, on_sigint);
    int color = !json && isatty(STDOUT_FILENO);
    int all = 1;
    for (;;) {
        uv_update_time(&cl.loop);
        for (int k = 0; k < v.n; k++) {
            for (int i = 0; i < route_swarm_n_stages(v.sw[k]); i++)
                route_swarm_invalidate(v.sw[k], i);
            route_swarm_refresh(v.sw[k], (double)uv_now(&cl.loop) / 1000.0);
        }
        look_up_copies(cl.d, &v);
        wait_lookups(&cl, &v, timeout);
        if (g_stop)
            break;
        if (watch > 0 && color)
            fputs("\033[H\033[2J", stdout);
        all = json ? render_json(stdout, &v, min_tput) : render_text(stdout, &v, min_tput, color);
        if (watch <= 0)
            break;
        for (double s = 0; s < watch && !g_stop; s += 0.05) {
            uv_run(&cl.loop, UV_RUN_NOWAIT);
            usleep(50000);
        }
        if (g_stop)
            break;
    }
    for (int k = 0; k < v.n; k++)
        route_swarm_destroy(&v.sw[k]);
    tools_client_close(&cl);
    return all ? CLI_EXIT_OK : CLI_EXIT_FAIL;
}
