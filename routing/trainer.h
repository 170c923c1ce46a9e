/* routing/trainer.h: training a model whose stages are served by the swarm.
 *
 * The trainer holds the data and the loss; every parameterised stage lives
 * on peers. It finds each stage's holders through the DHT (routing/swarm.h),
 * keeps several micro-batches in flight (routing/pipeline.h) so all stages
 * work at once, sends each forward and backward call to a replica chosen at
 * random in proportion to its expected service rate (routing/swarm.h),
 * and on a timeout or an error bans that replica for a while and sends the
 * same call to another: no batch is lost (unless its backward is refused
 * too often: see below). Every call, connection and
 * handshake is bounded by call_timeout_s. A stage whose replicas are all
 * banned is probed every ROUTE_PROBE_S (routing/swarm.h), so training
 * resumes soon after a dead holder comes back. When a stage has no online holder
 * the trainer waits (saying so) up to max_wait_s, then gives up with a
 * message naming the stage. After each epoch it evaluates the test set
 * through the same swarm (forward only).
 *
 * A byte-level language model (a model of task EXPERT_TASK_BYTES) trains on
 * text (routing/text.h) instead of images: a row is a window of seq+1
 * bytes drawn exactly as ../shared/bench/torch/train_lm.py draws them
 * (step s takes draws s·B .. s·B+B-1 of the training stream seeded with
 * `seed`, B = sync_samples), the loss is the mean next-byte cross-entropy
 * over every position, and the "epochs" are the stretches between
 * evaluations: one before the first step, then every eval_every steps and
 * after the last, each over the same eval_rows validation windows.
 *
 * A holder's error reply is logged with its sentence, as is a call that
 * failed in transport: the first of each (stage, error) at once, then at
 * most one summary line every ROUTE_ERRLOG_PERIOD_S (routing/pipeline.h)
 * with the counts. A
 * backward refused with ERANGE (the holder's gradient checks failed) is
 * sent to another replica without banning the refuser; a refuser is backed
 * off only when another replica accepts what it refused (it refuses what
 * its replicas accept: a bad or hostile replica). After
 * ROUTE_PIPELINE_MAX_REFUSALS refusals of one micro-batch's backward the
 * trainer drops that micro-batch's update: every replica refusing says our
 * gradient is bad (the loss blew up), so retrying cannot help.
 *
 * Each forward reply names the holder's weight version; a holder whose
 * version goes down (it restarted from an older checkpoint or its initial
 * weights) is reported as a rollback (routing/versions.h).
 *
 * Calls go out through routing/caller.h, which the trainer shares with
 * inference: the trainer's own part is the data order, the pipeline's
 * calls, backward affinity and refusals, the loss, epochs and evaluation.
 *
 * Threads: route_train_run runs the given loop on the calling thread (the
 * loop's thread; the DHT must already be started and joined on that loop
 * and stays the caller's) until training ends. Every callback in the config
 * (on_progress, on_epoch, on_message) is called on that thread, from inside
 * route_train_run; their pointer arguments are valid for the duration of
 * the callback only. The callbacks must not run the loop or call
 * route_train_run.
 *
 * Ownership: everything the config points to (DHT, identity, model, data
 * sets) is borrowed for the duration of route_train_run and must not change
 * meanwhile; the config itself is copied. *out is the caller's; it is
 * filled on every return, errors included. Nothing is left allocated or
 * open on the loop when route_train_run returns (the DHT's handles aside).
 */
#ifndef ROUTE_TRAINER_H
#define ROUTE_TRAINER_H

#include <stdint.h>

#include <uv.h>

#include "dht/dht.h"
#include "expert/model.h"
#include "routing/data.h"
#include "routing/text.h"

typedef struct route_train_progress {
    int epoch;                 /* 1-based */
    long done;                 /* training samples finished this run */
    long total;                /* training samples in the whole run */
    double loss;               /* mean loss of the recent batches */
    double elapsed_s;          /* training time so far (evaluation excluded) */
    long retries;              /* calls re-sent so far (route_train_result.retries) */
    long refused;              /* backward calls refused so far (route_train_result.refused) */
} route_train_progress;

typedef struct route_epoch_result {
    int epoch;
    double train_loss;         /* mean over the epoch's samples */
    double test_loss, test_acc;
    long samples;              /* training samples this epoch */
    double train_time_s;       /* this epoch's training time */
    long retries;              /* calls re-sent during this epoch's training and evaluation */
    long refused;              /* backward calls refused during this epoch */
    long refused_samples;      /* of `samples`, those whose update was dropped */
} route_epoch_result;

/* A holder whose weight version went down. */
typedef struct route_rollback {
    int stage;
    uint8_t holder[DHT_ID_LEN];   /* its node ID */
    uint64_t from, to;            /* weight versions: highest seen before, then the lower one */
} route_rollback;

#define ROUTE_MAX_ROLLBACKS 32

typedef struct route_train_config {
    dht *dht;                               /* started and joined; borrowed */
    const dht_identity *ident;              /* for the RPC handshakes */
    const uint8_t *swarm_key;               /* 32 bytes or NULL */
    const struct expert_model_spec *model;
    const route_dataset *train, *test;      /* borrowed (NULL with text) */
    const route_text *text;                 /* a language model's corpus, borrowed (NULL
                                               for images); then: */
    long steps;                             /*   optimizer steps of sync_samples windows */
    int eval_every;                         /*   steps between evaluations (>= 1) */
    int eval_rows;                          /*   validation windows (>= 1) */
    double max_seconds;                     /* > 0: stop after the first optimizer step (text)
                                               or micro-batch that ends this long after the
                                               start (evaluations included), then evaluate */
    int n_train, n_test;                    /* first n samples (0 = all) */
    int epochs;                             /* >= 1 */
    int batch;                              /* micro-batch rows */
    int inflight;                           /* micro-batches in flight */
    uint64_t seed;                          /* data order */
    double call_timeout_s;                  /* one RPC (default 30) */
    double max_wait_s;                      /* a stage without holders (default 120) */
    double refresh_s;                       /* holder lookups (default 10) */
    int sync_samples;                       /* > 0: training micro-batches go in groups of
                                               this many samples, and a group starts only
                                               once the previous one has finished its
                                               backward everywhere (synchronous steps when
                                               it equals the peers' target batch); 0: a new
                                               micro-batch starts whenever one finishes */
    int wire_format;                        /* peer_fmt of the activations and gradients
                                               sent to and asked of holders that accept it
                                               (announced "wf"; others get f32): 0 f32 */
    int wire_block;                         /* its q8 block (0: the default) */
    void (*on_progress)(void *arg, const route_train_progress *p);
    void (*on_epoch)(void *arg, const route_epoch_result *e);
    void (*on_message)(void *arg, const char *msg);
    void *arg;
} route_train_config;

typedef struct route_train_result {
    int epochs;                /* completed */
    long samples;              /* training samples (text: windows) processed (each exactly
                                  once per epoch) */
    long steps;                /* text: optimizer steps (groups of sync_samples) finished */
    int stopped_early;         /* max_seconds ended training */
    double train_time_s;
    double samples_per_s;
    double test_acc, test_loss;
    long retries;              /* calls re-sent: every call that failed or timed out,
                                  and every call that waited for a connection that
                                  could not be made, then went out again */
    long refused;              /* backward calls a holder refused (RPC error ERANGE: the
                                  gradient failed its checks); each is retried on
                                  another replica, up to ROUTE_PIPELINE_MAX_REFUSALS
                                  per micro-batch */
    long refused_batches;      /* micro-batches whose backward was refused that often:
                                  their update was dropped (not retried again) */
    long refused_samples;      /* their samples: counted in `samples` (processed),
                                  but only the stages after the refusing one learnt
                                  from them */
    long errors;               /* calls that failed after they were sent: error replies
                                  (refusals included), timeouts, broken connections;
                                  not the calls we cancelled ourselves, nor those that
                                  waited for a connection that could not be made */
    uint64_t bytes_sent;       /* tensor bytes of training calls' requests (retries included;
                                  not the evaluation's) */
    uint64_t bytes_received;   /* ... and of their replies */
    uint64_t f32_calls, compressed_calls; /* training calls sent in f32 / in wire_format */
    int n_rollbacks;           /* rollbacks seen (the first ROUTE_MAX_ROLLBACKS are kept) */
    route_rollback rollbacks[ROUTE_MAX_ROLLBACKS];
    char error[320];           /* why it stopped early, or "" */
} route_train_result;

/* Runs training to the end. Returns 0, or -ETIMEDOUT (a stage stayed without
 * holders longer than max_wait_s), -EINVAL (bad config, or the data does not
 * fit the model: nothing ran), -ENOMEM; out->error says what happened, and
 * out's counts cover what ran before the end. */
int route_train_run(uv_loop_t *loop, const route_train_config *cfg, route_train_result *out);

#endif
