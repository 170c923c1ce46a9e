/* expert/embed.c: the EMBED kind, a GPT's first stage: token + learned
 * position embedding (train_lm.py's tok_emb, pos_emb), then its decoder
 * layers (expert/decoder.c).
 *   inp  (B, T)      token ids as floats, integers in [0, vocab) (host memory)
 *   x    (B, T, d)   = tok_emb[inp] + pos_emb[0..T-1]
 *   out  (B, T, d)   = layers(x)   (x itself when the stage has none)
 * Tensors: tok_emb (vocab,d), pos_emb (T,d), then 12 per layer. */
#include "expert/kinds_internal.h"

#include <errno.h>

int expert__embed_forward(const struct expert__exec *x, struct expert__seq_ws *ws, float *out,
                          const float *inp_host, int B)
{
    const struct expert_block_config *c = x->c;
    int T = c->seq, d = c->dim;
    if (expert__seq_tokens(ws->tok, inp_host, (long)B * T, c->vocab) != 0)
        return -EINVAL;
    float *e = c->layers ? ws->l[0].x : out;
    if (!e)
        return 0; /* nothing kept and nothing wanted */
    EXPERT__TRY(x->o->embedding_forward(e, ws->tok, EXPERT__P(x, 0), EXPERT__P(x, 1), B, T, d,
                                        c->vocab));
    return c->layers ? expert__layers_forward(x, 2, ws, e, out, B) : 0;
}

int expert__embed_backward(const struct expert__exec *x, struct expert__seq_ws *ws,
                           const float *dout, const float *inp_host, int B)
{
    const struct expert_block_config *c = x->c;
    int T = c->seq, d = c->dim;
    if (expert__seq_tokens(ws->tok, inp_host, (long)B * T, c->vocab) != 0)
        return -EINVAL;
    const float *de = dout;
    if (c->layers) {
        EXPERT__TRY(expert__layers_backward(x, 2, ws, dout, ws->g0, B));
        de = ws->g0;
    }
    return x->o->embedding_backward(EXPERT__G(x, 0), EXPERT__G(x, 1), de, ws->tok, B, T, d,
                                    c->vocab);
}
