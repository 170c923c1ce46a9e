/* peer/averaging.h: when and with whom a peer averages its blocks with
 * their other replicas (the round itself is peer/allreduce.h).
 *
 * Rounds start on wall-clock multiples of the period: round R is the
 * round's start in ms since the epoch, so replicas agree on R without
 * talking, and peers whose periods are multiples of one another (10 s and
 * 30 s) meet at the common multiples. At the start of a round each hosted
 * block stores a signed matchmaking entry (below, with the
 * period), waits a gathering window, reads who else did, and runs the
 * all-reduce with that group (peer_avg_choose_group).
 *
 * The members' views of the group can differ (an entry still on its way
 * through the DHT, a loaded machine). A member asked about a round it has
 * not begun, or named in another group for the same round, answers EAGAIN
 * and reads the group again at once (peer_allreduce_server_set_hint); when the
 * new view differs it cancels its round and starts the new group's, while
 * the others keep asking. So the views converge on every entry stored in
 * time, instead of every member abandoning the round (which a short
 * gathering window on a loaded machine made the rule, not the exception).
 *
 * Every completed and abandoned round is counted per block (the
 * announcement, the metrics and the monitor show both), and so is every
 * contribution the robust reduce dropped or clipped; the log names the
 * member, once per round. A peer that sees a
 * replica with another period says once how often they meet.
 *
 * The matchmaking entry: under the key
 * BLAKE2b-160("starling.avg:<block>:<stage hash, 16 hex digits>") every
 * holder stores, at the start of each round, a signed entry (subkey = its
 * node ID) that expires a few seconds after the round may end; its value
 * is a msgpack map in the announcements' frame (swarm/announce.h):
 *     "v" u 1, "r" u round: its start, ms since the epoch (a multiple of the
 *     period, so peers with periods that are multiples of each other meet),
 *     "a" str tensor RPC address, "o" u optimizer kind (expert_optim_kind),
 *     "p" u the holder's averaging period in ms (optional),
 *     "m" u the averaging mode (enum peer_avg_mode; absent: mean),
 *     "f" u the slices' format (peer_fmt; absent: f32), "fb" u q8's block
 *     (written with q8 only; absent: 64).
 * Holders averaging in another mode than mean store and read their
 * entries under another key, "starling.avg.<mode>:<block>:<hash>"
 * ("starling.avg.diloco:..."), and holders whose slices are not f32 under
 * one naming the format too ("starling.avg.q8-64:...",
 * "starling.avg.diloco.f16:..."), so peers that predate the modes or the
 * formats never see them; a candidate whose mode or format differs from
 * ours is left out all the same, and both are part of the group digest.
 *
 * Loop thread only.
 */
#ifndef PEER_AVERAGING_H
#define PEER_AVERAGING_H

#include <stdint.h>
#include <stdio.h>

#include <uv.h>

#include "dht/dht.h"
#include "peer/allreduce.h"
#include "peer/service.h"

/* ---- The matchmaking entry (see above) ---- */

typedef struct peer_avg_record {
    uint64_t round;
    char addr[65];
    int optim;                    /* 0..255 */
    uint64_t period_ms;           /* 0: not given */
    int mode;                     /* enum peer_avg_mode, 0..255; 0 (mean) is not written */
    int fmt;                      /* peer_fmt of the slices, 0..255; 0 (f32) is not written */
    int fmt_block;                /* q8's block (0: the default); 0 for the others */
} peer_avg_record;

/* The matchmaking key of a block (see above) for mean mode, and for any
 * mode. */
void peer_avg_key(uint8_t key[DHT_ID_LEN], const char *block, uint64_t stage_hash);
void peer_avg_mode_key(uint8_t key[DHT_ID_LEN], const char *block, uint64_t stage_hash, int mode);
/* ... and for any mode and slice format (fmt_block: q8's, 0 the default). */
void peer_avg_fmt_key(uint8_t key[DHT_ID_LEN], const char *block, uint64_t stage_hash, int mode, int fmt,
                      int fmt_block);
/* Encodes m into buf. Returns the length, -EINVAL (no address, one too
 * long or with control characters, optim, mode or format out of range) or
 * -EMSGSIZE. */
long peer_avg_record_encode(const peer_avg_record *m, uint8_t *buf, size_t cap);
/* Decodes an untrusted value: 0 or -EBADMSG (out zeroed). */
int peer_avg_record_decode(peer_avg_record *out, const uint8_t *buf, size_t len);

/* ---- With whom (pure) ---- */

typedef struct peer_avg_candidate {
    peer_allreduce_member m;
    uint8_t optim;                 /* expert_optim_kind of its optimizer */
    uint8_t mode;                  /* enum peer_avg_mode */
    uint8_t fmt;                   /* the slices' peer_fmt (0: f32) */
    uint16_t fmt_block;            /* q8's block (0: the default) */
} peer_avg_candidate;

typedef struct peer_avg_group {
    peer_allreduce_member members[PEER_ALLREDUCE_MAX_MEMBERS]; /* sorted by node ID */
    int n, me;
    int with_optim;                /* every member has the same optimizer kind */
    int mode;                      /* every member's (self's) */
    int fmt, fmt_block;            /* likewise (fmt_block: q8's, normalized; else 0) */
    uint8_t digest[PEER_AVG_DIGEST_LEN];
} peer_avg_group;

/* The group of round `round` that self belongs to, from every member's
 * entry (cand[0..nc), self included, IDs distinct); candidates whose mode
 * or slice format is not self's are left out first. More than
 * PEER_ALLREDUCE_MAX_MEMBERS candidates split into near-equal groups by a
 * per-round hash of the IDs, alike on every member. Returns 0, -ENOENT
 * when self is not among the candidates or would be alone, -EINVAL. */
int peer_avg_choose_group(const peer_avg_candidate *cand, int nc, const uint8_t self[DHT_ID_LEN],
                          uint64_t round, peer_avg_group *out);

/* The candidates of round `round` from the matchmaking entries e[0..n)
 * read under a block's key: the signed entries (subkey a node ID) whose
 * value decodes and names that round, self's mode (an entry without
 * one: mean) and self's format (without one: f32), other than self's own,
 * then self,
 * last (a member whether or not its own entry came back). At most cap
 * (>= 1) candidates in out, self included. *other_period_ms (may be
 * NULL): the first period a decoded entry names (of any round) other than
 * our_period_ms, 0 when none. Returns the number of candidates, or -EINVAL. */
int peer_avg_candidates(const dht_entry *e, size_t n, uint64_t round, const peer_avg_candidate *self,
                        uint64_t our_period_ms, peer_avg_candidate *out, int cap, uint64_t *other_period_ms);

/* ---- When: the period timer and the rounds ---- */

typedef struct peer_averaging_config {
    uv_loop_t *loop;
    dht *dht;
    const dht_identity *self;      /* borrowed: outlives the averaging */
    const uint8_t *swarm_key;      /* 32 bytes or NULL; borrowed likewise */
    peer_service *svc;             /* borrowed likewise */
    peer_allreduce_server *rounds; /* svc's averaging rounds (peer_allreduce_server_create);
                                      borrowed likewise */
    const char *addr;              /* our tensor RPC "HOST:PORT" (copied) */
    int optim_kind;
    peer_avg_method method;        /* how rounds average and their slices travel
                                      (zeros: PEER_AVG_MEAN in f32) */
    double every_s;                /* > 0 */
    double round_timeout_s;        /* one round, all attempts; 0 = 30 */
    int (*ready)(void *arg);       /* nonzero once the blocks may average (online) */
    void *ready_arg;
    FILE *log;                     /* status lines */
} peer_averaging_config;

typedef struct peer_averaging_stats {
    uint64_t rounds;               /* completed (applied) */
    uint64_t abandoned;            /* begun and abandoned (weights unchanged) */
    int group;                     /* size of the last completed round's group */
    /* Contributions of other members (each counted once per round and
     * member, as the log names them): left out of our part's average for
     * non-finite values, a reduced part that came back non-finite, or a
     * reduced part far from the others' that we did not apply (dropped,
     * peer_allreduce_check_parts); pulled in toward the group's median because they were far
     * from it (clipped). See peer_allreduce_robust_mean. */
    uint64_t dropped, clipped;
    /* Averaging tensor bytes (slices in their format) since start:
     * fetched by our rounds, and served to the other members. */
    uint64_t bytes_received, bytes_sent;
    /* The last completed round's: what it fetched, and what we served for
     * it so far (members that finish after us still fetch our part). */
    uint64_t last_bytes_received, last_bytes_sent;
} peer_averaging_stats;

typedef struct peer_averaging peer_averaging;

/* Starts the period timer and installs the rounds' hint. Returns
 * NULL on bad arguments (an unknown mode, diloco's outer_lr not > 0 or
 * outer_momentum not in [0, 1), a format or q8 block that is not one) or
 * out of memory. */
peer_averaging *peer_averaging_start(const peer_averaging_config *cfg);

/* The blocks' state is final (the daemon went online, after restoring or
 * downloading it): in diloco mode each block's anchor is taken now
 * (peer_allreduce_server_anchor), so the training that follows is the
 * first round's pseudo-gradient. No-op in mean mode; NULL-safe. */
void peer_averaging_anchor(peer_averaging *av);

/* Block i's counters (zeros for NULL or a bad index). */
void peer_averaging_get_stats(const peer_averaging *av, int i, peer_averaging_stats *out);

/* Cancels rounds in flight (their blocks keep their weights) and closes the
 * timers; cb runs on the loop once no round or timer is left. The service
 * must stand until then. A group lookup may still call back until the DHT
 * is closed, so free av with peer_averaging_destroy only after that.
 * NULL-safe (cb is not called for NULL). */
void peer_averaging_stop(peer_averaging *av, void (*cb)(void *arg), void *arg);

/* Frees a stopped averaging (see above). NULL-safe; sets *p = NULL. */
void peer_averaging_destroy(peer_averaging **p);

#endif
