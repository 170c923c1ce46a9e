/* net/stagecall.c: the stage-call protocol: its meta bytes and the
 * codec of requests and replies (net/stagecall.h). */
#include "net/stagecall.h"

#include <errno.h>

/* ---- meta ---- */

size_t peer_meta_versions_encode(uint8_t *buf, size_t cap, const uint64_t *v, int n)
{
    if (n < 0 || (n > 0 && (!buf || !v)) || (size_t)n > cap / PEER_META_U64_LEN)
        return 0;
    for (int i = 0; i < n; i++)
        peer_put_le64(buf + PEER_META_U64_LEN * (size_t)i, v[i]);
    return PEER_META_U64_LEN * (size_t)n;
}

int peer_meta_versions_decode(const void *meta, size_t len, uint64_t *v, int max)
{
    if (len == 0)
        return 0;
    if (!meta || len % PEER_META_U64_LEN != 0 || max < 0 || len / PEER_META_U64_LEN > (size_t)max || !v)
        return -EINVAL;
    int n = (int)(len / PEER_META_U64_LEN);
    for (int i = 0; i < n; i++)
        v[i] = peer_get_le64((const uint8_t *)meta + PEER_META_U64_LEN * (size_t)i);
    return n;
}

size_t peer_meta_at_version_encode(uint8_t buf[PEER_META_U64_LEN], uint64_t version)
{
    peer_put_le64(buf, version);
    return PEER_META_U64_LEN;
}

int peer_meta_at_version_decode(const void *meta, size_t len, uint64_t *version_out)
{
    if (len == 0)
        return 0;
    if (!meta || len != PEER_META_U64_LEN)
        return -EINVAL;
    if (version_out)
        *version_out = peer_get_le64(meta);
    return 1;
}

size_t peer_meta_span_encode(uint8_t buf[PEER_META_U64_LEN], int span)
{
    if (span <= 1)
        return 0;
    peer_put_le64(buf, (uint64_t)span);
    return PEER_META_U64_LEN;
}

int peer_meta_span_decode(const void *meta, size_t len, int max, int *span_out)
{
    uint64_t v = 1;
    if (len != 0) {
        if (!meta || len != PEER_META_U64_LEN)
            return -EINVAL;
        v = peer_get_le64(meta);
    }
    if (v < 1 || max < 1 || v > (uint64_t)max)
        return -EINVAL;
    if (span_out)
        *span_out = (int)v;
    return 0;
}

/* ---- the stage call ---- */

int peer_stagecall_encode(peer_msg *m, uint8_t meta_buf[PEER_META_U64_LEN], const peer_stagecall *c)
{
    size_t half = c->scratch_cap / 2;
    int tokens = c->exact_inputs;
    int rc = peer_tensor_rows_as(&m->t[0], c->x, c->rows, c->nin, c->rin, tokens ? PEER_DTYPE_F32 : c->fmt,
                                 tokens ? 0 : c->block, 0, 0, c->scratch, half);
    m->n_tensors = 1;
    m->meta = NULL;
    m->meta_len = 0;
    if (rc == 0 && c->dy) {
        rc = peer_tensor_rows_as(&m->t[1], c->dy, c->rows, c->nout, c->rout, c->fmt, c->block, 1, c->sr_seed,
                                 c->scratch ? c->scratch + half : NULL, half);
        m->n_tensors = 2;
        if (c->at_version_known)
            m->meta_len = peer_meta_at_version_encode(meta_buf, c->at_version);
    } else if (rc == 0)
        m->meta_len = peer_meta_span_encode(meta_buf, c->span);
    if (m->meta_len)
        m->meta = meta_buf;
    m->reply_dtype = c->fmt;
    m->reply_block = c->block;
    return rc;
}

int peer_stagecall_reply_rows(const peer_msg *m, int nrow, const uint64_t *row, uint64_t rows, float *out,
                              size_t cap)
{
    uint64_t got = 0;
    if (m->n_tensors != 1 || !peer_tensor_is_rows(&m->t[0], nrow, row, rows, &got) || got != rows ||
        (out && peer_tensor_to_f32(&m->t[0], out, cap) != 0))
        return -EBADMSG;
    return 0;
}
