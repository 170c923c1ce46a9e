/* peer/rpc_conn.h: one TCP connection carrying a peer_channel (internal to
 * rpc_server.c and rpc_client.c; not part of peer.h).
 *
 * The connection runs the handshake, reassembles records and hands each
 * decoded message to its owner. Records are assembled in c->rec, a buffer the
 * owner may take (swap for another) inside on_message, so the server can keep
 * a request's bytes without copying them. Small records are gathered from a
 * 64 KiB staging buffer; the tail of a large record is read straight into
 * c->rec. Loop thread only.
 */
#ifndef PEER_RPC_CONN_H
#define PEER_RPC_CONN_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "peer/channel.h"
#include "peer/wire.h"

typedef struct peer__buf {
    uint8_t *p;
    size_t cap;
} peer__buf;

/* Grows b to at least n bytes (never shrinks). Returns 0 or -ENOMEM. */
int peer__buf_reserve(peer__buf *b, size_t n);
void peer__buf_free(peer__buf *b);

typedef struct peer__conn peer__conn;

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
};

#define PEER__STAGE_LEN 65536

/* Sets up c (caller-owned memory, zeroed here) on loop with a fresh channel.
 * Returns 0, -ENOMEM, or a libuv error. On failure nothing needs closing.
 * The first call sets SIGPIPE to ignored when its action is the default
 * (a peer resetting a connection must not kill the process). */
int peer__conn_init(peer__conn *c, uv_loop_t *loop, const peer_channel_config *cc, int initiator,
                    const peer__conn_ops *ops, void *owner, size_t max_frame);

/* Starts reading (and, as initiator, sends msg1). Returns 0 or a libuv error. */
int peer__conn_start(peer__conn *c);

/* Stops / resumes delivering messages (backpressure). Resuming first
 * delivers records already buffered. */
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
