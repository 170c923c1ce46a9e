/* peer/service.h: the blocks a peer serves, behind the tensor RPC.
 *
 * A service hosts some stages of one model. For each it keeps an expert
 * block (restored from its checkpoint when one exists), a batcher (compute
 * threads, joined batches, backpressure, optimizer steps) and a pool of
 * request contexts with output buffers, so steady traffic allocates nothing.
 * The RPC server (net/rpc_server.h) hands requests to the service on the
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
 * (meta) describing the hosted blocks. Other methods (state downloads,
 * averaging rounds) go to handlers that other modules register (see
 * "Methods served by other modules" below).
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
#include "expert/backend.h"
#include "expert/guard.h"
#include "expert/optim.h"
#include "peer/batcher.h"
#include "net/rpc_server.h"

#define PEER_SERVICE_MAX_BLOCKS 64
/* The largest tensor a handler answers with (a state chunk, peer/statesync.h;
 * an averaging slice, peer/allreduce.h): the RPC frames are sized for it. */
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
    const char *init_weights;     /* NULL, or a weight file of the whole model: a
                                     "*.safetensors" file under Hugging Face's names
                                     (expert/hfweights.h), else a flat file
                                     (expert_block_load_flat); the blocks start from
                                     their part of it instead of the seed's weights
                                     (a checkpoint, when there is one, still wins) */
    /* Limits of the RPC server against hostile clients (peer_rpc_server_config,
     * docs/rpc.md "Limits"); 0 takes the server's default. */
    int rpc_max_conns;            /* connections in all (1024) */
    int rpc_max_conns_per_ip;     /* per IPv4 address or IPv6 /64 (64) */
    int rpc_max_handshakes;       /* unfinished handshakes (64) */
    uint64_t rpc_idle_timeout_ms; /* established connection with nothing happening (120000) */
    uint32_t formats;             /* tensor formats accepted from clients (peer_fmt_mask,
                                     net/tensorfmt.h); 0: all. float32 always */
    const expert_backend *backend; /* where the blocks live and compute (peer/device.h);
                                     NULL: the CPU. Before a block is created its
                                     memory is checked against the device's free
                                     memory (a stage that does not fit is refused
                                     with a sentence naming the bytes) */
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
    int has_state;                /* not its initial weights: restored, installed, averaged
                                     (peer_service_note_state) or stepped (version > 0) */
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

/* The number of blocks hosted. */
int peer_service_n_blocks(const peer_service *s);
/* Fills info for hosted block i. Returns 0 or -EINVAL. */
int peer_service_block_info(peer_service *s, int i, peer_block_info *info);

/* The RPC server's counters and gauges (connections refused and closed by
 * the limits, bytes held; peer_rpc_server_stats). s NULL: all zero. Loop
 * thread. */
void peer_service_get_rpc_stats(const peer_service *s, peer_rpc_server_stats *out);

/* Tensor bytes of the compute methods: method 0 forward, 1 backward, 2
 * infer; fmt a peer_fmt; dir 0 received in requests, 1 sent in replies.
 * Any thread. */
#define PEER_SERVICE_TRAFFIC_METHODS 3
uint64_t peer_service_tensor_bytes(const peer_service *s, int method, int fmt, int dir);
/* All those bytes divided by the rows served (forward, backward, infer)
 * of every hosted block; 0 before the first. Loop thread. */
double peer_service_bytes_per_sample(peer_service *s);
/* The accepted formats (peer_fmt_mask). */
uint32_t peer_service_formats(const peer_service *s);

/* Installs serialized state (from a donor's PEER_METHOD_STATE download) into
 * hosted block i. Returns 0, -EINVAL, or expert_block_deserialize's error
 * (-EBADMSG corrupt, -ESTALE another configuration or another stage: the
 * state records its stage, checkpoint format 2); the block is unchanged on
 * error. Loop thread. */
int peer_service_install_state(peer_service *s, int i, const void *buf, size_t len);

/* Block i's expert block, borrowed until the service is destroyed (NULL
 * for a bad index). Its compute threads use it meanwhile: callers use only
 * the calls that are safe beside them (serialize, flat export and apply,
 * version). Loop thread. */
struct expert_block;
struct expert_block *peer_service_block(peer_service *s, int i);

/* Records that block i's state was replaced from elsewhere (an averaging
 * round applied): peer_block_info.has_state is then set. Loop thread. */
void peer_service_note_state(peer_service *s, int i);

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
 * hosted by this peer"); any other negative errno, without answering: the
 * service answers with that error. It may use the service's loop-thread calls below
 * (block info, peer_service_block), but not close or destroy it. */
#define PEER_SERVICE_MAX_METHODS 16
typedef int (*peer_service_handler)(void *ctx, peer_rpc_request *req, const peer_msg *msg, int block);

/* Hands requests of `method` to fn with ctx (fn NULL: none). The service
 * owns the registration: release (may be NULL) is called with ctx once fn
 * is no longer called, that is when another handler replaces it or in
 * peer_service_destroy; a handler that answers later must have answered
 * every request it took before it is replaced (both handlers in the tree
 * answer before returning). Returns 0, or -EINVAL for a method the service
 * computes itself or out of range (release is then not called). Loop
 * thread. */
int peer_service_set_handler(peer_service *s, peer_method method, peer_service_handler fn, void *ctx,
                             void (*release)(void *ctx));

/* Writes every block's checkpoint now (atomically; blocks the caller for the
 * time of the writes), then removes any temporary file of the blocks' that a
 * write in this process or a killed one left. Returns 0 or the first error.
 * Runs on a worker thread too (periodic checkpoints), never two at once. */
int peer_service_checkpoint(peer_service *s);

/* Graceful stop: closes the RPC server (requests already queued are
 * computed), stops the compute threads, writes the checkpoints, then calls
 * cb on the loop. Idempotent. */
void peer_service_stop(peer_service *s, void (*cb)(peer_service *, int ckpt_status, void *),
                        void *arg);

/* Frees a service whose close callback has run (or that never listened).
 * NULL-safe; sets *p = NULL. */
void peer_service_destroy(peer_service **p);

#endif
