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

/* Which addresses the per-network limits of the routing table and of
 * lookups apply to (dht_config.diversity). */
enum dht_diversity {
    DHT_DIVERSITY_PUBLIC = 0, /* every address but local ones (the default) */
    DHT_DIVERSITY_ALL = 1,    /* every address, loopback and private included */
    DHT_DIVERSITY_OFF = 2,    /* none */
};

/* 1 if the limits of mode apply to a. */
int dht_addr_limited(const dht_addr *a, int mode);

/* 1 if a is a loopback, private or link-local address: IPv4 127/8, 10/8,
 * 172.16/12, 192.168/16, 100.64/10 (carrier-grade NAT), 169.254/16, 0/8;
 * IPv6 ::1, ::, fc00::/7 (unique local), fe80::/10, and IPv4-mapped forms of
 * the above. Such addresses are one operator's network: the routing table's
 * per-address limits (dht/table.h) exempt them by default. */
int dht_addr_is_local(const dht_addr *a);

/* The network group of a for per-address limits: a copy with port 0 and the
 * address cut to its first `bits` bits (IPv4 /24 and IPv6 /48 are the
 * prefixes a single operator typically holds; 32 or 128 = the exact IP).
 * bits is clamped to the family's length. Two addresses are in the same
 * group when dht_addr_equal says their groups are equal. */
void dht_addr_prefix(dht_addr *out, const dht_addr *a, unsigned bits);

/* The prefix length of a's network for per-network limits: 24 for IPv4, 48
 * for IPv6, 120 for an IPv4-mapped IPv6 address (its IPv4 /24). */
unsigned dht_addr_net_bits(const dht_addr *a);

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
