/* starling.h: the public C API of libstarling, for language bindings
 * (python/ uses it through ctypes) and C programs that want a swarm
 * without the `starling` command.
 *
 * What it gives:
 * - a swarm handle (starling_swarm_open): a light DHT client of its own
 *   (client_only, kept out of others' routing tables) joined through the
 *   initial peers, on its own event-loop thread;
 * - queries on it: the models the swarm serves, a stage's holders, raw
 *   DHT records (JSON documents, see each function);
 * - remote stages (starling_stages_open): consecutive stages of a model
 *   called one at a time through the same call engine as `starling train`
 *   (routing/caller.h: replica choice, retries on another replica, bans,
 *   waits for holders), forward and backward; the stages' optimizers stay
 *   on the peers that hold them;
 * - local facts about a model (starling_model_info) and its stages'
 *   initial weights (starling_stage_init_params), for checking.
 *
 * Threads. Every function may be called from any thread, and from several
 * threads at once: a call on a swarm (or its stages) hands its work to the
 * swarm's loop thread and blocks the calling thread until it is done, so
 * calls from several threads go out concurrently (e.g. micro-batches in
 * flight). No callback ever runs on the caller's thread; the API has no
 * callbacks. starling_swarm_close and starling_stages_close must not race
 * calls on the same handle (the caller makes sure the others returned).
 *
 * Errors. Functions return 0 (or a count) on success and a negative errno
 * on failure, with a sentence for people in err (err_len bytes, always
 * NUL-terminated when err_len > 0; err may be NULL):
 *   -EINVAL     a bad argument (NULL, stage out of range, rows < 1, ...)
 *   -ENOENT     unknown model (neither built in nor published in the swarm)
 *   -EHOSTUNREACH  no initial peer answered (starling_swarm_open); no DHT
 *               node answered a query (models, holders, get, put)
 *   -EKEYREJECTED  the swarm is under another swarm key (or none)
 *   -ETIMEDOUT  a stage had no reachable holder within max_wait_s
 *   -EAGAIN     a stages handle is still replacing its call engine after
 *               a failure (rare); call again
 *   -ECANCELED  the handle was closed while the call waited
 *   -ENOMEM, -EIO (a file could not be read), -EBADMSG (a reply or record
 *               that does not decode)
 *
 * Ownership. Strings returned through char ** are the library's malloc'd
 * memory: free them with starling_free. Tensors passed in are borrowed for
 * the duration of the call (read, never kept); tensors written are the
 * caller's buffers of the documented size. Handles are freed by their
 * close function.
 */
#ifndef STARLING_H
#define STARLING_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STARLING_API_VERSION 1
#define STARLING_ID_LEN 20          /* node IDs (DHT keys too) */

typedef struct starling_swarm starling_swarm;
typedef struct starling_stages starling_stages;

/* "0.1.0": the library's version; STARLING_API_VERSION for the ABI. */
const char *starling_version(void);
int starling_api_version(void);

/* Frees a string (or buffer) the library returned. NULL-safe. */
void starling_free(void *p);

/* ---- the swarm ---- */

typedef struct starling_swarm_options {
    const char *swarm_key_file;  /* 64 hex digits, mode 0600; NULL: open swarm */
    const char *identity_file;   /* ed25519 identity (starling keygen); NULL: a fresh one */
    const char *listen;          /* local DHT address "HOST:PORT"; NULL: any port on the
                                    initial peers' address family */
    double join_timeout_s;       /* 0: 15 */
    double call_timeout_s;       /* one stage call, and a connection's set-up (0: 30) */
    double max_wait_s;           /* a stage without a reachable holder (0: 120) */
    uint64_t seed;               /* replica choice (0: from the clock) */
} starling_swarm_options;

/* Joins the swarm through initial_peers ("HOST:PORT[/NODEID],..." as
 * `starling peer` prints them). opt may be NULL (defaults). Returns 0 and
 * *out, or -errno (see above: -EINVAL for a bad list or option,
 * -EHOSTUNREACH, -EKEYREJECTED, -EADDRNOTAVAIL (an initial peer answered
 * with another node ID), -EIO (a key or identity file)). On failure
 * nothing is left running. */
int starling_swarm_open(starling_swarm **out, const char *initial_peers, const starling_swarm_options *opt,
                        char *err, size_t err_len);

/* Closes every stages handle still open on s (they are freed: do not use
 * or close them afterwards), leaves the DHT and stops the loop thread;
 * frees s. Calls still waiting return -ECANCELED first. NULL-safe. */
void starling_swarm_close(starling_swarm *s);

/* The swarm's node ID (ours) as 40 hex digits into hex[41]. */
void starling_swarm_node_id(const starling_swarm *s, char hex[41]);

/* The models the swarm's peers announce (their models index), as a JSON
 * array: [{"model": NAME, "stages": N, "description": HEX40 or null,
 * "announcers": K}, ...] sorted by name. Returns the count (>= 0) and
 * *json, or -errno. */
int starling_swarm_models(starling_swarm *s, char **json, char *err, size_t err_len);

/* The holders of stage `stage` of model `model` (built in, or published in
 * the swarm: fetched and checked as `starling monitor --model` does), as a
 * JSON array of the monitor's rows: [{"id": HEX40, "addr": "HOST:PORT",
 * "state": "online"|"joining"|"offline", "usable": bool (online and
 * announcing this build's stage hash), "throughput": samples/s, "load":
 * 0..1, "weight_version": N, "device": "cpu", "age_s": seconds since its
 * announcement, "avg_rounds": N, "grads_refused": N, "frozen": bool}, ...].
 * Returns the count (>= 0) and *json, or -errno (-ENOENT: unknown model,
 * -EINVAL: stage out of range). */
int starling_swarm_holders(starling_swarm *s, const char *model, int stage, char **json, char *err,
                           size_t err_len);

/* Raw DHT records, for debugging: key is hashed to a 160-bit key as the
 * peers do (BLAKE2b-160 of its bytes, e.g. "fmnist-mlp.2"), or taken as is
 * when it is 40 hex digits prefixed "0x". get: a JSON array
 * [{"subkey": HEX, "value": HEX, "signed": bool, "expires_in_s": S}, ...];
 * returns the count and *json. put: stores value (len <= 768 bytes) for
 * ttl_s seconds (1..86400), signed with our identity (subkey = our node
 * ID); returns the number of nodes that stored it (>= 1). */
int starling_swarm_get(starling_swarm *s, const char *key, char **json, char *err, size_t err_len);
int starling_swarm_put(starling_swarm *s, const char *key, const void *value, size_t len, double ttl_s,
                       char *err, size_t err_len);

/* ---- models, locally ---- */

/* A model's facts as a JSON object: {"name", "description", "task":
 * "classes"|"bytes", "max_batch": rows per call (starling_stages_max_rows),
 * "seq", "vocab" (a language model's context and vocabulary; 0 otherwise),
 * "stages": [{"index", "kind", "in_shape": [..], "out_shape": [..],
 * "in_width", "out_width" (floats per row), "params": N, "tensors":
 * [{"name", "offset", "shape": [rows, cols]}, ...]}, ...]}. A vector's
 * shape is [n, 1]; names repeat for each layer of a multi-layer stage, in
 * order. in_shape/out_shape are one row's shape (a token row's is
 * [context]; a float row's [width] or [context, dim]).
 * s may be NULL (built-in and registered models only); with a swarm, a
 * model the swarm publishes is fetched. Returns 0 and *json, or -errno. */
int starling_model_info(starling_swarm *s, const char *model, char **json, char *err, size_t err_len);

/* Stage `stage`'s initial parameters (what a peer started without --seed
 * and without state to download starts from: its seeded PyTorch-default
 * initialisation) into
 * params[0..n), n = the stage's "params". Returns 0 or -errno. */
int starling_stage_init_params(starling_swarm *s, const char *model, int stage, float *params, size_t n,
                               char *err, size_t err_len);

/* ---- remote stages ---- */

/* Opens stages first..last (inclusive) of `model` for calls. The model is
 * built in, registered, or fetched from the swarm. Returns 0 and *out, or
 * -errno (-ENOENT unknown model, -EINVAL range). Holders are looked up on
 * first use. */
int starling_stages_open(starling_stages **out, starling_swarm *s, const char *model, int first, int last,
                         char *err, size_t err_len);

/* Closes st: calls still waiting return -ECANCELED. NULL-safe. There is
 * no way yet to cancel one waiting call without closing the handle. */
void starling_stages_close(starling_stages *st);

/* Who served a forward: passed back to the backward of the same rows so it
 * goes to the same holder and is computed on the same weight version when
 * that holder still has it (else another replica recomputes it on its own
 * weights). */
typedef struct starling_served {
    uint8_t holder[STARLING_ID_LEN];
    uint64_t weight_version;
    int32_t version_known;
    int32_t attempts;           /* calls it took (1: no retry) */
} starling_served;

/* Row widths of stage `stage` (index within the model): floats per input
 * row and per output row. Returns 0 or -EINVAL. */
int starling_stages_widths(const starling_stages *st, int stage, int64_t *in_width, int64_t *out_width);

/* One forward of `rows` rows through stage `stage` (first..last): x is
 * (rows, in_width) float32, contiguous; y (rows, out_width) is written.
 * training != 0: a training forward (the holder may keep its activations
 * for the backward); 0: an inference call (never changes weights, served
 * ahead of training work). served (may be NULL) receives who served it.
 * Failed calls are sent again to another replica until one answers or no
 * holder is reachable for max_wait_s. 1 <= rows <= starling_stages_max_rows.
 * Returns 0 or -errno. */
int starling_stage_forward(starling_stages *st, int stage, const float *x, int64_t rows, float *y, int training,
                           starling_served *served, char *err, size_t err_len);

/* The backward of a forward of the same x through stage `stage`: dy is the
 * gradient of the loss (summed over rows) with respect to y, (rows,
 * out_width); dx (rows, in_width) receives the gradient with respect to x,
 * or is NULL when not needed. The holder accumulates the parameter
 * gradients and steps its optimizer at its target batch. served (may be
 * NULL) is the forward's. A holder that refuses the gradient (ERANGE: its
 * gradient checks failed) three times gives -ERANGE. Returns 0 or -errno. */
int starling_stage_backward(starling_stages *st, int stage, const float *x, const float *dy, int64_t rows,
                            float *dx, const starling_served *served, char *err, size_t err_len);

/* The most rows one call takes: the model's peers' largest request (its
 * max_batch, or a peer's default 256). Split larger batches. */
int starling_stages_max_rows(const starling_stages *st);

/* Calls made and calls sent again so far on st. */
void starling_stages_counters(const starling_stages *st, uint64_t *calls, uint64_t *retries);

#ifdef __cplusplus
}
#endif

#endif
