/* routing/swarm.c: the swarm view (holders per stage, refreshed from the
 * DHT) and the replicas' records and choice (routing/swarm.h). */
#include "routing/swarm.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "swarm/holders.h"

struct route_swarm {
    route_lookup_fn lookup;
    void *lookup_ctx;
    const struct expert_model_spec *m;
    double refresh_s;
    double now;               /* time of the latest refresh call */
    int n;
    route_stage *stages;
    int refs;                 /* 1 for the owner + 1 per lookup in flight */
    int dead;
};

typedef struct lookup {
    route_swarm *s;
    int stage;
} lookup;

static void unref(route_swarm *s)
{
    if (--s->refs == 0) {
        free(s->stages);
        free(s);
    }
}

static int dht_lookup(void *ctx, const uint8_t key[DHT_ID_LEN], dht_get_cb cb, void *ud)
{
    return dht_get(ctx, key, cb, ud);
}

route_swarm *route_swarm_create(dht *d, const struct expert_model_spec *m, double refresh_s)
{
    return d ? route_swarm_create_with(dht_lookup, d, m, refresh_s) : NULL;
}

route_swarm *route_swarm_create_with(route_lookup_fn fn, void *ctx, const struct expert_model_spec *m,
                                     double refresh_s)
{
    if (!fn || !m || m->n_stages < 1 || !(refresh_s > 0))
        return NULL;
    route_swarm *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->stages = calloc((size_t)m->n_stages, sizeof *s->stages);
    if (!s->stages) {
        free(s);
        return NULL;
    }
    s->lookup = fn;
    s->lookup_ctx = ctx;
    s->m = m;
    s->refresh_s = refresh_s;
    s->n = m->n_stages;
    s->refs = 1;
    for (int i = 0; i < s->n; i++) {
        route_stage *st = &s->stages[i];
        struct expert_block_config c;
        expert_model_stage(m, i, &c);
        expert_stage_name(st->name, sizeof st->name, m, i);
        st->index = i;
        st->hash = expert_stage_hash(m, i);
        st->in = c.in;
        st->out = c.out;
        st->refreshed_at = -1e30;
    }
    return s;
}

int route_stage_usable(const route_stage *st)
{
    int n = 0;
    for (int i = 0; i < st->n_holders; i++)
        n += st->holders[i].ann.state == PEER_STATE_ONLINE;
    return n;
}

int route_stage_available(const route_stage *st, double now)
{
    int n = 0;
    for (int i = 0; i < st->n_holders; i++)
        n += st->holders[i].ann.state == PEER_STATE_ONLINE && !(st->holders[i].rep.banned_until > now);
    return n;
}

static void merge(route_stage *st, const dht_entry *e, size_t n)
{
    route_holder fresh[ROUTE_MAX_HOLDERS];
    int nf = 0, wrong = 0;
    for (size_t i = 0; i < n && nf < ROUTE_MAX_HOLDERS; i++) {
        swarm_holder sh;
        if (!swarm_holder_read(&sh, &e[i], st->name, st->hash))
            continue; /* not a holder's announcement for this stage */
        if (!sh.same_hash) {
            wrong++;
            continue;
        }
        const peer_announce *a = &sh.ann;
        route_holder *h = &fresh[nf++];
        /* Keep what we learned about a holder we already knew. */
        int known = -1;
        for (int j = 0; j < st->n_holders; j++)
            if (memcmp(st->holders[j].rep.id, sh.id, DHT_ID_LEN) == 0)
                known = j;
        if (known >= 0) {
            h->rep = st->holders[known].rep;
            /* A newer announcement: the holder is alive (perhaps back
             * after a restart), so its ban from earlier failures ends. */
            if (a->time_ms > st->holders[known].ann.time_ms)
                route_replica_unban(&h->rep);
        } else
            route_replica_init(&h->rep, sh.id, a->throughput, a->load);
        h->rep.tput = a->throughput;
        h->rep.load = a->load;
        h->ann = *a;
        h->expires_ms = sh.expires_ms;
    }
    /* Our requests in flight to a holder stay counted even if it vanished
     * from this lookup: its entry simply drops out of the choice. */
    memcpy(st->holders, fresh, (size_t)nf * sizeof *fresh);
    st->n_holders = nf;
    st->wrong_hash = wrong;
}

static void on_get(dht *d, int status, const dht_entry *entries, size_t n, void *ud)
{
    (void)d;
    lookup *lk = ud;
    route_swarm *s = lk->s;
    if (!s->dead) {
        route_stage *st = &s->stages[lk->stage];
        st->pending = 0;
        st->last_status = status;
        st->lookups++;
        st->refreshed_at = s->now;
        if (status == 0)
            merge(st, entries, n);
    }
    free(lk);
    unref(s);
}

int route_swarm_refresh(route_swarm *s, double now)
{
    if (!s || s->dead)
        return 0;
    s->now = now;
    int started = 0;
    for (int i = 0; i < s->n; i++) {
        route_stage *st = &s->stages[i];
        if (st->pending)
            continue;
        double age = now - st->refreshed_at;
        int due = age >= s->refresh_s || (route_stage_available(st, now) == 0 && age >= 1.0);
        if (!due)
            continue;
        lookup *lk = malloc(sizeof *lk);
        if (!lk)
            break;
        lk->s = s;
        lk->stage = i;
        uint8_t key[DHT_ID_LEN];
        dht_id_of_bytes(key, st->name, strlen(st->name));
        if (s->lookup(s->lookup_ctx, key, on_get, lk) != 0) {
            free(lk);
            continue;
        }
        st->pending = 1;
        s->refs++;
        started++;
    }
    return started;
}

void route_swarm_invalidate(route_swarm *s, int i)
{
    if (s && i >= 0 && i < s->n)
        s->stages[i].refreshed_at = -1e30;
}

int route_swarm_n_stages(const route_swarm *s)
{
    return s ? s->n : 0;
}

route_stage *route_swarm_stage(route_swarm *s, int i)
{
    return s && i >= 0 && i < s->n ? &s->stages[i] : NULL;
}

void route_swarm_destroy(route_swarm **ps)
{
    if (!ps || !*ps)
        return;
    (*ps)->dead = 1;
    unref(*ps);
    *ps = NULL;
}

route_holder *route_swarm_find_holder(route_swarm *s, int stage, const uint8_t id[DHT_ID_LEN])
{
    route_stage *st = route_swarm_stage(s, stage);
    for (int i = 0; st && i < st->n_holders; i++)
        if (!memcmp(st->holders[i].rep.id, id, DHT_ID_LEN))
            return &st->holders[i];
    return NULL;
}

void route_swarm_ban(route_swarm *s, const uint8_t id[DHT_ID_LEN], const char *addr, double now,
                     uint64_t *rng)
{
    for (int i = 0; i < route_swarm_n_stages(s); i++) {
        route_holder *h = route_swarm_find_holder(s, i, id);
        if (h && (!addr || !strcmp(h->ann.addr, addr)))
            route_replica_failure(&h->rep, now, rng);
    }
}

void route_swarm_unban(route_swarm *s, const uint8_t id[DHT_ID_LEN], const char *addr)
{
    for (int i = 0; i < route_swarm_n_stages(s); i++) {
        route_holder *h = route_swarm_find_holder(s, i, id);
        if (h && (!addr || !strcmp(h->ann.addr, addr)))
            route_replica_unban(&h->rep);
    }
}

void route_waits_mark(route_waits *w, int stage, int has_holder, double now)
{
    if (stage < 0 || stage >= ROUTE_SWARM_MAX_STAGES)
        return;
    if (has_holder)
        w->since[stage] = 0;
    else if (w->since[stage] == 0)
        w->since[stage] = now;
}

int route_waits_check(route_waits *w, route_swarm *s, double now, double max_wait, char *err,
                      size_t errlen, char *note, size_t notelen)
{
    int n = route_swarm_n_stages(s) < ROUTE_SWARM_MAX_STAGES ? route_swarm_n_stages(s) : ROUTE_SWARM_MAX_STAGES;
    for (int i = 0; i < n; i++) {
        double since = w->since[i];
        if (since == 0)
            continue;
        route_stage *st = route_swarm_stage(s, i);
        if (now - since > max_wait) {
            snprintf(err, errlen,
                     "stage %s has no online holder (waited %.0f s%s); start a peer with --blocks %d",
                     st->name, now - since,
                     st->wrong_hash ? ", and some holders run another version of the model" : "", i);
            return -ETIMEDOUT;
        }
        if (now - w->last_note[i] >= 5.0 && now - since >= 1.0) {
            w->last_note[i] = now;
            snprintf(note, notelen, "waiting for a holder of %s (%s; %.0f s so far, giving up after %.0f s)",
                     st->name, st->wrong_hash ? "holders found run another model version" : "none online",
                     now - since, max_wait);
            return 1;
        }
    }
    return 0;
}

/* ---- replicas ---- */

void route_replica_init(route_replica *r, const uint8_t id[ROUTE_ID_LEN], double tput, double load)
{
    memset(r, 0, sizeof *r);
    memcpy(r->id, id, ROUTE_ID_LEN);
    r->tput = tput;
    r->load = load;
    r->latency_s = -1.0;
}

/* A claim capped by our own measurement of r (when there is one). */
static double tput_measured_cap(const route_replica *r, double tput)
{
    if (r->meas_tput > 0 && isfinite(r->meas_tput) && tput > ROUTE_TPUT_MEASURED_FACTOR * r->meas_tput)
        return ROUTE_TPUT_MEASURED_FACTOR * r->meas_tput;
    return tput;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double route_replica_tput(const route_replica *r, int n, int i)
{
    if (!r || i < 0 || i >= n)
        return 0.0;
    double t = r[i].tput;
    if (!(t > 0) || !isfinite(t))
        return 0.0;
    if (r[i].meas_tput > 0 && isfinite(r[i].meas_tput))
        return tput_measured_cap(&r[i], t);
    /* Not measured yet: at most what a typical other replica claims. */
    double s[64];
    int m = 0;
    for (int j = 0; j < n && m < 64; j++)
        if (j != i && r[j].tput > 0 && isfinite(r[j].tput))
            s[m++] = r[j].tput;
    if (m == 0)
        return t;
    qsort(s, (size_t)m, sizeof s[0], cmp_double);
    return t > s[m / 2] ? s[m / 2] : t;
}

/* route_replica_weight with the throughput given (<= 0: unknown). */
static double weight_of(const route_replica *r, double tput, double now)
{
    if (r->banned_until > now)
        return 0.0;
    /* Unknown or absurd announcements get a modest default so a new peer is
     * tried (and measured) without being flooded. */
    if (!(tput > 0) || !isfinite(tput))
        tput = 100.0;
    double load = (r->load >= 0 && r->load <= 1) ? r->load : 1.0;
    /* Expected time for one more request: its queueing behind our own
     * in-flight work and the announced load, plus the observed latency. */
    double service = (1.0 + r->inflight) / tput * (1.0 + 3.0 * load);
    double latency = (r->latency_s >= 0 && isfinite(r->latency_s)) ? r->latency_s : 0.0;
    double w = 1.0 / (service + latency + 1e-6);
    return isfinite(w) && w > 0 ? w : 1e-9;
}

double route_replica_weight(const route_replica *r, double now)
{
    return weight_of(r, tput_measured_cap(r, r->tput), now);
}

int route_pick_replica(const route_replica *r, int n, const uint8_t *skip, double now,
                       uint64_t *rng, double *retry_at)
{
    if (!r || n < 0 || !rng || *rng == 0)
        return -EINVAL;
    double total = 0.0, earliest = 0.0;
    for (int i = 0; i < n; i++) {
        if (skip && skip[i])
            continue;
        double w = weight_of(&r[i], route_replica_tput(r, n, i), now);
        total += w;
        if (w == 0.0 && (earliest == 0.0 || r[i].banned_until < earliest))
            earliest = r[i].banned_until;
    }
    if (total <= 0.0) {
        if (retry_at)
            *retry_at = earliest;
        return -EAGAIN;
    }
    double x = route_rand01(rng) * total;
    int last = -1;
    for (int i = 0; i < n; i++) {
        if (skip && skip[i])
            continue;
        double w = weight_of(&r[i], route_replica_tput(r, n, i), now);
        if (w <= 0.0)
            continue;
        last = i;
        if (x < w)
            return i;
        x -= w;
    }
    return last; /* rounding left x just above the final weight */
}

int route_pick_probe(const route_replica *r, int n, const uint8_t *skip, double now)
{
    if (!r || n < 0)
        return -EINVAL;
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (skip && skip[i])
            continue;
        if (!(r[i].banned_until > now))
            return -EAGAIN;
        if (best < 0 || r[i].banned_until < r[best].banned_until)
            best = i;
    }
    return best >= 0 ? best : -EAGAIN;
}

void route_replica_unban(route_replica *r)
{
    r->banned_until = 0.0;
}

void route_replica_success(route_replica *r, double rtt_s)
{
    r->failures = 0;
    r->banned_until = 0.0;
    if (!(rtt_s >= 0) || !isfinite(rtt_s))
        return;
    r->latency_s = r->latency_s < 0 ? rtt_s
                                    : (1.0 - ROUTE_LATENCY_ALPHA) * r->latency_s + ROUTE_LATENCY_ALPHA * rtt_s;
}

void route_replica_measured(route_replica *r, int rows, double rtt_s)
{
    if (rows <= 0 || !(rtt_s > 0) || !isfinite(rtt_s))
        return;
    double rate = (double)rows / rtt_s;
    if (!isfinite(rate))
        return;
    r->meas_tput = r->meas_tput > 0 ? (1.0 - ROUTE_LATENCY_ALPHA) * r->meas_tput + ROUTE_LATENCY_ALPHA * rate : rate;
}

void route_replica_failure(route_replica *r, double now, uint64_t *rng)
{
    if (r->failures < 30)
        r->failures++;
    double ban = ROUTE_BAN_BASE_S * ldexp(1.0, r->failures - 1);
    if (ban > ROUTE_BAN_MAX_S)
        ban = ROUTE_BAN_MAX_S;
    r->banned_until = now + ban * (1.0 + 0.25 * route_rand01(rng));
}
