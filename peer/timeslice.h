/* peer/timeslice.h: a thread's CPU time slice (Linux, best effort).
 *
 * Linux 6.12+ (EEVDF) lets a normal (SCHED_OTHER) thread ask for its own
 * time slice through sched_setattr's sched_runtime, without privileges;
 * threads created afterwards inherit it. With --training-priority idle the
 * peer's network thread asks for PEER_LOOP_SLICE_NS: measured here, a
 * request's tail under training load then no longer collects the
 * multi-millisecond stalls behind idle-priority training threads
 * (docs/benchmarks.md, Inference, Session 6). Compute threads reset theirs
 * to the default, since a long slice on the inference threads made the
 * tail worse. Older kernels accept the call and ignore the value. */
#ifndef PEER_TIMESLICE_H
#define PEER_TIMESLICE_H

#include <stdint.h>

#define PEER_LOOP_SLICE_NS 10000000ull /* 10 ms */

/* Sets the calling thread's slice to ns (the kernel clamps it to
 * 0.1-100 ms); 0 restores the kernel's default. Keeps the thread's policy
 * and nice value. Returns 0, -ENOSYS where the call does not exist, or
 * another -errno. */
int peer_sched_set_slice(uint64_t ns);

/* The calling thread's current slice in ns as the kernel reports it (the
 * value set, or the default, e.g. 1.4 ms on two cores); 0 where the kernel
 * reports none (before Linux 6.12) or the call does not exist. */
uint64_t peer_sched_get_slice(void);

#endif
