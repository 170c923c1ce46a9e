/* expert/residual.c: residual add; its backward fans the gradient out. */
#include "expert/ops.h"
#include "expert/pool.h"
#include "expert/simd.h"

#include <errno.h>
#include <string.h>

EXPERT__CLONES
static void residual_fwd(float *out, const float *a, const float *b, long N)
{
    for (long i = 0; i < N; i++)
        out[i] = a[i] + b[i];
}

struct res_job {
    float *out;
    const float *a, *b;
    long N;
};

static void res_fwd_task(void *p, int i, int n)
{
    struct res_job *j = p;
    size_t lo, hi;
    expert__split((size_t)j->N, i, n, 16, &lo, &hi);
    residual_fwd(j->out + lo, j->a + lo, j->b + lo, (long)(hi - lo));
}

int expert_residual_forward(float *out, const float *a, const float *b, long N)
{
    if (!out || !a || !b || N < 0)
        return -EINVAL;
    struct res_job j = { out, a, b, N };
    expert__parallel(res_fwd_task, &j, (size_t)N);
    return 0;
}

int expert_residual_backward(float *da, float *db, const float *dout, long N)
{
    if (!dout || N < 0)
        return -EINVAL;
    /* memmove: the caller may pass da or db aliasing dout. */
    if (da && da != dout)
        memmove(da, dout, (size_t)N * sizeof *da);
    if (db && db != dout)
        memmove(db, dout, (size_t)N * sizeof *db);
    return 0;
}
