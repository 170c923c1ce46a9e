#include "tools/client.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <sodium.h>

#include "tools/cli.h"

typedef struct join_wait {
    int done;
    int status;
    int timed_out;
} join_wait;

static void on_join(dht *d, int status, void *ud)
{
    (void)d;
    join_wait *w = ud;
    w->done = 1;
    w->status = status;
}

static void on_timeout(uv_timer_t *t)
{
    join_wait *w = t->data;
    w->timed_out = 1;
}

static void on_timer_closed(uv_handle_t *h)
{
    *(int *)h->data = 1;
}

static void wipe(tools_client *c)
{
    sodium_memzero(&c->ident, sizeof c->ident);
    sodium_memzero(c->swarm_key, sizeof c->swarm_key);
}

int tools_client_open(tools_client *c, const char *cmd, const char *initial, const char *listen,
                      const char *identity, const char *swarm_key_file, double timeout_s)
{
    dht_peer_addr peers[64];
    dht_config cfg;
    int rc;

    memset(c, 0, sizeof *c);
    if (!initial)
        return cli_usage_error(cmd, "--initial-peers LIST is required (the address a 'starling "
                                    "bootstrap' or 'starling peer' prints)");
    int np = dht_peer_list_parse(peers, 64, initial);
    if (np < 0)
        return cli_usage_error(cmd, "--initial-peers '%s' is not a list of HOST:PORT[/NODEID]", initial);
    if (listen) {
        dht_addr la;
        if (dht_addr_parse_listen(&la, listen) != 0)
            return cli_usage_error(cmd, "--listen '%s' is not a numeric HOST:PORT", listen);
    } else {
        /* Loopback peers are reached from loopback; others from any address. */
        int lo = peers[0].addr.family == 4 && peers[0].addr.ip[0] == 127;
        int lo6 = peers[0].addr.family == 6 && !memcmp(peers[0].addr.ip, "\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\1", 16);
        listen = peers[0].addr.family == 6 ? (lo6 ? "[::1]:0" : "[::]:0") : (lo ? "127.0.0.1:0" : "0.0.0.0:0");
    }
    dht_config_default(&cfg);
    cfg.client_only = 1;
    if (swarm_key_file) {
        rc = dht_swarm_key_load(c->swarm_key, swarm_key_file);
        if (rc != 0)
            return cli_fail(cmd, "cannot load swarm key '%s': %s", swarm_key_file,
                            rc == -EPERM ? "readable by group or others; chmod 600 it"
                            : rc == -EBADMSG ? "expected 64 hex digits"
                                             : strerror(-rc));
        c->has_swarm_key = 1;
        cfg.has_swarm_key = 1;
        memcpy(cfg.swarm_key, c->swarm_key, 32);
    }
    rc = identity ? dht_identity_load(&c->ident, identity) : dht_identity_generate(&c->ident);
    if (rc != 0) {
        wipe(c);
        return cli_fail(cmd, "cannot load identity '%s': %s", identity ? identity : "(new)",
                        dht_identity_strerror(rc));
    }
    if (uv_loop_init(&c->loop) != 0) {
        wipe(c);
        return cli_fail(cmd, "cannot create the event loop");
    }
    c->loop_ready = 1;
    c->d = dht_create(&c->loop, &c->ident, &cfg);
    sodium_memzero(cfg.swarm_key, sizeof cfg.swarm_key);
    if (!c->d) {
        tools_client_close(c);
        return cli_fail(cmd, "cannot create the DHT node");
    }
    rc = dht_start(c->d, listen);
    if (rc != 0) {
        tools_client_close(c);
        return cli_fail(cmd, "cannot listen on %s: %s", listen, strerror(-rc));
    }
    join_wait w = {0, 0, 0};
    rc = dht_join(c->d, peers, (size_t)np, on_join, &w);
    if (rc != 0) {
        tools_client_close(c);
        return cli_fail(cmd, "cannot join: %s", strerror(-rc));
    }
    int timer_closed = 0;
    uv_timer_init(&c->loop, &c->join_timer);
    c->join_timer.data = &w;
    uv_timer_start(&c->join_timer, on_timeout, (uint64_t)(timeout_s * 1000), 0);
    while (!w.done && !w.timed_out)
        uv_run(&c->loop, UV_RUN_ONCE);
    c->join_timer.data = &timer_closed;
    uv_close((uv_handle_t *)&c->join_timer, on_timer_closed);
    while (!timer_closed) /* w and the flag live on this stack frame */
        uv_run(&c->loop, UV_RUN_ONCE);
    if (w.done && w.status == -EADDRINUSE) {
        /* The join worked; a client is kept out of routing tables, so a
         * twin hurts nobody, but the user may have meant another file. */
        char msg[256];
        tools_join_error(c->d, w.status, msg, sizeof msg);
        fprintf(stderr, "starling %s: warning: %s\n", cmd, msg);
        w.status = 0;
    }
    if (w.done && (w.status == -EADDRNOTAVAIL || w.status == -EKEYREJECTED)) {
        char msg[256];
        tools_join_error(c->d, w.status, msg, sizeof msg);
        tools_client_close(c);
        return cli_fail(cmd, "%s", msg);
    }
    if (!w.done || w.status < 0) {
        tools_client_close(c);
        return cli_fail(cmd, "cannot reach any initial peer (%s)%s", initial,
                        c->has_swarm_key || swarm_key_file
                            ? "; check the address and that the swarm key matches"
                            : "; check the address, or whether the swarm needs --swarm-key");
    }
    return CLI_EXIT_OK;
}

int tools_join_error(const dht *d, int status, char *buf, size_t cap)
{
    int n = dht_join_strerror(d, status, buf, cap);
    const char *hint = status == -EADDRNOTAVAIL ? ": check the node ID in --initial-peers"
                     : status == -EKEYREJECTED  ? ": check --swarm-key"
                     : status == -EADDRINUSE    ? ": use another --identity"
                                                : "";
    int m = snprintf(buf + n, cap - (size_t)n, "%s", hint);
    return m < 0 ? n : (size_t)m >= cap - (size_t)n ? (int)cap - 1 : n + m;
}

static void on_closed(dht *d, void *ud)
{
    (void)d;
    *(int *)ud = 1;
}

void tools_client_close(tools_client *c)
{
    if (c->d) {
        int closed = 0;
        dht_close(c->d, on_closed, &closed);
        c->d = NULL;
        while (!closed)
            uv_run(&c->loop, UV_RUN_ONCE);
    }
    if (c->loop_ready) {
        uv_run(&c->loop, UV_RUN_NOWAIT);
        uv_loop_close(&c->loop);
        c->loop_ready = 0;
    }
    wipe(c);
}
