#include "swarm/announce.h"

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

int peer__printable(const char *s, size_t max)
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
    if (!a || !buf || !peer__printable(a->block, 64) || !a->block[0] || !peer__printable(a->addr, 64) ||
        !a->addr[0] || !peer__printable(a->device, 32) || a->state < PEER_STATE_JOINING ||
        a->state > PEER_STATE_OFFLINE || !isfinite(a->throughput) || !isfinite(a->load))
        return -EINVAL;
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, cap < PEER_ANNOUNCE_MAX_BYTES ? cap : PEER_ANNOUNCE_MAX_BYTES);
    msgpack_packer *pk = &w.pk;
    int lost = a->lost_from > a->lost_to, gr = a->grads_refused > 0, fz = a->frozen_steps > 0,
        wf = a->formats != 0, bs = a->bytes_per_sample > 0, pr = a->precision[0] != 0;
    if (!peer__printable(a->precision, 8))
        return -EINVAL;
    if (!isfinite(a->bytes_per_sample))
        return -EINVAL;
    msgpack_pack_map(pk, 13 + 2 * lost + gr + fz + wf + bs + pr);
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
    dht_mp_pack_cstr(pk, "af");
    msgpack_pack_uint64(pk, a->avg_abandoned);
    if (lost) {
        dht_mp_pack_cstr(pk, "lf");
        msgpack_pack_uint64(pk, a->lost_from);
        dht_mp_pack_cstr(pk, "lt");
        msgpack_pack_uint64(pk, a->lost_to);
    }
    if (gr) {
        dht_mp_pack_cstr(pk, "gr");
        msgpack_pack_uint64(pk, a->grads_refused);
    }
    if (fz) {
        dht_mp_pack_cstr(pk, "fz");
        msgpack_pack_uint64(pk, a->frozen_steps);
    }
    if (wf) {
        dht_mp_pack_cstr(pk, "wf");
        msgpack_pack_uint64(pk, a->formats);
    }
    if (bs) {
        dht_mp_pack_cstr(pk, "bs");
        msgpack_pack_double(pk, a->bytes_per_sample);
    }
    if (pr) {
        dht_mp_pack_cstr(pk, "pr");
        dht_mp_pack_cstr(pk, a->precision);
    }
    return dht_mp_writer_finish(&w);
}

/* The records' shared frame: a msgpack map of at most 64 keys within
 * PEER_ANNOUNCE_MAX_BYTES whose "v" is PEER_ANNOUNCE_VERSION (bit 1 of
 * have); every other key goes to field, unknown ones are skipped. Good when
 * the bits set equal want. Returns 0 or -EBADMSG, leaving *out as it is. */
static int record_decode(const uint8_t *buf, size_t len, peer__record_field_fn field, void *out, int want)
{
    dht_mp_reader r;
    uint64_t n, u;
    char key[4];
    int have = 0;

    if (!buf || len > PEER_ANNOUNCE_MAX_BYTES)
        return -EBADMSG;
    dht_mp_reader_init(&r, buf, len);
    if (dht_mp_container(&r, 'm', &n) || n > 64)
        return -EBADMSG;
    for (uint64_t i = 0; i < n; i++) {
        if (dht_mp_key(&r, key, sizeof key))
            return -EBADMSG;
        if (!strcmp(key, "v")) {
            if (dht_mp_uint(&r, &u) || u != PEER_ANNOUNCE_VERSION)
                return -EBADMSG;
            have |= 1;
            continue;
        }
        int rc = field(&r, key, out, &have);
        if (rc < 0 || (rc > 0 && dht_mp_skip(&r, 1)))
            return -EBADMSG;
    }
    return dht_mp_at_end(&r) && have == want ? 0 : -EBADMSG;
}

int peer__record_decode_into(void *out, size_t size, const uint8_t *buf, size_t len, peer__record_field_fn field,
                             int want)
{
    if (!out)
        return -EINVAL;
    memset(out, 0, size);
    int rc = record_decode(buf, len, field, out, want);
    if (rc != 0)
        memset(out, 0, size);
    return rc;
}

static int announce_field(dht_mp_reader *r, const char *key, void *outp, int *have)
{
    peer_announce *out = outp;
    uint64_t u;
    if (!strcmp(key, "b")) {
        if (dht_mp_cstr(r, out->block, sizeof out->block, 64) || !out->block[0])
            return -1;
        *have |= 2;
    } else if (!strcmp(key, "a")) {
        if (dht_mp_cstr(r, out->addr, sizeof out->addr, 64) || !out->addr[0])
            return -1;
        *have |= 4;
    } else if (!strcmp(key, "st")) {
        if (dht_mp_uint(r, &u) || u > PEER_STATE_OFFLINE)
            return -1;
        out->state = (peer_state)u;
        *have |= 8;
    } else if (!strcmp(key, "h")) {
        if (dht_mp_uint(r, &out->stage_hash))
            return -1;
        *have |= 16;
    } else if (!strcmp(key, "wv")) {
        if (dht_mp_uint(r, &out->weight_version))
            return -1;
    } else if (!strcmp(key, "tp")) {
        if (dht_mp_double(r, &out->throughput))
            return -1;
        /* A peer cannot claim more than a sane maximum or less than 0. */
        out->throughput = fmin(fmax(out->throughput, 0.0), 1e9);
    } else if (!strcmp(key, "ld")) {
        if (dht_mp_double(r, &out->load))
            return -1;
        out->load = fmin(fmax(out->load, 0.0), 1.0);
    } else if (!strcmp(key, "dv")) {
        if (dht_mp_cstr(r, out->device, sizeof out->device, 32))
            return -1;
    } else if (!strcmp(key, "t")) {
        if (dht_mp_uint(r, &out->time_ms))
            return -1;
    } else if (!strcmp(key, "ar")) {
        if (dht_mp_uint(r, &out->avg_rounds))
            return -1;
    } else if (!strcmp(key, "ag")) {
        if (dht_mp_uint(r, &u) || u > 4096)
            return -1;
        out->avg_group = (int)u;
    } else if (!strcmp(key, "af")) {
        if (dht_mp_uint(r, &out->avg_abandoned))
            return -1;
    } else if (!strcmp(key, "lf")) {
        if (dht_mp_uint(r, &out->lost_from))
            return -1;
    } else if (!strcmp(key, "lt")) {
        if (dht_mp_uint(r, &out->lost_to))
            return -1;
    } else if (!strcmp(key, "gr")) {
        if (dht_mp_uint(r, &out->grads_refused))
            return -1;
    } else if (!strcmp(key, "fz")) {
        if (dht_mp_uint(r, &out->frozen_steps))
            return -1;
    } else if (!strcmp(key, "wf")) {
        uint64_t m;
        if (dht_mp_uint(r, &m))
            return -1;
        out->formats = (uint32_t)(m & 0xFFFFFFFFu); /* bits of formats this reader does not know stay */
    } else if (!strcmp(key, "pr")) {
        if (dht_mp_cstr(r, out->precision, sizeof out->precision, 8))
            return -1;
    } else if (!strcmp(key, "bs")) {
        if (dht_mp_double(r, &out->bytes_per_sample))
            return -1;
        out->bytes_per_sample = isnan(out->bytes_per_sample) ? 0 : fmin(fmax(out->bytes_per_sample, 0.0), 1e12);
    } else {
        return 1;
    }
    return 0;
}

int peer_announce_decode(peer_announce *out, const uint8_t *buf, size_t len)
{
    /* required: v b a st h */
    return peer__record_decode_into(out, sizeof *out, buf, len, announce_field, 31);
}

long peer_model_record_encode(const peer_model_record *m, uint8_t *buf, size_t cap)
{
    if (!m || !buf || !m->model[0] || !peer__printable(m->model, 48) || m->n_stages < 1 ||
        m->n_stages > 4096)
        return -EINVAL;
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, cap);
    msgpack_pack_map(&w.pk, m->has_desc ? 4 : 3);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, PEER_ANNOUNCE_VERSION);
    dht_mp_pack_cstr(&w.pk, "m");
    dht_mp_pack_cstr(&w.pk, m->model);
    dht_mp_pack_cstr(&w.pk, "n");
    msgpack_pack_uint64(&w.pk, (uint64_t)m->n_stages);
    if (m->has_desc) {
        dht_mp_pack_cstr(&w.pk, "d");
        msgpack_pack_bin(&w.pk, sizeof m->desc_hash);
        msgpack_pack_bin_body(&w.pk, m->desc_hash, sizeof m->desc_hash);
    }
    return dht_mp_writer_finish(&w);
}

static int model_field(dht_mp_reader *r, const char *key, void *outp, int *have)
{
    peer_model_record *out = outp;
    uint64_t u;
    if (!strcmp(key, "m")) {
        if (dht_mp_cstr(r, out->model, sizeof out->model, 48) || !out->model[0])
            return -1;
        *have |= 2;
    } else if (!strcmp(key, "n")) {
        if (dht_mp_uint(r, &u) || u < 1 || u > 4096)
            return -1;
        out->n_stages = (int)u;
        *have |= 4;
    } else if (!strcmp(key, "d")) {
        const uint8_t *d;
        size_t len;
        if (dht_mp_bin(r, &d, &len, sizeof out->desc_hash) || len != sizeof out->desc_hash)
            return -1;
        memcpy(out->desc_hash, d, len);
        out->has_desc = 1;
    } else {
        return 1;
    }
    return 0;
}

int peer_model_record_decode(peer_model_record *out, const uint8_t *buf, size_t len)
{
    return peer__record_decode_into(out, sizeof *out, buf, len, model_field, 7);
}

void peer_keep_key(uint8_t key[DHT_ID_LEN], const char *block, uint64_t stage_hash)
{
    char name[128];
    int n = snprintf(name, sizeof name, "starling.keep:%.64s:%016" PRIx64, block, stage_hash);
    dht_id_of_bytes(key, name, (size_t)n);
}

long peer_keep_record_encode(const peer_keep_record *m, uint8_t *buf, size_t cap)
{
    if (!m || !buf || !m->addr[0] || !peer__printable(m->addr, 64))
        return -EINVAL;
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, cap < PEER_ANNOUNCE_MAX_BYTES ? cap : PEER_ANNOUNCE_MAX_BYTES);
    msgpack_pack_map(&w.pk, 4);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, PEER_ANNOUNCE_VERSION);
    dht_mp_pack_cstr(&w.pk, "a");
    dht_mp_pack_cstr(&w.pk, m->addr);
    dht_mp_pack_cstr(&w.pk, "wv");
    msgpack_pack_uint64(&w.pk, m->weight_version);
    dht_mp_pack_cstr(&w.pk, "t");
    msgpack_pack_uint64(&w.pk, m->time_ms);
    return dht_mp_writer_finish(&w);
}

static int keep_field(dht_mp_reader *r, const char *key, void *outp, int *have)
{
    peer_keep_record *out = outp;
    if (!strcmp(key, "a")) {
        if (dht_mp_cstr(r, out->addr, sizeof out->addr, 64) || !out->addr[0])
            return -1;
        *have |= 2;
    } else if (!strcmp(key, "wv")) {
        if (dht_mp_uint(r, &out->weight_version))
            return -1;
        *have |= 4;
    } else if (!strcmp(key, "t")) {
        if (dht_mp_uint(r, &out->time_ms))
            return -1;
    } else {
        return 1;
    }
    return 0;
}

int peer_keep_record_decode(peer_keep_record *out, const uint8_t *buf, size_t len)
{
    return peer__record_decode_into(out, sizeof *out, buf, len, keep_field, 7);
}
