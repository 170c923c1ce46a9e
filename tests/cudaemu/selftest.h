// tests/cudaemu/selftest.h: the emulator's self-test (selftest.cu).
#ifndef TESTS_CUDAEMU_SELFTEST_H
#define TESTS_CUDAEMU_SELFTEST_H

// Runs the checks of the emulator's semantics; prints one line per check
// and returns the number of failures.
int emu_selftest(void);

#endif
