/* tests/hf_weights.c: writes one random set of weights of a GPT-style model
 * twice: as a flat file (train_lm.py's --save-init layout) and as a
 * safetensors file under GPT-2's Hugging Face names (expert/hfweights.h),
 * for tests/test_swarm_hfinit.sh. Not a test itself.
 *
 *     hf_weights MODEL_FILE SEED OUT.bin OUT.safetensors
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "expert/block.h"
#include "expert/hfweights.h"
#include "expert/modelfile.h"

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: hf_weights MODEL_FILE SEED OUT.bin OUT.safetensors\n");
        return 2;
    }
    char err[400];
    struct expert_model_spec *m = expert_model_load_file(argv[1], err, sizeof err);
    if (!m) {
        fprintf(stderr, "hf_weights: %s\n", err);
        return 1;
    }
    uint64_t r = strtoull(argv[2], NULL, 10) * 2654435761ULL + 1;
    size_t total = 0;
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config c;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        size_t k = 0;
        expert_model_stage(m, s, &c);
        expert_block_config_tensors(&c, t, &k);
        total += k;
    }
    float *p = malloc(total * sizeof *p);
    if (!p)
        return 1;
    for (size_t i = 0; i < total; i++) {
        r = r * 6364136223846793005ULL + 1442695040888963407ULL;
        p[i] = (float)((double)(r >> 40) / (double)(1ULL << 24) - 0.5) * 0.2f;
    }
    FILE *f = fopen(argv[3], "wb");
    if (!f || fwrite(p, sizeof *p, total, f) != total || fclose(f) != 0) {
        fprintf(stderr, "hf_weights: cannot write %s\n", argv[3]);
        return 1;
    }
    const float *per[64];
    size_t base = 0;
    for (int s = 0; s < m->n_stages && s < 64; s++) {
        struct expert_block_config c;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        size_t k = 0;
        expert_model_stage(m, s, &c);
        expert_block_config_tensors(&c, t, &k);
        per[s] = p + base;
        base += k;
    }
    int rc = expert_hf_write(m, per, argv[4], NULL, 0, err, sizeof err);
    if (rc != 0)
        fprintf(stderr, "hf_weights: %s\n", err);
    free(p);
    expert_model_free(m);
    return rc != 0;
}
