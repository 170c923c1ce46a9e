/* peer/metrics_text.h: the Prometheus text a peer serves at /metrics.
 *
 * The families, in order: starling_up; per block and kind, requests and
 * samples; per block, the batcher's counters and gauges, the weight
 * version and throughput; the training-integrity refusals and frozen
 * weights; the compute methods' tensor bytes by method, format and
 * direction, and the formats accepted; per block, the averaging rounds,
 * the contributions the robust reduce dropped or clipped and the
 * averaging bytes (only with averaging); the tensor RPC
 * server and its limits (docs/rpc.md, "Limits"); the metrics endpoint's
 * own limits (peer/metrics.h); the DHT's datagrams, bytes, drops and
 * refusals. Tests and dashboards read these names and labels: renaming
 * one breaks them.
 *
 * The endpoint (peer/metrics.c) serves whatever text it is given; this
 * file writes the text from the parts' counters. Loop thread only.
 */
#ifndef PEER_METRICS_TEXT_H
#define PEER_METRICS_TEXT_H

#include <stddef.h>

#include "dht/dht.h"
#include "peer/averaging.h"
#include "peer/metrics.h"
#include "peer/service.h"

/* Where the counters come from (all borrowed for the call). */
typedef struct peer_metrics_sources {
    peer_service *svc;            /* required */
    const peer_averaging *avg;    /* NULL: no averaging families */
    const peer_metrics *endpoint; /* NULL: the endpoint's counters read 0 */
    const dht *dht;               /* required */
} peer_metrics_sources;

/* Writes the text into buf[0..cap) (cut short, not terminated, when it
 * does not fit) and returns its length (at most cap); the shape of a
 * peer_metrics_render_fn. */
size_t peer_metrics_text_render(char *buf, size_t cap, const peer_metrics_sources *src);

#endif
