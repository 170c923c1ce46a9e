// tests/cudaemu/include/cuda_runtime.h: the emulator stands in for the CUDA
// runtime when cuda/common.cuh is compiled for tests/cudaemu.
#ifndef TESTS_CUDAEMU_CUDA_RUNTIME_H
#define TESTS_CUDAEMU_CUDA_RUNTIME_H
#include "emu.h"
#endif
