/* A minimal msgpack reader and writer for the DHT messages.
 *
 * Why not msgpack-c's unpacker: it allocates the element array of a container
 * from the declared count before reading the elements, so a 5-byte header
 * claiming 4 billion entries asks for tens of gigabytes. The reader below
 * allocates nothing and trusts no count. The writer emits standard msgpack
 * (the tests decode its output with msgpack-c), always in the smallest form.
 */
#include "dht/wire.h"
#include "dht/mp.h"

#include <errno.h>
#include <string.h>

#include <sodium.h>

/* ---- writer ---- */

typedef struct wr {
    uint8_t *p, *end;
    int err;
} wr;

static void w_raw(wr *w, const void *b, size_t n)
{
    if (w->err || (size_t)(w->end - w->p) < n) {
        w->err = 1;
        return;
    }
    if (n)
        memcpy(w->p, b, n);
    w->p += n;
}

static void w_be(wr *w, uint8_t tag, uint64_t v, int bytes)
{
    uint8_t b[9];
    b[0] = tag;
    for (int i = 0; i < bytes; i++)
        b[1 + i] = (uint8_t)(v >> (8 * (bytes - 1 - i)));
    w_raw(w, b, (size_t)bytes + 1);
}

static void w_uint(wr *w, uint64_t v)
{
    if (v < 128) {
        uint8_t b = (uint8_t)v;
        w_raw(w, &b, 1);
    } else if (v <= 0xff)
        w_be(w, 0xcc, v, 1);
    else if (v <= 0xffff)
        w_be(w, 0xcd, v, 2);
    else if (v <= 0xffffffffu)
        w_be(w, 0xce, v, 4);
    else
        w_be(w, 0xcf, v, 8);
}

static void w_map(wr *w, uint32_t n) /* n < 16 always here */
{
    uint8_t b = (uint8_t)(0x80 | n);
    w_raw(w, &b, 1);
}

static void w_array(wr *w, uint32_t n)
{
    if (n < 16) {
        uint8_t b = (uint8_t)(0x90 | n);
        w_raw(w, &b, 1);
    } else
        w_be(w, 0xdc, n, 2);
}

static void w_str(wr *w, const char *s) /* short keys only */
{
    size_t n = strlen(s);
    uint8_t b = (uint8_t)(0xa0 | n);
    w_raw(w, &b, 1);
    w_raw(w, s, n);
}

static void w_bin(wr *w, const void *d, size_t n)
{
    if (n <= 0xff)
        w_be(w, 0xc4, n, 1);
    else
        w_be(w, 0xc5, n, 2);
    w_raw(w, d, n);
}

int dht_wire_addr_pack(uint8_t out[18], const dht_addr *a)
{
    size_t n = a->family == 4 ? 4 : a->family == 6 ? 16 : 0;
    if (!n)
        return -EINVAL;
    memcpy(out, a->ip, n);
    out[n] = (uint8_t)(a->port >> 8);
    out[n + 1] = (uint8_t)a->port;
    return (int)n + 2;
}

int dht_wire_addr_unpack(dht_addr *out, const uint8_t *b, size_t len)
{
    memset(out, 0, sizeof *out);
    if (len == 6)
        out->family = 4;
    else if (len == 18)
        out->family = 6;
    else
        return -EBADMSG;
    memcpy(out->ip, b, len - 2);
    out->port = (uint16_t)(b[len - 2] << 8 | b[len - 1]);
    return out->port ? 0 : -EBADMSG;
}

static int entry_ok(const dht_entry *e)
{
    return e->subkey_len <= DHT_MAX_SUBKEY && e->value_len <= DHT_MAX_VALUE &&
           (e->subkey || !e->subkey_len) && (e->value || !e->value_len);
}

static void w_entry(wr *w, const dht_entry *e)
{
    w_map(w, e->is_signed ? 5 : 3);
    w_str(w, "s");
    w_bin(w, e->subkey, e->subkey_len);
    w_str(w, "v");
    w_bin(w, e->value, e->value_len);
    w_str(w, "ex");
    w_uint(w, e->expires);
    if (e->is_signed) {
        w_str(w, "pk");
        w_bin(w, e->pk, 32);
        w_str(w, "sig");
        w_bin(w, e->sig, 64);
    }
}

/* The number of map fields m encodes to (v t x id and the rest), and
 * whether it carries nodes and entries; -EINVAL for a store without exactly
 * one entry and a token. */
static long count_fields(const dht_msg *m, int base, int is_reply, int *want_nodes, int *want_entries)
{
    uint32_t n = 4; /* v t x id */
    *want_nodes = *want_entries = 0;
    if (!is_reply) {
        n += m->has_nonce ? 1 : 0;
        n += m->read_only ? 1 : 0;
        if (base == DHT_MSG_FIND_NODE || base == DHT_MSG_GET)
            n += 1;
        if (base == DHT_MSG_GET && m->offset)
            n += 1;
        if (base == DHT_MSG_STORE) {
            if (m->n_entries != 1 || !m->has_token)
                return -EINVAL;
            n += 3; /* tg tok e */
            *want_entries = 1;
        }
        return n;
    }
    n += m->has_proof ? 2 : 0;
    n += m->has_token ? 1 : 0;
    *want_nodes = (base == DHT_MSG_FIND_NODE || base == DHT_MSG_GET) && m->n_nodes;
    *want_entries = base == DHT_MSG_GET && m->n_entries;
    n += (uint32_t)*want_nodes + (uint32_t)*want_entries;
    n += base == DHT_MSG_GET && m->has_next ? 1 : 0;
    n += base == DHT_MSG_STORE ? 1 : 0;
    return n;
}

/* A request's fields after v t x id. */
static void w_request(wr *w, const dht_msg *m, int base)
{
    if (m->has_nonce) {
        w_str(w, "n");
        w_bin(w, m->nonce, DHT_NONCE_LEN);
    }
    if (m->read_only) {
        w_str(w, "ro");
        w_uint(w, 1);
    }
    if (base != DHT_MSG_PING) {
        w_str(w, "tg");
        w_bin(w, m->target, DHT_ID_LEN);
    }
    if (base == DHT_MSG_GET && m->offset) {
        w_str(w, "o");
        w_uint(w, m->offset);
    }
    if (base == DHT_MSG_STORE) {
        w_str(w, "tok");
        w_bin(w, m->token, DHT_TOKEN_LEN);
    }
}

/* A reply's fields after v t x id, entries aside. Returns 0, or -EINVAL
 * for a node address that does not pack. */
static int w_reply(wr *w, const dht_msg *m, int base, int want_nodes)
{
    if (m->has_proof) {
        w_str(w, "pk");
        w_bin(w, m->pk, 32);
        w_str(w, "sig");
        w_bin(w, m->sig, 64);
    }
    if (m->has_token) {
        w_str(w, "tok");
        w_bin(w, m->token, DHT_TOKEN_LEN);
    }
    if (base == DHT_MSG_STORE) {
        w_str(w, "st");
        w_uint(w, (uint64_t)(m->status < 0 ? 0 : m->status));
    }
    if (want_nodes) {
        w_str(w, "nd");
        w_array(w, (uint32_t)m->n_nodes);
        for (size_t i = 0; i < m->n_nodes; i++) {
            uint8_t a[18];
            int al = dht_wire_addr_pack(a, &m->nodes[i].addr);
            if (al < 0)
                return -EINVAL;
            w_array(w, 2);
            w_bin(w, m->nodes[i].id, DHT_ID_LEN);
            w_bin(w, a, (size_t)al);
        }
    }
    if (base == DHT_MSG_GET && m->has_next) {
        w_str(w, "nx");
        w_uint(w, m->next_offset);
    }
    return 0;
}

int dht_wire_encode(const dht_msg *m, uint8_t *buf, size_t cap)
{
    int is_reply = (m->type & DHT_MSG_REPLY) != 0;
    int base = m->type & 0x7f;
    wr w = {buf, buf + (cap < DHT_MAX_DATAGRAM - DHT_TAG_LEN ? cap : DHT_MAX_DATAGRAM - DHT_TAG_LEN), 0};
    int want_nodes, want_entries;

    if (base < DHT_MSG_PING || base > DHT_MSG_STORE || m->n_nodes > DHT_WIRE_MAX_NODES ||
        m->n_entries > DHT_WIRE_MAX_ENTRIES)
        return -EINVAL;
    for (size_t i = 0; i < m->n_entries; i++)
        if (!entry_ok(&m->entries[i]))
            return -EINVAL;
    long n = count_fields(m, base, is_reply, &want_nodes, &want_entries);
    if (n < 0)
        return (int)n;

    w_map(&w, (uint32_t)n);
    w_str(&w, "v");
    w_uint(&w, DHT_WIRE_VERSION);
    w_str(&w, "t");
    w_uint(&w, m->type);
    w_str(&w, "x");
    w_uint(&w, m->tid);
    w_str(&w, "id");
    w_bin(&w, m->id, DHT_ID_LEN);
    if (!is_reply)
        w_request(&w, m, base);
    else if (w_reply(&w, m, base, want_nodes) != 0)
        return -EINVAL;
    if (want_entries) {
        w_str(&w, "e");
        w_array(&w, (uint32_t)m->n_entries);
        for (size_t i = 0; i < m->n_entries; i++)
            w_entry(&w, &m->entries[i]);
    }
    if (w.err)
        return -EMSGSIZE;
    return (int)(w.p - buf);
}

/* ---- reader ---- */

/* The bounded pull reader of dht/mp.h (shared with the peer layer). */
typedef dht_mp_reader rd;

static int r_bin_exact(rd *r, uint8_t *out, size_t want)
{
    const uint8_t *d;
    size_t n;
    if (dht_mp_bin(r, &d, &n, want) || n != want)
        return -1;
    memcpy(out, d, n);
    return 0;
}

static int r_entry(rd *r, dht_entry *e)
{
    uint64_t n;
    char key[8];
    int have_s = 0, have_v = 0, have_ex = 0, have_pk = 0, have_sig = 0;
    memset(e, 0, sizeof *e);
    if (dht_mp_container(r, 'm', &n))
        return -1;
    for (uint64_t i = 0; i < n; i++) {
        if (dht_mp_key(r, key, sizeof key))
            return -1;
        if (!strcmp(key, "s")) {
            if (have_s++ || dht_mp_bin(r, &e->subkey, &e->subkey_len, DHT_MAX_SUBKEY))
                return -1;
        } else if (!strcmp(key, "v")) {
            if (have_v++ || dht_mp_bin(r, &e->value, &e->value_len, DHT_MAX_VALUE))
                return -1;
        } else if (!strcmp(key, "ex")) {
            if (have_ex++ || dht_mp_uint(r, &e->expires))
                return -1;
        } else if (!strcmp(key, "pk")) {
            if (have_pk++ || r_bin_exact(r, e->pk, 32))
                return -1;
        } else if (!strcmp(key, "sig")) {
            if (have_sig++ || r_bin_exact(r, e->sig, 64))
                return -1;
        } else if (dht_mp_skip(r, 2))
            return -1;
    }
    if (!have_s || !have_v || !have_ex || have_pk != have_sig)
        return -1;
    e->is_signed = have_pk;
    return 0;
}

/* "nd": an array of [id, packed address] pairs. 0, or -1. */
static int r_nodes(rd *r, dht_msg *m)
{
    uint64_t cnt;
    if (dht_mp_container(r, 'a', &cnt) || cnt > DHT_WIRE_MAX_NODES)
        return -1;
    for (uint64_t j = 0; j < cnt; j++) {
        uint64_t two;
        const uint8_t *a;
        size_t al;
        dht_wire_node *nd = &m->nodes[j];
        if (dht_mp_container(r, 'a', &two) || two != 2 || r_bin_exact(r, nd->id, DHT_ID_LEN) ||
            dht_mp_bin(r, &a, &al, 18) || dht_wire_addr_unpack(&nd->addr, a, al))
            return -1;
    }
    m->n_nodes = (size_t)cnt;
    return 0;
}

/* "e": an array of entries. 0, or -1. */
static int r_entries(rd *r, dht_msg *m)
{
    uint64_t cnt;
    if (dht_mp_container(r, 'a', &cnt) || cnt > DHT_WIRE_MAX_ENTRIES)
        return -1;
    for (uint64_t j = 0; j < cnt; j++)
        if (r_entry(r, &m->entries[j]))
            return -1;
    m->n_entries = (size_t)cnt;
    return 0;
}

static int check_type(const dht_msg *m, int have_tg, int have_st);

static int decode(dht_msg *m, rd *r)
{
    uint64_t n, u;
    char key[8];
    int have_v = 0, have_t = 0, have_x = 0, have_id = 0, have_tg = 0, have_st = 0;
    int have_pk = 0, have_sig = 0, have_nd = 0, have_e = 0, have_o = 0, have_n = 0;

    if (dht_mp_container(r, 'm', &n))
        return -1;
    for (uint64_t i = 0; i < n; i++) {
        if (dht_mp_key(r, key, sizeof key))
            return -1;
        if (!strcmp(key, "v")) {
            if (have_v++ || dht_mp_uint(r, &u) || u != DHT_WIRE_VERSION)
                return -1;
        } else if (!strcmp(key, "t")) {
            if (have_t++ || dht_mp_uint(r, &u) || u > 0xff)
                return -1;
            m->type = (uint8_t)u;
        } else if (!strcmp(key, "x")) {
            if (have_x++ || dht_mp_uint(r, &u) || u > 0xffffffffu)
                return -1;
            m->tid = (uint32_t)u;
        } else if (!strcmp(key, "id")) {
            if (have_id++ || r_bin_exact(r, m->id, DHT_ID_LEN))
                return -1;
        } else if (!strcmp(key, "n")) {
            if (have_n++ || r_bin_exact(r, m->nonce, DHT_NONCE_LEN))
                return -1;
            m->has_nonce = 1;
        } else if (!strcmp(key, "ro")) {
            if (m->read_only || dht_mp_uint(r, &u) || u > 1)
                return -1;
            m->read_only = (int)u + 2; /* 2 or 3 while decoding: seen */
        } else if (!strcmp(key, "pk")) {
            if (have_pk++ || r_bin_exact(r, m->pk, 32))
                return -1;
        } else if (!strcmp(key, "sig")) {
            if (have_sig++ || r_bin_exact(r, m->sig, 64))
                return -1;
        } else if (!strcmp(key, "tok")) {
            if (m->has_token++ || r_bin_exact(r, m->token, DHT_TOKEN_LEN))
                return -1;
        } else if (!strcmp(key, "tg")) {
            if (have_tg++ || r_bin_exact(r, m->target, DHT_ID_LEN))
                return -1;
        } else if (!strcmp(key, "o")) {
            if (have_o++ || dht_mp_uint(r, &u) || u > 0xffffffffu)
                return -1;
            m->offset = (uint32_t)u;
        } else if (!strcmp(key, "nx")) {
            if (m->has_next++ || dht_mp_uint(r, &u) || u > 0xffffffffu)
                return -1;
            m->next_offset = (uint32_t)u;
        } else if (!strcmp(key, "st")) {
            if (have_st++ || dht_mp_uint(r, &u) || u > 0xff)
                return -1;
            m->status = (int)u;
        } else if (!strcmp(key, "nd")) {
            if (have_nd++ || r_nodes(r, m))
                return -1;
        } else if (!strcmp(key, "e")) {
            if (have_e++ || r_entries(r, m))
                return -1;
        } else if (dht_mp_skip(r, 1)) {
            return -1;
        }
    }
    if (!dht_mp_at_end(r) || !have_v || !have_t || !have_x || !have_id || have_pk != have_sig)
        return -1;
    m->has_proof = have_pk;
    m->read_only = m->read_only == 3;
    return check_type(m, have_tg, have_st);
}

/* The fields each message type needs: 0, or -1 (missing, or an unknown
 * type). */
static int check_type(const dht_msg *m, int have_tg, int have_st)
{
    switch (m->type) {
    case DHT_MSG_PING:
        break;
    case DHT_MSG_FIND_NODE:
    case DHT_MSG_GET:
        if (!have_tg)
            return -1;
        break;
    case DHT_MSG_STORE:
        if (!have_tg || !m->has_token || m->n_entries != 1)
            return -1;
        break;
    case DHT_MSG_PING | DHT_MSG_REPLY:
    case DHT_MSG_FIND_NODE | DHT_MSG_REPLY:
    case DHT_MSG_GET | DHT_MSG_REPLY:
        break;
    case DHT_MSG_STORE | DHT_MSG_REPLY:
        if (!have_st)
            return -1;
        break;
    default:
        return -1;
    }
    return 0;
}

int dht_wire_decode(dht_msg *m, const uint8_t *buf, size_t len)
{
    rd r;
    dht_mp_reader_init(&r, buf, len);
    memset(m, 0, sizeof *m);
    if (!buf || len == 0 || len > DHT_MAX_DATAGRAM)
        return -EBADMSG;
    return decode(m, &r) ? -EBADMSG : 0;
}

int dht_wire_encode_reject(uint32_t tid, uint8_t *buf, size_t cap)
{
    wr w = {buf, buf + cap, 0};
    w_map(&w, 3);
    w_str(&w, "v");
    w_uint(&w, DHT_WIRE_VERSION);
    w_str(&w, "t");
    w_uint(&w, DHT_MSG_SWARM_REJECT);
    w_str(&w, "x");
    w_uint(&w, tid);
    return w.err ? -EMSGSIZE : (int)(w.p - buf);
}

int dht_wire_decode_reject(const uint8_t *buf, size_t len, uint32_t *tid_out)
{
    rd r;
    uint64_t n, u;
    char key[8];
    int have_v = 0, have_t = 0, have_x = 0;
    if (!buf || len == 0 || len > DHT_MAX_DATAGRAM)
        return -EBADMSG;
    dht_mp_reader_init(&r, buf, len);
    if (dht_mp_container(&r, 'm', &n))
        return -EBADMSG;
    for (uint64_t i = 0; i < n; i++) {
        if (dht_mp_key(&r, key, sizeof key))
            return -EBADMSG;
        if (!strcmp(key, "v")) {
            if (have_v++ || dht_mp_uint(&r, &u) || u != DHT_WIRE_VERSION)
                return -EBADMSG;
        } else if (!strcmp(key, "t")) {
            if (have_t++ || dht_mp_uint(&r, &u) || u != DHT_MSG_SWARM_REJECT)
                return -EBADMSG;
        } else if (!strcmp(key, "x")) {
            if (have_x++ || dht_mp_uint(&r, &u) || u > 0xffffffffu)
                return -EBADMSG;
            if (tid_out)
                *tid_out = (uint32_t)u;
        } else if (dht_mp_skip(&r, 1)) {
            return -EBADMSG;
        }
    }
    return dht_mp_at_end(&r) && have_v && have_t && have_x ? 0 : -EBADMSG;
}

void dht_wire_tag(uint8_t tag[DHT_TAG_LEN], const uint8_t swarm_key[32], const uint8_t *body,
                  size_t len)
{
    crypto_generichash(tag, DHT_TAG_LEN, body, len, swarm_key, 32);
}
