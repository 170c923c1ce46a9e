/* expert/model.h: named models as ordered lists of stages.
 *
 * A stage is one block with a fixed config, named "<model>.<index>"
 * (e.g. "fmnist-mlp.3"); every parameterised stage can live on a peer, and
 * trainers/inference clients keep only the data and the loss.
 *
 * fmnist-mlp (= ../shared/bench/torch/common.py build_model(), 8 811 018
 * parameters):
 *   .0  LINEAR  784 -> 512
 *   .1  RESFFN  d 512, hidden 2048      .2, .3, .4 the same
 *   .5  HEAD    LN(512) + Linear 512 -> 10
 *   loss (trainer): softmax cross-entropy over 10 classes
 * tiny-lm (= ../shared train_lm.py's default GPT, 4 903 168 parameters):
 *   .0  EMBED    tokens + positions, 2 decoder layers (d 256, 8 heads,
 *                hidden 1024, context 128, vocabulary 256)
 *   .1  DECODER  2 layers     .2  LMHEAD  2 layers + LN + Linear 256 -> 256
 *   loss (trainer): next-byte cross-entropy at every position
 *
 * Besides the built-ins, models described by model files
 * (expert/modelfile.h, docs/models.md) can be registered at run time
 * (expert_model_register); expert_model_find, expert_model_at and
 * expert_stage_parse see them as they see the built-ins. Registered specs
 * are never freed or moved: a pointer these functions return is valid until
 * the process exits. Every function here is thread-safe.
 */
#ifndef EXPERT_MODEL_H
#define EXPERT_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "expert/blockcfg.h"

#define EXPERT_STAGE_NAME_MAX 64

/* What the trainer feeds the model and how it scores the output. */
enum expert_task {
    EXPERT_TASK_CLASSES = 0,  /* images (n_in pixels) -> one of n_out classes */
    EXPERT_TASK_BYTES = 1,    /* byte-level language model: a row is seq tokens,
                                 the output seq·vocab logits, the loss the mean
                                 cross-entropy of the next byte at every position */
};

struct expert_model_spec {
    const char *name;
    const char *desc;
    int n_stages;
    const struct expert_block_config *stages;   /* n_stages entries */
    int n_in, n_out;                            /* model input/output widths (per row) */
    int task;                                   /* enum expert_task */
    int seq, vocab;                             /* EXPERT_TASK_BYTES: context, vocabulary */
    int batch;                                  /* rows per optimizer step a trainer and
                                                   the peers use by default (0: theirs) */
    int max_batch;                              /* largest batch a peer should join, rows
                                                   (0: the peer's default) */
};

/* The model called name (built in or registered), or NULL. */
const struct expert_model_spec *expert_model_find(const char *name);
/* The i-th known model (0-based: the built-ins, then the registered models in
 * the order they were registered), or NULL past the end. */
const struct expert_model_spec *expert_model_at(int i);

/* Models that may be registered in one process. */
#define EXPERT_MODEL_REGISTRY_MAX 256

/* Registers a model (from expert_model_parse/expert_model_load_file) so the
 * functions above find it by name. Takes ownership of owned in every case:
 * do not use or free it after the call; look the model up with
 * expert_model_find(name) (copy the name first). Returns 0 (registered),
 * 1 (a model with this name and the same canonical JSON, built in or
 * registered, is already there: owned was freed, the existing one stays),
 * -EEXIST (the name is taken by another definition), -EINVAL (owned is not a
 * valid model), -ENOSPC (EXPERT_MODEL_REGISTRY_MAX reached), -ENOMEM; on
 * failure a sentence in err (may be NULL). */
int expert_model_register(struct expert_model_spec *owned, char *err, size_t errlen);

/* Stage index's config into *cfg_out. -EINVAL / -ENOENT (index out of range). */
int expert_model_stage(const struct expert_model_spec *m, int index,
                       struct expert_block_config *cfg_out);

/* Parses "<model>.<index>" (index decimal, no sign, no leading zeros except
 * "0"). -EINVAL for a malformed id, -ENOENT for an unknown model or index. */
int expert_stage_parse(const char *id, const struct expert_model_spec **model_out,
                       int *index_out);
/* Writes "<model>.<index>" into buf. Returns its length or -ENOSPC/-EINVAL. */
int expert_stage_name(char *buf, size_t len, const struct expert_model_spec *m, int index);

/* Stage hash: 64-bit FNV-1a over "starling.stage.v1", the model name, a NUL,
 * the index as u32 LE, then the block config hash as u64 LE. Two peers that
 * agree on it run the same computation for the same stage. 0 if invalid. */
uint64_t expert_stage_hash(const struct expert_model_spec *m, int index);
/* The same hash from its parts: a model name, a stage index and that stage's
 * expert_block_config_hash (checkpoints verify the stage they record with
 * it, whether or not this build knows the model). 0 if invalid. */
uint64_t expert_stage_hash_of(const char *model, int index, uint64_t block_hash);

/* Per-stage init seed from a model seed (splitmix64 of seed and index), so a
 * whole model is reproducible from one number. */
uint64_t expert_stage_seed(uint64_t model_seed, int index);

/* Matmul FLOPs of one forward of the whole model per sample. */
double expert_model_flops_per_sample(const struct expert_model_spec *m);

#endif
