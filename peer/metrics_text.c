/* peer/metrics_text.c: the Prometheus text a peer serves at /metrics, one
 * function per group of families (peer/metrics_text.h). */
#include "peer/metrics_text.h"

#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "net/tensorfmt.h"

/* Appends to buf[off..cap) (the render callbacks' buf, cap, off). */
#define EMIT(...)                                                                       \
    do {                                                                                \
        int n_ = snprintf(buf + off, cap > off ? cap - off : 0, __VA_ARGS__);           \
        if (n_ > 0)                                                                     \
            off = off + (size_t)n_ < cap ? off + (size_t)n_ : cap;                      \
    } while (0)

/* starling_up, and the requests and samples served, by block and kind. */
static size_t emit_requests(peer_service *svc, char *buf, size_t cap, size_t off)
{
    EMIT("# HELP starling_up 1 while the peer serves.\n# TYPE starling_up gauge\nstarling_up 1\n");
    static const char *kinds[4] = {"", "inference", "forward", "backward"};
    EMIT("# HELP starling_requests_total Requests served, by block and kind.\n"
         "# TYPE starling_requests_total counter\n");
    int nb = peer_service_n_blocks(svc);
    peer_block_info info;
    for (int i = 0; i < nb; i++) {
        if (peer_service_block_info(svc, i, &info) != 0)
            continue;
        for (int k = 1; k <= 3; k++)
            EMIT("starling_requests_total{block=\"%s\",kind=\"%s\"} %" PRIu64 "\n", info.name, kinds[k],
                 info.stats.tasks[k]);
    }
    EMIT("# HELP starling_samples_total Rows (samples) computed, by block and kind.\n"
         "# TYPE starling_samples_total counter\n");
    for (int i = 0; i < nb; i++) {
        if (peer_service_block_info(svc, i, &info) != 0)
            continue;
        for (int k = 1; k <= 3; k++)
            EMIT("starling_samples_total{block=\"%s\",kind=\"%s\"} %" PRIu64 "\n", info.name, kinds[k],
                 info.stats.rows[k]);
    }
    return off;
}

/* Tensor bytes of the compute methods by method, format and direction. */
static size_t emit_traffic(peer_service *svc, char *buf, size_t cap, size_t off)
{
    static const char *methods[PEER_SERVICE_TRAFFIC_METHODS] = {"forward", "backward", "infer"};
    static const char *dirs[2] = {"received", "sent"};
    EMIT("# HELP starling_tensor_bytes_total Tensor bytes of forward, backward and infer requests "
         "received and replies sent, by method and wire format.\n"
         "# TYPE starling_tensor_bytes_total counter\n");
    for (int m = 0; m < PEER_SERVICE_TRAFFIC_METHODS; m++)
        for (int f = 0; f < PEER_FMT_COUNT; f++)
            for (int d = 0; d < 2; d++)
                EMIT("starling_tensor_bytes_total{method=\"%s\",format=\"%s\",direction=\"%s\"} %" PRIu64 "\n",
                     methods[m], peer_tensorfmt_name((peer_fmt)f), dirs[d], peer_service_tensor_bytes(svc, m, f, d));
    char list[64];
    if (peer_tensorfmt_mask_format(peer_service_formats(svc), list, sizeof list) < 0)
        list[0] = '\0';
    EMIT("# HELP starling_wire_formats_info The tensor formats this peer accepts (--wire-formats).\n"
         "# TYPE starling_wire_formats_info gauge\nstarling_wire_formats_info{formats=\"%s\"} 1\n", list);
    return off;
}

/* Per block: the batcher's counters and gauges, the weight version and
 * the measured throughput. */
static size_t emit_batcher(peer_service *svc, char *buf, size_t cap, size_t off)
{
    int nb = peer_service_n_blocks(svc);
    peer_block_info info;
    struct {
        const char *name, *type, *help;
    } per_block[] = {
        {"starling_batches_total", "counter", "Joined batches computed."},
        {"starling_batch_rows_avg", "gauge", "Average rows per joined batch."},
        {"starling_queue_rows", "gauge", "Rows waiting in the queue."},
        {"starling_rejected_total", "counter", "Requests refused because the queue was full."},
        {"starling_errors_total", "counter", "Requests that failed in compute."},
        {"starling_steps_total", "counter", "Optimizer steps applied."},
        {"starling_weight_version", "gauge", "Current weight version."},
        {"starling_throughput_samples_per_second", "gauge", "Measured training throughput."},
        {"starling_backward_kept_samples_total", "counter",
         "Backward rows computed from kept forward activations (no recompute)."},
        {"starling_backward_recomputed_samples_total", "counter",
         "Backward rows that recomputed their forward (with --keep-activations > 0)."},
    };
    for (size_t m = 0; m < sizeof per_block / sizeof per_block[0]; m++) {
        EMIT("# HELP %s %s\n# TYPE %s %s\n", per_block[m].name, per_block[m].help, per_block[m].name,
             per_block[m].type);
        for (int i = 0; i < nb; i++) {
            if (peer_service_block_info(svc, i, &info) != 0)
                continue;
            const peer_batcher_stats *s = &info.stats;
            uint64_t rows = s->rows[1] + s->rows[2] + s->rows[3];
            double v = 0;
            switch (m) {
            case 0: v = (double)s->batches; break;
            case 1: v = s->batches ? (double)rows / (double)s->batches : 0; break;
            case 2: v = s->queued_rows; break;
            case 3: v = (double)s->rejected; break;
            case 4: v = (double)s->errors; break;
            case 5: v = (double)s->steps; break;
            case 6: v = (double)info.version; break;
            case 7: v = peer_batcher_train_throughput(s); break;
            case 8: v = (double)s->kept_hits; break;
            default: v = (double)s->kept_misses; break;
            }
            EMIT("%s{block=\"%s\"} %.6g\n", per_block[m].name, info.name, v);
        }
    }
    return off;
}

/* Training integrity (peer/service.h, "Gradient checks"): refused
 * gradients and frozen weights, by block. */
static size_t emit_integrity(peer_service *svc, char *buf, size_t cap, size_t off)
{
    int nb = peer_service_n_blocks(svc);
    peer_block_info info;
    EMIT("# HELP starling_gradients_refused_total Gradients refused by the training-integrity checks, by "
         "block and kind (request: a backward answered ERANGE before it was queued; step: an optimizer "
         "step dropped).\n# TYPE starling_gradients_refused_total counter\n");
    for (int i = 0; i < nb; i++) {
        if (peer_service_block_info(svc, i, &info) != 0)
            continue;
        EMIT("starling_gradients_refused_total{block=\"%s\",kind=\"request\"} %" PRIu64 "\n"
             "starling_gradients_refused_total{block=\"%s\",kind=\"step\"} %" PRIu64 "\n",
             info.name, info.refused_requests, info.name, info.refused_steps);
    }
    EMIT("# HELP starling_weights_frozen 1 while the block's latest --frozen-steps optimizer steps applied "
         "gradients but changed no weight.\n# TYPE starling_weights_frozen gauge\n");
    for (int i = 0; i < nb; i++)
        if (peer_service_block_info(svc, i, &info) == 0)
            EMIT("starling_weights_frozen{block=\"%s\"} %d\n", info.name, info.frozen ? 1 : 0);
    EMIT("# HELP starling_weights_still_steps Consecutive latest optimizer steps that changed no weight.\n"
         "# TYPE starling_weights_still_steps gauge\n");
    for (int i = 0; i < nb; i++)
        if (peer_service_block_info(svc, i, &info) == 0)
            EMIT("starling_weights_still_steps{block=\"%s\"} %" PRIu64 "\n", info.name, info.still_steps);
    return off;
}

/* One per-block averaging counter family with two values of a label
 * (result, direction), each a uint64_t field of peer_averaging_stats (by
 * offset), appended at off. Returns the new offset (at most cap). */
static size_t emit_avg_family(const peer_metrics_sources *src, char *buf, size_t cap, size_t off,
                              const char *name, const char *help, const char *label, const char *res_a,
                              size_t field_a, const char *res_b, size_t field_b)
{
    EMIT("# HELP %s %s\n# TYPE %s counter\n", name, help, name);
    int nb = peer_service_n_blocks(src->svc);
    for (int i = 0; i < nb; i++) {
        peer_block_info info;
        if (peer_service_block_info(src->svc, i, &info) != 0)
            continue;
        peer_averaging_stats as;
        peer_averaging_get_stats(src->avg, i, &as);
        uint64_t a, b;
        memcpy(&a, (const char *)&as + field_a, sizeof a);
        memcpy(&b, (const char *)&as + field_b, sizeof b);
        EMIT("%s{block=\"%s\",%s=\"%s\"} %" PRIu64 "\n%s{block=\"%s\",%s=\"%s\"} %" PRIu64 "\n", name,
             info.name, label, res_a, a, name, info.name, label, res_b, b);
    }
    return off;
}

/* The tensor RPC server and its limits (docs/rpc.md, "Limits"). */
static size_t emit_rpc(const peer_service *svc, char *buf, size_t cap, size_t off)
{
    peer_rpc_server_stats rs;
    peer_service_get_rpc_stats(svc, &rs);
    EMIT("# HELP starling_rpc_connections Tensor RPC connections open.\n"
         "# TYPE starling_rpc_connections gauge\nstarling_rpc_connections %" PRIu64 "\n"
         "# HELP starling_rpc_connections_total Tensor RPC connections accepted.\n"
         "# TYPE starling_rpc_connections_total counter\nstarling_rpc_connections_total %" PRIu64 "\n"
         "# HELP starling_rpc_handshakes_failed_total Handshakes refused, failed or timed out.\n"
         "# TYPE starling_rpc_handshakes_failed_total counter\n"
         "starling_rpc_handshakes_failed_total %" PRIu64 "\n",
         rs.conns_open, rs.conns_accepted, rs.handshakes_failed);
    EMIT("# HELP starling_rpc_refused_total Connections closed at accept by the limits, by reason "
         "(per_ip: --max-conns-per-ip; full: --max-conns; handshakes: too many unfinished handshakes).\n"
         "# TYPE starling_rpc_refused_total counter\n"
         "starling_rpc_refused_total{reason=\"per_ip\"} %" PRIu64 "\n"
         "starling_rpc_refused_total{reason=\"full\"} %" PRIu64 "\n"
         "starling_rpc_refused_total{reason=\"handshakes\"} %" PRIu64 "\n",
         rs.refused_per_ip, rs.refused_full, rs.refused_handshakes);
    EMIT("# HELP starling_rpc_closed_total Connections closed by the limits, by reason "
         "(handshake_timeout; idle: --idle-timeout; evicted: to make room for another address; drain: "
         "replies not read; record_timeout: a record not sent whole in time).\n"
         "# TYPE starling_rpc_closed_total counter\n"
         "starling_rpc_closed_total{reason=\"handshake_timeout\"} %" PRIu64 "\n"
         "starling_rpc_closed_total{reason=\"idle\"} %" PRIu64 "\n"
         "starling_rpc_closed_total{reason=\"evicted\"} %" PRIu64 "\n"
         "starling_rpc_closed_total{reason=\"drain\"} %" PRIu64 "\n"
         "starling_rpc_closed_total{reason=\"record_timeout\"} %" PRIu64 "\n",
         rs.closed_hs_timeout, rs.closed_idle, rs.evicted, rs.closed_drain, rs.closed_record_timeout);
    EMIT("# HELP starling_rpc_bad_frames_total Frames answered with an error, by reason (malformed: not a "
         "usable request, connection kept; oversize: over the frame limit, connection closed).\n"
         "# TYPE starling_rpc_bad_frames_total counter\n"
         "starling_rpc_bad_frames_total{reason=\"malformed\"} %" PRIu64 "\n"
         "starling_rpc_bad_frames_total{reason=\"oversize\"} %" PRIu64 "\n"
         "# HELP starling_rpc_record_waits_total Records that waited for the budget of records being "
         "received.\n# TYPE starling_rpc_record_waits_total counter\n"
         "starling_rpc_record_waits_total %" PRIu64 "\n",
         rs.bad_frames, rs.oversize_frames, rs.record_waits);
    EMIT("# HELP starling_rpc_handshaking Connections in the handshake.\n"
         "# TYPE starling_rpc_handshaking gauge\nstarling_rpc_handshaking %" PRIu64 "\n"
         "# HELP starling_rpc_incomplete_bytes Bytes charged to records being received.\n"
         "# TYPE starling_rpc_incomplete_bytes gauge\nstarling_rpc_incomplete_bytes %" PRIu64 "\n"
         "# HELP starling_rpc_incomplete_bytes_max High-water mark of starling_rpc_incomplete_bytes.\n"
         "# TYPE starling_rpc_incomplete_bytes_max gauge\nstarling_rpc_incomplete_bytes_max %" PRIu64 "\n"
         "# HELP starling_rpc_queued_bytes Reply bytes handed to the sockets and not yet written.\n"
         "# TYPE starling_rpc_queued_bytes gauge\nstarling_rpc_queued_bytes %" PRIu64 "\n"
         "# HELP starling_rpc_queued_bytes_max High-water mark of starling_rpc_queued_bytes.\n"
         "# TYPE starling_rpc_queued_bytes_max gauge\nstarling_rpc_queued_bytes_max %" PRIu64 "\n",
         rs.handshaking, rs.incomplete_bytes, rs.incomplete_bytes_max, rs.queued_bytes, rs.queued_bytes_max);
    return off;
}

/* This endpoint's own limits (peer/metrics.h). */
static size_t emit_endpoint(const peer_metrics *endpoint, char *buf, size_t cap, size_t off)
{
    peer_metrics_stats ms = {0};
    if (endpoint)
        peer_metrics_get_stats(endpoint, &ms);
    EMIT("# HELP starling_metrics_endpoint_refused_total Metrics connections closed at accept, by reason "
         "(per_ip: 8 per address; full: 64 in all, no address to take one from).\n"
         "# TYPE starling_metrics_endpoint_refused_total counter\n"
         "starling_metrics_endpoint_refused_total{reason=\"per_ip\"} %" PRIu64 "\n"
         "starling_metrics_endpoint_refused_total{reason=\"full\"} %" PRIu64 "\n"
         "# HELP starling_metrics_endpoint_closed_total Metrics connections closed early, by reason "
         "(evicted: to make room for another address; timeout: the exchange took over 5 s).\n"
         "# TYPE starling_metrics_endpoint_closed_total counter\n"
         "starling_metrics_endpoint_closed_total{reason=\"evicted\"} %" PRIu64 "\n"
         "starling_metrics_endpoint_closed_total{reason=\"timeout\"} %" PRIu64 "\n",
         ms.refused_per_ip, ms.refused_full, ms.evicted, ms.timed_out);
    return off;
}

/* The DHT: datagrams, bytes, drops and refusals. */
static size_t emit_dht(const dht *dh, char *buf, size_t cap, size_t off)
{
    dht_node_stats ds;
    dht_get_stats(dh, &ds);
    EMIT("# HELP starling_dht_datagrams_total DHT datagrams, by direction.\n"
         "# TYPE starling_dht_datagrams_total counter\n"
         "starling_dht_datagrams_total{dir=\"rx\"} %" PRIu64 "\n"
         "starling_dht_datagrams_total{dir=\"tx\"} %" PRIu64 "\n",
         ds.rx, ds.tx);
    EMIT("# HELP starling_dht_bytes_total DHT bytes, by direction.\n"
         "# TYPE starling_dht_bytes_total counter\n"
         "starling_dht_bytes_total{dir=\"rx\"} %" PRIu64 "\n"
         "starling_dht_bytes_total{dir=\"tx\"} %" PRIu64 "\n",
         ds.rx_bytes, ds.tx_bytes);
    EMIT("# HELP starling_dht_dropped_total DHT datagrams dropped, by reason.\n"
         "# TYPE starling_dht_dropped_total counter\n"
         "starling_dht_dropped_total{reason=\"malformed\"} %" PRIu64 "\n"
         "starling_dht_dropped_total{reason=\"swarm_tag\"} %" PRIu64 "\n"
         "starling_dht_dropped_total{reason=\"rate\"} %" PRIu64 "\n",
         ds.drop_malformed, ds.drop_tag, ds.drop_rate);
    EMIT("# HELP starling_dht_refused_total Nodes kept out by the DHT's per-network limits (--dht-limits), "
         "by where (table: proven nodes not added to the routing table; lookup: lookup candidates "
         "dropped).\n# TYPE starling_dht_refused_total counter\n"
         "starling_dht_refused_total{where=\"table\"} %" PRIu64 "\n"
         "starling_dht_refused_total{where=\"lookup\"} %" PRIu64 "\n",
         ds.table_refused, ds.lookup_refused);
    return off;
}

size_t peer_metrics_text_render(char *buf, size_t cap, const peer_metrics_sources *src)
{
    size_t off = 0;
    off = emit_requests(src->svc, buf, cap, off);
    off = emit_batcher(src->svc, buf, cap, off);
    off = emit_integrity(src->svc, buf, cap, off);
    off = emit_traffic(src->svc, buf, cap, off);
    if (src->avg) {
        off = emit_avg_family(src, buf, cap, off, "starling_avg_rounds_total",
                              "Replica averaging rounds, by block and result (abandoned: weights unchanged).",
                              "result", "completed", offsetof(peer_averaging_stats, rounds), "abandoned",
                              offsetof(peer_averaging_stats, abandoned));
        off = emit_avg_family(src, buf, cap, off, "starling_avg_contributions_total",
                              "Other members' contributions to averaging rounds the robust reduce did not take "
                              "as sent (dropped: non-finite, or a reduced part far from the others'; clipped: "
                              "pulled in toward the group's median).",
                              "result", "dropped", offsetof(peer_averaging_stats, dropped), "clipped",
                              offsetof(peer_averaging_stats, clipped));
        off = emit_avg_family(src, buf, cap, off, "starling_avg_bytes_total",
                              "Averaging tensor bytes (round slices, in their --average-format), by block and "
                              "direction (received: fetched by our rounds; sent: served to other members).",
                              "direction", "received", offsetof(peer_averaging_stats, bytes_received), "sent",
                              offsetof(peer_averaging_stats, bytes_sent));
    }
    off = emit_rpc(src->svc, buf, cap, off);
    off = emit_endpoint(src->endpoint, buf, cap, off);
    off = emit_dht(src->dht, buf, cap, off);
    return off;
}
