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
#include "expert/safetensors.h"

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
    size_t total = 0, nt = 0;
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config c;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        size_t k = 0;
        expert_model_stage(m, s, &c);
        nt += (size_t)expert_block_config_tensors(&c, t, &k);
        total += k;
    }
    float *p = malloc(total * sizeof *p), *tr = malloc(total * sizeof *tr);
    expert_st_out *out = calloc(nt, sizeof *out);
    char (*names)[EXPERT_HF_NAME_MAX] = calloc(nt, sizeof *names);
    if (!p || !tr || !out || !names)
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
    size_t base = 0;
    int n = 0;
    for (int s = 0; s < m->n_stages; s++) {
        struct expert_block_config c;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        size_t k = 0;
        expert_model_stage(m, s, &c);
        int count = expert_block_config_tensors(&c, t, &k);
        for (int i = 0; i < count; i++, n++) {
            int transposed = 0;
            if (expert_hf_name(m, s, i, names[n], sizeof names[n], &transposed) != 0) {
                fprintf(stderr, "hf_weights: stage %d has no Hugging Face names\n", s);
                return 1;
            }
            const float *src = p + base + t[i].offset;
            float *dst = tr + base + t[i].offset;
            for (int a = 0; a < t[i].rows; a++)
                for (int b = 0; b < t[i].cols; b++) {
                    size_t from = (size_t)a * (size_t)t[i].cols + (size_t)b;
                    dst[transposed ? (size_t)b * (size_t)t[i].rows + (size_t)a : from] = src[from];
                }
            out[n].name = names[n];
            out[n].data = dst;
            out[n].ndim = t[i].cols == 1 ? 1 : 2;
            out[n].shape[0] = (uint64_t)(transposed ? t[i].cols : t[i].rows);
            out[n].shape[1] = (uint64_t)(transposed ? t[i].rows : t[i].cols);
        }
        base += k;
    }
    if (expert_st_write(argv[4], out, n, NULL, 0, err, sizeof err) != 0) {
        fprintf(stderr, "hf_weights: %s\n", err);
        return 1;
    }
    return 0;
}
