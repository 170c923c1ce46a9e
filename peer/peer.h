/* peer/peer.h: the public face of the peer daemon layer.
 *
 * peer/ serves blocks over the tensor RPC, announces them in the DHT, batches
 * requests and runs compute off the event loop. It links to dht/, expert/ and
 * cuda/ (through its plain-C header only).
 */
#ifndef PEER_PEER_H
#define PEER_PEER_H

#include "swarm/announce.h"
#include "peer/batcher.h"
#include "net/channel.h"
#include "peer/daemon.h"
#include "peer/device.h"
#include "peer/metrics.h"
#include "net/rpc_client.h"
#include "net/rpc_server.h"
#include "peer/service.h"
#include "peer/statesync.h"
#include "net/wire.h"

#endif
