/* net/wake.h: wakes a libuv loop from another thread without uv_async_t.
 *
 * libuv 1.44's uv_async_send marks the handle busy, writes the loop's
 * eventfd, then marks it done; the loop thread spins (997 pauses, then
 * sched_yield, again) while it sees the handle busy. When the write wakes the
 * loop thread onto the sender's CPU and preempts the sender between the two
 * marks, which happens often with more busy threads than cores, the loop
 * burns its time slice spinning (2 % of all CPU in a 3-peer training swarm
 * on 2 cores, `perf`). Here a sender only writes an eventfd, which the loop
 * polls: no shared busy state, so nothing to spin on. Several sends before
 * the loop runs coalesce into one callback, as with uv_async_t.
 *
 * Linux only (eventfd). The loop-side calls (init, close) belong to the loop
 * thread; peer__wake_send may be called from any thread, any number of
 * times, but the owner must make sure that no send can start once it calls
 * peer__wake_close (the eventfd is closed after that, and its number may be
 * reused). rpc_server closes its wake-up only after every connection, and so
 * every request a worker could still answer, is gone.
 */
#ifndef NET_WAKE_H
#define NET_WAKE_H

#include <uv.h>

typedef struct peer__wake peer__wake;
typedef void (*peer__wake_cb)(peer__wake *w);

struct peer__wake {
    uv_poll_t poll;      /* poll.data == this */
    int fd;              /* the eventfd, -1 when closed */
    peer__wake_cb cb;    /* on the loop thread after one or more sends */
    peer__wake_cb closed;
    void *data;          /* the owner's */
};

/* Opens the eventfd and starts polling it. Returns 0, or a negative errno /
 * libuv error. After an error w->fd is -1 and nothing is left open, except
 * when the poll handle was made but could not be started: then w->fd stays
 * >= 0 and the caller must still close w with peer__wake_close. */
int peer__wake_init(peer__wake *w, uv_loop_t *loop, peer__wake_cb cb, void *data);

/* Any thread: makes the loop call cb soon. Async-signal-safe (one write;
 * errno is preserved). */
void peer__wake_send(peer__wake *w);

/* Loop thread: stops polling, closes the handle, then the eventfd, then calls
 * closed (may be NULL); after that w must not be used. No send may start
 * after this call (see above). Closing twice is a no-op. */
void peer__wake_close(peer__wake *w, peer__wake_cb closed);

/* Whether peer__wake_close has been called. */
int peer__wake_is_closing(const peer__wake *w);

#endif
