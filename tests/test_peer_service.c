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
#include "net/tensorfmt.h"
#include "test_util.h"
#include "test_rpc_util.h"

static uv_loop_t loop;
static dht_identity id_srv, id_cli;
static char dir[256];
static FILE *svc_log; /* the services' log (NULL: stderr) */
static struct expert_guard_config svc_guard; /* the services' gradient checks (zeros: defaults) */
static uint32_t svc_formats; /* the services' accepted tensor formats (0: all) */
static const char *svc_model = "fmnist-mlp"; /* the services' model */

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
    c.model = svc_model;
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
    c.formats = svc_formats;
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
    peer_service_stop(*s, closed_svc, &b);
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

/* ---- compressed tensor formats ---- */

/* A reply as it came: its tensor's format, bytes and values. */
typedef struct fresult {
    int done, status;
    peer_kind kind;
    int err_code;
    char err_msg[PEER_WIRE_MAX_ERRMSG + 1];
    int n_tensors;
    peer_dtype dtype;
    int block;
    uint64_t shape[2];
    size_t nbytes;
    uint8_t raw[4 * 2 * 128 * 256]; /* the largest reply: a tiny-lm embed output of 2 rows */
    float data[16 * 512];
    int to_f32; /* peer_tensor_to_f32's result */
} fresult;

static void on_freply(void *arg, int status, const peer_msg *m)
{
    fresult *r = arg;
    r->done = 1;
    r->status = status;
    if (status != 0)
        return;
    r->kind = m->kind;
    r->err_code = m->err_code;
    snprintf(r->err_msg, sizeof r->err_msg, "%s", m->err_msg);
    r->n_tensors = m->n_tensors;
    if (m->kind == PEER_KIND_REPLY && m->n_tensors == 1) {
        const peer_tensor *t = &m->t[0];
        r->dtype = t->dtype;
        r->block = t->block;
        r->shape[0] = t->shape[0];
        r->shape[1] = t->ndim > 1 ? t->shape[1] : 0;
        r->nbytes = t->nbytes;
        assert_true(t->nbytes <= sizeof r->raw);
        memcpy(r->raw, t->data, t->nbytes);
        r->to_f32 = peer_tensor_to_f32(t, r->data, sizeof r->data / sizeof r->data[0]);
    }
}

/* A wire tensor for a call: (rows, width) values x sent in format (dtype,
 * block); bytes is where its encoding goes. */
typedef struct ftensor {
    const float *x;
    int rows, width;
    peer_dtype dtype;
    int block;
} ftensor;

/* Encodes each tensor of ts in its format and calls method on block with
 * the reply format (rdt, rblk). */
static void call_fmt(peer_rpc_client *cl, peer_method method, const char *block, const ftensor *ts, int nt,
                     peer_dtype rdt, int rblk, fresult *r)
{
    static uint8_t enc[2][4 * 16 * 512];
    peer_msg m;
    peer_msg_init(&m, PEER_KIND_REQUEST, method, 0);
    snprintf(m.block, sizeof m.block, "%s", block);
    for (int i = 0; i < nt; i++) {
        uint64_t row[1] = {(uint64_t)ts[i].width};
        assert_int_equal(peer_tensor_rows_as(&m.t[i], ts[i].x, (uint64_t)ts[i].rows, 1, row, ts[i].dtype,
                                             ts[i].block, 0, 0, enc[i], sizeof enc[i]),
                         0);
    }
    m.n_tensors = nt;
    m.reply_dtype = rdt;
    m.reply_block = rblk;
    memset(r, 0, sizeof *r);
    assert_int_equal(peer_rpc_call(cl, &m, 20000, on_freply, r, NULL), 0);
    run_until(&r->done);
    assert_int_equal(r->status, 0);
}

/* x (n values) as it reads after a round trip through (dtype, block). */
static void through(const float *x, size_t n, peer_dtype dtype, int block, float *out)
{
    static uint8_t b[4 * 16 * 512];
    long k = peer_tensorfmt_encode((peer_fmt)dtype, block, x, n, b, sizeof b);
    assert_true(k > 0);
    assert_int_equal(peer_tensorfmt_decode((peer_fmt)dtype, block, b, (size_t)k, n, out), 0);
}

/* Q8's bound for a value of a block whose absmax is amax, to nearest
 * (half a step) or stochastically (one step), plus float rounding. */
static double q8_err_bound(double amax, int sr)
{
    return amax / (sr ? 127.0 : 254.0) + amax * 0x1.0p-21 + 0x1.0p-149;
}

/* The largest error of y against want (n values) relative to Q8's bound
 * with the given block; > 1 is out of bound. Also the share of values
 * whose error exceeds half a step (only stochastic rounding gives those). */
static double q8_worst(const float *y, const float *want, size_t n, int block, int sr, double *over_half)
{
    double worst = 0;
    size_t over = 0;
    for (size_t b0 = 0; b0 < n; b0 += (size_t)block) {
        size_t b1 = b0 + (size_t)block < n ? b0 + (size_t)block : n;
        double amax = 0;
        for (size_t i = b0; i < b1; i++)
            amax = fmax(amax, fabs((double)want[i]));
        for (size_t i = b0; i < b1; i++) {
            double err = fabs((double)y[i] - (double)want[i]);
            worst = fmax(worst, err / q8_err_bound(amax, sr));
            if (err > q8_err_bound(amax, 0))
                over++;
        }
    }
    if (over_half)
        *over_half = (double)over / (double)n;
    return worst;
}

static uint64_t tbytes(const peer_service *s, int method, peer_dtype fmt, int way)
{
    return peer_service_tensor_bytes(s, method, (int)fmt, way);
}

/* Requests with compressed tensors and a reply format (key 8): inputs are
 * decoded before the computation (the reply equals the local computation
 * on the decoded inputs), replies come in the format asked for (to nearest
 * for forward and infer: exactly the codec's encoding of the f32 reply;
 * stochastically rounded for backward: within one step, unbiased), a
 * payload that does not decode is EBADMSG, and the service counts tensor
 * bytes by method, format and direction. */
static void test_compressed_formats(void **state)
{
    (void)state;
    static const int blocks[] = {1, 5};
    int port;
    peer_service *s = start(&port, blocks, 2);
    peer_rpc_client *cl = connect_to(port);
    assert_int_equal(peer_service_formats(s), PEER_FMT_MASK_ALL);
    const struct expert_model_spec *spec = expert_model_find("fmnist-mlp");
    struct expert_block_config c1;
    assert_int_equal(expert_model_stage(spec, 1, &c1), 0);
    expert_block *ref1 = expert_block_create(&c1, expert_stage_seed(42, 1));
    expert_workspace *ws1 = expert_workspace_create(&c1, 16);
    assert_true(ref1 && ws1);
    enum { B = 5, W = 512, N = B * W };
    static float x[N], xd[N], gy[N], gyd[N], want[N], enc_want[N];
    static uint8_t wbytes[4 * N];
    static fresult r, r32;
    fill(x, N, 11);
    fill(gy, N, 12);
    for (int i = 0; i < N; i += 97)
        x[i] *= 4.0f; /* blocks of different absmax */

    /* forward, q8 input, f32 reply: the local forward of the decoded input */
    through(x, N, PEER_DTYPE_Q8, 64, xd);
    ftensor in_q8 = {x, B, W, PEER_DTYPE_Q8, 64};
    uint64_t f_q8_in = tbytes(s, 0, PEER_DTYPE_Q8, 0), f_f32_out = tbytes(s, 0, PEER_DTYPE_F32, 1);
    call_fmt(cl, PEER_METHOD_FORWARD, "fmnist-mlp.1", &in_q8, 1, PEER_DTYPE_F32, 0, &r32);
    assert_int_equal(r32.kind, PEER_KIND_REPLY);
    assert_int_equal(r32.dtype, PEER_DTYPE_F32);
    assert_true(r32.shape[0] == B && r32.shape[1] == W);
    assert_int_equal(r32.to_f32, 0);
    assert_int_equal(expert_block_forward(ref1, ws1, want, xd, B, NULL), 0);
    assert_memory_equal(r32.data, want, sizeof want);
    assert_true(tbytes(s, 0, PEER_DTYPE_Q8, 0) - f_q8_in == peer_tensorfmt_size(PEER_FMT_Q8, 64, N));
    assert_true(tbytes(s, 0, PEER_DTYPE_F32, 1) - f_f32_out == 4 * (uint64_t)N);
    /* the same with the decoded values sent as f32 */
    ftensor in_d = {xd, B, W, PEER_DTYPE_F32, 0};
    call_fmt(cl, PEER_METHOD_FORWARD, "fmnist-mlp.1", &in_d, 1, PEER_DTYPE_F32, 0, &r);
    assert_memory_equal(r.data, want, sizeof want);

    /* the reply in each format asked for: exactly the codec's encoding of
     * the f32 reply (to nearest), so within its bound */
    static const struct { peer_dtype dt; int blk; } rf[] = {
        {PEER_DTYPE_Q8, 64}, {PEER_DTYPE_Q8, 16}, {PEER_DTYPE_Q8, 4096}, {PEER_DTYPE_F16, 0}, {PEER_DTYPE_BF16, 0},
    };
    for (size_t i = 0; i < sizeof rf / sizeof rf[0]; i++) {
        uint64_t in0 = tbytes(s, 0, PEER_DTYPE_Q8, 0), out0 = tbytes(s, 0, rf[i].dt, 1);
        call_fmt(cl, PEER_METHOD_FORWARD, "fmnist-mlp.1", &in_q8, 1, rf[i].dt, rf[i].blk, &r);
        if (r.kind != PEER_KIND_REPLY)
            fail_msg("reply format %s:%d: error %d %s", peer_tensorfmt_name((peer_fmt)rf[i].dt), rf[i].blk,
                     r.err_code, r.err_msg);
        assert_int_equal(r.dtype, rf[i].dt);
        assert_int_equal(r.block, rf[i].blk);
        assert_true(r.shape[0] == B && r.shape[1] == W);
        size_t sz = peer_tensorfmt_size((peer_fmt)rf[i].dt, rf[i].blk, N);
        assert_int_equal(r.nbytes, sz);
        assert_int_equal(r.to_f32, 0);
        assert_int_equal(peer_tensorfmt_encode((peer_fmt)rf[i].dt, rf[i].blk, want, N, wbytes, sizeof wbytes),
                         (long)sz);
        assert_memory_equal(r.raw, wbytes, sz);
        if (rf[i].dt == PEER_DTYPE_Q8) {
            double worst = q8_worst(r.data, want, N, rf[i].blk, 0, NULL);
            if (!(worst <= 1.0))
                fail_msg("q8:%d reply: an error %.2f x the bound", rf[i].blk, worst);
        } else {
            through(want, N, rf[i].dt, 0, enc_want);
            assert_memory_equal(r.data, enc_want, sizeof enc_want);
        }
        assert_true(tbytes(s, 0, PEER_DTYPE_Q8, 0) - in0 == peer_tensorfmt_size(PEER_FMT_Q8, 64, N));
        assert_true(tbytes(s, 0, rf[i].dt, 1) - out0 == sz);
    }

    /* f16 and bf16 inputs are decoded too */
    for (int dt = PEER_DTYPE_F16; dt <= PEER_DTYPE_BF16; dt++) {
        ftensor in = {x, B, W, (peer_dtype)dt, 0};
        uint64_t in0 = tbytes(s, 0, (peer_dtype)dt, 0);
        call_fmt(cl, PEER_METHOD_FORWARD, "fmnist-mlp.1", &in, 1, PEER_DTYPE_F32, 0, &r);
        assert_int_equal(r.kind, PEER_KIND_REPLY);
        through(x, N, (peer_dtype)dt, 0, xd);
        assert_int_equal(expert_block_forward(ref1, ws1, enc_want, xd, B, NULL), 0);
        assert_memory_equal(r.data, enc_want, sizeof enc_want);
        assert_true(tbytes(s, 0, (peer_dtype)dt, 0) - in0 == 2 * (uint64_t)N);
    }

    /* infer: the same reply as forward, counted as infer */
    uint64_t i_in = tbytes(s, 2, PEER_DTYPE_Q8, 0), i_out = tbytes(s, 2, PEER_DTYPE_F16, 1);
    call_fmt(cl, PEER_METHOD_INFER, "fmnist-mlp.1", &in_q8, 1, PEER_DTYPE_F16, 0, &r);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    assert_int_equal(r.dtype, PEER_DTYPE_F16);
    through(want, N, PEER_DTYPE_F16, 0, enc_want);
    assert_memory_equal(r.data, enc_want, sizeof enc_want);
    assert_true(tbytes(s, 2, PEER_DTYPE_Q8, 0) - i_in == peer_tensorfmt_size(PEER_FMT_Q8, 64, N));
    assert_true(tbytes(s, 2, PEER_DTYPE_F16, 1) - i_out == 2 * (uint64_t)N);

    /* backward: q8 inputs and bf16 grad_outputs, 3 rows (two of them stay
     * below target_batch 8, so the weights do not move): the f32 reply is
     * the local backward of the decoded tensors; a q8 reply is within one
     * step of it, stochastically rounded (some errors above half a step) */
    enum { BB = 3, NB = BB * W };
    ftensor bw[2] = {{x, BB, W, PEER_DTYPE_Q8, 64}, {gy, BB, W, PEER_DTYPE_BF16, 0}};
    through(x, NB, PEER_DTYPE_Q8, 64, xd);
    through(gy, NB, PEER_DTYPE_BF16, 0, gyd);
    assert_int_equal(expert_block_backward(ref1, ws1, want, gyd, xd, BB, NULL), 0);
    uint64_t b_q8 = tbytes(s, 1, PEER_DTYPE_Q8, 0), b_bf16 = tbytes(s, 1, PEER_DTYPE_BF16, 0),
             b_f32o = tbytes(s, 1, PEER_DTYPE_F32, 1), b_q8o = tbytes(s, 1, PEER_DTYPE_Q8, 1);
    call_fmt(cl, PEER_METHOD_BACKWARD, "fmnist-mlp.1", bw, 2, PEER_DTYPE_F32, 0, &r);
    if (r.kind != PEER_KIND_REPLY)
        fail_msg("backward: error %d %s", r.err_code, r.err_msg);
    assert_memory_equal(r.data, want, NB * sizeof(float));
    call_fmt(cl, PEER_METHOD_BACKWARD, "fmnist-mlp.1", bw, 2, PEER_DTYPE_Q8, 64, &r);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    assert_int_equal(r.dtype, PEER_DTYPE_Q8);
    assert_int_equal(r.block, 64);
    assert_int_equal(r.to_f32, 0);
    double over_half;
    double worst = q8_worst(r.data, want, NB, 64, 1, &over_half);
    fprintf(stderr, "  backward q8 reply: worst error %.2f of a step, %.0f%% of values over half a step\n", worst,
            100 * over_half);
    assert_true(worst <= 1.0);
    assert_true(over_half > 0.05); /* rounding to nearest never gives those */
    assert_true(tbytes(s, 1, PEER_DTYPE_Q8, 0) - b_q8 == 2 * peer_tensorfmt_size(PEER_FMT_Q8, 64, NB));
    assert_true(tbytes(s, 1, PEER_DTYPE_BF16, 0) - b_bf16 == 2 * 2 * (uint64_t)NB);
    assert_true(tbytes(s, 1, PEER_DTYPE_F32, 1) - b_f32o == 4 * (uint64_t)NB);
    assert_true(tbytes(s, 1, PEER_DTYPE_Q8, 1) - b_q8o == peer_tensorfmt_size(PEER_FMT_Q8, 64, NB));

    /* a q8 payload with a negative scale: EBADMSG, nothing computed */
    {
        static uint8_t bad[4 * N];
        long k = peer_tensorfmt_encode(PEER_FMT_Q8, 64, x, N, bad, sizeof bad);
        assert_true(k > 0);
        const float neg = -1.0f;
        memcpy(bad + 68 * 3, &neg, 4);
        peer_msg m;
        peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_FORWARD, 0);
        snprintf(m.block, sizeof m.block, "fmnist-mlp.1");
        uint64_t shape[2] = {B, W};
        assert_int_equal(peer_tensor_encoded(&m.t[0], PEER_DTYPE_Q8, 64, bad, 2, shape), 0);
        m.n_tensors = 1;
        memset(&r, 0, sizeof r);
        assert_int_equal(peer_rpc_call(cl, &m, 20000, on_freply, &r, NULL), 0);
        run_until(&r.done);
        assert_int_equal(r.kind, PEER_KIND_ERROR);
        assert_int_equal(r.err_code, EBADMSG);
        fprintf(stderr, "  negative scale: %s\n", r.err_msg);
        assert_non_null(strstr(r.err_msg, "fmnist-mlp.1"));
    }
    /* a q8 input of the wrong shape is refused like an f32 one */
    ftensor wrong = {x, B, W - 1, PEER_DTYPE_Q8, 64};
    call_fmt(cl, PEER_METHOD_FORWARD, "fmnist-mlp.1", &wrong, 1, PEER_DTYPE_Q8, 64, &r);
    assert_int_equal(r.kind, PEER_KIND_ERROR);
    assert_int_equal(r.err_code, EINVAL);
    assert_non_null(strstr(r.err_msg, "(B, 512)"));

    /* counters: bad arguments read 0 */
    assert_true(peer_service_tensor_bytes(s, 3, 0, 0) == 0);
    assert_true(peer_service_tensor_bytes(s, -1, 0, 0) == 0);
    assert_true(peer_service_tensor_bytes(s, 0, 4, 0) == 0);
    assert_true(peer_service_tensor_bytes(s, 0, 0, 2) == 0);
    assert_true(peer_service_tensor_bytes(NULL, 0, 0, 0) == 0);
    peer_block_info info;
    assert_int_equal(peer_service_block_info(s, 0, &info), 0);
    assert_true(info.version == 0); /* 6 backward rows: no step yet */
    stop(&s, &cl);
    expert_workspace_destroy(&ws1);
    expert_block_destroy(&ref1);
}

/* A service that accepts only some formats refuses requests whose tensors
 * or reply format are not among them, with EINVAL naming what it accepts;
 * float32 is always accepted. */
static void test_formats_refused(void **state)
{
    (void)state;
    static const int blocks[] = {5};
    enum { B = 4, W = 512, N = B * W };
    static float x[N];
    static fresult r;
    fill(x, N, 21);
    struct { uint32_t cfg, want; } cases[] = {
        {PEER_FMT_BIT(PEER_FMT_F32), PEER_FMT_BIT(PEER_FMT_F32)},
        {PEER_FMT_BIT(PEER_FMT_F16), PEER_FMT_BIT(PEER_FMT_F32) | PEER_FMT_BIT(PEER_FMT_F16)},
    };
    for (int c = 0; c < 2; c++) {
        svc_formats = cases[c].cfg;
        int port;
        peer_service *s = start(&port, blocks, 1);
        peer_rpc_client *cl = connect_to(port);
        assert_int_equal(peer_service_formats(s), cases[c].want);
        char accepts[64];
        assert_true(peer_tensorfmt_mask_format(cases[c].want, accepts, sizeof accepts) > 0);
        /* a q8 input; an f32 input with a q8 reply; a bf16 input with an f32
         * reply: all refused */
        ftensor q8in = {x, B, W, PEER_DTYPE_Q8, 64}, f32in = {x, B, W, PEER_DTYPE_F32, 0},
                bfin = {x, B, W, PEER_DTYPE_BF16, 0}, f16in = {x, B, W, PEER_DTYPE_F16, 0};
        struct { const ftensor *in; peer_dtype rdt; int rblk; const char *name; } refused[] = {
            {&q8in, PEER_DTYPE_F32, 0, "q8"},
            {&f32in, PEER_DTYPE_Q8, 64, "q8"},
            {&bfin, PEER_DTYPE_F32, 0, "bf16"},
            {&f32in, PEER_DTYPE_BF16, 0, "bf16"},
            {&q8in, PEER_DTYPE_Q8, 16, "q8"},
        };
        for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
            for (int method = PEER_METHOD_FORWARD; method <= PEER_METHOD_INFER; method += 2) {
                call_fmt(cl, (peer_method)method, "fmnist-mlp.5", refused[i].in, 1, refused[i].rdt, refused[i].rblk,
                         &r);
                if (r.kind != PEER_KIND_ERROR || r.err_code != EINVAL)
                    fail_msg("accepting %s: case %zu method %d was not refused (kind %d, code %d)", accepts, i,
                             method, (int)r.kind, r.err_code);
                if (!strstr(r.err_msg, "not accepted") || !strstr(r.err_msg, refused[i].name) ||
                    !strstr(r.err_msg, accepts))
                    fail_msg("accepting %s: case %zu: message \"%s\"", accepts, i, r.err_msg);
            }
        }
        fprintf(stderr, "  %s\n", r.err_msg);
        /* a backward with one tensor in a refused format */
        ftensor bw[2] = {{x, B, W, PEER_DTYPE_F32, 0}, {x, B, 10, PEER_DTYPE_Q8, 16}};
        call_fmt(cl, PEER_METHOD_BACKWARD, "fmnist-mlp.5", bw, 2, PEER_DTYPE_F32, 0, &r);
        assert_int_equal(r.kind, PEER_KIND_ERROR);
        assert_int_equal(r.err_code, EINVAL);
        assert_non_null(strstr(r.err_msg, "not accepted"));
        /* accepted: f32 both ways; f16 where configured */
        call_fmt(cl, PEER_METHOD_FORWARD, "fmnist-mlp.5", &f32in, 1, PEER_DTYPE_F32, 0, &r);
        assert_int_equal(r.kind, PEER_KIND_REPLY);
        assert_true(r.shape[0] == B && r.shape[1] == 10);
        call_fmt(cl, PEER_METHOD_FORWARD, "fmnist-mlp.5", &f16in, 1, PEER_DTYPE_F16, 0, &r);
        if (c == 0) {
            assert_int_equal(r.kind, PEER_KIND_ERROR);
            assert_int_equal(r.err_code, EINVAL);
            assert_non_null(strstr(r.err_msg, "f16"));
        } else {
            assert_int_equal(r.kind, PEER_KIND_REPLY);
            assert_int_equal(r.dtype, PEER_DTYPE_F16);
            assert_int_equal(r.nbytes, 2 * B * 10);
        }
        /* nothing refused was computed */
        peer_block_info info;
        assert_int_equal(peer_service_block_info(s, 0, &info), 0);
        assert_true(info.stats.rows[PEER_TASK_FORWARD] == (uint64_t)B * (c == 0 ? 1 : 2));
        assert_true(info.stats.rows[PEER_TASK_INFER] == 0 && info.stats.rows[PEER_TASK_BACKWARD] == 0);
        stop(&s, &cl);
    }
}

/* An embed stage takes token values only as f32: f16 and bf16 would round
 * large tokens to their neighbours silently, q8 would blur them. */
static void test_tokens_only_f32(void **state)
{
    (void)state;
    static const int blocks[] = {0};
    enum { B = 2, W = 128, N = B * W };
    static float x[N];
    static fresult r;
    for (int i = 0; i < N; i++)
        x[i] = (float)(i % 256);
    svc_model = "tiny-lm";
    int port;
    peer_service *s = start(&port, blocks, 1);
    peer_rpc_client *cl = connect_to(port);
    ftensor f16in = {x, B, W, PEER_DTYPE_F16, 0}, q8in = {x, B, W, PEER_DTYPE_Q8, 64},
            f32in = {x, B, W, PEER_DTYPE_F32, 0};
    const ftensor *bad[] = {&f16in, &q8in};
    for (int i = 0; i < 2; i++) {
        call_fmt(cl, PEER_METHOD_FORWARD, "tiny-lm.0", bad[i], 1, PEER_DTYPE_F32, 0, &r);
        assert_int_equal(r.kind, PEER_KIND_ERROR);
        assert_int_equal(r.err_code, EINVAL);
        if (!strstr(r.err_msg, "token values as f32"))
            fail_msg("message \"%s\"", r.err_msg);
    }
    /* f32 tokens with a compressed reply are fine */
    call_fmt(cl, PEER_METHOD_FORWARD, "tiny-lm.0", &f32in, 1, PEER_DTYPE_BF16, 0, &r);
    assert_int_equal(r.kind, PEER_KIND_REPLY);
    assert_int_equal(r.dtype, PEER_DTYPE_BF16);
    stop(&s, &cl);
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
    svc_formats = 0;
    svc_model = "fmnist-mlp";
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
        cmocka_unit_test_setup_teardown(test_compressed_formats, setup, teardown),
        cmocka_unit_test_setup_teardown(test_formats_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tokens_only_f32, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
