// tests/cudaemu/emu_ctx.h: knobs of the emulated cuda/context.cu (emu_ctx.cc).
#ifndef TESTS_CUDAEMU_EMU_CTX_H
#define TESTS_CUDAEMU_EMU_CTX_H

// on != 0: cuda__context() returns NULL (no usable device), so every op
// reports -ENODEV.
void emu_ctx_set_no_device(int on);

#endif
