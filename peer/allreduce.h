/* peer/allreduce.h: one group-averaging round of one block among its
 * replicas, as a butterfly all-reduce over the tensor RPC.
 *
 * The members (found through the DHT by the daemon, sorted by node ID, the
 * same list on every member) each freeze their block's flat state (params,
 * m, v; peer_allreduce_server_begin) and split it into n parts. Member j pulls
 * part j of every other member's base (PEER_METHOD_AVG kind 0), forms the
 * average weighted by each member's weight (training samples since its last
 * round, plus one; 0 for initial weights), publishes it, then pulls every other member's reduced
 * part (kind 1). Each member receives and sends 2 (n-1)/n of the state.
 * With the whole average in hand it applies it as one new weight version,
 * keeping the updates made during the round (expert_block_flat_apply).
 *
 * The reduce is robust (peer_allreduce_robust_mean): a member whose
 * contribution holds a non-finite value is left out of our part's average,
 * and with three or more contributors a member far from the others is
 * pulled in to PEER_ALLREDUCE_CLIP_FACTOR times the typical distance
 * before it is averaged, so a hostile minority moves the result a bounded
 * amount; an honest group, whose members are about equally far from its
 * median, gets the exact weighted mean. A reduced part that comes back
 * non-finite refuses the round.
 *
 * A member in another group for the same round answers EAGAIN and is asked
 * again until the deadline (the daemon regroups meanwhile). A group whose
 * weights are all 0 fails with -ENODATA.
 *
 * Failure: any other error (a member gone, a timeout) abandons the
 * round here and leaves the block unchanged; a member that fails before its
 * part is reduced answers ECANCELED, so the others abandon too. So every
 * member ends with its own weights either unchanged or replaced by the
 * group's average, never a mix.
 *
 * DiLoCo mode (PEER_AVG_DILOCO, below) runs the same round over a smaller
 * vector: each block keeps an anchor (its parameters after its last
 * applied round) and an outer momentum buffer; the members all-reduce only
 * their pseudo-gradients anchor - params (the AdamW moments stay local),
 * and each applies an outer Nesterov step from its anchor.
 *
 * Both sides live here: the round as a client (peer_allreduce_start) and
 * the serving side (peer_allreduce_server), which keeps each hosted
 * block's round and answers the others' PEER_METHOD_AVG requests.
 *
 * Loop thread only.
 */
#ifndef PEER_ALLREDUCE_H
#define PEER_ALLREDUCE_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "dht/identity.h"
#include "peer/service.h"

#define PEER_ALLREDUCE_MAX_MEMBERS 16

/* ---- What a round averages (--average-mode) ----
 *
 * PEER_AVG_MEAN: the round's vector is the block's flat state (parameters,
 *   m, v: 3 x nparams floats); the group's weighted mean replaces it.
 * PEER_AVG_DILOCO (Douillard et al. 2023, "DiLoCo"): the round's vector is
 *   the pseudo-gradient delta = anchor - params (nparams floats), the anchor
 *   being the parameters right after the block's last applied round (or
 *   when it went online: peer_allreduce_server_anchor). With dbar the
 *   group's weighted mean of the deltas, the outer step is PyTorch's SGD
 *   with Nesterov momentum mu and learning rate lr:
 *       buf = mu buf + dbar;  step = dbar + mu buf;  new = anchor - lr step;
 *   the block moves by (new - params at the round's start), keeping the
 *   updates made during the round, and anchor := new. The moments stay
 *   local. A failed round leaves anchor and buf unchanged.
 * Members of one group must use one mode: it is part of the group digest
 * (peer_allreduce_digest) and of the matchmaking (peer/averaging.h). */
enum peer_avg_mode {
    PEER_AVG_MEAN = 0,
    PEER_AVG_DILOCO = 1,
};

#define PEER_AVG_OUTER_LR 0.7          /* DiLoCo's outer learning rate */
#define PEER_AVG_OUTER_MOMENTUM 0.9    /* and its Nesterov momentum */

/* ---- How slices travel (--average-format) ----
 *
 * The slices of a round (bases, kind 0, and reduced parts, kind 1) travel
 * in one tensor format (net/tensorfmt.h): f32 (the default, bit for bit),
 * f16, bf16 or q8 with its block. The asker names it as the request's reply
 * format; the server refuses another with EINVAL, and the asker refuses a
 * reply in another format, of another shape, or that does not decode
 * (-EBADMSG: the round is abandoned). Members of one group use one format:
 * it is part of the group digest and of the matchmaking.
 *
 *  - Bases: each member encodes its whole vector once when the round
 *    begins, part by part (so a q8 block never straddles two parts), and
 *    serves slices of those bytes; its own part enters its reduce exact.
 *    Mean mode rounds to nearest. Diloco mode adds error feedback: a
 *    block keeps a residual (nparams floats, zero when the anchor is set);
 *    the round shares v = delta + residual, the parts others reduce encoded
 *    with peer_tensorfmt_encode_ef, and once the round is applied the
 *    residual becomes what those encodings lost (0 over our own part),
 *    so the next round sends it. A failed round keeps the old residual
 *    (its delta stays in the next round's, the anchor being unchanged).
 *  - Reduced parts: member j encodes its part once, rounding to nearest
 *    (deterministic), serves those bytes, and applies their decoded values
 *    itself, so every member applies the same average, bit for bit.
 *
 * The error of a lossy round is that of the format (net/tensorfmt.h) on
 * each contribution, plus once more on the reduced part. f16 turns
 * magnitudes of 65520 and more into Inf, which the reduce leaves out as
 * non-finite (bf16 and q8 keep float32's range). q8 slices cost n + 4n/B
 * bytes (B the block) against f32's 4n: 3.76x less for B = 64. */
typedef struct peer_avg_method {
    int mode;                      /* enum peer_avg_mode */
    double outer_lr;               /* diloco: > 0 */
    double outer_momentum;         /* diloco: 0 <= mu < 1 */
    int fmt;                       /* the slices' format (peer_fmt); 0: f32 */
    int fmt_block;                 /* q8's block (0: PEER_FMT_Q8_BLOCK); 0 for the others */
} peer_avg_method;

/* ---- The serving side: each hosted block's round ----
 *
 * A round freezes the block's flat state (expert_block_flat_export:
 * parameters, m, v; in diloco mode the pseudo-gradient, nparams floats) as
 * the round's base and splits it into n contiguous
 * parts, one per member (peer_avg_part); member j reduces part j. Other
 * members pull slices of our base and, once we have reduced our part, of
 * the result, with PEER_METHOD_AVG (docs/rpc.md):
 *   request meta (48 bytes LE): round u64 | group digest 16 bytes |
 *                               kind u64 (0 base, 1 reduced) | offset u64 | count u64,
 *                               reply format (key 8): the round's (absent: f32)
 *   reply meta (24 bytes LE):   round u64 | weight f64 | flat length u64,
 *                               one (1, count) tensor in the round's format.
 * Errors: EAGAIN (that round has not begun here yet, our part is not
 * reduced yet, or we are in another group for this round and look again:
 * ask again), ESTALE (another round), ECANCELED
 * (the round failed here), EINVAL (a range outside the state or our part,
 * another format than the round's, or, in q8, an offset that is not a
 * multiple of the block from its part's start). */
#define PEER_AVG_MAX_COUNT (PEER_STATE_CHUNK / 4)
#define PEER_AVG_DIGEST_LEN 16

/* Part j of n of a flat vector of nflat floats. */
static inline void peer_avg_part(size_t nflat, int n, int j, size_t *off, size_t *len)
{
    size_t a = nflat * (size_t)j / (size_t)n, b = nflat * (size_t)(j + 1) / (size_t)n;
    *off = a;
    *len = b - a;
}

typedef struct peer_allreduce_server peer_allreduce_server;

/* Creates the rounds of svc's blocks and registers their PEER_METHOD_AVG
 * handler with svc (peer_service_set_handler): the service owns the
 * server from then on and frees it in peer_service_destroy, so the caller
 * never frees it. Returns NULL when out of memory (nothing registered). */
peer_allreduce_server *peer_allreduce_server_create(peer_service *svc);

/* Begins round `round` of block i in the group named by digest (n members,
 * we are member me), averaging as `how` says (NULL: PEER_AVG_MEAN): freezes
 * the base and our weight (training samples
 * since the last applied round, plus one, so a group where nobody trained
 * averages with equal weights; 0 while the block still has its initial
 * weights: never restored, downloaded, averaged or stepped, so it takes
 * the group's average without pulling it toward noise; in diloco mode
 * also 0 when the block had no anchor yet: it takes its parameters as the
 * anchor now, so its delta is 0). Replaces any earlier round. *nflat_out:
 * the length of the round's vector. Returns 0, -EINVAL or -ENOMEM. */
int peer_allreduce_server_begin(peer_allreduce_server *srv, int i, uint64_t round,
                                const uint8_t digest[PEER_AVG_DIGEST_LEN], int n, int me,
                                const peer_avg_method *how, double *weight_out, size_t *nflat_out);
/* Diloco mode: sets block i's anchor to its current parameters and zeroes
 * its outer momentum; samples trained from now on count for its next
 * round's weight. The daemon calls it when a block's state is final (it
 * went online, after restoring or downloading its state). A block whose
 * state came with an outer state (its checkpoint, or a holder's download:
 * expert_block_outer_lock) keeps that anchor, momentum and residual: the
 * replicas' shared outer optimizer resumes where it was. Returns 0,
 * -EINVAL or -ENOMEM (anchor unchanged). */
int peer_allreduce_server_anchor(peer_allreduce_server *srv, int i);
/* The frozen base of the current round (its vector's length), or NULL. */
const float *peer_allreduce_server_base(peer_allreduce_server *srv, int i);
/* Publishes our reduced part for the others to pull: encodes it once in
 * the round's format (rounding to nearest) and keeps those bytes and their
 * decoded values (peer_allreduce_server_reduced_part). Returns 0, -EINVAL,
 * or -ERANGE when a decoded value is not finite (an f16 overflow; nothing
 * published). */
int peer_allreduce_server_reduced(peer_allreduce_server *srv, int i, const float *part);
/* Marks the round failed here: others asking get ECANCELED. */
void peer_allreduce_server_fail(peer_allreduce_server *srv, int i, int err);
/* Applies the round's result (the whole averaged vector) as one new
 * weight version, keeping the updates made since the base was frozen
 * (expert_block_flat_apply); with_optim == 0 moves the parameters only.
 * In diloco mode avg is the mean pseudo-gradient: the outer step (above)
 * moves the parameters, then the anchor and momentum advance (with_optim
 * is ignored). The samples counted for the next round's weight start at
 * the base. *dist_before, *dist_after: the parameters' L2 distance to the
 * result (the group average; in diloco mode the new anchor) at the
 * round's start and after. Returns 0, -ENOMEM or expert_block_flat_apply's
 * error (block, anchor and momentum unchanged). */
int peer_allreduce_server_apply(peer_allreduce_server *srv, int i, const float *avg, int with_optim,
                                double *dist_before, double *dist_after);
/* Frees the round's buffers (others still asking then get ESTALE); a
 * finished round's reduced part stays served to slower members. */
void peer_allreduce_server_release(peer_allreduce_server *srv, int i);
/* Our published part as every member decodes it (what the round applies
 * over our part), or NULL before peer_allreduce_server_reduced. */
const float *peer_allreduce_server_reduced_part(peer_allreduce_server *srv, int i);

/* Averaging tensor bytes of block i (slices as they travel, in their
 * format): *received, the slices our rounds fetched; *sent, the slices
 * we served to other members (either may be NULL). Since creation. */
void peer_allreduce_server_bytes(const peer_allreduce_server *srv, int i, uint64_t *received, uint64_t *sent);
/* The bytes we served for round `round` so far (members still fetching
 * our reduced part after we applied it add to it), or 0 when that round
 * is not one of the last two served. */
uint64_t peer_allreduce_server_round_sent(const peer_allreduce_server *srv, int i, uint64_t round);

/* Called when another member asks block i about averaging round `round`
 * that has not begun here, or names another group for the round we are in
 * (the answer is EAGAIN): the members' views of the group differ, so the
 * owner should look at the group again. fn NULL: nobody is told. */
typedef void (*peer_allreduce_hint_fn)(void *arg, int block, uint64_t round);
void peer_allreduce_server_set_hint(peer_allreduce_server *srv, peer_allreduce_hint_fn fn, void *arg);

/* ---- The round as a client ---- */

typedef struct peer_allreduce_member {
    uint8_t id[DHT_ID_LEN];
    char addr[66];                 /* "HOST:PORT" of its tensor RPC */
} peer_allreduce_member;

typedef struct peer_allreduce_result {
    int n;                         /* group size */
    double weight_self;            /* our weight / the group's total */
    double dist_before, dist_after; /* our parameters' L2 distance to the group average
                                       (diloco: to the new anchor), before and after */
    double seconds;                /* begin to apply */
    uint64_t bytes_in;             /* tensor bytes received (in the round's format) */
    /* What the robust reduce did with each member's contribution to our
     * part (bit j: members[j]): left out for a non-finite value, or
     * clipped (pulled in toward the median). */
    uint32_t dropped, clipped;
    int bad_reducer;               /* member whose reduced part was non-finite, or -1 */
    uint32_t rejected;             /* bit j: members[j]'s reduced part moved our values far
                                      more than the others' did (peer_allreduce_check_parts);
                                      we kept our own values for it */
} peer_allreduce_result;

/* status 0: the average was applied; otherwise a negative errno and the
 * block is unchanged. res is valid during the callback only. */
typedef void (*peer_allreduce_cb)(void *arg, int status, const peer_allreduce_result *res);

typedef struct peer_allreduce peer_allreduce;

typedef struct peer_allreduce_config {
    uv_loop_t *loop;
    const dht_identity *self;
    const uint8_t *swarm_key;      /* 32 bytes or NULL */
    peer_allreduce_server *srv;    /* our side of the round (borrowed) */
    int block;                     /* the service's block index */
    const char *block_name;
    uint64_t round;
    const uint8_t *digest;         /* PEER_AVG_DIGEST_LEN bytes naming the group */
    const peer_allreduce_member *members; /* sorted; includes us */
    int n;                         /* 2..PEER_ALLREDUCE_MAX_MEMBERS */
    int me;                        /* our index in members */
    int with_optim;                /* average m and v too (mean mode) */
    peer_avg_method method;        /* zeros: PEER_AVG_MEAN */
    double timeout_s;              /* the whole round */
    peer_allreduce_cb cb;
    void *arg;
} peer_allreduce_config;

/* Begins the round (freezing our base). Returns 0 and *out (cb runs exactly
 * once later), or a negative errno (cb never runs, nothing changed). */
int peer_allreduce_start(const peer_allreduce_config *cfg, peer_allreduce **out);

/* Abandons the round now (cb runs later with -ECANCELED, unless the
 * round already succeeded). */
void peer_allreduce_cancel(peer_allreduce *ar);

/* The group digest: BLAKE2b-128 over "starling.avg.v1", the round and the
 * sorted member IDs, each followed by a byte the caller chooses (the
 * optimizer kind), then, for any mode but PEER_AVG_MEAN, one byte with the
 * mode (so mean digests stay those of peers that predate the modes, and
 * the longer input cannot equal a mean group's). Slices in f32. */
void peer_allreduce_digest(uint8_t out[PEER_AVG_DIGEST_LEN], uint64_t round,
                           const uint8_t (*ids)[DHT_ID_LEN], const uint8_t *tags, int n, int mode);
/* The same for slices in format fmt (q8: block, 0 meaning the default):
 * f32 gives peer_allreduce_digest's (what peers that predate the formats
 * compute); any other format appends the mode byte (even for mean), the
 * format byte and, for q8, the block (u16 LE), so no two (mode, format)
 * pairs hash the same input. */
void peer_allreduce_digest_fmt(uint8_t out[PEER_AVG_DIGEST_LEN], uint64_t round,
                               const uint8_t (*ids)[DHT_ID_LEN], const uint8_t *tags, int n, int mode, int fmt,
                               int block);

/* ---- The robust reduce (pure; exposed for tests and benchmarks) ----
 *
 * Why this rule: the plain weighted mean lets one member move the result
 * anywhere (zeros, 1e30, NaN, huge optimizer moments). The rule is one
 * step of CenteredClip (Karimireddy et al. 2021, as in hivemind's robust
 * averaging) started at the coordinate-wise median, with the clipping
 * radius taken from the data; it is the weighted mean whenever nobody is
 * clipped, so honest rounds lose nothing, and costs a few passes over the
 * part. Per segment of the flat state (parameters, m, v: their scales
 * differ by orders of magnitude, so a distance over the mix would let the
 * moments be blown up unseen), over the members with a positive weight
 * and finite values (m of them):
 *   c   = the coordinate-wise median of their values (mean of the two
 *         middle ones for even m);
 *   d_j = the L2 distance of member j's values to c;
 *   tau = PEER_ALLREDUCE_CLIP_FACTOR * median(d_j);
 *   y_j = c + min(1, tau / d_j) (x_j - c)        (clipped when d_j > tau);
 *   out = sum w_j y_j / sum w_j.
 * Guarantee: with f < m/2 hostile members (any values, any weights), c
 * lies coordinate by coordinate between the honest members' smallest and
 * largest value, so |c - mu| <= D, and tau <= FACTOR * D, where mu is the
 * honest members' weighted mean and D the L2 norm of the honest
 * coordinate-wise range (max - min) in that segment: |out - mu| <= (1 +
 * FACTOR) D, however large the hostile values or weights. When no honest
 * member is clipped, |out - mu| <= (W_bad / W) (1 + FACTOR) D, with W_bad /
 * W the hostile share of the weight. With m <= 2 there is no majority to
 * tell who is right: the result is the weighted mean of the finite
 * contributions. Weight-0 members (initial weights) neither count nor vote. */
#ifndef PEER_ALLREDUCE_CLIP_FACTOR
#define PEER_ALLREDUCE_CLIP_FACTOR 4.0
#endif

typedef struct peer_robust_stats {
    uint32_t dropped;              /* bit j: x[j] held a non-finite value */
    uint32_t clipped;              /* bit j: x[j] was clipped in some segment */
    double max_ratio;              /* the largest d_j / median(d) seen (diagnostic) */
} peer_robust_stats;

/* Reduces the contributions x[0..n) (each len floats, or NULL: left out)
 * with weights w[0..n) (finite, >= 0) into out (len floats) by the rule
 * above. The values are a slice starting at offset `off` of a flat vector
 * whose segments are `seg` floats long (segments start at multiples of
 * seg; 0: one segment). n <= PEER_ALLREDUCE_MAX_MEMBERS. st may be NULL.
 * Returns 0; -ENODATA when no member has a positive weight (nothing to
 * average; out untouched); -ERANGE when every member with a positive
 * weight was dropped; -EINVAL. Allocates nothing. */
int peer_allreduce_robust_mean(const float *const *x, const double *w, int n, size_t len, size_t off,
                               size_t seg, float *out, peer_robust_stats *st);


/* ---- Checking the parts other members reduced ----
 *
 * Each member reduces one part and the others adopt it, so a hostile
 * member could publish anything finite for its own part. Before applying,
 * a member with a positive weight checks every other member's part, piece
 * by piece (a piece: the part's coordinates within one segment: parameters,
 * m or v), by how far it moves the member's own values: r = |avg - own| /
 * |own| and the cosine between (avg - own) and own. A part is rejected,
 * and the member keeps its own values for it (as if that slice were not
 * averaged), when a piece
 *   - moves it more than PEER_ALLREDUCE_PART_FACTOR times the segment's
 *     reference + PEER_ALLREDUCE_PART_FLOOR, the reference being the
 *     median r over the segment's pieces when there are three or more, and
 *     at least the member's own piece's r (it reduced that one itself);
 *   - moves it more than twice as far as the member's own part does (in
 *     its most moved piece: a member far from the group is moved far by
 *     every part) and either more than PEER_ALLREDUCE_PART_MAX_PARAMS
 *     (parameters) or PEER_ALLREDUCE_PART_MAX_MOMENTS (m, v) relative, or
 *     (parameters and v) by half or more, toward zero or away from it
 *     along its own values (|cosine| >= 0.9): zeroed or scaled.
 * Honest parts move a member about as far as each other (the members'
 * differences are spread over all coordinates) and in no particular
 * direction, so honest rounds reject nothing; a part of zeros, a scaled
 * part or a blown-up part is rejected. Guarantee: whatever a hostile
 * reducer publishes, an honest member's values over that part move by at
 * most FACTOR x the segment's honest reference + FLOOR where there is a
 * reference, and by at most PART_MAX relative (or twice what its own part
 * moves it) in any case. A false
 * rejection costs only that slice's averaging for one round (logged). */
#ifndef PEER_ALLREDUCE_PART_FACTOR
#define PEER_ALLREDUCE_PART_FACTOR 10.0
#endif
#ifndef PEER_ALLREDUCE_PART_FLOOR
#define PEER_ALLREDUCE_PART_FLOOR 1e-3
#endif
#ifndef PEER_ALLREDUCE_PART_MAX_PARAMS
#define PEER_ALLREDUCE_PART_MAX_PARAMS 1.0
#endif
#ifndef PEER_ALLREDUCE_PART_MAX_MOMENTS
#define PEER_ALLREDUCE_PART_MAX_MOMENTS 20.0
#endif

/* avg and base: the whole flat vector (nflat floats), parts split by
 * peer_avg_part among n members, me = our index. Sets *rejected (bit j:
 * part j rejected; never our own). The vector is parameters, m, v when
 * nflat is three equal thirds, else one segment of parameters. Returns 0
 * or -EINVAL. */
int peer_allreduce_check_parts(const float *avg, const float *base, size_t nflat, int n, int me,
                               uint32_t *rejected);
/* The same with the number of segments given: 3 (parameters, m, v) or 1
 * (parameters, or a diloco round's pseudo-gradient). */
int peer_allreduce_check_parts_seg(const float *avg, const float *base, size_t nflat, int nseg, int n, int me,
                                   uint32_t *rejected);

#endif
