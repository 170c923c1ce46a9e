/* tests/wan/netprobe.c: measures round-trip time and bandwidth between two
 * hosts of the emulated wide-area network (tests/wan/wanbed.sh).
 *
 *   netprobe serve PORT [SECONDS]
 *       UDP echo and TCP sink on PORT (every IPv4 and IPv6 address). Prints
 *       {"netprobe":"serve","port":PORT} once listening; exits 0 after
 *       SECONDS (default 300) or on SIGTERM/SIGINT.
 *   netprobe rtt HOST PORT COUNT
 *       sends COUNT UDP echo requests one after another (each waits at most
 *       1 s for its answer) and prints the median, minimum and maximum round
 *       trip in ms. Exits 1 if no answer came.
 *   netprobe bw HOST PORT SECONDS [--cc NAME] [--sndbuf BYTES]
 *       sends as fast as TCP allows for SECONDS, then half-closes; the server
 *       answers with what it counted, and this prints it: the rate in Mbit/s
 *       of TCP payload at the receiver, from the first read 0.5 s after the
 *       first byte to the last byte (slow start left out), and the sender's
 *       own figure (bytes handed to the socket / SECONDS, an overestimate by
 *       whatever sits in buffers). --cc picks the congestion control,
 *       --sndbuf fixes the send buffer (default: the kernel's autotuning,
 *       net.ipv4.tcp_wmem). Exits 1 on failure.
 *   netprobe reach HOST PORT TIMEOUT_MS
 *       one TCP connect: an accepted or refused connection (a RST) both show
 *       that packets get there and back. Exits 0 then, 1 on a timeout.
 *
 * Every command prints one JSON line on stdout; errors go to stderr. HOST is
 * a numeric IPv4 or IPv6 address. Every wait is bounded. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define NP_MAGIC 0x4e50524fu      /* "NPRO" */
#define NP_MAX_CONNS 16
#define NP_WARMUP_S 0.5           /* left out of the receiver's rate */
#define NP_IDLE_S 30.0            /* a TCP client silent this long is dropped */
#define NP_ECHO_TIMEOUT_MS 1000
#define NP_CONNECT_TIMEOUT_MS 5000
#define NP_RESULT_TIMEOUT_MS 30000
#define NP_BUF (256 * 1024)
#define NP_MAX_COUNT 100000

static volatile sig_atomic_t stop_signal;
static void on_signal(int sig) { stop_signal = sig; }

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what)
{
    fprintf(stderr, "netprobe: %s: %s\n", what, strerror(errno));
    exit(1);
}

static int parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return -EINVAL;
    *out = v;
    return 0;
}

/* Parses a numeric IPv4 or IPv6 host and a port into sa. */
static int parse_addr(const char *host, const char *port, struct sockaddr_storage *sa,
                      socklen_t *len_out)
{
    long p;
    memset(sa, 0, sizeof *sa);
    struct sockaddr_in *a4 = (struct sockaddr_in *)sa;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)sa;
    if (parse_long(port, 1, 65535, &p) < 0)
        goto bad;
    if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)p);
        *len_out = sizeof *a4;
        return 0;
    }
    if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)p);
        *len_out = sizeof *a6;
        return 0;
    }
bad:
    fprintf(stderr, "netprobe: bad address %s port %s (a numeric IPv4 or IPv6 address)\n", host, port);
    return -EINVAL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* -- serve -- */

struct conn {
    int fd;
    double first, warm, last, seen;  /* times; 0: not yet */
    uint64_t bytes, warm_bytes;
};

static void conn_close(struct conn *c)
{
    close(c->fd);
    c->fd = -1;
}

/* The client half-closed: answer with the receiver's figures (small enough
 * for the empty send buffer, so the blocking write does not wait) and close. */
static void conn_report(struct conn *c)
{
    double win = c->last - c->warm;
    double mbit = (c->warm > 0 && win > 0) ? (double)c->warm_bytes * 8 / win / 1e6 : 0;
    char line[256];
    int n = snprintf(line, sizeof line,
                     "{\"bytes\":%llu,\"window_bytes\":%llu,\"window_s\":%.4f,\"mbit_s\":%.3f}\n",
                     (unsigned long long)c->bytes, (unsigned long long)c->warm_bytes,
                     c->warm > 0 ? win : 0.0, mbit);
    int fl = fcntl(c->fd, F_GETFL);
    fcntl(c->fd, F_SETFL, fl & ~O_NONBLOCK);
    struct timeval tv = { .tv_sec = 2 };
    setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (write(c->fd, line, (size_t)n) != n)
        fprintf(stderr, "netprobe: could not send the result: %s\n", strerror(errno));
    conn_close(c);
}

static void conn_read(struct conn *c, char *buf)
{
    /* Bounded per call so that the UDP echo is not held up by a bulk sender. */
    for (int i = 0; i < 16; i++) {
        ssize_t r = read(c->fd, buf, NP_BUF);
        if (r == 0) {
            conn_report(c);
            return;
        }
        if (r < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                conn_close(c);
            return;
        }
        double t = now_s();
        c->seen = t;
        if (c->first == 0)
            c->first = t;
        c->bytes += (uint64_t)r;
        if (t - c->first >= NP_WARMUP_S) {
            if (c->warm == 0)
                c->warm = t; /* what this read returned arrived before it */
            else
                c->warm_bytes += (uint64_t)r;
            c->last = t;
        }
    }
}

static int cmd_serve(int argc, char **argv)
{
    long port, secs = 300;
    if (argc < 1 || parse_long(argv[0], 1, 65535, &port) < 0 ||
        (argc > 1 && parse_long(argv[1], 1, 86400, &secs) < 0)) {
        fprintf(stderr, "usage: netprobe serve PORT [SECONDS]\n");
        return 2;
    }
    /* One dual-stack socket of each kind: IPv4 clients arrive as
     * ::ffff:a.b.c.d. */
    struct sockaddr_in6 sa = { .sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port),
                               .sin6_addr = IN6ADDR_ANY_INIT };
    int one = 1, zero = 0;
    int u = socket(AF_INET6, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (u < 0)
        die("udp socket");
    setsockopt(u, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (bind(u, (struct sockaddr *)&sa, sizeof sa) < 0)
        die("udp bind");
    int l = socket(AF_INET6, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (l < 0)
        die("tcp socket");
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    setsockopt(l, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (bind(l, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(l, 16) < 0)
        die("tcp listen");
    struct sigaction act = { .sa_handler = on_signal };
    sigemptyset(&act.sa_mask);
    sigaction(SIGTERM, &act, NULL);
    sigaction(SIGINT, &act, NULL);
    signal(SIGPIPE, SIG_IGN);
    printf("{\"netprobe\":\"serve\",\"port\":%ld}\n", port);
    fflush(stdout);

    char *buf = malloc(NP_BUF);
    if (!buf)
        die("malloc");
    struct conn conns[NP_MAX_CONNS];
    for (int i = 0; i < NP_MAX_CONNS; i++)
        conns[i].fd = -1;
    double end = now_s() + (double)secs;
    while (!stop_signal) {
        double t = now_s();
        if (t >= end)
            break;
        struct pollfd pfd[2 + NP_MAX_CONNS];
        int idx[NP_MAX_CONNS];
        int n = 0;
        pfd[n++] = (struct pollfd){ .fd = u, .events = POLLIN };
        pfd[n++] = (struct pollfd){ .fd = l, .events = POLLIN };
        for (int i = 0; i < NP_MAX_CONNS; i++) {
            if (conns[i].fd < 0)
                continue;
            if (t - conns[i].seen > NP_IDLE_S) {
                conn_close(&conns[i]);
                continue;
            }
            idx[n - 2] = i;
            pfd[n++] = (struct pollfd){ .fd = conns[i].fd, .events = POLLIN };
        }
        double wait = end - t < 1.0 ? end - t : 1.0;
        int r = poll(pfd, (nfds_t)n, (int)(wait * 1000) + 1);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            die("poll");
        }
        if (pfd[0].revents & POLLIN) {
            /* Echo every datagram back as it came: the client matches it. */
            for (int k = 0; k < 64; k++) {
                struct sockaddr_storage from;
                socklen_t fl = sizeof from;
                ssize_t m = recvfrom(u, buf, 2048, 0, (struct sockaddr *)&from, &fl);
                if (m < 0)
                    break;
                (void)sendto(u, buf, (size_t)m, MSG_DONTWAIT, (struct sockaddr *)&from, fl);
            }
        }
        if (pfd[1].revents & POLLIN) {
            int c = accept4(l, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (c >= 0) {
                int slot = -1;
                for (int i = 0; i < NP_MAX_CONNS && slot < 0; i++)
                    if (conns[i].fd < 0)
                        slot = i;
                if (slot < 0) {
                    close(c);
                } else {
                    conns[slot] = (struct conn){ .fd = c, .seen = now_s() };
                }
            }
        }
        for (int k = 2; k < n; k++)
            if (pfd[k].revents & (POLLIN | POLLHUP | POLLERR))
                conn_read(&conns[idx[k - 2]], buf);
    }
    for (int i = 0; i < NP_MAX_CONNS; i++)
        if (conns[i].fd >= 0)
            conn_close(&conns[i]);
    close(l);
    close(u);
    free(buf);
    return 0;
}

/* -- rtt -- */

struct echo {
    uint32_t magic, seq;
    uint64_t pad[4];
};

static int cmd_rtt(int argc, char **argv)
{
    struct sockaddr_storage sa;
    socklen_t salen;
    long count;
    if (argc < 3 || parse_addr(argv[0], argv[1], &sa, &salen) < 0 ||
        parse_long(argv[2], 1, NP_MAX_COUNT, &count) < 0) {
        fprintf(stderr, "usage: netprobe rtt HOST PORT COUNT\n");
        return 2;
    }
    int fd = socket(sa.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, salen) < 0)
        die("udp connect");
    double *rtt = malloc((size_t)count * sizeof *rtt);
    if (!rtt)
        die("malloc");
    long got = 0, refused = 0;
    for (long i = 0; i < count; i++) {
        struct echo q = { .magic = NP_MAGIC, .seq = (uint32_t)i };
        double t0 = now_s();
        if (send(fd, &q, sizeof q, 0) < 0) {
            if (errno == ECONNREFUSED) {
                refused++;
                usleep(100000); /* nobody listens yet: do not spin */
                continue;
            }
            die("send");
        }
        for (;;) {
            int left = NP_ECHO_TIMEOUT_MS - (int)((now_s() - t0) * 1000);
            if (left <= 0)
                break;
            struct pollfd p = { .fd = fd, .events = POLLIN };
            if (poll(&p, 1, left) <= 0)
                continue;
            struct echo a;
            ssize_t m = recv(fd, &a, sizeof a, MSG_DONTWAIT);
            if (m < 0) {
                if (errno == ECONNREFUSED) {
                    refused++;
                    usleep(100000);
                    break;
                }
                continue;
            }
            if (m == (ssize_t)sizeof a && a.magic == NP_MAGIC && a.seq == q.seq) {
                rtt[got++] = (now_s() - t0) * 1000;
                break;
            }
            /* A late answer to an earlier request: keep waiting for ours. */
        }
    }
    close(fd);
    if (got == 0) {
        printf("{\"netprobe\":\"rtt\",\"sent\":%ld,\"received\":0,\"refused\":%ld}\n", count, refused);
        free(rtt);
        return 1;
    }
    qsort(rtt, (size_t)got, sizeof *rtt, cmp_double);
    double med = got % 2 ? rtt[got / 2] : (rtt[got / 2 - 1] + rtt[got / 2]) / 2;
    printf("{\"netprobe\":\"rtt\",\"sent\":%ld,\"received\":%ld,\"median_ms\":%.3f,"
           "\"min_ms\":%.3f,\"max_ms\":%.3f}\n",
           count, got, med, rtt[0], rtt[got - 1]);
    free(rtt);
    return 0;
}

/* -- bw and reach -- */

/* Connects fd (non-blocking) to sa within timeout_ms. Returns 0 or -errno
 * (-ETIMEDOUT, -ECONNREFUSED, ...). */
static int connect_timed(int fd, const struct sockaddr_storage *sa, socklen_t salen,
                         int timeout_ms)
{
    if (connect(fd, (const struct sockaddr *)sa, salen) == 0)
        return 0;
    if (errno != EINPROGRESS)
        return -errno;
    double end = now_s() + timeout_ms / 1000.0;
    for (;;) {
        int left = (int)((end - now_s()) * 1000);
        if (left <= 0)
            return -ETIMEDOUT;
        struct pollfd p = { .fd = fd, .events = POLLOUT };
        int r = poll(&p, 1, left);
        if (r < 0 && errno != EINTR)
            return -errno;
        if (r > 0)
            break;
    }
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
        return -errno;
    return -err;
}

static int cmd_reach(int argc, char **argv)
{
    struct sockaddr_storage sa;
    socklen_t salen;
    long ms;
    if (argc < 3 || parse_addr(argv[0], argv[1], &sa, &salen) < 0 ||
        parse_long(argv[2], 1, 600000, &ms) < 0) {
        fprintf(stderr, "usage: netprobe reach HOST PORT TIMEOUT_MS\n");
        return 2;
    }
    int fd = socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die("socket");
    double t0 = now_s();
    int r = connect_timed(fd, &sa, salen, (int)ms);
    close(fd);
    int ok = r == 0 || r == -ECONNREFUSED;
    printf("{\"netprobe\":\"reach\",\"reachable\":%s,\"ms\":%.3f,\"result\":\"%s\"}\n",
           ok ? "true" : "false", (now_s() - t0) * 1000, r == 0 ? "connected" : strerror(-r));
    return ok ? 0 : 1;
}

static int cmd_bw(int argc, char **argv)
{
    struct sockaddr_storage sa;
    socklen_t salen;
    long secs, sndbuf = 0;
    const char *cc = NULL;
    if (argc < 3 || parse_addr(argv[0], argv[1], &sa, &salen) < 0 ||
        parse_long(argv[2], 1, 3600, &secs) < 0)
        goto usage;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--cc") && i + 1 < argc)
            cc = argv[++i];
        else if (!strcmp(argv[i], "--sndbuf") && i + 1 < argc &&
                 parse_long(argv[i + 1], 4096, 1L << 30, &sndbuf) == 0)
            i++;
        else
            goto usage;
    }
    signal(SIGPIPE, SIG_IGN);
    int fd = socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        die("socket");
    if (cc && setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, (socklen_t)strlen(cc)) < 0)
        die("TCP_CONGESTION");
    if (sndbuf) {
        int v = (int)sndbuf;
        if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v) < 0)
            die("SO_SNDBUF");
    }
    int r = connect_timed(fd, &sa, salen, NP_CONNECT_TIMEOUT_MS);
    if (r < 0) {
        errno = -r;
        die("connect");
    }
    char *buf = calloc(1, NP_BUF);
    if (!buf)
        die("malloc");
    uint64_t sent = 0;
    double t0 = now_s(), end = t0 + (double)secs;
    for (;;) {
        double t = now_s();
        if (t >= end)
            break;
        struct pollfd p = { .fd = fd, .events = POLLOUT };
        int pr = poll(&p, 1, (int)((end - t) * 1000) + 1);
        if (pr < 0 && errno != EINTR)
            die("poll");
        if (pr <= 0)
            continue;
        ssize_t w = write(fd, buf, NP_BUF);
        if (w < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                continue;
            die("write");
        }
        sent += (uint64_t)w;
    }
    double sent_s = now_s() - t0;
    if (shutdown(fd, SHUT_WR) < 0)
        die("shutdown");
    /* The server answers once it has read everything: what sits in buffers
     * drains first, at the link's rate. */
    char res[512];
    size_t have = 0;
    double rend = now_s() + NP_RESULT_TIMEOUT_MS / 1000.0;
    while (have < sizeof res - 1) {
        int left = (int)((rend - now_s()) * 1000);
        if (left <= 0) {
            fprintf(stderr, "netprobe: no result from the server within %d ms\n", NP_RESULT_TIMEOUT_MS);
            return 1;
        }
        struct pollfd p = { .fd = fd, .events = POLLIN };
        if (poll(&p, 1, left) <= 0)
            continue;
        ssize_t m = read(fd, res + have, sizeof res - 1 - have);
        if (m == 0)
            break;
        if (m < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            die("read result");
        }
        have += (size_t)m;
    }
    res[have] = 0;
    close(fd);
    free(buf);
    char *nl = strchr(res, '\n');
    double mbit;
    char *m = strstr(res, "\"mbit_s\":");
    if (!nl || !m || sscanf(m, "\"mbit_s\":%lf", &mbit) != 1) {
        fprintf(stderr, "netprobe: bad result from the server: %s\n", res);
        return 1;
    }
    *nl = 0;
    /* The server's object, with the sender's figures added at its end. */
    char *brace = strrchr(res, '}');
    if (brace)
        *brace = 0;
    printf("{\"netprobe\":\"bw\",%s,\"sender_bytes\":%llu,\"sender_s\":%.3f,\"sender_mbit_s\":%.3f}\n",
           res + 1, (unsigned long long)sent, sent_s, (double)sent * 8 / sent_s / 1e6);
    return mbit > 0 ? 0 : 1;
usage:
    fprintf(stderr, "usage: netprobe bw HOST PORT SECONDS [--cc NAME] [--sndbuf BYTES]\n");
    return 2;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "serve"))
        return cmd_serve(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "rtt"))
        return cmd_rtt(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "bw"))
        return cmd_bw(argc - 2, argv + 2);
    if (argc >= 2 && !strcmp(argv[1], "reach"))
        return cmd_reach(argc - 2, argv + 2);
    fprintf(stderr, "usage: netprobe serve PORT [SECONDS] | rtt HOST PORT COUNT |\n"
                    "       bw HOST PORT SECONDS [--cc NAME] [--sndbuf BYTES] |\n"
                    "       reach HOST PORT TIMEOUT_MS\n");
    return 2;
}
