#include "peer/timeslice.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

#if defined(__linux__)
#include <sys/syscall.h>
#endif

#if defined(__linux__) && defined(SYS_sched_setattr) && defined(SYS_sched_getattr)
/* The kernel's struct sched_attr (include/uapi/linux/sched/types.h); glibc
 * declares it only since 2.41, so it is spelled out here. */
struct peer_sched_attr {
    uint32_t size;
    uint32_t sched_policy;
    uint64_t sched_flags;
    int32_t sched_nice;
    uint32_t sched_priority;
    uint64_t sched_runtime;
    uint64_t sched_deadline;
    uint64_t sched_period;
    uint32_t sched_util_min;
    uint32_t sched_util_max;
};

static int get_attr(struct peer_sched_attr *a)
{
    memset(a, 0, sizeof *a);
    if (syscall(SYS_sched_getattr, 0, a, (unsigned)sizeof *a, 0u) != 0)
        return -errno;
    return 0;
}

int peer_sched_set_slice(uint64_t ns)
{
    struct peer_sched_attr a;
    int rc = get_attr(&a);
    if (rc != 0)
        return rc;
    a.size = sizeof a;
    a.sched_flags = 0; /* keep policy and nice; no reset-on-fork, no util clamps */
    a.sched_runtime = ns;
    a.sched_deadline = a.sched_period = 0;
    if (syscall(SYS_sched_setattr, 0, &a, 0u) != 0)
        return -errno;
    return 0;
}

uint64_t peer_sched_get_slice(void)
{
    struct peer_sched_attr a;
    return get_attr(&a) == 0 ? a.sched_runtime : 0;
}
#else
int peer_sched_set_slice(uint64_t ns)
{
    (void)ns;
    return -ENOSYS;
}

uint64_t peer_sched_get_slice(void)
{
    return 0;
}
#endif
