/* capi/query.c: what a swarm handle can ask: the models the swarm serves,
 * a stage's holders, raw DHT records; a model's facts and its stages'
 * initial weights; finding a model (built in, registered, or published in
 * the swarm). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capi/capi_internal.h"
#include "expert/block.h"
#include "expert/model.h"
#include "expert/modelfile.h"
#include "swarm/announce.h"
#include "swarm/holders.h"
#include "swarm/modeldesc.h"

#define MAX_MODELS 64

/* ---- finding a model ---- */

typedef struct find_ctx {
    starling_swarm *s;
    char name[80];
    char *err;
    size_t err_len;
    capi_model_cb done;
    void *arg;
} find_ctx;

static void on_fetched(int status, struct expert_model_spec *spec, const uint8_t hash[PEER_MODELDESC_HASH_LEN],
                       size_t json_len, const char *why, void *arg)
{
    find_ctx *f = arg;
    (void)hash;
    (void)json_len;
    int rc = status;
    const struct expert_model_spec *found = NULL;
    if (rc == -ENOENT && why && !strncmp(why, "no peer", 7))
        capi_err(f->err, f->err_len, rc,
                 "unknown model '%s': no built-in model and no peer in the swarm publishes one by that name", f->name);
    else if (rc != 0)
        capi_err(f->err, f->err_len, rc, "model '%s': %s", f->name, why ? why : strerror(-rc));
    if (rc == 0) {
        char msg[512];
        if (expert_model_register(spec, msg, sizeof msg) < 0) /* takes spec */
            rc = capi_err(f->err, f->err_len, -EINVAL, "model '%s' from the swarm: %s", f->name, msg);
        else if (!(found = expert_model_find(f->name)))
            rc = capi_err(f->err, f->err_len, -ENOENT, "model '%s' from the swarm: not registered", f->name);
    } else {
        expert_model_free(spec);
    }
    f->done(f->arg, rc, found);
    free(f);
}

void capi_model_find(starling_swarm *s, const char *name, char *err, size_t err_len, capi_model_cb done, void *arg)
{
    const struct expert_model_spec *m = name ? expert_model_find(name) : NULL;
    if (m || !name || !s || expert_model_name_check(name) != 0) {
        int rc = m ? 0
                 : !name ? capi_err(err, err_len, -EINVAL, "no model name given")
                         : capi_err(err, err_len, -ENOENT, "unknown model '%s'%s", name,
                                    s ? ": not a valid model name" : ": not built in (a swarm handle can fetch "
                                                                     "models its peers publish)");
        done(arg, rc, m);
        return;
    }
    find_ctx *f = calloc(1, sizeof *f);
    if (!f) {
        done(arg, capi_err(err, err_len, -ENOMEM, "out of memory"), NULL);
        return;
    }
    f->s = s;
    snprintf(f->name, sizeof f->name, "%s", name);
    f->err = err;
    f->err_len = err_len;
    f->done = done;
    f->arg = arg;
    int rc = peer_modeldesc_fetch(s->d, name, on_fetched, f);
    if (rc != 0) {
        free(f);
        done(arg, capi_err(err, err_len, rc, "cannot look model '%s' up in the swarm: %s", name, strerror(-rc)), NULL);
    }
}

/* A job that needs a model first: finds it, then calls next. */
typedef struct model_job {
    capi_job job;
    const char *name;
    int stage;                            /* -1: none asked */
    const struct expert_model_spec *spec;
    char **json;
    float *params;
    size_t n;
    void (*next)(struct model_job *mj);   /* loop thread, spec set */
} model_job;

static void model_found(void *arg, int rc, const struct expert_model_spec *spec)
{
    model_job *mj = arg;
    if (rc != 0) {
        capi_done(&mj->job, rc);
        return;
    }
    mj->spec = spec;
    if (mj->stage >= 0 && mj->stage >= spec->n_stages) {
        capi_done(&mj->job, capi_err(mj->job.err, mj->job.err_len, -EINVAL,
                                     "stage %d is out of range: model '%s' has stages 0..%d", mj->stage, spec->name,
                                     spec->n_stages - 1));
        return;
    }
    mj->next(mj);
}

static void model_job_start(capi_job *j)
{
    model_job *mj = (model_job *)j;
    capi_model_find(j->s, mj->name, j->err, j->err_len, model_found, mj);
}

/* Runs mj: on the loop thread with a swarm, or here without one. */
static int run_model_job(starling_swarm *s, model_job *mj)
{
    if (s) {
        mj->job.start = model_job_start;
        return capi_run(s, &mj->job);
    }
    /* No swarm: built-in and registered models only; capi_model_find then
     * calls back at once, and capi_done needs a swarm for its lock. */
    const struct expert_model_spec *m = mj->name ? expert_model_find(mj->name) : NULL;
    if (!m)
        return capi_err(mj->job.err, mj->job.err_len, mj->name ? -ENOENT : -EINVAL,
                        mj->name ? "unknown model '%s': not built in (a swarm handle can fetch models its peers "
                                   "publish)"
                                 : "no model name given",
                        mj->name ? mj->name : "");
    if (mj->stage >= 0 && mj->stage >= m->n_stages)
        return capi_err(mj->job.err, mj->job.err_len, -EINVAL, "stage %d is out of range: model '%s' has stages 0..%d",
                        mj->stage, m->name, m->n_stages - 1);
    mj->spec = m;
    mj->job.s = NULL; /* capi_done then only records rc */
    mj->next(mj);
    return mj->job.rc;
}

static int check_out(void *out, char *err, size_t err_len)
{
    if (err && err_len)
        err[0] = '\0';
    return out ? 0 : capi_err(err, err_len, -EINVAL, "no place for the result (NULL)");
}

/* ---- a model's facts ---- */

static void shape_json(capi_buf *b, const struct expert_block_config *c, int out)
{
    uint64_t dims[2];
    int n = expert_block_row_shape(c, out, dims);
    capi_buf_printf(b, "[");
    for (int i = 0; i < n; i++)
        capi_buf_printf(b, "%s%llu", i ? "," : "", (unsigned long long)dims[i]);
    capi_buf_printf(b, "]");
}

static void info_next(model_job *mj)
{
    const struct expert_model_spec *m = mj->spec;
    capi_buf b = {0};
    capi_buf_printf(&b, "{\"name\":");
    capi_buf_json_str(&b, m->name);
    capi_buf_printf(&b, ",\"description\":");
    capi_buf_json_str(&b, m->desc ? m->desc : "");
    capi_buf_printf(&b, ",\"task\":\"%s\",\"max_batch\":%d,\"seq\":%d,\"vocab\":%d,\"stages\":[",
                    m->task == EXPERT_TASK_BYTES ? "bytes" : "classes", m->max_batch > 0 ? m->max_batch : 256, m->seq,
                    m->vocab);
    for (int i = 0; i < m->n_stages; i++) {
        struct expert_block_config c;
        expert_model_stage(m, i, &c);
        int nt = 0;
        size_t total = 0;
        struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
        nt = expert_block_config_tensors(&c, t, &total);
        if (nt < 0) {
            free(b.p);
            capi_done(&mj->job, capi_err(mj->job.err, mj->job.err_len, -EINVAL, "stage %d is not a valid block", i));
            return;
        }
        capi_buf_printf(&b, "%s{\"index\":%d,\"kind\":\"%s\",\"in_shape\":", i ? "," : "", i,
                        expert_block_kind_name(c.kind));
        shape_json(&b, &c, 0);
        capi_buf_printf(&b, ",\"out_shape\":");
        shape_json(&b, &c, 1);
        capi_buf_printf(&b, ",\"in_width\":%d,\"out_width\":%d,\"params\":%zu,\"tensors\":[", c.in, c.out, total);
        for (int k = 0; k < nt; k++) {
            capi_buf_printf(&b, "%s{\"name\":", k ? "," : "");
            capi_buf_json_str(&b, t[k].name);
            capi_buf_printf(&b, ",\"offset\":%zu,\"shape\":[%d,%d]}", t[k].offset, t[k].rows, t[k].cols);
        }
        capi_buf_printf(&b, "]}");
    }
    capi_buf_printf(&b, "]}");
    capi_done(&mj->job, capi_buf_take(&b, mj->json, mj->job.err, mj->job.err_len));
}

int starling_model_info(starling_swarm *s, const char *model, char **json, char *err, size_t err_len)
{
    int rc = check_out(json, err, err_len);
    if (rc != 0)
        return rc;
    *json = NULL;
    model_job mj = {.job = {.err = err, .err_len = err_len}, .name = model, .stage = -1, .json = json,
                    .next = info_next};
    return run_model_job(s, &mj);
}

static void init_next(model_job *mj)
{
    const struct expert_model_spec *m = mj->spec;
    struct expert_block_config c;
    expert_model_stage(m, mj->stage, &c);
    size_t n = 0;
    struct expert_tensor_info t[EXPERT_BLOCK_MAX_TENSORS];
    int rc = 0;
    if (expert_block_config_tensors(&c, t, &n) < 0)
        rc = capi_err(mj->job.err, mj->job.err_len, -EINVAL, "stage %d of '%s' is not a valid block",
                      mj->stage, m->name);
    else if (n != mj->n)
        rc = capi_err(mj->job.err, mj->job.err_len, -EINVAL, "stage %d of '%s' has %zu parameters, not %zu",
                      mj->stage, m->name, n, mj->n);
    else /* a peer's default --seed */
        expert_block_init_params(&c, expert_stage_seed(0, mj->stage), mj->params);
    capi_done(&mj->job, rc);
}

int starling_stage_init_params(starling_swarm *s, const char *model, int stage, float *params, size_t n, char *err,
                               size_t err_len)
{
    int rc = check_out(params, err, err_len);
    if (rc != 0)
        return rc;
    if (stage < 0)
        return capi_err(err, err_len, -EINVAL, "stage %d is out of range", stage);
    model_job mj = {.job = {.err = err, .err_len = err_len}, .name = model, .stage = stage, .params = params,
                    .n = n, .next = init_next};
    return run_model_job(s, &mj);
}

/* ---- DHT reads ---- */

typedef struct get_job {
    capi_job job;
    uint8_t key[DHT_ID_LEN];
    char **json;
    int count;
    /* holders */
    model_job mj;
    int stage;
    uint64_t hash;
    /* put */
    const void *value;
    size_t len;
    double ttl_s;
} get_job;

static int parse_key(uint8_t key[DHT_ID_LEN], const char *k, char *err, size_t err_len)
{
    if (!k || !*k)
        return capi_err(err, err_len, -EINVAL, "no key given");
    if (!strncmp(k, "0x", 2)) {
        if (strlen(k) != 2 + 2 * DHT_ID_LEN || dht_id_from_hex(key, k + 2) != 0)
            return capi_err(err, err_len, -EINVAL, "key '%s' starts with 0x but is not 40 hex digits", k);
        return 0;
    }
    dht_id_of_bytes(key, k, strlen(k));
    return 0;
}

static void hex_json(capi_buf *b, const uint8_t *p, size_t n)
{
    capi_buf_printf(b, "\"");
    for (size_t i = 0; i < n; i++)
        capi_buf_printf(b, "%02x", p[i]);
    capi_buf_printf(b, "\"");
}

static void on_raw(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)d;
    get_job *g = ud;
    if (status < 0 && n == 0) {
        capi_done(&g->job, capi_err(g->job.err, g->job.err_len, status,
                                    status == -EHOSTUNREACH ? "no DHT node answered the lookup" : "lookup failed: %s",
                                    strerror(-status)));
        return;
    }
    uint64_t now = dht_now_ms();
    capi_buf b = {0};
    capi_buf_printf(&b, "[");
    for (size_t i = 0; i < n; i++) {
        capi_buf_printf(&b, "%s{\"subkey\":", i ? "," : "");
        hex_json(&b, e[i].subkey, e[i].subkey_len);
        capi_buf_printf(&b, ",\"value\":");
        hex_json(&b, e[i].value, e[i].value_len);
        capi_buf_printf(&b, ",\"signed\":%s,\"expires_in_s\":%.3f}", e[i].is_signed ? "true" : "false",
                        e[i].expires > now ? (double)(e[i].expires - now) / 1000.0 : 0.0);
    }
    capi_buf_printf(&b, "]");
    int rc = capi_buf_take(&b, g->json, g->job.err, g->job.err_len);
    capi_done(&g->job, rc == 0 ? (int)n : rc);
}

static void get_start(capi_job *j)
{
    get_job *g = (get_job *)j;
    int rc = dht_get(j->s->d, g->key, on_raw, g);
    if (rc != 0)
        capi_done(j, capi_err(j->err, j->err_len, rc, "cannot start the lookup: %s", strerror(-rc)));
}

int starling_swarm_get(starling_swarm *s, const char *key, char **json, char *err, size_t err_len)
{
    int rc = check_out(json, err, err_len);
    if (rc != 0)
        return rc;
    *json = NULL;
    if (!s)
        return capi_err(err, err_len, -EINVAL, "no swarm handle");
    get_job g = {.job = {.start = get_start, .err = err, .err_len = err_len}, .json = json};
    rc = parse_key(g.key, key, err, err_len);
    return rc ? rc : capi_run(s, &g.job);
}

static void on_put(dht *d, int status, void *ud)
{
    (void)d;
    get_job *g = ud;
    if (status < 0)
        capi_err(g->job.err, g->job.err_len, status, "no DHT node stored the record: %s", strerror(-status));
    capi_done(&g->job, status);
}

static void put_start(capi_job *j)
{
    get_job *g = (get_job *)j;
    uint64_t exp = dht_now_ms() + (uint64_t)(g->ttl_s * 1000.0);
    int rc = dht_put(j->s->d, g->key, NULL, 0, g->value, g->len, exp, 1, on_put, g);
    if (rc != 0)
        capi_done(j, capi_err(j->err, j->err_len, rc, "cannot store the record: %s", strerror(-rc)));
}

int starling_swarm_put(starling_swarm *s, const char *key, const void *value, size_t len, double ttl_s, char *err,
                       size_t err_len)
{
    if (err && err_len)
        err[0] = '\0';
    if (!s)
        return capi_err(err, err_len, -EINVAL, "no swarm handle");
    if (!value && len > 0)
        return capi_err(err, err_len, -EINVAL, "value is NULL");
    if (len > DHT_MAX_VALUE)
        return capi_err(err, err_len, -EINVAL, "value is %zu bytes; at most %d", len, (int)DHT_MAX_VALUE);
    if (!(ttl_s >= 1 && ttl_s <= 86400))
        return capi_err(err, err_len, -EINVAL, "ttl %g s is not in [1, 86400]", ttl_s);
    get_job g = {.job = {.start = put_start, .err = err, .err_len = err_len}, .value = value, .len = len,
                 .ttl_s = ttl_s};
    int rc = parse_key(g.key, key, err, err_len);
    return rc ? rc : capi_run(s, &g.job);
}

/* ---- the models index ---- */

typedef struct model_row {
    char name[49];
    int stages, announcers, has_desc;
    uint8_t desc[20];
} model_row;

static int by_name(const void *a, const void *b)
{
    return strcmp(((const model_row *)a)->name, ((const model_row *)b)->name);
}

static void on_models(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)d;
    get_job *g = ud;
    if (status < 0 && n == 0) {
        capi_done(&g->job, capi_err(g->job.err, g->job.err_len, status, "the models index lookup failed: %s",
                                    status == -EHOSTUNREACH ? "no DHT node answered" : strerror(-status)));
        return;
    }
    model_row rows[MAX_MODELS];
    int nr = 0;
    for (size_t i = 0; i < n; i++) {
        peer_model_record m;
        if (!e[i].is_signed || peer_model_record_decode(&m, e[i].value, e[i].value_len) != 0)
            continue;
        int k = 0;
        while (k < nr && strcmp(rows[k].name, m.model))
            k++;
        if (k == nr) {
            if (nr == MAX_MODELS)
                continue;
            memset(&rows[nr], 0, sizeof rows[nr]);
            snprintf(rows[nr].name, sizeof rows[nr].name, "%s", m.model);
            rows[nr].stages = m.n_stages;
            nr++;
        }
        rows[k].announcers++;
        if (m.has_desc && !rows[k].has_desc) {
            rows[k].has_desc = 1;
            memcpy(rows[k].desc, m.desc_hash, 20);
        }
    }
    qsort(rows, (size_t)nr, sizeof rows[0], by_name);
    capi_buf b = {0};
    capi_buf_printf(&b, "[");
    for (int k = 0; k < nr; k++) {
        capi_buf_printf(&b, "%s{\"model\":", k ? "," : "");
        capi_buf_json_str(&b, rows[k].name);
        capi_buf_printf(&b, ",\"stages\":%d,\"description\":", rows[k].stages);
        if (rows[k].has_desc)
            hex_json(&b, rows[k].desc, 20);
        else
            capi_buf_printf(&b, "null");
        capi_buf_printf(&b, ",\"announcers\":%d}", rows[k].announcers);
    }
    capi_buf_printf(&b, "]");
    int rc = capi_buf_take(&b, g->json, g->job.err, g->job.err_len);
    capi_done(&g->job, rc == 0 ? nr : rc);
}

static void models_start(capi_job *j)
{
    get_job *g = (get_job *)j;
    dht_id_of_bytes(g->key, PEER_MODELS_KEY, strlen(PEER_MODELS_KEY));
    int rc = dht_get(j->s->d, g->key, on_models, g);
    if (rc != 0)
        capi_done(j, capi_err(j->err, j->err_len, rc, "cannot start the lookup: %s", strerror(-rc)));
}

int starling_swarm_models(starling_swarm *s, char **json, char *err, size_t err_len)
{
    int rc = check_out(json, err, err_len);
    if (rc != 0)
        return rc;
    *json = NULL;
    if (!s)
        return capi_err(err, err_len, -EINVAL, "no swarm handle");
    get_job g = {.job = {.start = models_start, .err = err, .err_len = err_len}, .json = json};
    return capi_run(s, &g.job);
}

/* ---- a stage's holders ---- */

static void on_holders(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)d;
    get_job *g = ud;
    if (status < 0 && n == 0) {
        capi_done(&g->mj.job, capi_err(g->mj.job.err, g->mj.job.err_len, status, "the holders lookup failed: %s",
                                       status == -EHOSTUNREACH ? "no DHT node answered" : strerror(-status)));
        return;
    }
    uint64_t now = dht_now_ms();
    capi_buf b = {0};
    int count = 0;
    char id[DHT_ID_HEX_LEN + 1];
    capi_buf_printf(&b, "[");
    for (size_t i = 0; i < n; i++) {
        swarm_holder h;
        if (!swarm_holder_read(&h, &e[i], NULL, g->hash))
            continue;
        const peer_announce *a = &h.ann;
        dht_id_to_hex(id, h.id);
        capi_buf_printf(&b, "%s{\"id\":\"%s\",\"addr\":", count ? "," : "", id);
        capi_buf_json_str(&b, a->addr);
        capi_buf_printf(&b, ",\"state\":\"%s\",\"usable\":%s,\"throughput\":%.3f,\"load\":%.4f,"
                            "\"weight_version\":%llu,\"device\":",
                        peer_state_name(a->state),
                        h.usable ? "true" : "false", a->throughput,
                        a->load, (unsigned long long)a->weight_version);
        capi_buf_json_str(&b, a->device);
        capi_buf_printf(&b, ",\"precision\":");
        capi_buf_json_str(&b, a->precision[0] ? a->precision : "fp32");
        capi_buf_printf(&b, ",\"age_s\":%.3f,\"avg_rounds\":%llu,\"grads_refused\":%llu,\"frozen\":%s}",
                        now > a->time_ms ? (double)(now - a->time_ms) / 1000.0 : 0.0,
                        (unsigned long long)a->avg_rounds, (unsigned long long)a->grads_refused,
                        a->frozen_steps ? "true" : "false");
        count++;
    }
    capi_buf_printf(&b, "]");
    int rc = capi_buf_take(&b, g->json, g->mj.job.err, g->mj.job.err_len);
    capi_done(&g->mj.job, rc == 0 ? count : rc);
}

static void holders_next(model_job *mj)
{
    get_job *g = (get_job *)((char *)mj - offsetof(get_job, mj));
    char name[80];
    snprintf(name, sizeof name, "%s.%d", mj->spec->name, mj->stage);
    dht_id_of_bytes(g->key, name, strlen(name));
    g->hash = expert_stage_hash(mj->spec, mj->stage);
    int rc = dht_get(mj->job.s->d, g->key, on_holders, g);
    if (rc != 0)
        capi_done(&mj->job, capi_err(mj->job.err, mj->job.err_len, rc, "cannot start the lookup: %s", strerror(-rc)));
}

int starling_swarm_holders(starling_swarm *s, const char *model, int stage, char **json, char *err, size_t err_len)
{
    int rc = check_out(json, err, err_len);
    if (rc != 0)
        return rc;
    *json = NULL;
    if (!s)
        return capi_err(err, err_len, -EINVAL, "no swarm handle");
    if (stage < 0)
        return capi_err(err, err_len, -EINVAL, "stage %d is out of range", stage);
    get_job g = {.json = json};
    g.mj = (model_job){.job = {.err = err, .err_len = err_len}, .name = model, .stage = stage, .next = holders_next};
    return run_model_job(s, &g.mj);
}
