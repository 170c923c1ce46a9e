/* expert/block_internal.h: the block runtime's structs and the calls its
 * files share (internal; only expert/ includes it).
 *
 * The runtime is three files: expert/block.c (creation, weight slots and
 * snapshots, the forward and backward drivers, stage identity),
 * expert/workspace.c (per-thread activations and kept rows) and
 * expert/trainstate.c (gradients, optimizer state, guard and health: the
 * steps, flat export and apply). The checkpoint format (expert/serialize.c)
 * reads a block's state through a locked host view and replaces it in one
 * call, so it never sees the slots, the locks or the gradients.
 */
#ifndef EXPERT_BLOCK_INTERNAL_H
#define EXPERT_BLOCK_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "expert/backend.h"
#include "expert/block.h"
#include "expert/kinds_internal.h"

struct expert_block {
    struct expert_block_config cfg;
    struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
    int nt;
    size_t n;              /* floats per parameter set */
    const expert_backend *be;

    /* Backend memory. */
    float *params;         /* 2*n: slot 0 then slot 1 */
    uint16_t *params16;    /* 2*n: each slot as bf16 (bf16 precision), else NULL */
    float *grads;          /* n */
    float *m;              /* n: AdamW first moment / SGD momentum */
    float *v;              /* n: AdamW second moment */

    /* Snapshot state, under mu. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int cur;
    int refs[2];
    uint64_t slot_version[2]; /* the weight version each slot holds */
    int slot_valid[2];
    uint64_t version;

    /* Gradient / optimizer state, under grad_mu (taken before mu). */
    pthread_mutex_t grad_mu;
    int accum;
    uint64_t steps;
    int optim_kind;        /* 0 until the first step */
    uint64_t dropped_steps; /* steps refused (expert_block_step) */
    struct expert_guard_config guard_cfg; /* resolved */
    struct expert_guard guard;  /* accepted step gradient norms */

    /* DiLoCo's outer state (expert_block_outer_lock), host memory, under
     * outer_mu (taken before grad_mu): anchor, momentum, residual. */
    pthread_mutex_t outer_mu;
    float *outer;          /* 3*n, or NULL while the block has none */

    /* Health of the steps (expert_block_health), under health_mu: a leaf
     * lock, so a reader never waits for a backward that holds grad_mu. */
    pthread_mutex_t health_mu;
    struct expert_block_health health;

    /* Stage identity (expert_block_set_stage): "" / 0 when none. */
    char model[EXPERT_CKPT_NAME_LEN];
    char stage[EXPERT_CKPT_NAME_LEN];
    uint64_t stage_hash;
};

struct expert_workspace {
    struct expert_block_config cfg;
    const expert_backend *be;
    int max_batch;
    float *buf;            /* backend memory: the views below, then the staging */
    struct expert__ffn_ws ffn;  /* LINEAR, RESFFN, HEAD (expert/ffnws.c) */
    struct expert__seq_ws *seq; /* the transformer kinds' views (expert/seqws.c); NULL otherwise */
    /* Where a call's host tensors are staged on a backend without host
     * memory (NULL on the CPU): input, output, output gradient, input
     * gradient, max_batch rows each. */
    float *d_in, *d_out, *d_dout, *d_dinp;
};

/* ---- weight slots (expert/block.c), for writers holding grad_mu ---- */

/* The spare slot's weights, once no reader pins it (waits). */
float *expert__spare_begin(expert_block *b);
/* Publishes the spare slot (written since expert__spare_begin) as the
 * current weights at version: refreshes its bf16 copy when the block keeps
 * one and waits for the calling thread's queued work first, so readers on
 * other threads see it whole. Returns 0, or the backend's error (nothing
 * published). */
int expert__spare_publish(expert_block *b, uint64_t version);
/* The current slot's weights (cur cannot change under grad_mu). */
const float *expert__current_params(expert_block *b);

/* ---- the checkpoint format's view (expert/trainstate.c) ---- */

/* A block's state as a checkpoint records it, in host memory: views into
 * the block (the CPU) or copies (other backends), valid until
 * expert__block_state_unlock. */
struct expert__block_state {
    const float *params;   /* the current weights, expert_block_nparams floats */
    const float *m, *v;    /* optimizer state, as many floats each (SGD: m) */
    uint64_t version;      /* the weights' version */
    uint64_t steps;        /* optimizer steps taken */
    int optim_kind;        /* enum expert_optim_kind; 0 before the first step */
    const char *model;     /* expert_block_set_stage's model name, "" when none */
    const char *stage;     /* its stage name, "" when none */
    uint64_t stage_hash;   /* its stage hash, 0 when none */
    struct expert_guard guard; /* the history of the steps' gradient norms */
    const float *outer;    /* DiLoCo's anchor, momentum, residual (3 nparams floats), or NULL */
    float *copy_;          /* the host copy of a device block's state (internal) */
};

/* Fills *out with b's state and holds it still: every call that takes the
 * block's gradient lock (backward, step, load, parameter updates) or its
 * outer state waits until expert__block_state_unlock; forwards go on.
 * Not re-entrant: call none of b's functions in between. Returns 0, or
 * -ENOMEM / the backend's error (then nothing is held and unlock must not
 * be called). */
int expert__block_state_lock(expert_block *b, struct expert__block_state *out);
void expert__block_state_unlock(expert_block *b, struct expert__block_state *st);

/* 1 when the block has DiLoCo's outer state now (it may gain one at any
 * time: serialise sizes again under the state lock). */
int expert__block_has_outer(const expert_block *b);

/* The model name given by expert_block_set_stage ("" when none; static for
 * the block's life, like expert_block_stage). */
const char *expert__block_model(const expert_block *b);

/* The training state beyond the optimizer's moments that a checkpoint of
 * format 4 carries (expert/serialize.c). */
struct expert__train_extra {
    struct expert_guard guard; /* the steps' gradient norm history */
    const void *outer;         /* DiLoCo's anchor, momentum, residual (3 nparams floats,
                                  host memory, any alignment), or NULL: none */
};

/* Replaces b's state: params (expert_block_nparams floats, host memory, any
 * alignment; read only) become the current weights, as version; with m
 * and v (as many floats each) the optimizer state, at steps and
 * optim_kind, or with m and v NULL a fresh optimizer (zero state, no
 * steps). With extra, the guard's history and the outer state become
 * extra's (no outer state when extra->outer is NULL); without (an older
 * format), the guard starts afresh and the outer state is dropped.
 * Gradients accumulated so far are dropped. Waits for readers of the spare weight slot. Returns 0, or
 * the backend's error (then the weights are unchanged and the optimizer
 * state is reset). */
int expert__block_restore(expert_block *b, const void *params, const void *m, const void *v,
                          uint64_t version, uint64_t steps, int optim_kind,
                          const struct expert__train_extra *extra);

#endif
