#include "swarm/balance.h"

#include <errno.h>
#include <math.h>

#include "swarm/rng.h"

static double span_sum(const double *tput, int start, int k)
{
    double s = 0;
    for (int i = start; i < start + k; i++)
        s += tput[i] > 0 && isfinite(tput[i]) ? tput[i] : 0;
    return s;
}

/* Aligned starts (multiples of k, and the last full span) tile the model,
 * so peers that pick among equal spans prefer them: three peers of two
 * stages each then cover six stages exactly instead of overlapping. */
static int aligned(int start, int n, int k)
{
    return start % k == 0 || start == n - k;
}

int route_balance_choose(const double *tput, int n, int k, uint64_t *rng)
{
    if (!tput || n < 1 || k < 1 || k > n || !rng || *rng == 0)
        return -EINVAL;
    double best = INFINITY;
    for (int s = 0; s + k <= n; s++) {
        double v = span_sum(tput, s, k);
        if (v < best)
            best = v;
    }
    /* Candidates: within 1% of the best (announcements are noisy); aligned
     * ones first; one at random among them. */
    int pick = -1, ties = 0;
    for (int pass = 0; pass < 2 && pick < 0; pass++)
        for (int s = 0; s + k <= n; s++) {
            if (span_sum(tput, s, k) > best * 1.01 + 1e-9 || (pass == 0 && !aligned(s, n, k)))
                continue;
            if (route_rand01(rng) * ++ties < 1.0)
                pick = s;
        }
    return pick;
}

/* Stages with no holder if we served [start, start+k) and the others stay. */
static int uncovered_with(const int *holders, int n, int k, int start)
{
    int u = 0;
    for (int i = 0; i < n; i++)
        u += holders[i] < 1 && !(i >= start && i < start + k);
    return u;
}

int route_balance_should_move(const double *tput, const int *holders, int n, int k, int cur,
                              double ratio, int outranked, uint64_t *rng, int *to)
{
    if (!tput || !holders || n < 1 || k < 1 || k > n || cur < 0 || cur + k > n || !to ||
        !(ratio > 0 && ratio < 1) || outranked < 0 || !rng || *rng == 0)
        return -EINVAL;
    /* First, coverage: move when some span leaves fewer stages without a
     * holder than ours does (this may give up a stage we hold alone, when
     * that uncovers fewer than it covers). */
    int now_unc = uncovered_with(holders, n, k, cur), best_unc = now_unc, best = -1, ties = 0;
    for (int s = 0; s + k <= n; s++) {
        int u = uncovered_with(holders, n, k, s);
        if (u < best_unc) {
            best_unc = u;
            best = s;
            ties = 1;
        } else if (u == best_unc && best >= 0 && route_rand01(rng) * ++ties < 1.0) {
            best = s;
        }
    }
    if (best >= 0) {
        /* Peers sharing our span see the same gap at the same time; if all
         * of them jumped, the gap would just move. Only the highest ID goes. */
        if (outranked > 0)
            return 0;
        *to = best;
        return 1;
    }
    /* Then throughput, with hysteresis, and only when none of our stages
     * would lose its last holder. */
    for (int i = cur; i < cur + k; i++)
        if (holders[i] < 1)
            return 0;
    int cand = route_balance_choose(tput, n, k, rng);
    if (cand < 0 || cand == cur)
        return 0;
    if (span_sum(tput, cand, k) < ratio * span_sum(tput, cur, k)) {
        if (outranked > 0)
            return 0; /* see above: the highest ID among the sharers goes */
        *to = cand;
        return 1;
    }
    return 0;
}
