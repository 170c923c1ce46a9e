#include "peer/batcher.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "peer/timeslice.h"

#define EWMA_ALPHA 0.1

typedef struct queue {
    peer_task *head, *tail;
} queue;

typedef struct worker {
    struct peer_batcher *b;
    pthread_t thread;
    int started;
    int infer_only;   /* the inference lane: never takes training work */
    expert_workspace *ws;     /* on the block's backend */
    /* Host memory the backend copies from fastest (pinned for CUDA): */
    float *in_buf;    /* (max_batch, in): joined inputs */
    float *go_buf;    /* (max_batch, out): joined grad_outputs */
    float *out_buf;   /* (max_batch, max(in, out)): joined results */
} worker;

/* A kept training forward (see batcher.h). */
enum { KEPT_FREE = 0, KEPT_BUSY, KEPT_READY };
typedef struct kept {
    int state;
    int rows;
    uint64_t version, seq;
    size_t cap;        /* rows the buffers hold */
    float *in;         /* rows * in input floats (host memory: compared with the backward's) */
    float *act;        /* rows * kept_floats activations (the block's backend memory: they
                          stay on the device) */
} kept;

struct peer_batcher {
    int nworkers;             /* cfg.threads + cfg.infer_threads */
    expert_block *blk;
    const expert_backend *be; /* the block's */
    peer_batcher_config cfg;
    int in, out;
    pthread_mutex_t mu;
    pthread_cond_t cv;        /* training threads (and lanes' work, without lanes) */
    pthread_cond_t cv_infer;  /* inference lanes */
    queue infer;      /* inference first */
    queue train;      /* training forwards and backwards, FIFO */
    int queued_rows, queued_tasks;
    int stopping;
    peer_batcher_stats st;
    worker *workers;
    kept *kept;               /* cfg.keep slots, guarded by mu; BUSY ones are a worker's */
    size_t kept_floats;       /* activation floats per row (0: nothing worth keeping) */
    uint64_t kept_seq;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void q_push(queue *q, peer_task *t)
{
    t->next_ = NULL;
    if (q->tail)
        q->tail->next_ = t;
    else
        q->head = t;
    q->tail = t;
}

static int is_forward(peer_task_kind k)
{
    return k == PEER_TASK_INFER || k == PEER_TASK_FORWARD;
}

/* Moves from q into *list (appending at *tail) every task whose operation
 * matches `fwd`, in order, while the joined rows stay <= max. */
/* Backwards join only when they ask for the same weights. */
static int same_weights(const peer_task *a, const peer_task *b)
{
    if (!a || is_forward(a->kind))
        return 1;
    return a->has_at_version == b->has_at_version &&
           (!a->has_at_version || a->at_version == b->at_version);
}

static void q_take_matching(queue *q, int fwd, int max, int *rows, peer_task **head,
                            peer_task **tail)
{
    peer_task *prev = NULL, *t = q->head;
    while (t && *rows < max) {
        peer_task *next = t->next_;
        if (is_forward(t->kind) == fwd && *rows + t->rows <= max && same_weights(*head, t)) {
            if (prev)
                prev->next_ = next;
            else
                q->head = next;
            if (q->tail == t)
                q->tail = prev;
            t->next_ = NULL;
            if (*tail)
                (*tail)->next_ = t;
            else
                *head = t;
            *tail = t;
            *rows += t->rows;
        } else {
            prev = t;
        }
        t = next;
    }
}

/* Takes the next joined batch, or returns NULL when stopping and empty.
 * Called with mu held. */
static peer_task *take_batch(peer_batcher *b, int infer_only, int *fwd_out, int *rows_out)
{
    for (;;) {
        /* With an inference lane, the lane alone serves inference: a
         * training thread runs at idle priority and would keep a request
         * it took waiting behind every other runnable thread. */
        int lanes = b->cfg.infer_threads > 0;
        queue *q = b->infer.head && (infer_only || !lanes) ? &b->infer
                   : !infer_only && b->train.head          ? &b->train
                                                           : NULL;
        if (q) {
            int fwd = is_forward(q->head->kind);
            int rows = 0;
            peer_task *head = NULL, *tail = NULL;
            q_take_matching(q, fwd, b->cfg.max_batch, &rows, &head, &tail);
            /* Inference batches are topped up with queued training forwards:
             * same operation, and it costs the inference nothing. */
            if (fwd && q == &b->infer && !infer_only)
                q_take_matching(&b->train, 1, b->cfg.max_batch, &rows, &head, &tail);
            int n = 0;
            for (peer_task *t = head; t; t = t->next_)
                n++;
            b->queued_rows -= rows;
            b->queued_tasks -= n;
            *fwd_out = fwd;
            *rows_out = rows;
            return head;
        }
        if (b->stopping)
            return NULL;
        pthread_cond_wait(infer_only ? &b->cv_infer : &b->cv, &b->mu);
    }
}

/* Keeps task t's forward (its rows start at row `off` of the worker's
 * workspace) for its backward. Best effort: no free slot or no memory
 * just means that backward recomputes. */
static void keep_forward(worker *w, const peer_task *t, int off, uint64_t version)
{
    peer_batcher *b = w->b;
    size_t in_n = (size_t)t->rows * (size_t)b->in;
    kept *k = NULL;
    pthread_mutex_lock(&b->mu);
    for (int i = 0; i < b->cfg.keep; i++) { /* a free slot, else the oldest ready one */
        kept *c = &b->kept[i];
        if (c->state == KEPT_BUSY)
            continue;
        if (!k || (k->state == KEPT_READY && (c->state == KEPT_FREE || c->seq < k->seq)))
            k = c;
    }
    if (k)
        k->state = KEPT_BUSY;
    pthread_mutex_unlock(&b->mu);
    if (!k)
        return;
    if (k->cap < (size_t)t->rows) {
        /* Sized for a whole batch once, so a slot is allocated at most twice. */
        size_t rows = (size_t)b->cfg.max_batch;
        float *ni = realloc(k->in, rows * (size_t)b->in * sizeof(float));
        if (ni)
            k->in = ni;
        expert_backend_free(b->be, k->act);
        k->act = expert_backend_alloc(b->be, rows * b->kept_floats * sizeof(float));
        k->cap = ni && k->act ? rows : 0;
        if (!k->cap) {
            pthread_mutex_lock(&b->mu);
            k->state = KEPT_FREE;
            pthread_mutex_unlock(&b->mu);
            return;
        }
    }
    memcpy(k->in, t->inputs, in_n * sizeof(float));
    int rc = expert_workspace_save_rows(w->ws, off, t->rows, k->act);
    pthread_mutex_lock(&b->mu);
    k->rows = t->rows;
    k->version = version;
    k->seq = ++b->kept_seq;
    k->state = rc == 0 ? KEPT_READY : KEPT_FREE;
    pthread_mutex_unlock(&b->mu);
}

/* Claims the kept forward of backward task t: same rows, version and
 * input. Returns the slot (BUSY, the caller's until kept_release) or NULL. */
static kept *kept_claim(peer_batcher *b, const peer_task *t)
{
    size_t in_n = (size_t)t->rows * (size_t)b->in;
    size_t probe = in_n < 64 ? in_n : 64; /* a cheap first look under the lock */
    for (int i = 0; i < b->cfg.keep; i++) {
        kept *k = &b->kept[i];
        pthread_mutex_lock(&b->mu);
        int cand = k->state == KEPT_READY && k->rows == t->rows && k->version == t->at_version &&
                   memcmp(k->in, t->inputs, probe * sizeof(float)) == 0;
        if (cand)
            k->state = KEPT_BUSY;
        pthread_mutex_unlock(&b->mu);
        if (!cand)
            continue;
        if (memcmp(k->in, t->inputs, in_n * sizeof(float)) == 0)
            return k;
        pthread_mutex_lock(&b->mu);
        k->state = KEPT_READY;
        pthread_mutex_unlock(&b->mu);
    }
    return NULL;
}

static void kept_release(peer_batcher *b, kept *k)
{
    pthread_mutex_lock(&b->mu);
    k->state = KEPT_FREE;
    pthread_mutex_unlock(&b->mu);
}

/* For a backward batch: loads every task's kept forward into the worker's
 * workspace in batch order. Returns 1 when all were there (the slots are
 * freed either way: each forward has one backward). */
static int load_kept(worker *w, peer_task *head)
{
    peer_batcher *b = w->b;
    if (b->cfg.keep < 1 || b->kept_floats == 0 || !head->has_at_version)
        return 0;
    int all = 1, off = 0;
    for (peer_task *t = head; t; t = t->next_) {
        kept *k = kept_claim(b, t);
        if (!k) {
            all = 0;
            continue;
        }
        if (all && expert_workspace_load_rows(w->ws, off, t->rows, k->act) != 0)
            all = 0;
        kept_release(b, k);
        off += t->rows;
    }
    return all;
}

/* Runs one joined batch. Returns 0 or -errno for the whole batch. */
static int compute(worker *w, peer_task *head, int fwd, int rows, uint64_t *version,
                   struct expert_step_info *step, int *stepped)
{
    peer_batcher *b = w->b;
    const size_t in = (size_t)b->in, out = (size_t)b->out;
    /* One request is computed on its own buffers; several are joined in
     * the worker's. On a device every batch goes through the worker's
     * buffers, which are pinned: the copies to and from the device are
     * then DMA at full speed instead of being staged by the driver. */
    int single = head->next_ == NULL && b->be->host_memory;
    int rc;

    *stepped = 0;
    if (fwd) {
        const float *x = head->inputs;
        float *y = single ? head->outputs : w->out_buf;
        if (!single) {
            size_t off = 0;
            for (peer_task *t = head; t; t = t->next_) {
                memcpy(w->in_buf + off * in, t->inputs, (size_t)t->rows * in * sizeof(float));
                off += (size_t)t->rows;
            }
            x = w->in_buf;
        }
        int keep = 0;
        if (b->cfg.keep > 0 && b->kept_floats > 0)
            for (peer_task *t = head; t; t = t->next_)
                keep |= t->kind == PEER_TASK_FORWARD;
        rc = keep ? expert_block_forward_train(b->blk, w->ws, y, x, rows, version)
                  : expert_block_forward(b->blk, w->ws, y, x, rows, version);
        if (rc == 0 && keep) {
            int off = 0;
            for (peer_task *t = head; t; t = t->next_) {
                if (t->kind == PEER_TASK_FORWARD)
                    keep_forward(w, t, off, *version);
                off += t->rows;
            }
        }
        if (rc == 0 && !single) {
            size_t off = 0;
            for (peer_task *t = head; t; t = t->next_) {
                memcpy(t->outputs, w->out_buf + off * out, (size_t)t->rows * out * sizeof(float));
                off += (size_t)t->rows;
            }
        }
        return rc;
    }

    const float *x = head->inputs, *gy = head->grad_outputs;
    float *gx = single ? head->outputs : w->out_buf;
    int want_gx = 0;
    for (peer_task *t = head; t; t = t->next_)
        want_gx |= t->outputs != NULL;
    if (!single) {
        size_t off = 0;
        for (peer_task *t = head; t; t = t->next_) {
            memcpy(w->in_buf + off * in, t->inputs, (size_t)t->rows * in * sizeof(float));
            memcpy(w->go_buf + off * out, t->grad_outputs, (size_t)t->rows * out * sizeof(float));
            off += (size_t)t->rows;
        }
        x = w->in_buf;
        gy = w->go_buf;
    }
    int from_kept = load_kept(w, head);
    rc = from_kept ? expert_block_backward_kept(b->blk, w->ws, want_gx ? gx : NULL, gy, x, rows,
                                                head->at_version, version)
                   : -ESTALE;
    if (rc == -ESTALE) {
        from_kept = 0;
        rc = expert_block_backward_at(b->blk, w->ws, NULL, want_gx ? gx : NULL, gy, x, rows,
                                      head->has_at_version ? head->at_version : EXPERT_VERSION_CURRENT,
                                      version);
    }
    if (b->cfg.keep > 0 && b->kept_floats > 0) {
        pthread_mutex_lock(&b->mu);
        *(from_kept ? &b->st.kept_hits : &b->st.kept_misses) += (uint64_t)rows;
        pthread_mutex_unlock(&b->mu);
    }
    if (rc == 0 && !single && want_gx) {
        size_t off = 0;
        for (peer_task *t = head; t; t = t->next_) {
            if (t->outputs)
                memcpy(t->outputs, w->out_buf + off * in, (size_t)t->rows * in * sizeof(float));
            off += (size_t)t->rows;
        }
    }
    if (rc == 0) {
        int s = expert_block_maybe_step(b->blk, &b->cfg.optim, step);
        if (s > 0)
            *stepped = 1;
        else if (s < 0)
            rc = s;
    }
    return rc;
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    peer_batcher *b = w->b;
    char tname[32]; /* the kernel keeps 15 characters */
    snprintf(tname, sizeof tname, "%s-%d", w->infer_only ? "infer" : "train", b->cfg.stage);
    tname[15] = '\0';
    (void)pthread_setname_np(pthread_self(), tname); /* best effort: diagnostics only */
    /* The default time slice, whatever the creating thread (the network
     * thread, peer/timeslice.h) asked for itself. */
    (void)peer_sched_set_slice(0);
    /* Training threads yield the CPU to the inference lane: on a loaded
     * machine the lane's requests would otherwise wait for a time slice.
     * A nice value of 10 by default; with train_idle, SCHED_IDLE (Linux):
     * any waking normal thread (the loop, the lane) preempts them at once,
     * but so does every other process's, so training only gets the CPU
     * the machine leaves over. Best effort either way. */
    if (!w->infer_only && b->cfg.infer_threads > 0) {
        struct sched_param sp = {0};
        if (!b->cfg.train_idle || pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp) != 0)
            (void)setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 10);
    }
    pthread_mutex_lock(&b->mu);
    for (;;) {
        int fwd = 0, rows = 0;
        peer_task *head = take_batch(b, w->infer_only, &fwd, &rows);
        if (!head)
            break;
        pthread_mutex_unlock(&b->mu);

        uint64_t version = 0;
        struct expert_step_info step;
        int stepped = 0;
        double t0 = now_s();
        int rc = compute(w, head, fwd, rows, &version, &step, &stepped);
        double per_row = (now_s() - t0) / rows;

        pthread_mutex_lock(&b->mu);
        b->st.batches++;
        if (rc == 0) {
            double *ew = fwd ? &b->st.fwd_row_s : &b->st.bwd_row_s;
            *ew = *ew == 0 ? per_row : (1 - EWMA_ALPHA) * *ew + EWMA_ALPHA * per_row;
        }
        b->st.steps += (uint64_t)stepped;
        for (peer_task *t = head; t; t = t->next_) {
            b->st.tasks[t->kind]++;
            b->st.rows[t->kind] += (uint64_t)t->rows;
            if (rc != 0)
                b->st.errors++;
        }
        pthread_mutex_unlock(&b->mu);

        /* Complete without the lock: a callback may submit again. */
        for (peer_task *t = head, *next; t; t = next) {
            next = t->next_;
            t->next_ = NULL;
            t->version = version;
            t->done(t, rc);
        }
        pthread_mutex_lock(&b->mu);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static void free_workers(peer_batcher *b)
{
    for (int i = 0; i < b->cfg.keep && b->kept; i++) {
        free(b->kept[i].in);
        expert_backend_free(b->be, b->kept[i].act);
    }
    free(b->kept);
    b->kept = NULL;
    for (int i = 0; i < b->nworkers; i++) {
        worker *w = &b->workers[i];
        expert_workspace_destroy(&w->ws);
        expert_backend_host_free(b->be, w->in_buf);
        expert_backend_host_free(b->be, w->go_buf);
        expert_backend_host_free(b->be, w->out_buf);
    }
    free(b->workers);
}

peer_batcher *peer_batcher_create(expert_block *blk, const peer_batcher_config *cfg)
{
    if (!blk || !cfg || cfg->threads < 1 || cfg->threads > 256 || cfg->infer_threads < 0 ||
        cfg->infer_threads > 16 || cfg->keep < 0 || cfg->keep > PEER_BATCHER_MAX_KEEP ||
        cfg->max_batch < 1 ||
        cfg->max_queue_rows < cfg->max_batch || expert_optim_check(&cfg->optim) != 0)
        return NULL;
    peer_batcher *b = calloc(1, sizeof *b);
    if (!b)
        return NULL;
    b->blk = blk;
    b->be = expert_block_backend(blk);
    b->cfg = *cfg;
    const struct expert_block_config *bc = expert_block_config(blk);
    b->in = bc->in;
    b->out = bc->out;
    size_t wide = (size_t)(b->in > b->out ? b->in : b->out);
    b->nworkers = cfg->threads + cfg->infer_threads;
    b->workers = calloc((size_t)b->nworkers, sizeof *b->workers);
    if (!b->workers) {
        free(b);
        return NULL;
    }
    if (cfg->keep > 0) {
        b->kept = calloc((size_t)cfg->keep, sizeof *b->kept);
        if (!b->kept) {
            free(b->workers);
            free(b);
            return NULL;
        }
    }
    for (int i = 0; i < b->nworkers; i++) {
        worker *w = &b->workers[i];
        w->b = b;
        w->infer_only = i >= cfg->threads;
        w->ws = expert_workspace_create_on(bc, cfg->max_batch, b->be);
        size_t B = (size_t)cfg->max_batch;
        w->in_buf = expert_backend_host_alloc(b->be, B * (size_t)b->in * sizeof(float));
        w->go_buf = expert_backend_host_alloc(b->be, B * (size_t)b->out * sizeof(float));
        w->out_buf = expert_backend_host_alloc(b->be, B * wide * sizeof(float));
        if (!w->ws || !w->in_buf || !w->go_buf || !w->out_buf) {
            free_workers(b);
            free(b);
            return NULL;
        }
        b->kept_floats = expert_workspace_kept_floats(w->ws);
    }
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    pthread_cond_init(&b->cv_infer, NULL);
    for (int i = 0; i < b->nworkers; i++) {
        if (pthread_create(&b->workers[i].thread, NULL, worker_main, &b->workers[i]) != 0) {
            peer_batcher_destroy(&b);
            return NULL;
        }
        b->workers[i].started = 1;
    }
    return b;
}

void peer_batcher_destroy(peer_batcher **pp)
{
    if (!pp || !*pp)
        return;
    peer_batcher *b = *pp;
    pthread_mutex_lock(&b->mu);
    b->stopping = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_cond_broadcast(&b->cv_infer);
    pthread_mutex_unlock(&b->mu);
    for (int i = 0; i < b->nworkers; i++)
        if (b->workers[i].started)
            pthread_join(b->workers[i].thread, NULL);
    pthread_cond_destroy(&b->cv);
    pthread_cond_destroy(&b->cv_infer);
    pthread_mutex_destroy(&b->mu);
    free_workers(b);
    free(b);
    *pp = NULL;
}

int peer_batcher_submit(peer_batcher *b, peer_task *t)
{
    if (!b || !t || !t->done || !t->inputs || t->rows < 1 || t->rows > b->cfg.max_batch)
        return -EINVAL;
    if (t->kind == PEER_TASK_BACKWARD) {
        if (!t->grad_outputs)
            return -EINVAL;
    } else if (!is_forward(t->kind) || !t->outputs) {
        return -EINVAL;
    }
    pthread_mutex_lock(&b->mu);
    if (b->stopping) {
        pthread_mutex_unlock(&b->mu);
        return -ESHUTDOWN;
    }
    /* Inference may use the whole bound; training leaves room for it, so a
     * queue full of training work still admits inference. */
    int limit = t->kind == PEER_TASK_INFER ? b->cfg.max_queue_rows + b->cfg.max_batch
                                           : b->cfg.max_queue_rows;
    if (b->queued_rows + t->rows > limit) {
        b->st.rejected++;
        pthread_mutex_unlock(&b->mu);
        return -EAGAIN;
    }
    q_push(t->kind == PEER_TASK_INFER ? &b->infer : &b->train, t);
    b->queued_rows += t->rows;
    b->queued_tasks++;
    int lane = t->kind == PEER_TASK_INFER && b->cfg.infer_threads > 0;
    pthread_mutex_unlock(&b->mu);
    /* Inference wakes the lanes (and, without lanes, the workers, which
     * then serve it first); training work wakes the training threads.
     * The wake-up comes after the unlock: signalled under the lock, a
     * lane woken on this CPU preempted us, found the lock held and slept
     * again, and we (a lane handing a span's next stage over) then waited
     * runnable, still holding the lock, until the next scheduler tick
     * while an idle-priority training thread ran (perf sched showed one
     * such hand-over take 4.9 ms). The batcher cannot go away meanwhile:
     * it is destroyed only once every request has been answered. */
    if (lane)
        pthread_cond_signal(&b->cv_infer);
    else
        pthread_cond_broadcast(&b->cv);
    return 0;
}

int peer_batcher_infer_now(peer_batcher *b, expert_workspace *ws, peer_task *t)
{
    if (!b || !ws || !t || t->kind != PEER_TASK_INFER || !t->inputs || !t->outputs || t->rows < 1 ||
        t->rows > b->cfg.max_batch)
        return -EINVAL;
    pthread_mutex_lock(&b->mu);
    int stopping = b->stopping;
    pthread_mutex_unlock(&b->mu);
    if (stopping)
        return -ESHUTDOWN;
    uint64_t version = 0;
    int rc = expert_block_forward(b->blk, ws, t->outputs, t->inputs, t->rows, &version);
    /* Not folded into the per-row time estimates: a few rows cost far more
     * per row than the joined batches they describe. */
    pthread_mutex_lock(&b->mu);
    b->st.batches++;
    b->st.tasks[t->kind]++;
    b->st.rows[t->kind] += (uint64_t)t->rows;
    if (rc != 0)
        b->st.errors++;
    pthread_mutex_unlock(&b->mu);
    t->version = version;
    return rc;
}

void peer_batcher_get_stats(peer_batcher *b, peer_batcher_stats *out)
{
    pthread_mutex_lock(&b->mu);
    *out = b->st;
    out->queued_rows = b->queued_rows;
    out->queued_tasks = b->queued_tasks;
    pthread_mutex_unlock(&b->mu);
    out->version = expert_block_version(b->blk);
}

void peer_batcher_set_speed(peer_batcher *b, double fwd_row_s, double bwd_row_s)
{
    pthread_mutex_lock(&b->mu);
    if (fwd_row_s > 0)
        b->st.fwd_row_s = fwd_row_s;
    if (bwd_row_s > 0)
        b->st.bwd_row_s = bwd_row_s;
    pthread_mutex_unlock(&b->mu);
}

double peer_batcher_train_throughput(const peer_batcher_stats *s)
{
    double t = s->fwd_row_s + s->bwd_row_s;
    if (s->fwd_row_s <= 0 || s->bwd_row_s <= 0 || !(t > 0))
        return 0.0;
    return 1.0 / t;
}
