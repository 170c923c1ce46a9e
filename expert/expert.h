/* expert/expert.h: the public face of the math layer.
 *
 * expert/ does no networking and knows nothing of dht/. It holds tensors,
 * layers, blocks, optimizers, the checkpoint format and the CPU backend;
 * cuda/ implements the same backend interface on the GPU.
 */
#ifndef EXPERT_EXPERT_H
#define EXPERT_EXPERT_H

#include "expert/blas.h"

#endif
