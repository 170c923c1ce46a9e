/* peer/metrics.h: a minimal HTTP endpoint for Prometheus text metrics.
 *
 * `GET /metrics` answers with the text the render callback writes (the
 * Prometheus exposition format, version 0.0.4); any other path gets 404,
 * and anything that is not a GET request within 8 KiB gets 400. Each
 * connection serves one request and is closed (HTTP/1.0). At most 32
 * connections are open at once; more are closed at accept. Loop thread only.
 */
#ifndef PEER_METRICS_H
#define PEER_METRICS_H

#include <stddef.h>

#include <uv.h>

/* Writes the metrics text into buf (cap bytes) and returns its length
 * (truncated output is fine: return at most cap). */
typedef size_t (*peer_metrics_render_fn)(char *buf, size_t cap, void *arg);

typedef struct peer_metrics peer_metrics;

/* Listens on addr (numeric "HOST:PORT" already resolved by the caller).
 * Returns NULL with a negative errno in *err on failure. */
peer_metrics *peer_metrics_start(uv_loop_t *loop, const struct sockaddr *addr,
                                 peer_metrics_render_fn render, void *arg, int *err);

/* The port listened on, or -1. */
int peer_metrics_port(const peer_metrics *m);

/* Closes the listener and every connection; frees m when all handles are
 * closed. NULL-safe. */
void peer_metrics_stop(peer_metrics *m);

#endif
