/* swarm/holders.h: the holders of one stage, as a DHT lookup of the
 * stage's key ("<model>.<i>") returns them.
 *
 * Every holder stores a signed announcement (swarm/announce.h) under that
 * key, with its node ID as the subkey. This is the one place that decides
 * which entries of such a lookup are holders and which of those can take
 * work, for every reader: the trainer's swarm view (routing/swarm.c), the
 * daemon's catch-up and keepers (peer/catchup.c, peer/keeper.c) and
 * libstarling's holders query (capi/query.c). An entry is a holder when it
 * is signed, sits under a node ID, decodes as an announcement and names
 * the stage (when a name is asked for); anything else at the key (garbage,
 * another kind of record, a hostile value) is not one. A holder is usable
 * when it is online and announces the stage hash the reader computes with
 * (the same model version). Pure: no I/O, no state.
 */
#ifndef SWARM_HOLDERS_H
#define SWARM_HOLDERS_H

#include <stddef.h>
#include <stdint.h>

#include "dht/dht.h"
#include "swarm/announce.h"

/* One holder, as its announcement says. */
typedef struct swarm_holder {
    uint8_t id[DHT_ID_LEN];  /* its node ID (the entry's subkey) */
    peer_announce ann;       /* what it announced */
    uint64_t expires_ms;     /* when its entry expires (unix ms) */
    int same_hash;           /* it announces stage_hash */
    int usable;              /* online and same_hash */
} swarm_holder;

/* Reads entry e as a holder of stage `block` (NULL: any stage) whose
 * readers compute with stage_hash. Returns 1 and fills *h when the entry is
 * a holder, 0 when it is not. */
int swarm_holder_read(swarm_holder *h, const dht_entry *e, const char *block, uint64_t stage_hash);

/* Reads e[0..n) into out[0..max): the usable holders of `block` other than
 * `self` (NULL: none excluded), in the lookup's order. Returns how many. */
int swarm_holders_usable(swarm_holder *out, int max, const dht_entry *e, size_t n, const char *block,
                         uint64_t stage_hash, const uint8_t *self);

#endif
