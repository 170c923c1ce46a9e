/* expert/softmax.c: row softmax (max-subtracted) and its backward. */
#include "expert/ops.h"
#include "expert/pool.h"
#include "expert/simd.h"

#include <errno.h>

/* Rows [N0, N1) of out (N,V) = softmax(inp) (N,V). */
EXPERT__CLONES
static void sm_fwd(float *out, const float *inp, int N0, int N1, int V)
{
    for (int n = N0; n < N1; n++)
        expert__softmax_row(out + (size_t)n * V, inp + (size_t)n * V, V, 1.0f);
}

/* Rows [N0, N1): dinp = out ⊙ (dout − ⟨dout, out⟩). The dot is taken before
 * the row is written, so dinp may alias dout. */
EXPERT__CLONES
static void sm_bwd(float *dinp, const float *dout, const float *out, int N0, int N1, int V)
{
    for (int n = N0; n < N1; n++) {
        const float *dy = dout + (size_t)n * V, *y = out + (size_t)n * V;
        float *dx = dinp + (size_t)n * V;
        float dot = expert__vdot(dy, y, V);
        for (int v = 0; v < V; v++)
            dx[v] = y[v] * (dy[v] - dot);
    }
}

struct sm_job {
    float *out;
    const float *inp, *y;
    int N, V;
};

static void sm_fwd_task(void *p, int i, int n)
{
    struct sm_job *j = p;
    size_t lo, hi;
    expert__split((size_t)j->N, i, n, 1, &lo, &hi);
    sm_fwd(j->out, j->inp, (int)lo, (int)hi, j->V);
}

static void sm_bwd_task(void *p, int i, int n)
{
    struct sm_job *j = p;
    size_t lo, hi;
    expert__split((size_t)j->N, i, n, 1, &lo, &hi);
    sm_bwd(j->out, j->inp, j->y, (int)lo, (int)hi, j->V);
}

int expert_softmax_forward(float *out, const float *inp, int N, int V)
{
    if (!out || !inp || N < 0 || V <= 0)
        return -EINVAL;
    struct sm_job j = { out, inp, NULL, N, V };
    expert__parallel(sm_fwd_task, &j, (size_t)N * V);
    return 0;
}

int expert_softmax_backward(float *dinp, const float *dout, const float *out, int N, int V)
{
    if (!dinp || !dout || !out || N < 0 || V <= 0)
        return -EINVAL;
    struct sm_job j = { dinp, dout, out, N, V };
    expert__parallel(sm_bwd_task, &j, (size_t)N * V);
    return 0;
}
