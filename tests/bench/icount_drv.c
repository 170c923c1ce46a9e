/* tests/bench/icount_drv.c: a fixed number of forwards, forward+backwards
 * and AdamW steps of a model's blocks on the CPU backend, always the same
 * calls, so that callgrind's instruction count of one build's expert
 * library compares with another's (tests/bench/icount_ab.sh builds it
 * against each). Instructions are repeatable where seconds are not on a
 * shared machine; they miss memory effects, which wall-clock runs
 * (ab_bench.sh) cover.
 *
 *   icount_drv 0   fmnist-mlp's stages (LINEAR 784->512, RESFFN 512/2048,
 *                  HEAD 512->10), micro-batch 64, 10 iterations
 *   icount_drv 1   small transformer stages (EMBED, DECODER x2, LMHEAD:
 *                  d 64, 4 heads, context 32, vocab 256), batch 2, where
 *                  per-call overheads weigh the most */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "expert/expert.h"

static void run(const struct expert_block_config *c, int B, int iters)
{
    expert_block *b = expert_block_create(c, 1);
    expert_workspace *ws = expert_workspace_create(c, B);
    size_t ni = (size_t)B * c->in, no = (size_t)B * c->out;
    float *x = calloc(ni, 4), *y = calloc(no, 4), *dy = calloc(no, 4), *dx = calloc(ni, 4);
    for (size_t i = 0; i < ni; i++) x[i] = c->kind == EXPERT_BLOCK_EMBED ? (float)(i % 7) : (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    for (size_t i = 0; i < no; i++) dy[i] = (float)((i * 40503u) % 1000) / 1000.0f - 0.5f;
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    for (int i = 0; i < iters; i++) {
        if (expert_block_forward(b, ws, y, x, B, NULL) != 0) abort();
        if (expert_block_forward_backward(b, ws, y, dx, dy, x, B, NULL) != 0) abort();
        if (expert_block_step(b, &o, NULL) != 0) abort();
    }
    printf("%d %f\n", c->kind, (double)y[0]);
    free(x); free(y); free(dy); free(dx);
    expert_workspace_destroy(&ws);
    expert_block_destroy(&b);
}

int main(int argc, char **argv)
{
    int which = argc > 1 ? atoi(argv[1]) : 0;
    if (which == 0) { /* fmnist-mlp's stages at micro-batch 64 */
        struct expert_block_config lin = { .kind = EXPERT_BLOCK_LINEAR, .in = 784, .out = 512 };
        struct expert_block_config ffn = { .kind = EXPERT_BLOCK_RESFFN, .in = 512, .out = 512, .hidden = 2048 };
        struct expert_block_config head = { .kind = EXPERT_BLOCK_HEAD, .in = 512, .out = 10 };
        run(&lin, 64, 10); run(&ffn, 64, 10); run(&head, 64, 10);
    } else { /* small transformer stages: the seam's overhead at its largest */
        struct expert_block_config dec = { .kind = EXPERT_BLOCK_DECODER, .in = 32 * 64, .out = 32 * 64, .hidden = 256, .dim = 64, .heads = 4, .seq = 32, .layers = 2 };
        struct expert_block_config emb = { .kind = EXPERT_BLOCK_EMBED, .in = 32, .out = 32 * 64, .hidden = 256, .dim = 64, .heads = 4, .seq = 32, .layers = 1, .vocab = 256 };
        struct expert_block_config lmh = { .kind = EXPERT_BLOCK_LMHEAD, .in = 32 * 64, .out = 32 * 256, .hidden = 256, .dim = 64, .heads = 4, .seq = 32, .layers = 1, .vocab = 256 };
        run(&emb, 2, 10); run(&dec, 2, 10); run(&lmh, 2, 10);
    }
    return 0;
}
