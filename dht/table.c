#include "dht/table.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

typedef struct bucket {
    dht_table_entry *e;     /* up to k, capacity grows */
    uint8_t n, cap;
    uint8_t n_repl;
    dht_table_entry *repl;  /* DHT_TABLE_REPLACEMENTS, oldest first */
    uint64_t refreshed;
} bucket;

struct dht_table {
    uint8_t self[DHT_ID_LEN];
    size_t k, size;
    int diversity;          /* enum dht_diversity */
    bucket b[DHT_BUCKETS];
};

int dht_id_common_prefix(const uint8_t self[DHT_ID_LEN], const uint8_t id[DHT_ID_LEN])
{
    for (int i = 0; i < DHT_ID_LEN; i++) {
        uint8_t x = self[i] ^ id[i];
        if (x) {
            int bit = 0;
            while (!(x & 0x80)) {
                x <<= 1;
                bit++;
            }
            return i * 8 + bit;
        }
    }
    return -1;
}

int dht_id_distance_cmp(const uint8_t target[DHT_ID_LEN], const uint8_t a[DHT_ID_LEN],
                        const uint8_t b[DHT_ID_LEN])
{
    for (int i = 0; i < DHT_ID_LEN; i++) {
        uint8_t da = a[i] ^ target[i], db = b[i] ^ target[i];
        if (da != db)
            return da < db ? -1 : 1;
    }
    return 0;
}

dht_table *dht_table_create(const uint8_t self[DHT_ID_LEN], size_t k)
{
    dht_table *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    memcpy(t->self, self, DHT_ID_LEN);
    t->k = k ? (k > 255 ? 255 : k) : DHT_K;
    return t;
}

void dht_table_destroy(dht_table **p)
{
    if (!p || !*p)
        return;
    for (int i = 0; i < DHT_BUCKETS; i++) {
        free((*p)->b[i].e);
        free((*p)->b[i].repl);
    }
    free(*p);
    *p = NULL;
}

void dht_table_set_diversity(dht_table *t, int mode)
{
    t->diversity = mode;
}

/* 1 if an entry at addr may join bucket bi: its network has fewer than
 * DHT_TABLE_PER_BUCKET_NET entries there and fewer than DHT_TABLE_PER_NET in
 * the table, its IP fewer than DHT_TABLE_PER_IP. skip and skip2 (if not
 * NULL) are not counted: an entry about to leave, the node's own copy.
 * Replacements count too, so that one network cannot fill a replacement
 * cache either. O(table size), paid only for nodes not yet in the table. */
static int fits(const dht_table *t, int bi, const dht_addr *addr, const dht_table_entry *skip,
                const dht_table_entry *skip2)
{
    dht_addr net, ip, x;
    size_t in_bucket = 0, in_table = 0, same_ip = 0;
    if (!dht_addr_limited(addr, t->diversity))
        return 1;
    unsigned bits = dht_addr_net_bits(addr);
    dht_addr_prefix(&net, addr, bits);
    dht_addr_prefix(&ip, addr, 128);
    for (int j = 0; j < DHT_BUCKETS; j++) {
        const bucket *b = &t->b[j];
        for (int pass = 0; pass < 2; pass++) {
            const dht_table_entry *e = pass ? b->repl : b->e;
            size_t n = pass ? b->n_repl : b->n;
            for (size_t i = 0; i < n; i++) {
                if (&e[i] == skip || &e[i] == skip2 || e[i].addr.family != addr->family)
                    continue;
                dht_addr_prefix(&x, &e[i].addr, bits);
                if (!dht_addr_equal(&x, &net))
                    continue;
                in_bucket += j == bi;
                in_table++;
                dht_addr_prefix(&x, &e[i].addr, 128);
                same_ip += dht_addr_equal(&x, &ip);
            }
        }
    }
    return in_bucket < DHT_TABLE_PER_BUCKET_NET && in_table < DHT_TABLE_PER_NET &&
           same_ip < DHT_TABLE_PER_IP;
}

static dht_table_entry *find_in(dht_table_entry *e, size_t n, const uint8_t id[DHT_ID_LEN])
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(e[i].id, id, DHT_ID_LEN) == 0)
            return &e[i];
    return NULL;
}

static void fill(dht_table_entry *e, const uint8_t id[DHT_ID_LEN], const dht_addr *addr,
                 const uint8_t *token, uint64_t now)
{
    memset(e, 0, sizeof *e);
    memcpy(e->id, id, DHT_ID_LEN);
    e->addr = *addr;
    e->last_seen = now;
    if (token) {
        e->has_token = 1;
        memcpy(e->token, token, DHT_TOKEN_LEN);
    }
}

int dht_table_insert(dht_table *t, const uint8_t id[DHT_ID_LEN], const dht_addr *addr,
                     const uint8_t *token, uint64_t now, dht_table_entry **ping_out)
{
    int i = dht_id_common_prefix(t->self, id);
    dht_table_entry *e;
    if (ping_out)
        *ping_out = NULL;
    if (i < 0)
        return -EINVAL;
    bucket *b = &t->b[i];
    e = find_in(b->e, b->n, id);
    if (e) {
        if (!dht_addr_equal(&e->addr, addr))
            return -EEXIST;
        e->last_seen = now;
        e->fails = 0;
        e->pinging = 0;
        if (token) {
            e->has_token = 1;
            memcpy(e->token, token, DHT_TOKEN_LEN);
        }
        return DHT_TABLE_UPDATED;
    }
    e = b->repl ? find_in(b->repl, b->n_repl, id) : NULL;
    if (!fits(t, i, addr, e, NULL))
        return -EDQUOT;
    if (b->n < t->k) {
        if (b->n == b->cap) {
            size_t nc = b->cap ? b->cap * 2u : 4u;
            if (nc > t->k)
                nc = t->k;
            dht_table_entry *ne = realloc(b->e, nc * sizeof *ne);
            if (!ne)
                return -ENOMEM;
            b->e = ne;
            b->cap = (uint8_t)nc;
        }
        /* It may have been waiting as a replacement: drop that copy. */
        e = find_in(b->repl, b->n_repl, id);
        if (e) {
            memmove(e, e + 1, (size_t)(b->repl + b->n_repl - e - 1) * sizeof *e);
            b->n_repl--;
        }
        fill(&b->e[b->n++], id, addr, token, now);
        t->size++;
        return DHT_TABLE_ADDED;
    }
    /* Full bucket: remember the newcomer, newest last. */
    if (!b->repl) {
        b->repl = calloc(DHT_TABLE_REPLACEMENTS, sizeof *b->repl);
        if (!b->repl)
            return -ENOMEM;
    }
    e = find_in(b->repl, b->n_repl, id);
    if (e) {
        memmove(e, e + 1, (size_t)(b->repl + b->n_repl - e - 1) * sizeof *e);
        b->n_repl--;
    } else if (b->n_repl == DHT_TABLE_REPLACEMENTS) {
        memmove(b->repl, b->repl + 1, (DHT_TABLE_REPLACEMENTS - 1) * sizeof *b->repl);
        b->n_repl--;
    }
    fill(&b->repl[b->n_repl++], id, addr, token, now);
    if (ping_out) {
        dht_table_entry *lrs = &b->e[0];
        for (size_t j = 1; j < b->n; j++)
            if (b->e[j].last_seen < lrs->last_seen)
                lrs = &b->e[j];
        if (!lrs->pinging) {
            lrs->pinging = 1;
            *ping_out = lrs;
        }
    }
    return DHT_TABLE_CACHED;
}

dht_table_entry *dht_table_find(dht_table *t, const uint8_t id[DHT_ID_LEN])
{
    int i = dht_id_common_prefix(t->self, id);
    if (i < 0)
        return NULL;
    return find_in(t->b[i].e, t->b[i].n, id);
}

int dht_table_failed(dht_table *t, const uint8_t id[DHT_ID_LEN], int force)
{
    int i = dht_id_common_prefix(t->self, id);
    if (i < 0)
        return 0;
    bucket *b = &t->b[i];
    dht_table_entry *e = find_in(b->e, b->n, id);
    if (!e)
        return 0;
    e->pinging = 0;
    if (!force && ++e->fails < DHT_TABLE_MAX_FAILS)
        return 0;
    /* Promote the newest replacement that is within the per-network limits
     * once e is gone. (Replacements were counted when cached, so one fails
     * this only after dht_table_set_diversity tightened the limits.) */
    for (size_t r = b->n_repl; r-- > 0;) {
        dht_table_entry *rp = &b->repl[r];
        if (!fits(t, i, &rp->addr, e, rp))
            continue;
        *e = *rp;
        memmove(rp, rp + 1, (size_t)(b->n_repl - r - 1) * sizeof *rp);
        b->n_repl--;
        return 1;
    }
    *e = b->e[--b->n];
    t->size--;
    return 1;
}

/* Buckets in order of distance to target: with i = common_prefix(self,
 * target), bucket i agrees with target on i+1 bits, every deeper bucket on
 * exactly i bits, and bucket j < i on only j bits. So the groups {i},
 * {i+1..159}, {i-1}, {i-2}, ... {0} are each strictly farther than the one
 * before, and the walk can stop after the group that fills out. */
static size_t closest_add(const bucket *b, const uint8_t target[DHT_ID_LEN], size_t n,
                          dht_table_entry *out, size_t w)
{
    for (size_t j = 0; j < b->n; j++) {
        const dht_table_entry *e = &b->e[j];
        size_t pos = w;
        while (pos > 0 && dht_id_distance_cmp(target, e->id, out[pos - 1].id) < 0)
            pos--;
        if (pos >= n)
            continue;
        size_t keep = w < n ? w : n - 1;
        memmove(&out[pos + 1], &out[pos], (keep - pos) * sizeof *out);
        out[pos] = *e;
        if (w < n)
            w++;
    }
    return w;
}

size_t dht_table_closest(const dht_table *t, const uint8_t target[DHT_ID_LEN], size_t n,
                         dht_table_entry *out)
{
    size_t w = 0;
    int i = dht_id_common_prefix(t->self, target);
    if (!n)
        return 0;
    if (i < 0) {
        /* target is our own ID: every bucket j is closer than j-1. */
        for (int j = DHT_BUCKETS - 1; j >= 0 && w < n; j--)
            w = closest_add(&t->b[j], target, n, out, w);
        return w;
    }
    w = closest_add(&t->b[i], target, n, out, w);
    if (w < n)
        for (int j = i + 1; j < DHT_BUCKETS; j++)
            w = closest_add(&t->b[j], target, n, out, w);
    for (int j = i - 1; j >= 0 && w < n; j--)
        w = closest_add(&t->b[j], target, n, out, w);
    return w;
}

size_t dht_table_size(const dht_table *t)
{
    return t->size;
}

int dht_table_has_room(const dht_table *t, const uint8_t id[DHT_ID_LEN], const dht_addr *addr)
{
    int i = dht_id_common_prefix(t->self, id);
    if (i < 0)
        return 0;
    const bucket *b = &t->b[i];
    return b->n < t->k && !find_in(b->e, b->n, id) && (!addr || fits(t, i, addr, NULL, NULL));
}

int dht_table_depth(const dht_table *t)
{
    for (int i = DHT_BUCKETS - 1; i >= 0; i--)
        if (t->b[i].n)
            return i;
    return -1;
}

uint64_t dht_table_bucket_refreshed(const dht_table *t, int i)
{
    return i >= 0 && i < DHT_BUCKETS ? t->b[i].refreshed : 0;
}

void dht_table_bucket_touch(dht_table *t, int i, uint64_t now)
{
    if (i >= 0 && i < DHT_BUCKETS)
        t->b[i].refreshed = now;
}
