/* expert/pool.c: the persistent helper threads behind expert__parallel.
 *
 * Parts are claimed from an atomic counter by the caller and by the helpers
 * alike, so the caller never waits for a helper that has not been scheduled
 * yet (on a shared 2-core machine it often is not): it simply runs the
 * unclaimed parts itself, and waits only for parts a helper already started.
 *
 * A claim names the job: the claim word holds the job's generation above
 * the next part's index, and a part is taken only by a compare-and-swap
 * that still finds the generation the claimer read with fn/ctx. A helper
 * that woke for a job which then ended, while the caller already started
 * the next one, therefore claims nothing (otherwise it would take a part of
 * the new job and run the old job's function on the old caller's dead
 * context, and that part of the new job would never be computed). */
#include "expert/pool.h"
#include "expert/blas.h"

#include <pthread.h>
#include <stdatomic.h>

static struct {
    pthread_mutex_t busy;        /* held by the one caller using the pool */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    int started;                 /* helpers created so far */
    unsigned long gen;           /* bumped per job, under mu */
    expert__task_fn fn;
    void *ctx;
    int n;                       /* parts in the current job */
    _Atomic unsigned long long claim; /* (gen << CLAIM_BITS) | next part to claim */
    atomic_int finished;         /* parts completed */
} pool = {
    .busy = PTHREAD_MUTEX_INITIALIZER,
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .go = PTHREAD_COND_INITIALIZER,
    .done = PTHREAD_COND_INITIALIZER,
};

#define CLAIM_BITS 16 /* n <= 2 * EXPERT__POOL_MAX parts */
#define CLAIM_PART 0xffffull
#define CLAIM_GEN(g) ((unsigned long long)(g) << CLAIM_BITS)

/* Claims parts of job gen and runs them until none is left; returns how
 * many it ran. */
static int run_parts(expert__task_fn fn, void *ctx, int n, unsigned long gen)
{
    int ran = 0;
    for (;;) {
        unsigned long long v = atomic_load(&pool.claim);
        for (;;) {
            if ((v & ~CLAIM_PART) != CLAIM_GEN(gen) || (int)(v & CLAIM_PART) >= n)
                return ran; /* another job by now, or nothing left */
            if (atomic_compare_exchange_weak(&pool.claim, &v, v + 1))
                break;
        }
        int i = (int)(v & CLAIM_PART);
        fn(ctx, i, n);
        ran++;
        if (atomic_fetch_add(&pool.finished, 1) + 1 == n) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
}

static void *helper(void *arg)
{
    (void)arg;
    (void)pthread_setname_np(pthread_self(), "expert-pool"); /* shows in ps/top/perf */
    unsigned long seen = 0;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (pool.gen == seen)
            pthread_cond_wait(&pool.go, &pool.mu);
        seen = pool.gen;
        expert__task_fn fn = pool.fn;
        void *ctx = pool.ctx;
        int n = pool.n;
        pthread_mutex_unlock(&pool.mu);
        /* A helper waking after the job ended claims nothing (all parts
         * taken, or the claim word names a newer job); fn/ctx are only
         * called for parts of job `seen` it claimed in time. */
        run_parts(fn, ctx, n, seen);
        pthread_mutex_lock(&pool.mu);
    }
    return NULL;
}

/* Starts helpers until there are want-1 of them (best effort). */
static int ensure_helpers(int want)
{
    while (pool.started + 1 < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        int rc = pthread_create(&t, &attr, helper, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pool.started++;
    }
    return pool.started + 1 < want ? pool.started + 1 : want;
}

void expert__parallel(expert__task_fn fn, void *ctx, size_t work)
{
    int t = expert_blas_threads();
    if (t > EXPERT__POOL_MAX)
        t = EXPERT__POOL_MAX;
    if (t <= 1 || work < EXPERT__POOL_MIN_WORK || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    t = ensure_helpers(t);
    if (t <= 1) {
        pthread_mutex_unlock(&pool.mu);
        pthread_mutex_unlock(&pool.busy);
        fn(ctx, 0, 1);
        return;
    }
    /* Two parts per thread: whoever runs first takes more. */
    int n = 2 * t;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    atomic_store(&pool.finished, 0);
    unsigned long gen = ++pool.gen;
    atomic_store(&pool.claim, CLAIM_GEN(gen));
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    run_parts(fn, ctx, n, gen);
    pthread_mutex_lock(&pool.mu);
    while (atomic_load(&pool.finished) < n)
        pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.busy);
}

void expert__split(size_t count, int i, int n, size_t align, size_t *lo, size_t *hi)
{
    size_t units = (count + align - 1) / align;
    size_t a = units * (size_t)i / (size_t)n, b = units * (size_t)(i + 1) / (size_t)n;
    *lo = a * align < count ? a * align : count;
    *hi = b * align < count ? b * align : count;
}
