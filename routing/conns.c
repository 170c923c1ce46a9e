#include "routing/conns.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <uthash.h>

#include "dht/addr.h"

enum { CONN_CONNECTING, CONN_READY };

typedef struct conn {
    uint8_t id[DHT_ID_LEN];
    struct route_conns *owner;
    peer_rpc_client *cl;
    int state;
    int closing; /* closed by us: the connect callback that follows is our cancel */
    UT_hash_handle hh;
} conn;

struct route_conns {
    uv_loop_t *loop;
    route_conns_config cfg;
    uint8_t swarm_key[32];
    int has_key;
    conn *map;
    int open;
};

route_conns *route_conns_create(uv_loop_t *loop, const route_conns_config *cfg)
{
    if (!loop || !cfg || !cfg->ident)
        return NULL;
    route_conns *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    c->loop = loop;
    c->cfg = *cfg;
    if (cfg->swarm_key) {
        memcpy(c->swarm_key, cfg->swarm_key, 32);
        c->has_key = 1;
    }
    return c;
}

static void on_closed(peer_rpc_client *cl, void *arg)
{
    conn *k = arg;
    route_conns *c = k->owner;
    peer_rpc_client_destroy(&cl);
    free(k);
    c->open--;
}

/* k leaves the table here, once; closing a client that is still setting
 * up calls on_connect with -ECANCELED from inside peer_rpc_client_close,
 * which must then not remove k again (nor report a failed holder), and k
 * may be freed before this returns. */
static void close_conn(route_conns *c, conn *k)
{
    HASH_DEL(c->map, k);
    k->closing = 1;
    peer_rpc_client_close(k->cl, on_closed, k);
}

static void on_connect(peer_rpc_client *cl, int status, void *arg)
{
    (void)cl;
    conn *k = arg;
    route_conns *c = k->owner;
    if (k->closing)
        return;
    if (status == 0) {
        k->state = CONN_READY;
        if (c->cfg.on_ready)
            c->cfg.on_ready(c->cfg.arg);
        return;
    }
    uint8_t id[DHT_ID_LEN];
    memcpy(id, k->id, DHT_ID_LEN);
    close_conn(c, k);
    if (c->cfg.on_failed)
        c->cfg.on_failed(c->cfg.arg, id, status);
}

peer_rpc_client *route_conns_get(route_conns *c, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    conn *k = NULL;
    HASH_FIND(hh, c->map, id, DHT_ID_LEN, k);
    if (k)
        return k->state == CONN_READY ? k->cl : NULL;
    dht_addr a;
    struct sockaddr_storage ss;
    if (dht_addr_parse(&a, addr) != 0 || dht_addr_to_sockaddr(&a, &ss) < 0)
        return NULL;
    k = calloc(1, sizeof *k);
    if (!k)
        return NULL;
    memcpy(k->id, id, DHT_ID_LEN);
    k->owner = c;
    peer_rpc_client_config cc;
    memset(&cc, 0, sizeof cc);
    cc.self = c->cfg.ident;
    cc.expect_id = id;
    cc.swarm_key = c->has_key ? c->swarm_key : NULL;
    cc.max_pending = c->cfg.max_pending > 0 ? c->cfg.max_pending : 64;
    k->cl = peer_rpc_client_create(c->loop, &cc);
    if (!k->cl) {
        free(k);
        return NULL;
    }
    if (peer_rpc_client_connect(k->cl, (const struct sockaddr *)&ss, on_connect, k) != 0) {
        peer_rpc_client_destroy(&k->cl);
        free(k);
        return NULL;
    }
    k->state = CONN_CONNECTING;
    HASH_ADD(hh, c->map, id, DHT_ID_LEN, k);
    c->open++;
    return NULL;
}

void route_conns_drop(route_conns *c, const uint8_t id[DHT_ID_LEN])
{
    conn *k = NULL;
    HASH_FIND(hh, c->map, id, DHT_ID_LEN, k);
    if (k)
        close_conn(c, k);
}

void route_conns_close_all(route_conns *c)
{
    /* The head each time: closing fails pending calls, whose callbacks may
     * drop other entries meanwhile. */
    for (int guard = 0; c->map && guard < 1 << 20; guard++)
        close_conn(c, c->map);
}

int route_conns_open(const route_conns *c)
{
    return c ? c->open : 0;
}

void route_conns_destroy(route_conns **pc)
{
    if (!pc || !*pc)
        return;
    free(*pc);
    *pc = NULL;
}
