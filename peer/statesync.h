/* peer/statesync.h: downloading a block's current state from a holder.
 *
 * A newcomer connects to a donor (checking its node ID), asks for the
 * block's state snapshot chunk by chunk (PEER_METHOD_STATE, see
 * peer/service.h) and hands the whole byte string to the callback; the
 * caller installs it with peer_service_install_state, which verifies the
 * checksum and the config hash. A snapshot replaced mid-download (ESTALE)
 * restarts once. Loop thread only.
 */
#ifndef PEER_STATESYNC_H
#define PEER_STATESYNC_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "dht/identity.h"

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

#endif
