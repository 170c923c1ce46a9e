/* expert/block.h: the model blocks a peer serves (one block = one stage).
 *
 * Kinds (PyTorch equivalents in ../shared/bench/torch/common.py and
 * train_lm.py):
 *   LINEAR  y = x·Wᵀ + b                                  nn.Linear(in, out)
 *   RESFFN  y = x + W2·gelu(W1·LN(x) + b1) + b2            ResFFN(d, hidden), in = out = d
 *   HEAD    y = W·LN(x) + b                                Head(in, out)
 * and the transformer kinds, whose row is one sequence of `seq` positions
 * (a tensor [batch, seq, d] between stages is (batch, seq·d) rows here):
 *   EMBED   tokens (seq, as floats) -> tok_emb[x] + pos_emb, then `layers`
 *           decoder layers; in = seq, out = seq·dim
 *   DECODER `layers` (>= 1) pre-LN decoder layers; in = out = seq·dim
 *   LMHEAD  `layers` decoder layers, then LN + Linear(dim, vocab);
 *           in = seq·dim, out = seq·vocab (logits per position)
 *   A decoder layer (train_lm.py's Block): x += proj(attn(LN1(x)));
 *   x += fc2(gelu(fc1(LN2(x)))), causal multi-head attention over a fused
 *   qkv, fc1 dim -> hidden (train_lm.py: 4·dim).
 * Parameter tensors, in order (the order of torch's state_dict):
 *   LINEAR  w (out,in), b (out)
 *   RESFFN  ln_w (d), ln_b (d), fc1_w (hidden,d), fc1_b (hidden), fc2_w (d,hidden), fc2_b (d)
 *   HEAD    ln_w (in), ln_b (in), fc_w (out,in), fc_b (out)
 *   EMBED   tok_emb (vocab,dim), pos_emb (seq,dim), then per layer:
 *   layer   ln1_w, ln1_b (dim), qkv_w (3dim,dim), qkv_b (3dim), proj_w (dim,dim),
 *           proj_b (dim), ln2_w, ln2_b (dim), fc1_w (hidden,dim), fc1_b (hidden),
 *           fc2_w (dim,hidden), fc2_b (dim)
 *   DECODER per layer as above
 *   LMHEAD  per layer as above, then lnf_w, lnf_b (dim), head_w (vocab,dim), head_b (vocab)
 * A block's parameters, gradients, first and second optimizer moments are one
 * allocation each, with the tensors above as views at fixed offsets
 * (expert_block_tensors()). Parameters are double-buffered: see "Snapshots".
 *
 * Activations live in an expert_workspace, one per calling thread, sized for
 * a maximum batch; forward and backward allocate nothing.
 *
 * Backward is stateless between calls: it takes the same input the forward
 * took, recomputes the forward into the workspace and then back-propagates,
 * so a server need not keep activations between a forward and a backward.
 * Parameter gradients ACCUMULATE (sum over samples, +=) until a step; the
 * input gradient is WRITTEN (=).
 *
 * Snapshots and threads. Parameters live in two slots. Readers (forward,
 * backward, serialise) pin the current slot with a reference count; a step
 * writes the new weights into the other slot (reading the current one, so no
 * copy is needed), waiting first until no reader still pins that older
 * slot, then publishes it as current and bumps the weight version. So any
 * number of threads may run forwards concurrently with a step; each forward
 * sees one consistent version and never blocks on the step; a step waits at
 * most for forwards that started two versions ago. Gradients and optimizer
 * state are single-buffered and guarded by a mutex: backward, step, load and
 * serialise exclude each other (backwards on one block are serialised; BLAS
 * threads parallelise each one). All functions on one block are thread-safe
 * except expert_block_destroy. A thread must not hold a snapshot pin while
 * it calls step/load/set_params on the same block: the second such call
 * would wait for its own pin.
 */
#ifndef EXPERT_BLOCK_H
#define EXPERT_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#include "expert/backend.h"
#include "expert/blockcfg.h"
#include "expert/guard.h"
#include "expert/optim.h"

typedef struct expert_block expert_block;
typedef struct expert_workspace expert_workspace;

/* Creates a block with parameters initialised from seed as PyTorch's
 * defaults draw them (Linear w and b ~ U(±1/√fan_in), LayerNorm w=1 b=0),
 * from our own generator (splitmix64), so the same seed gives the same
 * weights on every machine. Gradients and optimizer state start at zero,
 * weight version 0. Returns NULL on a bad config or out of memory. */
expert_block *expert_block_create(const struct expert_block_config *cfg, uint64_t seed);
/* The same on backend be (expert/backend.h): the block's weights,
 * gradients and optimizer state are be's memory, and every forward,
 * backward and step computes on be. The same seed gives the same first
 * weights on every backend (they are drawn on the host, then uploaded).
 * NULL also when be has not enough memory (expert_block_bytes says how
 * much it needs). */
expert_block *expert_block_create_on(const struct expert_block_config *cfg, uint64_t seed,
                                     const expert_backend *be);
/* The backend memory a block of config cfg takes on be: two weight slots,
 * gradients, two optimizer moments (5 floats per parameter), plus two bf16
 * copies of the weights in bf16 precision. 0 for a bad config. */
size_t expert_block_bytes(const struct expert_block_config *cfg, const expert_backend *be);

/* Frees the block; NULL-safe, sets *p = NULL. No call may be in flight. */
void expert_block_destroy(expert_block **p);

/* The block's configuration (borrowed: lives as long as b). */
const struct expert_block_config *expert_block_config(const expert_block *b);
/* The backend the block was created on. */
const expert_backend *expert_block_backend(const expert_block *b);
/* Tensor list (static per config) and count; total floats in *total_out. */
const struct expert_tensor_info *expert_block_tensors(const expert_block *b, int *n_out,
                                                      size_t *total_out);
/* The number of parameters (floats). */
size_t expert_block_nparams(const expert_block *b);

/* Workspace for one thread's forward/backward calls on blocks with this
 * config, for batches up to max_batch. Owned by the caller; destroy with
 * expert_workspace_destroy. NULL on bad arguments or out of memory. */
expert_workspace *expert_workspace_create(const struct expert_block_config *cfg,
                                          int max_batch);
/* The same on backend be, for blocks created on be (a block refuses a
 * workspace of another backend with -EINVAL). Its activations are be's
 * memory; on a backend without host memory it also stages each call's
 * host tensors (max_batch rows of input, output and their gradients). */
expert_workspace *expert_workspace_create_on(const struct expert_block_config *cfg,
                                             int max_batch, const expert_backend *be);
void expert_workspace_destroy(expert_workspace **p);
const expert_backend *expert_workspace_backend(const expert_workspace *ws);
/* The backend memory expert_workspace_create_on takes (0 for bad arguments). */
size_t expert_workspace_bytes(const struct expert_block_config *cfg, const expert_backend *be,
                              int max_batch);

/* A pinned weight version. params points at the slot's flat parameters
 * (read-only, expert_block_nparams floats, memory of the block's backend:
 * host code may read it only on the CPU backend), valid until release. */
struct expert_snapshot {
    const float *params;
    uint64_t version;
    int slot;
};
/* Pins the current weights. Never blocks on a step. Each acquire must be
 * paired with exactly one release; keep pins short (a step waits for them). */
void expert_block_snapshot_acquire(expert_block *b, struct expert_snapshot *s);
void expert_block_snapshot_release(expert_block *b, struct expert_snapshot *s);

/* Copies the current weights (nparams floats) into out (host memory), in
 * one consistent version (*version_out, may be NULL). Returns 0, -EINVAL
 * or the backend's error. */
int expert_block_read_params(expert_block *b, float *out, uint64_t *version_out);

/* The current weight version: 0 after create, +1 per step or load. */
uint64_t expert_block_version(expert_block *b);

/* out (B,out) = block(inp (B,in)) on the current weights (or on snapshot s
 * for the _snapshot variant, which the caller pinned). out must not alias
 * inp. 1 <= B <= the
 * workspace's max batch; the workspace must match the config. Inference
 * only: touches no gradient. *version_out (may be NULL) = version used.
 * Returns 0, -EINVAL. */
int expert_block_forward(expert_block *b, expert_workspace *ws, float *out,
                         const float *inp, int B, uint64_t *version_out);
int expert_block_forward_snapshot(expert_block *b, const struct expert_snapshot *s,
                                  expert_workspace *ws, float *out,
                                  const float *inp, int B);

/* Recomputes the forward on inp (B,in) with the current weights, then
 * back-propagates dout (B,out): dinp (B,in) = ∂/∂inp (=; may be NULL when
 * not needed, e.g. the first stage; EMBED's token inputs have no gradient:
 * it writes zeros), parameter grads += ∂/∂params, and the
 * accumulated sample count += B. dout is the gradient of a loss SUMMED over
 * samples; the step divides by the accumulated count. dinp must not alias
 * dout or inp. Returns 0, -EINVAL, -EOVERFLOW (over 2^30 samples pending). */
int expert_block_backward(expert_block *b, expert_workspace *ws, float *dinp,
                          const float *dout, const float *inp, int B,
                          uint64_t *version_out);

/* backward plus the forward's output: out (B,out) = block(inp) as well.
 * Exactly the work of a framework's forward+backward; the benchmark uses it. */
int expert_block_forward_backward(expert_block *b, expert_workspace *ws, float *out,
                                  float *dinp, const float *dout, const float *inp,
                                  int B, uint64_t *version_out);

/* "The current weights" for expert_block_backward_at. */
#define EXPERT_VERSION_CURRENT UINT64_MAX

/* As expert_block_forward_backward (out may be NULL), but recomputes the
 * forward on weight version at_version when the block still holds it (the
 * current one or the one before it: the two slots), so a backward whose
 * forward ran just before a step uses the same weights as that forward
 * (weight stashing); otherwise on the current weights. *version_out says
 * which version was used. */
int expert_block_backward_at(expert_block *b, expert_workspace *ws, float *out, float *dinp,
                             const float *dout, const float *inp, int B, uint64_t at_version,
                             uint64_t *version_out);

/* ---- Keeping a training forward's activations for its backward ----
 * A server that sees both halves of a training sample may skip the
 * backward's recompute: run the forward with expert_block_forward_train,
 * save the rows' activations out of the workspace (expert_workspace_save_rows),
 * and before the backward load them back (into any workspace of the same
 * config, at any row offset) and call expert_block_backward_kept with the
 * forward's weight version. The result is the backward of that version,
 * as expert_block_backward_at computes it, without the forward's first
 * matrix product, LayerNorm and GELU. */

/* As expert_block_forward, and the workspace keeps what a backward reads
 * (for RESFFN also gelu'), so the rows can be saved. */
int expert_block_forward_train(expert_block *b, expert_workspace *ws, float *out,
                               const float *inp, int B, uint64_t *version_out);

/* Floats per row that save_rows/load_rows move (0 for LINEAR: nothing to
 * keep; in + 2 for HEAD; in + 2 + 2·hidden for RESFFN; for the transformer
 * kinds every decoder layer's views (seq·(8·dim + 2·hidden + heads·seq + 4)
 * each), plus LMHEAD's final LN (seq·(2·dim + 2)); 0 for an EMBED without
 * layers). */
size_t expert_workspace_kept_floats(const expert_workspace *ws);
/* The same for a workspace of config cfg on backend be, without one (0
 * for bad arguments). */
size_t expert_kept_floats(const struct expert_block_config *cfg, const expert_backend *be);

/* Copies rows [row0, row0+rows) of the kept activations into dst
 * (rows · kept_floats floats, packed view by view), or back from src. dst
 * and src are memory of the workspace's backend (expert_backend_alloc:
 * kept activations stay on the device). Returns 0, -EINVAL (bad range) or
 * the backend's error. */
int expert_workspace_save_rows(const expert_workspace *ws, int row0, int rows, float *dst);
int expert_workspace_load_rows(expert_workspace *ws, int row0, int rows, const float *src);

/* As expert_block_backward_at(version), but takes the forward from the
 * workspace instead of recomputing it: ws must hold rows 0..B-1 of the
 * forward of inp on weight version `version`. Returns -ESTALE (nothing
 * changed) when the block no longer holds that version; the caller then
 * recomputes with expert_block_backward_at. */
int expert_block_backward_kept(expert_block *b, expert_workspace *ws, float *dinp,
                               const float *dout, const float *inp, int B, uint64_t version,
                               uint64_t *version_out);

/* ---- Tensors already on the device ----
 * The same calls with out, inp, dout and dinp in the block's backend
 * memory (expert_backend_alloc), so stages that follow each other on one
 * device pass activations without copies through the host; EMBED's input
 * (its tokens) is host memory all the same. On the CPU backend they are
 * the calls above. */

/* As expert_block_forward (keep: as expert_block_forward_train). */
int expert_block_forward_dev(expert_block *b, expert_workspace *ws, float *out, const float *inp,
                             int B, int keep, uint64_t *version_out);
/* version EXPERT_VERSION_CURRENT: as expert_block_backward (recomputes the
 * forward); otherwise as expert_block_backward_kept(version): the
 * workspace holds the forward of inp from expert_block_forward_dev(keep
 * 1) on that version (-ESTALE when the block no longer holds it). */
int expert_block_backward_dev(expert_block *b, expert_workspace *ws, float *dinp, const float *dout,
                              const float *inp, int B, uint64_t version, uint64_t *version_out);

/* Samples accumulated in the gradients since the last step. */
int expert_block_accumulated(expert_block *b);

struct expert_step_info {
    double grad_norm;     /* L2 norm of the averaged gradient, before clipping */
    uint64_t version;     /* the weight version published */
    int samples;          /* samples averaged into this step */
};

/* Applies one optimizer step using the gradients averaged over the
 * accumulated samples (clipped to o->clip_norm when > 0; the norm is this
 * block's own, since a peer holds one block), publishes the new weights as a
 * new version, zeroes the gradients and the sample count. Waits for readers
 * of the old spare slot. Returns 0, -EINVAL (bad optimizer config, or a
 * kind that differs from the block's earlier steps' state), -EAGAIN (no
 * samples accumulated), -ERANGE (refused: the accumulation is dropped, the
 * weights and version are unchanged, expert_block_dropped_steps() counts
 * it and expert_block_health() holds a sentence saying why). A step is
 * refused when the averaged gradient's norm is not finite or out of the
 * bounds of expert_block_set_guard (before it touches the optimizer
 * state), or when the update would make a weight or optimizer moment
 * non-finite (the new weights are discarded and the moments reset to
 * zero). info may be NULL. */
int expert_block_step(expert_block *b, const struct expert_optim *o,
                      struct expert_step_info *info);
/* Steps only when at least o->target_batch samples have accumulated.
 * Returns 1 if it stepped, 0 if not yet, or a negative errno. */
int expert_block_maybe_step(expert_block *b, const struct expert_optim *o,
                            struct expert_step_info *info);
/* Drops the accumulated gradients and sample count without stepping. */
void expert_block_zero_grad(expert_block *b);
/* Steps refused with -ERANGE since create. */
uint64_t expert_block_dropped_steps(expert_block *b);

/* The bounds every step's averaged gradient is checked against
 * (expert/guard.h; zero fields: defaults, which a new block has), and how
 * many steps that change no weight make the block count as frozen. The
 * history of accepted norms is kept. Returns 0 or -EINVAL. */
int expert_block_set_guard(expert_block *b, const struct expert_guard_config *c);

/* What the checks of the steps saw. */
struct expert_block_health {
    uint64_t refused_steps;   /* = expert_block_dropped_steps */
    uint64_t still_steps;     /* consecutive steps (the latest ones) that applied a non-zero
                                 gradient at lr > 0 and changed no weight (relative change
                                 <= EXPERT_GUARD_STILL_REL); 0 once a step moves them */
    int frozen;               /* still_steps >= the guard's frozen_steps */
    double last_change;       /* ‖Δp‖ / ‖p‖ of the latest step */
    double grad_ref;          /* reference norm of the averaged gradient (guard.h) */
    char last_refusal[192];   /* why the latest refused step was refused ("" if none) */
};
/* A consistent copy. Never waits for a backward or a step in progress. */
void expert_block_health(expert_block *b, struct expert_block_health *out);
/* Optimizer steps taken (the AdamW t). */
uint64_t expert_block_steps(expert_block *b);

/* Copies the current gradients (nparams floats) into out (host memory).
 * Test/diagnostic. Returns 0, -EINVAL or the backend's error. */
int expert_block_copy_grads(expert_block *b, float *out);
/* Replaces the parameters with params (nparams floats) as a new version. */
int expert_block_set_params(expert_block *b, const float *params);

/* Group averaging (an all-reduce among replicas, peer/allreduce.h) works on
 * a flat view of the block's state: parameters, then the first moment m,
 * then the second moment v (3 * nparams floats; m and v are zero before
 * the first optimizer step). */
size_t expert_block_flat_len(const expert_block *b);
/* Copies the current state into out (flat_len floats) in one consistent
 * piece (no optimizer step in between). Returns 0 or -EINVAL. */
int expert_block_flat_export(expert_block *b, float *out);
/* Applies the result of a round that started from `base` (this block's own
 * flat_export at the round's start): every element moves by (avg - base),
 * so the updates this block made while the round ran are kept. The second
 * moment is clamped at 0. with_optim == 0 moves the parameters only.
 * The parameters are published as a new weight version in one piece.
 * Returns 0, -EINVAL, or -ERANGE when any result is not finite (nothing
 * changes). *dist_before / *dist_after (may be NULL): the L2 distance of
 * the parameters to the group's average before (base) and after. */
int expert_block_flat_apply(expert_block *b, const float *avg, const float *base, int with_optim,
                            double *dist_before, double *dist_after);

/* DiLoCo's outer state (peer/allreduce.c, --average-mode diloco): the
 * anchor (the weights the last outer step reached), the outer optimizer's
 * momentum and the error-feedback residual of compressed rounds, n =
 * nparams floats each, in host memory. It belongs to the block's training
 * state, so checkpoints and state downloads carry it with the optimizer's
 * moments (checkpoint format 4), and a peer that restarts resumes its
 * outer steps where they were. */
struct expert_outer {
    float *anchor, *momentum, *residual;
    size_t n;
};
/* Locks the outer state and points out at it; create != 0 makes one (all
 * zero) when the block has none. Returns 0 (the caller must unlock), or
 * -ENOENT (none, and create == 0), -ENOMEM, -EINVAL, and then holds no
 * lock. The lock comes before the block's gradient lock: the holder may
 * call expert_block_flat_apply and the like, never the reverse. Keep it
 * short (checkpoints wait for it). */
int expert_block_outer_lock(expert_block *b, int create, struct expert_outer *out);
void expert_block_outer_unlock(expert_block *b);
/* Forgets the outer state (the next round takes a new anchor). */
void expert_block_outer_drop(expert_block *b);

/* ---- Stage identity ---- */

struct expert_model_spec;

/* Tells the block that it is stage `index` of model m (expert/model.h).
 * Serialised state and checkpoint files then record the model name, the
 * stage name ("<model>.<index>") and the stage hash, and deserialising or
 * loading refuses state that records another stage (-ESTALE). Call it once,
 * before the block is shared between threads. Returns 0, or -EINVAL when m
 * has no such stage or its config is not this block's. */
int expert_block_set_stage(expert_block *b, const struct expert_model_spec *m, int index);
/* The stage name set with expert_block_set_stage ("" when none; static for
 * the block's life) and, when stage_hash_out is not NULL, its hash (0). */
const char *expert_block_stage(const expert_block *b, uint64_t *stage_hash_out);

/* ---- Serialisation (the checkpoint file format; docs/expert.md; expert/serialize.c) ---- */

#define EXPERT_CKPT_FORMAT 4          /* the newest read: with optimizer state format 4 is
                                         written (it adds the guard's history and DiLoCo's
                                         outer state); without, format 2, or 3 for the
                                         transformer kinds; format 1 is still read */
#define EXPERT_CKPT_NAME_LEN 64       /* model and stage name fields, with the NUL */

/* What a checkpoint's header says (expert_ckpt_peek). */
struct expert_ckpt_info {
    uint32_t format;                  /* 1 to 4 */
    int with_outer;                   /* format 4: DiLoCo's outer state present */
    int with_optim;
    uint64_t config_hash;             /* expert_block_config_hash of cfg */
    struct expert_block_config cfg;
    uint64_t version;                 /* weight version */
    uint64_t steps;                   /* optimizer steps (0 without optimizer state) */
    uint64_t stage_hash;              /* expert_stage_hash; 0 when no stage is recorded */
    char model[EXPERT_CKPT_NAME_LEN]; /* "" when no stage is recorded (format 1, or */
    char stage[EXPERT_CKPT_NAME_LEN]; /*    a block without expert_block_set_stage) */
    size_t total_len;                 /* the length the whole state must have */
};

/* Reads the header at the start of buf (len bytes, at least the header's
 * length; the rest need not be there) into *out. It checks the header's
 * structure (magic, flags, dims, table length, name fields, and that the
 * stage hash is the hash of the recorded model, index and config), not the
 * checksum: use it to explain a refusal, never to trust the data. Returns 0,
 * -EBADMSG (not a well-formed header), -EPROTONOSUPPORT (another format
 * version; out->format holds it), -EINVAL. */
int expert_ckpt_peek(const void *buf, size_t len, struct expert_ckpt_info *out);
/* 0 when state with header *info may be loaded into b: same block config,
 * and, when both b (expert_block_set_stage) and the state name a stage, the
 * same stage. -ESTALE otherwise, -EINVAL. State that names no stage fits any
 * block of its config (the caller should warn: it may be another stage's). */
int expert_block_ckpt_fits(const expert_block *b, const struct expert_ckpt_info *info);

/* Bytes expert_block_serialize writes: with_optim != 0 adds the optimizer
 * state (AdamW m and v, or the SGD momentum buffer in m). */
size_t expert_block_serialized_size(const expert_block *b, int with_optim);
/* Writes the current version's parameters (and optimizer state) into buf,
 * in format EXPERT_CKPT_FORMAT, with the block's stage if it has one.
 * Returns the bytes written, or -ENOSPC if cap is too small, -EINVAL. */
long expert_block_serialize(expert_block *b, int with_optim, void *buf, size_t cap);
/* Loads bytes from expert_block_serialize (e.g. a newcomer's download, or a
 * file), formats 1 to 3: validates everything before touching the block,
 * then installs the parameters as the file's weight version and, if
 * present, the optimizer state and step count; gradients are zeroed. Never
 * trusts the input: -EBADMSG (truncated, bad magic, bad checksum, malformed
 * header or table), -EPROTONOSUPPORT (unknown format version), -ESTALE (the
 * config hash or dims are another block's, or the state records another
 * stage than b's: expert_block_ckpt_fits). On error the block is unchanged. */
int expert_block_deserialize(expert_block *b, const void *buf, size_t len);

/* Atomic checkpoint file: written to a temporary file "<path>.tmp.<pid>.XXXXXX"
 * in the same directory, locked (flock) while it is written, fsync'd, renamed
 * over path, then the directory fsync'd, so a crash leaves either the old
 * file or the new one, never a torn one (but maybe the temporary file:
 * expert_ckpt_clean_tmp). Returns 0 or -errno. */
int expert_block_save(expert_block *b, const char *path, int with_optim);
/* Reads and deserialises path. Errors as deserialize, plus -errno from I/O;
 * a file whose header names another block or stage is refused (-ESTALE)
 * without being read whole, a file of the wrong size for its header too
 * (-EBADMSG). When msg is not NULL it receives a sentence: on failure what
 * is wrong, naming the file and, for -ESTALE, what it holds and what b is
 * ("<path> holds fmnist-mlp.2 (stage hash ..), not fmnist-mlp.3 (..)"); on
 * success "" or a warning to show: the file records no stage (format 1),
 * so only its block config could be checked. */
int expert_block_load(expert_block *b, const char *path, char *msg, size_t msglen);

/* Loads stage `index` of model m from a flat weight file: every parameter of
 * the whole model, float32 little-endian, stage after stage, each stage's
 * tensors in order, nothing else (../shared/bench/torch/train_lm.py's
 * --save-init/--save-final files for a GPT of the same config are this).
 * The file must be exactly the model's size; the stage's slice must be
 * finite. Installs it as a new weight version (expert_block_set_params);
 * b must be a block of that stage's config. Returns 0, -errno (I/O),
 * -EBADMSG (wrong size, non-finite value) or -EINVAL, with a sentence in
 * msg naming the file on failure. */
int expert_block_load_flat(expert_block *b, const struct expert_model_spec *m, int index,
                           const char *path, char *msg, size_t msglen);

/* Files older than this with no live writer count as stale (below). */
#define EXPERT_CKPT_TMP_STALE_S 600

/* Removes the temporary files that saves of the checkpoint at path left
 * behind (a process killed while writing). Only files in path's directory
 * named "<basename>.tmp.<pid>.<6 chars>" are candidates, and only those no
 * process holds locked (a write in flight holds its lock) and whose writer is
 * gone: pid is ours, or no process has it (kill(pid, 0) fails with ESRCH), or
 * the file has not changed for EXPERT_CKPT_TMP_STALE_S seconds (another pid
 * namespace, or the pid reused). An older build's "<basename>.tmp.<6 chars>"
 * files are removed once they are that old. Call it when no save of path
 * runs in this process outside the lock (any time, in practice). Returns the
 * number of files removed, or -errno when the directory cannot be read;
 * *bytes_out (may be NULL) = their total size. */
int expert_ckpt_clean_tmp(const char *path, uint64_t *bytes_out);

#endif
