/* routing/routing.h: the public face of the trainer side.
 *
 * routing/ finds block holders through the DHT, picks replicas, pipelines
 * forward and backward passes and retries; it also owns the trainer's data.
 */
#ifndef ROUTE_ROUTING_H
#define ROUTE_ROUTING_H

#include "swarm/balance.h"
#include "routing/data.h"
#include "routing/infer.h"
#include "routing/pipeline.h"
#include "routing/swarm.h"
#include "routing/trainer.h"
#include "routing/versions.h"

#endif
