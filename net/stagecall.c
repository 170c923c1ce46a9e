/* net/stagecall.c: the stage-call codec (net/stagecall.h). */
#include "net/stagecall.h"

#include <errno.h>

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
