/* net/rpc_conn.h: one TCP connection carrying a peer_channel (internal to
 * rpc_server.c and rpc_client.c; not part of peer.h).
 *
 * The connection runs the handshake, reassembles records and hands each
 * decoded message to its owner. Records are assembled in c->rec, a buffer the
 * owner may take (swap for another) inside on_message, so the server can keep
 * a request's bytes without copying them. Small records are gathered from a
 * 64 KiB staging buffer; the tail of a large record is read straight into
 * c->rec. Loop thread only.
 */
#ifndef NET_RPC_CONN_H
#define NET_RPC_CONN_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "net/channel.h"
#include "net/wire.h"

typedef struct peer__buf {
    uint8_t *p;
    size_t cap;
} peer__buf;

/* Grows b to at least n bytes (never shrinks). Returns 0 or -ENOMEM. */
int peer__buf_reserve(peer__buf *b, size_t n);
void peer__buf_free(peer__buf *b);

typedef struct peer__conn peer__conn;

/* Bytes of records being received, shared by the connections of one server
 * (so many half-sent records cannot add up to unbounded memory). A record is
 * charged its whole length when its length prefix arrives and released when
 * it is complete or the connection dies. A record that does not fit waits:
 * its connection stops reading (c->budget_wait) until the owner resumes it,
 * which it should try whenever used drops. A record is always admitted when
 * nothing else is charged, so a cap below one frame cannot wedge a server.
 * Connections may also belong to a group (the server's per-address count,
 * peer__conn_set_group): a group holds at most group_cap, except that a
 * group holding nothing may always begin one record that fits the total. */
typedef struct peer__budget {
    size_t used, cap;
    size_t group_cap;              /* most one group may hold (0: no group limit) */
    size_t high;                   /* high-water mark of used */
    uint64_t waits;                /* records that had to wait */
    int waiters;                   /* connections waiting now */
} peer__budget;

/* Sets SIGPIPE to ignored when its action is the default, once per process.
 * libuv writes with write(2), which raises SIGPIPE on a reset socket, and the
 * default action kills: every module that writes to a socket a stranger can
 * reset calls this before its first write. */
void peer__ignore_sigpipe(void);

typedef struct peer__conn_ops {
    /* The handshake succeeded. */
    void (*on_established)(peer__conn *c);
    /* A record arrived and was opened. rc is 0 and m the decoded message
     * (borrowing c->rec), or rc is the decoder's -EBADMSG/-EMSGSIZE and m
     * is NULL. */
    void (*on_message)(peer__conn *c, const peer_msg *m, int rc);
    /* The connection failed (handshake refused, forged record, EOF, read
     * error, or an oversize record: -EMSGSIZE). Reading has stopped; the
     * owner closes the connection. Called at most once. */
    void (*on_error)(peer__conn *c, int err);
} peer__conn_ops;

struct peer__conn {
    uv_tcp_t tcp;                  /* first member: the handle's data is the conn */
    peer_channel *ch;
    const peer__conn_ops *ops;
    void *owner;
    peer_wire_limits lim;
    uint8_t hs_in[PEER_CHANNEL_HS_MAX];
    size_t hs_have;
    uint8_t hs_out[2][PEER_CHANNEL_HS_MAX]; /* msg1/msg2 and msg3: at most two in flight */
    uv_write_t hs_wr[2];
    uint8_t hdr[PEER_CHANNEL_HDR_LEN];
    size_t hdr_have;
    peer__buf rec;                 /* the record being assembled */
    size_t rec_len, rec_have;
    int in_rec;
    uint8_t *stage;
    size_t stage_off, stage_len;
    int alloc_direct;
    int opening;                   /* streaming decryption of c->rec begun */
    int reading, paused, failed, closing;
    peer__budget *budget;          /* NULL: unbounded (clients) */
    size_t charged;                /* this record's charge in *budget */
    int budget_wait;               /* paused until the budget has room */
    size_t *group;                 /* the owner's per-group charge (an address), or NULL */
    uint64_t rec_start;            /* uv_now when the record being received was admitted */
};

#define PEER__STAGE_LEN 65536

/* The address a per-address limit counts: an IPv4 address (written as
 * ::ffff:a.b.c.d) or an IPv6 /64 (the block one subscriber usually holds;
 * the low 64 bits are zero). Anything else is all zeros. */
void peer__addr_key(const struct sockaddr *sa, uint8_t key[16]);

/* Sets up c (caller-owned memory, zeroed here) on loop with a fresh channel.
 * Returns 0, -ENOMEM, or a libuv error. On failure nothing needs closing.
 * The first call sets SIGPIPE to ignored when its action is the default
 * (a peer resetting a connection must not kill the process). */
int peer__conn_init(peer__conn *c, uv_loop_t *loop, const peer_channel_config *cc, int initiator,
                    const peer__conn_ops *ops, void *owner, size_t max_frame);

/* Charges this connection's records to b (call before start; NULL: none). */
void peer__conn_set_budget(peer__conn *c, peer__budget *b);

/* Also charges this connection's records to *group (NULL: no group). A
 * record already charged moves from the old group to the new one, so the
 * owner calls this with NULL before it frees the group's counter. */
void peer__conn_set_group(peer__conn *c, size_t *group);

/* Starts reading (and, as initiator, sends msg1). Returns 0 or a libuv error. */
int peer__conn_start(peer__conn *c);

/* Stops / resumes delivering messages (backpressure). Resuming first
 * delivers records already buffered; a connection waiting for the record
 * budget stays paused if the budget still has no room. */
void peer__conn_pause(peer__conn *c);
void peer__conn_resume(peer__conn *c);

/* Seals and writes one message. rec has room for the whole record
 * (PEER_CHANNEL_HDR_LEN + plain_len + PEER_CHANNEL_TAG_LEN); its first
 * head_len plaintext bytes are already at rec + PEER_CHANNEL_HDR_LEN. The
 * rest comes from m's tensors, encrypted straight from their memory (m may
 * be NULL when head_len == plain_len, i.e. all bytes are in place). Ready
 * ciphertext may go to the socket before this returns. wr's data must be
 * set by the caller; cb runs when the write ends (status < 0 on failure or
 * close). Returns 0 or a negative errno (then cb is not called, and the
 * connection has failed if the error came after bytes could have left). */
int peer__conn_send(peer__conn *c, uint8_t *rec, size_t head_len, const peer_msg *m,
                    size_t plain_len, uv_write_t *wr, uv_write_cb cb);

/* Closes the handle; close_cb (may be NULL) runs later. Frees the channel and
 * buffers in the close path. The memory of c stays the owner's. */
void peer__conn_close(peer__conn *c, uv_close_cb close_cb);

/* Releases buffers and the channel (call from the close callback). */
void peer__conn_free(peer__conn *c);

#endif
