/* peer/catchup.h: where a joining block's state comes from.
 *
 * Before a block serves, its state catches up with the swarm's. The
 * block's entries are read from the DHT (its holders' announcements,
 * swarm/announce.h, then the cold copies kept of it, peer/keeper.h), and
 * the block takes the newest of:
 *   1. an online holder's state: a random one of the trusted holders at
 *      most one version behind the newest (so newcomers spread over
 *      donors), when that is newer than ours or ours is the initial
 *      weights; holders are at least as new as any copy of them;
 *   2. when no holder is online, the cold copies newer than ours, newest
 *      first (a copy that cannot be had: the next one);
 *   3. its own checkpoint, or its initial weights.
 * A claimed version is only its announcer's word: a claim far above the
 * others' is ignored and said (peer_statesync_choose), and a downloaded
 * state far above the trusted claims is refused. When a newer version is
 * known to have existed (this node's own announcement from before a
 * restart, or a cold copy that could not be had) and the block starts
 * from an older one, the catch-up says STATE LOST and keeps the two
 * versions for the block's announcements (peer_catchup_lost).
 * --no-state-download keeps our own state, and still says what it loses.
 *
 * The choice of a source from the entries read is pure
 * (peer_catchup_read_holders, _read_keepers, _pick_holder, _next_copy);
 * peer_catchup does the lookups and downloads around it. Loop thread only.
 */
#ifndef PEER_CATCHUP_H
#define PEER_CATCHUP_H

#include <stdint.h>
#include <stdio.h>

#include <uv.h>

#include "dht/dht.h"
#include "swarm/announce.h"
#include "peer/service.h"

#define PEER_CATCHUP_MAX 16 /* holders and cold copies considered per block */

/* ---- The choice (pure) ---- */

/* What a joining block knows of its sources: its online holders, then its
 * cold copies, newest first. */
typedef struct peer_catchup_view {
    peer_announce cand[PEER_CATCHUP_MAX];       /* online holders (the first 16) */
    uint8_t ids[PEER_CATCHUP_MAX][DHT_ID_LEN];
    int nc, found;                              /* found: some holder is online */
    uint64_t best;                              /* newest trusted online version */
    uint64_t prev;                              /* what this node ID announced before it restarted (0: nothing) */
    uint8_t suspect[PEER_CATCHUP_MAX];          /* holders whose claim is far above the others' */
    peer_keep_record keep[PEER_CATCHUP_MAX];    /* cold copies, newest first */
    uint8_t kid[PEER_CATCHUP_MAX][DHT_ID_LEN];
    int nk, next_keep;                          /* copies found, the next one to try */
    uint8_t keep_suspect[PEER_CATCHUP_MAX];     /* copies whose claim is far above the others' */
    uint64_t known;                             /* the newest version known to have existed */
    uint64_t hold_max, keep_max;                /* a state downloaded from a holder (a copy) newer
                                                   than this is refused */
} peer_catchup_view;

/* Resets v and reads the entries found under the block's key (e[0..n),
 * borrowed): signed announcements of `block` with `stage_hash`. This
 * node's own entry (self) gives v->prev unless it was joining; the others
 * count when online. Sets the holders' suspect flags, hold_max and best. */
void peer_catchup_read_holders(peer_catchup_view *v, const dht_entry *e, size_t n,
                               const uint8_t self[DHT_ID_LEN], const char *block, uint64_t stage_hash);

/* Reads the entries found under the block's cold-copy key (e[0..n),
 * borrowed; read_holders first): signed records of a version above 0 from
 * other nodes, sorted newest first. Sets the copies' suspect flags,
 * keep_max, next_keep = 0 and known (v->prev, or the newest trusted copy
 * when it is newer and no holder is online). */
void peer_catchup_read_keepers(peer_catchup_view *v, const dht_entry *e, size_t n,
                               const uint8_t self[DHT_ID_LEN]);

/* A random trusted holder at most one version behind v->best, each
 * equally likely (reservoir sampling on *rng, a 64-bit LCG state that is
 * advanced once per eligible holder); -1 when none. */
int peer_catchup_pick_holder(const peer_catchup_view *v, uint64_t *rng);

/* The next trusted cold copy newer than `ours`, in v's order, or -1 when
 * none is left; advances v->next_keep past it (and past suspect copies). */
int peer_catchup_next_copy(peer_catchup_view *v, uint64_t ours);

/* ---- The catch-up ---- */

typedef struct peer_catchup_config {
    uv_loop_t *loop;
    dht *dht;
    const dht_identity *self;      /* borrowed: outlives the catch-up */
    const uint8_t *swarm_key;      /* 32 bytes or NULL; borrowed likewise */
    peer_service *svc;             /* borrowed likewise */
    int no_state_download;         /* keep our own state even if others have newer */
    FILE *log;
    /* Called once block i's holders are read, to announce it joining: only
     * then, so that a restarted peer first reads its own entry from before
     * (with the version it had) and the joining one replaces it after. */
    void (*joining)(void *arg, int block);
    /* Called when block i is settled (its state downloaded and installed,
     * or ours kept). Not called after peer_catchup_stop. */
    void (*done)(void *arg, int block);
    void *arg;
} peer_catchup_config;

typedef struct peer_catchup peer_catchup;

/* NULL when out of memory. Downloads pick holders with a seed taken from
 * cfg->self's node ID. */
peer_catchup *peer_catchup_create(const peer_catchup_config *cfg);

/* Catches block i up (one block at a time: call again from `done`).
 * Returns 0 (`done` runs later) or a negative errno, said in the log (the
 * block keeps its own state; `done` never runs). */
int peer_catchup_start(peer_catchup *c, int block);

/* The versions block i went back from and to (both 0: no state lost). */
void peer_catchup_lost(const peer_catchup *c, int block, uint64_t *from, uint64_t *to);

/* Stops: no more callbacks. cb runs once no state download can call back
 * (at once when none is in flight). DHT lookups may still call back until
 * the DHT is closed: free with peer_catchup_destroy only after that.
 * NULL-safe. */
void peer_catchup_stop(peer_catchup *c, void (*cb)(void *arg), void *arg);
void peer_catchup_destroy(peer_catchup **p);

#endif
