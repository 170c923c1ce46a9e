#include "dht/mp.h"

#include <errno.h>
#include <math.h>
#include <string.h>

static int mp_write(void *data, const char *buf, size_t len)
{
    dht_mp_writer *w = data;
    if (w->overflow || len > w->cap - w->len) {
        w->overflow = 1;
        return -1;
    }
    memcpy(w->buf + w->len, buf, len);
    w->len += len;
    return 0;
}

void dht_mp_writer_init(dht_mp_writer *w, void *buf, size_t cap)
{
    w->buf = buf;
    w->cap = cap;
    w->len = 0;
    w->overflow = 0;
    msgpack_packer_init(&w->pk, w, mp_write);
}

long dht_mp_writer_finish(const dht_mp_writer *w)
{
    return w->overflow ? -EMSGSIZE : (long)w->len;
}

int dht_mp_pack_cstr(msgpack_packer *pk, const char *s)
{
    return msgpack_pack_str_with_body(pk, s, strlen(s));
}

void dht_mp_reader_init(dht_mp_reader *r, const void *buf, size_t len)
{
    r->p = buf;
    r->end = r->p + len;
}

static int r_byte(dht_mp_reader *r, uint8_t *b)
{
    if (r->p >= r->end)
        return -1;
    *b = *r->p++;
    return 0;
}

static int r_be(dht_mp_reader *r, int bytes, uint64_t *v)
{
    if (r->end - r->p < bytes)
        return -1;
    *v = 0;
    for (int i = 0; i < bytes; i++)
        *v = *v << 8 | r->p[i];
    r->p += bytes;
    return 0;
}

int dht_mp_take(dht_mp_reader *r, uint64_t n, const uint8_t **out)
{
    if ((uint64_t)(r->end - r->p) < n)
        return -1;
    *out = r->p;
    r->p += n;
    return 0;
}

int dht_mp_head(dht_mp_reader *r, char *kind, uint64_t *val)
{
    uint8_t b;
    if (r_byte(r, &b))
        return -1;
    *val = 0;
    if (b <= 0x7f) { *kind = 'u'; *val = b; return 0; }
    if (b >= 0xe0) { *kind = 'i'; *val = b; return 0; }
    if ((b & 0xf0) == 0x80) { *kind = 'm'; *val = b & 0x0f; return 0; }
    if ((b & 0xf0) == 0x90) { *kind = 'a'; *val = b & 0x0f; return 0; }
    if ((b & 0xe0) == 0xa0) { *kind = 's'; *val = b & 0x1f; return 0; }
    switch (b) {
    case 0xc0: *kind = 'n'; return 0;
    case 0xc2: case 0xc3: *kind = 't'; *val = b & 1; return 0;
    case 0xc4: *kind = 'b'; return r_be(r, 1, val);
    case 0xc5: *kind = 'b'; return r_be(r, 2, val);
    case 0xc6: *kind = 'b'; return r_be(r, 4, val);
    case 0xc7: *kind = 'e'; if (r_be(r, 1, val)) return -1; *val += 1; return 0;
    case 0xc8: *kind = 'e'; if (r_be(r, 2, val)) return -1; *val += 1; return 0;
    case 0xc9: *kind = 'e'; if (r_be(r, 4, val)) return -1; *val += 1; return 0;
    case 0xca: *kind = 'f'; *val = 4; return 0;   /* payload not consumed */
    case 0xcb: *kind = 'f'; *val = 8; return 0;
    case 0xcc: *kind = 'u'; return r_be(r, 1, val);
    case 0xcd: *kind = 'u'; return r_be(r, 2, val);
    case 0xce: *kind = 'u'; return r_be(r, 4, val);
    case 0xcf: *kind = 'u'; return r_be(r, 8, val);
    case 0xd0: *kind = 'i'; return r_be(r, 1, val);
    case 0xd1: *kind = 'i'; return r_be(r, 2, val);
    case 0xd2: *kind = 'i'; return r_be(r, 4, val);
    case 0xd3: *kind = 'i'; return r_be(r, 8, val);
    case 0xd4: *kind = 'e'; *val = 2; return 0;
    case 0xd5: *kind = 'e'; *val = 3; return 0;
    case 0xd6: *kind = 'e'; *val = 5; return 0;
    case 0xd7: *kind = 'e'; *val = 9; return 0;
    case 0xd8: *kind = 'e'; *val = 17; return 0;
    case 0xd9: *kind = 's'; return r_be(r, 1, val);
    case 0xda: *kind = 's'; return r_be(r, 2, val);
    case 0xdb: *kind = 's'; return r_be(r, 4, val);
    case 0xdc: *kind = 'a'; return r_be(r, 2, val);
    case 0xdd: *kind = 'a'; return r_be(r, 4, val);
    case 0xde: *kind = 'm'; return r_be(r, 2, val);
    case 0xdf: *kind = 'm'; return r_be(r, 4, val);
    default: return -1; /* 0xc1 is never used */
    }
}

int dht_mp_skip(dht_mp_reader *r, int depth)
{
    char k;
    uint64_t v;
    const uint8_t *d;
    if (depth > DHT_MP_MAX_DEPTH || dht_mp_head(r, &k, &v))
        return -1;
    switch (k) {
    case 's': case 'b': case 'e': case 'f': return dht_mp_take(r, v, &d);
    case 'a':
        for (uint64_t i = 0; i < v; i++)
            if (dht_mp_skip(r, depth + 1))
                return -1;
        return 0;
    case 'm':
        for (uint64_t i = 0; i < v; i++)
            if (dht_mp_skip(r, depth + 1) || dht_mp_skip(r, depth + 1))
                return -1;
        return 0;
    default: return 0;
    }
}

int dht_mp_uint(dht_mp_reader *r, uint64_t *out)
{
    char k;
    return dht_mp_head(r, &k, out) || k != 'u' ? -1 : 0;
}

int dht_mp_double(dht_mp_reader *r, double *out)
{
    char k;
    uint64_t v;
    const uint8_t *d;
    if (dht_mp_head(r, &k, &v))
        return -1;
    if (k == 'u') {
        *out = (double)v;
        return 0;
    }
    if (k != 'f' || dht_mp_take(r, v, &d))
        return -1;
    uint64_t bits = 0;
    for (uint64_t i = 0; i < v; i++)
        bits = bits << 8 | d[i];
    if (v == 4) {
        uint32_t b32 = (uint32_t)bits;
        float f;
        memcpy(&f, &b32, sizeof f);
        *out = f;
    } else {
        memcpy(out, &bits, sizeof *out);
    }
    return isfinite(*out) ? 0 : -1;
}

int dht_mp_bin(dht_mp_reader *r, const uint8_t **d, size_t *len, size_t max)
{
    char k;
    uint64_t v;
    if (dht_mp_head(r, &k, &v) || k != 'b' || v > max || dht_mp_take(r, v, d))
        return -1;
    *len = (size_t)v;
    return 0;
}

int dht_mp_cstr(dht_mp_reader *r, char *out, size_t cap, size_t max)
{
    char k;
    uint64_t v;
    const uint8_t *d;
    if (dht_mp_head(r, &k, &v) || k != 's' || v > max || v >= cap || dht_mp_take(r, v, &d))
        return -1;
    for (uint64_t i = 0; i < v; i++)
        if (d[i] < 0x20 || d[i] == 0x7f)
            return -1;
    memcpy(out, d, v);
    out[v] = '\0';
    return 0;
}

int dht_mp_key(dht_mp_reader *r, char *key, size_t cap)
{
    char k;
    uint64_t v;
    const uint8_t *d;
    if (dht_mp_head(r, &k, &v) || k != 's' || dht_mp_take(r, v, &d))
        return -1;
    if (v >= cap || memchr(d, 0, v)) {
        key[0] = '\0';
        return 0;
    }
    memcpy(key, d, v);
    key[v] = '\0';
    return 0;
}

int dht_mp_container(dht_mp_reader *r, char want, uint64_t *n)
{
    char k;
    return dht_mp_head(r, &k, n) || k != want ? -1 : 0;
}

int dht_mp_at_end(const dht_mp_reader *r)
{
    return r->p == r->end;
}
