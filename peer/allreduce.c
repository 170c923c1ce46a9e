#include "peer/allreduce.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <sodium.h>

#include "dht/addr.h"
#include "peer/rpc_client.h"
#include "peer/wire.h"

#define RETRY_MS 10

typedef struct ar_link {
    struct peer_allreduce *ar;
    int j;
    peer_rpc_client *cl;
    uv_timer_t retry;
    int timer_open;
    size_t off, len, pos;          /* the slice this phase pulls from member j */
    double weight;                 /* member j's weight (phase 1) */
    int done;
} ar_link;

struct peer_allreduce {
    uv_loop_t *loop;
    peer_service *svc;
    int bi;
    char block[PEER_WIRE_MAX_BLOCK + 1];
    uint64_t round;
    uint8_t digest[PEER_AVG_DIGEST_LEN];
    int n, me, with_optim;
    size_t nflat, part_off, part_len;
    float *acc;                    /* our part: the weighted sum, then the average */
    double wsum, wself;
    float *avg;                    /* the whole result (phase 2) */
    ar_link links[PEER_ALLREDUCE_MAX_MEMBERS];
    int phase, remaining;
    uv_timer_t deadline;
    int handles;                   /* open clients and timers */
    int finished, status;
    peer_allreduce_result res;
    uint64_t t0;
    peer_allreduce_cb cb;
    void *arg;
};

void peer_allreduce_digest(uint8_t out[PEER_AVG_DIGEST_LEN], uint64_t round,
                           const uint8_t (*ids)[DHT_ID_LEN], const uint8_t *tags, int n)
{
    crypto_generichash_state st;
    uint8_t r[8];
    peer_put_le64(r, round);
    crypto_generichash_init(&st, NULL, 0, PEER_AVG_DIGEST_LEN);
    crypto_generichash_update(&st, (const uint8_t *)"starling.avg.v1", 15);
    crypto_generichash_update(&st, r, sizeof r);
    for (int i = 0; i < n; i++) {
        crypto_generichash_update(&st, ids[i], DHT_ID_LEN);
        crypto_generichash_update(&st, tags ? &tags[i] : (const uint8_t *)"", 1);
    }
    crypto_generichash_final(&st, out, PEER_AVG_DIGEST_LEN);
}

static void on_handle_closed(uv_handle_t *h);

static void release(peer_allreduce *ar)
{
    if (--ar->handles > 0)
        return;
    ar->res.seconds = (double)(uv_now(ar->loop) - ar->t0) / 1000.0;
    ar->cb(ar->arg, ar->status, &ar->res);
    free(ar->acc);
    free(ar->avg);
    free(ar);
}

static void on_client_closed(peer_rpc_client *cl, void *arg)
{
    peer_rpc_client_destroy(&cl);
    release(arg);
}

static void on_handle_closed(uv_handle_t *h)
{
    release(h->data);
}

static void finish(peer_allreduce *ar, int status)
{
    if (ar->finished)
        return;
    ar->finished = 1;
    ar->status = status;
    if (status == 0) {
        ar->status = peer_service_avg_apply(ar->svc, ar->bi, ar->avg, ar->with_optim, &ar->res.dist_before,
                                            &ar->res.dist_after);
    } else if (ar->phase == 1) {
        /* Our part will never be reduced: the others must not wait for it. */
        peer_service_avg_fail(ar->svc, ar->bi, status);
    }
    /* A failure after our part was published leaves it served, so members
     * still pulling can finish; the daemon releases it later. */
    uv_timer_stop(&ar->deadline);
    uv_close((uv_handle_t *)&ar->deadline, on_handle_closed);
    for (int j = 0; j < ar->n; j++) {
        ar_link *l = &ar->links[j];
        if (j == ar->me)
            continue;
        if (l->timer_open) {
            uv_timer_stop(&l->retry);
            uv_close((uv_handle_t *)&l->retry, on_handle_closed);
        }
        if (l->cl)
            peer_rpc_client_close(l->cl, on_client_closed, ar);
    }
}

static void pull(ar_link *l);

static void start_phase2(peer_allreduce *ar)
{
    if (!(ar->wsum > 0)) {
        /* Every member still has its initial weights: nothing to average. */
        finish(ar, -ENODATA);
        return;
    }
    float inv = (float)(1.0 / ar->wsum);
    for (size_t k = 0; k < ar->part_len; k++)
        ar->acc[k] *= inv;
    for (size_t k = 0; k < ar->part_len; k++)
        if (!isfinite(ar->acc[k])) {
            finish(ar, -ERANGE);
            return;
        }
    peer_service_avg_reduced(ar->svc, ar->bi, ar->acc);
    memcpy(ar->avg + ar->part_off, ar->acc, ar->part_len * sizeof(float));
    ar->res.weight_self = ar->wself / ar->wsum;
    ar->phase = 2;
    ar->remaining = 0;
    for (int j = 0; j < ar->n; j++) {
        ar_link *l = &ar->links[j];
        if (j == ar->me)
            continue;
        peer_avg_part(ar->nflat, ar->n, j, &l->off, &l->len);
        l->pos = 0;
        l->done = l->len == 0;
        if (!l->done)
            ar->remaining++;
    }
    if (ar->remaining == 0) {
        finish(ar, 0);
        return;
    }
    for (int j = 0; j < ar->n && !ar->finished; j++)
        if (j != ar->me && !ar->links[j].done)
            pull(&ar->links[j]);
}

static void link_done(ar_link *l)
{
    peer_allreduce *ar = l->ar;
    l->done = 1;
    if (--ar->remaining > 0)
        return;
    if (ar->phase == 1)
        start_phase2(ar);
    else
        finish(ar, 0);
}

static void on_retry(uv_timer_t *t)
{
    ar_link *l = t->data == NULL ? NULL : (ar_link *)((char *)t - offsetof(ar_link, retry));
    if (l && !l->ar->finished)
        pull(l);
}

static void on_reply(void *arg, int status, const peer_msg *m)
{
    ar_link *l = arg;
    peer_allreduce *ar = l->ar;
    if (ar->finished)
        return;
    if (status != 0) {
        finish(ar, status);
        return;
    }
    if (m->kind == PEER_KIND_ERROR) {
        if (m->err_code == EAGAIN) {
            uv_timer_start(&l->retry, on_retry, RETRY_MS, 0);
            return;
        }
        finish(ar, m->err_code > 0 ? -m->err_code : -EIO);
        return;
    }
    size_t count = l->len - l->pos < PEER_AVG_MAX_COUNT ? l->len - l->pos : PEER_AVG_MAX_COUNT;
    if (!m->meta || m->meta_len != 24 || peer_get_le64(m->meta) != ar->round ||
        peer_get_le64((const uint8_t *)m->meta + 16) != ar->nflat || m->n_tensors != 1 ||
        m->t[0].dtype != PEER_DTYPE_F32 || m->t[0].nbytes != count * sizeof(float)) {
        finish(ar, -EBADMSG);
        return;
    }
    const float *x = m->t[0].data;
    ar->res.bytes_in += m->t[0].nbytes;
    if (ar->phase == 1) {
        uint64_t bits = peer_get_le64((const uint8_t *)m->meta + 8);
        double w;
        memcpy(&w, &bits, sizeof w);
        if (!(w >= 0.0) || !isfinite(w) || (l->pos > 0 && w != l->weight)) {
            finish(ar, -EBADMSG);
            return;
        }
        if (l->pos == 0) {
            l->weight = w;
            ar->wsum += w;
        }
        float fw = (float)w;
        float *acc = ar->acc + (l->off - ar->part_off) + l->pos;
        for (size_t k = 0; k < count; k++)
            acc[k] += fw * x[k];
    } else {
        memcpy(ar->avg + l->off + l->pos, x, count * sizeof(float));
    }
    l->pos += count;
    if (l->pos == l->len)
        link_done(l);
    else
        pull(l);
}

static void pull(ar_link *l)
{
    peer_allreduce *ar = l->ar;
    size_t count = l->len - l->pos < PEER_AVG_MAX_COUNT ? l->len - l->pos : PEER_AVG_MAX_COUNT;
    uint8_t meta[48];
    peer_put_le64(meta, ar->round);
    memcpy(meta + 8, ar->digest, PEER_AVG_DIGEST_LEN);
    peer_put_le64(meta + 24, ar->phase == 1 ? 0 : 1);
    peer_put_le64(meta + 32, l->off + l->pos);
    peer_put_le64(meta + 40, count);
    peer_msg req;
    peer_msg_init(&req, PEER_KIND_REQUEST, PEER_METHOD_AVG, 0);
    snprintf(req.block, sizeof req.block, "%s", ar->block);
    req.meta = meta;
    req.meta_len = sizeof meta;
    int rc = peer_rpc_call(l->cl, &req, 0, on_reply, l, NULL);
    if (rc != 0)
        finish(ar, rc);
}

static void on_connect(peer_rpc_client *cl, int status, void *arg)
{
    (void)cl;
    ar_link *l = arg;
    if (l->ar->finished)
        return;
    if (status != 0)
        finish(l->ar, status);
    else if (l->done)
        link_done(l); /* an empty slice: nothing to pull */
    else
        pull(l);
}

static void on_deadline(uv_timer_t *t)
{
    finish(t->data, -ETIMEDOUT);
}

int peer_allreduce_start(const peer_allreduce_config *c, peer_allreduce **out)
{
    if (!c || !out || !c->loop || !c->self || !c->svc || !c->block_name || !c->digest || !c->members ||
        !c->cb || c->n < 2 || c->n > PEER_ALLREDUCE_MAX_MEMBERS || c->me < 0 || c->me >= c->n ||
        strlen(c->block_name) > PEER_WIRE_MAX_BLOCK || !(c->timeout_s > 0))
        return -EINVAL;
    struct sockaddr_storage ss[PEER_ALLREDUCE_MAX_MEMBERS];
    for (int j = 0; j < c->n; j++) {
        dht_addr a;
        if (j != c->me && (dht_addr_parse(&a, c->members[j].addr) != 0 || dht_addr_to_sockaddr(&a, &ss[j]) < 0))
            return -EINVAL;
    }
    peer_allreduce *ar = calloc(1, sizeof *ar);
    if (!ar)
        return -ENOMEM;
    ar->loop = c->loop;
    ar->svc = c->svc;
    ar->bi = c->block;
    snprintf(ar->block, sizeof ar->block, "%s", c->block_name);
    ar->round = c->round;
    memcpy(ar->digest, c->digest, PEER_AVG_DIGEST_LEN);
    ar->n = c->n;
    ar->me = c->me;
    ar->with_optim = c->with_optim;
    ar->cb = c->cb;
    ar->arg = c->arg;
    ar->res.n = c->n;
    ar->t0 = uv_now(c->loop);
    int rc = peer_service_avg_begin(c->svc, c->block, c->round, c->digest, c->n, c->me, &ar->wself, &ar->nflat);
    if (rc != 0) {
        free(ar);
        return rc;
    }
    peer_avg_part(ar->nflat, ar->n, ar->me, &ar->part_off, &ar->part_len);
    ar->acc = malloc((ar->part_len ? ar->part_len : 1) * sizeof(float));
    ar->avg = malloc(ar->nflat * sizeof(float));
    if (!ar->acc || !ar->avg) {
        peer_service_avg_release(c->svc, c->block);
        free(ar->acc);
        free(ar->avg);
        free(ar);
        return -ENOMEM;
    }
    const float *base = peer_service_avg_base(c->svc, c->block);
    float fw = (float)ar->wself;
    for (size_t k = 0; k < ar->part_len; k++)
        ar->acc[k] = fw * base[ar->part_off + k];
    ar->wsum = ar->wself;
    ar->phase = 1;

    uv_timer_init(c->loop, &ar->deadline);
    ar->deadline.data = ar;
    ar->handles = 1;
    uv_timer_start(&ar->deadline, on_deadline, (uint64_t)(c->timeout_s * 1000), 0);
    peer_rpc_client_config cc;
    memset(&cc, 0, sizeof cc);
    cc.self = c->self;
    cc.swarm_key = c->swarm_key;
    cc.max_pending = 4;
    for (int j = 0; j < c->n; j++) {
        ar_link *l = &ar->links[j];
        l->ar = ar;
        l->j = j;
        if (j == c->me)
            continue;
        l->off = ar->part_off;
        l->len = ar->part_len;
        l->done = ar->part_len == 0;
        ar->remaining++;
        uv_timer_init(c->loop, &l->retry);
        l->retry.data = ar; /* non-NULL: on_retry finds the link by offset */
        l->timer_open = 1;
        ar->handles++;
        cc.expect_id = c->members[j].id;
        l->cl = peer_rpc_client_create(c->loop, &cc);
        if (l->cl) {
            ar->handles++;
            if (peer_rpc_client_connect(l->cl, (const struct sockaddr *)&ss[j], on_connect, l) != 0) {
                finish(ar, -ECONNREFUSED);
                break;
            }
        } else {
            finish(ar, -ENOMEM);
            break;
        }
    }
    *out = ar;
    return 0;
}

void peer_allreduce_cancel(peer_allreduce *ar)
{
    if (ar)
        finish(ar, -ECANCELED);
}
