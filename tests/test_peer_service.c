/* The peer service over real loopback RPC: forward and backward equal the
 * local expert computation exactly, bad requests get clear errors, and a
 * graceful close writes checkpoints that a restart resumes from. */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>

#include "expert/block.h"
#include "expert/model.h"
#include "peer/peer.h"
#include "peer/service.h"
#include "peer/statesync.h"
#include "test_util.h"
#include "test_rpc_util.h"

static uv_loop_t loop;
static dht_identity id_srv, id_cli;
static char dir[256];
static FILE *svc_log; /* the services' log (NULL: stderr) */
static struct expert_guard_config svc_guard; /* the services' gradient checks (zeros: defaults) */

/* ---- a tiny synchronous call helper on top of the async client ---- */

typedef struct result {
    int done, status;
    peer_kind kind;
    int err_code;
    char err_msg[PEER_WIRE_MAX_ERRMSG + 1];
    float data[64 * 1024];
    uint64_t shape[2];
    uint64_t version;
    char meta[4096];
} result;

static void on_reply(void *arg, int status, const peer_msg *m)
{
    result *r = arg;
    r->done = 1;
    r->status = status;
    if (status != 0)
        return;
    r->kind = m->kind;
    r->err_code = m->err_code;
    snprintf(r->err_msg, sizeof r->err_msg, "%s", m->err_msg);
    if (m->kind == PEER_KIND_REPLY && m->n_tensors == 1) {
        assert_true(m->t[0].nbytes <= sizeof r->data);
        memcpy(r->data, m->t[0].data, m->t[0].nbytes);
        r->shape[0] = m->t[0].shape[0];
        r->shape[1] = m->t[0].shape[1];
    }
    r->version = 0;
    if (m->meta && m->meta_len == 8)
        for (int i = 0; i < 8; i++)
            r->version |= (uint64_t)((const uint8_t *)m->meta)[i] << (8 * i);
    if (m->meta && m->meta_len < sizeof r->meta) {
        memcpy(r->meta, m->meta, m->meta_len);
        r->meta[m->meta_len] = '\0';
    }
}

/* Runs the loop until *flag is non-zero, at most ~20 s. */
static void run_until(volatile int *flag)
{
    test_run_until(&loop, flag, 20000);
}

static void call(peer_rpc_client *cl, peer_method method, const char *block, const float *a,
                 int rows, int wa, const float *b, int wb, result *r)
{
    peer_msg m;
    peer_msg_init(&m, PEER_KIND_REQUEST, method, 0);
    snprintf(m.block, sizeof m.block, "%s", block);
    uint64_t sa[2] = {(uint64_t)rows, (uint64_t)wa}, sb[2] = {(uint64_t)rows, (uint64_t)wb};
    if (a) {
        assert_int_equal(peer_tensor_f32(&m.t[m.n_tensors++], a, 2, sa), 0);
    }
    if (b) {
        assert_int_equal(peer_tensor_f32(&m.t[m.n_tensors++], b, 2, sb), 0);
    }
    memset(r, 0, sizeof *r);
    assert_int_equal(peer_rpc_call(cl, &m, 20000, on_reply, r, NULL), 0);
    run_until(&r->done);
    assert_int_equal(r->status, 0);
}

/* A state request with raw meta bytes. */
/* A request with raw meta bytes and at most one (rows, width) tensor x. */
static void call_meta(peer_rpc_client *cl, peer_method method, const char *block, const float *x, int rows,
                      int width, const void *meta, size_t meta_len, result *r)
{
    peer_msg m;
    peer_msg_init(&m, PEER_KIND_REQUEST, method, 0);
    snprintf(m.block, sizeof m.block, "%s", block);
    if (x) {
        uint64_t shape[2] = {(uint64_t)rows, (uint64_t)width};
        assert_int_equal(peer_tensor_f32(&m.t[m.n_tensors++], x, 2, shape), 0);
    }
    m.meta = meta;
    m.meta_len = meta_len;
    memset(r, 0, sizeof *r);
    assert_int_equal(peer_rpc_call(cl, &m, 20000, on_reply, r, NULL), 0);
    run_until(&r->done);
    assert_int_equal(r->status, 0);
}

static void call_state(peer_rpc_client *cl, const char *block, const void *meta, size_t meta_len,
                       result *r)
{
    call_meta(cl, PEER_METHOD_STATE, block, NULL, 0, 0, meta, meta_len, r);
}

static void fill(float *x, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)rand_r(&seed) / (float)RAND_MAX * 2.0f - 1.0f;
}

static peer_service *start_inline(int *port, const int *blocks, int n, int inline_rows)
{
    char err[256] = "";
    peer_service_config c;
    memset(&c, 0, sizeof c);
    c.self = &id_srv;
    c.model = "fmnist-mlp";
    c.blocks = blocks;
    c.n_blocks = n;
    c.threads = 1;
    c.max_batch = 16;
    c.max_queue_rows = 64;
    expert_optim_default_adamw(&c.optim);
    c.optim.target_batch = 8;
    c.seed = 42;
    c.checkpoint_dir = dir;
    c.log = svc_log;
    c.guard = svc_guard;
    c.infer_inline_rows = inline_rows;
    peer_service *s = peer_service_create(&loop, &c, err, sizeof err);
    if (!s)
        fail_msg("peer_service_create: %s", err);
    struct sockaddr_in sa;
    uv_ip4_addr("127.0.0.1", 0, &sa);
    assert_int_equal(peer_service_listen(s, (const struct sockaddr *)&sa), 0);
    *port = peer_service_port(s);
    assert_true(*port > 0);
    return s;
}

static peer_service *start(int *port, const int *blocks, int n)
{
    return start_inline(port, blocks, n, 0);
}

/* An infer request with raw meta bytes (the span). */
static void call_infer(peer_rpc_client *cl, const char *block, const float *x, int rows, int width,
                       const void *meta, size_t meta_len, result *r)
{
    call_meta(cl, PEER_METHOD_INFER, block, x, rows, width, meta, meta_len, r);
}

static peer_rpc_client *connect_to(int port)
{
    return test_rpc_connect(&loop, &id_cli, id_srv.id, port);
}

static void closed_svc(peer_service *s, int ck, void *arg)
{
    (void)s;
    assert_int_equal(ck, 0);
    *(int *)arg = 1;
}

static void stop(peer_service **s, peer_rpc_client **cl)
{
    int b = 0;
    test_rpc_close(&loop, cl);
    peer_service_close(*s, closed_svc, &b);
    run_until(&b);
    peer_service_destroy(s);
}

static void test_rpc_equals_local_and_restart(void **state)
{
    (void)state;
    static const int blocks[] = {1, 5};
    int port;
    peer_service *s = start(&port, blocks, 2);
    peer_rpc_client *cl = connect_to(port);
    const struct expert_model_spec *spec = expert_model_find("fmnist-mlp");
    struct expert_block_config c1, c5;
    assert_int_equal(expert_model_stage(spec, 1, &c1), 0);
    assert_int_equal(expert_model_stage(spec, 5, &c5), 0);
    expert_block *ref1 = expert_block_create(&c1, expert_stage_seed(42, 1));
    expert_block *ref5 = expert_block_create(&c5, expert_stage_seed(42, 5));
    expert_workspace *ws1 = expert_workspace_create(&c1, 16), *ws5 = expert_workspace_create(&c5, 16);
    static float x[32 * 512], gy[32 * 512], want[32 * 512];
    static result r;
    const int B = 5;
    fill(x, (size_t)B * 512, 1);
    fill(gy, (size_t)B * 512, 2);

    /* forward on stage 1 and stage 5: bit-for-bit the local computation */
    call(cl, PEER_METHOD_FORWARD, "fmnist-mlp.1", x, B, 512, NULL, 0, &r);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    assert_true(r.shape[0] == (uint64_t)B && r.shape[1] == 512);
    assert_int_equal(expert_block_forward(ref1, ws1, want, x, B, NULL), 0);
    assert_memory_equal(r.data, want, (size_t)B * 512 * sizeof(float));
    assert_true(r.version == 0);
    call(cl, PEER_METHOD_FORWARD, "fmnist-mlp.5", x, B, 512, NULL, 0, &r);
    assert_int_equal(expert_block_forward(ref5, ws5, want, x, B, NULL), 0);
    assert_memory_equal(r.data, want, (size_t)B * 10 * sizeof(float));

    /* backward: grad_inputs equal too */
    call(cl, PEER_METHOD_BACKWARD, "fmnist-mlp.1", x, B, 512, gy, 512, &r);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    assert_int_equal(expert_block_backward(ref1, ws1, want, gy, x, B, NULL), 0);
    assert_memory_equal(r.data, want, (size_t)B * 512 * sizeof(float));
    /* 5 + 5 samples reach target_batch 8: the block steps; forward shows it */
    call(cl, PEER_METHOD_BACKWARD, "fmnist-mlp.1", x, B, 512, gy, 512, &r);
    call(cl, PEER_METHOD_FORWARD, "fmnist-mlp.1", x, B, 512, NULL, 0, &r);
    assert_true(r.version == 1);

    /* errors: unknown block, wrong width, too many rows, wrong tensor count */
    call(cl, PEER_METHOD_FORWARD, "fmnist-mlp.3", x, B, 512, NULL, 0, &r);
    assert_int_equal(r.kind, PEER_KIND_ERROR);
    assert_int_equal(r.err_code, ENOENT);
    assert_non_null(strstr(r.err_msg, "not hosted"));
    call(cl, PEER_METHOD_FORWARD, "fmnist-mlp.1", x, B, 511, NULL, 0, &r);
    assert_int_equal(r.err_code, EINVAL);
    assert_non_null(strstr(r.err_msg, "(B, 512)"));
    call(cl, PEER_METHOD_FORWARD, "fmnist-mlp.5", x, 17, 512, NULL, 0, &r);
    assert_int_equal(r.err_code, EINVAL);
    call(cl, PEER_METHOD_BACKWARD, "fmnist-mlp.5", x, B, 512, NULL, 0, &r);
    assert_int_equal(r.err_code, EINVAL);
    call(cl, PEER_METHOD_INFO, "", NULL, 0, 0, NULL, 0, &r);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    assert_non_null(strstr(r.meta, "\"fmnist-mlp.1\""));
    assert_non_null(strstr(r.meta, "\"fmnist-mlp.5\""));

    /* The state method is served by its handler (peer/statesync.h): none
     * registered, it is an unknown method; the service computes the other
     * methods itself and refuses handlers for them. */
    uint8_t sm[16] = {0};
    call_state(cl, "fmnist-mlp.5", sm, sizeof sm, &r);
    assert_int_equal(r.kind, PEER_KIND_ERROR);
    assert_int_equal(r.err_code, ENOSYS);
    assert_int_equal(peer_service_set_handler(s, PEER_METHOD_FORWARD, NULL, NULL, NULL), -EINVAL);
    assert_int_equal(peer_service_set_handler(s, PEER_METHOD_INFO, NULL, NULL, NULL), -EINVAL);
    assert_non_null(peer_statesync_server_create(s)); /* the service frees it */

    /* The state method: a first chunk, then hostile requests. */
    call_state(cl, "fmnist-mlp.5", sm, sizeof sm, &r);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    uint64_t sid = peer_get_le64(r.meta), total = peer_get_le64(r.meta + 8);
    assert_true(sid > 0 && total > 0);
    call_state(cl, "fmnist-mlp.5", sm, 3, &r); /* meta of the wrong size */
    assert_int_equal(r.kind, PEER_KIND_ERROR);
    assert_int_equal(r.err_code, EINVAL);
    peer_put_le64(sm, sid);
    peer_put_le64(sm + 8, total + 1); /* past the end */
    call_state(cl, "fmnist-mlp.5", sm, sizeof sm, &r);
    assert_int_equal(r.err_code, EINVAL);
    peer_put_le64(sm, sid + 100); /* not the current snapshot */
    peer_put_le64(sm + 8, 0);
    call_state(cl, "fmnist-mlp.5", sm, sizeof sm, &r);
    assert_int_equal(r.err_code, ESTALE);
    call_state(cl, "fmnist-mlp.4", sm, sizeof sm, &r); /* not hosted */
    assert_int_equal(r.err_code, ENOENT);

    peer_block_info info;
    assert_int_equal(peer_service_block_info(s, 0, &info), 0);
    assert_string_equal(info.name, "fmnist-mlp.1");
    assert_true(info.version == 1);
    assert_true(info.stats.steps == 1);
    assert_true(info.stats.rows[PEER_TASK_FORWARD] == 2 * (uint64_t)B && info.stats.rows[PEER_TASK_BACKWARD] == 2 * (uint64_t)B);
    stop(&s, &cl);

    /* Restart from the checkpoints written at close: same weights version,
     * and the forward equals the stepped reference. */
    s = start(&port, blocks, 2);
    assert_int_equal(peer_service_block_info(s, 0, &info), 0);
    assert_int_equal(info.restored, 1);
    assert_true(info.version == 1);
    cl = connect_to(port);
    struct expert_optim o;
    expert_optim_default_adamw(&o);
    o.target_batch = 8;
    assert_int_equal(expert_block_backward(ref1, ws1, NULL, gy, x, B, NULL), 0);
    assert_int_equal(expert_block_step(ref1, &o, NULL), 0);
    call(cl, PEER_METHOD_FORWARD, "fmnist-mlp.1", x, B, 512, NULL, 0, &r);
    assert_int_equal(expert_block_forward(ref1, ws1, want, x, B, NULL), 0);
    assert_memory_equal(r.data, want, (size_t)B * 512 * sizeof(float));
    stop(&s, &cl);

    expert_workspace_destroy(&ws1);
    expert_workspace_destroy(&ws5);
    expert_block_destroy(&ref1);
    expert_block_destroy(&ref5);
}

/* An infer request may name a span of consecutive stages hosted by the
 * peer: the reply equals the stages' local forwards one after the other, bit
 * for bit, and carries one weight version per stage; the same whether the
 * stages run on the network thread (few rows, infer_inline_rows) or go
 * through each block's inference lane. Bad spans get clear errors. */
static void test_infer_spans(void **state)
{
    (void)state;
    static const int blocks[] = {4, 2, 3}; /* hosted out of order on purpose */
    const struct expert_model_spec *spec = expert_model_find("fmnist-mlp");
    struct expert_block_config c[5];
    expert_block *ref[5] = {0};
    expert_workspace *ws[5] = {0};
    for (int i = 2; i <= 4; i++) {
        assert_int_equal(expert_model_stage(spec, i, &c[i]), 0);
        ref[i] = expert_block_create(&c[i], expert_stage_seed(42, (unsigned)i));
        ws[i] = expert_workspace_create(&c[i], 16);
        assert_true(ref[i] && ws[i]);
    }
    static float x[16 * 512], want[16 * 512], tmp[16 * 512];
    static result r;
    for (int inl = 0; inl <= 8; inl += 8) {
        int port;
        peer_service *s = start_inline(&port, blocks, 3, inl);
        peer_rpc_client *cl = connect_to(port);
        const int sizes[2] = {3, 13}; /* within and beyond the inline limit */
        uint64_t served = 0;
        for (int k = 0; k < 2; k++) {
            int B = sizes[k];
            fill(x, (size_t)B * 512, 7u + (unsigned)k);
            /* stages 2, 3, 4 in one request */
            uint8_t meta[8];
            peer_put_le64(meta, 3);
            call_infer(cl, "fmnist-mlp.2", x, B, 512, meta, sizeof meta, &r);
            assert_int_equal(r.kind, PEER_KIND_REPLY);
            assert_true(r.shape[0] == (uint64_t)B && r.shape[1] == 512);
            assert_int_equal(expert_block_forward(ref[2], ws[2], want, x, B, NULL), 0);
            assert_int_equal(expert_block_forward(ref[3], ws[3], tmp, want, B, NULL), 0);
            assert_int_equal(expert_block_forward(ref[4], ws[4], want, tmp, B, NULL), 0);
            assert_memory_equal(r.data, want, (size_t)B * 512 * sizeof(float));
            /* one version per stage: 24 bytes, all version 0 */
            static const char zeros[24];
            assert_memory_equal(r.meta, zeros, 24);
            assert_true(r.version == 0); /* on_reply reads versions only from 8-byte metas */
            /* a span of 1 and no meta at all: the plain single-stage reply */
            peer_put_le64(meta, 1);
            call_infer(cl, "fmnist-mlp.3", x, B, 512, meta, sizeof meta, &r);
            assert_int_equal(r.kind, PEER_KIND_REPLY);
            assert_int_equal(expert_block_forward(ref[3], ws[3], want, x, B, NULL), 0);
            assert_memory_equal(r.data, want, (size_t)B * 512 * sizeof(float));
            call_infer(cl, "fmnist-mlp.3", x, B, 512, NULL, 0, &r);
            assert_int_equal(r.kind, PEER_KIND_REPLY);
            assert_memory_equal(r.data, want, (size_t)B * 512 * sizeof(float));
            served += (uint64_t)B * 3;
        }
        /* stage 5 is not hosted: the span is refused, naming it */
        uint8_t meta[8];
        peer_put_le64(meta, 3);
        call_infer(cl, "fmnist-mlp.3", x, 2, 512, meta, sizeof meta, &r);
        assert_int_equal(r.kind, PEER_KIND_ERROR);
        assert_int_equal(r.err_code, ENOENT);
        assert_non_null(strstr(r.err_msg, "stage 5"));
        /* garbage metas: wrong length, zero, more than hosted, huge */
        call_infer(cl, "fmnist-mlp.2", x, 2, 512, meta, 3, &r);
        assert_int_equal(r.err_code, EINVAL);
        assert_non_null(strstr(r.err_msg, "consecutive stages"));
        const uint64_t bad[] = {0, 4, UINT64_MAX};
        for (int i = 0; i < 3; i++) {
            peer_put_le64(meta, bad[i]);
            call_infer(cl, "fmnist-mlp.2", x, 2, 512, meta, sizeof meta, &r);
            assert_int_equal(r.kind, PEER_KIND_ERROR);
            assert_int_equal(r.err_code, EINVAL);
        }
        /* the blocks counted what they served: stage 3 ran in every request */
        peer_block_info info;
        assert_int_equal(peer_service_block_info(s, 2, &info), 0);
        assert_string_equal(info.name, "fmnist-mlp.3");
        assert_true(info.stats.rows[PEER_TASK_INFER] == served);
        stop(&s, &cl);
    }
    for (int i = 2; i <= 4; i++) {
        expert_workspace_destroy(&ws[i]);
        expert_block_destroy(&ref[i]);
    }
}

static void test_bad_configs(void **state)
{
    (void)state;
    char err[256];
    peer_service_config c;
    memset(&c, 0, sizeof c);
    int blocks[2] = {1, 1};
    c.self = &id_srv;
    c.model = "fmnist-mlp";
    c.blocks = blocks;
    c.n_blocks = 2;
    c.threads = 1;
    c.max_batch = 8;
    c.max_queue_rows = 8;
    expert_optim_default_adamw(&c.optim);
    assert_null(peer_service_create(&loop, &c, err, sizeof err));
    assert_non_null(strstr(err, "twice"));
    blocks[1] = 99;
    assert_null(peer_service_create(&loop, &c, err, sizeof err));
    assert_non_null(strstr(err, "no stage 99"));
    c.model = "nope";
    assert_null(peer_service_create(&loop, &c, err, sizeof err));
    assert_non_null(strstr(err, "unknown model"));
    /* inline inference rows beyond max_batch, or negative */
    c.model = "fmnist-mlp";
    blocks[1] = 2;
    c.infer_inline_rows = 9;
    assert_null(peer_service_create(&loop, &c, err, sizeof err));
    assert_non_null(strstr(err, "invalid service configuration"));
    c.infer_inline_rows = -1;
    assert_null(peer_service_create(&loop, &c, err, sizeof err));
    c.infer_inline_rows = 0;
    /* A corrupt checkpoint is refused with a clear message, not ignored. */
    c.model = "fmnist-mlp";
    c.n_blocks = 1;
    c.checkpoint_dir = dir;
    char path[512];
    snprintf(path, sizeof path, "%s/fmnist-mlp.1.ckpt", dir);
    test_write_file(path, "garbage", 7, 0600);
    assert_null(peer_service_create(&loop, &c, err, sizeof err));
    assert_non_null(strstr(err, "cannot restore fmnist-mlp.1"));
}

/* A checkpoint file renamed to another stage's name is refused, naming both
 * stages, and left in place untouched (nothing is lost); the right stage
 * still loads it. */
static void test_checkpoint_of_another_stage(void **state)
{
    (void)state;
    static const int two[] = {2}, three[] = {3};
    int port;
    peer_service *s = start(&port, two, 1);
    peer_rpc_client *cl = connect_to(port);
    stop(&s, &cl); /* writes fmnist-mlp.2.ckpt */
    char p2[512], p3[512];
    snprintf(p2, sizeof p2, "%s/fmnist-mlp.2.ckpt", dir);
    snprintf(p3, sizeof p3, "%s/fmnist-mlp.3.ckpt", dir);
    assert_int_equal(rename(p2, p3), 0);
    struct stat st0, st1;
    assert_int_equal(stat(p3, &st0), 0);

    char err[512] = "";
    peer_service_config c;
    memset(&c, 0, sizeof c);
    c.self = &id_srv;
    c.model = "fmnist-mlp";
    c.blocks = three;
    c.n_blocks = 1;
    c.threads = 1;
    c.max_batch = 8;
    c.max_queue_rows = 8;
    expert_optim_default_adamw(&c.optim);
    c.checkpoint_dir = dir;
    assert_null(peer_service_create(&loop, &c, err, sizeof err));
    fprintf(stderr, "refused as: %s\n", err);
    assert_non_null(strstr(err, "holds fmnist-mlp.2"));
    assert_non_null(strstr(err, "not fmnist-mlp.3"));
    assert_non_null(strstr(err, p3));
    /* The refused file is where it was, unchanged. */
    assert_int_equal(stat(p3, &st1), 0);
    assert_true(st1.st_size == st0.st_size && st1.st_ino == st0.st_ino &&
                st1.st_mtim.tv_sec == st0.st_mtim.tv_sec && st1.st_mtim.tv_nsec == st0.st_mtim.tv_nsec);
    /* Put back under its own name, it loads. */
    assert_int_equal(rename(p3, p2), 0);
    s = start(&port, two, 1);
    peer_block_info info;
    assert_int_equal(peer_service_block_info(s, 0, &info), 0);
    assert_int_equal(info.restored, 1);
    /* Downloaded state records its stage too: stage 3's (same shape) is
     * refused by our stage 2, stage 2's installed. */
    const struct expert_model_spec *spec = expert_model_find("fmnist-mlp");
    struct expert_block_config bc;
    assert_int_equal(expert_model_stage(spec, 3, &bc), 0);
    expert_block *other = expert_block_create(&bc, 7);
    assert_non_null(other);
    size_t len = expert_block_serialized_size(other, 1);
    void *buf = malloc(len);
    for (int stage = 3; stage >= 2; stage--) {
        assert_int_equal(expert_block_set_stage(other, spec, stage), 0);
        assert_int_equal(expert_block_serialize(other, 1, buf, len), (long)len);
        assert_int_equal(peer_service_install_state(s, 0, buf, len), stage == 3 ? -ESTALE : 0);
    }
    free(buf);
    expert_block_destroy(&other);
    cl = connect_to(port);
    stop(&s, &cl);
}

static int tmp_exists(const char *name)
{
    char p[600];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &st) == 0;
}

static void tmp_make(const char *name, size_t len, time_t age_s)
{
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    char *junk = calloc(1, len ? len : 1);
    assert_non_null(junk);
    test_write_file(p, junk, len, 0644);
    free(junk);
    if (age_s) {
        struct timespec ts[2];
        clock_gettime(CLOCK_REALTIME, &ts[0]);
        ts[0].tv_sec -= age_s;
        ts[1] = ts[0];
        assert_int_equal(utimensat(AT_FDCWD, p, ts, 0), 0);
    }
}

/* Stale temporary files of a killed checkpoint write are removed at start
 * (ours: our blocks, our pattern, a writer that is gone) and at a clean
 * stop; another live process's, another block's and other files are kept. */
static void test_stale_tmp_cleaned(void **state)
{
    (void)state;
    pid_t dead = fork();
    assert_true(dead >= 0);
    if (dead == 0)
        _exit(0);
    assert_int_equal(waitpid(dead, NULL, 0), dead);
    char n_dead[128], n_self[128], n_live[128], n_other_blk[128], n_locked[128];
    snprintf(n_dead, sizeof n_dead, "fmnist-mlp.1.ckpt.tmp.%d.aB3xYz", (int)dead);
    snprintf(n_self, sizeof n_self, "fmnist-mlp.1.ckpt.tmp.%d.Qq0000", (int)getpid());
    snprintf(n_live, sizeof n_live, "fmnist-mlp.1.ckpt.tmp.%d.Zz9999", (int)getppid());
    snprintf(n_other_blk, sizeof n_other_blk, "fmnist-mlp.4.ckpt.tmp.%d.aB3xYz", (int)dead);
    snprintf(n_locked, sizeof n_locked, "fmnist-mlp.1.ckpt.tmp.%d.Lk1234", (int)getpid());
    tmp_make(n_dead, 3000, 0);
    tmp_make(n_self, 500, 0);
    tmp_make(n_live, 100, 0);
    tmp_make(n_other_blk, 100, 0);
    tmp_make(n_locked, 100, 0);
    tmp_make("fmnist-mlp.1.ckpt.tmp.OLDone", 20, 3600);  /* an older build's leftover */
    tmp_make("fmnist-mlp.1.ckpt.tmp.NEWone", 20, 0);     /* possibly an older build writing now */
    tmp_make("fmnist-mlp.1.ckpt.tmp.12.x", 20, 3600);    /* not our pattern */
    tmp_make("fmnist-mlp.1.ckpt.bak", 20, 3600);
    /* A write in flight in this process (another service): it holds the lock. */
    char pl[600];
    snprintf(pl, sizeof pl, "%s/%s", dir, n_locked);
    int lfd = open(pl, O_RDWR | O_CLOEXEC);
    assert_true(lfd >= 0);
    assert_int_equal(flock(lfd, LOCK_EX), 0);

    static const int one[] = {1};
    int port;
    svc_log = tmpfile();
    assert_non_null(svc_log);
    peer_service *s = start(&port, one, 1);
    /* The start said what it removed: 3000 + 500 + 20 bytes in 3 files. */
    char logtext[2048];
    rewind(svc_log);
    size_t got = fread(logtext, 1, sizeof logtext - 1, svc_log);
    logtext[got] = '\0';
    fprintf(stderr, "%s", logtext);
    assert_non_null(strstr(logtext, "fmnist-mlp.1: removed 3 stale temporary checkpoint files (3520 bytes)"));
    assert_false(tmp_exists(n_dead));
    assert_false(tmp_exists(n_self));
    assert_false(tmp_exists("fmnist-mlp.1.ckpt.tmp.OLDone"));
    assert_true(tmp_exists(n_live));
    assert_true(tmp_exists(n_other_blk));
    assert_true(tmp_exists(n_locked));
    assert_true(tmp_exists("fmnist-mlp.1.ckpt.tmp.NEWone"));
    assert_true(tmp_exists("fmnist-mlp.1.ckpt.tmp.12.x"));
    assert_true(tmp_exists("fmnist-mlp.1.ckpt.bak"));
    /* One of ours appears while we run (as a killed write would leave it). */
    tmp_make(n_self, 10, 0);
    peer_rpc_client *cl = connect_to(port);
    stop(&s, &cl);
    assert_false(tmp_exists(n_self));
    assert_true(tmp_exists(n_live));
    assert_true(tmp_exists(n_locked));
    assert_true(tmp_exists("fmnist-mlp.1.ckpt"));
    close(lfd);
    fclose(svc_log);
    svc_log = NULL;
}

/* The whole of what svc_log holds (the caller frees it). */
static char *log_text(void)
{
    fflush(svc_log);
    rewind(svc_log);
    static char text[16384];
    size_t got = fread(text, 1, sizeof text - 1, svc_log);
    text[got] = '\0';
    return text;
}

/* One backward of 8 rows on the head (stage 5: 512 -> 10) with grad_outputs
 * of the scale a summed cross-entropy gives, times scale. */
static void head_backward(peer_rpc_client *cl, unsigned seed, float scale, result *r)
{
    static float x[8 * 512], gy[8 * 10];
    fill(x, sizeof x / sizeof x[0], seed);
    fill(gy, sizeof gy / sizeof gy[0], seed + 1);
    for (size_t i = 0; i < sizeof gy / sizeof gy[0]; i++)
        gy[i] *= 0.3f * scale;
    call(cl, PEER_METHOD_BACKWARD, "fmnist-mlp.5", x, 8, 512, gy, 10, r);
}

/* Issue 18's finding, over RPC: one backward with finite but huge
 * grad_outputs (1e30) froze a replica for good (its version kept rising,
 * its outputs never changed again). The peer now refuses it with ERANGE
 * and a sentence; NaN/Inf are refused too; later honest backwards still
 * change the outputs; the refusals are counted and logged. */
static void test_backward_gradients_checked(void **state)
{
    (void)state;
    static const int blocks[] = {5};
    static float x[8 * 512], gy[8 * 10], probe[8 * 10];
    static result r;
    svc_log = tmpfile();
    assert_non_null(svc_log);
    int port;
    peer_service *s = start(&port, blocks, 1);
    peer_rpc_client *cl = connect_to(port);
    fill(x, sizeof x / sizeof x[0], 99);
    for (int i = 0; i < 40; i++) {
        head_backward(cl, 100 + (unsigned)i, 1.0f, &r);
        assert_int_equal(r.kind, PEER_KIND_REPLY);
    }
    call(cl, PEER_METHOD_FORWARD, "fmnist-mlp.5", x, 8, 512, NULL, 0, &r);
    uint64_t v0 = r.version;
    assert_true(v0 == 40);
    memcpy(probe, r.data, sizeof probe);

    head_backward(cl, 7, 1e30f / 0.3f, &r);
    assert_int_equal(r.kind, PEER_KIND_ERROR);
    assert_int_equal(r.err_code, ERANGE);
    fprintf(stderr, "  1e30: %s\n", r.err_msg);
    assert_non_null(strstr(r.err_msg, "fmnist-mlp.5"));
    assert_non_null(strstr(r.err_msg, "grad_output"));
    assert_non_null(strstr(r.err_msg, "refused"));
    fill(gy, sizeof gy / sizeof gy[0], 5);
    gy[3] = NAN;
    call(cl, PEER_METHOD_BACKWARD, "fmnist-mlp.5", x, 8, 512, gy, 10, &r);
    assert_int_equal(r.err_code, ERANGE);
    fprintf(stderr, "  NaN: %s\n", r.err_msg);
    assert_non_null(strstr(r.err_msg, "NaN or Inf"));
    gy[3] = 0.1f;
    float keep = x[17];
    x[17] = INFINITY;
    call(cl, PEER_METHOD_BACKWARD, "fmnist-mlp.5", x, 8, 512, gy, 10, &r);
    assert_int_equal(r.err_code, ERANGE);
    x[17] = keep;
    head_backward(cl, 8, 1000.0f, &r); /* 1000x this block's recent norm */
    assert_int_equal(r.err_code, ERANGE);
    fprintf(stderr, "  1000x: %s\n", r.err_msg);
    assert_non_null(strstr(r.err_msg, "recent norm"));
    call(cl, PEER_METHOD_FORWARD, "fmnist-mlp.5", x, 8, 512, NULL, 0, &r);
    assert_true(r.version == v0);
    assert_memory_equal(r.data, probe, sizeof probe); /* nothing of them reached the weights */

    /* Honest backwards still move the weights. */
    for (int i = 0; i < 3; i++) {
        head_backward(cl, 200 + (unsigned)i, 1.0f, &r);
        assert_int_equal(r.kind, PEER_KIND_REPLY);
        call(cl, PEER_METHOD_FORWARD, "fmnist-mlp.5", x, 8, 512, NULL, 0, &r);
        assert_true(r.version == v0 + 1 + (uint64_t)i);
        double d = 0;
        for (int k = 0; k < 8 * 10; k++)
            d = fmax(d, fabs((double)r.data[k] - (double)probe[k]));
        assert_true(d > 1e-6);
        memcpy(probe, r.data, sizeof probe);
    }
    peer_block_info info;
    assert_int_equal(peer_service_block_info(s, 0, &info), 0);
    assert_true(info.refused_requests == 4);
    assert_true(info.refused_steps == 0);
    assert_int_equal(info.frozen, 0);
    stop(&s, &cl);
    char *text = log_text();
    fprintf(stderr, "%s", text);
    assert_non_null(strstr(text, "block fmnist-mlp.5: 1 gradient refused"));
    assert_null(strstr(text, "have not moved"));
    fclose(svc_log);
    svc_log = NULL;
}

/* A replica whose weights stop moving is detected and reported: with the
 * bounds off, one finite 1e15 gradient leaves AdamW's second moment so
 * large that, once the momentum has decayed, steps change no weight. The
 * peer logs it once and block_info says frozen. */
static void test_frozen_replica_reported(void **state)
{
    (void)state;
    static const int blocks[] = {5};
    static result r;
    svc_log = tmpfile();
    assert_non_null(svc_log);
    svc_guard = (struct expert_guard_config){ .factor = -1, .max_norm = -1, .frozen_steps = 5 };
    int port;
    peer_service *s = start(&port, blocks, 1);
    peer_rpc_client *cl = connect_to(port);
    for (int i = 0; i < 3; i++)
        head_backward(cl, 300 + (unsigned)i, 1.0f, &r);
    head_backward(cl, 9, 1e15f, &r);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    peer_block_info info;
    int i = 0;
    for (; i < 600; i++) {
        head_backward(cl, 400 + (unsigned)i, 1.0f, &r);
        assert_int_equal(r.kind, PEER_KIND_REPLY);
        assert_int_equal(peer_service_block_info(s, 0, &info), 0);
        if (info.frozen)
            break;
    }
    fprintf(stderr, "  frozen after %d honest steps (version %llu)\n", i + 1, (unsigned long long)info.version);
    assert_int_equal(info.frozen, 1);
    assert_true(info.still_steps == 5);
    head_backward(cl, 1000, 1.0f, &r); /* the next request logs it */
    for (int k = 0; k < 3; k++)
        head_backward(cl, 1001 + (unsigned)k, 1.0f, &r);
    stop(&s, &cl);
    char *text = log_text();
    fprintf(stderr, "%s", text);
    const char *hit = strstr(text, "block fmnist-mlp.5: weights have not moved in 5 steps");
    assert_non_null(hit);
    assert_null(strstr(hit + strlen("block fmnist-mlp.5: weights have not moved"), "have not moved")); /* once */
    fclose(svc_log);
    svc_log = NULL;
    svc_guard = (struct expert_guard_config){0};
}

static int setup(void **state)
{
    (void)state;
    test_tmpdir(dir, sizeof dir, "svc");
    assert_int_equal(uv_loop_init(&loop), 0);
    uint8_t s1[32] = {1}, s2[32] = {2};
    dht_identity_from_seed(&id_srv, s1);
    dht_identity_from_seed(&id_cli, s2);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    uv_run(&loop, UV_RUN_NOWAIT);
    assert_int_equal(uv_loop_close(&loop), 0);
    test_rmtree(dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_rpc_equals_local_and_restart, setup, teardown),
        cmocka_unit_test_setup_teardown(test_infer_spans, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_configs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_checkpoint_of_another_stage, setup, teardown),
        cmocka_unit_test_setup_teardown(test_stale_tmp_cleaned, setup, teardown),
        cmocka_unit_test_setup_teardown(test_backward_gradients_checked, setup, teardown),
        cmocka_unit_test_setup_teardown(test_frozen_replica_reported, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
