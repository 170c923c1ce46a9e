/* expert/block_internal.h: what the checkpoint format (expert/serialize.c)
 * needs of a block beyond expert/block.h.
 *
 * Not public API: only files in expert/ include it. struct expert_block
 * stays private to expert/block.c; the format reads a block's state through
 * a locked view and replaces it in one call, so it never sees the weight
 * slots, the locks or the gradients.
 */
#ifndef EXPERT_BLOCK_INTERNAL_H
#define EXPERT_BLOCK_INTERNAL_H

#include <stdint.h>

#include "expert/block.h"

/* A block's state as a checkpoint records it. The pointers are views into
 * the block, valid until expert__block_state_unlock. */
struct expert__block_state {
    const float *params;   /* the current weights, expert_block_nparams floats */
    const float *m, *v;    /* optimizer state, as many floats each (SGD: m) */
    uint64_t version;      /* the weights' version */
    uint64_t steps;        /* optimizer steps taken */
    int optim_kind;        /* enum expert_optim_kind; 0 before the first step */
    const char *model;     /* expert_block_set_stage's model name, "" when none */
    const char *stage;     /* its stage name, "" when none */
    uint64_t stage_hash;   /* its stage hash, 0 when none */
};

/* Fills *out with b's state and holds it still: every call that takes the
 * block's gradient lock (backward, step, load, parameter updates) waits
 * until expert__block_state_unlock; forwards go on. Not re-entrant: call
 * none of b's functions in between. */
void expert__block_state_lock(expert_block *b, struct expert__block_state *out);
void expert__block_state_unlock(expert_block *b);

/* The model name given by expert_block_set_stage ("" when none; static for
 * the block's life, like expert_block_stage). */
const char *expert__block_model(const expert_block *b);

/* Replaces b's state: params (expert_block_nparams floats, any alignment;
 * read only) become the current weights, as version; with m and v (as
 * many floats each) the optimizer state, at steps and optim_kind, or with
 * m and v NULL a fresh optimizer (zero state, no steps). Gradients
 * accumulated so far are dropped. Waits for readers of the spare weight
 * slot; cannot fail. */
void expert__block_restore(expert_block *b, const void *params, const void *m, const void *v,
                           uint64_t version, uint64_t steps, int optim_kind);

#endif
