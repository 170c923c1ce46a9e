/* net/rpc_server.h: the tensor RPC server on libuv TCP.
 *
 * The server accepts connections, runs the channel handshake (net/channel.h)
 * as responder, decodes requests (net/wire.h) and hands each to the user's
 * handler on the loop thread. The handler answers later, exactly once, with
 * peer_rpc_respond or peer_rpc_respond_error, from the loop thread or from any
 * other thread (a worker computing the block): off-loop replies are encoded
 * on the calling thread and handed to the loop through an eventfd the loop
 * polls (net/wake.h).
 *
 * The server answers by itself, without calling the handler: a frame that
 * decodes to garbage or is not a request (EBADMSG); an oversize frame
 * (EMSGSIZE, then it closes the connection, since it cannot skip the record
 * without its bytes). A forged record or a failed handshake closes the
 * connection at once. Each connection holds at most max_inflight requests
 * the handler has not answered, and all unanswered requests together hold at
 * most about max_held_bytes of frames (so a few clients pipelining huge
 * frames cannot make the server allocate without bound); beyond either the
 * server stops reading (TCP backpressure) until answers go out.
 *
 * Hostile clients (docs/rpc.md, "Limits"): the server bounds what a stranger
 * can hold. At accept, before any handshake, it counts connections per
 * address (IPv4 address, IPv6 /64): beyond max_conns_per_ip the newcomer is
 * closed. When max_conns connections or max_handshakes unfinished handshakes
 * are open, it closes one connection of the address that holds the most
 * (handshaking and idle ones first) if that address holds more than the
 * newcomer's would, else it closes the newcomer: a flood from a few
 * addresses costs those addresses, not newcomers. A handshake must finish
 * within handshake_timeout_ms; an established connection with no request in
 * flight, or whose replies stopped draining, is closed after
 * idle_timeout_ms without a request or a finished reply (a request already
 * in the socket buffer keeps it open). Records being received are charged
 * their whole length against max_incomplete_bytes (all connections
 * together) and max_incomplete_per_ip (the connections of one address); a
 * record that does not fit waits, its connection not read, until others
 * complete; a record must arrive whole within record_timeout_ms (plus
 * 250 ms per MiB) of its length prefix, else its connection is closed.
 * Replies handed to the socket and not yet written count against
 * max_queued_bytes per connection; at that bound the connection's requests
 * are not read, so a client that pipelines and never reads holds at most
 * max_queued_bytes plus the replies to the requests already taken (at most
 * max_inflight). When all connections together reach max_queued_total, only
 * the connections of addresses holding at least an equal share of it (the
 * total over the addresses with replies queued) stop being read, and the
 * connection holding the most is closed once it has made no write progress
 * for a quarter of drain_timeout_ms. Any connection whose queued replies
 * make no write progress for drain_timeout_ms is closed. Buffers of answered requests are kept for reuse up to
 * max_held_bytes / 4 all together, and a connection idle for a second gives
 * its buffers back.
 *
 * Thread-safety: everything runs on the loop thread except peer_rpc_respond*
 * and peer_rpc_request_* getters, which may be called from any thread for a
 * request that has not yet been answered.
 */
#ifndef NET_RPC_SERVER_H
#define NET_RPC_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "dht/identity.h"
#include "net/wire.h"

typedef struct peer_rpc_server peer_rpc_server;
typedef struct peer_rpc_request peer_rpc_request;

/* Called on the loop thread for each request. msg (and its tensors, which
 * live in the request's own receive buffer) stays valid until the request is
 * answered, so a worker may read the inputs in place. */
typedef void (*peer_rpc_handler)(peer_rpc_request *req, const peer_msg *msg, void *arg);

typedef struct peer_rpc_server_config {
    const dht_identity *self;       /* required; copied */
    const uint8_t *swarm_key;       /* 32 bytes or NULL; copied */
    int plaintext;                  /* benchmarks only: must match the clients */
    int no_aes;                     /* do not offer AES-GCM (tests) */
    size_t max_frame;               /* largest message; 0 = 256 MiB */
    int max_inflight;               /* unanswered requests per connection; 0 = 64 */
    size_t max_held_bytes;          /* request bytes held by unanswered requests, all
                                       connections together; 0 = 1 GiB */
    int max_conns;                  /* 0 = 1024; see the header comment for who is closed */
    uint64_t handshake_timeout_ms;  /* 0 = 5000 */
    int max_conns_per_ip;           /* per IPv4 address or IPv6 /64; 0 = 64 */
    int max_handshakes;             /* unfinished handshakes; 0 = 64 */
    uint64_t idle_timeout_ms;       /* established, nothing happening; 0 = 120000 */
    size_t max_incomplete_bytes;    /* records being received, all connections; 0 = 256 MiB */
    size_t max_queued_bytes;        /* replies not yet written, per connection; 0 = 16 MiB */
    size_t max_queued_total;        /* replies not yet written, all connections; 0 = 256 MiB.
                                       At the bound only addresses holding an equal share
                                       or more are not read */
    size_t max_incomplete_per_ip;   /* records being received, per address;
                                       0 = max_incomplete_bytes / 4 */
    uint64_t record_timeout_ms;     /* a record must arrive within this (+250 ms per MiB)
                                       of its length prefix; 0 = 30000 */
    uint64_t drain_timeout_ms;      /* queued replies with no write progress; 0 = 30000 */
    peer_rpc_handler handler;       /* required */
    void *arg;
} peer_rpc_server_config;

typedef struct peer_rpc_server_stats {
    uint64_t conns_accepted, conns_open, handshakes_failed; /* failed includes timed out */
    uint64_t requests, replies, bad_frames, oversize_frames;
    /* Connections refused or closed by the limits, per reason (counters). */
    uint64_t refused_per_ip;        /* at accept: its address had max_conns_per_ip */
    uint64_t refused_full;          /* at accept: max_conns open, no address holds more */
    uint64_t refused_handshakes;    /* at accept: max_handshakes running, none to take */
    uint64_t evicted;               /* closed to make room for a newcomer's address */
    uint64_t closed_hs_timeout;     /* handshake unfinished after handshake_timeout_ms */
    uint64_t closed_idle;           /* idle (or replies not draining) for idle_timeout_ms */
    uint64_t record_waits;          /* records that waited for max_incomplete_bytes */
    uint64_t closed_drain;          /* replies made no write progress for drain_timeout_ms
                                       (or a quarter of it, holding the most at the total) */
    uint64_t closed_record_timeout; /* a record unfinished after record_timeout_ms */
    /* Gauges (now) and their high-water marks. */
    uint64_t handshaking;
    uint64_t incomplete_bytes, incomplete_bytes_max;
    uint64_t queued_bytes, queued_bytes_max;
} peer_rpc_server_stats;

/* Call on the thread that runs loop: the server remembers it to tell loop
 * replies from worker replies. Returns NULL on bad arguments or no memory. */
peer_rpc_server *peer_rpc_server_create(uv_loop_t *loop, const peer_rpc_server_config *cfg);

/* Binds and listens. Returns 0 or a libuv error (negative errno). */
int peer_rpc_server_listen(peer_rpc_server *srv, const struct sockaddr *addr);

/* The port bound by listen (useful after binding port 0), or -1. */
int peer_rpc_server_port(const peer_rpc_server *srv);

/* The server's counters and gauges since start (connections refused and
 * closed by each limit, bytes held). Loop thread. */
void peer_rpc_server_get_stats(const peer_rpc_server *srv, peer_rpc_server_stats *out);

/* Answers req with reply's tensors, meta and block (kind and id are set by
 * the server). Tensor bytes are copied before this returns, so the caller
 * may free them. reply may be NULL for an empty reply. Returns 0, or
 * -EINVAL (reply malformed: the client gets EIO instead) or -ENOMEM (the
 * request is dropped and the client times out). Either way req is gone. */
int peer_rpc_respond(peer_rpc_request *req, const peer_msg *reply);

/* Answers req with an error (code: a positive errno, see wire.h). */
int peer_rpc_respond_error(peer_rpc_request *req, int code, const char *message);

/* The caller's node ID (DHT_ID_LEN bytes), valid until req is answered. */
const uint8_t *peer_rpc_request_peer_id(const peer_rpc_request *req);

/* Stops listening and closes every connection. close_cb runs on the loop
 * once every handle is closed, which waits for every request already handed
 * to the handler to be answered (their replies are dropped). */
void peer_rpc_server_stop(peer_rpc_server *srv, void (*close_cb)(peer_rpc_server *, void *),
                           void *arg);

/* Frees a server that was never listened on or whose close_cb has run.
 * Accepts NULL; sets *p = NULL. */
void peer_rpc_server_destroy(peer_rpc_server **p);

#endif
