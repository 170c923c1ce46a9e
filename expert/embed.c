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
#include <stdio.h>
#include <string.h>

static int is_token(float v, int V)
{
    return v >= 0.0f && v < (float)V && v == floorf(v);
}

int expert__seq_tokens(int32_t *tok, const float *inp, long n, int V)
{
    for (long i = 0; i < n; i++) {
        if (!is_token(inp[i], V))
            return -EINVAL;
        tok[i] = (int32_t)inp[i];
    }
    return 0;
}

int expert_block_input_check(const struct expert_block_config *cfg, const float *inp, int B,
                             char *why, size_t why_len)
{
    if (expert_block_config_check(cfg) < 0 || !inp || B < 0)
        return -EINVAL;
    if (cfg->kind != EXPERT_BLOCK_EMBED)
        return 0;
    for (long i = 0; i < (long)B * cfg->seq; i++)
        if (!is_token(inp[i], cfg->vocab)) {
            if (why && why_len)
                snprintf(why, why_len, "input value %g at row %ld, position %ld is not a token "
                         "(an integer in [0, %d))", (double)inp[i], i / cfg->seq, i % cfg->seq, cfg->vocab);
            return -EINVAL;
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
                           float *dinp, const float *dout, const float *inp, int B)
{
    int T = c->seq, d = c->dim;
    if (expert__seq_tokens(ws->tok, inp, (long)B * T, c->vocab) != 0)
        return -EINVAL;
    if (dinp) /* tokens have no gradient; the contract writes dinp all the same */
        memset(dinp, 0, (size_t)B * (size_t)T * sizeof *dinp);
    const float *dx = dout;
    if (c->layers) {
        expert__layers_backward(c, t, 2, params, grads, ws, dout, ws->g0, B);
        dx = ws->g0;
    }
    expert_embedding_backward(grads + t[0].offset, grads + t[1].offset, dx, ws->tok, B, T, d,
                              c->vocab);
    return 0;
}
