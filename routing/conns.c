#include "routing/conns.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <uthash.h>

#include "dht/addr.h"

enum { CONN_CONNECTING, CONN_READY };

/* The hash key: node ID and address, zero-padded so it compares as bytes. */
typedef struct conn_key {
    uint8_t id[DHT_ID_LEN];
    char addr[ROUTE_CONNS_ADDR_MAX + 1];
} conn_key;

typedef struct conn {
    conn_key key;
    uint64_t serial;
    struct route_conns *owner;
    peer_rpc_client *cl;
    int state;
    int closing; /* closed by us: the connect callback that follows is our cancel */
    int doomed;  /* route_conns_retain decided to close it */
    UT_hash_handle hh;
} conn;

struct route_conns {
    uv_loop_t *loop;
    route_conns_config cfg;
    uint8_t swarm_key[32];
    int has_key;
    conn *map;
    int open;
    uint64_t next_serial;
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
 * up calls on_connect with -ECANCELED from inside peer_rpc_client_stop,
 * which must then not remove k again (nor report a failed holder), and k
 * may be freed before this returns. */
static void close_conn(route_conns *c, conn *k)
{
    HASH_DEL(c->map, k);
    k->closing = 1;
    peer_rpc_client_stop(k->cl, on_closed, k);
}

static void on_connect(peer_rpc_client *cl, int status, void *arg)
{
    (void)cl;
    conn *k = arg;
    route_conns *c = k->owner;
    if (k->closing)
        return;
    /* A copy: the callbacks may close k. */
    conn_key key = k->key;
    if (status == 0) {
        k->state = CONN_READY;
        if (c->cfg.on_ready)
            c->cfg.on_ready(c->cfg.arg, key.id, key.addr);
        return;
    }
    close_conn(c, k);
    if (c->cfg.on_failed)
        c->cfg.on_failed(c->cfg.arg, key.id, key.addr, status);
}

/* Fills *key; returns -EINVAL when addr is too long to be an announced one. */
static int make_key(conn_key *key, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    memset(key, 0, sizeof *key);
    memcpy(key->id, id, DHT_ID_LEN);
    size_t n = strlen(addr);
    if (n > ROUTE_CONNS_ADDR_MAX)
        return -EINVAL;
    memcpy(key->addr, addr, n);
    return 0;
}

peer_rpc_client *route_conns_get(route_conns *c, const uint8_t id[DHT_ID_LEN], const char *addr,
                                 uint64_t *serial_out)
{
    conn_key key;
    if (!c || !id || !addr || make_key(&key, id, addr) != 0)
        return NULL;
    conn *k = NULL;
    HASH_FIND(hh, c->map, &key, sizeof key, k);
    if (k) {
        if (k->state != CONN_READY)
            return NULL;
        if (serial_out)
            *serial_out = k->serial;
        return k->cl;
    }
    dht_addr a;
    struct sockaddr_storage ss;
    if (dht_addr_parse(&a, addr) != 0 || dht_addr_to_sockaddr(&a, &ss) < 0)
        return NULL;
    k = calloc(1, sizeof *k);
    if (!k)
        return NULL;
    k->key = key;
    k->serial = ++c->next_serial;
    k->owner = c;
    peer_rpc_client_config cc;
    memset(&cc, 0, sizeof cc);
    cc.self = c->cfg.ident;
    cc.expect_id = id;
    cc.swarm_key = c->has_key ? c->swarm_key : NULL;
    cc.max_pending = c->cfg.max_pending > 0 ? c->cfg.max_pending : 64;
    cc.connect_timeout_ms = c->cfg.connect_timeout_ms;
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
    HASH_ADD(hh, c->map, key, sizeof k->key, k);
    c->open++;
    return NULL;
}

void route_conns_drop(route_conns *c, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    if (!c || !id)
        return;
    if (addr) {
        conn_key key;
        conn *k = NULL;
        if (make_key(&key, id, addr) != 0)
            return;
        HASH_FIND(hh, c->map, &key, sizeof key, k);
        if (k)
            close_conn(c, k);
        return;
    }
    /* Every address of id. A fresh scan after each close: closing fails
     * pending calls, whose callbacks may change the table. */
    for (int guard = 0; guard < 1 << 20; guard++) {
        conn *k, *tmp, *hit = NULL;
        HASH_ITER(hh, c->map, k, tmp)
            if (!memcmp(k->key.id, id, DHT_ID_LEN)) {
                hit = k;
                break;
            }
        if (!hit)
            return;
        close_conn(c, hit);
    }
}

int route_conns_retain(route_conns *c, int (*keep)(void *arg, const uint8_t id[DHT_ID_LEN], const char *addr),
                       void *arg)
{
    if (!c || !keep)
        return 0;
    /* Decide first, close after: keep() sees a stable table, and closing
     * (whose failed calls' callbacks may change the table) never runs
     * inside an iteration. Connections are few, so the rescans are cheap. */
    int closed = 0;
    for (conn *k = c->map; k; k = k->hh.next)
        k->doomed = !keep(arg, k->key.id, k->key.addr);
    for (int guard = 0; guard < 1 << 20; guard++) {
        conn *k, *tmp, *hit = NULL;
        HASH_ITER(hh, c->map, k, tmp)
            if (k->doomed) {
                hit = k;
                break;
            }
        if (!hit)
            break;
        close_conn(c, hit);
        closed++;
    }
    return closed;
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
