// cuda/embedding.cu: token + learned position embedding and its backward.
//
// The tokens live in host memory (expert/ops.h): they are checked on the
// host before anything is queued, so a bad batch changes nothing on the
// device, then uploaded into the thread's scratch.
//
// Upload and host buffers. The caller may reuse its token array as soon as
// the op returns, and the backward's sorted index arrays are host buffers
// of ours that are freed on return. A cudaMemcpyAsync from host memory may
// still be reading it after it returns (always so when the caller's memory
// is pinned), so every upload here is followed by cudaStreamSynchronize
// before the op returns or frees anything. That costs one wait on the
// stream per call, once per step for each direction, where the step already
// waits (the cross-entropy forward and the optimizer's sums read results
// back); a pinned staging buffer of our own would need an event per thread
// to know when it may be refilled, for no measurable gain.
//
// Determinism, no atomics. The backward sorts the B·T positions by token on
// the host (a counting sort, stable: positions of one token stay in
// increasing order), and one block per distinct token adds that token's
// dout rows, in increasing position, onto dwte[token]. The position grad
// has one thread per (t, c) adding dout[b][t][c] for b = 0, 1, ... . Both
// add in the same order as the CPU reference (b, then t), starting from the
// gradient's current value, so the sums are the CPU's, float for float.
#include <stdlib.h>

#include "cuda/common.cuh"

#define EMB_THREADS 256

// 1 when every token of tok (n) is in [0, V).
static int tokens_ok(const int32_t *tok, size_t n, int V)
{
    for (size_t i = 0; i < n; i++)
        if (tok[i] < 0 || tok[i] >= V)
            return 0;
    return 1;
}

// Copies n int32 from host src to device dst on the stream and waits for
// the copy, so src may be reused or freed as soon as this returns.
static int upload_ints(cuda__ctx *c, int32_t *dst, const int32_t *src, size_t n)
{
    cudaError_t e = cudaMemcpyAsync(dst, src, n * sizeof(int32_t), cudaMemcpyHostToDevice,
                                    c->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->stream);
    if (e != cudaSuccess) {
        (void)cudaGetLastError(); // the error is reported here, not by a later launch
        return expert_backend_set_error(-EIO, "CUDA: the embedding's token upload failed: %s",
                                        cudaGetErrorString(e));
    }
    return 0;
}

// out[bt][c] = wte[tok[bt]][c] + wpe[bt % T][c]: one block per row bt
// (a loop over rows, so any B·T fits the grid), threads over c.
static __global__ void embedding_forward_kernel(float *out, const int32_t *tok, const float *wte,
                                                const float *wpe, long rows, int T, int C)
{
    for (long bt = blockIdx.x; bt < rows; bt += gridDim.x) {
        int t = (int)(bt % T);
        const float *e = wte + (size_t)tok[bt] * C;
        const float *p = wpe + (size_t)t * C;
        float *o = out + (size_t)bt * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x)
            o[c] = e[c] + p[c];
    }
}

// dwte[seg_tok[s]][c] += dout[pos[k]][c] for k in [seg_start[s],
// seg_start[s+1]), in increasing k (so increasing position): one block per
// segment (a loop over segments), threads over c. Every token has one
// segment, so no two blocks write the same row of dwte.
static __global__ void embedding_dwte_kernel(float *dwte, const float *dout, const int32_t *pos,
                                             const int32_t *seg_start, const int32_t *seg_tok,
                                             int nseg, int C)
{
    for (int s = blockIdx.x; s < nseg; s += gridDim.x) {
        float *e = dwte + (size_t)seg_tok[s] * C;
        int k0 = seg_start[s], k1 = seg_start[s + 1];
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = e[c];
            for (int k = k0; k < k1; k++)
                acc += dout[(size_t)pos[k] * C + c];
            e[c] = acc;
        }
    }
}

// dwpe[t][c] += Σ_b dout[b][t][c] over b in increasing order: one thread
// per element of dwpe (T, C).
static __global__ void embedding_dwpe_kernel(float *dwpe, const float *dout, int B, int T, int C)
{
    long n = (long)T * C;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n;
         i += (long)gridDim.x * blockDim.x) {
        // i = t·C + c, and dout[b][t][c] sits at b·T·C + i.
        float acc = dwpe[i];
        for (int b = 0; b < B; b++)
            acc += dout[(size_t)b * (size_t)n + (size_t)i];
        dwpe[i] = acc;
    }
}

extern "C" int cuda_embedding_forward(float *out, const int32_t *tok, const float *wte,
                                      const float *wpe, int B, int T, int C, int V)
{
    if (!out || !tok || !wte || !wpe || B <= 0 || T <= 0 || C <= 0 || V <= 0)
        return -EINVAL;
    size_t n = (size_t)B * (size_t)T;
    if (!tokens_ok(tok, n, V))
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;
    int32_t *dtok = (int32_t *)cuda__scratch(ctx, n * sizeof(int32_t));
    if (!dtok)
        return -ENOMEM;
    int rc = upload_ints(ctx, dtok, tok, n);
    if (rc)
        return rc;
    embedding_forward_kernel<<<cuda__blocks((long)n, 1), EMB_THREADS, 0, ctx->stream>>>(
        out, dtok, wte, wpe, (long)n, T, C);
    return cuda__launch_status();
}

extern "C" int cuda_embedding_backward(float *dwte, float *dwpe, const float *dout,
                                       const int32_t *tok, int B, int T, int C, int V)
{
    if (!dwte || !dwpe || !dout || !tok || B <= 0 || T <= 0 || C <= 0 || V <= 0)
        return -EINVAL;
    size_t n = (size_t)B * (size_t)T;
    // The sorted arrays index positions with int32 (as the kernels do).
    if (n > (size_t)INT32_MAX)
        return -EINVAL;
    if (!tokens_ok(tok, n, V))
        return -EINVAL;
    cuda__ctx *ctx = cuda__context();
    if (!ctx)
        return -ENODEV;

    // Counting sort of the positions by token. count has V + 1 entries:
    // after the prefix sum, count[v] is where token v's positions start.
    // One host buffer holds what is uploaded, laid out as
    //   pos[n] | seg_start[nseg + 1] | seg_tok[nseg]
    // with nseg (the number of distinct tokens) <= n; the buffer is sized
    // for nseg = n and the three arrays are packed once nseg is known.
    int32_t *count = (int32_t *)calloc((size_t)V + 1, sizeof(int32_t));
    int32_t *host = (int32_t *)malloc((3 * n + 1) * sizeof(int32_t));
    if (!count || !host) {
        free(count);
        free(host);
        return expert_backend_set_error(-ENOMEM, "embedding backward: out of host memory");
    }
    for (size_t i = 0; i < n; i++)
        count[tok[i] + 1]++;
    for (int v = 0; v < V; v++)
        count[v + 1] += count[v];
    // count[v] = the first slot of token v; count[V] = n.
    int32_t *pos = host;
    int32_t *seg_start = host + n;
    int nseg = 0;
    for (int v = 0; v < V; v++)
        if (count[v + 1] > count[v])
            seg_start[nseg++] = count[v];
    seg_start[nseg] = (int32_t)n;
    int32_t *seg_tok = seg_start + nseg + 1;
    for (int v = 0, s = 0; v < V; v++)
        if (count[v + 1] > count[v])
            seg_tok[s++] = v;
    // Fill the positions in increasing order (stable); count[v] walks
    // through token v's slots.
    for (size_t i = 0; i < n; i++)
        pos[count[tok[i]]++] = (int32_t)i;
    free(count);

    size_t nints = n + 2 * (size_t)nseg + 1;
    int32_t *dev = (int32_t *)cuda__scratch(ctx, nints * sizeof(int32_t));
    if (!dev) {
        free(host);
        return -ENOMEM;
    }
    int rc = upload_ints(ctx, dev, host, nints);
    free(host);
    if (rc)
        return rc;
    const int32_t *dpos = dev, *dseg_start = dev + n, *dseg_tok = dev + n + nseg + 1;
    embedding_dwte_kernel<<<cuda__blocks(nseg, 1), EMB_THREADS, 0, ctx->stream>>>(
        dwte, dout, dpos, dseg_start, dseg_tok, nseg, C);
    rc = cuda__launch_status();
    if (rc)
        return rc;
    long pe = (long)T * C;
    embedding_dwpe_kernel<<<cuda__blocks(pe, EMB_THREADS), EMB_THREADS, 0, ctx->stream>>>(
        dwpe, dout, B, T, C);
    return cuda__launch_status();
}
