/* dht/addr.h: network addresses as the DHT core sees them, and the peer
 * address string that users pass to --initial-peers.
 *
 * The core is sans-I/O, so it never touches a struct sockaddr: a dht_addr is
 * plain data (family, 16 address bytes, port) that can be copied, compared
 * byte-wise and hashed. The UDP binding converts to and from sockaddr.
 *
 * Peer address string (printed by `starling bootstrap`):
 *
 *     HOST:PORT/NODEID      e.g. 127.0.0.1:4000/3f0c...(40 hex digits)
 *     [IPV6]:PORT/NODEID    e.g. [::1]:4000/3f0c...
 *     HOST:PORT             the node ID is not checked (trust on first use)
 *
 * HOST is a numeric IPv4 or IPv6 address (no DNS: the string must mean the
 * same thing on every machine), PORT is 1..65535, NODEID is 40 hex digits of
 * the node's BLAKE2b-160 ID. A peer given the ID refuses a node that answers
 * with another ID (the answer is signed, see docs/protocol.md).
 * All functions are pure and thread-safe.
 */
#ifndef DHT_ADDR_H
#define DHT_ADDR_H

#include <stddef.h>
#include <stdint.h>

#include "dht/id.h"

struct sockaddr;
struct sockaddr_storage;

#define DHT_ADDR_STRLEN 96 /* enough for "[v6]:port/40hex" and a NUL */

typedef struct dht_addr {
    uint8_t family;   /* 4 or 6 (0 = unset) */
    uint8_t ip[16];   /* IPv4 uses ip[0..4), the rest is zero */
    uint16_t port;    /* host byte order */
} dht_addr;

/* A peer as given on the command line: an address and maybe a node ID. */
typedef struct dht_peer_addr {
    dht_addr addr;
    int has_id;
    uint8_t id[DHT_ID_LEN];
} dht_peer_addr;

/* Fills a from the IPv4 bytes ip4[4] and port (tests, simulation). */
void dht_addr_v4(dht_addr *a, const uint8_t ip4[4], uint16_t port);

/* 1 if a and b are the same family, address and port, else 0. */
int dht_addr_equal(const dht_addr *a, const dht_addr *b);

/* Parses "HOST:PORT" or "[V6]:PORT" (numeric hosts only). Returns 0 or
 * -EINVAL; out is untouched on failure. */
int dht_addr_parse(dht_addr *out, const char *s);

/* As dht_addr_parse, but port 0 (any free port) is allowed: for listening. */
int dht_addr_parse_listen(dht_addr *out, const char *s);

/* Formats "HOST:PORT" / "[V6]:PORT" into buf. Returns the length written
 * (without NUL) or -ENOSPC / -EINVAL. */
int dht_addr_format(char *buf, size_t cap, const dht_addr *a);

/* Parses a peer address string (see top). Returns 0 or -EINVAL. */
int dht_peer_addr_parse(dht_peer_addr *out, const char *s);

/* Formats a peer address string; includes the ID when has_id. Returns the
 * length or -ENOSPC / -EINVAL. */
int dht_peer_addr_format(char *buf, size_t cap, const dht_peer_addr *p);

/* Parses a comma-separated list of peer address strings into out[0..max).
 * Returns the count (>= 1), or -EINVAL (empty item, bad item) or -E2BIG. */
int dht_peer_list_parse(dht_peer_addr *out, size_t max, const char *s);

/* Conversions for the UDP binding. to_sockaddr writes a sockaddr_in or
 * sockaddr_in6 into ss and returns its length, or -EINVAL. from_sockaddr
 * returns 0 or -EAFNOSUPPORT. An IPv4-mapped IPv6 address becomes IPv4. */
int dht_addr_to_sockaddr(const dht_addr *a, struct sockaddr_storage *ss);
int dht_addr_from_sockaddr(dht_addr *out, const struct sockaddr *sa);

#endif
