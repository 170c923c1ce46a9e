/* peer/service.h: the blocks a peer serves, behind the tensor RPC.
 *
 * A service hosts some stages of one model. For each it keeps an expert
 * block (restored from its checkpoint when one exists), a batcher (compute
 * threads, joined batches, backpressure, optimizer steps) and a pool of
 * request contexts with output buffers, so steady traffic allocates nothing.
 * The RPC server (peer/rpc_server.h) hands requests to the service on the
 * loop thread; the service checks them, queues them on the block's batcher,
 * and the worker that computes a batch sends each reply itself.
 *
 * Requests (docs/rpc.md): forward(block "<model>.<i>", inputs (B, in)) ->
 * outputs (B, out); backward(block, inputs (B, in), grad_outputs (B, out))
 * -> grad_inputs (B, in). B is 1..max_batch. The reply's meta is the weight
 * version the computation used, as 8 bytes little-endian. Errors come back
 * as codes with a sentence: ENOENT block not hosted, EINVAL wrong shapes or
 * dtype, ENOSYS unknown method, EBUSY queue full (try another replica),
 * ESHUTDOWN stopping, EIO compute failed. info returns a JSON document
 * (meta) describing the hosted blocks.
 *
 * state(block, meta = u64 snapshot id (0: take a new snapshot) + u64 offset,
 * both little-endian) -> one f32 tensor (1, n) carrying up to
 * PEER_STATE_CHUNK bytes of the block's serialized state (parameters and
 * optimizer state, the checkpoint format; zero padded to whole floats), and
 * meta = u64 snapshot id, u64 total bytes, u64 weight version, u64 training
 * samples processed since the block's last averaging round. A newcomer
 * asks for offset 0 with id 0, then for the following offsets with the id it
 * got; if the snapshot was replaced meanwhile the answer is ESTALE and it
 * starts again. The serialized bytes carry their own checksum and config
 * hash, which the receiver verifies when it installs them.
 *
 * Gradient checks (training integrity, expert/guard.h). A backward whose
 * inputs or grad_outputs hold NaN/Inf, or whose per-sample norms are above
 * cfg.guard's absolute cap or, once the block has seen `warmup` backward
 * requests, `factor` times their recent norm, is refused before it is
 * queued: ERANGE with a sentence ("fmnist-mlp.3: backward per-sample
 * grad_output norm 1e+30 is above the limit 1e+05; refused"). Every
 * optimizer step checks the averaged gradient the same way and the update
 * it makes (expert_block_step); a refused step drops the accumulation and
 * the backward that completed it is answered ERANGE ("fmnist-mlp.3: the
 * optimizer step this backward completed was dropped: ..."). A block whose steps
 * apply gradients but change no weight for frozen_steps steps is logged
 * ("block fmnist-mlp.3: weights have not moved in 8 steps ...") and
 * reported in peer_block_info.frozen. Refusals are logged at most once per
 * 10 s per block, with their count.
 *
 * Thread-safety: create, listen, checkpoint, close and the getters run on
 * the loop thread.
 */
#ifndef PEER_SERVICE_H
#define PEER_SERVICE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <uv.h>

#include "dht/identity.h"
#include "expert/guard.h"
#include "expert/optim.h"
#include "peer/batcher.h"
#include "peer/rpc_server.h"

#define PEER_SERVICE_MAX_BLOCKS 64
#define PEER_STATE_CHUNK (256 * 1024)

typedef struct peer_service_config {
    const dht_identity *self;     /* required; borrowed for create only */
    const uint8_t *swarm_key;     /* 32 bytes or NULL */
    const char *model;            /* e.g. "fmnist-mlp" */
    const int *blocks;            /* stage indices to host */
    int n_blocks;                 /* 1..PEER_SERVICE_MAX_BLOCKS */
    int threads;                  /* compute threads per block (>= 1) */
    int max_batch;                /* rows per request and per joined batch */
    int max_queue_rows;           /* per block, before EBUSY */
    int train_idle;               /* training threads at SCHED_IDLE (peer_batcher_config) */
    int infer_inline_rows;        /* inference requests of at most this many rows are
                                     computed at once on the loop thread (no hand-off
                                     to the lane); 0: always through the lane */
    int keep_activations;         /* per block: training forwards kept for their
                                     backward (peer_batcher_config.keep; 0: every
                                     backward recomputes its forward) */
    struct expert_optim optim;    /* optimizer, incl. target_batch */
    struct expert_guard_config guard; /* training-integrity bounds (expert/guard.h; zeros:
                                     the defaults): each backward request's per-sample
                                     input and grad_output norms, and every step's
                                     averaged gradient */
    uint64_t seed;                /* init seed when no checkpoint exists */
    /* Limits of the RPC server against hostile clients (peer_rpc_server_config,
     * docs/rpc.md "Limits"); 0 takes the server's default. */
    int rpc_max_conns;            /* connections in all (1024) */
    int rpc_max_conns_per_ip;     /* per IPv4 address or IPv6 /64 (64) */
    int rpc_max_handshakes;       /* unfinished handshakes (64) */
    uint64_t rpc_idle_timeout_ms; /* established connection with nothing happening (120000) */
    const char *checkpoint_dir;   /* NULL: no checkpoints */
    FILE *log;                    /* warnings and notes about checkpoints (stale temp
                                     files removed, a file that records no stage);
                                     NULL: stderr. Borrowed; must outlive the service */
} peer_service_config;

/* What a service reports about one hosted block (for announcements and
 * metrics). */
typedef struct peer_block_info {
    char name[65];                /* "<model>.<index>" */
    int index;
    uint64_t stage_hash;          /* expert_stage_hash */
    int in, out;
    uint64_t version;             /* current weight version */
    int restored;                 /* loaded from a checkpoint at start */
    peer_batcher_stats stats;
    /* Training integrity (see "Gradient checks" above). */
    uint64_t refused_requests;    /* backward requests refused (ERANGE) */
    uint64_t refused_steps;       /* optimizer steps refused (accumulation dropped) */
    uint64_t still_steps;         /* consecutive latest steps that changed no weight */
    int frozen;                   /* still_steps reached the guard's frozen_steps */
} peer_block_info;

typedef struct peer_service peer_service;

/* Creates blocks (from checkpoints in checkpoint_dir when present), their
 * batchers and the RPC server. Returns NULL on failure with a sentence in
 * err (unknown model or stage, duplicate stage, corrupt or mismatched
 * checkpoint, out of memory). A checkpoint that cannot be loaded (corrupt,
 * or another stage's: "<file> holds fmnist-mlp.2 (..), not fmnist-mlp.3
 * (..)") is left untouched and the service is not created, so a running
 * peer never overwrites it (docs/expert.md). Before loading, the temporary
 * files that killed checkpoint writes of the hosted blocks left are removed
 * (expert_ckpt_clean_tmp), and logged with their size. */
peer_service *peer_service_create(uv_loop_t *loop, const peer_service_config *cfg, char *err,
                                  size_t errlen);

/* Listens for tensor RPC on addr. Returns 0 or a negative errno. */
int peer_service_listen(peer_service *s, const struct sockaddr *addr);

/* The TCP port listened on, or -1. */
int peer_service_port(const peer_service *s);

int peer_service_n_blocks(const peer_service *s);
/* Fills info for hosted block i. Returns 0 or -EINVAL. */
int peer_service_block_info(peer_service *s, int i, peer_block_info *info);

/* The RPC server's counters and gauges (connections refused and closed by
 * the limits, bytes held; peer_rpc_server_stats). s NULL: all zero. Loop
 * thread. */
void peer_service_rpc_stats(const peer_service *s, peer_rpc_server_stats *out);

/* Installs serialized state (from a donor's PEER_METHOD_STATE download) into
 * hosted block i. Returns 0, -EINVAL, or expert_block_deserialize's error
 * (-EBADMSG corrupt, -ESTALE another configuration or another stage: the
 * state records its stage, checkpoint format 2); the block is unchanged on
 * error. Loop thread. */
int peer_service_install_state(peer_service *s, int i, const void *buf, size_t len);

/* ---- Group averaging, the serving side (peer/allreduce.h drives it) ----
 *
 * A round freezes the block's flat state (expert_block_flat_export:
 * parameters, m, v) as the round's base and splits it into n contiguous
 * parts, one per member (peer_avg_part); member j reduces part j. Other
 * members pull slices of our base and, once we have reduced our part, of
 * the result, with PEER_METHOD_AVG (docs/rpc.md):
 *   request meta (48 bytes LE): round u64 | group digest 16 bytes |
 *                               kind u64 (0 base, 1 reduced) | offset u64 | count u64
 *   reply meta (24 bytes LE):   round u64 | weight f64 | flat length u64,
 *                               one (1, count) f32 tensor.
 * Errors: EAGAIN (that round has not begun here yet, our part is not
 * reduced yet, or we are in another group for this round and look again:
 * ask again), ESTALE (another round), ECANCELED
 * (the round failed here), EINVAL (a range outside the state or our part). */
#define PEER_AVG_MAX_COUNT (PEER_STATE_CHUNK / 4)
#define PEER_AVG_DIGEST_LEN 16

/* Part j of n of a flat vector of nflat floats. */
static inline void peer_avg_part(size_t nflat, int n, int j, size_t *off, size_t *len)
{
    size_t a = nflat * (size_t)j / (size_t)n, b = nflat * (size_t)(j + 1) / (size_t)n;
    *off = a;
    *len = b - a;
}

/* Begins round `round` of block i in the group named by digest (n members,
 * we are member me): freezes the base and our weight (training samples
 * since the last applied round, plus one, so a group where nobody trained
 * averages with equal weights; 0 while the block still has its initial
 * weights: never restored, downloaded, averaged or stepped, so it takes
 * the group's average without pulling it toward noise). Replaces any earlier round. Returns 0,
 * -EINVAL or -ENOMEM. Loop thread. */
int peer_service_avg_begin(peer_service *s, int i, uint64_t round, const uint8_t digest[PEER_AVG_DIGEST_LEN],
                           int n, int me, double *weight_out, size_t *nflat_out);
/* The frozen base of the current round (flat length floats), or NULL. */
const float *peer_service_avg_base(peer_service *s, int i);
/* Publishes our reduced part (copied) for the others to pull. */
int peer_service_avg_reduced(peer_service *s, int i, const float *part);
/* Marks the round failed here: others asking get ECANCELED. */
void peer_service_avg_fail(peer_service *s, int i, int err);
/* Applies the round's result (the whole averaged flat vector) as one new
 * weight version, keeping the updates made since the base was frozen
 * (expert_block_flat_apply); with_optim == 0 moves the parameters only.
 * The samples counted for the next round's weight start at the base.
 * Returns 0 or expert_block_flat_apply's error (block unchanged). */
int peer_service_avg_apply(peer_service *s, int i, const float *avg, int with_optim, double *dist_before,
                           double *dist_after);
/* Frees the round's buffers (others still asking then get ESTALE). */
void peer_service_avg_release(peer_service *s, int i);

/* Called on the loop thread when another member asks block i about
 * averaging round `round` that has not begun here, or names another group
 * for the round we are in (the answer is EAGAIN): the members' views of
 * the group differ, so the owner should look at the group again. */
typedef void (*peer_service_avg_hook)(void *arg, int block, uint64_t round);
void peer_service_set_avg_hook(peer_service *s, peer_service_avg_hook fn, void *arg);

/* ---- Methods served by other modules ----
 *
 * The service computes info, forward, backward and infer itself. Every
 * other method goes to the handler registered for it (state downloads:
 * peer/statesync.h; averaging rounds: peer/allreduce.h); a method with no
 * handler is answered ENOSYS ("unknown method"), and every method is
 * answered ESHUTDOWN once the service is closing.
 *
 * The handler runs on the loop thread. block is the index of the hosted
 * block msg->block names, or -1 when this service hosts no such block. msg
 * (and its tensors) is borrowed: valid until req is answered. The handler
 * returns 0 when it takes the request: it then answers req exactly once
 * (peer_rpc_respond / peer_rpc_respond_error), before returning or later
 * on the loop thread. It returns -ENOENT, without answering, when it has
 * nothing for that block: the service answers ENOENT ("block '...' is not
 * hosted by this peer"). It may use the service's loop-thread calls below
 * (block info, peer_service_block), but not close or destroy it. */
#define PEER_SERVICE_MAX_METHODS 16
typedef int (*peer_service_handler)(void *ctx, peer_rpc_request *req, const peer_msg *msg, int block);

/* Hands requests of `method` to fn with ctx (fn NULL: none). The service
 * owns the registration: release (may be NULL) is called with ctx once fn
 * is no longer called, that is when another handler replaces it or in
 * peer_service_destroy. Returns 0, or -EINVAL for a method the service
 * computes itself or out of range (release is then not called). Loop
 * thread. */
int peer_service_set_handler(peer_service *s, peer_method method, peer_service_handler fn, void *ctx,
                             void (*release)(void *ctx));

/* Cold copies (peer/keeper.h): a state request naming a block this
 * service does not host asks fn, which returns 0 with the serialized state
 * (borrowed: valid until control returns to the loop), its id (non-zero,
 * new whenever the copy is replaced) and weight version, or a negative
 * errno when it keeps no copy (the request then gets ENOENT). Loop thread. */
typedef int (*peer_service_cold_fn)(void *arg, const char *block, const uint8_t **buf, size_t *len,
                                    uint64_t *id, uint64_t *version);
void peer_service_set_cold_source(peer_service *s, peer_service_cold_fn fn, void *arg);

/* Writes every block's checkpoint now (atomically; blocks the caller for the
 * time of the writes), then removes any temporary file of the blocks' that a
 * write in this process or a killed one left. Returns 0 or the first error.
 * Runs on a worker thread too (periodic checkpoints), never two at once. */
int peer_service_checkpoint(peer_service *s);

/* Graceful stop: closes the RPC server (requests already queued are
 * computed), stops the compute threads, writes the checkpoints, then calls
 * cb on the loop. Idempotent. */
void peer_service_close(peer_service *s, void (*cb)(peer_service *, int ckpt_status, void *),
                        void *arg);

/* Frees a service whose close callback has run (or that never listened).
 * NULL-safe; sets *p = NULL. */
void peer_service_destroy(peer_service **p);

#endif
