/* Group averaging over real loopback RPC: three replicas of a block run the
 * butterfly all-reduce and each ends with the sample-weighted average of
 * the three (parameters and optimizer state), the same on all of them; a
 * member that fails or vanishes mid-round leaves the others' weights
 * bit-for-bit unchanged; a member serving NaN or 1e30 is left out or
 * clipped; bad averaging requests get clear errors. In diloco mode two
 * consecutive rounds give, element by element, the outer Nesterov step
 * computed here from the members' real tensors, leave the moments alone,
 * and a diloco member never forms a group with a mean one. Compressed
 * rounds (--average-format f16, q8) in both modes give every member the
 * values computed here, bit for bit, from one common average that is
 * within the format's bound of the f32 round's; q8 costs 3.76x fewer
 * bytes; diloco's error feedback carries what one round's q8 lost into
 * the next; members of different formats never group; a slice in the
 * wrong format or with a negative q8 scale fails the round cleanly. */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <netinet/in.h>

#include <uv.h>

#include "expert/block.h"
#include "peer/allreduce.h"
#include "peer/averaging.h"
#include "peer/peer.h"
#include "peer/service.h"
#include "net/tensorfmt.h"
#include "test_util.h"
#include "test_rpc_util.h"

#define N 3
#define STAGE 0 /* Linear 784 -> 512: 401,920 parameters, several chunks per part */
#define BLOCK "fmnist-mlp.0"

static uv_loop_t loop;
static dht_identity ids[N], id_cli;
static peer_service *svc[N];
static peer_allreduce_server *rounds[N]; /* svc[k]'s; the service frees it */
static int ports[N];
static peer_allreduce_member members[N];

static void run_until(volatile int *flag)
{
    test_run_until(&loop, flag, 30000);
}

static peer_service *start(int k, unsigned seed)
{
    char err[256] = "";
    static const int blocks[1] = {STAGE};
    peer_service_config c;
    memset(&c, 0, sizeof c);
    c.self = &ids[k];
    c.model = "fmnist-mlp";
    c.blocks = blocks;
    c.n_blocks = 1;
    c.threads = 1;
    c.max_batch = 16;
    c.max_queue_rows = 64;
    expert_optim_default_adamw(&c.optim);
    c.optim.target_batch = 16;
    c.seed = seed;
    peer_service *s = peer_service_create(&loop, &c, err, sizeof err);
    if (!s)
        fail_msg("peer_service_create: %s", err);
    struct sockaddr_in sa;
    uv_ip4_addr("127.0.0.1", 0, &sa);
    assert_int_equal(peer_service_listen(s, (const struct sockaddr *)&sa), 0);
    ports[k] = peer_service_port(s);
    memcpy(members[k].id, ids[k].id, DHT_ID_LEN);
    snprintf(members[k].addr, sizeof members[k].addr, "127.0.0.1:%d", ports[k]);
    return s;
}

static void closed_svc(peer_service *s, int ck, void *arg)
{
    (void)s;
    (void)ck;
    *(int *)arg = 1;
}

static void stop_svc(int k)
{
    int done = 0;
    peer_service_stop(svc[k], closed_svc, &done);
    run_until(&done);
    peer_service_destroy(&svc[k]);
}

/* ---- a synchronous RPC helper ---- */

typedef struct reply {
    int done, status, err_code, kind;
    int dtype, block;              /* the first tensor's format */
    size_t nbytes;
    uint8_t meta[64];
    size_t meta_len;
} reply;

static void on_reply(void *arg, int status, const peer_msg *m)
{
    reply *r = arg;
    r->done = 1;
    r->status = status;
    if (status)
        return;
    r->kind = m->kind;
    r->err_code = m->err_code;
    r->nbytes = m->n_tensors ? m->t[0].nbytes : 0;
    r->dtype = m->n_tensors ? (int)m->t[0].dtype : -1;
    r->block = m->n_tensors ? m->t[0].block : 0;
    r->meta_len = m->meta && m->meta_len <= sizeof r->meta ? m->meta_len : 0;
    if (r->meta_len)
        memcpy(r->meta, m->meta, r->meta_len);
}

static peer_rpc_client *connect_to(int k)
{
    return test_rpc_connect(&loop, &id_cli, ids[k].id, ports[k]);
}

static void close_client(peer_rpc_client **cl)
{
    test_rpc_close(&loop, cl);
}

/* The reply format the next call asks for (key 8; f32: none). */
static int call_fmt, call_fmt_block;

static void call(peer_rpc_client *cl, peer_method method, const void *meta, size_t meta_len, const float *a,
                 uint64_t rows, uint64_t wa, const float *b, uint64_t wb, reply *r)
{
    peer_msg m;
    peer_msg_init(&m, PEER_KIND_REQUEST, method, 0);
    m.reply_dtype = (peer_dtype)call_fmt;
    m.reply_block = call_fmt_block;
    snprintf(m.block, sizeof m.block, "%s", BLOCK);
    m.meta = meta;
    m.meta_len = meta_len;
    uint64_t sa[2] = {rows, wa}, sb[2] = {rows, wb};
    if (a)
        assert_int_equal(peer_tensor_f32(&m.t[m.n_tensors++], a, 2, sa), 0);
    if (b)
        assert_int_equal(peer_tensor_f32(&m.t[m.n_tensors++], b, 2, sb), 0);
    memset(r, 0, sizeof *r);
    assert_int_equal(peer_rpc_call(cl, &m, 20000, on_reply, r, NULL), 0);
    run_until(&r->done);
    assert_int_equal(r->status, 0);
}

/* Trains block k on `batches` backward requests of 16 random rows (the
 * optimizer steps every 16 rows), so its weight is 16 * batches + 1. */
static void train(int k, int batches, unsigned seed)
{
    peer_rpc_client *cl = connect_to(k);
    static float x[16 * 784], g[16 * 512];
    for (int b = 0; b < batches; b++) {
        for (size_t i = 0; i < sizeof x / sizeof x[0]; i++)
            x[i] = (float)rand_r(&seed) / (float)RAND_MAX - 0.5f;
        for (size_t i = 0; i < sizeof g / sizeof g[0]; i++)
            g[i] = (float)rand_r(&seed) / (float)RAND_MAX - 0.5f;
        reply r;
        call(cl, PEER_METHOD_BACKWARD, NULL, 0, x, 16, 784, g, 512, &r);
        assert_int_equal(r.kind, PEER_KIND_REPLY);
    }
    close_client(&cl);
}

/* The block's flat state (params, m, v) via a round's base: begin, copy,
 * release. */
static float *flat_of(int k, size_t *n_out)
{
    uint8_t dg[PEER_AVG_DIGEST_LEN] = {0};
    size_t n = 0;
    assert_int_equal(peer_allreduce_server_begin(rounds[k], 0, 1, dg, 1, 0, NULL, NULL, &n), 0);
    float *f = malloc(n * sizeof(float));
    assert_non_null(f);
    memcpy(f, peer_allreduce_server_base(rounds[k], 0), n * sizeof(float));
    peer_allreduce_server_release(rounds[k], 0);
    *n_out = n;
    return f;
}

typedef struct outcome {
    int done, status;
    peer_allreduce_result res;
} outcome;

static void on_done(void *arg, int status, const peer_allreduce_result *res)
{
    outcome *o = arg;
    o->done = 1;
    o->status = status;
    o->res = *res;
}

static int start_round_how(int k, uint64_t round, const uint8_t *digest, double timeout_s,
                           const peer_avg_method *how, outcome *o)
{
    peer_allreduce_config c;
    memset(&c, 0, sizeof c);
    c.loop = &loop;
    c.self = &ids[k];
    c.srv = rounds[k];
    c.block = 0;
    c.block_name = BLOCK;
    c.round = round;
    c.digest = digest;
    c.members = members;
    c.n = N;
    c.me = k;
    c.with_optim = 1;
    if (how)
        c.method = *how;
    c.timeout_s = timeout_s;
    c.cb = on_done;
    c.arg = o;
    memset(o, 0, sizeof *o);
    peer_allreduce *ar = NULL;
    return peer_allreduce_start(&c, &ar);
}

static int start_round(int k, uint64_t round, const uint8_t *digest, double timeout_s, outcome *o)
{
    return start_round_how(k, round, digest, timeout_s, NULL, o);
}

static void digest_for_mode(uint8_t *dg, uint64_t round, int mode)
{
    uint8_t idv[N][DHT_ID_LEN], tags[N] = {1, 1, 1};
    for (int k = 0; k < N; k++)
        memcpy(idv[k], ids[k].id, DHT_ID_LEN);
    peer_allreduce_digest(dg, round, (const uint8_t(*)[DHT_ID_LEN])idv, tags, N, mode);
}

static void digest_for(uint8_t *dg, uint64_t round)
{
    digest_for_mode(dg, round, PEER_AVG_MEAN);
}

static void start_all(void)
{
    /* Members sorted by node ID, as the daemon sorts them. */
    for (int i = 0; i < N; i++)
        for (int j = i + 1; j < N; j++)
            if (memcmp(ids[j].id, ids[i].id, DHT_ID_LEN) < 0) {
                dht_identity t = ids[i];
                ids[i] = ids[j];
                ids[j] = t;
            }
    for (int k = 0; k < N; k++) {
        svc[k] = start(k, 100u + (unsigned)k);
        rounds[k] = peer_allreduce_server_create(svc[k]);
        assert_non_null(rounds[k]);
    }
}

static void stop_all(void)
{
    for (int k = 0; k < N; k++)
        if (svc[k])
            stop_svc(k);
}

static void test_weighted_average(void **state)
{
    (void)state;
    start_all();
    /* Different initial weights (seeds) and different amounts of training:
     * member 0 trains 4 batches (weight 65), member 1 one (17), member 2
     * none: it still has its initial weights, so it takes the average and
     * adds nothing to it (0). */
    train(0, 4, 7);
    train(1, 1, 8);
    size_t n = 0;
    float *base[N];
    for (int k = 0; k < N; k++)
        base[k] = flat_of(k, &n);
    const double w[N] = {65, 17, 0}, wsum = 82;
    uint8_t dg[PEER_AVG_DIGEST_LEN];
    digest_for(dg, 42);
    outcome o[N];
    for (int k = 0; k < N; k++)
        assert_int_equal(start_round(k, 42, dg, 20.0, &o[k]), 0);
    for (int k = 0; k < N; k++)
        run_until(&o[k].done);
    for (int k = 0; k < N; k++) {
        assert_int_equal(o[k].status, 0);
        assert_int_equal(o[k].res.n, N);
        assert_true(fabs(o[k].res.weight_self - w[k] / wsum) < 1e-9);
        /* Our part from each of the others, then their parts: about
         * 2 (n-1)/n of the flat state came in. */
        size_t off, len, want = 0;
        peer_avg_part(n, N, k, &off, &len);
        want += (N - 1) * len;
        for (int j = 0; j < N; j++)
            if (j != k) {
                peer_avg_part(n, N, j, &off, &len);
                want += len;
            }
        assert_int_equal(o[k].res.bytes_in, want * sizeof(float));
        assert_true(o[k].res.dist_after <= 1e-4 * o[k].res.dist_before);
    }
    float *after[N];
    for (int k = 0; k < N; k++)
        after[k] = flat_of(k, &n);
    size_t nparam = n / 3;
    double max_err = 0, max_spread = 0, dist01 = 0;
    for (size_t i = 0; i < n; i++) {
        double want = 0;
        for (int k = 0; k < N; k++)
            want += w[k] * base[k][i];
        want /= wsum;
        for (int k = 0; k < N; k++) {
            double e = fabs(after[k][i] - want) / (1.0 + fabs(want));
            if (e > max_err)
                max_err = e;
            double s = fabs((double)after[k][i] - after[0][i]);
            if (s > max_spread)
                max_spread = s;
        }
        if (i < nparam)
            dist01 += ((double)base[0][i] - base[1][i]) * ((double)base[0][i] - base[1][i]);
        if (i >= 2 * nparam)
            assert_true(after[0][i] >= 0.0f); /* v stays non-negative */
    }
    print_message("weighted average: max rel error %.3g, spread between members %.3g, distance before %.3g\n",
                  max_err, max_spread, sqrt(dist01));
    assert_true(sqrt(dist01) > 1.0);  /* they really differed */
    assert_true(max_err < 1e-5);      /* everyone got sum(w x) / sum(w) */
    assert_true(max_spread < 1e-5);   /* and the same values */
    /* The optimizer state was averaged too: member 2 never stepped, yet
     * its moments now hold a share of the others'. */
    double m2 = 0;
    for (size_t i = nparam; i < 2 * nparam; i++)
        m2 += fabs(after[2][i]);
    assert_true(m2 > 0);
    for (int k = 0; k < N; k++) {
        free(base[k]);
        free(after[k]);
    }
    stop_all();
}

/* A hostile member (here member 2, whose served base is overwritten once
 * the round began): NaNs in every part are left out by every reducer, and
 * the honest members end with exactly the weighted mean of the two of
 * them; values of 1e30 are clipped, and the honest members end within the
 * robust reduce's guarantee of their mean (peer/allreduce.h). */
static void hostile_member(int nan)
{
    start_all();
    train(0, 4, 7);
    train(1, 1, 8);
    train(2, 1, 9);
    size_t n = 0;
    float *base[2];
    for (int k = 0; k < 2; k++)
        base[k] = flat_of(k, &n);
    uint8_t dg[PEER_AVG_DIGEST_LEN];
    digest_for(dg, 43);
    outcome o[N];
    for (int k = 0; k < N; k++)
        assert_int_equal(start_round(k, 43, dg, 20.0, &o[k]), 0);
    float *bad = (float *)peer_allreduce_server_base(rounds[2], 0); /* what member 2 serves */
    for (size_t i = 0; i < n; i++)
        if (!nan)
            bad[i] = 1e30f;
        else if (i % 5000 == 3)
            bad[i] = NAN;
    for (int k = 0; k < N; k++)
        run_until(&o[k].done);
    const double w[2] = {65, 17};
    size_t nparam = n / 3;
    for (int k = 0; k < 2; k++) {
        assert_int_equal(o[k].status, 0);
        if (nan)
            assert_int_equal(o[k].res.dropped, 1u << 2);
        else
            assert_int_equal(o[k].res.clipped, 1u << 2);
        float *after = flat_of(k, &n);
        double err = 0, dist[3] = {0}, spread[3] = {0};
        for (size_t i = 0; i < n; i++) {
            double mu = (w[0] * base[0][i] + w[1] * base[1][i]) / (w[0] + w[1]);
            double e = fabs(after[i] - mu), r = fabs((double)base[0][i] - base[1][i]);
            if (!(e <= INFINITY))
                fail_msg("member %d: element %zu is %g", k, i, after[i]);
            if (e / (1.0 + fabs(mu)) > err)
                err = e / (1.0 + fabs(mu));
            dist[i / nparam] += e * e;
            spread[i / nparam] += r * r;
        }
        print_message("hostile member (%s): member %d ends %.3g (max rel) from the honest mean; parameters "
                      "%.4g away, honest spread %.4g\n", nan ? "NaN" : "1e30", k, err, sqrt(dist[0]),
                      sqrt(spread[0]));
        if (nan)
            assert_true(err < 1e-5);
        else
            for (int s = 0; s < 3; s++)
                assert_true(sqrt(dist[s]) <= (1 + PEER_ALLREDUCE_CLIP_FACTOR) * sqrt(spread[s]) * 1.0001 + 1e-9);
        free(after);
    }
    for (int k = 0; k < 2; k++)
        free(base[k]);
    stop_all();
}

static void test_hostile_nan(void **state)
{
    (void)state;
    hostile_member(1);
}

static void test_hostile_huge(void **state)
{
    (void)state;
    hostile_member(0);
}

/* A member that fails before reducing its part: the others abandon the
 * round and keep their weights bit for bit. */
static void test_member_fails(void **state)
{
    (void)state;
    start_all();
    train(0, 2, 9);
    size_t n = 0;
    float *before[2];
    for (int k = 0; k < 2; k++)
        before[k] = flat_of(k, &n);
    uint8_t dg[PEER_AVG_DIGEST_LEN];
    digest_for(dg, 43);
    outcome o[2];
    for (int k = 0; k < 2; k++)
        assert_int_equal(start_round(k, 43, dg, 20.0, &o[k]), 0);
    /* Member 2 begins the round, then fails. */
    assert_int_equal(peer_allreduce_server_begin(rounds[2], 0, 43, dg, N, 2, NULL, NULL, NULL), 0);
    peer_allreduce_server_fail(rounds[2], 0, -EIO);
    for (int k = 0; k < 2; k++) {
        run_until(&o[k].done);
        assert_int_equal(o[k].status, -ECANCELED);
        size_t n2;
        float *now = flat_of(k, &n2);
        assert_int_equal(n2, n);
        assert_memory_equal(now, before[k], n * sizeof(float));
        free(now);
        free(before[k]);
    }
    stop_all();
}

/* A member that vanishes (its service closes) mid-round, and one that never
 * begins (the round times out): unchanged weights, clean errors. */
static void test_member_vanishes(void **state)
{
    (void)state;
    start_all();
    size_t n = 0;
    float *before[2];
    for (int k = 0; k < 2; k++)
        before[k] = flat_of(k, &n);
    uint8_t dg[PEER_AVG_DIGEST_LEN];
    digest_for(dg, 44);
    outcome o[2];
    for (int k = 0; k < 2; k++)
        assert_int_equal(start_round(k, 44, dg, 3.0, &o[k]), 0);
    /* Member 2 never begins: the others are told EAGAIN and ask again until
     * their deadline. */
    for (int k = 0; k < 2; k++) {
        run_until(&o[k].done);
        assert_int_equal(o[k].status, -ETIMEDOUT);
    }
    digest_for(dg, 45);
    for (int k = 0; k < 2; k++)
        assert_int_equal(start_round(k, 45, dg, 20.0, &o[k]), 0);
    stop_svc(2); /* gone: connections refused or reset */
    for (int k = 0; k < 2; k++) {
        run_until(&o[k].done);
        assert_true(o[k].status < 0);
        size_t n2;
        float *now = flat_of(k, &n2);
        assert_memory_equal(now, before[k], n * sizeof(float));
        free(now);
        free(before[k]);
    }
    stop_all();
}

static void avg_meta(uint8_t *m, uint64_t round, const uint8_t *dg, uint64_t kind, uint64_t off, uint64_t count)
{
    peer_put_le64(m, round);
    memcpy(m + 8, dg, PEER_AVG_DIGEST_LEN);
    peer_put_le64(m + 24, kind);
    peer_put_le64(m + 32, off);
    peer_put_le64(m + 40, count);
}

static void expect_err(peer_rpc_client *cl, const void *meta, size_t len, int code)
{
    reply r;
    call(cl, PEER_METHOD_AVG, meta, len, NULL, 0, 0, NULL, 0, &r);
    assert_int_equal(r.kind, PEER_KIND_ERROR);
    assert_int_equal(r.err_code, code);
}

static int hints;
static uint64_t hint_round;
static void on_hint(void *arg, int block, uint64_t round)
{
    (void)arg;
    assert_int_equal(block, 0);
    hints++;
    hint_round = round;
}

/* Nobody has trained or received state: every weight is 0, so the round
 * fails with -ENODATA on every member and changes nothing. */
static void test_all_initial_weights(void **state)
{
    (void)state;
    start_all();
    size_t n = 0;
    float *before[N];
    for (int k = 0; k < N; k++)
        before[k] = flat_of(k, &n);
    uint8_t dg[PEER_AVG_DIGEST_LEN];
    digest_for(dg, 44);
    outcome o[N];
    for (int k = 0; k < N; k++)
        assert_int_equal(start_round(k, 44, dg, 20.0, &o[k]), 0);
    for (int k = 0; k < N; k++) {
        run_until(&o[k].done);
        assert_int_equal(o[k].status, -ENODATA);
        size_t n2;
        float *now = flat_of(k, &n2);
        assert_memory_equal(now, before[k], n * sizeof(float));
        free(now);
        free(before[k]);
    }
    stop_all();
}

static void test_bad_requests(void **state)
{
    (void)state;
    start_all();
    peer_rpc_client *cl = connect_to(0);
    uint8_t dg[PEER_AVG_DIGEST_LEN], other[PEER_AVG_DIGEST_LEN], m[48];
    digest_for(dg, 50);
    memset(other, 0xab, sizeof other);
    avg_meta(m, 50, dg, 0, 0, 16);
    expect_err(cl, m, 48, EAGAIN);      /* no round begun yet */
    expect_err(cl, m, 47, EINVAL);      /* short meta */
    expect_err(cl, NULL, 0, EINVAL);
    size_t n = 0;
    assert_int_equal(peer_allreduce_server_begin(rounds[0], 0, 50, dg, N, 0, NULL, NULL, &n), 0);
    reply r;
    call(cl, PEER_METHOD_AVG, m, 48, NULL, 0, 0, NULL, 0, &r);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    assert_int_equal(r.nbytes, 16 * 4);
    assert_int_equal(peer_get_le64(r.meta + 16), n);
    avg_meta(m, 49, dg, 0, 0, 16);
    expect_err(cl, m, 48, ESTALE);      /* an older round */
    avg_meta(m, 51, dg, 0, 0, 16);
    expect_err(cl, m, 48, EAGAIN);      /* a later one: not begun here */
    /* A finished round's reduced part stays served to slower members after
     * the round is released (and while another begins); its base does not. */
    {
        uint8_t dg60[PEER_AVG_DIGEST_LEN];
        digest_for(dg60, 60);
        size_t n60 = 0;
        assert_int_equal(peer_allreduce_server_begin(rounds[1], 0, 60, dg60, N, 0, NULL, NULL, &n60), 0);
        size_t o60, l60;
        peer_avg_part(n60, N, 0, &o60, &l60);
        float *part = calloc(l60, sizeof(float));
        assert_non_null(part);
        part[0] = 42.0f;
        assert_int_equal(peer_allreduce_server_reduced(rounds[1], 0, part), 0);
        free(part);
        peer_allreduce_server_release(rounds[1], 0);
        peer_rpc_client *c1 = connect_to(1);
        uint8_t m60[48];
        avg_meta(m60, 60, dg60, 1, o60, 16);
        reply r60;
        call(c1, PEER_METHOD_AVG, m60, 48, NULL, 0, 0, NULL, 0, &r60);
        assert_int_equal(r60.kind, PEER_KIND_REPLY);
        assert_int_equal(r60.nbytes, 16 * 4);
        avg_meta(m60, 60, dg60, 0, o60, 16);
        expect_err(c1, m60, 48, ESTALE);  /* the base is gone */
        avg_meta(m60, 59, dg60, 1, o60, 16);
        expect_err(c1, m60, 48, ESTALE);  /* an older round */
        uint8_t dg61[PEER_AVG_DIGEST_LEN];
        digest_for(dg61, 61);
        assert_int_equal(peer_allreduce_server_begin(rounds[1], 0, 61, dg61, N, 0, NULL, NULL, NULL), 0);
        avg_meta(m60, 60, dg60, 1, o60, 16);
        call(c1, PEER_METHOD_AVG, m60, 48, NULL, 0, 0, NULL, 0, &r60);
        assert_int_equal(r60.kind, PEER_KIND_REPLY); /* still, during round 61 */
        peer_allreduce_server_release(rounds[1], 0);
        close_client(&c1);
    }
    hints = 0;
    peer_allreduce_server_set_hint(rounds[0], on_hint, NULL);
    avg_meta(m, 50, other, 0, 0, 16);
    expect_err(cl, m, 48, EAGAIN);      /* another group: both look again */
    assert_int_equal(hints, 1);
    assert_int_equal(hint_round, 50);
    avg_meta(m, 51, dg, 0, 0, 16);
    expect_err(cl, m, 48, EAGAIN);      /* a round not begun here: look again */
    assert_int_equal(hints, 2);
    assert_int_equal(hint_round, 51);
    avg_meta(m, 49, dg, 0, 0, 16);
    expect_err(cl, m, 48, ESTALE);      /* an older round: no reason to look */
    assert_int_equal(hints, 2);
    peer_allreduce_server_set_hint(rounds[0], NULL, NULL);
    avg_meta(m, 50, dg, 2, 0, 16);
    expect_err(cl, m, 48, EINVAL);      /* unknown kind */
    avg_meta(m, 50, dg, 0, n - 8, 16);
    expect_err(cl, m, 48, EINVAL);      /* past the end */
    avg_meta(m, 50, dg, 0, UINT64_MAX - 4, 16);
    expect_err(cl, m, 48, EINVAL);      /* overflowing offset */
    avg_meta(m, 50, dg, 0, 0, 0);
    expect_err(cl, m, 48, EINVAL);      /* empty */
    avg_meta(m, 50, dg, 0, 0, PEER_AVG_MAX_COUNT + 1);
    expect_err(cl, m, 48, EINVAL);      /* too large */
    avg_meta(m, 50, dg, 1, 0, 16);
    expect_err(cl, m, 48, EAGAIN);      /* our part is not reduced yet */
    avg_meta(m, 50, dg, 1, n - 16, 16);
    expect_err(cl, m, 48, EINVAL);      /* not member 0's part */
    peer_allreduce_server_fail(rounds[0], 0, -EIO);
    avg_meta(m, 50, dg, 1, 0, 16);
    expect_err(cl, m, 48, ECANCELED);
    close_client(&cl);
    stop_all();
}

/* ---- diloco mode ---- */

#define LR_OUT 0.7
#define MU_OUT 0.9

/* One diloco round among the three members with the given digest: every
 * member succeeds with the weights given, nothing dropped, clipped or
 * rejected (so the reduce is the exact weighted mean), and each pulled
 * 2 (n-1)/n of the parameters alone. */
static void diloco_round(uint64_t round, const double *w, size_t np)
{
    const peer_avg_method how = {PEER_AVG_DILOCO, LR_OUT, MU_OUT};
    uint8_t dg[PEER_AVG_DIGEST_LEN];
    digest_for_mode(dg, round, PEER_AVG_DILOCO);
    outcome o[N];
    for (int k = 0; k < N; k++)
        assert_int_equal(start_round_how(k, round, dg, 20.0, &how, &o[k]), 0);
    for (int k = 0; k < N; k++)
        run_until(&o[k].done);
    double wsum = 0;
    for (int k = 0; k < N; k++)
        wsum += w[k];
    for (int k = 0; k < N; k++) {
        if (o[k].status != 0)
            fail_msg("diloco round %llu: member %d: %s", (unsigned long long)round, k, strerror(-o[k].status));
        assert_int_equal(o[k].res.dropped, 0);
        assert_int_equal(o[k].res.clipped, 0);
        assert_int_equal(o[k].res.rejected, 0);
        if (!(fabs(o[k].res.weight_self - w[k] / wsum) < 1e-9))
            fail_msg("member %d: weight share %g, want %g", k, o[k].res.weight_self, w[k] / wsum);
        size_t off, len, want = 0;
        for (int j = 0; j < N; j++) {
            peer_avg_part(np, N, j, &off, &len);
            if (j != k)
                want += len;
            else
                want += (N - 1) * len;
        }
        assert_int_equal(o[k].res.bytes_in, want * sizeof(float)); /* a third of a mean round's */
    }
}

/* The outer step, computed here in double from the members' real tensors:
 * dbar = sum w_k (anchor_k - theta_k) / sum w; buf = mu buf + dbar; each
 * member's parameters must become anchor_k - lr (dbar + mu buf). Checks
 * after[k] (the whole flat state) element by element, and that the
 * moments are bit for bit those of before[k]; returns the new anchors in
 * anchor[k] and the new buf. Returns the largest |lr mu buf| (how far
 * Nesterov's term moves an element: the test's sensitivity). */
static double check_outer_step(float **anchor, float *const *before, float *const *after, const double *w,
                               double *buf, size_t np)
{
    double wsum = 0, max_err = 0, max_mom = 0, max_step = 0;
    for (int k = 0; k < N; k++)
        wsum += w[k];
    for (size_t i = 0; i < np; i++) {
        double dbar = 0;
        for (int k = 0; k < N; k++)
            dbar += w[k] * ((double)anchor[k][i] - before[k][i]);
        dbar /= wsum;
        buf[i] = MU_OUT * buf[i] + dbar;
        double step = dbar + MU_OUT * buf[i];
        if (fabs(LR_OUT * MU_OUT * buf[i]) > max_mom)
            max_mom = fabs(LR_OUT * MU_OUT * buf[i]);
        for (int k = 0; k < N; k++) {
            double want = (double)anchor[k][i] - LR_OUT * step, got = after[k][i];
            double e = fabs(got - want);
            if (!(e <= 2e-7 + 1e-6 * fabs(want)))
                fail_msg("member %d, parameter %zu: %.9g, want %.9g (anchor %.9g, theta %.9g, dbar %.6g)", k, i,
                         got, want, anchor[k][i], before[k][i], dbar);
            if (e > max_err)
                max_err = e;
            if (fabs(got - before[k][i]) > max_step)
                max_step = fabs(got - before[k][i]);
            anchor[k][i] = (float)want;
        }
    }
    for (int k = 0; k < N; k++)
        assert_memory_equal(after[k] + np, before[k] + np, 2 * np * sizeof(float)); /* m, v stay local */
    print_message("diloco: max error %.3g, largest move %.3g, largest Nesterov term %.3g\n", max_err, max_step,
                  max_mom);
    return max_mom;
}

static void test_diloco_two_rounds(void **state)
{
    (void)state;
    start_all();
    size_t n = 0, np = expert_block_nparams(peer_service_block(svc[0], 0));
    /* Members 0 and 1 take their initial parameters (seeds differ: the
     * anchors differ) as anchors, as the daemon does when it goes online;
     * member 2 takes none, so its first round takes its anchor then and
     * gives nothing (weight 0) though it trained. */
    float *anchor[N];
    for (int k = 0; k < N; k++) {
        anchor[k] = flat_of(k, &n);
        assert_int_equal(n, 3 * np);
    }
    for (int k = 0; k < 2; k++)
        assert_int_equal(peer_allreduce_server_anchor(rounds[k], 0), 0);
    train(0, 4, 7);
    train(1, 1, 8);
    train(2, 2, 9);
    float *before[N], *after[N];
    for (int k = 0; k < N; k++)
        before[k] = flat_of(k, &n);
    memcpy(anchor[2], before[2], np * sizeof(float));
    double *buf = calloc(np, sizeof(double));
    assert_non_null(buf);
    const double w1[N] = {65, 17, 0};
    diloco_round(80, w1, np);
    for (int k = 0; k < N; k++)
        after[k] = flat_of(k, &n);
    assert_true(check_outer_step(anchor, before, after, w1, buf, np) > 1e-4);
    for (int k = 0; k < N; k++) {
        free(before[k]);
        free(after[k]);
    }

    /* More training, then a round where member 2 averages in mean mode
     * (its digest names the same members and round without the mode): no
     * group forms, every member times out, and nothing changes, neither
     * the weights nor the anchors and momentum (the next round shows). */
    train(0, 1, 10);
    train(1, 2, 11);
    train(2, 1, 12);
    for (int k = 0; k < N; k++)
        before[k] = flat_of(k, &n);
    {
        const peer_avg_method how = {PEER_AVG_DILOCO, LR_OUT, MU_OUT};
        uint8_t dgd[PEER_AVG_DIGEST_LEN], dgm[PEER_AVG_DIGEST_LEN];
        digest_for_mode(dgd, 81, PEER_AVG_DILOCO);
        digest_for_mode(dgm, 81, PEER_AVG_MEAN);
        assert_memory_not_equal(dgd, dgm, PEER_AVG_DIGEST_LEN);
        outcome o[N];
        for (int k = 0; k < 2; k++)
            assert_int_equal(start_round_how(k, 81, dgd, 2.0, &how, &o[k]), 0);
        assert_int_equal(start_round_how(2, 81, dgm, 2.0, NULL, &o[2]), 0);
        for (int k = 0; k < N; k++) {
            run_until(&o[k].done);
            assert_int_equal(o[k].status, -ETIMEDOUT);
            float *now = flat_of(k, &n);
            assert_memory_equal(now, before[k], n * sizeof(float));
            free(now);
        }
    }

    /* The second diloco round: weights count the samples since round 80
     * (plus one); the momentum from round 80 carries over. */
    const double w2[N] = {17, 33, 17};
    diloco_round(82, w2, np);
    for (int k = 0; k < N; k++)
        after[k] = flat_of(k, &n);
    assert_true(check_outer_step(anchor, before, after, w2, buf, np) > 1e-4);

    /* The outer state is the block's: it holds the anchor the rounds
     * reached, a state download or checkpoint carries it (format 4), and
     * going online again keeps it. */
    expert_block *blk = peer_service_block(svc[0], 0);
    struct expert_outer o;
    assert_int_equal(expert_block_outer_lock(blk, 0, &o), 0);
    assert_int_equal(o.n, np);
    for (size_t i = 0; i < np; i++)
        if (!(fabs((double)o.anchor[i] - anchor[0][i]) <= 2e-7 + 1e-6 * fabs((double)anchor[0][i])))
            fail_msg("anchor %zu: block %.9g, want %.9g", i, (double)o.anchor[i], (double)anchor[0][i]);
    float *kept = malloc(3 * np * sizeof(float));
    assert_non_null(kept);
    memcpy(kept, o.anchor, 3 * np * sizeof(float));
    expert_block_outer_unlock(blk);
    size_t len = expert_block_serialized_size(blk, 1);
    void *bytes = malloc(len);
    assert_non_null(bytes);
    assert_int_equal(expert_block_serialize(blk, 1, bytes, len), (long)len);
    expert_block *copy = expert_block_create(expert_block_config(blk), 3);
    assert_non_null(copy);
    assert_int_equal(expert_block_deserialize(copy, bytes, len), 0);
    assert_int_equal(expert_block_outer_lock(copy, 0, &o), 0);
    assert_memory_equal(o.anchor, kept, 3 * np * sizeof(float));
    expert_block_outer_unlock(copy);
    expert_block_destroy(&copy);
    free(bytes);
    assert_int_equal(peer_allreduce_server_anchor(rounds[0], 0), 0);
    assert_int_equal(expert_block_outer_lock(blk, 0, &o), 0);
    assert_memory_equal(o.anchor, kept, 3 * np * sizeof(float));
    expert_block_outer_unlock(blk);
    free(kept);

    for (int k = 0; k < N; k++) {
        free(before[k]);
        free(after[k]);
        free(anchor[k]);
    }
    free(buf);
    stop_all();
}

/* ---- compressed rounds (--average-format) ---- */

static void digest_for_how(uint8_t *dg, uint64_t round, const peer_avg_method *how)
{
    uint8_t idv[N][DHT_ID_LEN], tags[N] = {1, 1, 1};
    for (int k = 0; k < N; k++)
        memcpy(idv[k], ids[k].id, DHT_ID_LEN);
    peer_allreduce_digest_fmt(dg, round, (const uint8_t(*)[DHT_ID_LEN])idv, tags, N, how->mode, how->fmt,
                              how->fmt_block);
}

/* dst = what src (n values, a slice starting a part) becomes on the wire:
 * encoded rounding to nearest, decoded; with r (n floats), encoded with
 * error feedback (peer_tensorfmt_encode_ef: sends src + r, r := the loss). */
static void wire_roundtrip(int fmt, int block, const float *src, size_t n, float *r, float *dst)
{
    size_t cap = peer_tensorfmt_size((peer_fmt)fmt, block, n);
    uint8_t *e = malloc(cap);
    assert_non_null(e);
    long k = r ? peer_tensorfmt_encode_ef((peer_fmt)fmt, block, src, n, r, e, cap)
               : peer_tensorfmt_encode((peer_fmt)fmt, block, src, n, e, cap);
    assert_int_equal(k, (long)cap);
    assert_int_equal(peer_tensorfmt_decode((peer_fmt)fmt, block, e, cap, n, dst), 0);
    free(e);
}

/* The common average A (nflat floats) a compressed round must give, from
 * each member's shared vector v[k] and weights w, computed here with the
 * public pieces: reducer j takes its own part of v[j] exact and the
 * others' parts as they decode, reduces them (peer_allreduce_robust_mean,
 * segments of seg floats) and publishes its part encoded to nearest.
 * Diloco (delta, resid not NULL): the others' parts were encoded from
 * delta[k] with error feedback against resid[k] (v[k] = delta[k] +
 * resid[k]); resid[k] becomes what the round leaves (0 over part k). */
static void expected_average(int fmt, int block, float *const *v, float *const *delta, float **resid,
                             const double *w, size_t nflat, size_t seg, float *A)
{
    float *dec[N], *out = malloc(nflat * sizeof(float));
    assert_non_null(out);
    for (int k = 0; k < N; k++)
        assert_non_null(dec[k] = malloc(nflat * sizeof(float)));
    for (int j = 0; j < N; j++) {
        size_t off, len;
        peer_avg_part(nflat, N, j, &off, &len);
        const float *xs[N];
        for (int k = 0; k < N; k++) {
            if (k == j) {
                xs[k] = v[k] + off;
                if (resid)
                    memset(resid[k] + off, 0, len * sizeof(float));
                continue;
            }
            if (resid)
                wire_roundtrip(fmt, block, delta[k] + off, len, resid[k] + off, dec[k] + off);
            else
                wire_roundtrip(fmt, block, v[k] + off, len, NULL, dec[k] + off);
            xs[k] = dec[k] + off;
        }
        peer_robust_stats st;
        assert_int_equal(peer_allreduce_robust_mean(xs, w, N, len, off, seg, out + off, &st), 0);
        assert_int_equal(st.clipped, 0);
        assert_int_equal(st.dropped, 0);
        wire_roundtrip(fmt, block, out + off, len, NULL, A + off);
    }
    for (size_t i = 0; i < nflat; i++)
        assert_true(isfinite(A[i]));
    for (int k = 0; k < N; k++)
        free(dec[k]);
    free(out);
}

/* Averaging tensor bytes member k fetches in a round over nflat floats:
 * its part of each other member's base, then each other member's reduced
 * part, chunk by chunk. (By symmetry also what it serves.) */
static uint64_t round_bytes(int fmt, int block, size_t nflat, int k)
{
    uint64_t b = 0;
    for (int j = 0; j < N; j++) {
        size_t off, len;
        peer_avg_part(nflat, N, j, &off, &len);
        for (size_t pos = 0; pos < len; pos += PEER_AVG_MAX_COUNT) {
            size_t c = len - pos < PEER_AVG_MAX_COUNT ? len - pos : PEER_AVG_MAX_COUNT;
            b += (uint64_t)(j == k ? N - 1 : 1) * peer_tensorfmt_size((peer_fmt)fmt, block, c);
        }
    }
    return b;
}

/* One encoding's error bound (net/tensorfmt.h) for a value x in a block
 * whose largest magnitude is absmax (q8). */
static double enc_bound(int fmt, double absmax, double x)
{
    switch (fmt) {
    case PEER_FMT_Q8: return absmax / 254 + absmax * 0x1p-21 + 0x1p-149;
    case PEER_FMT_F16: return fabs(x) * 0x1p-11 + 0x1p-25;
    case PEER_FMT_BF16: return fabs(x) * 0x1p-8 + 0x1p-134;
    default: return 0;
    }
}

/* Checks A against the f32 round's result from the same inputs (the
 * weighted mean of x[k], in double): each contribution is off by at most
 * one encoding's bound, the reduced part by one more (on a block whose
 * largest magnitude is at most the exact one's plus those errors). Returns
 * the largest error over its bound. */
static double check_bound(int fmt, int block, float *const *x, const double *w, size_t nflat, const float *A,
                          double *max_err)
{
    double wsum = 0, worst = 0;
    for (int k = 0; k < N; k++)
        wsum += w[k];
    double *want = malloc(nflat * sizeof(double)), *slack = malloc(nflat * sizeof(double));
    assert_non_null(want);
    assert_non_null(slack);
    *max_err = 0;
    for (int j = 0; j < N; j++) {
        size_t off, len;
        peer_avg_part(nflat, N, j, &off, &len);
        size_t B = fmt == PEER_FMT_Q8 ? (size_t)block : 1;
        for (size_t b0 = off; b0 < off + len; b0 += B) {
            size_t b1 = b0 + B < off + len ? b0 + B : off + len;
            double amax[N] = {0}, outmax = 0;
            for (size_t i = b0; i < b1; i++)
                for (int k = 0; k < N; k++)
                    amax[k] = fmax(amax[k], fabs(x[k][i]));
            for (size_t i = b0; i < b1; i++) {
                double m = 0, mag = 0, e = 0;
                for (int k = 0; k < N; k++) {
                    m += w[k] / wsum * x[k][i];
                    mag += w[k] / wsum * fabs(x[k][i]);
                    e += w[k] / wsum * enc_bound(fmt, amax[k], x[k][i]);
                }
                want[i] = m;
                /* The contributions' errors, and float rounding in the reduce. */
                slack[i] = e + 1e-6 * mag + 1e-30;
                outmax = fmax(outmax, fabs(m) + slack[i]);
            }
            for (size_t i = b0; i < b1; i++) {
                double err = fabs((double)A[i] - want[i]);
                double bound = slack[i] + enc_bound(fmt, outmax, fabs(want[i]) + slack[i]);
                if (!(err <= bound))
                    fail_msg("%s: element %zu is %.9g, the f32 round's %.9g: off by %.3g, bound %.3g",
                             peer_tensorfmt_name((peer_fmt)fmt), i, A[i], want[i], err, bound);
                worst = fmax(worst, err / bound);
                *max_err = fmax(*max_err, err);
            }
        }
    }
    free(want);
    free(slack);
    return worst;
}

/* Runs one round among the three members as `how` says; each succeeds with
 * nothing dropped, clipped or rejected, and fetched exactly the bytes of
 * its slices in the format, as its counters say too. */
static void compressed_round(uint64_t round, const peer_avg_method *how, size_t nflat, outcome *o)
{
    uint8_t dg[PEER_AVG_DIGEST_LEN];
    digest_for_how(dg, round, how);
    uint64_t rx0[N], tx0[N];
    for (int k = 0; k < N; k++) {
        peer_allreduce_server_bytes(rounds[k], 0, &rx0[k], &tx0[k]);
        assert_int_equal(start_round_how(k, round, dg, 20.0, how, &o[k]), 0);
    }
    for (int k = 0; k < N; k++)
        run_until(&o[k].done);
    int block = how->fmt == PEER_FMT_Q8 ? (how->fmt_block ? how->fmt_block : PEER_FMT_Q8_BLOCK) : 0;
    for (int k = 0; k < N; k++) {
        if (o[k].status != 0)
            fail_msg("round %llu: member %d: %s", (unsigned long long)round, k, strerror(-o[k].status));
        assert_int_equal(o[k].res.dropped, 0);
        assert_int_equal(o[k].res.clipped, 0);
        assert_int_equal(o[k].res.rejected, 0);
        uint64_t want = round_bytes(how->fmt, block, nflat, k), rx, tx;
        assert_int_equal(o[k].res.bytes_in, want);
        peer_allreduce_server_bytes(rounds[k], 0, &rx, &tx);
        assert_int_equal(rx - rx0[k], want);
        assert_int_equal(tx - tx0[k], want);
        assert_int_equal(peer_allreduce_server_round_sent(rounds[k], 0, round), want);
    }
}

/* Member k's flat state after a mean round that applied A: each value is
 * base + (A - base) (expert_block_flat_apply; v kept >= 0), bit for bit. */
static void check_applied_mean(const float *after, const float *base, const float *A, size_t n, int k)
{
    for (size_t i = 0; i < n; i++) {
        float want = base[i] + (A[i] - base[i]);
        if (i >= 2 * (n / 3))
            want = want > 0.0f ? want : 0.0f;
        if (memcmp(&want, &after[i], sizeof want) != 0)
            fail_msg("member %d, element %zu: %.9g, want %.9g from the common average %.9g", k, i, after[i], want,
                     A[i]);
    }
}

/* A mean round in (fmt, block) among three trained members. */
static void compressed_mean(int fmt, int block)
{
    start_all();
    train(0, 4, 7);
    train(1, 1, 8);
    train(2, 2, 9);
    const double w[N] = {65, 17, 33};
    size_t n = 0;
    float *base[N], *after[N];
    for (int k = 0; k < N; k++)
        base[k] = flat_of(k, &n);
    const peer_avg_method how = {PEER_AVG_MEAN, 0, 0, fmt, block};
    outcome o[N];
    compressed_round(90, &how, n, o);
    for (int k = 0; k < N; k++)
        after[k] = flat_of(k, &n);
    float *A = malloc(n * sizeof(float));
    assert_non_null(A);
    int B = fmt == PEER_FMT_Q8 ? (block ? block : PEER_FMT_Q8_BLOCK) : 0;
    expected_average(fmt, B, base, NULL, NULL, w, n, n / 3, A);
    /* Every member applied the same average A, bit for bit (its own part
     * as the others decoded it, not its float sum). */
    size_t same = 0;
    double spread = 0;
    for (int k = 0; k < N; k++)
        check_applied_mean(after[k], base[k], A, n, k);
    /* The values themselves differ where base + (A - base) rounds
     * differently from member to member (by an ulp or so). */
    for (size_t i = 0; i < n; i++) {
        same += !memcmp(&after[0][i], &after[1][i], sizeof(float)) && !memcmp(&after[0][i], &after[2][i], sizeof(float));
        for (int k = 1; k < N; k++)
            spread = fmax(spread, fabs((double)after[k][i] - after[0][i]) /
                                      fmax(fmax(fabs((double)A[i]), fabs((double)base[k][i])),
                                           fmax(fabs((double)base[0][i]), 1e-30)));
    }
    double max_err, ratio = check_bound(fmt, B, base, w, n, A, &max_err);
    /* It was compressed: not the f32 round's result. */
    assert_true(max_err > 0);
    uint64_t f32b = round_bytes(PEER_FMT_F32, 0, n, 0), got = o[0].res.bytes_in;
    print_message("mean %s: %zu floats; %llu bytes in per member (f32: %llu, %.3fx fewer); max error %.3g, "
                  "%.2f of the bound; values equal on all members: %.4f (the others within %.2g of their magnitude)\n",
                  peer_tensorfmt_name((peer_fmt)fmt), n, (unsigned long long)got, (unsigned long long)f32b,
                  (double)f32b / (double)got, max_err, ratio, (double)same / (double)n, spread);
    if (fmt == PEER_FMT_Q8 && B == 64)
        assert_true((double)f32b / (double)got > 3.75 && (double)f32b / (double)got < 3.77);
    if (fmt == PEER_FMT_F16)
        assert_int_equal(2 * got, f32b);
    free(A);
    for (int k = 0; k < N; k++) {
        free(base[k]);
        free(after[k]);
    }
    stop_all();
}

static void test_mean_q8(void **state)
{
    (void)state;
    compressed_mean(PEER_FMT_Q8, 0);
}

static void test_mean_f16(void **state)
{
    (void)state;
    compressed_mean(PEER_FMT_F16, 0);
}

/* Checks a diloco round that applied A on every member: parameters
 * theta + (new - theta) with new = anchor - lr (A + mu m'), m' = mu buf +
 * A, bit for bit as peer/allreduce.c computes it; moments unchanged.
 * Advances anchor and buf. */
static void check_applied_diloco(float *const *after, float *const *before, float **anchor, float *buf,
                                 const float *A, size_t np)
{
    for (size_t i = 0; i < np; i++) {
        double m = MU_OUT * buf[i] + A[i];
        for (int k = 0; k < N; k++) {
            float nw = (float)(anchor[k][i] - LR_OUT * (A[i] + MU_OUT * m));
            float want = before[k][i] + (nw - before[k][i]);
            if (memcmp(&want, &after[k][i], sizeof want) != 0)
                fail_msg("member %d, parameter %zu: %.9g, want %.9g (common mean delta %.9g)", k, i, after[k][i],
                         want, A[i]);
            anchor[k][i] = nw;
        }
        buf[i] = (float)m;
    }
    for (int k = 0; k < N; k++)
        assert_memory_equal(after[k] + np, before[k] + np, 2 * np * sizeof(float));
}

/* Diloco in (fmt, block): two rounds. The first shares the deltas; the
 * second the deltas plus what the first one's encoding lost (error
 * feedback), so its mean delta is that of anchor - params + residual, which
 * this test computes (and checks differs from the mean without it). */
static void compressed_diloco(int fmt, int block)
{
    start_all();
    size_t n = 0, np = expert_block_nparams(peer_service_block(svc[0], 0));
    int B = fmt == PEER_FMT_Q8 ? (block ? block : PEER_FMT_Q8_BLOCK) : 0;
    float *anchor[N], *before[N], *after[N], *d[N], *v[N], *r[N];
    for (int k = 0; k < N; k++) {
        anchor[k] = flat_of(k, &n);
        assert_int_equal(peer_allreduce_server_anchor(rounds[k], 0), 0);
        assert_non_null(d[k] = malloc(np * sizeof(float)));
        assert_non_null(v[k] = malloc(np * sizeof(float)));
        assert_non_null(r[k] = calloc(np, sizeof(float)));
    }
    float *buf = calloc(np, sizeof(float)), *A = malloc(np * sizeof(float)), *A0 = malloc(np * sizeof(float));
    assert_non_null(buf);
    assert_non_null(A);
    assert_non_null(A0);
    const peer_avg_method how = {PEER_AVG_DILOCO, LR_OUT, MU_OUT, fmt, block};
    const double w1[N] = {65, 17, 33}, w2[N] = {17, 33, 17};
    train(0, 4, 7);
    train(1, 1, 8);
    train(2, 2, 9);
    for (int t = 0; t < 2; t++) {
        const double *w = t ? w2 : w1;
        for (int k = 0; k < N; k++) {
            before[k] = flat_of(k, &n);
            for (size_t i = 0; i < np; i++) {
                d[k][i] = anchor[k][i] - before[k][i];
                v[k][i] = d[k][i] + r[k][i];
            }
        }
        if (t == 1) {
            /* The same round without error feedback, for comparison. */
            float *z[N];
            for (int k = 0; k < N; k++)
                assert_non_null(z[k] = calloc(np, sizeof(float)));
            expected_average(fmt, B, d, d, z, w, np, 0, A0);
            for (int k = 0; k < N; k++)
                free(z[k]);
        }
        outcome o[N];
        compressed_round(95 + (uint64_t)t, &how, np, o);
        for (int k = 0; k < N; k++)
            after[k] = flat_of(k, &n);
        expected_average(fmt, B, v, d, r, w, np, 0, A);
        double max_err, ratio = check_bound(fmt, B, v, w, np, A, &max_err), rmax = 0, dmax = 0;
        for (int k = 0; k < N; k++)
            for (size_t i = 0; i < np; i++)
                rmax = fmax(rmax, fabs(r[k][i]));
        size_t differ = 0;
        if (t == 1)
            for (size_t i = 0; i < np; i++) {
                differ += A[i] != A0[i];
                dmax = fmax(dmax, fabs((double)A[i] - A0[i]));
            }
        check_applied_diloco(after, before, anchor, buf, A, np);
        print_message("diloco %s round %d: %llu bytes in per member (f32: %llu); mean delta off the f32 round's "
                      "by %.3g (%.2f of the bound); residual left up to %.3g%s",
                      peer_tensorfmt_name((peer_fmt)fmt), t + 1, (unsigned long long)o[0].res.bytes_in,
                      (unsigned long long)round_bytes(PEER_FMT_F32, 0, np, 0), max_err, ratio, rmax,
                      t ? "" : "\n");
        if (t == 1)
            print_message("; the residual moved %zu of %zu mean-delta values, by up to %.3g\n", differ, np, dmax);
        assert_true(rmax > 0); /* the encoding lost something, carried to the next round */
        if (t == 1)
            assert_true(differ > np / 10 && dmax > 1e-7); /* without error feedback the check above fails */
        for (int k = 0; k < N; k++) {
            free(before[k]);
            free(after[k]);
        }
        train(0, 1, 10);
        train(1, 2, 11);
        train(2, 1, 12);
    }
    for (int k = 0; k < N; k++) {
        free(anchor[k]);
        free(d[k]);
        free(v[k]);
        free(r[k]);
    }
    free(buf);
    free(A);
    free(A0);
    stop_all();
}

static void test_diloco_q8_error_feedback(void **state)
{
    (void)state;
    compressed_diloco(PEER_FMT_Q8, 0);
}

static void test_diloco_f16(void **state)
{
    (void)state;
    compressed_diloco(PEER_FMT_F16, 0);
}

/* Members of different formats never group: the digests differ (f32's is
 * the one peers before the formats compute), the matchmaking leaves them
 * out, and a round where one member uses another format times out on
 * every member, changing nothing. A request for another format than the
 * round's is refused. */
static void test_format_groups(void **state)
{
    (void)state;
    start_all();
    const peer_avg_method hs[] = {
        {PEER_AVG_MEAN, 0, 0, PEER_FMT_F32, 0},           {PEER_AVG_MEAN, 0, 0, PEER_FMT_F16, 0},
        {PEER_AVG_MEAN, 0, 0, PEER_FMT_BF16, 0},          {PEER_AVG_MEAN, 0, 0, PEER_FMT_Q8, 64},
        {PEER_AVG_MEAN, 0, 0, PEER_FMT_Q8, 128},          {PEER_AVG_DILOCO, LR_OUT, MU_OUT, PEER_FMT_F32, 0},
        {PEER_AVG_DILOCO, LR_OUT, MU_OUT, PEER_FMT_F16, 0}, {PEER_AVG_DILOCO, LR_OUT, MU_OUT, PEER_FMT_Q8, 64},
    };
    const int nh = (int)(sizeof hs / sizeof hs[0]);
    uint8_t dg[8][PEER_AVG_DIGEST_LEN], old[PEER_AVG_DIGEST_LEN];
    for (int a = 0; a < nh; a++)
        digest_for_how(dg[a], 70, &hs[a]);
    for (int a = 0; a < nh; a++)
        for (int b = a + 1; b < nh; b++)
            assert_memory_not_equal(dg[a], dg[b], PEER_AVG_DIGEST_LEN);
    digest_for_mode(old, 70, PEER_AVG_MEAN);
    assert_memory_equal(old, dg[0], PEER_AVG_DIGEST_LEN); /* f32: as before the formats */
    digest_for_mode(old, 70, PEER_AVG_DILOCO);
    assert_memory_equal(old, dg[5], PEER_AVG_DIGEST_LEN);
    const peer_avg_method q8d = {PEER_AVG_MEAN, 0, 0, PEER_FMT_Q8, 0};
    digest_for_how(old, 70, &q8d);
    assert_memory_equal(old, dg[3], PEER_AVG_DIGEST_LEN); /* q8's default block is 64 */

    /* Matchmaking: members 0 and 1 in q8 (one naming the default block),
     * member 2 in f32 and then in q8:128. */
    peer_avg_candidate c[N];
    memset(c, 0, sizeof c);
    for (int k = 0; k < N; k++) {
        c[k].m = members[k];
        c[k].optim = 1;
        c[k].fmt = k < 2 ? PEER_FMT_Q8 : PEER_FMT_F32;
    }
    c[0].fmt_block = 64;
    peer_avg_group g;
    assert_int_equal(peer_avg_choose_group(c, N, ids[1].id, 70, &g), 0);
    assert_int_equal(g.n, 2);
    assert_int_equal(g.fmt, PEER_FMT_Q8);
    assert_int_equal(g.fmt_block, 64);
    uint8_t two[2][DHT_ID_LEN], tags[2] = {1, 1}, want[PEER_AVG_DIGEST_LEN];
    memcpy(two[0], ids[0].id, DHT_ID_LEN);
    memcpy(two[1], ids[1].id, DHT_ID_LEN);
    peer_allreduce_digest_fmt(want, 70, (const uint8_t(*)[DHT_ID_LEN])two, tags, 2, PEER_AVG_MEAN, PEER_FMT_Q8, 64);
    assert_memory_equal(g.digest, want, PEER_AVG_DIGEST_LEN);
    assert_int_equal(peer_avg_choose_group(c, N, ids[2].id, 70, &g), -ENOENT); /* alone in f32 */
    c[2].fmt = PEER_FMT_Q8;
    c[2].fmt_block = 128;
    assert_int_equal(peer_avg_choose_group(c, N, ids[2].id, 70, &g), -ENOENT); /* alone in q8:128 */
    /* The entries carry the format; an f32 entry is the same bytes as before. */
    uint8_t val[N][PEER_ANNOUNCE_MAX_BYTES];
    long len[N];
    dht_entry e[N];
    memset(e, 0, sizeof e);
    for (int k = 0; k < N; k++) {
        peer_avg_record rec = {0}, back;
        rec.round = 70;
        snprintf(rec.addr, sizeof rec.addr, "%.64s", members[k].addr);
        rec.optim = 1;
        rec.fmt = k < 2 ? PEER_FMT_Q8 : PEER_FMT_F32;
        rec.fmt_block = k == 0 ? 0 : k == 1 ? 128 : 0;
        assert_true((len[k] = peer_avg_record_encode(&rec, val[k], sizeof val[k])) > 0);
        assert_int_equal(peer_avg_record_decode(&back, val[k], (size_t)len[k]), 0);
        assert_int_equal(back.fmt, rec.fmt);
        assert_int_equal(back.fmt_block, k == 0 ? 64 : k == 1 ? 128 : 0);
        e[k].subkey = ids[k].id;
        e[k].subkey_len = DHT_ID_LEN;
        e[k].value = val[k];
        e[k].value_len = (size_t)len[k];
        e[k].is_signed = 1;
    }
    {
        peer_avg_record rec = {0};
        uint8_t plain[PEER_ANNOUNCE_MAX_BYTES];
        rec.round = 70;
        snprintf(rec.addr, sizeof rec.addr, "%.64s", members[2].addr);
        rec.optim = 1;
        rec.fmt_block = 0;
        assert_int_equal(peer_avg_record_encode(&rec, plain, sizeof plain), len[2]);
        assert_memory_equal(plain, val[2], (size_t)len[2]);
    }
    peer_avg_candidate self, out[N + 1];
    memset(&self, 0, sizeof self);
    memcpy(self.m.id, id_cli.id, DHT_ID_LEN);
    snprintf(self.m.addr, sizeof self.m.addr, "127.0.0.1:1");
    self.fmt = PEER_FMT_Q8; /* default block: only member 0's entry (q8:64) */
    assert_int_equal(peer_avg_candidates(e, N, 70, &self, 0, out, N + 1, NULL), 2);
    assert_memory_equal(out[0].m.id, ids[0].id, DHT_ID_LEN);
    self.fmt = PEER_FMT_F32;
    assert_int_equal(peer_avg_candidates(e, N, 70, &self, 0, out, N + 1, NULL), 2);
    assert_memory_equal(out[0].m.id, ids[2].id, DHT_ID_LEN);
    uint8_t k32[DHT_ID_LEN], kmode[DHT_ID_LEN], kq8[DHT_ID_LEN], kq8b[DHT_ID_LEN], kdq8[DHT_ID_LEN];
    peer_avg_fmt_key(k32, BLOCK, 7, PEER_AVG_MEAN, PEER_FMT_F32, 0);
    peer_avg_mode_key(kmode, BLOCK, 7, PEER_AVG_MEAN);
    peer_avg_fmt_key(kq8, BLOCK, 7, PEER_AVG_MEAN, PEER_FMT_Q8, 0);
    peer_avg_fmt_key(kq8b, BLOCK, 7, PEER_AVG_MEAN, PEER_FMT_Q8, 128);
    peer_avg_fmt_key(kdq8, BLOCK, 7, PEER_AVG_DILOCO, PEER_FMT_Q8, 0);
    assert_memory_equal(k32, kmode, DHT_ID_LEN);
    assert_memory_not_equal(k32, kq8, DHT_ID_LEN);
    assert_memory_not_equal(kq8, kq8b, DHT_ID_LEN);
    assert_memory_not_equal(kq8, kdq8, DHT_ID_LEN);

    /* A round where member 2 uses f32 and the others q8: nobody averages. */
    train(0, 1, 7);
    train(1, 1, 8);
    size_t n = 0;
    float *before[N];
    for (int k = 0; k < N; k++)
        before[k] = flat_of(k, &n);
    const peer_avg_method q8 = {PEER_AVG_MEAN, 0, 0, PEER_FMT_Q8, 64};
    uint8_t dq[PEER_AVG_DIGEST_LEN], df[PEER_AVG_DIGEST_LEN];
    digest_for_how(dq, 71, &q8);
    digest_for(df, 71);
    outcome o[N];
    for (int k = 0; k < 2; k++)
        assert_int_equal(start_round_how(k, 71, dq, 2.0, &q8, &o[k]), 0);
    assert_int_equal(start_round_how(2, 71, df, 2.0, NULL, &o[2]), 0);
    for (int k = 0; k < N; k++) {
        run_until(&o[k].done);
        assert_int_equal(o[k].status, -ETIMEDOUT);
        float *now = flat_of(k, &n);
        assert_memory_equal(now, before[k], n * sizeof(float));
        free(now);
        free(before[k]);
    }

    /* The server side: a q8 round refuses f32 and q8:128 requests, serves
     * q8:64 slices that start on a block of a part, and nothing else. */
    digest_for_how(dq, 72, &q8);
    assert_int_equal(peer_allreduce_server_begin(rounds[0], 0, 72, dq, N, 0, &q8, NULL, &n), 0);
    peer_rpc_client *cl = connect_to(0);
    uint8_t m[48];
    reply rp;
    size_t off1, len1;
    peer_avg_part(n, N, 1, &off1, &len1);
    avg_meta(m, 72, dq, 0, off1, 16);
    expect_err(cl, m, 48, EINVAL);     /* f32 asked */
    call_fmt = PEER_FMT_Q8;
    call_fmt_block = 128;
    expect_err(cl, m, 48, EINVAL);     /* q8:128 asked */
    call_fmt_block = 64;
    call(cl, PEER_METHOD_AVG, m, 48, NULL, 0, 0, NULL, 0, &rp);
    assert_int_equal(rp.kind, PEER_KIND_REPLY);
    assert_int_equal(rp.dtype, PEER_DTYPE_Q8);
    assert_int_equal(rp.block, 64);
    assert_int_equal(rp.nbytes, 16 + 4);
    avg_meta(m, 72, dq, 0, off1 + 8, 16);
    expect_err(cl, m, 48, EINVAL);     /* not on a block of member 1's part */
    avg_meta(m, 72, dq, 0, off1 - 64, 128);
    expect_err(cl, m, 48, EINVAL);     /* across two parts */
    call_fmt = PEER_FMT_F32;
    call_fmt_block = 0;
    close_client(&cl);
    peer_allreduce_server_release(rounds[0], 0);
    stop_all();
}

/* ---- garbage slices ---- */

static int garbage_mode;
static size_t garbage_nflat;
static float garbage_data[PEER_AVG_MAX_COUNT + 1024];

/* Member 2's avg handler: answers every slice request with a tensor that
 * is not what was asked: f32 for q8 (mode 0), q8 with a negative scale
 * (1), q8 of one value less (2). */
static int garbage_avg(void *ctx, peer_rpc_request *req, const peer_msg *msg, int i)
{
    (void)ctx;
    (void)i;
    if (!msg->meta || msg->meta_len != 48) {
        peer_rpc_respond_error(req, EINVAL, "bad meta");
        return 0;
    }
    uint64_t count = peer_get_le64((const uint8_t *)msg->meta + 40), shape[2] = {1, count};
    uint8_t meta[24];
    double wt = 1.0;
    uint64_t wbits;
    memcpy(&wbits, &wt, sizeof wbits);
    peer_put_le64(meta, peer_get_le64(msg->meta));
    peer_put_le64(meta + 8, wbits);
    peer_put_le64(meta + 16, garbage_nflat);
    peer_msg out;
    peer_msg_init(&out, PEER_KIND_REPLY, PEER_METHOD_AVG, 0);
    out.meta = meta;
    out.meta_len = sizeof meta;
    out.n_tensors = 1;
    memset(garbage_data, 0, sizeof garbage_data);
    if (garbage_mode == 0) {
        assert_int_equal(peer_tensor_f32(&out.t[0], garbage_data, 2, shape), 0);
    } else {
        if (garbage_mode == 1)
            garbage_data[0] = -1.0f; /* the first block's scale */
        else
            shape[1] = count - 1;
        assert_int_equal(peer_tensor_encoded(&out.t[0], PEER_DTYPE_Q8, 64, garbage_data, 2, shape), 0);
    }
    peer_rpc_respond(req, &out);
    return 0;
}

static void test_garbage_slices(void **state)
{
    (void)state;
    const char *what[3] = {"f32 for q8", "negative q8 scale", "one value short"};
    for (garbage_mode = 0; garbage_mode < 3; garbage_mode++) {
        start_all();
        train(0, 1, 7);
        train(1, 1, 8);
        size_t n = 0;
        float *before[2];
        for (int k = 0; k < 2; k++)
            before[k] = flat_of(k, &n);
        garbage_nflat = n;
        /* Member 2 answers garbage (its rounds are freed with the old handler). */
        assert_int_equal(peer_service_set_handler(svc[2], PEER_METHOD_AVG, garbage_avg, NULL, NULL), 0);
        rounds[2] = NULL;
        const peer_avg_method q8 = {PEER_AVG_MEAN, 0, 0, PEER_FMT_Q8, 0};
        uint8_t dg[PEER_AVG_DIGEST_LEN];
        digest_for_how(dg, 73, &q8);
        outcome o[2];
        for (int k = 0; k < 2; k++)
            assert_int_equal(start_round_how(k, 73, dg, 20.0, &q8, &o[k]), 0);
        for (int k = 0; k < 2; k++) {
            run_until(&o[k].done);
            /* Each fetches its part of member 2's base first: refused. */
            assert_int_equal(o[k].status, -EBADMSG);
            uint64_t rx;
            peer_allreduce_server_bytes(rounds[k], 0, &rx, NULL);
            assert_true(rx > 0);
            float *now = flat_of(k, &n);
            assert_memory_equal(now, before[k], n * sizeof(float));
            free(now);
            free(before[k]);
        }
        print_message("garbage slices (%s): both rounds refused, weights unchanged\n", what[garbage_mode]);
        stop_all();
    }
}

static int setup(void **state)
{
    (void)state;
    assert_int_equal(uv_loop_init(&loop), 0);
    for (int k = 0; k < N; k++) {
        uint8_t s[32] = {(uint8_t)(10 + k)};
        dht_identity_from_seed(&ids[k], s);
    }
    uint8_t s[32] = {99};
    dht_identity_from_seed(&id_cli, s);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    for (int i = 0; i < 100; i++)
        uv_run(&loop, UV_RUN_NOWAIT);
    assert_int_equal(uv_loop_close(&loop), 0);
    return 0;
}

int main(void)
{
    /* Whatever the runner left: a member whose connections are reset
     * mid-round (test_member_fails, test_member_vanishes) must not kill the
     * process through SIGPIPE (it did, with the default action). */
    signal(SIGPIPE, SIG_DFL);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_weighted_average, setup, teardown),
        cmocka_unit_test_setup_teardown(test_member_fails, setup, teardown),
        cmocka_unit_test_setup_teardown(test_member_vanishes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_all_initial_weights, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hostile_nan, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hostile_huge, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_requests, setup, teardown),
        cmocka_unit_test_setup_teardown(test_diloco_two_rounds, setup, teardown),
        cmocka_unit_test_setup_teardown(test_mean_q8, setup, teardown),
        cmocka_unit_test_setup_teardown(test_mean_f16, setup, teardown),
        cmocka_unit_test_setup_teardown(test_diloco_q8_error_feedback, setup, teardown),
        cmocka_unit_test_setup_teardown(test_diloco_f16, setup, teardown),
        cmocka_unit_test_setup_teardown(test_format_groups, setup, teardown),
        cmocka_unit_test_setup_teardown(test_garbage_slices, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
