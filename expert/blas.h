/* expert/blas.h: the BLAS the CPU backend runs on (OpenBLAS).
 *
 * OpenBLAS chooses its kernel family when the library loads, from the CPU or
 * from $OPENBLAS_CORETYPE; these helpers report which one ran so benchmark
 * figures can say so, and set the number of BLAS threads.
 */
#ifndef EXPERT_BLAS_H
#define EXPERT_BLAS_H

#include <stddef.h>

/* Sets OpenBLAS's thread count. n <= 0 means "one per online CPU".
 * Returns the count now in force. Not thread-safe: call it before compute
 * threads start. */
int expert_blas_set_threads(int n);

/* The number of threads OpenBLAS uses now. */
int expert_blas_threads(void);

/* The kernel family OpenBLAS loaded, e.g. "Haswell" or "Cooperlake".
 * The string is static; never NULL. */
const char *expert_blas_corename(void);

#endif

/* OpenBLAS reads $OPENBLAS_CORETYPE once, when the library loads, and many
 * machines set it to a lower kernel family than the CPU has (this project's
 * VMs set Haswell/AVX2 on AVX-512 CPUs, half the rate). Call this first thing
 * in main(): when OPENBLAS_CORETYPE is set it re-executes the program
 * (/proc/self/exe) without it, so OpenBLAS detects the CPU's best kernels.
 * $STARLING_BLAS_CORETYPE overrides: a kernel name (e.g. "Haswell") forces
 * that family; "env" keeps whatever OPENBLAS_CORETYPE says. Returns normally
 * when nothing needs doing or the exec fails (the program then simply runs
 * with the inherited kernels). */
void expert_blas_prefer_native(char **argv);
