/* peer/daemon.c: a whole peer (peer/daemon.h): wires the parts together,
 * starts them and stops them in order. The parts: the DHT node, the block
 * service, the metrics endpoint and its text (peer/metrics_text.h),
 * joining the swarm (peer/joiner.h), catching joining blocks up
 * (peer/catchup.h), announcements (peer/announcer.h), replica averaging
 * (peer/averaging.h), cold copies (peer/keeper.h) and the periodic
 * checkpoint, which stays here: a timer and a work item whose only other
 * use is that a stop waits for it before the service closes. */
#include "peer/daemon.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "expert/model.h"

#include "peer/allreduce.h"
#include "peer/announcer.h"
#include "peer/averaging.h"
#include "peer/catchup.h"
#include "peer/joiner.h"
#include "peer/keeper.h"
#include "peer/log.h"
#include "peer/metrics.h"
#include "peer/metrics_text.h"
#include "peer/statesync.h"
#include "peer/timeslice.h"

#define STOP_ANNOUNCE_WAIT_MS 3000

struct peer_daemon {
    uv_loop_t *loop;
    dht_identity ident;
    uint8_t swarm_key[32];
    int has_swarm_key;
    char model[49];
    int n_stages;
    char device[33];
    char announce_addr[65];
    double announce_every_s, ttl_s, checkpoint_every_s;
    int max_queue_rows;
    FILE *log;

    dht *dht;
    peer_service *svc;
    peer_allreduce_server *rounds; /* svc's averaging rounds (the service frees it) */
    peer_statesync_server *states; /* svc's state serving (likewise) */
    peer_metrics *metrics;
    peer_announcer *announcer;
    peer_joiner *joiner;         /* NULL: the first node of a swarm */
    uv_timer_t ckpt_timer, stop_timer;
    double average_every_s;
    peer_avg_method avg_method;
    int optim_kind;
    peer_averaging *avg;         /* NULL: no averaging */
    int avg_running;             /* its stop callback is still to come */
    peer_keeper *keeper;         /* NULL: no cold copies */
    int keeper_running;
    int timers_open;             /* the timers, announcer and joiner not yet closed */

    int joined;
    int syncing;                 /* index of the block being caught up, or -1 */
    peer_catchup *catchup;
    int catchup_running;         /* its stop callback is still to come */
    int stopping;
    int stopped, destroy_pending; /* the stop callback has run; destroy was called */
    int stop_phase;              /* 1 announcing offline, 2 closing service, 3 closing the rest, 4 done */
    int ckpt_busy;
    uv_work_t ckpt_work;
    int ckpt_status;
    void (*stop_cb)(int, void *);
    void *stop_arg;
    void (*on_refused)(void *);
    void *refused_arg;
    int final_status;
};

#define say(d, ...) peer_log((d)->log, __VA_ARGS__)
static void maybe_stopped(peer_daemon *d);
static void continue_stop(peer_daemon *d);

/* ---- announcements (peer/announcer.h) ---- */

/* The daemon's part of block i's announcement. */
static void fill_announcement(void *arg, int i, peer_announce *a)
{
    peer_daemon *d = arg;
    peer_averaging_stats as;
    peer_averaging_get_stats(d->avg, i, &as);
    a->avg_rounds = as.rounds;
    a->avg_group = as.group;
    a->avg_abandoned = as.abandoned;
    peer_catchup_lost(d->catchup, i, &a->lost_from, &a->lost_to);
}

static void on_offline_announced(void *arg)
{
    peer_daemon *d = arg;
    if (d->stop_phase == 1)
        continue_stop(d);
}

/* ---- joining and newcomer state (peer/joiner.h, peer/catchup.h) ---- */

static void go_online(peer_daemon *d)
{
    d->syncing = -1;
    peer_averaging_anchor(d->avg); /* the state is final: diloco's first anchor */
    peer_announcer_go_online(d->announcer);
}

/* Catches the blocks up one after another (d->syncing), then goes online. */
static void catch_up_next(peer_daemon *d)
{
    if (d->stopping)
        return;
    while (++d->syncing < peer_service_n_blocks(d->svc))
        if (peer_catchup_start(d->catchup, d->syncing) == 0)
            return; /* on_caught_up goes on */
    go_online(d);
}

static void on_caught_up(void *arg, int block)
{
    (void)block;
    catch_up_next(arg);
}

static void on_catchup_joining(void *arg, int block)
{
    peer_daemon *d = arg;
    peer_announcer_joining(d->announcer, block);
}

static void on_catchup_stopped(void *arg)
{
    peer_daemon *d = arg;
    d->catchup_running = 0;
    maybe_stopped(d);
}

static void on_joined(void *arg)
{
    peer_daemon *d = arg;
    d->joined = 1;
    say(d, "joined the swarm; fetching the current state of %d block%s from holders",
        peer_service_n_blocks(d->svc), peer_service_n_blocks(d->svc) == 1 ? "" : "s");
    /* Each block is announced joining once its holders are read
     * (peer/catchup.h), so that a restarted peer still finds its own entry
     * from before, with the version it had. */
    d->syncing = -1;
    catch_up_next(d);
}

/* Another peer is online with our identity (the joiner said so): the
 * owner stops us (peer_daemon_config.on_refused), or we stop. */
static void on_join_refused(void *arg)
{
    peer_daemon *d = arg;
    if (d->on_refused)
        d->on_refused(d->refused_arg);
    else
        peer_daemon_destroy(&d); /* stops, then frees itself */
}

/* ---- replica averaging and cold copies (peer/averaging.h, peer/keeper.h) ---- */

static int avg_ready(void *arg)
{
    peer_daemon *d = arg;
    /* Only once online (not while fetching state). */
    return d->joined && d->syncing < 0;
}

static void on_avg_stopped(void *arg)
{
    peer_daemon *d = arg;
    d->avg_running = 0;
    if (d->stop_phase == 2)
        continue_stop(d);
}

/* The keeper may still be finishing a copy's download (statesync cannot
 * be cancelled) while the rest stops: only the daemon's memory waits for
 * it, not the final checkpoints. */
static void on_keeper_stopped(void *arg)
{
    peer_daemon *d = arg;
    d->keeper_running = 0;
    maybe_stopped(d);
}

/* ---- checkpoints ---- */

static void ckpt_work_cb(uv_work_t *w)
{
    peer_daemon *d = w->data;
    /* libuv's pool threads start at the first queued work and inherit the
     * loop thread's time slice (10 ms under --training-priority idle): give
     * this one the kernel's default, as the compute threads have. */
    (void)peer_sched_set_slice(0);
    d->ckpt_status = peer_service_checkpoint(d->svc);
}

static void ckpt_after_cb(uv_work_t *w, int status)
{
    peer_daemon *d = w->data;
    (void)status;
    d->ckpt_busy = 0;
    if (d->ckpt_status != 0)
        say(d, "checkpoint failed: %s", strerror(-d->ckpt_status));
    if (d->stopping && d->stop_phase == 2)
        continue_stop(d);
}

static void on_ckpt_timer(uv_timer_t *t)
{
    peer_daemon *d = t->data;
    if (d->ckpt_busy || d->stopping)
        return;
    d->ckpt_busy = 1;
    d->ckpt_work.data = d;
    if (uv_queue_work(d->loop, &d->ckpt_work, ckpt_work_cb, ckpt_after_cb) != 0)
        d->ckpt_busy = 0;
}

/* ---- metrics (peer/metrics_text.h) ---- */

static size_t render_metrics(char *buf, size_t cap, void *arg)
{
    peer_daemon *d = arg;
    peer_metrics_sources src = {.svc = d->svc, .avg = d->avg, .endpoint = d->metrics, .dht = d->dht};
    return peer_metrics_text_render(buf, cap, &src);
}

/* ---- start ---- */

static void destroy_after_close(peer_service *s, int ckpt_status, void *arg)
{
    (void)ckpt_status;
    (void)arg;
    peer_service_destroy(&s);
}

static int split_host(const char *hostport, char *host, size_t cap)
{
    /* "[v6]:port" -> "v6" in brackets kept; "a.b.c.d:port" -> "a.b.c.d" */
    const char *colon = strrchr(hostport, ':');
    if (!colon || (size_t)(colon - hostport) >= cap)
        return -EINVAL;
    memcpy(host, hostport, (size_t)(colon - hostport));
    host[colon - hostport] = '\0';
    return 0;
}

static int is_wildcard(const char *host)
{
    return !strcmp(host, "0.0.0.0") || !strcmp(host, "[::]") || !strcmp(host, "::");
}

/* Checks cfg and writes the listen host to host[0..cap). Returns the
 * model, or NULL with a sentence in err. */
static const struct expert_model_spec *check_config(uv_loop_t *loop, const peer_daemon_config *cfg, char *host,
                                                    size_t cap, char *err, size_t errlen)
{
    if (!loop || !cfg || !cfg->ident || !cfg->listen || cfg->n_initial > PEER_JOINER_MAX_INITIAL ||
        (cfg->n_initial > 0 && !cfg->initial)) {
        snprintf(err, errlen, "invalid daemon configuration");
        return NULL;
    }
    const struct expert_model_spec *spec = expert_model_find(cfg->svc.model);
    if (!spec) {
        snprintf(err, errlen, "unknown model '%s'", cfg->svc.model ? cfg->svc.model : "");
        return NULL;
    }
    if (split_host(cfg->listen, host, cap) != 0) {
        snprintf(err, errlen, "--listen '%s' is not HOST:PORT", cfg->listen);
        return NULL;
    }
    if (!cfg->announce_host && is_wildcard(host)) {
        snprintf(err, errlen,
                 "--listen %s binds every interface: give --announce HOST with the address other "
                 "machines reach this one at", cfg->listen);
        return NULL;
    }
    return spec;
}

/* A daemon with cfg's settings, nothing started. NULL: out of memory. */
static peer_daemon *daemon_new(uv_loop_t *loop, const peer_daemon_config *cfg,
                               const struct expert_model_spec *spec)
{
    peer_daemon *d = calloc(1, sizeof *d);
    if (!d)
        return NULL;
    d->loop = loop;
    d->ident = *cfg->ident;
    if (cfg->swarm_key) {
        memcpy(d->swarm_key, cfg->swarm_key, 32);
        d->has_swarm_key = 1;
    }
    snprintf(d->model, sizeof d->model, "%s", spec->name);
    d->n_stages = spec->n_stages;
    snprintf(d->device, sizeof d->device, "%s", cfg->device ? cfg->device : "cpu");
    d->announce_every_s = cfg->announce_every_s > 0 ? cfg->announce_every_s : 20.0;
    d->ttl_s = cfg->ttl_s > 0 ? cfg->ttl_s : 60.0;
    d->checkpoint_every_s = cfg->checkpoint_every_s;
    d->max_queue_rows = cfg->svc.max_queue_rows > 0 ? cfg->svc.max_queue_rows : 1;
    d->syncing = -1;
    d->optim_kind = cfg->svc.optim.kind;
    d->average_every_s = cfg->average_every_s;
    d->avg_method = (peer_avg_method){cfg->average_mode, cfg->outer_lr > 0 ? cfg->outer_lr : PEER_AVG_OUTER_LR,
                                      cfg->outer_momentum, cfg->average_format, cfg->average_format_block};
    d->log = cfg->log ? cfg->log : stderr;
    d->on_refused = cfg->on_refused;
    d->refused_arg = cfg->refused_arg;
    return d;
}

/* Creates the block service (which restores checkpoints) and says which
 * blocks were restored. Returns 0, or -1 with a sentence in err. */
static int create_service(peer_daemon *d, const peer_daemon_config *cfg, char *err, size_t errlen)
{
    peer_service_config sc = cfg->svc;
    sc.log = d->log;
    sc.self = &d->ident;
    sc.swarm_key = cfg->swarm_key;
    d->svc = peer_service_create(d->loop, &sc, err, errlen);
    if (!d->svc)
        return -1;
    /* The averaging rounds and state serving answer their methods for the
     * service, which frees them. */
    d->rounds = peer_allreduce_server_create(d->svc);
    d->states = peer_statesync_server_create(d->svc);
    if (!d->rounds || !d->states) {
        snprintf(err, errlen, "out of memory");
        peer_service_destroy(&d->svc);
        return -1;
    }
    for (int i = 0; i < peer_service_n_blocks(d->svc); i++) {
        peer_block_info bi;
        if (peer_service_block_info(d->svc, i, &bi) == 0 && bi.restored)
            say(d, "restored %s from its checkpoint (weight version %llu)", bi.name,
                (unsigned long long)bi.version);
    }
    return 0;
}

/* Serves /metrics on listen ("HOST:PORT"; NULL: no endpoint). Returns 0,
 * or -1 with a sentence in err. */
static int start_metrics(peer_daemon *d, const char *listen, char *err, size_t errlen)
{
    if (!listen)
        return 0;
    dht_addr ma;
    struct sockaddr_storage ss;
    int rc;
    if (dht_addr_parse_listen(&ma, listen) != 0 || dht_addr_to_sockaddr(&ma, &ss) < 0) {
        snprintf(err, errlen, "--metrics '%s' is not HOST:PORT", listen);
        return -1;
    }
    d->metrics = peer_metrics_start(d->loop, (const struct sockaddr *)&ss, render_metrics, d, &rc);
    if (!d->metrics) {
        snprintf(err, errlen, "cannot serve metrics on %s: %s", listen, strerror(-rc));
        return -1;
    }
    char mh[64];
    dht_addr_format(mh, sizeof mh, &ma);
    *strrchr(mh, ':') = '\0';
    say(d, "metrics on http://%s:%d/metrics", mh, peer_metrics_port(d->metrics));
    return 0;
}

/* Starts the DHT node on cfg->listen and writes the address it is bound
 * to. The DHT (UDP) and the RPC (TCP) share one port. With port 0 the
 * kernel picks the UDP port, which TCP may already use for an outgoing
 * connection; so pick a port free for TCP first (a probe socket held
 * until the UDP bind succeeded), and try again if UDP has it taken.
 * Returns 0, or -1 with a sentence in err (d->dht NULL). */
static int start_dht(peer_daemon *d, const peer_daemon_config *cfg, dht_addr *bound, char *err, size_t errlen)
{
    dht_config dc;
    dht_config_default(&dc);
    if (cfg->dht_diversity_given)
        dc.diversity = cfg->dht_diversity;
    if (d->has_swarm_key) {
        dc.has_swarm_key = 1;
        memcpy(dc.swarm_key, d->swarm_key, 32);
    }
    dht_addr req;
    if (dht_addr_parse_listen(&req, cfg->listen) != 0) {
        snprintf(err, errlen, "--listen '%s' is not a numeric HOST:PORT", cfg->listen);
        return -1;
    }
    for (int attempt = 0;; attempt++) {
        char lst[96];
        int probe = -1;
        if (req.port == 0) {
            struct sockaddr_storage ps;
            socklen_t plen = sizeof ps;
            int sl = dht_addr_to_sockaddr(&req, &ps);
            probe = sl > 0 ? socket(ps.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0) : -1;
            if (probe < 0 || bind(probe, (struct sockaddr *)&ps, (socklen_t)sl) != 0 ||
                getsockname(probe, (struct sockaddr *)&ps, &plen) != 0) {
                snprintf(err, errlen, "cannot listen on %s: %s", cfg->listen, strerror(errno));
                if (probe >= 0)
                    close(probe);
                return -1;
            }
            dht_addr pa;
            dht_addr_from_sockaddr(&pa, (struct sockaddr *)&ps);
            dht_addr_format(lst, sizeof lst, &pa);
        } else {
            snprintf(lst, sizeof lst, "%s", cfg->listen);
        }
        d->dht = dht_create(d->loop, &d->ident, &dc);
        if (!d->dht) {
            snprintf(err, errlen, "cannot create the DHT node");
            if (probe >= 0)
                close(probe);
            return -1;
        }
        int rc = dht_start(d->dht, lst);
        if (rc == 0 && dht_local_addr(d->dht, bound) == 0) {
            if (probe >= 0)
                close(probe);
            return 0;
        }
        dht_close(d->dht, NULL, NULL);
        d->dht = NULL;
        if (probe >= 0)
            close(probe);
        if (req.port != 0 || attempt >= 15) {
            snprintf(err, errlen, "cannot listen on %s (UDP): %s", lst, strerror(rc < 0 ? -rc : EINVAL));
            return -1;
        }
    }
}

/* Sets the address we announce (the announce host, or the listen host,
 * and the bound port) and serves the tensor RPC on the bound port.
 * Returns 0, or -1 with a sentence in err. */
static int listen_rpc(peer_daemon *d, const peer_daemon_config *cfg, const char *host, const dht_addr *bound,
                      char *err, size_t errlen)
{
    const char *ahost = cfg->announce_host ? cfg->announce_host : host;
    if (strlen(ahost) > 48) {
        snprintf(err, errlen, "announce host '%.60s' is too long", ahost);
        return -1;
    }
    snprintf(d->announce_addr, sizeof d->announce_addr, "%.48s:%u", ahost, (unsigned)bound->port);
    struct sockaddr_storage ss;
    int rc = -EINVAL;
    if (dht_addr_to_sockaddr(bound, &ss) < 0 ||
        (rc = peer_service_listen(d->svc, (const struct sockaddr *)&ss)) != 0) {
        snprintf(err, errlen, "cannot listen on %s (TCP port %u): %s", cfg->listen, bound->port,
                 strerror(-rc));
        return -1;
    }
    return 0;
}

/* Creates the catch-up, the announcer and (with initial peers) the
 * joiner, which start nothing yet. Returns 0, or -1 with a sentence in
 * err (none of them left). */
static int create_parts(peer_daemon *d, const peer_daemon_config *cfg, char *err, size_t errlen)
{
    peer_catchup_config cc = {
        .loop = d->loop, .dht = d->dht, .self = &d->ident, .swarm_key = d->has_swarm_key ? d->swarm_key : NULL,
        .svc = d->svc, .no_state_download = cfg->no_state_download, .log = d->log,
        .joining = on_catchup_joining, .done = on_caught_up, .arg = d,
    };
    peer_announcer_config ac = {
        .loop = d->loop, .dht = d->dht, .svc = d->svc, .model = d->model, .n_stages = d->n_stages,
        .addr = d->announce_addr, .device = d->device,
        .precision = expert_precision_name(cfg->precision), .max_queue_rows = d->max_queue_rows,
        .every_s = d->announce_every_s, .ttl_s = d->ttl_s, .log = d->log, .fill = fill_announcement, .arg = d,
    };
    peer_joiner_config jc = {
        .loop = d->loop, .dht = d->dht, .initial = cfg->initial, .n_initial = cfg->n_initial, .log = d->log,
        .joined = on_joined, .refused = on_join_refused, .arg = d,
    };
    d->catchup = peer_catchup_create(&cc);
    d->announcer = d->catchup ? peer_announcer_create(&ac) : NULL;
    d->joiner = d->announcer && cfg->n_initial > 0 ? peer_joiner_create(&jc) : NULL;
    if (!d->catchup || !d->announcer || (cfg->n_initial > 0 && !d->joiner)) {
        snprintf(err, errlen, "out of memory");
        peer_catchup_destroy(&d->catchup);
        peer_announcer_destroy(&d->announcer);
        return -1;
    }
    d->timers_open += 1 + (d->joiner != NULL); /* closed with the timers */
    return 0;
}

static void start_averaging(peer_daemon *d)
{
    peer_averaging_config ac = {0};
    ac.loop = d->loop;
    ac.dht = d->dht;
    ac.self = &d->ident;
    ac.swarm_key = d->has_swarm_key ? d->swarm_key : NULL;
    ac.svc = d->svc;
    ac.rounds = d->rounds;
    ac.addr = d->announce_addr;
    ac.optim_kind = d->optim_kind;
    ac.method = d->avg_method;
    ac.every_s = d->average_every_s;
    ac.ready = avg_ready;
    ac.ready_arg = d;
    ac.log = d->log;
    if (!(d->avg = peer_averaging_start(&ac)))
        say(d, "cannot start replica averaging (out of memory, or a bad averaging mode); serving without it");
    d->avg_running = d->avg != NULL;
}

static void start_keeper(peer_daemon *d, const peer_daemon_config *cfg)
{
    peer_keeper_config kc = {0};
    kc.loop = d->loop;
    kc.dht = d->dht;
    kc.self = &d->ident;
    kc.swarm_key = d->has_swarm_key ? d->swarm_key : NULL;
    kc.svc = d->svc;
    kc.states = d->states;
    kc.model = d->model;
    kc.addr = d->announce_addr;
    kc.every_s = cfg->keep_every_s;
    kc.replicas = cfg->keep_copies > 0 ? cfg->keep_copies : 2;
    kc.max_bytes = cfg->keep_max_bytes ? cfg->keep_max_bytes : (size_t)2 << 30;
    kc.ready = avg_ready;
    kc.ready_arg = d;
    kc.log = d->log;
    char kerr[160];
    if (!(d->keeper = peer_keeper_start(&kc, kerr, sizeof kerr)))
        say(d, "%s; serving without cold copies", kerr);
    d->keeper_running = d->keeper != NULL;
}

/* Undoes a start that failed before any part ran. Once the service has
 * tried to listen (listened) it has handles open: it is closed
 * asynchronously (and frees itself in the callback); before, it is
 * destroyed at once. */
static void undo_start(peer_daemon *d, int listened)
{
    peer_metrics_destroy(&d->metrics); /* freed once its handles close */
    if (listened) {
        peer_service_stop(d->svc, destroy_after_close, NULL);
        d->svc = NULL;
    } else {
        peer_service_destroy(&d->svc);
    }
    if (d->dht)
        dht_close(d->dht, NULL, NULL);
    free(d);
}

peer_daemon *peer_daemon_start(uv_loop_t *loop, const peer_daemon_config *cfg, char *err,
                               size_t errlen)
{
    char host[64];
    dht_addr bound;
    const struct expert_model_spec *spec = check_config(loop, cfg, host, sizeof host, err, errlen);
    if (!spec)
        return NULL;
    peer_daemon *d = daemon_new(loop, cfg, spec);
    if (!d) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (create_service(d, cfg, err, errlen) != 0) {
        free(d);
        return NULL;
    }
    if (start_metrics(d, cfg->metrics_listen, err, errlen) != 0 || start_dht(d, cfg, &bound, err, errlen) != 0) {
        undo_start(d, 0);
        return NULL;
    }
    if (listen_rpc(d, cfg, host, &bound, err, errlen) != 0 || create_parts(d, cfg, err, errlen) != 0) {
        undo_start(d, 1);
        return NULL;
    }
    uv_timer_t *timers[] = {&d->ckpt_timer, &d->stop_timer};
    for (size_t i = 0; i < 2; i++) {
        uv_timer_init(loop, timers[i]);
        timers[i]->data = d;
        d->timers_open++;
    }
    if (d->checkpoint_every_s > 0) {
        uint64_t ms = (uint64_t)(d->checkpoint_every_s * 1000);
        uv_timer_start(&d->ckpt_timer, on_ckpt_timer, ms, ms);
    }
    if (d->average_every_s > 0)
        start_averaging(d);
    if (cfg->keep_every_s > 0)
        start_keeper(d, cfg);
    if (d->joiner) {
        peer_joiner_start(d->joiner);
    } else {
        /* The first node of a swarm: nothing to join or fetch. */
        d->joined = 1;
        go_online(d);
    }
    return d;
}

dht *peer_daemon_dht(peer_daemon *d)
{
    return d ? d->dht : NULL;
}

int peer_daemon_peer_string(const peer_daemon *d, char *buf, size_t cap)
{
    dht_addr bound;
    char id[DHT_ID_HEX_LEN + 1];
    if (!d || dht_local_addr(d->dht, &bound) != 0)
        return -EINVAL;
    dht_id_to_hex(id, d->ident.id);
    int n = snprintf(buf, cap, "%s/%s", d->announce_addr, id);
    return n < 0 || (size_t)n >= cap ? -ENOSPC : n;
}

/* ---- stop ---- */

/* The daemon goes away once its timers are closed and no state download
 * can still call back into it. */
static void maybe_stopped(peer_daemon *d)
{
    if (d->timers_open > 0 || d->catchup_running || d->avg_running || d->keeper_running || d->stop_phase < 4)
        return;
    peer_averaging_destroy(&d->avg);
    peer_keeper_destroy(&d->keeper);
    peer_catchup_destroy(&d->catchup);
    peer_announcer_destroy(&d->announcer);
    peer_joiner_destroy(&d->joiner);
    void (*cb)(int, void *) = d->stop_cb;
    void *arg = d->stop_arg;
    int status = d->final_status;
    d->stopped = 1;
    if (d->destroy_pending)
        free(d);
    if (cb)
        cb(status, arg);
}

void peer_daemon_destroy(peer_daemon **p)
{
    peer_daemon *d = p ? *p : NULL;
    if (!d)
        return;
    *p = NULL;
    if (d->stopped) {
        free(d);
        return;
    }
    d->destroy_pending = 1;
    peer_daemon_stop(d, NULL, NULL); /* nothing when already stopping */
}

static void on_timer_closed(uv_handle_t *h)
{
    peer_daemon *d = h->data;
    d->timers_open--;
    maybe_stopped(d);
}

static void on_part_closed(void *arg)
{
    peer_daemon *d = arg;
    d->timers_open--;
    maybe_stopped(d);
}

static void on_dht_closed(dht *dh, void *ud)
{
    (void)dh;
    peer_daemon *d = ud;
    d->stop_phase = 4;
    peer_announcer_stop(d->announcer, on_part_closed, d);
    uv_close((uv_handle_t *)&d->ckpt_timer, on_timer_closed);
    uv_close((uv_handle_t *)&d->stop_timer, on_timer_closed);
}

static void on_svc_closed(peer_service *s, int ckpt_status, void *arg)
{
    (void)s;
    peer_daemon *d = arg;
    d->final_status = ckpt_status;
    if (ckpt_status != 0)
        say(d, "final checkpoint failed: %s", strerror(-ckpt_status));
    peer_service_destroy(&d->svc);
    d->rounds = NULL; /* freed with the service */
    d->states = NULL;
    peer_metrics_destroy(&d->metrics); /* freed once its handles close */
    d->stop_phase = 3;
    dht_close(d->dht, on_dht_closed, d);
    d->dht = NULL;
}

static void on_stop_timer(uv_timer_t *t)
{
    peer_daemon *d = t->data;
    if (d->stop_phase == 1)
        continue_stop(d); /* offline announcements took too long: go on */
}

static void continue_stop(peer_daemon *d)
{
    if (d->stop_phase == 1) {
        uv_timer_stop(&d->stop_timer);
        d->stop_phase = 2;
    }
    if (d->stop_phase == 2) {
        if (d->ckpt_busy || d->avg_running)
            return; /* ckpt_after_cb / on_avg_stopped call us again */
        d->stop_phase = 3;
        peer_service_stop(d->svc, on_svc_closed, d);
    }
}

void peer_daemon_stop(peer_daemon *d, void (*cb)(int status, void *arg), void *arg)
{
    if (!d || d->stopping)
        return;
    d->stopping = 1;
    d->stop_cb = cb;
    d->stop_arg = arg;
    double bps = peer_service_bytes_per_sample(d->svc);
    if (bps > 0)
        say(d, "stopping: %.0f tensor bytes per sample served (received and sent, per block row)", bps);
    peer_joiner_stop(d->joiner, on_part_closed, d);
    uv_timer_stop(&d->ckpt_timer);
    /* Rounds in flight are abandoned while the service still stands. */
    if (d->avg_running)
        peer_averaging_stop(d->avg, on_avg_stopped, d);
    if (d->keeper_running)
        peer_keeper_stop(d->keeper, on_keeper_stopped, d);
    d->catchup_running = 1;
    peer_catchup_stop(d->catchup, on_catchup_stopped, d);
    d->stop_phase = 1;
    if (peer_announcer_leave(d->announcer, d->joined, on_offline_announced, d) == 0) {
        continue_stop(d);
        return;
    }
    uv_timer_start(&d->stop_timer, on_stop_timer, STOP_ANNOUNCE_WAIT_MS, 0);
}
