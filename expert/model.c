/* expert/model.c: the built-in models and the registry of the others. */
#include "expert/model.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "expert/modelfile.h"

static const struct expert_block_config fmnist_mlp_stages[] = {
    { EXPERT_BLOCK_LINEAR, 784, 512, 0 },
    { EXPERT_BLOCK_RESFFN, 512, 512, 2048 },
    { EXPERT_BLOCK_RESFFN, 512, 512, 2048 },
    { EXPERT_BLOCK_RESFFN, 512, 512, 2048 },
    { EXPERT_BLOCK_RESFFN, 512, 512, 2048 },
    { EXPERT_BLOCK_HEAD, 512, 10, 0 },
};

/* tiny-lm = train_lm.py's default config (d 256, 6 layers, 8 heads,
 * context 128, byte vocabulary; 4,903,168 parameters) in three stages of
 * two decoder layers each: a layer is ~0.85 M multiply-adds per token, the
 * embedding a gather and the head 65 k (8 % of a layer), so 2/2/2 gives
 * three peers the same work within 8 %. */
#define TINY_LM(kind, in, out, layers, vocab) \
    { kind, in, out, 1024, 256, 8, 128, layers, vocab }
static const struct expert_block_config tiny_lm_stages[] = {
    TINY_LM(EXPERT_BLOCK_EMBED, 128, 128 * 256, 2, 256),
    TINY_LM(EXPERT_BLOCK_DECODER, 128 * 256, 128 * 256, 2, 0),
    TINY_LM(EXPERT_BLOCK_LMHEAD, 128 * 256, 128 * 256 /* seq*vocab */, 2, 256),
};
#undef TINY_LM

static const struct expert_model_spec models[] = {
    { "fmnist-mlp",
      "Linear(784,512) -> 4 x ResFFN(512, hidden 2048, pre-LN, GELU) -> "
      "LayerNorm(512) -> Linear(512,10); softmax cross-entropy",
      6, fmnist_mlp_stages, 784, 10, EXPERT_TASK_CLASSES, 0, 0, 0, 0 },
    { "tiny-lm",
      "byte-level GPT (train_lm.py's default): embedding + 6 pre-LN decoder layers "
      "(d 256, 8 heads, hidden 1024, context 128) + LayerNorm + Linear(256,256); "
      "next-byte cross-entropy",
      3, tiny_lm_stages, 128, 128 * 256, EXPERT_TASK_BYTES, 128, 256, 32, 32 },
};
#define N_BUILTIN ((int)(sizeof models / sizeof models[0]))

/* Registered models: appended, never removed or moved (pointers handed out
 * stay valid until exit), each with its canonical JSON. */
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;
static struct expert_model_spec *reg[EXPERT_MODEL_REGISTRY_MAX];
static char *reg_json[EXPERT_MODEL_REGISTRY_MAX];
static int n_reg;

const struct expert_model_spec *expert_model_at(int i)
{
    if (i < 0)
        return NULL;
    if (i < N_BUILTIN)
        return &models[i];
    const struct expert_model_spec *m = NULL;
    pthread_mutex_lock(&reg_lock);
    if (i - N_BUILTIN < n_reg)
        m = reg[i - N_BUILTIN];
    pthread_mutex_unlock(&reg_lock);
    return m;
}

const struct expert_model_spec *expert_model_find(const char *name)
{
    if (!name)
        return NULL;
    for (int i = 0; i < N_BUILTIN; i++)
        if (strcmp(models[i].name, name) == 0)
            return &models[i];
    const struct expert_model_spec *m = NULL;
    pthread_mutex_lock(&reg_lock);
    for (int i = 0; i < n_reg && !m; i++)
        if (strcmp(reg[i]->name, name) == 0)
            m = reg[i];
    pthread_mutex_unlock(&reg_lock);
    return m;
}

int expert_model_register(struct expert_model_spec *owned, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!owned)
        return -EINVAL;
    char *json = expert_model_to_json(owned);
    if (!json) {
        if (err)
            snprintf(err, errlen, "model '%.48s' is not a valid model (no model file could "
                     "describe it)", owned->name ? owned->name : "");
        expert_model_free(owned);
        return -EINVAL;
    }
    int rc = 0;
    const char *other = NULL;
    pthread_mutex_lock(&reg_lock);
    for (int i = 0; i < N_BUILTIN && !other && !rc; i++) {
        if (strcmp(models[i].name, owned->name) != 0)
            continue;
        char *bj = expert_model_to_json(&models[i]);
        if (!bj)
            rc = -ENOMEM;
        else if (strcmp(bj, json) == 0)
            rc = 1;
        else
            other = "built in";
        free(bj);
    }
    for (int i = 0; i < n_reg && !other && !rc; i++) {
        if (strcmp(reg[i]->name, owned->name) != 0)
            continue;
        if (strcmp(reg_json[i], json) == 0)
            rc = 1;
        else
            other = "already registered";
    }
    if (other) {
        rc = -EEXIST;
        if (err)
            snprintf(err, errlen, "model '%s' is %s with another definition (its canonical "
                     "description differs); give this one another name", owned->name, other);
    } else if (rc == 0 && n_reg == EXPERT_MODEL_REGISTRY_MAX) {
        rc = -ENOSPC;
        if (err)
            snprintf(err, errlen, "cannot register model '%s': %d models are registered, the limit",
                     owned->name, EXPERT_MODEL_REGISTRY_MAX);
    } else if (rc == 0) {
        reg[n_reg] = owned;
        reg_json[n_reg] = json;
        n_reg++;
        owned = NULL;
        json = NULL;
    } else if (rc == -ENOMEM && err) {
        snprintf(err, errlen, "out of memory");
    }
    pthread_mutex_unlock(&reg_lock);
    expert_model_free(owned);
    free(json);
    return rc;
}

int expert_model_stage(const struct expert_model_spec *m, int index,
                       struct expert_block_config *cfg_out)
{
    if (!m || !cfg_out)
        return -EINVAL;
    if (index < 0 || index >= m->n_stages)
        return -ENOENT;
    *cfg_out = m->stages[index];
    return 0;
}

int expert_stage_parse(const char *id, const struct expert_model_spec **model_out,
                       int *index_out)
{
    if (!id)
        return -EINVAL;
    const char *dot = strrchr(id, '.');
    if (!dot || dot == id || dot[1] == '\0')
        return -EINVAL;
    size_t nlen = (size_t)(dot - id);
    if (nlen >= EXPERT_STAGE_NAME_MAX)
        return -EINVAL;
    const char *s = dot + 1;
    if (s[0] == '0' && s[1] != '\0')
        return -EINVAL;
    long idx = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9')
            return -EINVAL;
        idx = idx * 10 + (*s - '0');
        if (idx > 1000000)
            return -ENOENT;
    }
    char name[EXPERT_STAGE_NAME_MAX];
    memcpy(name, id, nlen);
    name[nlen] = '\0';
    const struct expert_model_spec *m = expert_model_find(name);
    if (!m || idx >= m->n_stages)
        return -ENOENT;
    if (model_out)
        *model_out = m;
    if (index_out)
        *index_out = (int)idx;
    return 0;
}

int expert_stage_name(char *buf, size_t len, const struct expert_model_spec *m, int index)
{
    if (!buf || !m || index < 0 || index >= m->n_stages)
        return -EINVAL;
    int n = snprintf(buf, len, "%s.%d", m->name, index);
    if (n < 0)
        return -EINVAL;
    if ((size_t)n >= len)
        return -ENOSPC;
    return n;
}

static uint64_t fnv1a(uint64_t h, const void *data, size_t len)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

uint64_t expert_stage_hash_of(const char *model, int index, uint64_t block_hash)
{
    if (!model || index < 0)
        return 0;
    static const char tag[] = "starling.stage.v1";
    unsigned char le[12];
    for (int i = 0; i < 4; i++)
        le[i] = (unsigned char)((uint32_t)index >> (8 * i));
    for (int i = 0; i < 8; i++)
        le[4 + i] = (unsigned char)(block_hash >> (8 * i));
    uint64_t h = 0xcbf29ce484222325ULL;
    h = fnv1a(h, tag, sizeof tag - 1);
    h = fnv1a(h, model, strlen(model) + 1); /* with its NUL */
    return fnv1a(h, le, sizeof le);
}

uint64_t expert_stage_hash(const struct expert_model_spec *m, int index)
{
    if (!m || index < 0 || index >= m->n_stages)
        return 0;
    return expert_stage_hash_of(m->name, index, expert_block_config_hash(&m->stages[index]));
}

uint64_t expert_stage_seed(uint64_t model_seed, int index)
{
    uint64_t z = model_seed + 0x9e3779b97f4a7c15ULL * (uint64_t)(index + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

double expert_model_flops_per_sample(const struct expert_model_spec *m)
{
    double f = 0.0;
    if (!m)
        return 0.0;
    for (int i = 0; i < m->n_stages; i++)
        f += expert_block_config_flops(&m->stages[i], 1);
    return f;
}
