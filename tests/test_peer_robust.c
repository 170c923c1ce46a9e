/* The robust reduce of replica averaging (peer_allreduce_robust_mean):
 * honest groups, whose replicas drift apart independently between rounds,
 * get the exact weighted mean with nothing clipped; a hostile member
 * sending zeros, 1e30, NaN or blown-up optimizer moments, with any weight
 * it claims, moves the result no further from the honest members' weighted
 * mean than the guarantee in peer/allreduce.h; a NaN member is dropped.
 * Deterministic (fixed seeds, printed on failure).
 *
 * `test_peer_robust --bench [NPARAMS]` times the robust reduce against the
 * plain weighted mean on one member's part of a block (default: the
 * fmnist-mlp ResFFN block, 2,100,736 parameters, x3 with the AdamW
 * moments) for groups of 2..8, and prints one JSON line per group. */
#include <errno.h>
#include <math.h>
#include <time.h>

#include "peer/allreduce.h"
#include "peer/service.h"
#include "test_util.h"

#define P 6000 /* parameters: the flat state is 3 P (params, m, v) */
#define NF (3 * P)
#define MAXN 8
#define CF PEER_ALLREDUCE_CLIP_FACTOR

static uint64_t rng_state;

static double urand(void)
{
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static double gauss(void)
{
    double u = urand(), v = urand();
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

/* Scales of each segment of a trained block: params, m, v. */
static const double seg_scale[3] = {0.05, 1e-3, 1e-6};

/* A common state, and n replicas of it that trained on their own since:
 * replica i drifted by drift[i] times a per-segment step (independent
 * noise, as independent minibatches give). */
static void make_replicas(float *x[], int n, const double *drift, unsigned seed)
{
    rng_state = seed;
    static float base[NF];
    for (int k = 0; k < NF; k++) {
        int s = k / P;
        base[k] = (float)(s == 2 ? fabs(gauss()) * seg_scale[s] : gauss() * seg_scale[s]);
    }
    for (int i = 0; i < n; i++)
        for (int k = 0; k < NF; k++) {
            int s = k / P;
            double v = base[k] + drift[i] * 0.02 * seg_scale[s] * gauss();
            x[i][k] = (float)(s == 2 && v < 0 ? 0 : v);
        }
}

/* The whole flat vector reduced as the group would: part j by member j. */
static int reduce_all(float *x[], const double *w, int n, float *out, peer_robust_stats *st)
{
    memset(st, 0, sizeof *st);
    for (int j = 0; j < n; j++) {
        size_t off, len;
        peer_avg_part(NF, n, j, &off, &len);
        const float *xs[MAXN];
        for (int i = 0; i < n; i++)
            xs[i] = x[i] ? x[i] + off : NULL;
        peer_robust_stats s;
        int rc = peer_allreduce_robust_mean(xs, w, n, len, off, P, out + off, &s);
        if (rc != 0)
            return rc;
        st->dropped |= s.dropped;
        st->clipped |= s.clipped;
        if (s.max_ratio > st->max_ratio)
            st->max_ratio = s.max_ratio;
    }
    return 0;
}

/* mu: the weighted mean of the members in `who` (bitmask). */
static void weighted_mean(float *x[], const double *w, int n, unsigned who, double *mu)
{
    double ws = 0;
    for (int i = 0; i < n; i++)
        if (who >> i & 1)
            ws += w[i];
    for (int k = 0; k < NF; k++) {
        double a = 0;
        for (int i = 0; i < n; i++)
            if (who >> i & 1)
                a += w[i] * x[i][k];
        mu[k] = a / ws;
    }
}

/* Per segment: |out - mu| and D, the norm of the honest coordinate-wise
 * range. */
static void seg_dist(const float *out, const double *mu, float *x[], int n, unsigned honest, double dist[3],
                     double range[3])
{
    for (int s = 0; s < 3; s++) {
        double d = 0, r = 0;
        for (int k = s * P; k < (s + 1) * P; k++) {
            double e = out[k] - mu[k], lo = INFINITY, hi = -INFINITY;
            d += e * e;
            for (int i = 0; i < n; i++)
                if (honest >> i & 1) {
                    lo = fmin(lo, x[i][k]);
                    hi = fmax(hi, x[i][k]);
                }
            r += (hi - lo) * (hi - lo);
        }
        dist[s] = sqrt(d);
        range[s] = sqrt(r);
    }
}

static float *rows[MAXN];
static float out[NF];
static double mu[NF];

static int setup(void **state)
{
    (void)state;
    for (int i = 0; i < MAXN; i++)
        rows[i] = malloc(NF * sizeof(float));
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    for (int i = 0; i < MAXN; i++)
        free(rows[i]);
    return 0;
}

/* Honest groups: the weighted mean, nothing clipped or dropped, across
 * group sizes, weights (samples since the last round + 1) and drifts (a
 * replica that trained 3x the others drifts ~1.7x as far: noise adds up
 * as the square root). */
static void test_honest_exact(void **state)
{
    (void)state;
    static const double drifts[][MAXN] = {
        {1, 1, 1, 1, 1, 1, 1, 1},
        {1, 2, 3, 1, 2, 3, 1, 2},
        {0.5, 1, 1.7, 1, 0.7, 1.3, 1, 2},
        {1, 1, 2.5, 1, 1, 2.5, 1, 1},
    };
    static const double weights[MAXN] = {65, 17, 193, 1, 33, 9, 129, 2};
    /* Float accumulation, as the plain mean always had: 1e-5 relative, the
     * tolerance of test_peer_allreduce. */
    double worst = 0;
    for (int n = 2; n <= MAXN; n++)
        for (size_t p = 0; p < sizeof drifts / sizeof drifts[0]; p++) {
            unsigned seed = 1000u * (unsigned)n + (unsigned)p;
            make_replicas(rows, n, drifts[p], seed);
            peer_robust_stats st;
            assert_int_equal(reduce_all(rows, weights, n, out, &st), 0);
            weighted_mean(rows, weights, n, (1u << n) - 1, mu);
            double err = 0;
            for (int k = 0; k < NF; k++) {
                double e = fabs(out[k] - mu[k]) / (seg_scale[k / P] * 1e-3 + fabs(mu[k]));
                if (e > err)
                    err = e;
            }
            if (st.clipped || st.dropped || !(err < 1e-5))
                fail_msg("seed %u n %d drift profile %zu: clipped %#x dropped %#x rel err %.3g (max ratio %.2f)",
                         seed, n, p, st.clipped, st.dropped, err, st.max_ratio);
            if (st.max_ratio > worst)
                worst = st.max_ratio;
        }
    print_message("honest groups 2..%d: exact weighted mean, nothing clipped; the largest distance to the median "
                  "was %.2fx the typical one (clipping starts at %.0fx)\n", MAXN, worst, CF);
}

/* Member 0 is hostile with the given values and weight; the others are
 * honest. Checks the guarantee and returns |out - mu| / |plain - mu| for
 * the parameters. */
static double attack(int n, int nbad, int kind, double wbad, unsigned seed)
{
    static const double drift[MAXN] = {1, 1, 1.5, 0.8, 1.2, 1, 1, 1};
    double w[MAXN];
    make_replicas(rows, n, drift, seed);
    for (int i = 0; i < n; i++)
        w[i] = 17 + 16 * i;
    unsigned honest = 0;
    for (int i = 0; i < n; i++)
        if (i >= nbad)
            honest |= 1u << i;
    for (int b = 0; b < nbad; b++) {
        w[b] = wbad;
        for (int k = 0; k < NF; k++) {
            int s = k / P;
            switch (kind) {
            case 0: rows[b][k] = 0; break;                          /* zero weights */
            case 1: rows[b][k] = 1e30f; break;                       /* huge */
            case 2: rows[b][k] = k % 1000 == 7 ? NAN : rows[b][k]; break; /* NaNs in every part */
            case 3: rows[b][k] = s == 0 ? rows[b][k] : s == 1 ? rows[b][k] * 1e4f : 1.0f; break; /* moments */
            case 4: rows[b][k] = -rows[b][k]; break;                 /* sign flip */
            }
        }
    }
    peer_robust_stats st;
    int rc = reduce_all(rows, w, n, out, &st);
    if (rc != 0)
        fail_msg("seed %u n %d kind %d: rc %d", seed, n, kind, rc);
    weighted_mean(rows, w, n, honest, mu);
    double dist[3], range[3];
    seg_dist(out, mu, rows, n, honest, dist, range);
    unsigned badmask = honest ^ ((1u << n) - 1);
    if (kind == 2) {
        /* Dropped, named, and the rest is the honest members' exact mean. */
        if (st.dropped != badmask)
            fail_msg("seed %u n %d: dropped %#x, want %#x", seed, n, st.dropped, badmask);
        for (int s = 0; s < 3; s++)
            if (!(dist[s] <= 1e-5 * range[s] + 1e-12))
                fail_msg("seed %u n %d: NaN member moved segment %d by %.3g (range %.3g)", seed, n, s, dist[s],
                         range[s]);
        return 0;
    }
    if (st.dropped || (st.clipped & honest) || (st.clipped & badmask) != badmask)
        fail_msg("seed %u n %d kind %d: dropped %#x clipped %#x (honest %#x)", seed, n, kind, st.dropped,
                 st.clipped, honest);
    double wb = 0, wt = 0;
    for (int i = 0; i < n; i++) {
        wt += w[i];
        wb += (badmask >> i & 1) ? w[i] : 0;
    }
    for (int s = 0; s < 3; s++) {
        /* Nobody honest clipped: the tighter form of the bound. */
        double bound = (wb / wt) * (1 + CF) * range[s] * (1 + 1e-6) + 1e-12;
        if (!(dist[s] <= bound))
            fail_msg("seed %u n %d kind %d segment %d: |out - mu| %.4g > bound %.4g (D %.4g)", seed, n, kind, s,
                     dist[s], bound, range[s]);
    }
    /* The plain mean, for scale. */
    int sg = kind == 3 ? 2 : 0; /* the segment the attack aims at */
    double plain = 0;
    for (int k = sg * P; k < (sg + 1) * P; k++) {
        double a = 0;
        for (int i = 0; i < n; i++)
            a += w[i] * rows[i][k];
        a = a / wt - mu[k];
        plain += a * a;
    }
    return dist[sg] / sqrt(plain);
}

static void test_hostile_minority(void **state)
{
    (void)state;
    static const char *kinds[] = {"zeros", "1e30", "NaN", "big moments", "sign flip"};
    /* (n, hostile): 3 with 1, 4 with 1, 5 with 2, 8 with 3 */
    static const int groups[][2] = {{3, 1}, {4, 1}, {5, 2}, {8, 3}};
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++)
        for (int kind = 0; kind < 5; kind++)
            for (int wk = 0; wk < 2; wk++) {
                double wbad = wk ? 1e12 : 33; /* an honest-looking or an absurd weight claim */
                double r = attack(groups[g][0], groups[g][1], kind, wbad, 77u + (unsigned)(10 * g + kind));
                if (kind != 2)
                    print_message("n=%d hostile=%d %-11s weight %-6g: the result moved %.3g of what the plain "
                                  "mean moves it (%s)\n", groups[g][0], groups[g][1], kinds[kind], wbad, r,
                                  kind == 3 ? "v" : "params");
            }
}

/* A real attack: two honest holders and one that serves zeros and claims
 * the weight of a huge amount of training. Without the robust reduce the
 * honest holders would land next to zero. */
static void test_zeros_attack_group_of_3(void **state)
{
    (void)state;
    const double drift[3] = {1, 1, 1};
    make_replicas(rows, 3, drift, 5);
    memset(rows[2], 0, NF * sizeof(float));
    const double w[3] = {40, 40, 1e9};
    peer_robust_stats st;
    assert_int_equal(reduce_all(rows, w, 3, out, &st), 0);
    assert_int_equal(st.clipped, 1u << 2);
    double n_out = 0, n_mu = 0;
    weighted_mean(rows, w, 3, 3, mu);
    for (int k = 0; k < P; k++) {
        n_out += (double)out[k] * out[k];
        n_mu += mu[k] * mu[k];
    }
    /* The honest parameters' norm is kept to within (1 + CF) x their
     * ~2 % spread, instead of collapsing to ~0. */
    print_message("zeros at weight 1e9 in a group of 3: |params| %.4g, honest mean's %.4g\n", sqrt(n_out),
                  sqrt(n_mu));
    assert_true(sqrt(n_out) > 0.8 * sqrt(n_mu));
}

static void test_edges(void **state)
{
    (void)state;
    const double drift[4] = {1, 2, 1, 1};
    make_replicas(rows, 4, drift, 9);
    const float *xs[4] = {rows[0], rows[1], rows[2], rows[3]};
    peer_robust_stats st;
    /* Every weight 0: nothing to average. */
    const double zero[4] = {0, 0, 0, 0};
    assert_int_equal(peer_allreduce_robust_mean(xs, zero, 4, NF, 0, P, out, &st), -ENODATA);
    /* A weight-0 member's NaN is dropped (and named) without harm. */
    const double w[4] = {3, 5, 0, 7};
    rows[2][10] = NAN;
    assert_int_equal(peer_allreduce_robust_mean(xs, w, 4, NF, 0, P, out, &st), 0);
    assert_int_equal(st.dropped, 1u << 2);
    /* Every member with a weight sends NaN: refused. */
    rows[0][1] = rows[1][2] = rows[3][3] = INFINITY;
    assert_int_equal(peer_allreduce_robust_mean(xs, w, 4, NF, 0, P, out, &st), -ERANGE);
    assert_int_equal(st.dropped, 0xfu);
    /* Bad weights are the caller's error. */
    const double neg[4] = {1, -1, 1, 1};
    assert_int_equal(peer_allreduce_robust_mean(xs, neg, 4, NF, 0, P, out, &st), -EINVAL);
    /* Segments are cut at multiples of seg, wherever the part starts: a
     * part straddling params and m reduces like its two pieces. */
    make_replicas(rows, 4, drift, 11);
    for (int k = 0; k < NF; k++)
        rows[0][k] = k < P ? rows[0][k] : rows[0][k] * 50; /* far out in m and v only */
    const double w4[4] = {1, 1, 1, 1};
    size_t off = P - 100, len = 300;
    const float *ys[4] = {rows[0] + off, rows[1] + off, rows[2] + off, rows[3] + off};
    static float a[300], b[300];
    assert_int_equal(peer_allreduce_robust_mean(ys, w4, 4, len, off, P, a, &st), 0);
    assert_int_equal(peer_allreduce_robust_mean(ys, w4, 4, 100, off, P, b, &st), 0);
    assert_int_equal(st.clipped, 0); /* in the params: no one far */
    const float *zs[4] = {ys[0] + 100, ys[1] + 100, ys[2] + 100, ys[3] + 100};
    assert_int_equal(peer_allreduce_robust_mean(zs, w4, 4, 200, P, P, b + 100, &st), 0);
    assert_int_equal(st.clipped, 1u);
    assert_memory_equal(a, b, sizeof a);
}

/* ---- benchmark ---- */

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int bench(size_t nparams)
{
    size_t nflat = 3 * nparams;
    for (int n = 2; n <= 8; n++) {
        size_t off, len;
        peer_avg_part(nflat, n, 0, &off, &len);
        float *x[MAXN], *o = malloc(len * sizeof(float));
        double w[MAXN];
        rng_state = 3;
        for (int i = 0; i < n; i++) {
            x[i] = malloc(len * sizeof(float));
            w[i] = 10 + i;
            for (size_t k = 0; k < len; k++)
                x[i][k] = (float)(0.05 * gauss());
        }
        const float *xs[MAXN];
        for (int i = 0; i < n; i++)
            xs[i] = x[i];
        /* The plain mean as the round did it before: float accumulation. */
        double best_plain = 1e9, best_rob = 1e9, best_clip = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            double t0 = now_s(), ws = 0;
            for (size_t k = 0; k < len; k++)
                o[k] = (float)w[0] * x[0][k];
            for (int i = 1; i < n; i++) {
                float fw = (float)w[i];
                for (size_t k = 0; k < len; k++)
                    o[k] += fw * x[i][k];
            }
            for (int i = 0; i < n; i++)
                ws += w[i];
            float inv = (float)(1.0 / ws);
            for (size_t k = 0; k < len; k++)
                o[k] *= inv;
            double t1 = now_s();
            peer_allreduce_robust_mean(xs, w, n, len, off, nparams, o, NULL);
            double t2 = now_s();
            best_plain = fmin(best_plain, t1 - t0);
            best_rob = fmin(best_rob, t2 - t1);
        }
        /* With one member far out (the clipping path). */
        if (n >= 3) {
            for (size_t k = 0; k < len; k++)
                x[0][k] = 1e3f;
            for (int rep = 0; rep < 5; rep++) {
                double t0 = now_s();
                peer_allreduce_robust_mean(xs, w, n, len, off, nparams, o, NULL);
                best_clip = fmin(best_clip, now_s() - t0);
            }
        }
        printf("{\"bench\":\"avg_reduce\",\"nparams\":%zu,\"group\":%d,\"part_floats\":%zu,\"plain_ms\":%.2f,"
               "\"robust_ms\":%.2f,\"robust_clipping_ms\":%.2f,\"ratio\":%.2f}\n",
               nparams, n, len, best_plain * 1e3, best_rob * 1e3, n >= 3 ? best_clip * 1e3 : 0.0,
               best_rob / best_plain);
        for (int i = 0; i < n; i++)
            free(x[i]);
        free(o);
    }
    return 0;
}

/* The parts other members reduced (peer_allreduce_check_parts): in honest
 * groups no part is rejected, from any member's point of view, whatever the
 * members' drifts; a part published as zeros, blown up or sign-flipped is
 * rejected by every honest member (and only that part), also in a group of
 * two and where the part is alone in its segment; a member that is itself far from the group (every part moves it a
 * lot) rejects nothing. */
static void test_reduced_parts(void **state)
{
    (void)state;
    static float avg[NF];
    static const double drifts[][4] = {{1, 1, 1, 1}, {1, 2, 3, 1}, {0.3, 1, 3, 2}, {1, 1, 1, 6}};
    const double w[4] = {1, 5, 17, 3};
    for (int n = 2; n <= 4; n++)
        for (size_t d = 0; d < sizeof drifts / sizeof drifts[0]; d++) {
            unsigned seed = 1000u + 10u * (unsigned)n + (unsigned)d;
            make_replicas(rows, n, drifts[d], seed);
            peer_robust_stats st;
            assert_int_equal(reduce_all(rows, w, n, avg, &st), 0);
            for (int me = 0; me < n; me++) {
                uint32_t rej = 1;
                assert_int_equal(peer_allreduce_check_parts(avg, rows[me], NF, n, me, &rej), 0);
                if (rej)
                    fail_msg("seed %u, n %d, drift set %zu: member %d rejected honest parts 0x%x", seed, n, d, me,
                             rej);
            }
            /* One reducer publishes garbage for its part: zeros, x1000, sign-flipped. */
            int bad = n - 1;
            size_t off, len;
            peer_avg_part(NF, n, bad, &off, &len);
            for (int attack = 0; attack < 3; attack++) {
                static float evil[NF];
                memcpy(evil, avg, sizeof evil);
                for (size_t k = off; k < off + len; k++)
                    evil[k] = attack == 0 ? 0.0f : attack == 1 ? avg[k] * 1000.0f : -avg[k];
                for (int me = 0; me < bad; me++) {
                    uint32_t rej = 0;
                    assert_int_equal(peer_allreduce_check_parts(evil, rows[me], NF, n, me, &rej), 0);
                    if (rej != 1u << bad)
                        fail_msg("seed %u, n %d, attack %d: member %d rejected 0x%x, want 0x%x", seed, n, attack,
                                 me, rej, 1u << bad);
                }
            }
        }
    /* A member far from everyone (its own state 3x off): every part moves it
     * far, its own too; nothing is rejected. */
    const double far[3] = {1, 1, 1};
    make_replicas(rows, 3, far, 77);
    peer_robust_stats st;
    assert_int_equal(reduce_all(rows, w, 3, avg, &st), 0);
    for (int k = 0; k < NF; k++)
        rows[0][k] *= 3.0f;
    uint32_t rej = 1;
    assert_int_equal(peer_allreduce_check_parts(avg, rows[0], NF, 3, 0, &rej), 0);
    assert_int_equal(rej, 0);
    assert_int_equal(peer_allreduce_check_parts(avg, rows[0], NF, 1, 0, &rej), -EINVAL);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--bench"))
        return bench(argc > 2 ? (size_t)strtoull(argv[2], NULL, 10) : 2100736);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_honest_exact, setup, teardown),
        cmocka_unit_test_setup_teardown(test_hostile_minority, setup, teardown),
        cmocka_unit_test_setup_teardown(test_zeros_attack_group_of_3, setup, teardown),
        cmocka_unit_test_setup_teardown(test_edges, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reduced_parts, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
