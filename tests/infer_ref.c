/* infer_ref: predictions of a model computed locally, for the swarm tests.
 * Usage: infer_ref SEED N [BATCH] — prints "index class" for the first N
 * Fashion-MNIST test images, with every stage initialised as a peer started
 * with --seed SEED initialises it. */
#include <stdio.h>
#include <stdlib.h>

#include "expert/block.h"
#include "expert/model.h"
#include "routing/data.h"

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: infer_ref SEED N [BATCH]\n");
        return 2;
    }
    unsigned long long seed = strtoull(argv[1], NULL, 10);
    int n = atoi(argv[2]), batch = argc > 3 ? atoi(argv[3]) : 64;
    const struct expert_model_spec *m = expert_model_find("fmnist-mlp");
    char dir[4096], err[512];
    route_dataset ds;
    if (!m || route_data_find_dir(NULL, dir, sizeof dir, err, sizeof err) != 0 ||
        route_data_load(&ds, dir, "t10k", err, sizeof err) != 0) {
        fprintf(stderr, "infer_ref: %s\n", err);
        return 1;
    }
    if (n > ds.n)
        n = ds.n;
    expert_block *blk[16];
    expert_workspace *ws[16];
    static float a[2][64 * 2048];
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config c;
        expert_model_stage(m, s, &c);
        blk[s] = expert_block_create(&c, expert_stage_seed(seed, s));
        ws[s] = expert_workspace_create(&c, batch);
        if (!blk[s] || !ws[s])
            return 1;
    }
    for (int first = 0; first < n; first += batch) {
        int rows = n - first < batch ? n - first : batch;
        const float *x = ds.images + (size_t)first * 784;
        for (int s = 0; s < m->n_stages; s++) {
            if (expert_block_forward(blk[s], ws[s], a[s & 1], x, rows, NULL) != 0)
                return 1;
            x = a[s & 1];
        }
        for (int r = 0; r < rows; r++) {
            const float *z = x + (size_t)r * (size_t)m->n_out;
            int arg = 0;
            for (int c = 1; c < m->n_out; c++)
                if (z[c] > z[arg])
                    arg = c;
            printf("%d %d\n", first + r, arg);
        }
    }
    for (int s = 0; s < m->n_stages; s++) {
        expert_workspace_destroy(&ws[s]);
        expert_block_destroy(&blk[s]);
    }
    route_data_free(&ds);
    return 0;
}
