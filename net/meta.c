/* net/meta.c: the compute methods' meta bytes (see meta.h). */
#include "net/meta.h"

#include <errno.h>

#include "net/wire.h"

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
