/* swarm/balance.h: which stages a peer without --blocks should serve.
 *
 * A peer serves K contiguous stages. It picks the span whose total service
 * (the other peers' online holders; the caller decides the unit: announced
 * throughput, or holder-equivalents as `starling peer` uses) is lowest, so
 * uncovered and weakly served stages attract newcomers; among equal spans
 * aligned ones (tiling the model) are preferred and ties broken at random,
 * so peers that join at the same moment spread out. Later it re-checks:
 * it moves when another span would leave fewer stages without any holder,
 * else only when the best span is much weaker than its own (hysteresis:
 * best total < ratio x own total) and leaving uncovers none of its stages.
 * Of the peers that share a span, only the one with the highest node ID
 * makes a warranted move (the caller counts those that outrank it), so
 * peers seeing the same gap do not all jump into it at once, and none
 * waits on a coin flip. Pure functions: the caller supplies the figures.
 */
#ifndef SWARM_BALANCE_H
#define SWARM_BALANCE_H

#include <stdint.h>

/* tput[i] and holders[i]: the other peers' announced throughput and online
 * holder count for stage i (0..n). Returns the start of the chosen span of
 * k stages, or -EINVAL. *rng (xorshift state, not 0) breaks ties. */
int route_balance_choose(const double *tput, int n, int k, uint64_t *rng);

/* Whether a peer serving [cur, cur+k) should move; when it should, returns 1
 * and stores the new start in *to. holders[] counts the OTHER peers' online
 * holders, tput[] their throughput. ratio in (0, 1): e.g. 0.5 means "move
 * only to a span with less than half our span's throughput". outranked:
 * other online peers that serve our whole span and have a higher node ID;
 * a warranted move is left to them unless it is 0. */
int route_balance_should_move(const double *tput, const int *holders, int n, int k, int cur,
                              double ratio, int outranked, uint64_t *rng, int *to);

#endif
