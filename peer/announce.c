#include "peer/announce.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <math.h>
#include <string.h>

#include "dht/id.h"
#include "dht/mp.h"

const char *peer_state_name(int state)
{
    switch (state) {
    case PEER_STATE_JOINING: return "joining";
    case PEER_STATE_ONLINE: return "online";
    case PEER_STATE_OFFLINE: return "offline";
    default: return "unknown";
    }
}

static int printable(const char *s, size_t max)
{
    size_t n = strnlen(s, max + 1);
    if (n > max)
        return 0;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f)
            return 0;
    return 1;
}

long peer_announce_encode(const peer_announce *a, uint8_t *buf, size_t cap)
{
    if (!a || !buf || !printable(a->block, 64) || !a->block[0] || !printable(a->addr, 64) ||
        !a->addr[0] || !printable(a->device, 32) || a->state < PEER_STATE_JOINING ||
        a->state > PEER_STATE_OFFLINE || !isfinite(a->throughput) || !isfinite(a->load))
        return -EINVAL;
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, cap < PEER_ANNOUNCE_MAX_BYTES ? cap : PEER_ANNOUNCE_MAX_BYTES);
    msgpack_packer *pk = &w.pk;
    msgpack_pack_map(pk, 12);
    dht_mp_pack_cstr(pk, "v");
    msgpack_pack_uint64(pk, PEER_ANNOUNCE_VERSION);
    dht_mp_pack_cstr(pk, "b");
    dht_mp_pack_cstr(pk, a->block);
    dht_mp_pack_cstr(pk, "a");
    dht_mp_pack_cstr(pk, a->addr);
    dht_mp_pack_cstr(pk, "st");
    msgpack_pack_uint64(pk, (uint64_t)a->state);
    dht_mp_pack_cstr(pk, "h");
    msgpack_pack_uint64(pk, a->stage_hash);
    dht_mp_pack_cstr(pk, "wv");
    msgpack_pack_uint64(pk, a->weight_version);
    dht_mp_pack_cstr(pk, "tp");
    msgpack_pack_double(pk, a->throughput);
    dht_mp_pack_cstr(pk, "ld");
    msgpack_pack_double(pk, a->load);
    dht_mp_pack_cstr(pk, "dv");
    dht_mp_pack_cstr(pk, a->device);
    dht_mp_pack_cstr(pk, "t");
    msgpack_pack_uint64(pk, a->time_ms);
    dht_mp_pack_cstr(pk, "ar");
    msgpack_pack_uint64(pk, a->avg_rounds);
    dht_mp_pack_cstr(pk, "ag");
    msgpack_pack_uint64(pk, a->avg_group);
    return dht_mp_writer_finish(&w);
}

int peer_announce_decode(peer_announce *out, const uint8_t *buf, size_t len)
{
    dht_mp_reader r;
    uint64_t n, u;
    char key[4];
    int have = 0; /* bits: v b a st h */

    if (!out)
        return -EINVAL;
    memset(out, 0, sizeof *out);
    if (!buf || len > PEER_ANNOUNCE_MAX_BYTES)
        goto bad;
    dht_mp_reader_init(&r, buf, len);
    if (dht_mp_container(&r, 'm', &n) || n > 64)
        goto bad;
    for (uint64_t i = 0; i < n; i++) {
        if (dht_mp_key(&r, key, sizeof key))
            goto bad;
        if (!strcmp(key, "v")) {
            if (dht_mp_uint(&r, &u) || u != PEER_ANNOUNCE_VERSION)
                goto bad;
            have |= 1;
        } else if (!strcmp(key, "b")) {
            if (dht_mp_cstr(&r, out->block, sizeof out->block, 64) || !out->block[0])
                goto bad;
            have |= 2;
        } else if (!strcmp(key, "a")) {
            if (dht_mp_cstr(&r, out->addr, sizeof out->addr, 64) || !out->addr[0])
                goto bad;
            have |= 4;
        } else if (!strcmp(key, "st")) {
            if (dht_mp_uint(&r, &u) || u > PEER_STATE_OFFLINE)
                goto bad;
            out->state = (peer_state)u;
            have |= 8;
        } else if (!strcmp(key, "h")) {
            if (dht_mp_uint(&r, &out->stage_hash))
                goto bad;
            have |= 16;
        } else if (!strcmp(key, "wv")) {
            if (dht_mp_uint(&r, &out->weight_version))
                goto bad;
        } else if (!strcmp(key, "tp")) {
            if (dht_mp_double(&r, &out->throughput))
                goto bad;
            /* A peer cannot claim more than a sane maximum or less than 0. */
            out->throughput = fmin(fmax(out->throughput, 0.0), 1e9);
        } else if (!strcmp(key, "ld")) {
            if (dht_mp_double(&r, &out->load))
                goto bad;
            out->load = fmin(fmax(out->load, 0.0), 1.0);
        } else if (!strcmp(key, "dv")) {
            if (dht_mp_cstr(&r, out->device, sizeof out->device, 32))
                goto bad;
        } else if (!strcmp(key, "t")) {
            if (dht_mp_uint(&r, &out->time_ms))
                goto bad;
        } else if (!strcmp(key, "ar")) {
            if (dht_mp_uint(&r, &out->avg_rounds))
                goto bad;
        } else if (!strcmp(key, "ag")) {
            uint64_t g;
            if (dht_mp_uint(&r, &g) || g > 4096)
                goto bad;
            out->avg_group = (int)g;
        } else if (dht_mp_skip(&r, 1)) {
            goto bad;
        }
    }
    if (!dht_mp_at_end(&r) || have != 31)
        goto bad;
    return 0;
bad:
    memset(out, 0, sizeof *out);
    return -EBADMSG;
}

long peer_model_record_encode(const peer_model_record *m, uint8_t *buf, size_t cap)
{
    if (!m || !buf || !m->model[0] || !printable(m->model, 48) || m->n_stages < 1 ||
        m->n_stages > 4096)
        return -EINVAL;
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, cap);
    msgpack_pack_map(&w.pk, 3);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, PEER_ANNOUNCE_VERSION);
    dht_mp_pack_cstr(&w.pk, "m");
    dht_mp_pack_cstr(&w.pk, m->model);
    dht_mp_pack_cstr(&w.pk, "n");
    msgpack_pack_uint64(&w.pk, (uint64_t)m->n_stages);
    return dht_mp_writer_finish(&w);
}

int peer_model_record_decode(peer_model_record *out, const uint8_t *buf, size_t len)
{
    dht_mp_reader r;
    uint64_t n, u;
    char key[4];
    int have = 0;

    if (!out)
        return -EINVAL;
    memset(out, 0, sizeof *out);
    if (!buf || len > PEER_ANNOUNCE_MAX_BYTES)
        goto bad;
    dht_mp_reader_init(&r, buf, len);
    if (dht_mp_container(&r, 'm', &n) || n > 64)
        goto bad;
    for (uint64_t i = 0; i < n; i++) {
        if (dht_mp_key(&r, key, sizeof key))
            goto bad;
        if (!strcmp(key, "v")) {
            if (dht_mp_uint(&r, &u) || u != PEER_ANNOUNCE_VERSION)
                goto bad;
            have |= 1;
        } else if (!strcmp(key, "m")) {
            if (dht_mp_cstr(&r, out->model, sizeof out->model, 48) || !out->model[0])
                goto bad;
            have |= 2;
        } else if (!strcmp(key, "n")) {
            if (dht_mp_uint(&r, &u) || u < 1 || u > 4096)
                goto bad;
            out->n_stages = (int)u;
            have |= 4;
        } else if (dht_mp_skip(&r, 1)) {
            goto bad;
        }
    }
    if (!dht_mp_at_end(&r) || have != 7)
        goto bad;
    return 0;
bad:
    memset(out, 0, sizeof *out);
    return -EBADMSG;
}

void peer_avg_key(uint8_t key[DHT_ID_LEN], const char *block, uint64_t stage_hash)
{
    char name[128];
    int n = snprintf(name, sizeof name, "starling.avg:%.64s:%016" PRIx64, block, stage_hash);
    dht_id_of_bytes(key, name, (size_t)n);
}

long peer_avg_record_encode(const peer_avg_record *m, uint8_t *buf, size_t cap)
{
    if (!m || !buf || !m->addr[0] || !printable(m->addr, 64) || m->optim < 0 || m->optim > 255)
        return -EINVAL;
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, cap);
    msgpack_pack_map(&w.pk, 4);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, PEER_ANNOUNCE_VERSION);
    dht_mp_pack_cstr(&w.pk, "r");
    msgpack_pack_uint64(&w.pk, m->round);
    dht_mp_pack_cstr(&w.pk, "a");
    dht_mp_pack_cstr(&w.pk, m->addr);
    dht_mp_pack_cstr(&w.pk, "o");
    msgpack_pack_uint64(&w.pk, (uint64_t)m->optim);
    return dht_mp_writer_finish(&w);
}

int peer_avg_record_decode(peer_avg_record *out, const uint8_t *buf, size_t len)
{
    dht_mp_reader r;
    uint64_t n, u;
    char key[4];
    int have = 0;

    if (!out)
        return -EINVAL;
    memset(out, 0, sizeof *out);
    if (!buf || len > PEER_ANNOUNCE_MAX_BYTES)
        goto bad;
    dht_mp_reader_init(&r, buf, len);
    if (dht_mp_container(&r, 'm', &n) || n > 64)
        goto bad;
    for (uint64_t i = 0; i < n; i++) {
        if (dht_mp_key(&r, key, sizeof key))
            goto bad;
        if (!strcmp(key, "v")) {
            if (dht_mp_uint(&r, &u) || u != PEER_ANNOUNCE_VERSION)
                goto bad;
            have |= 1;
        } else if (!strcmp(key, "r")) {
            if (dht_mp_uint(&r, &out->round))
                goto bad;
            have |= 2;
        } else if (!strcmp(key, "a")) {
            if (dht_mp_cstr(&r, out->addr, sizeof out->addr, 64) || !out->addr[0])
                goto bad;
            have |= 4;
        } else if (!strcmp(key, "o")) {
            if (dht_mp_uint(&r, &u) || u > 255)
                goto bad;
            out->optim = (int)u;
            have |= 8;
        } else if (dht_mp_skip(&r, 1)) {
            goto bad;
        }
    }
    if (!dht_mp_at_end(&r) || have != 15)
        goto bad;
    return 0;
bad:
    memset(out, 0, sizeof *out);
    return -EBADMSG;
}
