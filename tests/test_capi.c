/* tests/test_capi.c: libstarling's public API (capi/starling.h) as a
 * binding uses it: local model facts and initial weights, argument and
 * join errors, and a loopback swarm started here (a bootstrap node and two
 * peers: A holds every stage of fmnist-mlp, B stages 1-4): its models and
 * holders, raw records, remote forward/backward equal to the block's own
 * math on the same weights, calls from several threads, a holder killed
 * under a backward that preferred it, and closing leaves no thread behind.
 * Every wait is bounded; every process is killed and reaped. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cmocka.h>

#include "capi/starling.h"
#include "expert/block.h"
#include "expert/model.h"

#define ERRLEN 512

static char dir[] = "/tmp/starling-capi-XXXXXX";
static pid_t pids[3];
static int n_pids;
static char bootstrap[200], id_a[41], id_b[41];

static int threads_now(void)
{
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    if (!d)
        return -1;
    for (struct dirent *e; (e = readdir(d));)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* ---- processes ---- */

static pid_t spawn(const char *name, char *const argv[])
{
    char out[300], err[300];
    snprintf(out, sizeof out, "%s/%s.out", dir, name);
    snprintf(err, sizeof err, "%s/%s.err", dir, name);
    pid_t p = fork();
    if (p == 0) {
        /* dies with the test, even when the test crashes before kill_all */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        int o = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0600), e = open(err, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(o, 1);
        dup2(e, 2);
        execv(argv[0], argv);
        _exit(127);
    }
    pids[n_pids++] = p;
    return p;
}

/* Waits (at most secs) for a line of file name containing needle; copies
 * that line into line (may be NULL). */
static int wait_line(const char *name, const char *needle, double secs, char *line, size_t cap)
{
    char path[300], buf[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    for (int i = 0; i < (int)(secs * 10); i++) {
        FILE *f = fopen(path, "r");
        while (f && fgets(buf, sizeof buf, f)) {
            if (strstr(buf, needle)) {
                buf[strcspn(buf, "\n")] = '\0';
                if (line && cap > 0) {
                    size_t n = strlen(buf) < cap - 1 ? strlen(buf) : cap - 1;
                    memcpy(line, buf, n);
                    line[n] = '\0';
                }
                fclose(f);
                return 0;
            }
        }
        if (f)
            fclose(f);
        usleep(100000);
    }
    return -1;
}

static void kill_all(void)
{
    for (int i = 0; i < n_pids; i++)
        if (pids[i] > 0) {
            kill(pids[i], SIGKILL);
            waitpid(pids[i], NULL, 0);
            pids[i] = 0;
        }
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", dir);
}

/* Node ID of a peer from its stdout line "HOST:PORT/NODEID". */
static int peer_id(const char *name, char id[41])
{
    char line[300];
    if (wait_line(name, "/", 30, line, sizeof line) != 0)
        return -1;
    const char *slash = strrchr(line, '/');
    if (!slash || strlen(slash + 1) < 40)
        return -1;
    memcpy(id, slash + 1, 40);
    id[40] = '\0';
    return 0;
}

static int start_swarm(void **state)
{
    (void)state;
    const char *s = getenv("STARLING");
    if (!s || !mkdtemp(dir))
        return -1;
    atexit(kill_all);
    char *bs[] = {(char *)s, "bootstrap", "--listen", "127.0.0.1:0", NULL};
    spawn("bs", bs);
    if (wait_line("bs.out", "/", 30, bootstrap, sizeof bootstrap) != 0)
        return -1;
    char *a[] = {(char *)s, "peer", "--initial-peers", bootstrap, "--blocks", "0-5", "--threads", "1", NULL};
    char *b[] = {(char *)s, "peer", "--initial-peers", bootstrap, "--blocks", "1-4", "--threads", "1", NULL};
    spawn("a", a);
    spawn("b", b);
    if (peer_id("a.out", id_a) || peer_id("b.out", id_b) || wait_line("a.err", "online: announcing", 60, NULL, 0) ||
        wait_line("b.err", "online: announcing", 60, NULL, 0))
        return -1;
    return 0;
}

static int stop_swarm(void **state)
{
    (void)state;
    kill_all();
    return 0;
}

/* ---- local: no swarm ---- */

static void test_version(void **state)
{
    (void)state;
    assert_int_equal(starling_api_version(), STARLING_API_VERSION);
    assert_non_null(starling_version());
    starling_free(NULL);
}

static void test_model_info_local(void **state)
{
    (void)state;
    char err[ERRLEN], *json = NULL;
    assert_int_equal(starling_model_info(NULL, "fmnist-mlp", &json, err, sizeof err), 0);
    assert_non_null(strstr(json, "\"name\":\"fmnist-mlp\""));
    assert_non_null(strstr(json, "\"kind\":\"resffn\""));
    assert_non_null(strstr(json, "\"in_shape\":[512]"));
    starling_free(json);
    assert_int_equal(starling_model_info(NULL, "tiny-lm", &json, err, sizeof err), 0);
    assert_non_null(strstr(json, "\"in_shape\":[128,256]"));
    assert_non_null(strstr(json, "\"task\":\"bytes\""));
    starling_free(json);
    json = NULL;
    assert_int_equal(starling_model_info(NULL, "no-such-model", &json, err, sizeof err), -ENOENT);
    assert_non_null(strstr(err, "no-such-model"));
    assert_null(json);
    assert_int_equal(starling_model_info(NULL, NULL, &json, err, sizeof err), -EINVAL);
    assert_int_equal(starling_model_info(NULL, "fmnist-mlp", NULL, err, sizeof err), -EINVAL);
}

static void test_init_params(void **state)
{
    (void)state;
    char err[ERRLEN];
    const struct expert_model_spec *m = expert_model_find("fmnist-mlp");
    struct expert_block_config cfg;
    expert_model_stage(m, 2, &cfg);
    expert_block *b = expert_block_create(&cfg, expert_stage_seed(0, 2));
    size_t n = expert_block_nparams(b);
    float *p = malloc(n * sizeof *p);
    assert_int_equal(starling_stage_init_params(NULL, "fmnist-mlp", 2, p, n, err, sizeof err), 0);
    struct expert_snapshot snap;
    expert_block_snapshot_acquire(b, &snap);
    assert_memory_equal(p, snap.params, n * sizeof *p);
    expert_block_snapshot_release(b, &snap);
    assert_int_equal(starling_stage_init_params(NULL, "fmnist-mlp", 2, p, n - 1, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "parameters"));
    assert_int_equal(starling_stage_init_params(NULL, "fmnist-mlp", 6, p, n, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "out of range"));
    assert_int_equal(starling_stage_init_params(NULL, "fmnist-mlp", -1, p, n, err, sizeof err), -EINVAL);
    assert_int_equal(starling_stage_init_params(NULL, "fmnist-mlp", 2, NULL, n, err, sizeof err), -EINVAL);
    free(p);
    expert_block_destroy(&b);
}

static void test_open_errors(void **state)
{
    (void)state;
    char err[ERRLEN];
    starling_swarm *s = (starling_swarm *)1;
    int base = threads_now();
    assert_int_equal(starling_swarm_open(NULL, "127.0.0.1:1", NULL, err, sizeof err), -EINVAL);
    assert_int_equal(starling_swarm_open(&s, NULL, NULL, err, sizeof err), -EINVAL);
    assert_null(s);
    assert_int_equal(starling_swarm_open(&s, "", NULL, err, sizeof err), -EINVAL);
    assert_int_equal(starling_swarm_open(&s, "not an address", NULL, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "HOST:PORT"));
    starling_swarm_options o = {.join_timeout_s = -1};
    assert_int_equal(starling_swarm_open(&s, "127.0.0.1:1", &o, err, sizeof err), -EINVAL);
    o = (starling_swarm_options){.identity_file = "/nonexistent/id"};
    assert_int_equal(starling_swarm_open(&s, "127.0.0.1:1", &o, err, sizeof err), -EIO);
    assert_non_null(strstr(err, "identity"));
    o = (starling_swarm_options){.swarm_key_file = "/nonexistent/key"};
    assert_int_equal(starling_swarm_open(&s, "127.0.0.1:1", &o, err, sizeof err), -EIO);
    o = (starling_swarm_options){.join_timeout_s = 1};
    assert_int_equal(starling_swarm_open(&s, "127.0.0.1:1", &o, err, sizeof err), -EHOSTUNREACH);
    assert_non_null(strstr(err, "cannot reach"));
    assert_null(s);
    assert_int_equal(threads_now(), base);
    starling_swarm_close(NULL);
    starling_stages_close(NULL);
}

/* ---- the swarm ---- */

static starling_swarm *open_swarm(void)
{
    char err[ERRLEN];
    starling_swarm *s = NULL;
    starling_swarm_options o = {.call_timeout_s = 5, .max_wait_s = 20, .seed = 7};
    int rc = starling_swarm_open(&s, bootstrap, &o, err, sizeof err);
    if (rc != 0)
        fail_msg("open: %s", err);
    return s;
}

/* Waits (bounded) until stage 1 has n usable holders. */
static void wait_holders(starling_swarm *s, int n)
{
    char err[ERRLEN], *json = NULL;
    for (int i = 0; i < 100; i++) {
        int rc = starling_swarm_holders(s, "fmnist-mlp", 1, &json, err, sizeof err);
        int usable = 0;
        for (const char *p = json; p && (p = strstr(p, "\"usable\":true")); p++)
            usable++;
        starling_free(json);
        json = NULL;
        if (rc >= n && usable >= n)
            return;
        usleep(200000);
    }
    fail_msg("stage 1 never had %d usable holders", n);
}

static void test_queries(void **state)
{
    (void)state;
    char err[ERRLEN], *json = NULL, hex[41];
    starling_swarm *s = open_swarm();
    starling_swarm_node_id(s, hex);
    assert_int_equal(strlen(hex), 40);
    wait_holders(s, 2);
    int n = starling_swarm_models(s, &json, err, sizeof err);
    assert_int_equal(n, 1);
    assert_non_null(strstr(json, "\"model\":\"fmnist-mlp\""));
    assert_non_null(strstr(json, "\"announcers\":2"));
    starling_free(json);
    n = starling_swarm_holders(s, "fmnist-mlp", 5, &json, err, sizeof err);
    assert_int_equal(n, 1);
    assert_non_null(strstr(json, id_a));
    assert_null(strstr(json, id_b));
    starling_free(json);
    assert_int_equal(starling_swarm_holders(s, "fmnist-mlp", 6, &json, err, sizeof err), -EINVAL);
    assert_int_equal(starling_swarm_holders(s, "nope-model", 0, &json, err, sizeof err), -ENOENT);
    assert_non_null(strstr(err, "unknown model 'nope-model'"));
    assert_int_equal(starling_swarm_holders(s, "bad name!", 0, &json, err, sizeof err), -ENOENT);

    /* raw records: a put we can read back, and garbage keys */
    assert_true(starling_swarm_put(s, "test/capi", "hello", 5, 60, err, sizeof err) >= 1);
    n = starling_swarm_get(s, "test/capi", &json, err, sizeof err);
    assert_true(n >= 1);
    assert_non_null(strstr(json, "\"value\":\"68656c6c6f\""));
    assert_non_null(strstr(json, hex)); /* subkey: our node ID */
    starling_free(json);
    n = starling_swarm_get(s, "fmnist-mlp.1", &json, err, sizeof err);
    assert_int_equal(n, 2);
    starling_free(json);
    assert_int_equal(starling_swarm_get(s, "0xnothex", &json, err, sizeof err), -EINVAL);
    assert_int_equal(starling_swarm_get(s, "", &json, err, sizeof err), -EINVAL);
    assert_int_equal(starling_swarm_put(s, "k", "x", 1, 0, err, sizeof err), -EINVAL);
    assert_int_equal(starling_swarm_put(s, "k", NULL, 1, 60, err, sizeof err), -EINVAL);
    static char big[2000];
    assert_int_equal(starling_swarm_put(s, "k", big, sizeof big, 60, err, sizeof err), -EINVAL);
    starling_swarm_close(s);
}

/* The block's own math on the initial weights. */
typedef struct local_stage {
    expert_block *b;
    expert_workspace *ws;
} local_stage;

static void local_open(local_stage *l, int stage)
{
    const struct expert_model_spec *m = expert_model_find("fmnist-mlp");
    struct expert_block_config cfg;
    expert_model_stage(m, stage, &cfg);
    l->b = expert_block_create(&cfg, expert_stage_seed(0, stage));
    l->ws = expert_workspace_create(&cfg, 64);
    assert_non_null(l->b);
    assert_non_null(l->ws);
}

static void local_close(local_stage *l)
{
    expert_workspace_destroy(&l->ws);
    expert_block_destroy(&l->b);
}

static void fill(float *x, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        x[i] = (float)((seed >> 8) & 0xffff) / 32768.0f - 1.0f;
    }
}

static float max_diff(const float *a, const float *b, size_t n)
{
    float m = 0;
    for (size_t i = 0; i < n; i++)
        m = fmaxf(m, fabsf(a[i] - b[i]));
    return m;
}

typedef struct thread_arg {
    starling_stages *st;
    const float *x;
    float y[16 * 512];
    int rc;
    char err[ERRLEN];
} thread_arg;

static void *forward_thread(void *p)
{
    thread_arg *t = p;
    for (int i = 0; i < 5 && t->rc == 0; i++)
        t->rc = starling_stage_forward(t->st, 1, t->x, 16, t->y, 0, NULL, t->err, sizeof t->err);
    return NULL;
}

static void test_stages(void **state)
{
    (void)state;
    char err[ERRLEN];
    enum { B = 16, W = 512 };
    static float x[B * W], y[B * W], ref[B * W], dy[B * W], dx[B * W], dref[B * W];
    /* the block's own answers first: its helper threads (expert-pool) are
     * this process's, not the library's */
    local_stage l;
    local_open(&l, 1);
    fill(x, B * W, 1);
    fill(dy, B * W, 2);
    assert_int_equal(expert_block_forward(l.b, l.ws, ref, x, B, NULL), 0);
    assert_int_equal(expert_block_backward(l.b, l.ws, dref, dy, x, B, NULL), 0);
    local_close(&l);
    int base = threads_now();
    starling_swarm *s = open_swarm();
    wait_holders(s, 2);
    starling_stages *st = NULL;
    assert_int_equal(starling_stages_open(&st, s, "fmnist-mlp", 1, 6, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "out of range"));
    assert_int_equal(starling_stages_open(&st, s, "fmnist-mlp", 2, 1, err, sizeof err), -EINVAL);
    assert_int_equal(starling_stages_open(&st, s, "nope-model", 0, 0, err, sizeof err), -ENOENT);
    assert_int_equal(starling_stages_open(&st, s, "fmnist-mlp", 1, 4, err, sizeof err), 0);
    int64_t wi = 0, wo = 0;
    assert_int_equal(starling_stages_widths(st, 1, &wi, &wo), 0);
    assert_int_equal(wi, W);
    assert_int_equal(wo, W);
    assert_int_equal(starling_stages_widths(st, 5, &wi, &wo), -EINVAL);
    assert_int_equal(starling_stages_max_rows(st), 256);

    /* forward (inference and training) equals the block on its initial
     * weights: no holder has stepped yet */
    starling_served sv;
    assert_int_equal(starling_stage_forward(st, 1, x, B, y, 0, &sv, err, sizeof err), 0);
    assert_true(max_diff(y, ref, B * W) < 1e-5f);
    assert_int_equal(starling_stage_forward(st, 1, x, B, y, 1, &sv, err, sizeof err), 0);
    assert_true(max_diff(y, ref, B * W) < 1e-5f);
    assert_true(sv.version_known);
    assert_int_equal(sv.attempts, 1);
    assert_int_equal(starling_stage_backward(st, 1, x, dy, B, dx, &sv, err, sizeof err), 0);
    assert_true(max_diff(dx, dref, B * W) < 1e-4f);
    assert_int_equal(starling_stage_backward(st, 1, x, dy, B, NULL, NULL, err, sizeof err), 0);

    /* bad calls */
    assert_int_equal(starling_stage_forward(st, 0, x, B, y, 1, NULL, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "not among"));
    assert_int_equal(starling_stage_forward(st, 1, x, 0, y, 1, NULL, err, sizeof err), -EINVAL);
    assert_int_equal(starling_stage_forward(st, 1, x, 257, y, 1, NULL, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "split the batch"));
    assert_int_equal(starling_stage_forward(st, 1, NULL, B, y, 1, NULL, err, sizeof err), -EINVAL);
    assert_int_equal(starling_stage_forward(st, 1, x, B, NULL, 1, NULL, err, sizeof err), -EINVAL);
    assert_int_equal(starling_stage_backward(st, 1, x, NULL, B, dx, NULL, err, sizeof err), -EINVAL);
    assert_int_equal(starling_stage_forward(NULL, 1, x, B, y, 1, NULL, err, sizeof err), -EINVAL);

    /* four threads at once get the serial answer */
    assert_int_equal(starling_stage_forward(st, 1, x, B, ref, 0, NULL, err, sizeof err), 0);
    pthread_t th[4];
    thread_arg *ta = calloc(4, sizeof *ta);
    for (int i = 0; i < 4; i++) {
        ta[i].st = st;
        ta[i].x = x;
        assert_int_equal(pthread_create(&th[i], NULL, forward_thread, &ta[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        if (ta[i].rc != 0)
            fail_msg("thread %d: %s", i, ta[i].err);
        assert_true(max_diff(ta[i].y, ref, B * W) < 1e-5f);
    }
    free(ta);

    /* the holder that served a forward hangs (stopped: its connection
     * stays up, nothing answers): the backward, which goes to it first,
     * times out (call_timeout_s) and is sent again to the other holder;
     * then it dies, and calls go on */
    assert_int_equal(starling_stage_forward(st, 1, x, B, y, 1, &sv, err, sizeof err), 0);
    char served_hex[41];
    for (int i = 0; i < 20; i++)
        snprintf(served_hex + 2 * i, 3, "%02x", sv.holder[i]);
    int victim = !strcmp(served_hex, id_a) ? 1 : !strcmp(served_hex, id_b) ? 2 : -1;
    assert_true(victim > 0);
    kill(pids[victim], SIGSTOP);
    uint64_t calls0, retries0, calls1, retries1;
    starling_stages_counters(st, &calls0, &retries0);
    assert_int_equal(starling_stage_backward(st, 1, x, dy, B, dx, &sv, err, sizeof err), 0);
    starling_stages_counters(st, &calls1, &retries1);
    assert_int_equal(calls1, calls0 + 1);
    assert_true(retries1 > retries0);
    kill(pids[victim], SIGKILL);
    waitpid(pids[victim], NULL, 0);
    pids[victim] = 0;
    for (int i = 0; i < 5; i++)
        assert_int_equal(starling_stage_forward(st, 1, x, B, y, 1, NULL, err, sizeof err), 0);

    starling_stages_close(st);
    /* a handle left open is closed by the swarm's close */
    assert_int_equal(starling_stages_open(&st, s, "fmnist-mlp", 1, 1, err, sizeof err), 0);
    starling_swarm_close(s);
    if (threads_now() != base) {
        if (system("grep . /proc/$PPID/task/*/comm >&2") != 0)
            fprintf(stderr, "cannot list the threads\n");
        fail_msg("%d threads after closing, %d before opening", threads_now(), base);
    }
}

int main(void)
{
    const struct CMUnitTest local[] = {
        cmocka_unit_test(test_version),
        cmocka_unit_test(test_model_info_local),
        cmocka_unit_test(test_init_params),
        cmocka_unit_test(test_open_errors),
    };
    const struct CMUnitTest swarm[] = {
        cmocka_unit_test(test_queries),
        cmocka_unit_test(test_stages),
    };
    int rc = cmocka_run_group_tests(local, NULL, NULL);
    return rc | cmocka_run_group_tests(swarm, start_swarm, stop_swarm);
}
