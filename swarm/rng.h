/* swarm/rng.h: the seeded generator behind every randomised choice of the
 * swarm and the trainer side (ties between spans, replica picks, ban
 * jitter, shuffles): xorshift64*, so a choice is reproducible from its
 * seed and costs no system call. Not for anything secret. */
#ifndef SWARM_RNG_H
#define SWARM_RNG_H

#include <stdint.h>

/* xorshift64*: advances *state (must not be 0) and returns a uniform double
 * in [0, 1). */
static inline double route_rand01(uint64_t *state)
{
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return (double)((x * 0x2545F4914F6CDD1DULL) >> 11) * (1.0 / 9007199254740992.0);
}

#endif
