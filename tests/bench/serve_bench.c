/* tests/bench/serve_bench.c: how much of a block's local speed a peer
 * serves over the tensor RPC (in the manner of hivemind's
 * benchmark_throughput).
 *
 * A peer service (own thread and loop) hosts fmnist-mlp.1 (ResFFN 512/2048).
 * C clients on the main loop keep D requests each in flight for S seconds:
 * backward requests of B random rows (each one is a forward recompute plus a
 * backward: the same work as one local forward+backward). Served samples/s
 * is then divided by the same block's local samples/s, measured in the same
 * process with expert_block_forward_backward at the same B and the same
 * OpenBLAS threads. The peer joins concurrent requests up to --max-batch
 * rows (default 256 as in `starling peer`, or --batch if larger), so the
 * local rate at that many rows is printed too (efficiency_vs_joined: what
 * joining itself gains is then left out). The local loop takes no optimizer step, so by default
 * the peer's target batch is so large that it takes none either (--target N
 * sets the peer's, to see what its AdamW steps cost). The last stdout line
 * is one JSON object.
 *
 * usage: serve_bench [--clients C] [--depth D] [--batch B] [--max-batch M] [--seconds S] [--threads T]
 *                    [--target N]
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <pthread.h>
#include <uv.h>

#include "expert/blas.h"
#include "expert/block.h"
#include "expert/model.h"
#include "peer/peer.h"

static dht_identity id_s, id_c;
static int g_batch = 128, g_max_batch = 0 /* max(256, batch) */, g_clients = 4, g_depth = 2, g_blas = 0, g_target = 1 << 30;
static double g_seconds = 8;

static double cpu_of(clockid_t id)
{
    struct timespec ts;
    if (clock_gettime(id, &ts) != 0)
        return 0.0;
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- the peer ---- */

typedef struct srv {
    pthread_t th;
    uv_loop_t loop;
    uv_async_t stop;
    peer_service *svc;
    atomic_int port;
    peer_block_info info; /* read on the peer's loop as it stops */
} srv;

static void svc_closed(peer_service *s, int ck, void *arg)
{
    (void)ck;
    srv *t = arg;
    peer_service_destroy(&s);
    uv_close((uv_handle_t *)&t->stop, NULL);
}

static void on_stop(uv_async_t *a)
{
    srv *t = a->data;
    peer_service_block_info(t->svc, 0, &t->info);
    peer_service_stop(t->svc, svc_closed, t);
}

static void *srv_main(void *arg)
{
    srv *t = arg;
    uv_loop_init(&t->loop);
    uv_async_init(&t->loop, &t->stop, on_stop);
    t->stop.data = t;
    static const int blocks[] = {1};
    peer_service_config c;
    memset(&c, 0, sizeof c);
    c.self = &id_s;
    c.model = "fmnist-mlp";
    c.blocks = blocks;
    c.n_blocks = 1;
    c.threads = 1;
    c.max_batch = g_max_batch;
    c.max_queue_rows = g_max_batch + g_batch * g_clients * g_depth * 2;
    expert_optim_default_adamw(&c.optim);
    c.optim.target_batch = g_target;
    char err[256];
    t->svc = peer_service_create(&t->loop, &c, err, sizeof err);
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", 0, &a);
    if (!t->svc || peer_service_listen(t->svc, (struct sockaddr *)&a) != 0) {
        fprintf(stderr, "serve_bench: cannot start the peer: %s\n", t->svc ? "listen" : err);
        atomic_store(&t->port, -1);
        return NULL;
    }
    atomic_store(&t->port, peer_service_port(t->svc));
    uv_run(&t->loop, UV_RUN_DEFAULT);
    uv_loop_close(&t->loop);
    return NULL;
}

/* ---- the clients ---- */

typedef struct cli {
    peer_rpc_client *cl;
    int ready;
    float *x, *dy;
} cli;

static uv_loop_t loop;
static long served_rows, errors, inflight;
static double t_end;
static int stopping;

static void send_one(cli *c);

static void on_reply(void *arg, int status, const peer_msg *m)
{
    cli *c = arg;
    inflight--;
    if (status != 0 || m->kind != PEER_KIND_REPLY)
        errors++;
    else
        served_rows += g_batch;
    if (!stopping && mono() < t_end)
        send_one(c);
}

static void send_one(cli *c)
{
    peer_msg m;
    peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_BACKWARD, 0);
    snprintf(m.block, sizeof m.block, "fmnist-mlp.1");
    uint64_t shape[2] = {(uint64_t)g_batch, 512};
    peer_tensor_f32(&m.t[0], c->x, 2, shape);
    peer_tensor_f32(&m.t[1], c->dy, 2, shape);
    m.n_tensors = 2;
    if (peer_rpc_call(c->cl, &m, 60000, on_reply, c, NULL) == 0)
        inflight++;
    else
        errors++;
}

static void on_connect(peer_rpc_client *cl, int status, void *arg)
{
    (void)cl;
    ((cli *)arg)->ready = status == 0 ? 1 : -1;
}

static void on_closed(peer_rpc_client *cl, void *arg)
{
    (void)arg;
    peer_rpc_client_destroy(&cl);
}

/* Local reference: the same block, n rows forward+backward in a loop. */
static double local_rate(int n)
{
    const struct expert_model_spec *spec = expert_model_find("fmnist-mlp");
    struct expert_block_config bc;
    expert_model_stage(spec, 1, &bc);
    expert_block *b = expert_block_create(&bc, 1);
    expert_workspace *ws = expert_workspace_create(&bc, n);
    float *x = malloc((size_t)n * 512 * sizeof(float)), *y = malloc((size_t)n * 512 * sizeof(float));
    float *dx = malloc((size_t)n * 512 * sizeof(float));
    for (int i = 0; i < n * 512; i++)
        x[i] = y[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
    expert_block_forward_backward(b, ws, NULL, dx, y, x, n, NULL); /* warm-up */
    long rows = 0;
    double t0 = mono();
    while (mono() - t0 < g_seconds / 2) {
        expert_block_forward_backward(b, ws, NULL, dx, y, x, n, NULL);
        rows += n;
    }
    double rate = (double)rows / (mono() - t0);
    free(x);
    free(y);
    free(dx);
    expert_workspace_destroy(&ws);
    expert_block_destroy(&b);
    return rate;
}

int main(int argc, char **argv)
{
    expert_blas_prefer_native(argv);
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--clients")) g_clients = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--depth")) g_depth = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--batch")) g_batch = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--max-batch")) g_max_batch = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--seconds")) g_seconds = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) g_blas = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--target")) g_target = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: serve_bench [--clients C] [--depth D] [--batch B] [--max-batch M] "
                            "[--seconds S] [--threads T] [--target N]\n");
            return 2;
        }
    }
    if (g_max_batch == 0)
        g_max_batch = g_batch > 256 ? g_batch : 256;
    if (g_clients < 1 || g_clients > 64 || g_depth < 1 || g_batch < 1 || g_batch > 4096 || g_max_batch < g_batch ||
        g_max_batch > 4096 || !(g_seconds > 0) ||
        g_target < 1) {
        fprintf(stderr, "serve_bench: bad arguments\n");
        return 2;
    }
    int blas = expert_blas_set_threads(g_blas);
    uint8_t s1[32] = {1}, s2[32] = {2};
    dht_identity_from_seed(&id_s, s1);
    dht_identity_from_seed(&id_c, s2);

    double local = local_rate(g_batch);
    double local_joined = g_max_batch == g_batch ? local : local_rate(g_max_batch);

    srv t;
    memset(&t, 0, sizeof t);
    pthread_create(&t.th, NULL, srv_main, &t);
    while (atomic_load(&t.port) == 0)
        usleep(1000);
    if (atomic_load(&t.port) < 0)
        return 1;
    uv_loop_init(&loop);
    cli *cs = calloc((size_t)g_clients, sizeof *cs);
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", atomic_load(&t.port), &a);
    for (int i = 0; i < g_clients; i++) {
        peer_rpc_client_config cc = {.self = &id_c, .expect_id = id_s.id};
        cs[i].cl = peer_rpc_client_create(&loop, &cc);
        cs[i].x = malloc((size_t)g_batch * 512 * sizeof(float));
        cs[i].dy = malloc((size_t)g_batch * 512 * sizeof(float));
        for (int k = 0; k < g_batch * 512; k++) {
            cs[i].x[k] = (float)((k * 13 + i) % 97) / 97.0f - 0.5f;
            cs[i].dy[k] = (float)((k * 7 + i) % 89) / 89.0f - 0.5f;
        }
        peer_rpc_client_connect(cs[i].cl, (struct sockaddr *)&a, on_connect, &cs[i]);
    }
    for (int ready = 0; ready < g_clients;) {
        uv_run(&loop, UV_RUN_ONCE);
        ready = 0;
        for (int i = 0; i < g_clients; i++) {
            if (cs[i].ready < 0)
                return 1;
            ready += cs[i].ready;
        }
    }
    /* Warm up for a second, then measure. */
    t_end = mono() + 1.0 + g_seconds;
    for (int i = 0; i < g_clients; i++)
        for (int d = 0; d < g_depth; d++)
            send_one(&cs[i]);
    double w_end = mono() + 1.0;
    while (mono() < w_end)
        uv_run(&loop, UV_RUN_ONCE);
    /* CPU of the clients' loop (this thread) and of the peer's loop thread
     * while measuring: what the network side takes from the BLAS threads. */
    clockid_t srv_clock;
    int have_srv_clock = pthread_getcpuclockid(t.th, &srv_clock) == 0;
    long rows0 = served_rows;
    double t0 = mono(), c0 = cpu_of(CLOCK_THREAD_CPUTIME_ID), s0 = have_srv_clock ? cpu_of(srv_clock) : 0.0;
    while (mono() < t_end)
        uv_run(&loop, UV_RUN_ONCE);
    double wall = mono() - t0;
    double served = (double)(served_rows - rows0) / wall;
    double client_cpu = (cpu_of(CLOCK_THREAD_CPUTIME_ID) - c0) / wall;
    double server_cpu = have_srv_clock ? (cpu_of(srv_clock) - s0) / wall : -1.0;
    stopping = 1;
    while (inflight > 0)
        uv_run(&loop, UV_RUN_ONCE);
    for (int i = 0; i < g_clients; i++) {
        peer_rpc_client_stop(cs[i].cl, on_closed, NULL);
        free(cs[i].x);
        free(cs[i].dy);
    }
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
    uv_async_send(&t.stop);
    pthread_join(t.th, NULL);
    free(cs);
    const peer_batcher_stats *st = &t.info.stats;
    double mean_rows = st->batches ? (double)(st->rows[PEER_TASK_BACKWARD] + st->rows[PEER_TASK_FORWARD]) /
                                         (double)st->batches
                                   : 0.0;
    printf("{\"bench\":\"serve_bench\",\"block\":\"fmnist-mlp.1\",\"batch\":%d,\"max_batch\":%d,"
           "\"clients\":%d,\"depth\":%d,\"blas_threads\":%d,\"target_batch\":%d,\"openblas_core\":\"%s\","
           "\"served_samples_per_s\":%.1f,\"mean_joined_rows\":%.1f,\"local_samples_per_s\":%.1f,"
           "\"local_joined_samples_per_s\":%.1f,\"efficiency\":%.3f,\"efficiency_vs_joined\":%.3f,"
           "\"client_loop_cpu\":%.3f,\"peer_loop_cpu\":%.3f,\"errors\":%ld}\n",
           g_batch, g_max_batch, g_clients, g_depth, blas, g_target, expert_blas_corename(), served, mean_rows,
           local, local_joined, served / local, served / local_joined, client_cpu, server_cpu, errors);
    return errors ? 1 : 0;
}
