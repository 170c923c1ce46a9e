/* capi/common.c: what every file of capi/ uses (capi/capi_internal.h):
 * sentences into the caller's err, JSON text, and jobs handed from the API
 * caller's thread to the loop thread. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capi/capi_internal.h"

int capi_err(char *err, size_t err_len, int rc, const char *fmt, ...)
{
    if (err && err_len > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_len, fmt, ap);
        va_end(ap);
    }
    return rc;
}

/* ---- JSON text ---- */

void capi_buf_printf(capi_buf *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if (b->p && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap * 2 : 1024;
        while (cap <= b->len + (size_t)n)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
}

/* Length of the valid UTF-8 sequence at c (1..4), or 0 when it is not one
 * (stray continuation, overlong, surrogate, beyond U+10FFFF, truncated). */
static int utf8_len(const unsigned char *c)
{
    int n = c[0] >= 0xf0 ? 4 : c[0] >= 0xe0 ? 3 : c[0] >= 0xc2 ? 2 : 0;
    if (n == 0 || c[0] > 0xf4)
        return 0;
    for (int i = 1; i < n; i++)
        if ((c[i] & 0xc0) != 0x80)
            return 0;
    if ((n == 3 && c[0] == 0xe0 && c[1] < 0xa0) || (n == 3 && c[0] == 0xed && c[1] >= 0xa0) ||
        (n == 4 && c[0] == 0xf0 && c[1] < 0x90) || (n == 4 && c[0] == 0xf4 && c[1] >= 0x90))
        return 0;
    return n;
}

/* s as a JSON string. Peers' strings are bytes: a byte that is not part of
 * valid UTF-8 becomes U+FFFD, so the document always decodes. */
void capi_buf_json_str(capi_buf *b, const char *s)
{
    capi_buf_printf(b, "\"");
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') {
            capi_buf_printf(b, "\\%c", *c);
        } else if (*c < 0x20 || *c == 0x7f) {
            capi_buf_printf(b, "\\u%04x", *c);
        } else if (*c < 0x80) {
            capi_buf_printf(b, "%c", *c);
        } else {
            int n = utf8_len(c);
            if (n == 0) {
                capi_buf_printf(b, "\\ufffd");
            } else {
                capi_buf_printf(b, "%.*s", n, (const char *)c);
                c += n - 1;
            }
        }
    }
    capi_buf_printf(b, "\"");
}

int capi_buf_take(capi_buf *b, char **out, char *err, size_t err_len)
{
    if (b->oom || !b->p) {
        free(b->p);
        *b = (capi_buf){0};
        return capi_err(err, err_len, -ENOMEM, "out of memory");
    }
    *out = b->p;
    *b = (capi_buf){0};
    return 0;
}

/* ---- jobs ---- */

int capi_run(starling_swarm *s, capi_job *j)
{
    j->s = s;
    j->done = 0;
    j->rc = 0;
    j->next = NULL;
    pthread_mutex_lock(&s->lock);
    if (s->closing) {
        pthread_mutex_unlock(&s->lock);
        return capi_err(j->err, j->err_len, -ECANCELED, "the swarm handle is closed");
    }
    s->waiters++;
    if (s->queue_tail)
        s->queue_tail->next = j;
    else
        s->queue = j;
    s->queue_tail = j;
    uv_async_send(&s->wake);
    while (!j->done)
        pthread_cond_wait(&s->cond, &s->lock);
    int rc = j->rc;
    if (--s->waiters == 0 && s->closing)
        pthread_cond_broadcast(&s->cond); /* starling_swarm_close waits for this */
    pthread_mutex_unlock(&s->lock);
    return rc;
}

void capi_done(capi_job *j, int rc)
{
    starling_swarm *s = j->s;
    if (!s) { /* run on the API caller's thread: no one waits */
        j->rc = rc;
        j->done = 1;
        return;
    }
    pthread_mutex_lock(&s->lock);
    j->rc = rc;
    j->done = 1;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->lock);
}
