#include "dht/addr.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

void dht_addr_v4(dht_addr *a, const uint8_t ip4[4], uint16_t port)
{
    memset(a, 0, sizeof *a);
    a->family = 4;
    memcpy(a->ip, ip4, 4);
    a->port = port;
}

int dht_addr_equal(const dht_addr *a, const dht_addr *b)
{
    return a->family == b->family && a->port == b->port && memcmp(a->ip, b->ip, 16) == 0;
}

int dht_addr_is_local(const dht_addr *a)
{
    static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    const uint8_t *v4 = NULL;
    if (a->family == 4)
        v4 = a->ip;
    else if (a->family == 6 && !memcmp(a->ip, mapped, 12))
        v4 = a->ip + 12;
    if (v4)
        return v4[0] == 127 || v4[0] == 10 || v4[0] == 0 ||
               (v4[0] == 172 && (v4[1] & 0xf0) == 16) || (v4[0] == 192 && v4[1] == 168) ||
               (v4[0] == 100 && (v4[1] & 0xc0) == 64) || (v4[0] == 169 && v4[1] == 254);
    if (a->family != 6)
        return 0;
    int zero15 = 1;
    for (int i = 0; i < 15; i++)
        zero15 &= a->ip[i] == 0;
    if (zero15 && a->ip[15] <= 1)
        return 1; /* :: and ::1 */
    return (a->ip[0] & 0xfe) == 0xfc || (a->ip[0] == 0xfe && (a->ip[1] & 0xc0) == 0x80);
}

int dht_addr_limited(const dht_addr *a, int mode)
{
    if (mode == DHT_DIVERSITY_OFF)
        return 0;
    return mode == DHT_DIVERSITY_ALL || !dht_addr_is_local(a);
}

unsigned dht_addr_net_bits(const dht_addr *a)
{
    static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (a->family != 6)
        return 24;
    return memcmp(a->ip, mapped, 12) == 0 ? 96 + 24 : 48;
}

void dht_addr_prefix(dht_addr *out, const dht_addr *a, unsigned bits)
{
    unsigned len = a->family == 6 ? 128 : 32;
    *out = *a;
    out->port = 0;
    if (bits > len)
        bits = len;
    for (unsigned i = 0; i < 16; i++) {
        unsigned keep = bits > 8 * i ? bits - 8 * i : 0;
        if (keep < 8)
            out->ip[i] &= (uint8_t)(0xff00u >> keep);
    }
}

static int parse_port(const char *s, uint16_t *out, int allow0)
{
    /* Digits only: strtoul would accept "+1", " 1" and "0x1". */
    unsigned long v = 0;
    if (!*s || strlen(s) > 5)
        return -EINVAL;
    for (const char *p = s; *p; p++) {
        if (*p < '0' || *p > '9')
            return -EINVAL;
        v = v * 10 + (unsigned long)(*p - '0');
    }
    if ((v == 0 && !allow0) || v > 65535)
        return -EINVAL;
    *out = (uint16_t)v;
    return 0;
}

static int parse_addr(dht_addr *out, const char *s, int allow0)
{
    char host[64];
    const char *port_s;
    dht_addr a;
    memset(&a, 0, sizeof a);
    if (!out || !s)
        return -EINVAL;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (!close || close[1] != ':' || (size_t)(close - s - 1) >= sizeof host)
            return -EINVAL;
        memcpy(host, s + 1, (size_t)(close - s - 1));
        host[close - s - 1] = '\0';
        port_s = close + 2;
        if (inet_pton(AF_INET6, host, a.ip) != 1)
            return -EINVAL;
        a.family = 6;
    } else {
        const char *colon = strrchr(s, ':');
        if (!colon || (size_t)(colon - s) >= sizeof host || strchr(s, ':') != colon)
            return -EINVAL;
        memcpy(host, s, (size_t)(colon - s));
        host[colon - s] = '\0';
        port_s = colon + 1;
        if (inet_pton(AF_INET, host, a.ip) != 1)
            return -EINVAL;
        a.family = 4;
    }
    if (parse_port(port_s, &a.port, allow0) != 0)
        return -EINVAL;
    *out = a;
    return 0;
}

int dht_addr_parse(dht_addr *out, const char *s)
{
    return parse_addr(out, s, 0);
}

int dht_addr_parse_listen(dht_addr *out, const char *s)
{
    return parse_addr(out, s, 1);
}

int dht_addr_format(char *buf, size_t cap, const dht_addr *a)
{
    char host[INET6_ADDRSTRLEN];
    int n;
    if (!buf || !a)
        return -EINVAL;
    if (a->family == 4)
        inet_ntop(AF_INET, a->ip, host, sizeof host);
    else if (a->family == 6)
        inet_ntop(AF_INET6, a->ip, host, sizeof host);
    else
        return -EINVAL;
    n = snprintf(buf, cap, a->family == 6 ? "[%s]:%u" : "%s:%u", host, (unsigned)a->port);
    if (n < 0 || (size_t)n >= cap)
        return -ENOSPC;
    return n;
}

int dht_peer_addr_parse(dht_peer_addr *out, const char *s)
{
    char buf[DHT_ADDR_STRLEN];
    dht_peer_addr p;
    memset(&p, 0, sizeof p);
    if (!out || !s || strlen(s) >= sizeof buf)
        return -EINVAL;
    strcpy(buf, s);
    char *slash = strchr(buf, '/');
    if (slash) {
        *slash = '\0';
        if (dht_id_from_hex(p.id, slash + 1) != 0)
            return -EINVAL;
        p.has_id = 1;
    }
    if (dht_addr_parse(&p.addr, buf) != 0)
        return -EINVAL;
    *out = p;
    return 0;
}

int dht_peer_addr_format(char *buf, size_t cap, const dht_peer_addr *p)
{
    char hex[DHT_ID_HEX_LEN + 1];
    int n;
    if (!p)
        return -EINVAL;
    n = dht_addr_format(buf, cap, &p->addr);
    if (n < 0 || !p->has_id)
        return n;
    if ((size_t)n + 1 + DHT_ID_HEX_LEN >= cap)
        return -ENOSPC;
    dht_id_to_hex(hex, p->id);
    buf[n] = '/';
    memcpy(buf + n + 1, hex, DHT_ID_HEX_LEN + 1);
    return n + 1 + DHT_ID_HEX_LEN;
}

int dht_peer_list_parse(dht_peer_addr *out, size_t max, const char *s)
{
    size_t n = 0;
    if (!out || !s)
        return -EINVAL;
    for (;;) {
        char item[DHT_ADDR_STRLEN];
        const char *comma = strchr(s, ',');
        size_t len = comma ? (size_t)(comma - s) : strlen(s);
        if (len == 0 || len >= sizeof item)
            return -EINVAL;
        if (n == max)
            return -E2BIG;
        memcpy(item, s, len);
        item[len] = '\0';
        if (dht_peer_addr_parse(&out[n], item) != 0)
            return -EINVAL;
        n++;
        if (!comma)
            return (int)n;
        s = comma + 1;
    }
}

int dht_addr_to_sockaddr(const dht_addr *a, struct sockaddr_storage *ss)
{
    memset(ss, 0, sizeof *ss);
    if (a->family == 4) {
        struct sockaddr_in *s4 = (struct sockaddr_in *)ss;
        s4->sin_family = AF_INET;
        s4->sin_port = htons(a->port);
        memcpy(&s4->sin_addr, a->ip, 4);
        return (int)sizeof *s4;
    }
    if (a->family == 6) {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)ss;
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons(a->port);
        memcpy(&s6->sin6_addr, a->ip, 16);
        return (int)sizeof *s6;
    }
    return -EINVAL;
}

int dht_addr_from_sockaddr(dht_addr *out, const struct sockaddr *sa)
{
    static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    memset(out, 0, sizeof *out);
    if (sa->sa_family == AF_INET) {
        const struct sockaddr_in *s4 = (const struct sockaddr_in *)sa;
        out->family = 4;
        memcpy(out->ip, &s4->sin_addr, 4);
        out->port = ntohs(s4->sin_port);
        return 0;
    }
    if (sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)sa;
        const uint8_t *b = (const uint8_t *)&s6->sin6_addr;
        if (memcmp(b, mapped, 12) == 0) {
            out->family = 4;
            memcpy(out->ip, b + 12, 4);
        } else {
            out->family = 6;
            memcpy(out->ip, b, 16);
        }
        out->port = ntohs(s6->sin6_port);
        return 0;
    }
    return -EAFNOSUPPORT;
}
