#include "routing/replica.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

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
