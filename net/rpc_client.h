/* net/rpc_client.h: one tensor RPC connection to one peer (libuv TCP).
 *
 * The client connects, runs the channel handshake as initiator and refuses a
 * server whose ed25519 key does not hash to the expected node ID. Requests
 * are pipelined: each gets an id, a timeout and a callback; replies may come
 * in any order. When the connection fails, every pending request's callback
 * runs with the error. At most max_pending requests may be outstanding;
 * peer_rpc_call returns -EAGAIN beyond that (backpressure to the caller).
 * Reply buffers are reused, so steady traffic with repeated shapes does not
 * allocate.
 *
 * Thread-safety: loop thread only. Callbacks may issue new calls or close
 * the client.
 */
#ifndef NET_RPC_CLIENT_H
#define NET_RPC_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "dht/identity.h"
#include "net/channel.h"
#include "net/wire.h"

typedef struct peer_rpc_client peer_rpc_client;

/* status 0: the handshake succeeded. Otherwise a negative errno: -EPERM
 * (wrong node ID), -EACCES (swarm key mismatch), -EBADMSG (tampered),
 * -EPROTO, -ECONNREFUSED, -ECONNRESET, -ETIMEDOUT, ... */
typedef void (*peer_rpc_connect_cb)(peer_rpc_client *cl, int status, void *arg);

/* status 0: reply is the answer (kind PEER_KIND_REPLY, or PEER_KIND_ERROR
 * with err_code/err_msg); it and its tensors are valid for the duration of
 * the callback only. Otherwise reply is NULL and status is -ETIMEDOUT, the
 * connection's error, or -ECANCELED (client closed). */
typedef void (*peer_rpc_reply_cb)(void *arg, int status, const peer_msg *reply);

typedef struct peer_rpc_client_config {
    const dht_identity *self;       /* required; copied */
    const uint8_t *expect_id;       /* DHT_ID_LEN bytes, or NULL to accept any server; copied */
    const uint8_t *swarm_key;       /* 32 bytes or NULL; copied */
    int plaintext;                  /* benchmarks only: must match the server */
    int no_aes;
    size_t max_frame;               /* largest message either way; 0 = 256 MiB */
    int max_pending;                /* outstanding requests; 0 = 256 */
    uint64_t connect_timeout_ms;    /* TCP connect + handshake; 0 = 5000 */
    const struct sockaddr *local_addr; /* bind here before connecting (a source address
                                          on a multi-homed host; tests: 127.0.0.2), or
                                          NULL; copied */
} peer_rpc_client_config;

/* Returns NULL on bad arguments or no memory. */
peer_rpc_client *peer_rpc_client_create(uv_loop_t *loop, const peer_rpc_client_config *cfg);

/* Connects and handshakes; cb runs exactly once if this returns 0. Returns
 * 0, -EINVAL (called twice) or a libuv error (cb is then not called). */
int peer_rpc_client_connect(peer_rpc_client *cl, const struct sockaddr *addr,
                            peer_rpc_connect_cb cb, void *arg);

/* Sends req (kind is forced to request; its id is assigned here). Tensor
 * bytes are copied before return. timeout_ms 0 means none. On success
 * returns 0, stores the id in *id_out (if not NULL), and cb runs exactly
 * once later. Otherwise returns -ENOTCONN (not connected or failed),
 * -EAGAIN (max_pending reached), -EINVAL (malformed req), -EMSGSIZE or
 * -ENOMEM, and cb is not called. */
int peer_rpc_call(peer_rpc_client *cl, const peer_msg *req, uint64_t timeout_ms,
                  peer_rpc_reply_cb cb, void *arg, uint64_t *id_out);

/* Requests outstanding. */
int peer_rpc_client_pending(const peer_rpc_client *cl);

/* The server's node ID once connected (DHT_ID_LEN bytes), else NULL. */
const uint8_t *peer_rpc_client_peer_id(const peer_rpc_client *cl);

/* The negotiated record protection once connected (PEER_CIPHER_NONE in
 * plaintext mode or before the handshake). */
peer_cipher peer_rpc_client_cipher(const peer_rpc_client *cl);

/* Fails pending requests with -ECANCELED, closes every handle; close_cb
 * runs on the loop when done. Idempotent. */
void peer_rpc_client_stop(peer_rpc_client *cl, void (*close_cb)(peer_rpc_client *, void *),
                           void *arg);

/* Frees a client on which connect was never called, or whose close_cb has
 * run (after any connect attempt, failed ones included, close first).
 * Accepts NULL; sets *p = NULL. */
void peer_rpc_client_destroy(peer_rpc_client **p);

#endif
