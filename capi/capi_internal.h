/* capi/capi_internal.h: what the files of capi/ share (not installed).
 *
 * A swarm handle owns one libuv loop, run by its own thread (the loop
 * thread) once the join is done. API calls from other threads become jobs:
 * capi_run queues a job, wakes the loop and blocks until the loop thread
 * has called capi_done for it. A job's start function runs on the loop
 * thread and starts the work (a DHT lookup, a stage call); whatever
 * callback ends it calls capi_done, after which the job (the caller's
 * stack memory) must not be touched again.
 */
#ifndef CAPI_INTERNAL_H
#define CAPI_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "capi/starling.h"
#include "dht/dht.h"

struct expert_model_spec;
struct route_caller;

typedef struct capi_job capi_job;
struct capi_job {
    void (*start)(capi_job *j);   /* loop thread */
    starling_swarm *s;
    char *err;                    /* the API caller's buffer (may be NULL) */
    size_t err_len;
    int done, rc;
    capi_job *next;
};

struct starling_swarm {
    uv_loop_t loop;
    uv_thread_t thread;
    int thread_started;
    dht *d;
    dht_identity ident;
    int has_swarm_key;
    uint8_t swarm_key[32];
    starling_swarm_options opt;   /* defaults filled in; file names not kept */
    uint64_t rng;                 /* seeds for the stages' callers */

    uv_async_t wake;              /* jobs queued */
    pthread_mutex_t lock;
    pthread_cond_t cond;          /* a job done */
    capi_job *queue, *queue_tail; /* under lock */
    int closing;                  /* under lock: no new jobs */
    int waiters;                  /* under lock: threads inside capi_run (the close
                                     frees the lock only once they all left) */

    /* loop thread only */
    int shutting, dht_closing, dht_closed, wake_closed;
    starling_stages *stages;      /* open stages handles */
};

/* ---- common.c ---- */

/* Writes a sentence into err (err_len > 0), returns rc. */
int capi_err(char *err, size_t err_len, int rc, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* Any thread but the loop's: runs j on the loop thread and waits for it.
 * Returns j->rc, or -ECANCELED (with a sentence) when s is closing. */
int capi_run(starling_swarm *s, capi_job *j);

/* Loop thread: j is finished with rc (its err already written). */
void capi_done(capi_job *j, int rc);

/* A growing string for JSON documents. */
typedef struct capi_buf {
    char *p;
    size_t len, cap;
    int oom;
} capi_buf;
/* Appends the formatted text; out of memory marks b (capi_buf_take says it). */
void capi_buf_printf(capi_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Appends s as a JSON string; bytes that are not valid UTF-8 become U+FFFD. */
void capi_buf_json_str(capi_buf *b, const char *s);
/* Hands the string over (*out) and returns 0, or -ENOMEM. */
int capi_buf_take(capi_buf *b, char **out, char *err, size_t err_len);

/* ---- query.c ---- */

/* Loop thread: the model called name, built in, registered or fetched from
 * the swarm (then registered): calls back done(arg, rc, spec) once, later
 * or at once; rc 0 or -errno with the sentence in err. */
typedef void (*capi_model_cb)(void *arg, int rc, const struct expert_model_spec *spec);
void capi_model_find(starling_swarm *s, const char *name, char *err, size_t err_len, capi_model_cb done, void *arg);

/* ---- stages.c ---- */

/* Loop thread: a stage handle's part of the shutdown. Starts
 * finishing its caller (its calls fail with -ECANCELED); returns 1 while a
 * caller's handles are still open. */
int capi_stages_shutdown(starling_stages *st);
/* Loop thread: frees a stage handle whose shutdown has ended
 * (capi_stages_shutdown returned 0). */
void capi_stages_free(starling_stages *st);
/* The next open stage handle of the same swarm (the swarm's list), or NULL. */
starling_stages *capi_stages_next(starling_stages *st);
/* Loop thread, after every turn of the loop: ends what the callers'
 * events finished (calls of an ended caller, closes). */
void capi_stages_poll(starling_swarm *s);

#endif
