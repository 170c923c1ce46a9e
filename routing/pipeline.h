/* routing/pipeline.h: the trainer's micro-batch scheduler, without I/O.
 *
 * A model is a chain of S stages served by peers; stage s maps rows of width
 * widths[s] to rows of width widths[s+1]. The trainer pushes micro-batches;
 * each travels forward through stages 0..S-1, the loss turns the last output
 * into a gradient, and the gradient travels backward through S-1..0. The
 * pipeline keeps every boundary activation of each micro-batch, so a backward
 * call can be sent to ANY replica of a stage (servers recompute the forward)
 * and a failed call is simply issued again: no batch is ever lost, with
 * one exception: a backward that the stage refuses (status -ERANGE: the
 * holder's gradient checks failed) max_refusals times is not sent again,
 * and its batch finishes with `refused` set (see route_pipeline_call_done).
 *
 * The pipeline only decides what to send next. The driver (the trainer's
 * event loop) takes calls with route_pipeline_next_call, sends them to a
 * replica it chooses, and reports each result with route_pipeline_call_done.
 * Several micro-batches are in flight at once so every stage can work at the
 * same time; backward calls and older micro-batches go first, which bounds
 * the number of activations held (as 1F1B schedules do).
 *
 * Memory: every buffer is allocated by route_pipeline_create; nothing is
 * allocated afterwards. Not thread-safe: one driver thread.
 */
#ifndef ROUTE_PIPELINE_H
#define ROUTE_PIPELINE_H

#include <stdint.h>

#define ROUTE_PIPELINE_MAX_STAGES 64
#define ROUTE_PIPELINE_MAX_INFLIGHT 64
#define ROUTE_PIPELINE_MAX_REFUSALS 3   /* default max_refusals */

typedef enum route_call_kind {
    ROUTE_CALL_FORWARD = 1,
    ROUTE_CALL_BACKWARD = 2,
} route_call_kind;

/* Computes the loss of one micro-batch: logits is (B, C), labels (B,
 * labels_per_row); writes dlogits (B, C), the gradient of the loss summed
 * over rows, and the summed loss and count of correct predictions. Returns
 * 0 or -errno (the micro-batch then fails). */
typedef int (*route_loss_fn)(void *ctx, const float *logits, const uint8_t *labels, int B, int C,
                             float *dlogits, double *loss_sum_out, int *correct_out);

typedef struct route_pipeline_config {
    int n_stages;                 /* S, 1..ROUTE_PIPELINE_MAX_STAGES */
    const int *widths;            /* S+1 widths; copied */
    int max_batch;                /* rows per micro-batch */
    int max_inflight;             /* micro-batches in flight, 1..ROUTE_PIPELINE_MAX_INFLIGHT */
    route_loss_fn loss;
    void *loss_ctx;
    int max_refusals;             /* -ERANGE answers to one batch's backward calls
                                     before its update is dropped; 0: the default,
                                     ROUTE_PIPELINE_MAX_REFUSALS */
    int labels_per_row;           /* label bytes per row: 1 (0 means 1) for a class, the
                                     context length for a language model */
} route_pipeline_config;

/* One RPC to make. The pointers stay valid until route_pipeline_call_done
 * for this call (the driver may send straight from them). */
typedef struct route_call {
    uint32_t token;               /* pass back to route_pipeline_call_done (opaque) */
    int slot;                     /* the micro-batch's slot, 0..max_inflight-1: what the
                                     driver keys per-batch state by */
    route_call_kind kind;
    int stage;
    int rows;                     /* B of this micro-batch */
    int width_in, width_out;
    const float *inputs;          /* (rows, width_in) */
    const float *grad_outputs;    /* (rows, width_out); backward only, else NULL */
    float *outputs;               /* forward: (rows, width_out); backward: grad_inputs (rows, width_in) */
    int attempt;                  /* 0 on the first try, +1 for each retry */
    int need_grad_inputs;         /* 0 for the backward of stage 0: only param grads matter */
} route_call;

/* A micro-batch that has finished its backward pass. */
typedef struct route_batch_result {
    uint64_t seq;                 /* order of route_pipeline_push, from 0 */
    int rows;
    double loss_sum;
    int correct;
    int retries;                  /* calls of this batch that had to be re-sent */
    int forward_only;             /* pushed with route_pipeline_push_eval */
    int refused;                  /* its backward was refused max_refusals times and
                                     dropped: the stages after the refusing one took
                                     its gradient, that stage and the ones before did
                                     not. Its loss and rows are still reported. */
    int refusals;                 /* -ERANGE answers to its backward calls */
} route_batch_result;

typedef struct route_pipeline route_pipeline;

/* Returns a new pipeline, or NULL on bad config or no memory. */
route_pipeline *route_pipeline_create(const route_pipeline_config *cfg);
void route_pipeline_destroy(route_pipeline **p);

/* Starts a micro-batch: x is (rows, widths[0]), labels (rows); both copied.
 * Returns its sequence number (>= 0), -EAGAIN when max_inflight batches are
 * already in flight, or -EINVAL. */
int64_t route_pipeline_push(route_pipeline *p, const float *x, const uint8_t *labels, int rows);

/* As route_pipeline_push, for evaluation: the batch goes forward and
 * through the loss (which counts correct predictions) but not backward, so
 * it changes no weights. */
int64_t route_pipeline_push_eval(route_pipeline *p, const float *x, const uint8_t *labels, int rows);

/* Takes the next call to send. Returns 1 and fills *call, or 0 when nothing
 * is ready (every in-flight batch waits on a call already taken). */
int route_pipeline_next_call(route_pipeline *p, route_call *call);

/* Reports a call's result. status 0: call->outputs holds the answer and the
 * batch moves on. status < 0: the call failed; it becomes ready again (with
 * attempt + 1) so the driver can send it to another replica. status -ERANGE
 * on a backward call is a refusal (the holder found the gradient out of
 * bounds): counted in the batch's refusals, and once they reach
 * max_refusals the call is not re-issued (nor counted as a retry): the
 * batch finishes with `refused` set, so a gradient that every replica
 * refuses cannot be retried forever. Returns 0,
 * -ENOENT for an unknown, stale or already reported token, or the loss
 * function's error: only bad labels cause that, and that batch is then
 * dropped and counted in route_pipeline_failed. */
int route_pipeline_call_done(route_pipeline *p, uint32_t token, int status);

/* Pops one finished micro-batch. Returns 1 and fills *out, or 0 if none. */
int route_pipeline_pop_result(route_pipeline *p, route_batch_result *out);

/* Micro-batches in flight (pushed, not yet popped). */
int route_pipeline_inflight(const route_pipeline *p);

/* Calls taken by the driver and not yet reported. */
int route_pipeline_outstanding(const route_pipeline *p);

/* Calls re-issued so far: every call reported failed (status < 0), which
 * the pipeline hands out again, counted at once, of training and evaluation
 * batches alike, whether or not the batch has finished. It equals the sum of
 * route_batch_result.retries over the batches popped once they all are. */
uint64_t route_pipeline_retries(const route_pipeline *p);

/* Micro-batches the loss function rejected. */
uint64_t route_pipeline_failed(const route_pipeline *p);

/* Backward calls reported refused (-ERANGE), and training micro-batches
 * (and their rows) finished with `refused` set. */
uint64_t route_pipeline_refusals(const route_pipeline *p);
uint64_t route_pipeline_refused_batches(const route_pipeline *p);
uint64_t route_pipeline_refused_rows(const route_pipeline *p);

/* ---- error notes: which remote errors to show, and when ----
 *
 * The trainer and `starling infer` log each distinct (stage, error code)
 * the first time it happens, then at most one summary line every
 * period_s with the counts since the last line, so a swarm that refuses
 * or fails thousands of calls does not flood stderr. Pure: time is passed
 * in; the caller formats and prints. */

#define ROUTE_ERRLOG_KINDS 32
#define ROUTE_ERRLOG_PERIOD_S 10.0    /* between summary lines, in the trainer and infer */

typedef struct route_errlog_kind {
    int stage;                    /* -1: not a stage's (e.g. a connection) */
    int code;                     /* positive errno */
    long total;                   /* all occurrences */
    long pending;                 /* since the last line that mentioned it */
    char last[160];               /* the latest sentence */
} route_errlog_kind;

typedef struct route_errlog {
    double period_s;              /* between summary lines (10 s in the tools) */
    double last_summary;          /* time of the last summary line */
    int n;
    route_errlog_kind k[ROUTE_ERRLOG_KINDS];
    long dropped;                 /* occurrences of kinds beyond ROUTE_ERRLOG_KINDS */
} route_errlog;

/* Starts an empty log at time now, with summaries every period_s. */
void route_errlog_init(route_errlog *e, double period_s, double now);

/* Records one occurrence of (stage, code) with its sentence. Returns 1
 * when it is the first of that kind (print it now), else 0 (it goes into
 * the next summary). */
int route_errlog_add(route_errlog *e, int stage, int code, const char *sentence);

/* When a summary is due (period_s since the last one and something
 * pending): calls line(arg, kind) for each kind with pending occurrences
 * (pending still set, so the caller can print it), clears them and returns
 * how many kinds it reported; else 0. */
int route_errlog_flush(route_errlog *e, double now, void (*line)(void *arg, const route_errlog_kind *k),
                       void *arg);

#endif
