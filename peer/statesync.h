/* peer/statesync.h: a block's state download, both sides.
 *
 * The method (docs/rpc.md): state(block, meta = u64 snapshot id (0: take
 * a new snapshot) + u64 offset, both little-endian) -> one f32 tensor
 * (1, n) carrying up to PEER_STATE_CHUNK bytes of the block's serialized
 * state (parameters and optimizer state, the checkpoint format; zero
 * padded to whole floats), and meta = u64 snapshot id, u64 total bytes,
 * u64 weight version. A newcomer asks for offset 0 with id 0, then for
 * the following offsets with the id it got; if the snapshot was replaced
 * meanwhile the answer is ESTALE and it starts again. The serialized bytes
 * carry their own checksum and config hash, which the receiver verifies
 * when it installs them.
 *
 * The serving side (peer_statesync_server) answers the method for the
 * service's hosted blocks and, through a cold source, for the copies a
 * keeper holds (peer/keeper.h).
 *
 * The download: a newcomer connects to a donor (checking its node ID),
 * asks for the block's state snapshot chunk by chunk and hands the whole
 * byte string to the callback; the caller installs it with
 * peer_service_install_state, which verifies the checksum and the config
 * hash. A snapshot replaced mid-download (ESTALE) restarts once. Loop
 * thread only.
 */
#ifndef PEER_STATESYNC_H
#define PEER_STATESYNC_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "dht/identity.h"
#include "peer/service.h"

/* ---- The serving side ---- */

typedef struct peer_statesync_server peer_statesync_server;

/* Creates the state serving of svc's blocks and registers its
 * PEER_METHOD_STATE handler with svc (peer_service_set_handler): the
 * service owns the server from then on and frees it in
 * peer_service_destroy, so the caller never frees it. Returns NULL when
 * out of memory (nothing registered). */
peer_statesync_server *peer_statesync_server_create(peer_service *svc);

/* Cold copies (peer/keeper.h): a state request naming a block the service
 * does not host asks fn, which returns 0 with the serialized state
 * (borrowed: valid until control returns to the loop), its id (non-zero,
 * new whenever the copy is replaced) and weight version, or a negative
 * errno when it keeps no copy (the request then gets ENOENT). fn NULL:
 * none. Loop thread. */
typedef int (*peer_statesync_cold_fn)(void *arg, const char *block, const uint8_t **buf, size_t *len,
                                      uint64_t *id, uint64_t *version);
void peer_statesync_server_set_cold_source(peer_statesync_server *srv, peer_statesync_cold_fn fn, void *arg);

/* ---- The download ---- */

/* status 0: buf[0..len) is the donor's state at weight `version` (buf is
 * valid during the callback only). Otherwise a negative errno. */
typedef void (*peer_statesync_cb)(void *arg, int status, const uint8_t *buf, size_t len,
                                  uint64_t version);

/* Starts a download of `block` from the donor with node ID donor_id at
 * donor_addr ("HOST:PORT"). Returns 0 (cb runs exactly once later) or a
 * negative errno (cb never runs). timeout_s bounds each request. */
int peer_statesync_start(uv_loop_t *loop, const dht_identity *self, const uint8_t *swarm_key,
                         const uint8_t donor_id[DHT_ID_LEN], const char *donor_addr, const char *block,
                         double timeout_s, peer_statesync_cb cb, void *arg);

/* ---- Trust: holders' claims checked against their peers' ----
 *
 * A holder's announced weight version and throughput are its own word. An
 * attacker who announces version 10^9 would otherwise be every newcomer's
 * donor (newcomers take the newest state), and one who announces 10^9
 * samples/s every trainer's favourite replica. So a claim is checked
 * against what the other holders of the same stage claim: a weight version
 * is suspect when it is above PEER_TRUST_VERSION_FACTOR times the median
 * of the others' plus PEER_TRUST_VERSION_SLACK, a throughput when it is
 * above PEER_TRUST_TPUT_FACTOR times the median of the others'. The median
 * is the upper median (of 2 others, the larger), so one honest holder
 * that lags (it restarted from fresh weights) does not make its newer
 * peers suspect; claims of 0 (initial weights; unknown throughput) are
 * no evidence and are left out. Why 10x: replicas step at different
 * rates (a trainer sends each about its share of the stage's throughput,
 * and throughput is flagged only above 10x), and announcements lag by up
 * to a renewal period, so honest versions can differ by about as much;
 * the attack this stops claims 10^9. With no other claim there is nothing to
 * compare: the claim is trusted (trust on first use); and holders that
 * are the majority make their own claim the median (a Sybil majority
 * wins: docs/operations.md, "Trust"). Pure functions. */
#ifndef PEER_TRUST_VERSION_FACTOR
#define PEER_TRUST_VERSION_FACTOR 10
#endif
#ifndef PEER_TRUST_VERSION_SLACK
#define PEER_TRUST_VERSION_SLACK 256
#endif
#ifndef PEER_TRUST_TPUT_FACTOR
#define PEER_TRUST_TPUT_FACTOR 10.0
#endif

/* The upper median of the non-zero values among v[0..n) other than v[skip]
 * (skip < 0: none skipped); 0 when there is none. n <= 256 (more are
 * ignored). */
uint64_t peer_trust_median_u64(const uint64_t *v, int n, int skip);
/* The same for positive finite doubles; 0 when there is none. */
double peer_trust_median(const double *v, int n, int skip);

/* 1 when version[i] is far above the others' (see above), else 0. */
int peer_trust_version_suspect(const uint64_t *version, int n, int i);
/* 1 when tput[i] is far above the others' (see above), else 0. */
int peer_trust_tput_suspect(const double *tput, int n, int i);

/* A newcomer's choice among the versions n holders of its stage claim:
 * sets suspect[i] (1: ignore holder i, its claim is far above the
 * others'), and returns the largest version a downloaded state may have:
 * PEER_TRUST_VERSION_FACTOR times the largest trusted claim plus
 * PEER_TRUST_VERSION_SLACK (saturating), so a donor that announces a
 * plausible version and serves a state of version 10^9 is refused too,
 * even when it is the only holder; UINT64_MAX (no bound) when every
 * trusted claim is 0 (a young swarm whose announcements lag its first
 * steps). suspect may be NULL. With two holders whose claims differ more
 * than that, the higher one is ignored: there is no majority, and the
 * cost of believing a lagging honest holder (an older state, which
 * training and averaging bring forward) is smaller than that of believing
 * a poisoned one. */
uint64_t peer_statesync_choose(const uint64_t *version, int n, uint8_t *suspect);

#endif
