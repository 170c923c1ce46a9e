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
} sentry;

typedef struct skey {
    uint8_t key[DHT_ID_LEN];
    sentry *e;      /* sorted by (is_signed, subkey_len, subkey) */
    size_t n, cap;
    UT_hash_handle hh;
} skey;

struct dht_store {
    dht_store_limits lim;
    skey *keys;
    size_t n_keys, n_entries, bytes;
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
    else {
        s->lim.max_keys = DHT_STORE_MAX_KEYS;
        s->lim.max_subkeys = DHT_STORE_MAX_SUBKEYS;
        s->lim.max_bytes = DHT_STORE_MAX_BYTES;
    }
    return s;
}

static void free_key(dht_store *s, skey *k)
{
    for (size_t i = 0; i < k->n; i++) {
        s->bytes -= k->e[i].value_len + ENTRY_OVERHEAD;
        free(k->e[i].value);
    }
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

static int cmp_entry(const sentry *a, int is_signed, const uint8_t *sub, size_t len)
{
    if (a->is_signed != is_signed)
        return a->is_signed < is_signed ? -1 : 1;
    if (a->subkey_len != len)
        return a->subkey_len < len ? -1 : 1;
    return len ? memcmp(a->subkey, sub, len) : 0;
}

int dht_store_put(dht_store *s, const uint8_t key[DHT_ID_LEN], const dht_entry *e, uint64_t now)
{
    int rc;
    skey *k;
    size_t lo = 0, hi;
    uint8_t *val;
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
    if (k) {
        /* Binary search for the entry's place. */
        hi = k->n;
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            int c = cmp_entry(&k->e[mid], e->is_signed, e->subkey, e->subkey_len);
            if (c == 0) {
                sentry *x = &k->e[mid];
                if (x->expires >= e->expires && x->expires > now)
                    return 0;
                if (s->bytes - x->value_len + e->value_len > s->lim.max_bytes)
                    return -ENOSPC;
                val = malloc(e->value_len ? e->value_len : 1);
                if (!val)
                    return -ENOMEM;
                if (e->value_len)
                    memcpy(val, e->value, e->value_len);
                s->bytes = s->bytes - x->value_len + e->value_len;
                free(x->value);
                x->value = val;
                x->value_len = e->value_len;
                x->expires = e->expires;
                memcpy(x->pk, e->pk, 32);
                memcpy(x->sig, e->sig, 64);
                return 1;
            }
            if (c < 0)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (k->n >= s->lim.max_subkeys)
            return -ENOSPC;
    } else if (s->n_keys >= s->lim.max_keys) {
        return -ENOSPC;
    }
    if (s->bytes + e->value_len + ENTRY_OVERHEAD > s->lim.max_bytes)
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
    memmove(&k->e[lo + 1], &k->e[lo], (k->n - lo) * sizeof *k->e);
    sentry *x = &k->e[lo];
    memset(x, 0, sizeof *x);
    if (e->subkey_len)
        memcpy(x->subkey, e->subkey, e->subkey_len);
    x->subkey_len = (uint8_t)e->subkey_len;
    x->is_signed = (uint8_t)e->is_signed;
    memcpy(x->pk, e->pk, 32);
    memcpy(x->sig, e->sig, 64);
    x->expires = e->expires;
    x->value = val;
    x->value_len = e->value_len;
    k->n++;
    s->n_entries++;
    s->bytes += e->value_len + ENTRY_OVERHEAD;
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
                s->bytes -= k->e[i].value_len + ENTRY_OVERHEAD;
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
