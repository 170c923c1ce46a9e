/* swarm/holders.c: the holders of one stage in a DHT lookup's entries
 * (swarm/holders.h). */
#include "swarm/holders.h"

#include <string.h>

int swarm_holder_read(swarm_holder *h, const dht_entry *e, const char *block, uint64_t stage_hash)
{
    if (!e->is_signed || e->subkey_len != DHT_ID_LEN || peer_announce_decode(&h->ann, e->value, e->value_len) != 0 ||
        (block && strcmp(h->ann.block, block) != 0))
        return 0;
    memcpy(h->id, e->subkey, DHT_ID_LEN);
    h->expires_ms = e->expires;
    h->same_hash = h->ann.stage_hash == stage_hash;
    h->usable = h->same_hash && h->ann.state == PEER_STATE_ONLINE;
    return 1;
}

int swarm_holders_usable(swarm_holder *out, int max, const dht_entry *e, size_t n, const char *block,
                         uint64_t stage_hash, const uint8_t *self)
{
    int k = 0;
    for (size_t i = 0; i < n && k < max; i++)
        if (swarm_holder_read(&out[k], &e[i], block, stage_hash) && out[k].usable &&
            !(self && !memcmp(out[k].id, self, DHT_ID_LEN)))
            k++;
    return k;
}
