/* expert/pool.h (internal): run an elementwise kernel on the BLAS thread
 * budget.
 *
 * GEMMs use OpenBLAS's threads; the passes between them (bias+GELU and its
 * backward, over B×hidden values) would otherwise run on one core, which at
 * 2 threads costs about a tenth of a ResFFN step. expert__parallel splits
 * such a pass into n tasks, runs task 0 on the caller and the others on a
 * small persistent pool, and returns when all are done. n is
 * min(expert_blas_threads(), EXPERT__POOL_MAX); work below a threshold, or
 * a call while another thread is using the pool, simply runs inline, so
 * concurrent callers never wait on each other here.
 */
#ifndef EXPERT_POOL_H
#define EXPERT_POOL_H

#include <stddef.h>

#define EXPERT__POOL_MAX 16
/* expert__parallel splits a pass into at most this many parts (2 per
 * thread): the size of any per-part array a task function writes. */
#define EXPERT__POOL_MAX_PARTS (2 * EXPERT__POOL_MAX)
/* Below this many floats touched, waking a thread costs more than it saves. */
#define EXPERT__POOL_MIN_WORK ((size_t)1 << 17)

/* fn(ctx, i, n) must process part i of n. */
typedef void (*expert__task_fn)(void *ctx, int i, int n);

/* Runs fn over parts of a pass that touches `work` floats, on the pool's
 * threads and the caller's, and returns when every part is done: one part
 * on the caller below EXPERT__POOL_MIN_WORK or while the pool is busy, at
 * most EXPERT__POOL_MAX_PARTS otherwise. */
void expert__parallel(expert__task_fn fn, void *ctx, size_t work);

/* [lo, hi) of part i of n over count items, in multiples of align. */
void expert__split(size_t count, int i, int n, size_t align, size_t *lo, size_t *hi);

#endif
