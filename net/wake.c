/* net/wake.c: eventfd-based loop wake-up (see wake.h). */
#include <errno.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "net/wake.h"

static void on_readable(uv_poll_t *p, int status, int events)
{
    (void)events;
    peer__wake *w = p->data;
    uint64_t n;
    ssize_t r;
    do
        r = read(w->fd, &n, sizeof n);
    while (r < 0 && errno == EINTR);
    /* EAGAIN: nothing to read (a spurious wake-up); cb finds nothing to
     * do. status < 0 (a poll error) does not happen for an eventfd. */
    (void)status;
    w->cb(w);
}

int peer__wake_init(peer__wake *w, uv_loop_t *loop, peer__wake_cb cb, void *data)
{
    w->cb = cb;
    w->closed = NULL;
    w->data = data;
    w->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->fd < 0)
        return -errno;
    int rc = uv_poll_init(loop, &w->poll, w->fd);
    if (rc == 0) {
        w->poll.data = w;
        /* On failure the handle exists: the caller closes it (wake.h). */
        return uv_poll_start(&w->poll, UV_READABLE, on_readable);
    }
    close(w->fd);
    w->fd = -1;
    return rc;
}

void peer__wake_send(peer__wake *w)
{
    int saved = errno;
    uint64_t one = 1;
    ssize_t r;
    do
        r = write(w->fd, &one, sizeof one);
    while (r < 0 && errno == EINTR);
    /* EAGAIN means the counter is at its maximum: a wake-up is pending. */
    errno = saved;
}

static void on_closed(uv_handle_t *h)
{
    peer__wake *w = h->data;
    close(w->fd);
    w->fd = -1;
    if (w->closed)
        w->closed(w);
}

void peer__wake_close(peer__wake *w, peer__wake_cb closed)
{
    if (uv_is_closing((uv_handle_t *)&w->poll))
        return;
    w->closed = closed;
    uv_close((uv_handle_t *)&w->poll, on_closed);
}

int peer__wake_is_closing(const peer__wake *w)
{
    return uv_is_closing((const uv_handle_t *)&w->poll);
}
