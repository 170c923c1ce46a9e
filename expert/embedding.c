/* expert/embedding.c: token + learned position embedding (train_lm.py's
 * tok_emb[idx] + pos_emb[0..T-1]) and its backward. */
#include "expert/ops.h"

#include <errno.h>

/* 0 when every token of tok (n) is in [0, V). Checked before anything is
 * written, so a bad batch leaves out and the gradients untouched. */
static int tokens_ok(const int32_t *tok, size_t n, int V)
{
    for (size_t i = 0; i < n; i++)
        if (tok[i] < 0 || tok[i] >= V)
            return 0;
    return 1;
}

int expert_embedding_forward(float *out, const int32_t *tok, const float *wte,
                             const float *wpe, int B, int T, int C, int V)
{
    if (!out || !tok || !wte || !wpe || B <= 0 || T <= 0 || C <= 0 || V <= 0)
        return -EINVAL;
    if (!tokens_ok(tok, (size_t)B * T, V))
        return -EINVAL;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            size_t bt = (size_t)b * T + t;
            float *o = out + bt * C;
            const float *e = wte + (size_t)tok[bt] * C, *p = wpe + (size_t)t * C;
            for (int c = 0; c < C; c++)
                o[c] = e[c] + p[c];
        }
    return 0;
}

int expert_embedding_backward(float *dwte, float *dwpe, const float *dout,
                              const int32_t *tok, int B, int T, int C, int V)
{
    if (!dwte || !dwpe || !dout || !tok || B <= 0 || T <= 0 || C <= 0 || V <= 0)
        return -EINVAL;
    if (!tokens_ok(tok, (size_t)B * T, V))
        return -EINVAL;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            size_t bt = (size_t)b * T + t;
            const float *d = dout + bt * C;
            float *e = dwte + (size_t)tok[bt] * C, *p = dwpe + (size_t)t * C;
            for (int c = 0; c < C; c++) {
                e[c] += d[c];
                p[c] += d[c];
            }
        }
    return 0;
}
