#include "tools/client.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "expert/model.h"
#include "expert/modelfile.h"
#include "swarm/modeldesc.h"
#include "tools/cli.h"

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
        listen = dht_client_listen(&peers[0]); /* loopback peers are reached from loopback */
    }
    dht_config_default(&cfg);
    cfg.client_only = 1;
    if (swarm_key_file) {
        rc = dht_swarm_key_load(c->swarm_key, swarm_key_file);
        if (rc != 0)
            return cli_fail(cmd, "cannot load swarm key '%s': %s", swarm_key_file, dht_swarm_key_strerror(rc));
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
    rc = dht_join_wait(c->d, peers, (size_t)np, timeout_s);
    if (rc == -EADDRINUSE) {
        /* The join worked; a client is kept out of routing tables, so a
         * twin hurts nobody, but the user may have meant another file. */
        char msg[256];
        tools_join_error(c->d, rc, msg, sizeof msg);
        fprintf(stderr, "starling %s: warning: %s\n", cmd, msg);
        rc = 0;
    }
    if (rc == -EADDRNOTAVAIL || rc == -EKEYREJECTED) {
        char msg[256];
        tools_join_error(c->d, rc, msg, sizeof msg);
        tools_client_close(c);
        return cli_fail(cmd, "%s", msg);
    }
    if (rc < 0) {
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

/* ---- a model from the swarm ---- */

/* Heap-allocated: when the wait times out the fetch goes on until the DHT
 * closes (its callback then frees this). */
typedef struct fetch_wait {
    int done, abandoned, status;
    struct expert_model_spec *spec;
    uint8_t hash[PEER_MODELDESC_HASH_LEN];
    size_t len;
    char msg[2048];
} fetch_wait;

static void on_fetched(int status, struct expert_model_spec *spec, const uint8_t hash[PEER_MODELDESC_HASH_LEN],
                       size_t json_len, const char *err, void *arg)
{
    fetch_wait *w = arg;
    if (w->abandoned) {
        expert_model_free(spec);
        free(w);
        return;
    }
    w->done = 1;
    w->status = status;
    w->spec = spec;
    memcpy(w->hash, hash, sizeof w->hash);
    w->len = json_len;
    snprintf(w->msg, sizeof w->msg, "%s", err ? err : "");
}

static void on_fetch_timeout(uv_timer_t *t)
{
    *(int *)t->data = 1;
}

static void known_models(char *names, size_t cap)
{
    names[0] = '\0';
    for (int i = 0; expert_model_at(i); i++)
        snprintf(names + strlen(names), cap - strlen(names), "%s%s", i ? ", " : "", expert_model_at(i)->name);
}

int tools_client_fetch_model(tools_client *c, const char *cmd, const char *name, double timeout_s,
                             const struct expert_model_spec **out)
{
    char names[512];
    *out = NULL;
    fetch_wait *w = calloc(1, sizeof *w);
    if (!w)
        return cli_fail(cmd, "out of memory");
    int rc = peer_modeldesc_fetch(c->d, name, on_fetched, w);
    if (rc != 0) {
        free(w);
        return cli_fail(cmd, "cannot look model '%s' up in the swarm: %s", name, strerror(-rc));
    }
    int timed_out = 0, timer_closed = 0;
    uv_timer_t timer;
    uv_timer_init(&c->loop, &timer);
    timer.data = &timed_out;
    uv_timer_start(&timer, on_fetch_timeout, (uint64_t)(timeout_s * 1000), 0);
    while (!w->done && !timed_out)
        uv_run(&c->loop, UV_RUN_ONCE);
    timer.data = &timer_closed;
    uv_close((uv_handle_t *)&timer, on_timer_closed);
    while (!timer_closed)
        uv_run(&c->loop, UV_RUN_ONCE);
    if (!w->done) {
        w->abandoned = 1; /* freed by its callback when the client closes */
        return cli_fail(cmd, "model '%s': no answer from the swarm within %g s", name, timeout_s);
    }
    int status = w->status;
    if (status != 0) {
        known_models(names, sizeof names);
        if (status == -ENOENT && !strncmp(w->msg, "no peer", 7))
            rc = cli_fail(cmd, "unknown model '%s': no built-in model and no peer in the swarm publishes one by "
                               "that name (known here: %s)", name, names);
        else if (status == -ENOENT)
            rc = cli_fail(cmd, "unknown model '%s': %s", name, w->msg);
        else
            rc = cli_fail(cmd, "%s", w->msg);
        free(w);
        return rc;
    }
    char hex[DHT_ID_HEX_LEN + 1], err[512];
    dht_id_to_hex(hex, w->hash);
    int n_stages = w->spec->n_stages;
    size_t len = w->len;
    struct expert_model_spec *spec = w->spec;
    free(w);
    if (expert_model_register(spec, err, sizeof err) < 0) /* takes spec */
        return cli_fail(cmd, "model '%s' from the swarm: %s", name, err);
    *out = expert_model_find(name);
    if (!*out)
        return cli_fail(cmd, "model '%s' from the swarm: not registered", name);
    fprintf(stderr, "starling %s: model %s: description %.8s fetched from the swarm (%zu bytes, %d stage%s)\n",
            cmd, name, hex, len, n_stages, n_stages == 1 ? "" : "s");
    return CLI_EXIT_OK;
}

int tools_model_select(const char *cmd, const char *name, const char *file, const char *dflt, const char *initial,
                       const char *swarm_key_file, const struct expert_model_spec **out)
{
    *out = NULL;
    if (file || !name || !initial || expert_model_find(name) || expert_model_name_check(name) != 0)
        return cli_model_select(cmd, name, file, dflt, out) ? CLI_EXIT_USAGE : CLI_EXIT_OK;
    tools_client cl;
    int rc = tools_client_open(&cl, cmd, initial, NULL, NULL, swarm_key_file, 15);
    if (rc != CLI_EXIT_OK)
        return rc;
    rc = tools_client_fetch_model(&cl, cmd, name, 60, out);
    tools_client_close(&cl);
    return rc;
}
