/* expert/embed.c: the EMBED kind, a GPT's first stage: token + learned
 * position embedding (train_lm.py's tok_emb, pos_emb), then its decoder
 * layers (expert/decoder.c).
 *   inp  (B, T)      token ids as floats, integers in [0, vocab)
 *   x    (B, T, d)   = tok_emb[inp] + pos_emb[0..T-1]
 *   out  (B, T, d)   = layers(x)   (x itself when the stage has none)
 * Tensors: tok_emb (vocab,d), pos_emb (T,d), then 12 per layer. */
#include "expert/ops.h"
#include "expert/kinds_internal.h"

#include <errno.h>
#include <math.h>

int expert__seq_tokens(int32_t *tok, const float *inp, long n, int V)
{
    for (long i = 0; i < n; i++) {
        float v = inp[i];
        if (!(v >= 0.0f && v < (float)V) || v != floorf(v))
            return -EINVAL;
        tok[i] = (int32_t)v;
    }
    return 0;
}

int expert__embed_forward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                          const float *params, struct expert__seq_ws *ws, float *out,
                          const float *inp, int B)
{
    int T = c->seq, d = c->dim;
    if (expert__seq_tokens(ws->tok, inp, (long)B * T, c->vocab) != 0)
        return -EINVAL;
    float *x = c->layers ? ws->l[0].x : out;
    if (!x)
        return 0; /* nothing kept and nothing wanted */
    expert_embedding_forward(x, ws->tok, params + t[0].offset, params + t[1].offset, B, T, d,
                             c->vocab);
    if (c->layers)
        expert__layers_forward(c, t, 2, params, ws, x, out, B);
    return 0;
}

int expert__embed_backward(const struct expert_block_config *c, const struct expert_tensor_info *t,
                           const float *params, float *grads, struct expert__seq_ws *ws,
                           const float *dout, const float *inp, int B)
{
    int T = c->seq, d = c->dim;
    if (expert__seq_tokens(ws->tok, inp, (long)B * T, c->vocab) != 0)
        return -EINVAL;
    const float *dx = dout;
    if (c->layers) {
        expert__layers_backward(c, t, 2, params, grads, ws, dout, ws->g0, B);
        dx = ws->g0;
    }
    expert_embedding_backward(grads + t[0].offset, grads + t[1].offset, dx, ws->tok, B, T, d,
                              c->vocab);
    return 0;
}
