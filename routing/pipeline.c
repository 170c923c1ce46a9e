#include "routing/pipeline.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum slot_state { SLOT_FREE = 0, SLOT_FWD, SLOT_BWD };

typedef struct slot {
    enum slot_state state;
    int stage;            /* stage of the next/outstanding call */
    int taken;            /* a call for this slot is out with the driver */
    int attempt;          /* attempts of the current call so far */
    uint32_t gen;         /* bumps on every call taken: stale tokens miss */
    uint64_t seq;
    int rows;
    int retries;
    int refusals;         /* -ERANGE answers to its backward calls */
    int forward_only;     /* evaluation: stop after the loss */
    double loss_sum;
    int correct;
    uint8_t *labels;      /* (max_batch, labels_per_row) */
    float **acts;         /* acts[s] is (rows, widths[s]), s = 0..S */
    float *grad[2];       /* ping-pong (rows, max width) */
} slot;

struct route_pipeline {
    int S, max_batch, max_inflight, max_width;
    int labels_per_row;
    int widths[ROUTE_PIPELINE_MAX_STAGES + 1];
    route_loss_fn loss;
    void *loss_ctx;
    slot slots[ROUTE_PIPELINE_MAX_INFLIGHT];
    route_batch_result results[ROUTE_PIPELINE_MAX_INFLIGHT];
    int res_head, res_count;
    int active;           /* slots not FREE */
    int outstanding;
    uint64_t next_seq, failed;
    uint64_t retries;     /* calls reported failed, all batches */
    int max_refusals;
    uint64_t refusals, refused_batches, refused_rows;
    void *mem;            /* the one allocation behind every buffer */
};

route_pipeline *route_pipeline_create(const route_pipeline_config *cfg)
{
    if (!cfg || cfg->n_stages < 1 || cfg->n_stages > ROUTE_PIPELINE_MAX_STAGES || !cfg->widths ||
        cfg->max_batch < 1 || cfg->max_inflight < 1 ||
        cfg->max_inflight > ROUTE_PIPELINE_MAX_INFLIGHT || !cfg->loss || cfg->labels_per_row < 0 ||
        cfg->labels_per_row > (1 << 16))
        return NULL;
    route_pipeline *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    p->S = cfg->n_stages;
    p->max_batch = cfg->max_batch;
    p->labels_per_row = cfg->labels_per_row ? cfg->labels_per_row : 1;
    p->max_inflight = cfg->max_inflight;
    p->loss = cfg->loss;
    p->loss_ctx = cfg->loss_ctx;
    p->max_refusals = cfg->max_refusals > 0 ? cfg->max_refusals : ROUTE_PIPELINE_MAX_REFUSALS;
    size_t act_floats = 0;
    for (int s = 0; s <= p->S; s++) {
        if (cfg->widths[s] < 1 || cfg->widths[s] > (1 << 20)) {
            free(p);
            return NULL;
        }
        p->widths[s] = cfg->widths[s];
        if (cfg->widths[s] > p->max_width)
            p->max_width = cfg->widths[s];
        act_floats += (size_t)cfg->widths[s];
    }
    /* Per slot: activations, two gradient buffers, the act pointer table and
     * the labels, all carved from one allocation. */
    size_t B = (size_t)p->max_batch;
    size_t per_slot_floats = B * (act_floats + 2 * (size_t)p->max_width);
    size_t per_slot = per_slot_floats * sizeof(float) + (size_t)(p->S + 1) * sizeof(float *) +
                      B * (size_t)p->labels_per_row;
    per_slot = (per_slot + 63) & ~(size_t)63;
    p->mem = calloc((size_t)p->max_inflight, per_slot);
    if (!p->mem) {
        free(p);
        return NULL;
    }
    for (int i = 0; i < p->max_inflight; i++) {
        char *base = (char *)p->mem + (size_t)i * per_slot;
        float *f = (float *)base;
        slot *sl = &p->slots[i];
        sl->acts = (float **)(base + per_slot_floats * sizeof(float));
        for (int s = 0; s <= p->S; s++) {
            sl->acts[s] = f;
            f += B * (size_t)p->widths[s];
        }
        sl->grad[0] = f;
        f += B * (size_t)p->max_width;
        sl->grad[1] = f;
        sl->labels = (uint8_t *)(sl->acts + p->S + 1);
    }
    return p;
}

void route_pipeline_destroy(route_pipeline **pp)
{
    if (!pp || !*pp)
        return;
    free((*pp)->mem);
    free(*pp);
    *pp = NULL;
}

static int64_t push(route_pipeline *p, const float *x, const uint8_t *labels, int rows, int fwd_only)
{
    if (!p || !x || !labels || rows < 1 || rows > p->max_batch)
        return -EINVAL;
    if (p->active + p->res_count >= p->max_inflight)
        return -EAGAIN;
    slot *sl = NULL;
    for (int i = 0; i < p->max_inflight; i++)
        if (p->slots[i].state == SLOT_FREE) {
            sl = &p->slots[i];
            break;
        }
    if (!sl)
        return -EAGAIN;
    memcpy(sl->acts[0], x, (size_t)rows * (size_t)p->widths[0] * sizeof(float));
    memcpy(sl->labels, labels, (size_t)rows * (size_t)p->labels_per_row);
    sl->state = SLOT_FWD;
    sl->stage = 0;
    sl->taken = 0;
    sl->attempt = 0;
    sl->seq = p->next_seq++;
    sl->rows = rows;
    sl->retries = 0;
    sl->refusals = 0;
    sl->forward_only = fwd_only;
    sl->loss_sum = 0;
    sl->correct = 0;
    p->active++;
    return (int64_t)sl->seq;
}

int64_t route_pipeline_push(route_pipeline *p, const float *x, const uint8_t *labels, int rows)
{
    return push(p, x, labels, rows, 0);
}

int64_t route_pipeline_push_eval(route_pipeline *p, const float *x, const uint8_t *labels, int rows)
{
    return push(p, x, labels, rows, 1);
}

int route_pipeline_next_call(route_pipeline *p, route_call *call)
{
    if (!p || !call)
        return 0;
    slot *best = NULL;
    for (int i = 0; i < p->max_inflight; i++) {
        slot *sl = &p->slots[i];
        if (sl->state == SLOT_FREE || sl->taken)
            continue;
        /* Backward first (frees activations sooner), then the oldest batch. */
        if (!best || (sl->state == SLOT_BWD && best->state != SLOT_BWD) ||
            (sl->state == best->state && sl->seq < best->seq))
            best = sl;
    }
    if (!best)
        return 0;
    int idx = (int)(best - p->slots);
    int s = best->stage;
    best->taken = 1;
    best->gen++;
    p->outstanding++;
    memset(call, 0, sizeof *call);
    call->token = (best->gen << 8) | (uint32_t)idx;
    call->slot = idx;
    call->kind = best->state == SLOT_BWD ? ROUTE_CALL_BACKWARD : ROUTE_CALL_FORWARD;
    call->stage = s;
    call->rows = best->rows;
    call->width_in = p->widths[s];
    call->width_out = p->widths[s + 1];
    call->inputs = best->acts[s];
    call->attempt = best->attempt;
    if (call->kind == ROUTE_CALL_FORWARD) {
        call->outputs = best->acts[s + 1];
    } else {
        call->grad_outputs = best->grad[(s + 1) & 1];
        call->outputs = best->grad[s & 1];
        call->need_grad_inputs = s > 0;
    }
    return 1;
}

static void finish(route_pipeline *p, slot *sl, int refused)
{
    int at = (p->res_head + p->res_count) % p->max_inflight;
    route_batch_result *r = &p->results[at];
    r->seq = sl->seq;
    r->rows = sl->rows;
    r->loss_sum = sl->loss_sum;
    r->correct = sl->correct;
    r->retries = sl->retries;
    r->forward_only = sl->forward_only;
    r->refused = refused;
    r->refusals = sl->refusals;
    if (refused) {
        p->refused_batches++;
        p->refused_rows += (uint64_t)sl->rows;
    }
    p->res_count++;
    sl->state = SLOT_FREE;
    p->active--;
}

int route_pipeline_call_done(route_pipeline *p, uint32_t token, int status)
{
    if (!p)
        return -EINVAL;
    uint32_t idx = token & 0xFF;
    if (idx >= (uint32_t)p->max_inflight)
        return -ENOENT;
    slot *sl = &p->slots[idx];
    if (sl->state == SLOT_FREE || !sl->taken || (token >> 8) != (sl->gen & 0xFFFFFFu))
        return -ENOENT;
    sl->taken = 0;
    p->outstanding--;
    if (status == -ERANGE && sl->state == SLOT_BWD) {
        /* Refused: the holder's checks found the gradient out of bounds.
         * When every replica keeps refusing, the fault is ours (the loss
         * blew up): drop this batch's update rather than retry forever. */
        sl->refusals++;
        p->refusals++;
        if (sl->refusals >= p->max_refusals) {
            finish(p, sl, 1);
            return 0;
        }
    }
    if (status != 0) {
        sl->attempt++;
        sl->retries++;
        p->retries++;
        return 0;
    }
    sl->attempt = 0;
    if (sl->state == SLOT_FWD) {
        if (sl->stage + 1 < p->S) {
            sl->stage++;
            return 0;
        }
        int rc = p->loss(p->loss_ctx, sl->acts[p->S], sl->labels, sl->rows, p->widths[p->S],
                         sl->grad[p->S & 1], &sl->loss_sum, &sl->correct);
        if (rc != 0) {
            p->failed++;
            sl->state = SLOT_FREE;
            p->active--;
            return rc;
        }
        if (sl->forward_only) {
            finish(p, sl, 0);
            return 0;
        }
        sl->state = SLOT_BWD;
        sl->stage = p->S - 1;
        return 0;
    }
    if (sl->stage > 0) {
        sl->stage--;
        return 0;
    }
    finish(p, sl, 0);
    return 0;
}

int route_pipeline_pop_result(route_pipeline *p, route_batch_result *out)
{
    if (!p || !out || p->res_count == 0)
        return 0;
    *out = p->results[p->res_head];
    p->res_head = (p->res_head + 1) % p->max_inflight;
    p->res_count--;
    return 1;
}

int route_pipeline_inflight(const route_pipeline *p)
{
    return p ? p->active + p->res_count : 0;
}

int route_pipeline_outstanding(const route_pipeline *p)
{
    return p ? p->outstanding : 0;
}

uint64_t route_pipeline_retries(const route_pipeline *p)
{
    return p ? p->retries : 0;
}

uint64_t route_pipeline_failed(const route_pipeline *p)
{
    return p ? p->failed : 0;
}

uint64_t route_pipeline_refusals(const route_pipeline *p)
{
    return p ? p->refusals : 0;
}

uint64_t route_pipeline_refused_batches(const route_pipeline *p)
{
    return p ? p->refused_batches : 0;
}

uint64_t route_pipeline_refused_rows(const route_pipeline *p)
{
    return p ? p->refused_rows : 0;
}

/* ---- error notes ---- */

void route_errlog_init(route_errlog *e, double period_s, double now)
{
    memset(e, 0, sizeof *e);
    e->period_s = period_s > 0 ? period_s : 10;
    e->last_summary = now;
}

int route_errlog_add(route_errlog *e, int stage, int code, const char *sentence)
{
    route_errlog_kind *k = NULL;
    for (int i = 0; i < e->n; i++)
        if (e->k[i].stage == stage && e->k[i].code == code)
            k = &e->k[i];
    int first = 0;
    if (!k) {
        if (e->n == ROUTE_ERRLOG_KINDS) {
            e->dropped++;
            return 0;
        }
        k = &e->k[e->n++];
        memset(k, 0, sizeof *k);
        k->stage = stage;
        k->code = code;
        first = 1;
    } else {
        k->pending++;
    }
    k->total++;
    snprintf(k->last, sizeof k->last, "%s", sentence ? sentence : "");
    return first;
}

int route_errlog_flush(route_errlog *e, double now, void (*line)(void *arg, const route_errlog_kind *k),
                       void *arg)
{
    if (now - e->last_summary < e->period_s)
        return 0;
    int n = 0;
    for (int i = 0; i < e->n; i++)
        if (e->k[i].pending > 0) {
            if (line)
                line(arg, &e->k[i]);
            e->k[i].pending = 0;
            n++;
        }
    if (n > 0)
        e->last_summary = now;
    return n;
}
