/* expert/blockcfg.h: what a block is, as data: the kinds, their configs,
 * checks, config hashes, tensor lists, row shapes, FLOP counts and first
 * weights. Pure functions with no runtime state, so model specs
 * (expert/model.h), model files (expert/modelfile.h) and anyone who only
 * needs a block's shapes use them without the block runtime
 * (expert/block.h).
 *
 * Kinds (PyTorch equivalents in ../shared/bench/torch/common.py and
 * train_lm.py): see expert/block.h for what each computes and the order of
 * its parameter tensors.
 */
#ifndef EXPERT_BLOCKCFG_H
#define EXPERT_BLOCKCFG_H

#include <stddef.h>
#include <stdint.h>
enum expert_block_kind {
    EXPERT_BLOCK_LINEAR = 1,
    EXPERT_BLOCK_RESFFN = 2,
    EXPERT_BLOCK_HEAD = 3,
    EXPERT_BLOCK_EMBED = 4,
    EXPERT_BLOCK_DECODER = 5,
    EXPERT_BLOCK_LMHEAD = 6,
};

/* Decoder layers one stage may hold, and so its tensors: 2 + 12·layers + 4. */
#define EXPERT_BLOCK_MAX_LAYERS 16
#define EXPERT_BLOCK_MAX_TENSORS (6 + 12 * EXPERT_BLOCK_MAX_LAYERS)
#define EXPERT_TENSOR_NAME_LEN 24
/* Largest width a block accepts, so sizes stay far from int overflow. */
#define EXPERT_BLOCK_MAX_DIM (1 << 16)
/* Largest row (in, out) of a transformer kind: seq·dim or seq·vocab. */
#define EXPERT_BLOCK_MAX_ROW (1 << 22)
/* Largest context length and vocabulary of the transformer kinds. */
#define EXPERT_BLOCK_MAX_SEQ 4096
#define EXPERT_BLOCK_MAX_VOCAB (1 << 18)

struct expert_block_config {
    int kind;    /* enum expert_block_kind */
    int in;      /* input width of one row */
    int out;     /* output width of one row (RESFFN, DECODER: = in) */
    int hidden;  /* RESFFN, decoder layers: the MLP's hidden width; 0 otherwise */
    /* The transformer kinds only (0 for the others): */
    int dim;     /* model width d */
    int heads;   /* attention heads; dim % heads == 0 */
    int seq;     /* context length T: positions per row */
    int layers;  /* decoder layers in the stage (DECODER >= 1; EMBED, LMHEAD >= 0) */
    int vocab;   /* EMBED, LMHEAD: tokens; 0 for DECODER */
};

/* Which kinds are transformer kinds (rows are sequences). */
int expert_block_kind_is_seq(int kind);
/* The kind's name in model files ("linear", "resffn", "head", "embed",
 * "decoder", "lm_head"), or NULL for an unknown kind. */
const char *expert_block_kind_name(int kind);
/* The kind named name, or 0. */
int expert_block_kind_from_name(const char *name);

/* How a tensor's first values are drawn (torch's defaults). */
enum expert_tensor_init {
    EXPERT_INIT_FANIN = 0,  /* U(±1/√fan_in): Linear weights and biases */
    EXPERT_INIT_ONE = 1,    /* LayerNorm weights */
    EXPERT_INIT_ZERO = 2,   /* LayerNorm biases */
    EXPERT_INIT_NORMAL = 3, /* N(0, 1): embeddings */
};

/* One tensor of a block: a named view into the flat arrays. */
struct expert_tensor_info {
    const char *name;   /* static, e.g. "fc1_w" (repeats for each decoder layer) */
    size_t offset;      /* in floats, into params/grads/m/v */
    size_t count;
    int rows, cols;     /* cols = 1 for vectors */
    int init;           /* enum expert_tensor_init */
    int fan_in;         /* EXPERT_INIT_FANIN: the layer's input width */
};


/* -EINVAL for an unknown kind, dims out of [1, EXPERT_BLOCK_MAX_DIM], RESFFN
 * with in != out or hidden < 1, or hidden set on other kinds. Transformer
 * kinds: dim, hidden in [1, EXPERT_BLOCK_MAX_DIM], heads >= 1 dividing
 * dim, seq in [1, EXPERT_BLOCK_MAX_SEQ], layers in [0 (1 for DECODER),
 * EXPERT_BLOCK_MAX_LAYERS], vocab in [1, EXPERT_BLOCK_MAX_VOCAB] for EMBED
 * and LMHEAD (0 for DECODER), and in/out the widths the kind derives from
 * them (at most EXPERT_BLOCK_MAX_ROW). */
int expert_block_config_check(const struct expert_block_config *cfg);

/* Fills out[] (capacity EXPERT_BLOCK_MAX_TENSORS) with the tensor list and
 * returns its length, or -EINVAL. *total_out (may be NULL) = total floats. */
int expert_block_config_tensors(const struct expert_block_config *cfg,
                                struct expert_tensor_info *out, size_t *total_out);

/* 64-bit FNV-1a over the canonical encoding of the config (docs/expert.md):
 * "starling.block.v1", then kind, in, out, hidden as u32 little-endian, then
 * the fixed numerics (LN eps as f32 bits, GELU variant 1 = exact erf). The
 * transformer kinds use "starling.block.v2": kind, in, out, hidden, dim,
 * heads, seq, layers, vocab, then the numerics (LN eps, GELU variant 1,
 * attention variant 1 = causal, scale before the mask, learned absolute
 * positions). Stable across builds and machines; 0 for an invalid config. */
uint64_t expert_block_config_hash(const struct expert_block_config *cfg);

/* The shape of one row of a block's input (out == 0) or output (out != 0),
 * as the RPC carries it after the batch dimension: (in) or (out) for
 * LINEAR, RESFFN and HEAD; a transformer kind's row is a sequence: EMBED's
 * input (seq), LMHEAD's output (seq, vocab), the others (seq, dim). Writes
 * the dims into dims[0..1] and returns their count (1 or 2), or -EINVAL. */
int expert_block_row_shape(const struct expert_block_config *cfg, int out, uint64_t dims[2]);

/* Checks what only the values can say about B rows of input inp: for
 * EMBED every value must be a token, an integer in [0, vocab) (a forward
 * or backward refuses the whole call otherwise); the other kinds take any
 * floats. Returns 0, or -EINVAL with a sentence in why naming the first bad
 * value's row and position. Servers check each client's request with it
 * before joining requests into one batch. */
int expert_block_input_check(const struct expert_block_config *cfg, const float *inp, int B,
                             char *why, size_t why_len);

/* Matmul FLOPs of one forward over B samples (2·m·n·k); fwd+bwd is 3×. */
double expert_block_config_flops(const struct expert_block_config *cfg, int B);

/* Writes the first weights of a block of config cfg from seed into params
 * (the config's total floats, host memory) as PyTorch's defaults draw them
 * (Linear w and b ~ U(±1/√fan_in), LayerNorm w=1 b=0, embeddings N(0,1)),
 * from our own generator (splitmix64), so the same seed gives the same
 * weights on every machine. Returns 0 or -EINVAL. */
int expert_block_init_params(const struct expert_block_config *cfg, uint64_t seed, float *params);

#endif
