/* expert/hfweights.h: a model's weights under Hugging Face's names, in
 * safetensors files (expert/safetensors.h).
 *
 * GPT-style models (the embed, decoder and lm_head kinds) take GPT-2's
 * names (transformers' GPT2LMHeadModel), layers numbered across the whole
 * model (a stage's first decoder layer is the number of decoder layers in
 * the stages before it):
 *
 *   block tensor        name                                 stored as
 *   tok_emb [V,d]       transformer.wte.weight               [V,d]
 *   pos_emb [T,d]       transformer.wpe.weight               [T,d]
 *   ln1_w, ln1_b        transformer.h.L.ln_1.weight, .bias   [d]
 *   qkv_w [3d,d], qkv_b transformer.h.L.attn.c_attn.weight   [d,3d] (Conv1D:
 *                       (.bias [3d])                         transposed)
 *   proj_w, proj_b      transformer.h.L.attn.c_proj.*        [d,d] transposed
 *   ln2_w, ln2_b        transformer.h.L.ln_2.*               [d]
 *   fc1_w [h,d], fc1_b  transformer.h.L.mlp.c_fc.*           [d,h] transposed
 *   fc2_w [d,h], fc2_b  transformer.h.L.mlp.c_proj.*         [h,d] transposed
 *   lnf_w, lnf_b        transformer.ln_f.weight, .bias       [d]
 *   head_w [V,d]        lm_head.weight                       [V,d]
 *   head_b [V]          lm_head.bias                         [V]
 *
 * Reading also takes the names without "transformer." (the layout of
 * OpenAI's GPT-2 files); a file without lm_head.weight (GPT-2 ties the head
 * to the token embedding) gives the head transformer.wte.weight, and one
 * without lm_head.bias a zero bias; both are said in the note. GPT-2's own
 * activation is the tanh approximation of GELU and these blocks compute
 * the exact one, so GPT-2's released weights load but compute slightly
 * different activations. The MLP kinds (linear, resffn, head) have no
 * Hugging Face names.
 *
 * Thread-safe: no shared state.
 */
#ifndef EXPERT_HFWEIGHTS_H
#define EXPERT_HFWEIGHTS_H

#include <stddef.h>

#include "expert/block.h"
#include "expert/model.h"

#define EXPERT_HF_NAME_MAX 96

/* The Hugging Face name of tensor ti (an index into the stage's
 * expert_block_config_tensors list) of stage `index` of m into name, and in
 * *transposed whether it is stored transposed. Returns 0, -ENOENT for a
 * kind without names, -EINVAL for a bad stage or tensor index. */
int expert_hf_name(const struct expert_model_spec *m, int index, int ti, char *name, size_t len, int *transposed);

/* Loads stage `index` of m from the safetensors file at path, under the
 * names above: reads only that stage's tensors (any dtype the reader takes,
 * to f32), checks each one's shape and that every value is finite, and
 * installs them as a new weight version (expert_block_set_params); b must
 * be a block of that stage's config. Returns 0 (with a note in note, or
 * note[0] = 0, when a fallback above was taken), or -errno with a sentence
 * naming the file and the tensor in msg: -ENOENT (no such file or a
 * tensor missing), -EBADMSG (a malformed file, a wrong shape, a value not
 * finite), -EINVAL (a kind without names, b not of the stage), -ENOMEM. */
int expert_block_load_safetensors(expert_block *b, const struct expert_model_spec *m, int index, const char *path,
                                  char *msg, size_t msglen, char *note, size_t notelen);

/* Writes the whole of m's weights to path as a safetensors file under the
 * names above (F32, the stages' tensors in order; Conv1D weights
 * transposed): params[s] holds stage s's parameters (its
 * expert_block_config_tensors order, expert_block_nparams floats), meta
 * n_meta key/value pairs for "__metadata__". Returns 0, or -EINVAL (a kind
 * without names) or the writer's -errno, with a sentence in msg. */
int expert_hf_write(const struct expert_model_spec *m, const float *const *params, const char *path,
                    const char *const *meta, int n_meta, char *msg, size_t msglen);

/* m's transformers configuration (config.json: GPT2Config for
 * GPT2LMHeadModel, exact GELU, no dropout), as pretty JSON text with a
 * final newline (malloc'd; the caller frees it), or NULL for a kind without
 * names or no memory. */
char *expert_hf_config_json(const struct expert_model_spec *m);

#endif
