#include "dht/store.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>
#include <uthash.h>

#define ENTRY_OVERHEAD 160 /* bookkeeping bytes charged per entry */
#define SIGN_CTX "starling-dht-entry-v1"

typedef struct sentry {
    uint8_t subkey[DHT_MAX_SUBKEY];
    uint8_t subkey_len;
    uint8_t is_signed;
    uint8_t pk[32];
    uint8_t sig[64];
    uint64_t expires;
    uint8_t *value;
    size_t value_len;
    dht_addr src;   /* unsigned: the network that stored it (family 0: us) */
} sentry;

typedef struct skey {
    uint8_t key[DHT_ID_LEN];
    sentry *e;      /* signed first, then by (subkey_len, subkey) */
    size_t n, cap;
    size_t n_unsigned, unsigned_bytes; /* the unsigned tail e[n - n_unsigned..n) */
    UT_hash_handle hh;
} skey;

struct dht_store {
    dht_store_limits lim;
    skey *keys;
    size_t n_keys, n_entries, bytes, unsigned_bytes;
};

static size_t sign_msg(uint8_t *buf, const uint8_t key[DHT_ID_LEN], const dht_entry *e)
{
    size_t n = 0;
    memcpy(buf, SIGN_CTX, sizeof SIGN_CTX - 1);
    n += sizeof SIGN_CTX - 1;
    memcpy(buf + n, key, DHT_ID_LEN);
    n += DHT_ID_LEN;
    buf[n++] = (uint8_t)e->subkey_len;
    if (e->subkey_len)
        memcpy(buf + n, e->subkey, e->subkey_len);
    n += e->subkey_len;
    for (int i = 7; i >= 0; i--)
        buf[n++] = (uint8_t)(e->expires >> (8 * i));
    if (e->value_len)
        memcpy(buf + n, e->value, e->value_len);
    return n + e->value_len;
}

#define SIGN_BUF (sizeof SIGN_CTX + DHT_ID_LEN + 1 + DHT_MAX_SUBKEY + 8 + DHT_MAX_VALUE)

int dht_entry_sign(dht_entry *e, const uint8_t key[DHT_ID_LEN], const dht_identity *ident)
{
    uint8_t buf[SIGN_BUF];
    if (!e || !key || !ident || e->subkey_len != DHT_ID_LEN ||
        memcmp(e->subkey, ident->id, DHT_ID_LEN) != 0 || e->value_len > DHT_MAX_VALUE)
        return -EINVAL;
    size_t n = sign_msg(buf, key, e);
    crypto_sign_detached(e->sig, NULL, buf, n, ident->sk);
    memcpy(e->pk, ident->pk, 32);
    e->is_signed = 1;
    return 0;
}

int dht_entry_check(const dht_entry *e, const uint8_t key[DHT_ID_LEN], uint64_t now)
{
    if (e->subkey_len > DHT_MAX_SUBKEY || e->value_len > DHT_MAX_VALUE)
        return -EINVAL;
    if (e->expires <= now || e->expires > now + DHT_MAX_TTL_MS)
        return -ESTALE;
    if (e->is_signed) {
        uint8_t id[DHT_ID_LEN], buf[SIGN_BUF];
        if (e->subkey_len != DHT_ID_LEN)
            return -EINVAL;
        dht_id_of_pubkey(id, e->pk);
        if (memcmp(id, e->subkey, DHT_ID_LEN) != 0)
            return -EINVAL;
        size_t n = sign_msg(buf, key, e);
        if (crypto_sign_verify_detached(e->sig, buf, n, e->pk) != 0)
            return -EPERM;
    }
    return 0;
}

dht_store *dht_store_create(const dht_store_limits *limits)
{
    dht_store *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    if (limits)
        s->lim = *limits;
    if (!s->lim.max_keys)
        s->lim.max_keys = DHT_STORE_MAX_KEYS;
    if (!s->lim.max_subkeys)
        s->lim.max_subkeys = DHT_STORE_MAX_SUBKEYS;
    if (!s->lim.max_bytes)
        s->lim.max_bytes = DHT_STORE_MAX_BYTES;
    if (!s->lim.max_unsigned)
        s->lim.max_unsigned = DHT_STORE_MAX_UNSIGNED;
    if (!s->lim.max_unsigned_key_bytes)
        s->lim.max_unsigned_key_bytes = DHT_STORE_MAX_UNSIGNED_KEY_BYTES;
    if (!s->lim.max_unsigned_per_source)
        s->lim.max_unsigned_per_source = DHT_STORE_MAX_UNSIGNED_PER_SOURCE;
    if (!s->lim.max_unsigned_bytes)
        s->lim.max_unsigned_bytes = s->lim.max_bytes / 4;
    return s;
}

static void free_key(dht_store *s, skey *k)
{
    for (size_t i = 0; i < k->n; i++) {
        s->bytes -= k->e[i].value_len + ENTRY_OVERHEAD;
        free(k->e[i].value);
    }
    s->unsigned_bytes -= k->unsigned_bytes;
    s->n_entries -= k->n;
    s->n_keys--;
    HASH_DEL(s->keys, k);
    free(k->e);
    free(k);
}

void dht_store_destroy(dht_store **p)
{
    if (!p || !*p)
        return;
    dht_store *s = *p;
    skey *k, *tmp;
    HASH_ITER(hh, s->keys, k, tmp)
        free_key(s, k);
    free(s);
    *p = NULL;
}

/* Signed entries sort first: a reader that follows a bounded number of
 * pages (docs/protocol.md) must see every owner's entry before any of the
 * entries that anyone can write. */
static int cmp_entry(const sentry *a, int is_signed, const uint8_t *sub, size_t len)
{
    if (!a->is_signed != !is_signed)
        return a->is_signed ? -1 : 1;
    if (a->subkey_len != len)
        return a->subkey_len < len ? -1 : 1;
    return len ? memcmp(a->subkey, sub, len) : 0;
}

/* Removes entry i of k (the caller keeps k, even if it becomes empty). */
static void drop_entry(dht_store *s, skey *k, size_t i)
{
    sentry *x = &k->e[i];
    size_t sz = x->value_len + ENTRY_OVERHEAD;
    s->bytes -= sz;
    if (!x->is_signed) {
        k->n_unsigned--;
        k->unsigned_bytes -= sz;
        s->unsigned_bytes -= sz;
    }
    free(x->value);
    memmove(x, x + 1, (k->n - i - 1) * sizeof *x);
    k->n--;
    s->n_entries--;
}

/* Evicts the unsigned entry of k that expires first. Returns 1 if one went. */
static int evict_one_unsigned(dht_store *s, skey *k)
{
    size_t best = k->n;
    for (size_t i = k->n - k->n_unsigned; i < k->n; i++)
        if (best == k->n || k->e[i].expires < k->e[best].expires)
            best = i;
    if (best == k->n)
        return 0;
    drop_entry(s, k, best);
    return 1;
}

/* Frees unsigned entries (those of k first) until need more bytes fit.
 * Returns 1 if they fit now. keep is never freed as a whole key. */
static int evict_unsigned_bytes(dht_store *s, skey *k, size_t need)
{
    while (s->bytes + need > s->lim.max_bytes && k && evict_one_unsigned(s, k))
        ;
    skey *o, *tmp;
    HASH_ITER(hh, s->keys, o, tmp) {
        if (s->bytes + need <= s->lim.max_bytes || !s->unsigned_bytes)
            break;
        if (o == k)
            continue;
        while (s->bytes + need > s->lim.max_bytes && evict_one_unsigned(s, o))
            ;
        if (o->n == 0)
            free_key(s, o);
    }
    return s->bytes + need <= s->lim.max_bytes;
}

/* Frees a key that holds no signed entry (the one whose entries expire
 * first). Returns 1 if one went. */
static int evict_unsigned_key(dht_store *s)
{
    skey *o, *tmp, *best = NULL;
    uint64_t best_exp = 0;
    HASH_ITER(hh, s->keys, o, tmp) {
        if (o->n != o->n_unsigned)
            continue;
        uint64_t last = 0;
        for (size_t i = 0; i < o->n; i++)
            last = o->e[i].expires > last ? o->e[i].expires : last;
        if (!best || last < best_exp) {
            best = o;
            best_exp = last;
        }
    }
    if (!best)
        return 0;
    free_key(s, best);
    return 1;
}

/* The network an unsigned entry is charged to: the /24 (IPv4) or /48
 * (IPv6) of a public address, which one operator typically holds whole;
 * the exact IP of a loopback or private one (one machine of a local swarm). */
static void source_group(dht_addr *out, const dht_addr *src)
{
    if (!src || !src->family) {
        memset(out, 0, sizeof *out);
        return;
    }
    dht_addr_prefix(out, src, dht_addr_is_local(src) ? 128 : dht_addr_net_bits(src));
}

/* Number of unsigned entries of k charged to group g, except entry skip. */
static size_t count_source(const skey *k, const dht_addr *g, size_t skip)
{
    size_t c = 0;
    for (size_t i = k->n - k->n_unsigned; i < k->n; i++)
        c += i != skip && dht_addr_equal(&k->e[i].src, g);
    return c;
}

/* Whether an unsigned entry of sz bytes from group g may be added to k (or
 * replace entry at index repl, of old_sz bytes; repl = k->n for a new one). */
static int unsigned_room(const dht_store *s, const skey *k, const dht_addr *g, size_t sz,
                         size_t repl, size_t old_sz)
{
    size_t kn = k ? k->n_unsigned : 0, kb = k ? k->unsigned_bytes : 0;
    if (!k || repl == k->n) {
        if (kn >= s->lim.max_unsigned)
            return 0;
        old_sz = 0;
    }
    if (kb - old_sz + sz > s->lim.max_unsigned_key_bytes ||
        s->unsigned_bytes - old_sz + sz > s->lim.max_unsigned_bytes)
        return 0;
    if (g->family && k && count_source(k, g, repl) >= s->lim.max_unsigned_per_source)
        return 0;
    return 1;
}

/* Replaces entry i of key k (same subkey and kind as e) by e, within the
 * same bounds as a new entry. Returns 1 when replaced, 0 when the entry
 * held is as new as e (nothing to do), -ENOSPC or -ENOMEM. */
static int replace_entry(dht_store *s, skey *k, size_t i, const dht_entry *e, const dht_addr *g,
                         uint64_t now)
{
    sentry *x = &k->e[i];
    size_t sz = e->value_len + ENTRY_OVERHEAD, old = x->value_len + ENTRY_OVERHEAD;
    if (x->expires >= e->expires && x->expires > now)
        return 0;
    if (!e->is_signed && !unsigned_room(s, k, g, sz, i, old))
        return -ENOSPC;
    if (s->bytes - old + sz > s->lim.max_bytes && (!e->is_signed || !evict_unsigned_bytes(s, k, sz - old)))
        return -ENOSPC;
    uint8_t *val = malloc(e->value_len ? e->value_len : 1);
    if (!val)
        return -ENOMEM;
    if (e->value_len)
        memcpy(val, e->value, e->value_len);
    s->bytes = s->bytes - old + sz;
    if (!e->is_signed) {
        k->unsigned_bytes = k->unsigned_bytes - old + sz;
        s->unsigned_bytes = s->unsigned_bytes - old + sz;
        x->src = *g;
    }
    free(x->value);
    x->value = val;
    x->value_len = e->value_len;
    x->expires = e->expires;
    memcpy(x->pk, e->pk, 32);
    memcpy(x->sig, e->sig, 64);
    return 1;
}

int dht_store_put(dht_store *s, const uint8_t key[DHT_ID_LEN], const dht_entry *e, uint64_t now)
{
    return dht_store_put_from(s, key, e, now, NULL);
}

/* Room for a new entry of sz bytes under k (NULL: a new key). An unsigned
 * one only within its quotas; a signed one makes room by evicting unsigned
 * ones before it is refused (the unsigned tail sorts after the new entry's
 * place, so that place stays valid). Returns 1 when there is room, else 0. */
static int make_room(dht_store *s, skey *k, const dht_entry *e, const dht_addr *g, size_t sz)
{
    if (!e->is_signed) {
        if (!unsigned_room(s, k, g, sz, k ? k->n : 0, 0))
            return 0;
    } else if (k && k->n >= s->lim.max_subkeys) {
        if (!evict_one_unsigned(s, k))
            return 0;
    } else if (!k && s->n_keys >= s->lim.max_keys && !evict_unsigned_key(s)) {
        return 0;
    }
    if (k && k->n >= s->lim.max_subkeys)
        return 0;
    if (!k && s->n_keys >= s->lim.max_keys)
        return 0;
    if (s->bytes + sz > s->lim.max_bytes && (!e->is_signed || !evict_unsigned_bytes(s, k, sz)))
        return 0;
    return 1;
}

/* Inserts e (its value copied to val) at position lo of k, which has room,
 * and counts it. */
static void insert_entry(dht_store *s, skey *k, size_t lo, const dht_entry *e, const dht_addr *g, size_t sz,
                         uint8_t *val)
{
    memmove(&k->e[lo + 1], &k->e[lo], (k->n - lo) * sizeof *k->e);
    sentry *x = &k->e[lo];
    memset(x, 0, sizeof *x);
    if (e->subkey_len)
        memcpy(x->subkey, e->subkey, e->subkey_len);
    x->subkey_len = (uint8_t)e->subkey_len;
    x->is_signed = (uint8_t)(e->is_signed != 0);
    memcpy(x->pk, e->pk, 32);
    memcpy(x->sig, e->sig, 64);
    x->expires = e->expires;
    x->value = val;
    x->value_len = e->value_len;
    x->src = *g;
    k->n++;
    s->n_entries++;
    s->bytes += sz;
    if (!e->is_signed) {
        k->n_unsigned++;
        k->unsigned_bytes += sz;
        s->unsigned_bytes += sz;
    }
}

int dht_store_put_from(dht_store *s, const uint8_t key[DHT_ID_LEN], const dht_entry *e,
                       uint64_t now, const dht_addr *src)
{
    int rc;
    skey *k;
    size_t lo = 0, hi;
    uint8_t *val;
    dht_addr g;
    size_t sz = e->value_len + ENTRY_OVERHEAD;
    if (e->subkey_len > DHT_MAX_SUBKEY || e->value_len > DHT_MAX_VALUE)
        return -EINVAL;
    HASH_FIND(hh, s->keys, key, DHT_ID_LEN, k);
    if (k) {
        /* A copy we already hold with the same or a later expiration needs
         * no signature check: nothing would change (republish traffic is
         * mostly this). */
        for (hi = 0; hi < k->n; hi++)
            if (cmp_entry(&k->e[hi], e->is_signed, e->subkey, e->subkey_len) == 0 &&
                k->e[hi].expires >= e->expires && k->e[hi].expires > now)
                return e->expires > now ? 0 : -ESTALE;
    }
    rc = dht_entry_check(e, key, now);
    if (rc)
        return rc;
    source_group(&g, e->is_signed ? NULL : src);
    if (k) {
        /* Binary search for the entry's place. */
        hi = k->n;
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            int c = cmp_entry(&k->e[mid], e->is_signed, e->subkey, e->subkey_len);
            if (c == 0)
                return replace_entry(s, k, mid, e, &g, now);
            if (c < 0)
                lo = mid + 1;
            else
                hi = mid;
        }
    }
    if (!make_room(s, k, e, &g, sz))
        return -ENOSPC;
    if (!k) {
        k = calloc(1, sizeof *k);
        if (!k)
            return -ENOMEM;
        memcpy(k->key, key, DHT_ID_LEN);
        HASH_ADD(hh, s->keys, key, DHT_ID_LEN, k);
        s->n_keys++;
    }
    if (k->n == k->cap) {
        size_t nc = k->cap ? k->cap * 2 : 4;
        sentry *ne = realloc(k->e, nc * sizeof *ne);
        if (!ne)
            goto nomem;
        k->e = ne;
        k->cap = nc;
    }
    val = malloc(e->value_len ? e->value_len : 1);
    if (!val)
        goto nomem;
    if (e->value_len)
        memcpy(val, e->value, e->value_len);
    if (lo > k->n)
        lo = k->n; /* (evictions shortened the tail) */
    insert_entry(s, k, lo, e, &g, sz, val);
    return 1;
nomem:
    if (k->n == 0)
        free_key(s, k);
    return -ENOMEM;
}

static void view(dht_entry *o, const sentry *x)
{
    memset(o, 0, sizeof *o);
    o->subkey = x->subkey;
    o->subkey_len = x->subkey_len;
    o->value = x->value;
    o->value_len = x->value_len;
    o->expires = x->expires;
    o->is_signed = x->is_signed;
    memcpy(o->pk, x->pk, 32);
    memcpy(o->sig, x->sig, 64);
}

size_t dht_store_get(dht_store *s, const uint8_t key[DHT_ID_LEN], uint64_t now, size_t offset,
                     dht_entry *out, size_t max, size_t *total_out)
{
    skey *k;
    size_t live = 0, w = 0;
    HASH_FIND(hh, s->keys, key, DHT_ID_LEN, k);
    if (k) {
        for (size_t i = 0; i < k->n; i++) {
            if (k->e[i].expires <= now)
                continue;
            if (live >= offset && w < max)
                view(&out[w++], &k->e[i]);
            live++;
        }
    }
    if (total_out)
        *total_out = live;
    return w;
}

size_t dht_store_expire(dht_store *s, uint64_t now)
{
    skey *k, *tmp;
    size_t freed = 0;
    HASH_ITER(hh, s->keys, k, tmp) {
        size_t w = 0;
        for (size_t i = 0; i < k->n; i++) {
            if (k->e[i].expires <= now) {
                size_t sz = k->e[i].value_len + ENTRY_OVERHEAD;
                s->bytes -= sz;
                if (!k->e[i].is_signed) {
                    k->n_unsigned--;
                    k->unsigned_bytes -= sz;
                    s->unsigned_bytes -= sz;
                }
                free(k->e[i].value);
                s->n_entries--;
                freed++;
            } else {
                k->e[w++] = k->e[i];
            }
        }
        k->n = w;
        if (w == 0)
            free_key(s, k);
    }
    return freed;
}

size_t dht_store_keys(dht_store *s, size_t *cursor, uint8_t (*keys)[DHT_ID_LEN], size_t max)
{
    skey *k;
    size_t i = 0, w = 0;
    for (k = s->keys; k && w < max; k = k->hh.next, i++) {
        if (i < *cursor)
            continue;
        memcpy(keys[w++], k->key, DHT_ID_LEN);
    }
    *cursor = k ? i : 0;
    return w;
}

size_t dht_store_count_keys(const dht_store *s) { return s->n_keys; }
size_t dht_store_count_entries(const dht_store *s) { return s->n_entries; }
size_t dht_store_bytes(const dht_store *s) { return s->bytes; }
size_t dht_store_unsigned_bytes(const dht_store *s) { return s->unsigned_bytes; }
