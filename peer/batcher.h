/* peer/batcher.h: one hosted block's request queue and compute threads.
 *
 * Requests (tasks) for a block are queued and served by worker threads off
 * the event loop. A worker takes the oldest ready task and joins to it other
 * queued tasks of the same operation, up to max_batch rows, so concurrent
 * requests become one larger matrix product (rows are independent in every
 * block, and parameter gradients are sums over rows, so joining is exact).
 * Forward-only inference tasks go ahead of queued training work. The queue
 * is bounded in rows: a submit beyond it fails with -EAGAIN, and the RPC
 * layer answers "busy" so the trainer retries elsewhere (backpressure).
 *
 * Backward tasks accumulate parameter gradients; after each backward batch
 * the optimizer steps when target_batch samples have accumulated
 * (expert_block_maybe_step). Forwards read a pinned, consistent weight
 * version, so they never see a half-applied step; each task reports the
 * version it used.
 *
 * Kept activations (cfg.keep > 0): a training forward's activations are
 * kept, with a copy of its input, in one of cfg.keep slots (the oldest is
 * reused first); a backward whose input equals a kept forward's exactly and
 * that names the forward's weight version (has_at_version) loads them
 * instead of recomputing the forward: the same result without one of a
 * ResFFN sample's seven matrix products (and its LayerNorm and GELU). Anything else (another replica took the
 * forward, the slot was reused, the version is gone) recomputes, as a
 * stateless server would. Memory: up to keep * max_batch * (in + the
 * block's kept floats per row) floats.
 *
 * Threads: submit may be called from any thread. A task's done callback
 * runs on a worker thread, without any batcher lock held; it may submit
 * new tasks. The task memory is the caller's and must stay valid until done
 * is called.
 */
#ifndef PEER_BATCHER_H
#define PEER_BATCHER_H

#include <stdint.h>

#include "expert/block.h"
#include "expert/optim.h"

typedef enum peer_task_kind {
    PEER_TASK_INFER = 1,     /* forward, inference priority */
    PEER_TASK_FORWARD = 2,   /* forward for training */
    PEER_TASK_BACKWARD = 3,  /* recompute forward, backward, accumulate */
} peer_task_kind;

typedef struct peer_task peer_task;

/* Called once per submitted task from a worker thread: status 0 on success
 * or -errno. Borrowed pointers in the task are the caller's again after it. */
typedef void (*peer_task_done_fn)(peer_task *t, int status);

struct peer_task {
    peer_task_kind kind;
    int rows;                 /* B, 1..max_batch */
    const float *inputs;      /* (B, in) */
    const float *grad_outputs;/* (B, out); backward only */
    float *outputs;           /* forward: (B, out); backward: grad_inputs (B, in) or NULL */
    peer_task_done_fn done;
    void *user;               /* for the caller */
    uint64_t version;         /* out: weight version the task computed with */
    int has_at_version;       /* backward: recompute on weight version at_version when */
    uint64_t at_version;      /*   the block still holds it (see expert_block_backward_at) */
    /* internal */
    peer_task *next_;
};

#define PEER_BATCHER_MAX_KEEP 1024

typedef struct peer_batcher_config {
    int threads;          /* compute threads, >= 1 */
    int max_batch;        /* rows per joined batch (and per task) */
    int max_queue_rows;   /* queued rows before submit says -EAGAIN */
    struct expert_optim optim;
    int infer_threads;    /* extra threads that serve only inference (>= 0), so an
                             inference request never waits behind a training
                             batch already being computed */
    int train_idle;       /* with lanes: training threads run at SCHED_IDLE
                             (preempted at once by any other thread) instead
                             of nice 10 */
    int stage;            /* names the threads in ps/top/perf: "train-<stage>",
                             "infer-<stage>" */
    int keep;             /* training forwards whose activations are kept for
                             their backward (0: every backward recomputes its
                             forward; see "Kept activations" above) */
} peer_batcher_config;

typedef struct peer_batcher_stats {
    uint64_t tasks[4];        /* completed, by peer_task_kind */
    uint64_t rows[4];         /* completed rows, by kind */
    uint64_t batches;         /* joined batches computed */
    uint64_t rejected;        /* submits refused with -EAGAIN */
    uint64_t errors;          /* tasks completed with an error */
    uint64_t steps;           /* optimizer steps taken */
    int queued_rows;          /* rows waiting now */
    int queued_tasks;
    double fwd_row_s;         /* EWMA compute seconds per forward row */
    double bwd_row_s;         /* EWMA compute seconds per backward row */
    uint64_t version;         /* current weight version */
    uint64_t kept_hits;       /* backward rows computed from kept activations */
    uint64_t kept_misses;     /* backward rows that recomputed their forward (keep > 0) */
} peer_batcher_stats;

typedef struct peer_batcher peer_batcher;

/* Creates the queue and starts cfg->threads workers serving blk (borrowed:
 * it must outlive the batcher). Returns NULL on a bad config or no memory
 * (threads already started are stopped). */
peer_batcher *peer_batcher_create(expert_block *blk, const peer_batcher_config *cfg);

/* Stops accepting, serves everything already queued, joins the workers and
 * frees the batcher. NULL-safe; sets *p = NULL. Must not be called from a
 * done callback. */
void peer_batcher_destroy(peer_batcher **p);

/* Queues t. Returns 0 (done will be called exactly once), or, without ever
 * calling done: -EINVAL (bad rows/pointers/kind), -EAGAIN (queue full),
 * -ESHUTDOWN (stopping). */
int peer_batcher_submit(peer_batcher *b, peer_task *t);

/* Computes inference task t (kind PEER_TASK_INFER) at once on the calling
 * thread, ahead of everything queued, with the caller's workspace ws (made
 * for this block's config and at least t->rows rows; one thread at a time
 * per ws). For small requests, where handing them to the lane (a wake-up
 * there and one back) costs more than the compute. Reads one pinned weight
 * version like a queued forward, sets t->version, counts the task in the
 * stats; never calls t->done. Returns 0 or -errno (-EINVAL: bad task,
 * -ESHUTDOWN: stopping). */
int peer_batcher_infer_now(peer_batcher *b, expert_workspace *ws, peer_task *t);

/* A consistent copy of the counters. */
void peer_batcher_get_stats(peer_batcher *b, peer_batcher_stats *out);

/* Seeds the per-row compute times (seconds) before any request has been
 * measured, e.g. from a start-up calibration. Values <= 0 are ignored. */
void peer_batcher_set_speed(peer_batcher *b, double fwd_row_s, double bwd_row_s);

/* Estimated training throughput in samples/s (one forward plus one backward
 * per sample) from the measured per-row times; 0 before any measurement. */
double peer_batcher_train_throughput(const peer_batcher_stats *s);

#endif
