/* swarm/modeldesc.c: a model's description in the DHT, both sides:
 * publishing its chunks and fetching, checking and parsing them
 * (swarm/modeldesc.h). */
#include "swarm/modeldesc.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "dht/id.h"
#include "dht/mp.h"
#include "expert/model.h"
#include "expert/modelfile.h"
#include "swarm/announce.h"

#define FETCH_PARALLEL 8   /* dht_gets in flight per fetch */

/* ---- the format ---- */

void peer_modeldesc_hash(uint8_t hash[PEER_MODELDESC_HASH_LEN], const void *json, size_t len)
{
    uint8_t full[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(full, json, len);
    memcpy(hash, full, PEER_MODELDESC_HASH_LEN);
}

void peer_modeldesc_key(uint8_t key[DHT_ID_LEN], const uint8_t hash[PEER_MODELDESC_HASH_LEN], int i)
{
    char hex[DHT_ID_HEX_LEN + 1], name[96];
    dht_id_to_hex(hex, hash);
    int n = snprintf(name, sizeof name, "starling.model:%s:%d", hex, i);
    dht_id_of_bytes(key, name, (size_t)n);
}

int peer_modeldesc_chunks(size_t len)
{
    if (len == 0)
        return -EINVAL;
    size_t n = (len + PEER_MODELDESC_CHUNK - 1) / PEER_MODELDESC_CHUNK;
    return n > PEER_MODELDESC_MAX_CHUNKS ? -EFBIG : (int)n;
}

long peer_modeldesc_chunk_encode(const void *json, size_t len, int i, uint8_t *buf, size_t cap)
{
    int n = peer_modeldesc_chunks(len);
    if (!json || !buf || n < 0 || i < 0 || i >= n)
        return -EINVAL;
    size_t off = (size_t)i * PEER_MODELDESC_CHUNK;
    size_t clen = len - off < PEER_MODELDESC_CHUNK ? len - off : PEER_MODELDESC_CHUNK;
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, cap < DHT_MAX_VALUE ? cap : DHT_MAX_VALUE);
    msgpack_pack_map(&w.pk, 4);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, 1);
    dht_mp_pack_cstr(&w.pk, "n");
    msgpack_pack_uint64(&w.pk, (uint64_t)n);
    dht_mp_pack_cstr(&w.pk, "i");
    msgpack_pack_uint64(&w.pk, (uint64_t)i);
    dht_mp_pack_cstr(&w.pk, "c");
    msgpack_pack_bin(&w.pk, clen);
    msgpack_pack_bin_body(&w.pk, (const uint8_t *)json + off, clen);
    return dht_mp_writer_finish(&w);
}

static int chunk_decode(peer_modeldesc_chunk *out, const uint8_t *buf, size_t len)
{
    dht_mp_reader r;
    uint64_t n, u;
    char key[4];
    int have = 0;
    if (!buf || len > DHT_MAX_VALUE)
        return -1;
    dht_mp_reader_init(&r, buf, len);
    if (dht_mp_container(&r, 'm', &n) || n > 16)
        return -1;
    for (uint64_t k = 0; k < n; k++) {
        if (dht_mp_key(&r, key, sizeof key))
            return -1;
        if (!strcmp(key, "v")) {
            if (dht_mp_uint(&r, &u) || u != 1)
                return -1;
            have |= 1;
        } else if (!strcmp(key, "n")) {
            if (dht_mp_uint(&r, &u) || u < 1 || u > PEER_MODELDESC_MAX_CHUNKS)
                return -1;
            out->n = (int)u;
            have |= 2;
        } else if (!strcmp(key, "i")) {
            if (dht_mp_uint(&r, &u) || u >= PEER_MODELDESC_MAX_CHUNKS)
                return -1;
            out->i = (int)u;
            have |= 4;
        } else if (!strcmp(key, "c")) {
            if (dht_mp_bin(&r, &out->data, &out->len, PEER_MODELDESC_CHUNK) || out->len == 0)
                return -1;
            have |= 8;
        } else if (dht_mp_skip(&r, 1)) {
            return -1;
        }
    }
    if (!dht_mp_at_end(&r) || have != 15 || out->i >= out->n)
        return -1;
    /* Every chunk but the last is full, so one length splits one way. */
    if (out->i < out->n - 1 && out->len != PEER_MODELDESC_CHUNK)
        return -1;
    return 0;
}

int peer_modeldesc_chunk_decode(peer_modeldesc_chunk *out, const uint8_t *buf, size_t len)
{
    if (!out)
        return -EINVAL;
    memset(out, 0, sizeof *out);
    if (chunk_decode(out, buf, len) == 0)
        return 0;
    memset(out, 0, sizeof *out);
    return -EBADMSG;
}

/* ---- assembly ---- */

typedef struct variant {
    uint8_t *data;
    size_t len;
    int n;               /* the chunk count it claims */
    uint32_t signers;    /* bit s: signer slot s sent it */
    int count;           /* how many sent it (slots or not) */
} variant;

struct peer_modeldesc_asm {
    uint8_t hash[PEER_MODELDESC_HASH_LEN];
    uint8_t signer[PEER_MODELDESC_MAX_SIGNERS][DHT_ID_LEN];
    int n_signers;
    uint32_t dropped;    /* signers that sent two contents for one chunk */
    variant v[PEER_MODELDESC_MAX_CHUNKS][PEER_MODELDESC_MAX_VARIANTS];
    int nv[PEER_MODELDESC_MAX_CHUNKS];
};

static void short_hex(char out[9], const uint8_t *id)
{
    char hex[DHT_ID_HEX_LEN + 1];
    dht_id_to_hex(hex, id);
    memcpy(out, hex, 8);
    out[8] = '\0';
}

#define seterr(err, errlen, ...) \
    do { \
        if ((err) && (errlen)) \
            snprintf((err), (errlen), __VA_ARGS__); \
    } while (0)

peer_modeldesc_asm *peer_modeldesc_asm_create(const uint8_t hash[PEER_MODELDESC_HASH_LEN])
{
    peer_modeldesc_asm *a = calloc(1, sizeof *a);
    if (a && hash)
        memcpy(a->hash, hash, PEER_MODELDESC_HASH_LEN);
    return a;
}

void peer_modeldesc_asm_free(peer_modeldesc_asm *a)
{
    if (!a)
        return;
    for (int i = 0; i < PEER_MODELDESC_MAX_CHUNKS; i++)
        for (int k = 0; k < a->nv[i]; k++)
            free(a->v[i][k].data);
    free(a);
}

static void remove_variant(peer_modeldesc_asm *a, int i, int k)
{
    free(a->v[i][k].data);
    a->v[i][k] = a->v[i][--a->nv[i]];
    memset(&a->v[i][a->nv[i]], 0, sizeof a->v[i][0]);
}

/* Drops everything signer slot s sent. */
static void drop_signer(peer_modeldesc_asm *a, int s)
{
    uint32_t bit = 1u << s;
    a->dropped |= bit;
    for (int i = 0; i < PEER_MODELDESC_MAX_CHUNKS; i++)
        for (int k = a->nv[i] - 1; k >= 0; k--) {
            variant *v = &a->v[i][k];
            if (!(v->signers & bit))
                continue;
            v->signers &= ~bit;
            if (--v->count == 0)
                remove_variant(a, i, k);
        }
}

int peer_modeldesc_asm_add(peer_modeldesc_asm *a, const uint8_t signer[DHT_ID_LEN], int key_index,
                           const uint8_t *value, size_t len, char *err, size_t errlen)
{
    char who[9] = "?", h8[9];
    if (!a || !signer)
        return -EINVAL;
    short_hex(who, signer);
    short_hex(h8, a->hash);
    peer_modeldesc_chunk c;
    if (key_index < 0 || key_index >= PEER_MODELDESC_MAX_CHUNKS || peer_modeldesc_chunk_decode(&c, value, len)) {
        seterr(err, errlen, "description %s: chunk %d from peer %s is not a chunk value", h8, key_index, who);
        return -EBADMSG;
    }
    if (c.i != key_index) {
        seterr(err, errlen, "description %s: chunk %d from peer %s says it is chunk %d", h8, key_index, who, c.i);
        return -EBADMSG;
    }
    int s = -1;
    for (int k = 0; k < a->n_signers && s < 0; k++)
        if (!memcmp(a->signer[k], signer, DHT_ID_LEN))
            s = k;
    if (s < 0 && a->n_signers < PEER_MODELDESC_MAX_SIGNERS) {
        s = a->n_signers++;
        memcpy(a->signer[s], signer, DHT_ID_LEN);
    }
    uint32_t bit = s >= 0 ? 1u << s : 0;
    if (bit & a->dropped) {
        seterr(err, errlen, "description %s: peer %s sent two different copies of one chunk: ignored", h8, who);
        return -EEXIST;
    }
    int i = key_index, same_k = -1;
    for (int k = 0; k < a->nv[i]; k++) {
        variant *v = &a->v[i][k];
        int same = v->n == c.n && v->len == c.len && !memcmp(v->data, c.data, c.len);
        if (bit && (v->signers & bit)) {
            if (same)
                return 0;
            drop_signer(a, s);
            seterr(err, errlen, "description %s: peer %s sent two different copies of chunk %d: ignored", h8,
                   who, i);
            return -EEXIST;
        }
        if (same && same_k < 0)
            same_k = k;
    }
    if (same_k >= 0) {
        a->v[i][same_k].signers |= bit;
        a->v[i][same_k].count++;
        return 0;
    }
    if (a->nv[i] >= PEER_MODELDESC_MAX_VARIANTS) {
        seterr(err, errlen, "description %s: too many different copies of chunk %d: peer %s's ignored", h8, i,
               who);
        return -ENOSPC;
    }
    variant *v = &a->v[i][a->nv[i]];
    v->data = malloc(c.len);
    if (!v->data) {
        seterr(err, errlen, "out of memory");
        return -ENOMEM;
    }
    memcpy(v->data, c.data, c.len);
    v->len = c.len;
    v->n = c.n;
    v->signers = bit;
    v->count = 1;
    a->nv[i]++;
    return 0;
}

int peer_modeldesc_asm_want(const peer_modeldesc_asm *a)
{
    int want = 0;
    for (int i = 0; a && i < PEER_MODELDESC_MAX_CHUNKS; i++)
        for (int k = 0; k < a->nv[i]; k++)
            if (a->v[i][k].n > want)
                want = a->v[i][k].n;
    return want;
}

/* Concatenates parts[0..n) into a new buffer (NUL-terminated). */
static char *join_parts(variant *const *parts, int n, size_t *len)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += parts[i]->len;
    char *text = malloc(total + 1);
    if (!text)
        return NULL;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        memcpy(text + off, parts[i]->data, parts[i]->len);
        off += parts[i]->len;
    }
    text[total] = '\0';
    *len = total;
    return text;
}

/* Checks the whole text against the hash and, with name, the model in it.
 * Returns 1 (a spec in *out, or none asked for), 0 (wrong hash: err says
 * so, try another assembly), or -1 (the right bytes, but refused: err). */
static int check_text(const peer_modeldesc_asm *a, const char *text, size_t len, const char *from, const char *name,
                      int n_stages, struct expert_model_spec **out, char *err, size_t errlen)
{
    uint8_t got[PEER_MODELDESC_HASH_LEN];
    char h8[9], g8[9];
    short_hex(h8, a->hash);
    peer_modeldesc_hash(got, text, len);
    if (memcmp(got, a->hash, sizeof got) != 0) {
        short_hex(g8, got);
        seterr(err, errlen, "description %s: the chunks from %s hash to %s, not %s: refused", h8, from, g8, h8);
        return 0;
    }
    *out = NULL;
    char label[96], perr[512];
    snprintf(label, sizeof label, "description %s from %s", h8, from);
    struct expert_model_spec *m = expert_model_parse(text, len, label, perr, sizeof perr);
    if (!m) {
        seterr(err, errlen, "%.400s: refused", perr);
        return -1;
    }
    if (name && strcmp(m->name, name) != 0) {
        seterr(err, errlen, "description %s from %s describes model '%.48s', not '%s': refused", h8, from, m->name,
               name);
        expert_model_free(m);
        return -1;
    }
    if (n_stages > 0 && m->n_stages != n_stages) {
        seterr(err, errlen, "description %s from %s has %d stages, but its index entry says %d: refused", h8, from,
               m->n_stages, n_stages);
        expert_model_free(m);
        return -1;
    }
    char *canon = expert_model_to_json(m);
    if (!canon || strlen(canon) != len || memcmp(canon, text, len) != 0) {
        seterr(err, errlen, "description %s from %s is not the canonical JSON of its model: refused", h8, from);
        free(canon);
        expert_model_free(m);
        return -1;
    }
    free(canon);
    *out = m;
    return 1;
}

struct expert_model_spec *peer_modeldesc_asm_finish(peer_modeldesc_asm *a, const char *name, int n_stages,
                                                    size_t *json_len, char *err, size_t errlen)
{
    char h8[9], from[64], first_err[512] = "";
    variant *parts[PEER_MODELDESC_MAX_CHUNKS];
    int tried = 0, missing = -1;
    if (!a) {
        seterr(err, errlen, "no description");
        return NULL;
    }
    short_hex(h8, a->hash);
    /* Each publisher's own copy first, then the most common content of
     * each chunk. */
    for (int s = 0; s <= a->n_signers; s++) {
        uint32_t bit = s < a->n_signers ? 1u << s : 0;
        if (bit & a->dropped)
            continue;
        int n = 0, best = 0;
        for (int k = 0; k < a->nv[0]; k++)
            if (bit ? (a->v[0][k].signers & bit) != 0 : a->v[0][k].count > best) {
                n = a->v[0][k].n;
                best = a->v[0][k].count;
            }
        if (n == 0) {
            if (missing < 0)
                missing = 0;
            continue;
        }
        int ok = 1;
        for (int i = 0; i < n && ok; i++) {
            parts[i] = NULL;
            best = 0;
            for (int k = 0; k < a->nv[i]; k++) {
                variant *v = &a->v[i][k];
                if (v->n == n && (bit ? (v->signers & bit) != 0 : v->count > best)) {
                    parts[i] = v;
                    best = v->count;
                }
            }
            if (!parts[i]) {
                ok = 0;
                if (!bit && missing < 0)
                    missing = i;
            }
        }
        if (!ok)
            continue;
        if (!bit) { /* the pooled copy: skip it when one publisher sent all of it (tried above) */
            uint32_t common = ~0u;
            for (int i = 0; i < n; i++)
                common &= parts[i]->signers;
            if (common & ~a->dropped)
                continue;
        }
        if (bit) {
            char s8[9];
            short_hex(s8, a->signer[s]);
            snprintf(from, sizeof from, "peer %s", s8);
        } else {
            snprintf(from, sizeof from, "%s", a->n_signers == 1 ? "one peer" : "several peers");
        }
        size_t len;
        char *text = join_parts(parts, n, &len);
        if (!text) {
            seterr(err, errlen, "out of memory");
            return NULL;
        }
        struct expert_model_spec *m = NULL;
        char e[512];
        int rc = check_text(a, text, len, from, name, n_stages, &m, e, sizeof e);
        free(text);
        if (rc < 0) {
            seterr(err, errlen, "%s", e);
            return NULL;
        }
        if (rc > 0) {
            if (json_len)
                *json_len = len;
            return m;
        }
        if (!tried++)
            snprintf(first_err, sizeof first_err, "%s", e);
    }
    if (tried)
        seterr(err, errlen, "%s%s", first_err, tried > 1 ? " (and every other copy too)" : "");
    else if (missing >= 0 && peer_modeldesc_asm_want(a) > 0)
        seterr(err, errlen, "description %s: chunk %d not found", h8, missing);
    else
        seterr(err, errlen, "description %s: no chunk found", h8);
    return NULL;
}

/* ---- publishing ---- */

int peer_modeldesc_make(peer_modeldesc *out, const struct expert_model_spec *spec)
{
    memset(out, 0, sizeof *out);
    if (!spec)
        return -EINVAL;
    char *json = expert_model_to_json(spec);
    if (!json)
        return -EINVAL;
    size_t len = strlen(json);
    int n = peer_modeldesc_chunks(len);
    if (n < 0) {
        free(json);
        return n;
    }
    out->json = json;
    out->len = len;
    out->n_chunks = n;
    peer_modeldesc_hash(out->hash, json, len);
    return 0;
}

void peer_modeldesc_clear(peer_modeldesc *m)
{
    if (!m)
        return;
    free(m->json);
    memset(m, 0, sizeof *m);
}

int peer_modeldesc_publish(dht *d, const peer_modeldesc *desc, uint64_t expires_ms, dht_done_cb cb, void *ud)
{
    uint8_t val[DHT_MAX_VALUE], key[DHT_ID_LEN];
    int started = 0;
    if (!d || !desc || !desc->json)
        return 0;
    for (int i = 0; i < desc->n_chunks; i++) {
        long n = peer_modeldesc_chunk_encode(desc->json, desc->len, i, val, sizeof val);
        if (n < 0)
            continue;
        peer_modeldesc_key(key, desc->hash, i);
        if (dht_put(d, key, NULL, 0, val, (size_t)n, expires_ms, 1, cb, ud) == 0)
            started++;
    }
    return started;
}

/* ---- fetching ---- */

typedef struct cand {
    uint8_t hash[PEER_MODELDESC_HASH_LEN];
    uint8_t lister[DHT_ID_LEN];   /* the first index entry's signer that named it */
    int listers;
    peer_modeldesc_asm *as;
    int got0;                     /* chunk 0's read has answered */
    int want, next;               /* chunks to read; the next to ask for */
    char note[256];               /* the first chunk a publisher got wrong */
} cand;

typedef struct fetch {
    dht *d;
    char name[EXPERT_MODEL_NAME_MAX + 1];
    peer_modeldesc_fetch_cb cb;
    void *arg;
    cand c[PEER_MODELDESC_MAX_CANDIDATES];
    int n;
    int more;          /* index entries with descriptions beyond the cap */
    int named;         /* index entries naming the model */
    int inflight;
    int cancelled;
    int index_status;
} fetch;

typedef struct get_ctx {
    fetch *f;
    int c, i;
} get_ctx;

static void fetch_complete(fetch *f);
static void pump(fetch *f);

static void fetch_end(fetch *f, int status, struct expert_model_spec *spec, const uint8_t *hash, size_t len,
                      const char *msg)
{
    static const uint8_t zero[PEER_MODELDESC_HASH_LEN];
    f->cb(status, spec, hash ? hash : zero, len, msg, f->arg);
    for (int k = 0; k < f->n; k++)
        peer_modeldesc_asm_free(f->c[k].as);
    free(f);
}

static void on_chunk(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)d;
    get_ctx *g = ud;
    fetch *f = g->f;
    cand *c = &f->c[g->c];
    int i = g->i;
    free(g);
    f->inflight--;
    if (status == -ECANCELED)
        f->cancelled = 1;
    for (size_t k = 0; k < n; k++) {
        if (!e[k].is_signed || e[k].subkey_len != DHT_ID_LEN)
            continue;
        char err[256];
        if (peer_modeldesc_asm_add(c->as, e[k].subkey, i, e[k].value, e[k].value_len, err, sizeof err) != 0 &&
            !c->note[0])
            snprintf(c->note, sizeof c->note, "%s", err);
    }
    if (i == 0) {
        c->got0 = 1;
        c->want = peer_modeldesc_asm_want(c->as);
        c->next = 1;
    }
    pump(f);
}

static void ask(fetch *f, int ci, int i)
{
    uint8_t key[DHT_ID_LEN];
    get_ctx *g = malloc(sizeof *g);
    if (!g)
        return; /* the chunk goes missing; said when put together */
    g->f = f;
    g->c = ci;
    g->i = i;
    peer_modeldesc_key(key, f->c[ci].hash, i);
    int rc = dht_get(f->d, key, on_chunk, g);
    if (rc != 0) {
        free(g);
        if (rc == -ECANCELED)
            f->cancelled = 1;
        if (i == 0)
            f->c[ci].got0 = 1;
        return;
    }
    f->inflight++;
}

/* Starts reads up to FETCH_PARALLEL; completes once none is left. */
static void pump(fetch *f)
{
    for (int k = 0; k < f->n && f->inflight < FETCH_PARALLEL && !f->cancelled; k++) {
        cand *c = &f->c[k];
        while (c->got0 && c->next < c->want && f->inflight < FETCH_PARALLEL && !f->cancelled)
            ask(f, k, c->next++);
    }
    if (f->inflight == 0)
        fetch_complete(f);
}

static void append(char *buf, size_t cap, const char *s)
{
    size_t n = strlen(buf);
    if (n + 1 < cap)
        snprintf(buf + n, cap - n, "%s%s", n ? "; " : "", s);
}

static void fetch_complete(fetch *f)
{
    char msg[1536] = "", h8[9];
    struct expert_model_spec *ok = NULL;
    const uint8_t *ok_hash = NULL;
    size_t ok_len = 0;
    int valid = 0;
    char conflict[512] = "";
    if (f->cancelled) {
        fetch_end(f, -ECANCELED, NULL, NULL, 0, "the DHT closed during the fetch");
        return;
    }
    for (int k = 0; k < f->n; k++) {
        cand *c = &f->c[k];
        char err[512];
        size_t len = 0;
        struct expert_model_spec *m = peer_modeldesc_asm_finish(c->as, f->name, 0, &len, err, sizeof err);
        short_hex(h8, c->hash);
        if (!m) {
            char l8[9];
            short_hex(l8, c->lister);
            char line[900];
            snprintf(line, sizeof line, "%s (listed by peer %s%s)%s%s", err, l8, c->listers > 1 ? " and others" : "",
                     c->note[0] ? "; " : "", c->note);
            append(msg, sizeof msg, line);
            continue;
        }
        valid++;
        char item[64];
        snprintf(item, sizeof item, "%s%s (%d stages)", conflict[0] ? ", " : "", h8, m->n_stages);
        if (strlen(conflict) + strlen(item) + 1 < sizeof conflict)
            strcat(conflict, item);
        if (!ok) {
            ok = m;
            ok_hash = c->hash;
            ok_len = len;
        } else {
            expert_model_free(m);
        }
    }
    if (valid == 1) {
        fetch_end(f, 0, ok, ok_hash, ok_len, "ok");
        return;
    }
    if (valid > 1) {
        expert_model_free(ok);
        char line[1024];
        snprintf(line, sizeof line,
                 "%d different models are published under the name '%s' (descriptions %s): pass --model-file FILE "
                 "to choose",
                 valid, f->name, conflict);
        fetch_end(f, -ENOTUNIQ, NULL, NULL, 0, line);
        return;
    }
    char line[1700];
    snprintf(line, sizeof line, "model '%s': every description in the swarm was refused: %s%s", f->name, msg,
             f->more ? " (more descriptions were listed than are read)" : "");
    fetch_end(f, -EBADMSG, NULL, NULL, 0, line);
}

static void on_index(dht *d, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)d;
    fetch *f = ud;
    f->inflight--;
    f->index_status = status;
    if (status == -ECANCELED) {
        fetch_end(f, -ECANCELED, NULL, NULL, 0, "the DHT closed during the fetch");
        return;
    }
    /* The distinct descriptions listed for the name, the most listed
     * first: a forger that lists many hashes under its identities does not
     * push out the one every honest peer lists. */
    struct seen {
        uint8_t hash[PEER_MODELDESC_HASH_LEN], lister[DHT_ID_LEN];
        int listers;
    } seen[64];
    int n_seen = 0;
    for (size_t k = 0; k < n; k++) {
        peer_model_record m;
        if (!e[k].is_signed || e[k].subkey_len != DHT_ID_LEN ||
            peer_model_record_decode(&m, e[k].value, e[k].value_len) != 0 || strcmp(m.model, f->name) != 0)
            continue;
        f->named++;
        if (!m.has_desc)
            continue;
        int found = -1;
        for (int j = 0; j < n_seen && found < 0; j++)
            if (!memcmp(seen[j].hash, m.desc_hash, PEER_MODELDESC_HASH_LEN))
                found = j;
        if (found >= 0) {
            seen[found].listers++;
        } else if (n_seen < (int)(sizeof seen / sizeof seen[0])) {
            memcpy(seen[n_seen].hash, m.desc_hash, PEER_MODELDESC_HASH_LEN);
            memcpy(seen[n_seen].lister, e[k].subkey, DHT_ID_LEN);
            seen[n_seen++].listers = 1;
        } else {
            f->more++;
        }
    }
    for (int j = 0; j < n_seen; j++) {
        int best = -1;
        for (int q = 0; q < n_seen; q++)
            if (seen[q].listers > 0 && (best < 0 || seen[q].listers > seen[best].listers))
                best = q;
        if (f->n >= PEER_MODELDESC_MAX_CANDIDATES) {
            f->more++;
            continue;
        }
        cand *c = &f->c[f->n];
        memcpy(c->hash, seen[best].hash, PEER_MODELDESC_HASH_LEN);
        memcpy(c->lister, seen[best].lister, DHT_ID_LEN);
        c->listers = seen[best].listers;
        seen[best].listers = 0;
        c->as = peer_modeldesc_asm_create(c->hash);
        if (c->as)
            f->n++;
    }
    if (f->n == 0) {
        char line[256];
        if (status < 0 && f->named == 0)
            snprintf(line, sizeof line, "cannot read the swarm's models index: %s", strerror(-status));
        else if (f->named)
            snprintf(line, sizeof line,
                     "%d peer%s serve model '%s' but none publishes its description (older peers): pass "
                     "--model-file FILE",
                     f->named, f->named == 1 ? "" : "s", f->name);
        else
            snprintf(line, sizeof line, "no peer in the swarm publishes a model called '%s'", f->name);
        fetch_end(f, status < 0 && f->named == 0 ? -EHOSTUNREACH : -ENOENT, NULL, NULL, 0, line);
        return;
    }
    for (int k = 0; k < f->n; k++)
        ask(f, k, 0);
    pump(f);
}

int peer_modeldesc_fetch(dht *d, const char *name, peer_modeldesc_fetch_cb cb, void *arg)
{
    if (!d || !name || !cb || expert_model_name_check(name) != 0)
        return -EINVAL;
    fetch *f = calloc(1, sizeof *f);
    if (!f)
        return -ENOMEM;
    f->d = d;
    snprintf(f->name, sizeof f->name, "%s", name);
    f->cb = cb;
    f->arg = arg;
    uint8_t key[DHT_ID_LEN];
    dht_id_of_bytes(key, PEER_MODELS_KEY, strlen(PEER_MODELS_KEY));
    int rc = dht_get(d, key, on_index, f);
    if (rc != 0) {
        free(f);
        return rc;
    }
    f->inflight = 1;
    return 0;
}
