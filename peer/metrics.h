/* peer/metrics.h: a minimal HTTP endpoint for Prometheus text metrics.
 *
 * `GET /metrics` answers with the text the render callback writes (the
 * Prometheus exposition format, version 0.0.4); any other path gets 404,
 * and anything that is not a GET request within 8 KiB gets 400. Each
 * connection serves one request and is closed (HTTP/1.0). Loop thread only.
 *
 * Strangers can reach it, so what one can hold is bounded
 * (peer_metrics_limits): connections per address (IPv4 address, IPv6 /64),
 * connections in all (when full, a connection of the address holding the
 * most is closed if it holds more than the newcomer's, else the newcomer
 * is), and the time one exchange may take, request and response together
 * (a client that sends nothing, half a request, or never reads the answer
 * is closed).
 */
#ifndef PEER_METRICS_H
#define PEER_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

/* Writes the metrics text into buf (cap bytes) and returns its length
 * (truncated output is fine: return at most cap). */
typedef size_t (*peer_metrics_render_fn)(char *buf, size_t cap, void *arg);

typedef struct peer_metrics peer_metrics;

typedef struct peer_metrics_limits {
    int max_conns;                /* open at once; 0 = 64 */
    int max_conns_per_ip;         /* 0 = 8 */
    uint64_t timeout_ms;          /* one exchange, accept to last byte written; 0 = 5000 */
} peer_metrics_limits;

typedef struct peer_metrics_stats {
    uint64_t accepted, served;    /* connections; 200 answers */
    uint64_t refused_per_ip, refused_full, evicted, timed_out;
} peer_metrics_stats;

/* Listens on addr (numeric "HOST:PORT" already resolved by the caller) with
 * the default limits. Returns NULL with a negative errno in *err on failure. */
peer_metrics *peer_metrics_start(uv_loop_t *loop, const struct sockaddr *addr,
                                 peer_metrics_render_fn render, void *arg, int *err);

/* The same with explicit limits (lim may be NULL: defaults). Either sets
 * SIGPIPE to ignored if the process left it at its default, so a scraper
 * that resets the connection cannot kill the process. */
peer_metrics *peer_metrics_start_ex(uv_loop_t *loop, const struct sockaddr *addr,
                                    peer_metrics_render_fn render, void *arg,
                                    const peer_metrics_limits *lim, int *err);

/* Counters since start (refusals and closes by reason, for the peer's own
 * metrics). */
void peer_metrics_get_stats(const peer_metrics *m, peer_metrics_stats *out);

/* The port listened on, or -1. */
int peer_metrics_port(const peer_metrics *m);

/* Closes the listener and every connection, then calls cb (may be NULL) on
 * the loop once every handle is closed. Calls after the first do nothing;
 * NULL-safe (cb does not run then). */
void peer_metrics_stop(peer_metrics *m, void (*cb)(void *arg), void *arg);

/* Frees a stopped server. Called before its handles have closed, it stops
 * the server (when not yet stopping) and frees it once they have.
 * NULL-safe; sets *p = NULL. */
void peer_metrics_destroy(peer_metrics **p);

#endif
