/* routing/versions.h: noticing a holder that went back to older weights.
 *
 * Every forward reply names the weight version (optimizer steps applied)
 * the holder computed with. A holder's version only grows while its process
 * lives, so a lower one means it restarted from an older checkpoint or from
 * its initial weights: training there lost steps, and the trainer reports
 * it. Replicas of one stage legitimately differ, so versions are compared
 * per (stage, holder node ID), never per stage.
 *
 * A holder with several compute threads may answer two forwards out of
 * order, the later-computed one (higher version) first; that is not a
 * rollback. So a decrease counts only when it comes over another connection
 * than the highest version did (route_conns_get's serial): a restarted
 * process is always a new connection. Within one connection the highest
 * version is kept.
 *
 * Plain data; not thread-safe: one owner.
 */
#ifndef ROUTE_VERSIONS_H
#define ROUTE_VERSIONS_H

#include <stdint.h>

#include "routing/swarm.h"

typedef struct route_versions route_versions;

/* Returns NULL on no memory. */
route_versions *route_versions_create(void);

/* Records that holder id served stage `stage` on weight version `version`
 * over connection `conn`. Returns 1 when this is a rollback, with
 * *from_out = the highest version seen before from this holder for this
 * stage (the record then restarts from `version`, so one restart is
 * reported once); 0 when not; -ENOMEM or -EINVAL. */
int route_versions_observe(route_versions *v, int stage, const uint8_t id[ROUTE_ID_LEN], uint64_t conn,
                           uint64_t version, uint64_t *from_out);

/* Frees v. NULL-safe; sets *v = NULL. */
void route_versions_destroy(route_versions **v);

#endif
