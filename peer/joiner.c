/* peer/joiner.c: joins the swarm through the initial peers, retrying
 * while nobody answers (peer/joiner.h). */
#include "peer/joiner.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "peer/log.h"

struct peer_joiner {
    peer_joiner_config cfg;
    dht_peer_addr initial[PEER_JOINER_MAX_INITIAL];
    uv_timer_t timer;            /* the next try */
    int stopping;                /* stop called: the timer is closing or closed */
    int closed, destroy_pending;
    void (*close_cb)(void *);
    void *close_arg;
};

#define say(j, ...) peer_log((j)->cfg.log, __VA_ARGS__)

static void try_join(peer_joiner *j);

static void on_timer(uv_timer_t *t)
{
    peer_joiner *j = t->data;
    if (!j->stopping)
        try_join(j);
}

static void on_join(dht *dh, int status, void *ud)
{
    peer_joiner *j = ud;
    if (j->stopping)
        return;
    if (status == -EADDRINUSE) {
        /* Another process runs with our identity file (it proved our node
         * ID from another address): two peers with one ID would displace
         * each other in routing tables and announcements. Refuse: no
         * retry; the owner stops us. */
        char hex[DHT_ID_HEX_LEN + 1], at[DHT_ADDR_STRLEN];
        dht_id_to_hex(hex, dht_self_id(dh));
        if (dht_collision_addr(dh, at, sizeof at) < 0)
            snprintf(at, sizeof at, "another address");
        say(j, "another peer is online with this identity (node ID %s) at %s; refusing to start: "
               "use another --identity", hex, at);
        j->cfg.refused(j->cfg.arg);
        return;
    }
    if (status == -EADDRNOTAVAIL || status == -EKEYREJECTED) {
        /* The initial peer answered: say what is wrong, not "unreachable". */
        char why[256];
        dht_join_strerror(dh, status, why, sizeof why);
        say(j, "%s: check %s; retrying in %d s", why,
            status == -EADDRNOTAVAIL ? "the node ID in --initial-peers" : "--swarm-key",
            PEER_JOINER_RETRY_MS / 1000);
        uv_timer_start(&j->timer, on_timer, PEER_JOINER_RETRY_MS, 0);
        return;
    }
    if (status < 0) {
        say(j, "cannot reach any initial peer (%s); retrying in %d s", strerror(-status),
            PEER_JOINER_RETRY_MS / 1000);
        uv_timer_start(&j->timer, on_timer, PEER_JOINER_RETRY_MS, 0);
        return;
    }
    j->cfg.joined(j->cfg.arg);
}

static void try_join(peer_joiner *j)
{
    int rc = dht_join(j->cfg.dht, j->initial, j->cfg.n_initial, on_join, j);
    if (rc != 0) {
        say(j, "join failed to start (%s); retrying", strerror(-rc));
        uv_timer_start(&j->timer, on_timer, PEER_JOINER_RETRY_MS, 0);
    }
}

peer_joiner *peer_joiner_create(const peer_joiner_config *cfg)
{
    if (!cfg || !cfg->loop || !cfg->dht || !cfg->initial || cfg->n_initial == 0 ||
        cfg->n_initial > PEER_JOINER_MAX_INITIAL || !cfg->joined || !cfg->refused)
        return NULL;
    peer_joiner *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    j->cfg = *cfg;
    memcpy(j->initial, cfg->initial, cfg->n_initial * sizeof *cfg->initial);
    j->cfg.initial = j->initial;
    uv_timer_init(cfg->loop, &j->timer);
    j->timer.data = j;
    return j;
}

void peer_joiner_start(peer_joiner *j)
{
    if (j && !j->stopping)
        try_join(j);
}

static void on_closed(uv_handle_t *h)
{
    peer_joiner *j = h->data;
    void (*cb)(void *) = j->close_cb;
    void *arg = j->close_arg;
    j->closed = 1;
    if (j->destroy_pending)
        free(j);
    if (cb)
        cb(arg);
}

void peer_joiner_stop(peer_joiner *j, void (*cb)(void *arg), void *arg)
{
    if (!j || j->stopping)
        return;
    j->stopping = 1;
    j->close_cb = cb;
    j->close_arg = arg;
    uv_close((uv_handle_t *)&j->timer, on_closed);
}

void peer_joiner_destroy(peer_joiner **p)
{
    peer_joiner *j = p ? *p : NULL;
    if (!j)
        return;
    *p = NULL;
    peer_joiner_stop(j, NULL, NULL);
    if (j->closed)
        free(j);
    else
        j->destroy_pending = 1;
}
