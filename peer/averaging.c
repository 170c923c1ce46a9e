#include "peer/averaging.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "dht/id.h"
#include "dht/mp.h"
#include "swarm/announce.h"
#include "peer/log.h"
#include "net/tensorfmt.h"
#include "net/wire.h"

/* A replica that finds no other entry looks again this many times while the
 * round lasts: the others' entries can be late (a put that meets dead
 * contacts waits a stale period per hop, more on a loaded machine). */
#define AVG_REGETS 3
/* A member that is asked about a round it sees otherwise reads the group
 * again at most this often. */
#define HINT_GAP_MS 200
#define MAX_CANDIDATES 256
/* Restarts of one round after another member cancelled it. */
#define AVG_RETRIES 3

typedef struct avg_block {
    struct peer_averaging *av;
    int block;
    uint64_t round;              /* the round of our latest matchmaking entry */
    uint64_t round_end_ms;       /* after this, no more lookups for it */
    int in_round;                /* an entry for `round` is stored */
    int putting, getting;        /* waiting for the gathering window / lookup in flight */
    int regets;                  /* lookups repeated this round while alone */
    int retries;                 /* rounds restarted after another member cancelled */
    uint64_t last_get_ms;
    peer_allreduce *ar;          /* the round running, or NULL */
    uint8_t digest[PEER_AVG_DIGEST_LEN]; /* its group */
    int has_next;                /* a new view of the group waits for ar's cancel */
    peer_avg_group next;
    uint64_t done_round;         /* the last round applied here (0: none) */
    uint64_t rounds, abandoned;
    uint64_t dropped, clipped;   /* contributions (peer_averaging_stats) */
    uint64_t last_bytes_in;      /* fetched by the round last applied */
    peer_avg_group cur;          /* the group ar runs */
    uint64_t said_round;         /* members already named for this round: */
    uint8_t said[PEER_ALLREDUCE_MAX_MEMBERS * 2][DHT_ID_LEN];
    int n_said;
    int group;
    int alone_said, period_said, skip_said;
} avg_block;

struct peer_averaging {
    peer_averaging_config cfg;
    char addr[65];
    uint64_t period_ms;
    uv_timer_t timer, gather;
    int handles;                 /* open timers */
    int inflight;                /* all-reduce callbacks still to come */
    int stopping, stopped;
    void (*stop_cb)(void *);
    void *stop_arg;
    avg_block b[PEER_SERVICE_MAX_BLOCKS];
};

#define say(o, ...) peer_log((o)->cfg.log, __VA_ARGS__)

/* ---- the matchmaking entry ---- */

/* q8's block (the default for 0); 0 for the other formats. */
static int norm_block(int fmt, int block)
{
    return fmt == PEER_FMT_Q8 ? (block ? block : PEER_FMT_Q8_BLOCK) : 0;
}

void peer_avg_fmt_key(uint8_t key[DHT_ID_LEN], const char *block, uint64_t stage_hash, int mode, int fmt,
                      int fmt_block)
{
    char m[16] = "", f[24] = "", name[200];
    if (mode == PEER_AVG_DILOCO)
        snprintf(m, sizeof m, ".diloco");
    else if (mode != PEER_AVG_MEAN)
        snprintf(m, sizeof m, ".%d", mode);
    if (fmt == PEER_FMT_Q8)
        snprintf(f, sizeof f, ".q8-%d", norm_block(fmt, fmt_block));
    else if (fmt != PEER_FMT_F32)
        snprintf(f, sizeof f, ".%s", peer_tensorfmt_name((peer_fmt)fmt) ? peer_tensorfmt_name((peer_fmt)fmt) : "?");
    int n = snprintf(name, sizeof name, "starling.avg%s%s:%.64s:%016" PRIx64, m, f, block, stage_hash);
    dht_id_of_bytes(key, name, (size_t)n);
}

void peer_avg_mode_key(uint8_t key[DHT_ID_LEN], const char *block, uint64_t stage_hash, int mode)
{
    peer_avg_fmt_key(key, block, stage_hash, mode, PEER_FMT_F32, 0);
}

void peer_avg_key(uint8_t key[DHT_ID_LEN], const char *block, uint64_t stage_hash)
{
    peer_avg_mode_key(key, block, stage_hash, PEER_AVG_MEAN);
}

long peer_avg_record_encode(const peer_avg_record *m, uint8_t *buf, size_t cap)
{
    if (!m || !buf || !m->addr[0] || !peer__printable(m->addr, 64) || m->optim < 0 || m->optim > 255 ||
        m->mode < 0 || m->mode > 255 || m->fmt < 0 || m->fmt > 255 || m->fmt_block < 0 || m->fmt_block > 65535)
        return -EINVAL;
    const int q8 = m->fmt == PEER_FMT_Q8;
    dht_mp_writer w;
    dht_mp_writer_init(&w, buf, cap);
    msgpack_pack_map(&w.pk, 4 + (m->period_ms > 0) + (m->mode != PEER_AVG_MEAN) + (m->fmt != PEER_FMT_F32) + q8);
    dht_mp_pack_cstr(&w.pk, "v");
    msgpack_pack_uint64(&w.pk, PEER_ANNOUNCE_VERSION);
    dht_mp_pack_cstr(&w.pk, "r");
    msgpack_pack_uint64(&w.pk, m->round);
    dht_mp_pack_cstr(&w.pk, "a");
    dht_mp_pack_cstr(&w.pk, m->addr);
    dht_mp_pack_cstr(&w.pk, "o");
    msgpack_pack_uint64(&w.pk, (uint64_t)m->optim);
    if (m->period_ms > 0) {
        dht_mp_pack_cstr(&w.pk, "p");
        msgpack_pack_uint64(&w.pk, m->period_ms);
    }
    if (m->mode != PEER_AVG_MEAN) {
        dht_mp_pack_cstr(&w.pk, "m");
        msgpack_pack_uint64(&w.pk, (uint64_t)m->mode);
    }
    if (m->fmt != PEER_FMT_F32) {
        dht_mp_pack_cstr(&w.pk, "f");
        msgpack_pack_uint64(&w.pk, (uint64_t)m->fmt);
    }
    if (q8) {
        dht_mp_pack_cstr(&w.pk, "fb");
        msgpack_pack_uint64(&w.pk, (uint64_t)norm_block(m->fmt, m->fmt_block));
    }
    return dht_mp_writer_finish(&w);
}

static int avg_field(dht_mp_reader *r, const char *key, void *outp, int *have)
{
    peer_avg_record *out = outp;
    uint64_t u;
    if (!strcmp(key, "r")) {
        if (dht_mp_uint(r, &out->round))
            return -1;
        *have |= 2;
    } else if (!strcmp(key, "a")) {
        if (dht_mp_cstr(r, out->addr, sizeof out->addr, 64) || !out->addr[0])
            return -1;
        *have |= 4;
    } else if (!strcmp(key, "o")) {
        if (dht_mp_uint(r, &u) || u > 255)
            return -1;
        out->optim = (int)u;
        *have |= 8;
    } else if (!strcmp(key, "p")) {
        if (dht_mp_uint(r, &out->period_ms))
            return -1;
    } else if (!strcmp(key, "m")) {
        if (dht_mp_uint(r, &u) || u > 255)
            return -1;
        out->mode = (int)u;
    } else if (!strcmp(key, "f")) {
        if (dht_mp_uint(r, &u) || u > 255)
            return -1;
        out->fmt = (int)u;
    } else if (!strcmp(key, "fb")) {
        if (dht_mp_uint(r, &u) || u > 65535)
            return -1;
        out->fmt_block = (int)u;
    } else {
        return 1;
    }
    return 0;
}

int peer_avg_record_decode(peer_avg_record *out, const uint8_t *buf, size_t len)
{
    /* required: v r a o */
    return peer__record_decode_into(out, sizeof *out, buf, len, avg_field, 15);
}

int peer_avg_candidates(const dht_entry *e, size_t n, uint64_t round, const peer_avg_candidate *self,
                        uint64_t our_period_ms, peer_avg_candidate *out, int cap, uint64_t *other_period_ms)
{
    if (other_period_ms)
        *other_period_ms = 0;
    if ((!e && n) || !self || !out || cap < 1)
        return -EINVAL;
    int nc = 0;
    for (size_t i = 0; i < n && nc < cap - 1; i++) {
        peer_avg_record r;
        if (!e[i].is_signed || e[i].subkey_len != DHT_ID_LEN ||
            peer_avg_record_decode(&r, e[i].value, e[i].value_len) != 0)
            continue;
        if (other_period_ms && !*other_period_ms && r.period_ms && r.period_ms != our_period_ms)
            *other_period_ms = r.period_ms;
        if (r.round != round || !memcmp(e[i].subkey, self->m.id, DHT_ID_LEN))
            continue; /* we are a member whether or not our own entry came back */
        if (r.mode != self->mode || r.fmt != self->fmt ||
            norm_block(r.fmt, r.fmt_block) != norm_block(self->fmt, self->fmt_block))
            continue; /* averages otherwise: never in our group */
        memcpy(out[nc].m.id, e[i].subkey, DHT_ID_LEN);
        snprintf(out[nc].m.addr, sizeof out[nc].m.addr, "%s", r.addr);
        out[nc].optim = (uint8_t)r.optim;
        out[nc].mode = (uint8_t)r.mode;
        out[nc].fmt = (uint8_t)r.fmt;
        out[nc].fmt_block = (uint16_t)norm_block(r.fmt, r.fmt_block);
        nc++;
    }
    out[nc++] = *self;
    return nc;
}

/* ---- the group (pure) ---- */

typedef struct ordered {
    peer_avg_candidate c;
    uint8_t order[8];            /* BLAKE2b(id, round): splits large groups alike everywhere */
} ordered;

static int cmp_order(const void *a, const void *b)
{
    return memcmp(((const ordered *)a)->order, ((const ordered *)b)->order, 8);
}

static int cmp_id(const void *a, const void *b)
{
    return memcmp(((const peer_avg_candidate *)a)->m.id, ((const peer_avg_candidate *)b)->m.id, DHT_ID_LEN);
}

int peer_avg_choose_group(const peer_avg_candidate *cand, int nc, const uint8_t self[DHT_ID_LEN],
                          uint64_t round, peer_avg_group *out)
{
    if (!cand || !self || !out || nc < 0 || nc > MAX_CANDIDATES)
        return -EINVAL;
    memset(out, 0, sizeof *out);
    static ordered all[MAX_CANDIDATES]; /* loop thread only */
    uint8_t rb[8];
    peer_put_le64(rb, round);
    int found = -1;
    for (int i = 0; i < nc && found < 0; i++)
        if (!memcmp(cand[i].m.id, self, DHT_ID_LEN))
            found = i;
    if (found < 0)
        return -ENOENT;
    /* Only members that average as we do, in our format. */
    const uint8_t mode = cand[found].mode, fmt = cand[found].fmt;
    const int fblock = norm_block(fmt, cand[found].fmt_block);
    int kept = 0;
    for (int i = 0; i < nc; i++) {
        if (cand[i].mode != mode || cand[i].fmt != fmt || norm_block(cand[i].fmt, cand[i].fmt_block) != fblock)
            continue;
        all[kept].c = cand[i];
        crypto_generichash_state st;
        crypto_generichash_init(&st, NULL, 0, 8);
        crypto_generichash_update(&st, cand[i].m.id, DHT_ID_LEN);
        crypto_generichash_update(&st, rb, sizeof rb);
        crypto_generichash_final(&st, all[kept].order, 8);
        kept++;
    }
    nc = kept;
    int lo = 0, hi = nc;
    if (nc > PEER_ALLREDUCE_MAX_MEMBERS) {
        qsort(all, (size_t)nc, sizeof all[0], cmp_order);
        int groups = (nc + PEER_ALLREDUCE_MAX_MEMBERS - 1) / PEER_ALLREDUCE_MAX_MEMBERS;
        for (int g = 0; g < groups; g++) {
            int a = nc * g / groups, b = nc * (g + 1) / groups;
            for (int i = a; i < b; i++)
                if (!memcmp(all[i].c.m.id, self, DHT_ID_LEN)) {
                    lo = a;
                    hi = b;
                }
        }
    }
    int gn = hi - lo;
    if (gn < 2)
        return -ENOENT;
    peer_avg_candidate grp[PEER_ALLREDUCE_MAX_MEMBERS];
    for (int i = 0; i < gn; i++)
        grp[i] = all[lo + i].c;
    qsort(grp, (size_t)gn, sizeof grp[0], cmp_id);
    uint8_t ids[PEER_ALLREDUCE_MAX_MEMBERS][DHT_ID_LEN], tags[PEER_ALLREDUCE_MAX_MEMBERS];
    out->with_optim = 1;
    for (int i = 0; i < gn; i++) {
        out->members[i] = grp[i].m;
        memcpy(ids[i], grp[i].m.id, DHT_ID_LEN);
        tags[i] = grp[i].optim;
        out->with_optim &= grp[i].optim == grp[0].optim;
        if (!memcmp(grp[i].m.id, self, DHT_ID_LEN))
            out->me = i;
    }
    out->n = gn;
    out->mode = mode;
    out->fmt = fmt;
    out->fmt_block = fblock;
    peer_allreduce_digest_fmt(out->digest, round, (const uint8_t(*)[DHT_ID_LEN])ids, tags, gn, mode, fmt, fblock);
    return 0;
}

/* ---- rounds ---- */

static void maybe_done(peer_averaging *av)
{
    if (!av->stopping || av->handles > 0 || av->inflight > 0 || av->stopped)
        return;
    av->stopped = 1;
    if (av->stop_cb)
        av->stop_cb(av->stop_arg);
}

static void block_name(peer_averaging *av, int i, peer_block_info *info)
{
    if (peer_service_block_info(av->cfg.svc, i, info) != 0)
        memset(info, 0, sizeof *info);
}

static void on_round_done(void *arg, int status, const peer_allreduce_result *res);
static void look_up_group(avg_block *c);

/* Whether round `round` of c may still begin or regroup: ours, not
 * applied yet, within its time. */
static int round_open(const avg_block *c, uint64_t round)
{
    return c->in_round && c->round == round && c->done_round != round && dht_now_ms() < c->round_end_ms;
}

static void begin_group(avg_block *c, const peer_avg_group *g)
{
    peer_averaging *av = c->av;
    if (!round_open(c, c->round))
        return; /* applied already (a late view), or out of time */
    if (c->ar) {
        if (!memcmp(c->digest, g->digest, PEER_AVG_DIGEST_LEN))
            return; /* the view we are running */
        /* Another view: cancel ours, start this one from the callback. */
        c->next = *g;
        c->has_next = 1;
        peer_allreduce_cancel(c->ar);
        return;
    }
    peer_block_info info;
    block_name(av, c->block, &info);
    peer_allreduce_config ac = {0};
    ac.loop = av->cfg.loop;
    ac.self = av->cfg.self;
    ac.swarm_key = av->cfg.swarm_key;
    ac.srv = av->cfg.rounds;
    ac.block = c->block;
    ac.block_name = info.name;
    ac.round = c->round;
    ac.digest = g->digest;
    ac.members = g->members;
    ac.n = g->n;
    ac.me = g->me;
    ac.with_optim = g->with_optim;
    ac.method = av->cfg.method;
    uint64_t now = dht_now_ms();
    ac.timeout_s = c->round_end_ms > now + 1000 ? (double)(c->round_end_ms - now) / 1000.0 : 1.0;
    ac.cb = on_round_done;
    ac.arg = c;
    int rc = peer_allreduce_start(&ac, &c->ar);
    if (rc == 0) {
        memcpy(c->digest, g->digest, PEER_AVG_DIGEST_LEN);
        c->cur = *g;
        av->inflight++;
    } else {
        c->abandoned++;
        say(av, "%s: cannot begin averaging round %" PRIu64 ": %s", info.name, c->round, strerror(-rc));
    }
}

/* Names member j of the current group once per round: counts it and logs
 * why (what: 0 dropped, 1 clipped, 2 published a non-finite reduced part, 3 published a reduced
 * part far from the others', which we did not apply). A round that is
 * regrouped can reduce twice; the member is still named once. */
static void name_member(avg_block *c, const char *block, int j, int what)
{
    peer_averaging *av = c->av;
    if (j < 0 || j >= c->cur.n)
        return;
    const peer_allreduce_member *m = &c->cur.members[j];
    if (c->said_round != c->round) {
        c->said_round = c->round;
        c->n_said = 0;
    }
    for (int i = 0; i < c->n_said; i++)
        if (!memcmp(c->said[i], m->id, DHT_ID_LEN))
            return;
    if (c->n_said < (int)(sizeof c->said / sizeof c->said[0]))
        memcpy(c->said[c->n_said++], m->id, DHT_ID_LEN);
    char hex[17];
    for (int i = 0; i < 8; i++)
        snprintf(hex + 2 * i, 3, "%02x", m->id[i]);
    if (what == 0) {
        c->dropped++;
        say(av, "%s: averaging round %" PRIu64 ": member %s (%s) sent non-finite values; left out of the average "
                "of our part", block, c->round, hex, m->addr);
    } else if (what == 1) {
        c->clipped++;
        say(av, "%s: averaging round %" PRIu64 ": member %s (%s) sent values far from the group's (over %.0fx the "
                "typical distance to the median); clipped", block, c->round, hex, m->addr,
            PEER_ALLREDUCE_CLIP_FACTOR);
    } else if (what == 2) {
        c->dropped++;
        say(av, "%s: averaging round %" PRIu64 ": member %s (%s) published a non-finite average of its part; "
                "round refused", block, c->round, hex, m->addr);
    } else {
        c->dropped++;
        say(av, "%s: averaging round %" PRIu64 ": member %s (%s) published an average of its part that moves "
                "our values over %.0fx as far as the others' parts do; kept our own values there",
            block, c->round, hex, m->addr, PEER_ALLREDUCE_PART_FACTOR);
    }
}

static void on_round_done(void *arg, int status, const peer_allreduce_result *res)
{
    avg_block *c = arg;
    peer_averaging *av = c->av;
    c->ar = NULL;
    av->inflight--;
    if (av->stopping) {
        maybe_done(av);
        return;
    }
    peer_block_info info;
    block_name(av, c->block, &info);
    for (int j = 0; j < c->cur.n && j < 32; j++) {
        if (res->dropped >> j & 1)
            name_member(c, info.name, j, 0);
        else if (res->clipped >> j & 1)
            name_member(c, info.name, j, 1);
    }
    if (res->bad_reducer >= 0)
        name_member(c, info.name, res->bad_reducer, 2);
    for (int j = 0; j < c->cur.n && j < 32; j++)
        if (res->rejected >> j & 1)
            name_member(c, info.name, j, 3);
    if (status == 0) {
        c->has_next = 0; /* it succeeded before the cancel took: done for this round */
        c->done_round = c->round;
        c->rounds++;
        c->group = res->n;
        c->alone_said = 0;
        c->last_bytes_in = res->bytes_in;
        /* The slices' format, when not f32 ("q8:64 slices, "). */
        char how[40] = "";
        const peer_avg_method *h = &av->cfg.method;
        if (h->fmt == PEER_FMT_Q8)
            snprintf(how, sizeof how, "q8:%d slices, ", norm_block(h->fmt, h->fmt_block));
        else if (h->fmt != PEER_FMT_F32)
            snprintf(how, sizeof how, "%s slices, ", peer_tensorfmt_name((peer_fmt)h->fmt));
        if (h->mode == PEER_AVG_DILOCO)
            say(av,
                "%s: averaged in a group of %d (diloco, round %" PRIu64 ", our weight %.3g, %s%.3f MB in %.2f s; "
                "distance to the new anchor %.6g -> %.6g)",
                info.name, res->n, c->round, res->weight_self, how, (double)res->bytes_in / 1e6, res->seconds,
                res->dist_before, res->dist_after);
        else
            say(av,
                "%s: averaged in a group of %d (round %" PRIu64 ", our weight %.3g, %s%.3f MB in %.2f s; distance "
                "to the group average %.6g -> %.6g)",
                info.name, res->n, c->round, res->weight_self, how, (double)res->bytes_in / 1e6, res->seconds,
                res->dist_before, res->dist_after);
        return;
    }
    if (c->has_next) {
        c->has_next = 0;
        peer_avg_group g = c->next;
        begin_group(c, &g);
        return;
    }
    /* Another member cancelled: most often it saw another group and starts
     * that one now. Look at the group again while the round has time. */
    if ((status == -ECANCELED || status == -ESTALE) && c->retries < AVG_RETRIES &&
        dht_now_ms() + 2000 < c->round_end_ms && !c->getting) {
        c->retries++;
        look_up_group(c);
        return;
    }
    if (status == -ENODATA) {
        /* Not a failure: nobody has anything to share yet. Said once. */
        if (!c->skip_said)
            say(av, "%s: averaging round %" PRIu64 " in a group of %d skipped: every member has initial weights "
                    "(said once)", info.name, c->round, res->n);
        c->skip_said = 1;
        return;
    }
    c->abandoned++;
    say(av, "%s: averaging round %" PRIu64 " in a group of %d abandoned (%s); weights unchanged", info.name,
            c->round, res->n, strerror(-status));
}

static uint64_t gather_ms(const peer_averaging *av)
{
    uint64_t g = av->period_ms / 4;
    return g < 300 ? 300 : g > 2000 ? 2000 : g;
}

/* Says once per block that a replica averages with another period. */
static void check_period(avg_block *c, const char *name, uint64_t theirs)
{
    peer_averaging *av = c->av;
    uint64_t ours = av->period_ms;
    if (!theirs || theirs == ours || c->period_said)
        return;
    c->period_said = 1;
    uint64_t a = ours, b = theirs;
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    double lcm_s = (double)(ours / a) * (double)theirs / 1000.0;
    say(av,
        "%s: a replica averages every %.1f s, this peer every %.1f s: they average together only every %.0f s "
        "(give every replica the same --average-every)",
        name, (double)theirs / 1000.0, (double)ours / 1000.0, lcm_s);
}

static void on_gather(uv_timer_t *t);

static void on_group(dht *dh, int status, const dht_entry *e, size_t n, void *ud)
{
    (void)dh;
    avg_block *c = ud;
    peer_averaging *av = c->av;
    c->getting = 0;
    if (av->stopping || !round_open(c, c->round))
        return;
    peer_block_info info;
    block_name(av, c->block, &info);
    const uint8_t *self = av->cfg.self->id;
    static peer_avg_candidate cand[MAX_CANDIDATES]; /* loop thread only */
    peer_avg_candidate me = {0};
    memcpy(me.m.id, self, DHT_ID_LEN);
    snprintf(me.m.addr, sizeof me.m.addr, "%s", av->addr);
    me.optim = (uint8_t)av->cfg.optim_kind;
    me.mode = (uint8_t)av->cfg.method.mode;
    me.fmt = (uint8_t)av->cfg.method.fmt;
    me.fmt_block = (uint16_t)norm_block(av->cfg.method.fmt, av->cfg.method.fmt_block);
    uint64_t theirs = 0;
    int nc = peer_avg_candidates(e, status == 0 ? n : 0, c->round, &me, av->period_ms, cand, MAX_CANDIDATES,
                                 &theirs);
    check_period(c, info.name, theirs);
    peer_avg_group g;
    if (peer_avg_choose_group(cand, nc, self, c->round, &g) == 0) {
        begin_group(c, &g);
        return;
    }
    if (c->ar)
        return; /* a view without the others: keep the group we have */
    /* No other replica's entry (yet). */
    uint64_t gather = gather_ms(av), end = c->round + av->period_ms;
    if (c->regets < AVG_REGETS && dht_now_ms() + gather / 2 + gather < end) {
        c->regets++;
        c->putting = 1;
        uv_timer_start(&av->gather, on_gather, gather / 2, 0);
    } else if (c->group >= 2 && !c->alone_said) {
        /* Said once when a block that had a group finds itself alone. */
        say(av, "%s: no other replica joined averaging round %" PRIu64, info.name, c->round);
        c->alone_said = 1;
    }
}

static void look_up_group(avg_block *c)
{
    peer_averaging *av = c->av;
    peer_block_info info;
    uint8_t key[DHT_ID_LEN];
    block_name(av, c->block, &info);
    peer_avg_fmt_key(key, info.name, info.stage_hash, av->cfg.method.mode, av->cfg.method.fmt,
                     av->cfg.method.fmt_block);
    c->last_get_ms = uv_now(av->cfg.loop);
    if (dht_get(av->cfg.dht, key, on_group, c) == 0)
        c->getting = 1;
}

static void on_gather(uv_timer_t *t)
{
    peer_averaging *av = t->data;
    if (av->stopping)
        return;
    for (int i = 0; i < peer_service_n_blocks(av->cfg.svc); i++) {
        avg_block *c = &av->b[i];
        if (!c->putting || c->ar || c->getting)
            continue;
        c->putting = 0;
        look_up_group(c);
    }
}

/* The rounds' hint: a member asked about `round` and sees another group. */
static void on_hint(void *arg, int block, uint64_t round)
{
    peer_averaging *av = arg;
    if (av->stopping || block < 0 || block >= peer_service_n_blocks(av->cfg.svc))
        return;
    avg_block *c = &av->b[block];
    if (!round_open(c, round) || c->getting || uv_now(av->cfg.loop) - c->last_get_ms < HINT_GAP_MS)
        return;
    c->putting = 0;
    look_up_group(c);
}

static void on_tick(uv_timer_t *t);

static void schedule(peer_averaging *av)
{
    uint64_t p = av->period_ms, now = dht_now_ms();
    uv_timer_start(&av->timer, on_tick, p - now % p, 0);
}

/* A round starts: each block stores its matchmaking entry. */
static void on_tick(uv_timer_t *t)
{
    peer_averaging *av = t->data;
    if (av->stopping)
        return;
    schedule(av);
    if (av->cfg.ready && !av->cfg.ready(av->cfg.ready_arg))
        return;
    uint64_t now = dht_now_ms(), round = now - now % av->period_ms;
    uint64_t timeout_ms = (uint64_t)(av->cfg.round_timeout_s * 1000);
    uint8_t val[PEER_ANNOUNCE_MAX_BYTES], key[DHT_ID_LEN];
    int started = 0;
    for (int i = 0; i < peer_service_n_blocks(av->cfg.svc); i++) {
        avg_block *c = &av->b[i];
        if (c->ar || c->getting)
            continue; /* the last round of this block is still running */
        /* The last round's buffers were kept a period for slower members. */
        peer_allreduce_server_release(av->cfg.rounds, i);
        c->in_round = 0;
        peer_block_info info;
        block_name(av, i, &info);
        peer_avg_record r = {0};
        r.round = round;
        snprintf(r.addr, sizeof r.addr, "%s", av->addr);
        r.optim = av->cfg.optim_kind;
        r.period_ms = av->period_ms;
        r.mode = av->cfg.method.mode;
        r.fmt = av->cfg.method.fmt;
        r.fmt_block = norm_block(r.fmt, av->cfg.method.fmt_block);
        long n = peer_avg_record_encode(&r, val, sizeof val);
        if (n < 0)
            continue;
        peer_avg_fmt_key(key, info.name, info.stage_hash, r.mode, r.fmt, r.fmt_block);
        /* Lives as long as the round may (late members look it up), and
         * expires strictly later each round. */
        if (dht_put(av->cfg.dht, key, NULL, 0, val, (size_t)n, now + timeout_ms + 5000, 1, NULL, NULL) == 0) {
            c->round = round;
            c->round_end_ms = now + timeout_ms;
            c->in_round = 1;
            c->regets = 0;
            c->retries = 0;
            c->putting = 1;
            started++;
        }
    }
    if (started)
        uv_timer_start(&av->gather, on_gather, gather_ms(av), 0);
}

peer_averaging *peer_averaging_start(const peer_averaging_config *cfg)
{
    if (!cfg || !cfg->loop || !cfg->dht || !cfg->self || !cfg->svc || !cfg->rounds || !cfg->addr ||
        !(cfg->every_s > 0))
        return NULL;
    const peer_avg_method *h = &cfg->method;
    if (h->mode != PEER_AVG_MEAN &&
        (h->mode != PEER_AVG_DILOCO || !(h->outer_lr > 0 && isfinite(h->outer_lr)) || !(h->outer_momentum >= 0 && h->outer_momentum < 1)))
        return NULL;
    if (peer_tensorfmt_check((peer_fmt)h->fmt, norm_block(h->fmt, h->fmt_block)) != 0 ||
        (h->fmt != PEER_FMT_Q8 && h->fmt_block != 0))
        return NULL;
    peer_averaging *av = calloc(1, sizeof *av);
    if (!av)
        return NULL;
    av->cfg = *cfg;
    if (!(av->cfg.round_timeout_s > 0))
        av->cfg.round_timeout_s = 30.0;
    snprintf(av->addr, sizeof av->addr, "%s", cfg->addr);
    av->cfg.addr = av->addr;
    av->period_ms = (uint64_t)(cfg->every_s * 1000);
    if (!av->period_ms)
        av->period_ms = 1;
    for (int i = 0; i < PEER_SERVICE_MAX_BLOCKS; i++) {
        av->b[i].av = av;
        av->b[i].block = i;
    }
    uv_timer_init(cfg->loop, &av->timer);
    uv_timer_init(cfg->loop, &av->gather);
    av->timer.data = av->gather.data = av;
    av->handles = 2;
    peer_allreduce_server_set_hint(cfg->rounds, on_hint, av);
    schedule(av);
    return av;
}

void peer_averaging_anchor(peer_averaging *av)
{
    if (!av || av->cfg.method.mode != PEER_AVG_DILOCO)
        return;
    for (int i = 0; i < peer_service_n_blocks(av->cfg.svc); i++) {
        int rc = peer_allreduce_server_anchor(av->cfg.rounds, i);
        if (rc != 0) {
            peer_block_info info;
            block_name(av, i, &info);
            say(av, "%s: cannot set the diloco anchor (%s); its first round will take it", info.name,
                strerror(-rc));
        }
    }
}

void peer_averaging_get_stats(const peer_averaging *av, int i, peer_averaging_stats *out)
{
    memset(out, 0, sizeof *out);
    if (!av || i < 0 || i >= PEER_SERVICE_MAX_BLOCKS)
        return;
    out->rounds = av->b[i].rounds;
    out->abandoned = av->b[i].abandoned;
    out->group = av->b[i].group;
    out->dropped = av->b[i].dropped;
    out->clipped = av->b[i].clipped;
    peer_allreduce_server_bytes(av->cfg.rounds, i, &out->bytes_received, &out->bytes_sent);
    out->last_bytes_received = av->b[i].last_bytes_in;
    out->last_bytes_sent =
        av->b[i].rounds ? peer_allreduce_server_round_sent(av->cfg.rounds, i, av->b[i].done_round) : 0;
}

static void on_timer_closed(uv_handle_t *h)
{
    peer_averaging *av = h->data;
    av->handles--;
    maybe_done(av);
}

void peer_averaging_destroy(peer_averaging **p)
{
    if (!p || !*p)
        return;
    free(*p);
    *p = NULL;
}

void peer_averaging_stop(peer_averaging *av, void (*cb)(void *arg), void *arg)
{
    if (!av || av->stopping)
        return;
    av->stopping = 1;
    av->stop_cb = cb;
    av->stop_arg = arg;
    peer_allreduce_server_set_hint(av->cfg.rounds, NULL, NULL);
    for (int i = 0; i < PEER_SERVICE_MAX_BLOCKS; i++) {
        av->b[i].has_next = 0;
        if (av->b[i].ar)
            peer_allreduce_cancel(av->b[i].ar);
    }
    uv_timer_stop(&av->timer);
    uv_timer_stop(&av->gather);
    uv_close((uv_handle_t *)&av->timer, on_timer_closed);
    uv_close((uv_handle_t *)&av->gather, on_timer_closed);
}
