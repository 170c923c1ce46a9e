/* tests/fake_announce.c: prints, as hex, the announcement value a peer
 * stores for one stage (swarm/announce.h), with fields of our choosing, for
 * `starling dht put --value-hex` to store signed by an attacker's own
 * identity (tests/test_swarm_fakeholder.sh). Not a test itself.
 *
 *     fake_announce MODEL INDEX ADDR THROUGHPUT [WEIGHT_VERSION]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "expert/model.h"
#include "swarm/announce.h"

int main(int argc, char **argv)
{
    if (argc < 5 || argc > 6) {
        fprintf(stderr, "usage: fake_announce MODEL INDEX ADDR THROUGHPUT [WEIGHT_VERSION]\n");
        return 2;
    }
    const struct expert_model_spec *m = expert_model_find(argv[1]);
    int index = atoi(argv[2]);
    if (!m || index < 0 || index >= m->n_stages) {
        fprintf(stderr, "fake_announce: no stage %s.%s\n", argv[1], argv[2]);
        return 2;
    }
    peer_announce a;
    memset(&a, 0, sizeof a);
    snprintf(a.block, sizeof a.block, "%s.%d", m->name, index);
    snprintf(a.addr, sizeof a.addr, "%s", argv[3]);
    a.state = PEER_STATE_ONLINE;
    a.stage_hash = expert_stage_hash(m, index);
    a.weight_version = argc == 6 ? strtoull(argv[5], NULL, 10) : 0;
    a.throughput = strtod(argv[4], NULL);
    a.load = 0;
    snprintf(a.device, sizeof a.device, "cpu");
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    a.time_ms = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
    uint8_t buf[PEER_ANNOUNCE_MAX_BYTES];
    long n = peer_announce_encode(&a, buf, sizeof buf);
    if (n < 0) {
        fprintf(stderr, "fake_announce: cannot encode: %ld\n", n);
        return 1;
    }
    for (long i = 0; i < n; i++)
        printf("%02x", buf[i]);
    printf("\n");
    return 0;
}
