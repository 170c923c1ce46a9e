/* routing/infer.h: predictions from a swarm that may still be training.
 *
 * Each batch of inputs goes forward through every stage with the `infer`
 * method, which peers serve ahead of queued training work and which never
 * changes weights. Every reply names the weight version it was computed
 * with (each peer computes a request on one pinned version, so no reply
 * mixes two versions of a block). With replicas = K the same batch is sent
 * along K paths that use different holders wherever the swarm has them, and
 * each sample's answer is the majority vote of the paths, ties broken by
 * the mean probability. Routing, bans, retries, waits and the failure log
 * are the trainer's: both send through routing/caller.h.
 *
 * Threads: route_infer_run runs the given loop on the calling thread (the
 * loop's thread; the DHT must already be started and joined on that loop
 * and stays the caller's) until every sample is answered or the run fails.
 * on_message is called on that thread, from inside route_infer_run, with a
 * line valid for the duration of the call only; it must not run the loop.
 *
 * Ownership: the config's pointers (DHT, identity, model, inputs) are
 * borrowed for the duration of route_infer_run; the config is copied. *out
 * and the arrays it points to (pred, prob, agree) are the caller's; out is
 * filled on every return (pred/prob/agree only for batches that finished).
 */
#ifndef ROUTE_INFER_H
#define ROUTE_INFER_H

#include <stdint.h>

#include <uv.h>

#include "dht/dht.h"
#include "expert/model.h"

#define ROUTE_INFER_MAX_REPLICAS 9

typedef struct route_infer_config {
    dht *dht;                               /* started and joined; borrowed */
    const dht_identity *ident;
    const uint8_t *swarm_key;               /* 32 bytes or NULL */
    const struct expert_model_spec *model;
    const float *inputs;                    /* (n, model->n_in) */
    int n;
    const int *positions;                   /* a language model (task EXPERT_TASK_BYTES):
                                               (n) the position whose next-token logits
                                               answer each row (the row's output is
                                               (seq, vocab)); NULL otherwise */
    int batch;                              /* rows per request */
    int replicas;                           /* paths per batch, 1..ROUTE_INFER_MAX_REPLICAS */
    int inflight;                           /* (batch, path) units at once */
    double call_timeout_s, max_wait_s, refresh_s;
    void (*on_message)(void *arg, const char *msg);
    void *arg;
} route_infer_config;

typedef struct route_infer_result {
    int *pred;                 /* (n) caller-owned: the predicted class */
    float *prob;               /* (n) caller-owned or NULL: its mean probability */
    float *probs;              /* (n, classes) caller-owned or NULL: every class's mean
                                  probability over the paths (a language model: the
                                  next token's distribution, for sampling) */
    uint8_t *agree;            /* (n) caller-owned or NULL: paths that voted for it */
    uint64_t ver_min[64], ver_max[64];  /* weight versions seen per stage */
    double p50_ms, p99_ms;     /* latency of one (batch, path) through every stage */
    double requests_per_s;     /* (batch, path) units completed per second */
    double samples_per_s;      /* samples answered per second */
    double elapsed_s;
    long retries;              /* calls sent again: failed, timed out, or parked on a
                                  connection that could not be made */
    char error[320];           /* why it stopped early, or "" */
} route_infer_result;

/* Runs to the end. out->pred (and prob/agree when set) must have n entries,
 * out->probs (when set) n times the classes (n_out, or a language model's
 * vocabulary).
 * Returns 0, -ETIMEDOUT (a stage had no holder for max_wait_s), -EINVAL
 * (bad config: nothing ran), -ENOMEM; out->error says what happened. */
int route_infer_run(uv_loop_t *loop, const route_infer_config *cfg, route_infer_result *out);

#endif
