/* tests/hostile.c: a hostile client for the soak test (tests/test_swarm_soak.sh).
 *
 *   hostile udp HOST:PORT COUNT SEED
 *       sends COUNT garbage datagrams to a DHT node: random bytes of random
 *       length (0..1400), msgpack maps with random keys and values, and valid
 *       DHT requests with random bytes flipped or cut short.
 *   hostile tcp HOST:PORT COUNT SEED FROM_IP HOLD_S
 *       opens COUNT connections to a peer's RPC port from FROM_IP and
 *       misbehaves on each, in turn: stays silent; sends garbage; sends half
 *       a handshake; completes the handshake, then announces a huge record
 *       and sends only part of it; completes it, sends a valid request and
 *       resets the connection without reading the reply; resets at once.
 *       The open ones are held HOLD_S seconds, then closed.
 *
 * Prints one line of counts. Exits 0 unless it could not run at all: what the
 * target does with the garbage (drop it, refuse, close) is the test's
 * business, judged by the target still serving honest clients. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>

#include "dht/addr.h"
#include "dht/identity.h"
#include "dht/wire.h"
#include "net/channel.h"
#include "net/wire.h"

static uint64_t rng_state;
static volatile sig_atomic_t stop;

static void on_term(int sig)
{
    (void)sig;
    stop = 1;
}

static uint32_t rnd(void)
{
    /* xorshift64*: deterministic per seed, so a failure can be replayed. */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 2685821657736338717ull) >> 32);
}

static void fill(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rnd();
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int parse_target(const char *s, struct sockaddr_storage *ss, socklen_t *len)
{
    dht_addr a;
    if (dht_addr_parse(&a, s) != 0)
        return -1;
    int l = dht_addr_to_sockaddr(&a, ss);
    if (l <= 0)
        return -1;
    *len = (socklen_t)l;
    return 0;
}

/* A random msgpack-looking datagram: a map of random small keys to values of
 * random types, sometimes cut short. */
static size_t msgpack_garbage(uint8_t *b, size_t cap)
{
    size_t n = 0;
    int entries = (int)(rnd() % 8);
    b[n++] = (uint8_t)(0x80 | entries);
    for (int i = 0; i < entries && n + 40 < cap; i++) {
        static const char *keys[] = {"y", "q", "t", "id", "tg", "k", "o", "e", "n", "v", "nd", "s"};
        const char *k = keys[rnd() % (sizeof keys / sizeof keys[0])];
        size_t kl = strlen(k);
        b[n++] = (uint8_t)(0xa0 | kl);
        memcpy(b + n, k, kl);
        n += kl;
        switch (rnd() % 6) {
        case 0: b[n++] = (uint8_t)(rnd() & 0x7f); break;               /* fixint */
        case 1: b[n++] = 0xc4; b[n++] = 20; fill(b + n, 20); n += 20; break; /* bin 20 */
        case 2: b[n++] = 0xc4; b[n++] = 0xff; break;                   /* bin, length lies */
        case 3: b[n++] = 0xdd; fill(b + n, 4); n += 4; break;           /* array32, huge */
        case 4: b[n++] = 0xcf; fill(b + n, 8); n += 8; break;           /* uint64 */
        default: for (int d = 0; d < 30; d++) b[n++] = 0x91; b[n++] = 0xc0; break; /* deep */
        }
    }
    if (rnd() % 4 == 0 && n > 1)
        n = 1 + rnd() % (n - 1);
    return n;
}

/* A valid DHT request (ping, find_node, get or store) with a few bytes
 * flipped or its tail cut. */
static size_t mutated_request(uint8_t *b, size_t cap)
{
    static dht_msg m; /* large (20 nodes, 32 entries): not on the stack */
    memset(&m, 0, sizeof m);
    static const uint8_t types[] = {DHT_MSG_PING, DHT_MSG_FIND_NODE, DHT_MSG_GET, DHT_MSG_STORE};
    m.type = types[rnd() % 4];
    m.tid = rnd();
    fill(m.id, DHT_ID_LEN);
    fill(m.target, DHT_ID_LEN);
    m.offset = rnd() % 64;
    uint8_t val[64];
    if (m.type == DHT_MSG_STORE) {
        fill(val, sizeof val);
        m.entries[0].value = val;
        m.entries[0].value_len = 1 + rnd() % sizeof val;
        m.entries[0].subkey = val;
        m.entries[0].subkey_len = rnd() % 20;
        m.entries[0].expires = 1 + rnd();
        m.n_entries = 1;
        fill(m.token, DHT_TOKEN_LEN);
        m.has_token = 1;
    }
    int n = dht_wire_encode(&m, b, cap);
    if (n <= 0)
        return 0;
    int flips = 1 + (int)(rnd() % 4);
    for (int i = 0; i < flips; i++)
        b[rnd() % (unsigned)n] ^= (uint8_t)(1u << (rnd() % 8));
    if (rnd() % 3 == 0)
        n = 1 + (int)(rnd() % (unsigned)n);
    return (size_t)n;
}

static int cmd_udp(const char *target, long count)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    if (parse_target(target, &ss, &sl) != 0) {
        fprintf(stderr, "hostile: bad target '%s'\n", target);
        return 2;
    }
    int fd = socket(ss.ss_family, SOCK_DGRAM, 0);
    if (fd < 0) {
        perror("hostile: socket");
        return 2;
    }
    long sent = 0;
    uint8_t buf[1500];
    for (long i = 0; i < count; i++) {
        size_t n;
        switch (rnd() % 3) {
        case 0: n = rnd() % 1401; fill(buf, n); break;
        case 1: n = msgpack_garbage(buf, sizeof buf); break;
        default: n = mutated_request(buf, sizeof buf); break;
        }
        if (sendto(fd, buf, n, 0, (struct sockaddr *)&ss, sl) >= 0)
            sent++;
        /* About 2,000 datagrams a second per target: a flood that lasts
         * while a trainer trains, not one the kernel's socket buffer simply
         * drops wholesale. */
        if (i % 20 == 19)
            sleep_ms(10);
    }
    close(fd);
    printf("udp: sent %ld of %ld datagrams to %s\n", sent, count, target);
    return 0;
}

/* Blocking I/O with a deadline, for the few handshake bytes. */
static int send_all(int fd, const uint8_t *p, size_t n)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int recv_all(int fd, uint8_t *p, size_t n)
{
    while (n) {
        ssize_t r = recv(fd, p, n, 0);
        if (r <= 0)
            return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

/* Runs the initiator's handshake on fd. Returns the channel or NULL. */
static peer_channel *handshake(int fd, const dht_identity *self)
{
    peer_channel_config cc;
    memset(&cc, 0, sizeof cc);
    cc.self = self;
    peer_channel *ch = peer_channel_create(&cc, 1);
    if (!ch)
        return NULL;
    uint8_t out[PEER_CHANNEL_HS_MAX], in[PEER_CHANNEL_HS_MAX];
    int n = peer_channel_hello(ch, out);
    if (n <= 0 || send_all(fd, out, (size_t)n) != 0)
        goto fail;
    for (int step = 0; step < 4 && !peer_channel_established(ch); step++) {
        size_t want = peer_channel_hs_expect(ch);
        if (!want || want > sizeof in || recv_all(fd, in, want) != 0)
            goto fail;
        size_t ol = 0;
        int rc = peer_channel_hs_input(ch, in, out, &ol);
        if (rc < 0)
            goto fail;
        if (ol && send_all(fd, out, ol) != 0)
            goto fail;
    }
    if (peer_channel_established(ch))
        return ch;
fail:
    peer_channel_destroy(&ch);
    return NULL;
}

static void reset_close(int fd)
{
    struct linger lg = {1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
}

static int cmd_tcp(const char *target, long count, const char *from, int hold_s)
{
    struct sockaddr_storage ss, src;
    socklen_t sl;
    memset(&src, 0, sizeof src);
    if (parse_target(target, &ss, &sl) != 0 || ss.ss_family != AF_INET) {
        fprintf(stderr, "hostile: bad IPv4 target '%s'\n", target);
        return 2;
    }
    struct sockaddr_in *s4 = (struct sockaddr_in *)&src;
    s4->sin_family = AF_INET;
    if (inet_pton(AF_INET, from, &s4->sin_addr) != 1) {
        fprintf(stderr, "hostile: bad source address '%s'\n", from);
        return 2;
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    dht_identity self;
    if (dht_identity_generate(&self) != 0)
        return 2;
    int *fds = calloc((size_t)count, sizeof *fds);
    if (!fds)
        return 2;
    long connected = 0, refused = 0, handshakes = 0, held = 0;
    for (long i = 0; i < count; i++) {
        fds[i] = -1;
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            refused++;
            continue;
        }
        /* Replies the server sends must not block our handshake forever. */
        struct timeval tv = {2, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (bind(fd, (struct sockaddr *)&src, sizeof *s4) != 0 ||
            connect(fd, (struct sockaddr *)&ss, sl) != 0) {
            refused++;
            close(fd);
            continue;
        }
        connected++;
        uint8_t buf[8192];
        peer_channel *ch = NULL;
        switch (i % 6) {
        case 0: /* silent */
            break;
        case 1: /* garbage */
            fill(buf, 64 + rnd() % 4000);
            (void)send_all(fd, buf, 64 + rnd() % 4000);
            break;
        case 2: { /* half a handshake */
            peer_channel_config cc;
            memset(&cc, 0, sizeof cc);
            cc.self = &self;
            ch = peer_channel_create(&cc, 1);
            int n = ch ? peer_channel_hello(ch, buf) : 0;
            if (n > 1)
                (void)send_all(fd, buf, (size_t)n / 2);
            peer_channel_destroy(&ch);
            break;
        }
        case 3: /* handshake, then part of a huge record */
            if ((ch = handshake(fd, &self)) != NULL) {
                handshakes++;
                uint32_t len = 1u << 20;
                memcpy(buf, &len, 4); /* little-endian hosts only, as the test runs */
                fill(buf + 4, 4096);
                (void)send_all(fd, buf, 4100);
                peer_channel_destroy(&ch);
            }
            break;
        case 4: /* handshake, one valid info request, reset without reading */
            if ((ch = handshake(fd, &self)) != NULL) {
                handshakes++;
                peer_msg m;
                peer_msg_init(&m, PEER_KIND_REQUEST, PEER_METHOD_INFO, 1);
                long n = peer_wire_encode(&m, buf + PEER_CHANNEL_HDR_LEN,
                                          sizeof buf - PEER_CHANNEL_HDR_LEN - PEER_CHANNEL_TAG_LEN);
                long rec = n > 0 ? peer_channel_seal(ch, buf, (size_t)n) : -1;
                if (rec > 0)
                    (void)send_all(fd, buf, (size_t)rec);
                peer_channel_destroy(&ch);
            }
            reset_close(fd);
            continue;
        default: /* reset at once */
            reset_close(fd);
            continue;
        }
        fds[i] = fd;
        held++;
    }
    printf("tcp: opened %ld connections (%ld held)\n", connected, held);
    fflush(stdout);
    /* Hold what is open (until HOLD_S or SIGTERM), then count how many the
     * target has closed. */
    time_t t0 = time(NULL);
    for (int s = 0; s < hold_s * 10 && !stop; s++)
        sleep_ms(100);
    long waited = (long)(time(NULL) - t0);
    long closed_by_target = 0;
    for (long i = 0; i < count; i++) {
        if (fds[i] < 0)
            continue;
        struct pollfd p = {fds[i], POLLIN, 0};
        if (poll(&p, 1, 0) == 1) {
            uint8_t b[4096];
            ssize_t r;
            while ((r = recv(fds[i], b, sizeof b, MSG_DONTWAIT)) > 0) {
            }
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK))
                closed_by_target++;
        }
        close(fds[i]);
    }
    free(fds);
    printf("tcp: %ld connections to %s from %s: %ld connected, %ld refused, %ld handshakes, "
           "%ld held, %ld of them closed by the target within %ld s\n",
           count, target, from, connected, refused, handshakes, held, closed_by_target, waited);
    return 0;
}

int main(int argc, char **argv)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (argc >= 5 && strcmp(argv[1], "udp") == 0) {
        rng_state = strtoull(argv[4], NULL, 10) * 2654435761u + 1;
        return cmd_udp(argv[2], strtol(argv[3], NULL, 10));
    }
    if (argc >= 7 && strcmp(argv[1], "tcp") == 0) {
        rng_state = strtoull(argv[4], NULL, 10) * 2654435761u + 1;
        return cmd_tcp(argv[2], strtol(argv[3], NULL, 10), argv[5], atoi(argv[6]));
    }
    fprintf(stderr, "usage: hostile udp HOST:PORT COUNT SEED\n"
                    "       hostile tcp HOST:PORT COUNT SEED FROM_IP HOLD_S\n");
    return 2;
}
