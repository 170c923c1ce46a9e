/* dht/dht.h: the public face of the membership layer.
 *
 * dht/ knows nothing of expert/: it provides identities, 160-bit IDs and
 * (as it grows) the Kademlia core and its libuv UDP binding. Layers above
 * include this header only.
 */
#ifndef DHT_DHT_H
#define DHT_DHT_H

#include "dht/id.h"
#include "dht/identity.h"

#endif
