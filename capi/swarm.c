/* capi/swarm.c: the swarm handle: joining as a light client, the loop
 * thread, the jobs other threads hand to it, and the shutdown. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sodium.h>

#include "capi/capi_internal.h"
#include "config.h"
#include "dht/addr.h"

#define MAX_INITIAL_PEERS 64

const char *starling_version(void)
{
    return STARLING_VERSION;
}

int starling_api_version(void)
{
    return STARLING_API_VERSION;
}

void starling_free(void *p)
{
    free(p);
}

/* ---- the loop thread and the shutdown ---- */

static void on_dht_closed(dht *d, void *ud)
{
    (void)d;
    starling_swarm *s = ud;
    s->dht_closed = 1;
}

static void on_wake_closed(uv_handle_t *h)
{
    starling_swarm *s = h->data;
    s->wake_closed = 1;
}

/* The shutdown's next step, once the previous one has finished: callers,
 * then the DHT (its lookups fail with -ECANCELED), then the wake handle. */
static void shutdown_step(starling_swarm *s)
{
    int busy = 0;
    for (starling_stages *st = s->stages, *nx; st; st = nx) {
        nx = capi_stages_next(st); /* the shutdown may unlink st */
        busy |= capi_stages_shutdown(st);
    }
    if (busy)
        return;
    if (!s->dht_closing) {
        s->dht_closing = 1;
        dht_close(s->d, on_dht_closed, s);
        return;
    }
    if (s->dht_closed && !uv_is_closing((uv_handle_t *)&s->wake))
        uv_close((uv_handle_t *)&s->wake, on_wake_closed);
}

static void on_wake(uv_async_t *a)
{
    starling_swarm *s = a->data;
    pthread_mutex_lock(&s->lock);
    capi_job *q = s->queue;
    s->queue = s->queue_tail = NULL;
    int closing = s->closing;
    pthread_mutex_unlock(&s->lock);
    while (q) {
        capi_job *j = q;
        q = q->next;
        if (closing) {
            capi_err(j->err, j->err_len, -ECANCELED, "the swarm handle was closed");
            capi_done(j, -ECANCELED);
        } else {
            j->start(j);
        }
    }
    if (closing)
        s->shutting = 1;
}

static void loop_main(void *arg)
{
    starling_swarm *s = arg;
    while (!s->wake_closed) {
        uv_run(&s->loop, UV_RUN_ONCE);
        capi_stages_poll(s);
        if (s->shutting)
            shutdown_step(s);
    }
    uv_run(&s->loop, UV_RUN_NOWAIT);
}

/* ---- joining (on the calling thread, before the loop thread starts) ---- */

/* Frees s once its loop has nothing left open. */
static void free_swarm(starling_swarm *s)
{
    uv_loop_close(&s->loop);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->cond);
    sodium_memzero(&s->ident, sizeof s->ident);
    sodium_memzero(s->swarm_key, sizeof s->swarm_key);
    free(s);
}

/* Closes what open made, on the calling thread (the loop thread never ran). */
static void destroy_unstarted(starling_swarm *s)
{
    if (s->d) {
        dht_close(s->d, on_dht_closed, s);
        while (!s->dht_closed)
            uv_run(&s->loop, UV_RUN_ONCE);
    }
    if (!s->wake_closed && s->wake.data) {
        uv_close((uv_handle_t *)&s->wake, on_wake_closed);
        while (!s->wake_closed)
            uv_run(&s->loop, UV_RUN_ONCE);
    }
    uv_run(&s->loop, UV_RUN_NOWAIT);
    free_swarm(s);
}

static int join(starling_swarm *s, const char *initial, dht_peer_addr *peers, int np, char *err, size_t err_len)
{
    int rc = dht_join_wait(s->d, peers, (size_t)np, s->opt.join_timeout_s);
    if (rc == -EADDRINUSE)
        rc = 0; /* a twin client hurts nobody: it stays out of routing tables */
    if (rc == -EADDRNOTAVAIL || rc == -EKEYREJECTED) {
        char msg[256];
        dht_join_strerror(s->d, rc, msg, sizeof msg);
        return capi_err(err, err_len, rc, "%s%s", msg,
                        rc == -EKEYREJECTED ? ": check the swarm key" : ": check the node ID in initial_peers");
    }
    if (rc < 0)
        return capi_err(err, err_len, -EHOSTUNREACH, "cannot reach any initial peer (%s) within %g s; %s", initial,
                        s->opt.join_timeout_s,
                        s->has_swarm_key ? "check the address and that the swarm key matches"
                                         : "check the address, or whether the swarm needs a swarm key");
    return 0;
}

/* Checks the options' timeouts and fills in the defaults for 0: 0, or
 * -EINVAL for one out of range. */
static int fill_timeouts(starling_swarm_options *o)
{
    if (o->join_timeout_s < 0 || o->call_timeout_s < 0 || o->max_wait_s < 0 || o->join_timeout_s > 3600 ||
        o->call_timeout_s > 3600 || o->max_wait_s > 86400)
        return -EINVAL;
    if (!(o->join_timeout_s > 0))
        o->join_timeout_s = 15;
    if (!(o->call_timeout_s > 0))
        o->call_timeout_s = 30;
    if (!(o->max_wait_s > 0))
        o->max_wait_s = 120;
    return 0;
}

/* The handle's light DHT client: its swarm key and identity from the
 * options' files (or a new identity), then the node (not started). Returns
 * 0, or -EIO / -ENOMEM with the sentence in err. */
static int create_dht(starling_swarm *s, const starling_swarm_options *o, char *err, size_t err_len)
{
    dht_config cfg;
    dht_config_default(&cfg);
    cfg.client_only = 1;
    int rc;
    if (o->swarm_key_file) {
        rc = dht_swarm_key_load(s->swarm_key, o->swarm_key_file);
        if (rc != 0)
            return capi_err(err, err_len, -EIO, "cannot load swarm key '%s': %s", o->swarm_key_file,
                            dht_swarm_key_strerror(rc));
        s->has_swarm_key = 1;
        cfg.has_swarm_key = 1;
        memcpy(cfg.swarm_key, s->swarm_key, 32);
    }
    rc = o->identity_file ? dht_identity_load(&s->ident, o->identity_file) : dht_identity_generate(&s->ident);
    if (rc != 0) {
        sodium_memzero(cfg.swarm_key, sizeof cfg.swarm_key);
        return capi_err(err, err_len, -EIO, "cannot load identity '%s': %s",
                        o->identity_file ? o->identity_file : "(new)", dht_identity_strerror(rc));
    }
    s->d = dht_create(&s->loop, &s->ident, &cfg);
    sodium_memzero(cfg.swarm_key, sizeof cfg.swarm_key);
    if (!s->d)
        return capi_err(err, err_len, -ENOMEM, "cannot create the DHT node");
    return 0;
}

int starling_swarm_open(starling_swarm **out, const char *initial, const starling_swarm_options *opt, char *err,
                        size_t err_len)
{
    dht_peer_addr peers[MAX_INITIAL_PEERS];
    if (err && err_len)
        err[0] = '\0';
    if (!out)
        return capi_err(err, err_len, -EINVAL, "no place for the handle (out is NULL)");
    *out = NULL;
    if (!initial || !*initial)
        return capi_err(err, err_len, -EINVAL, "initial_peers is required: the address a 'starling bootstrap' or "
                                               "'starling peer' prints (HOST:PORT[/NODEID])");
    if (sodium_init() < 0)
        return capi_err(err, err_len, -EIO, "libsodium cannot initialise");
    int np = dht_peer_list_parse(peers, MAX_INITIAL_PEERS, initial);
    if (np <= 0)
        return capi_err(err, err_len, -EINVAL, "initial_peers '%s' is not a list of HOST:PORT[/NODEID]", initial);
    starling_swarm_options o = {0};
    if (opt)
        o = *opt;
    if (fill_timeouts(&o) != 0)
        return capi_err(err, err_len, -EINVAL, "timeouts must be in [0, 3600] s (max_wait_s up to 86400; 0: default)");
    const char *listen = o.listen;
    if (listen) {
        dht_addr la;
        if (dht_addr_parse_listen(&la, listen) != 0)
            return capi_err(err, err_len, -EINVAL, "listen '%s' is not a numeric HOST:PORT", listen);
    } else {
        listen = dht_client_listen(&peers[0]);
    }

    starling_swarm *s = calloc(1, sizeof *s);
    if (!s)
        return capi_err(err, err_len, -ENOMEM, "out of memory");
    s->opt = o;
    s->opt.swarm_key_file = s->opt.identity_file = s->opt.listen = NULL;
    s->rng = o.seed ? o.seed : (uint64_t)time(NULL) ^ ((uint64_t)(uintptr_t)s << 16);
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    if (uv_loop_init(&s->loop) != 0) {
        pthread_mutex_destroy(&s->lock);
        pthread_cond_destroy(&s->cond);
        free(s);
        return capi_err(err, err_len, -ENOMEM, "cannot create the event loop");
    }
    uv_async_init(&s->loop, &s->wake, on_wake);
    s->wake.data = s;

    int rc = create_dht(s, &o, err, err_len);
    if (rc != 0) {
        destroy_unstarted(s);
        return rc;
    }
    rc = dht_start(s->d, listen);
    if (rc == 0)
        rc = join(s, initial, peers, np, err, err_len);
    else
        capi_err(err, err_len, rc, "cannot listen on %s: %s", listen, strerror(-rc));
    if (rc == 0 && uv_thread_create(&s->thread, loop_main, s) != 0)
        rc = capi_err(err, err_len, -EAGAIN, "cannot start the loop thread");
    if (rc != 0) {
        destroy_unstarted(s);
        return rc;
    }
    s->thread_started = 1;
    *out = s;
    return 0;
}

void starling_swarm_close(starling_swarm *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->lock);
    s->closing = 1;
    uv_async_send(&s->wake);
    pthread_mutex_unlock(&s->lock);
    uv_thread_join(&s->thread);
    /* Threads woken with -ECANCELED still take the lock on their way out. */
    pthread_mutex_lock(&s->lock);
    while (s->waiters > 0)
        pthread_cond_wait(&s->cond, &s->lock);
    pthread_mutex_unlock(&s->lock);
    /* The loop thread freed nothing: the stages handles are ours now. */
    while (s->stages) {
        starling_stages *st = s->stages;
        s->stages = capi_stages_next(st);
        capi_stages_free(st);
    }
    free_swarm(s);
}

void starling_swarm_node_id(const starling_swarm *s, char hex[41])
{
    if (!s || !hex) {
        if (hex)
            hex[0] = '\0';
        return;
    }
    dht_id_to_hex(hex, s->ident.id);
}
