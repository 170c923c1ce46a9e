/* expert/expert.h: the public face of the math layer.
 *
 * expert/ does no networking and knows nothing of dht/. It holds tensors,
 * layers, blocks, optimizers, the checkpoint format and the CPU backend;
 * cuda/ implements the same backend interface on the GPU. See docs/expert.md.
 *   expert/blas.h   OpenBLAS threads and kernel family
 *   expert/ops.h    the backend interface (ops with _forward/_backward)
 *   expert/optim.h  AdamW, SGD with momentum
 *   expert/guard.h  gradient norm bounds from a block's own history
 *   expert/block.h  blocks: params/grads/state, snapshots, steps, checkpoints
 *   expert/model.h  named models and their stages
 */
#ifndef EXPERT_EXPERT_H
#define EXPERT_EXPERT_H

#include "expert/blas.h"
#include "expert/guard.h"
#include "expert/block.h"
#include "expert/model.h"
#include "expert/ops.h"
#include "expert/optim.h"

#endif
