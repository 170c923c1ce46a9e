/* tests/wan/delay_bridge.c: a learning Ethernet bridge that holds every frame
 * for a fixed one-way delay before it forwards it (tests/wan/wanbed.sh).
 *
 *   delay_bridge [--delay-ms MS] [--max-bytes N] [--max-frames N] IFACE...
 *
 * It stands in for `tc qdisc netem delay`, which this project's kernels lack.
 * Run it in a "router" network namespace that holds one veth end per host: it
 * opens an AF_PACKET socket on each IFACE (in promiscuous mode), learns which
 * port each source MAC address lives behind, and sends every frame it reads
 * (ARP, IPv4, IPv6, anything) out of the port its destination lives behind,
 * or out of every other port for broadcast, multicast and unknown
 * destinations, MS milliseconds (default 0, fractions allowed) after it read
 * it. A frame that crosses the bridge once per direction thus adds 2*MS to a
 * round trip. Rate limiting is not its job: `tc qdisc tbf` on the ports does
 * that (a qdisc on a port also applies to what the bridge sends out of it).
 *
 * The delay is the same for every frame, so frames leave each port in the
 * order they were queued for it: each port has a FIFO, and the next deadline
 * is the earliest head among the ports. Frames are read and sent in batches
 * (recvmmsg/sendmmsg) and carry their virtio-net header (PACKET_VNET_HDR), so
 * a TCP segment the host stack hands over as one 64 KiB GSO frame with its
 * checksum left to "hardware" crosses the bridge as one frame too: that keeps
 * the cost per byte low enough for 100 Mbit/s on a busy two-core machine.
 *
 * Memory is bounded: a frame that would take the queued total past
 * --max-bytes (default 64 MiB) or --max-frames (default 65536) is dropped and
 * counted. A send the qdisc refuses (tbf's queue is full: -ENOBUFS) is a drop
 * on the emulated link and is counted too; a full socket send buffer
 * (-EAGAIN) waits for POLLOUT instead.
 *
 * Prints "delay_bridge: forwarding ..." to stderr once every socket is bound,
 * runs until SIGTERM or SIGINT, then prints one JSON line of counters per
 * port and one of totals (with the CPU seconds it used) to stderr and exits
 * 0. Exits 1 if it cannot start
 * (not root, unknown interface), 2 on bad arguments. */
#include <errno.h>
#include <inttypes.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/virtio_net.h>
#include <net/if.h>
#include <arpa/inet.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BR_MAX_PORTS 64
/* Frames per recvmmsg/sendmmsg call, and frames read from one port per loop
 * turn (so that a flood on one port does not hold back the others' sends:
 * deadlines are checked at least once per turn). */
#define BR_BATCH 32
#define BR_RX_BUDGET 256
/* The virtio-net header, then a frame: up to 64 KiB for a GSO frame. A larger
 * one (BIG TCP) is cut short by the kernel and dropped as truncated. */
#define BR_VNET_LEN ((int)sizeof(struct virtio_net_hdr))
#define BR_FRAME_MAX (BR_VNET_LEN + 65536 + 1024)
#define BR_MACS 256
/* A learned address is forgotten after this long without a frame from it. */
#define BR_MAC_AGE_NS (300ull * 1000000000ull)
#define BR_SOCKBUF (8 << 20)

struct frame {
    struct frame *next;
    uint64_t due_ns;
    uint32_t len;            /* bytes in data: virtio-net header + frame */
    unsigned char data[];
};

struct port {
    char name[IF_NAMESIZE];
    int fd;
    struct frame *head, *tail; /* oldest first; due_ns never decreases */
    bool blocked;              /* send buffer full: waiting for POLLOUT */
    uint64_t rx_frames, rx_bytes, tx_frames, tx_bytes;
    uint64_t drop_queue;       /* queue bound reached when it was queued */
    uint64_t drop_qdisc;       /* the port's qdisc refused it (-ENOBUFS) */
    uint64_t drop_tx;          /* any other send error (link down, ...) */
    uint64_t flood_frames;     /* frames read here that were flooded */
    uint64_t queued_frames, queued_bytes, max_queued_bytes;
};

struct mac_entry {
    unsigned char mac[ETH_ALEN];
    int port;                  /* -1: free slot */
    uint64_t seen_ns;
};

struct bridge {
    struct port ports[BR_MAX_PORTS];
    int nports;
    uint64_t delay_ns;
    uint64_t max_bytes, max_frames;
    uint64_t queued_bytes, queued_frames;
    uint64_t drop_trunc, drop_runt, drop_local, drop_nomem, rx_errors;
    struct mac_entry macs[BR_MACS];
    /* Receive buffers for one batch. */
    unsigned char *rxbuf;
    struct mmsghdr rx_msgs[BR_BATCH];
    struct iovec rx_iov[BR_BATCH];
    struct sockaddr_ll rx_addr[BR_BATCH];
};

static volatile sig_atomic_t stop_signal;

static void on_signal(int sig) { stop_signal = sig; }

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: delay_bridge [--delay-ms MS] [--max-bytes N] [--max-frames N] IFACE...\n"
               "  Forwards Ethernet frames between IFACEs (2..%d) after a fixed one-way delay.\n",
            BR_MAX_PORTS);
}

/* Opens port p's socket on interface name: promiscuous, our own sends not
 * read back, virtio-net headers on. Returns 0 or -errno (printed). */
static int port_open(struct port *p, const char *name)
{
    snprintf(p->name, sizeof p->name, "%s", name);
    unsigned idx = if_nametoindex(name);
    if (idx == 0) {
        fprintf(stderr, "delay_bridge: no interface %s: %s\n", name, strerror(errno));
        return -ENODEV;
    }
    int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, htons(ETH_P_ALL));
    if (fd < 0) {
        int e = errno;
        fprintf(stderr, "delay_bridge: packet socket: %s (needs root or CAP_NET_RAW)\n", strerror(e));
        return -e;
    }
    int one = 1;
    if (setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) < 0)
        goto fail;
    /* Frames we send out of a port would otherwise be read back from that
     * port's socket as PACKET_OUTGOING (also checked per frame, for kernels
     * before 4.20 that lack this option). */
    (void)setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one);
    int sz = BR_SOCKBUF;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &sz, sizeof sz) < 0)
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &sz, sizeof sz) < 0)
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
    struct sockaddr_ll sll = {
        .sll_family = AF_PACKET,
        .sll_protocol = htons(ETH_P_ALL),
        .sll_ifindex = (int)idx,
    };
    if (bind(fd, (struct sockaddr *)&sll, sizeof sll) < 0)
        goto fail;
    struct packet_mreq mr = { .mr_ifindex = (int)idx, .mr_type = PACKET_MR_PROMISC };
    if (setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof mr) < 0)
        goto fail;
    p->fd = fd;
    return 0;
fail:;
    int e = errno;
    fprintf(stderr, "delay_bridge: %s: %s\n", name, strerror(e));
    close(fd);
    return -e;
}

static int mac_lookup(const struct bridge *b, const unsigned char *mac, uint64_t now)
{
    for (int i = 0; i < BR_MACS; i++) {
        const struct mac_entry *m = &b->macs[i];
        if (m->port >= 0 && memcmp(m->mac, mac, ETH_ALEN) == 0)
            return now - m->seen_ns < BR_MAC_AGE_NS ? m->port : -1;
    }
    return -1;
}

/* Records that mac was seen on port. When the table is full the entry seen
 * longest ago makes room. */
static void mac_learn(struct bridge *b, const unsigned char *mac, int port, uint64_t now)
{
    int slot = -1, oldest = 0;
    for (int i = 0; i < BR_MACS; i++) {
        struct mac_entry *m = &b->macs[i];
        if (m->port >= 0 && memcmp(m->mac, mac, ETH_ALEN) == 0) {
            m->port = port;
            m->seen_ns = now;
            return;
        }
        if (m->port < 0 && slot < 0)
            slot = i;
        if (b->macs[i].seen_ns < b->macs[oldest].seen_ns)
            oldest = i;
    }
    if (slot < 0)
        slot = oldest;
    memcpy(b->macs[slot].mac, mac, ETH_ALEN);
    b->macs[slot].port = port;
    b->macs[slot].seen_ns = now;
}

/* Queues a copy of data (len bytes) on port out, due at due. Drops and counts
 * it when the bounds would be exceeded. */
static void enqueue(struct bridge *b, struct port *out, const unsigned char *data,
                    uint32_t len, uint64_t due)
{
    uint64_t cost = sizeof(struct frame) + len;
    if (b->queued_bytes + cost > b->max_bytes || b->queued_frames + 1 > b->max_frames) {
        out->drop_queue++;
        return;
    }
    struct frame *f = malloc(sizeof *f + len);
    if (!f) {
        b->drop_nomem++;
        return;
    }
    f->next = NULL;
    f->due_ns = due;
    f->len = len;
    memcpy(f->data, data, len);
    if (out->tail)
        out->tail->next = f;
    else
        out->head = f;
    out->tail = f;
    out->queued_frames++;
    out->queued_bytes += cost;
    if (out->queued_bytes > out->max_queued_bytes)
        out->max_queued_bytes = out->queued_bytes;
    b->queued_frames++;
    b->queued_bytes += cost;
}

static void dequeue_head(struct bridge *b, struct port *p)
{
    struct frame *f = p->head;
    uint64_t cost = sizeof(struct frame) + f->len;
    p->head = f->next;
    if (!p->head)
        p->tail = NULL;
    p->queued_frames--;
    p->queued_bytes -= cost;
    b->queued_frames--;
    b->queued_bytes -= cost;
    free(f);
}

/* Decides where one frame read on port in goes and queues it there. */
static void forward(struct bridge *b, int in, const unsigned char *data, uint32_t len, uint64_t now)
{
    const unsigned char *eth = data + BR_VNET_LEN;
    const unsigned char *dst = eth, *src = eth + ETH_ALEN;
    uint64_t due = now + b->delay_ns;
    if (!(src[0] & 1))
        mac_learn(b, src, in, now);
    int out = (dst[0] & 1) ? -1 : mac_lookup(b, dst, now);
    if (out == in) {
        b->drop_local++; /* both ends behind the same port: not ours to carry */
        return;
    }
    if (out >= 0) {
        enqueue(b, &b->ports[out], data, len, due);
        return;
    }
    b->ports[in].flood_frames++;
    for (int i = 0; i < b->nports; i++)
        if (i != in)
            enqueue(b, &b->ports[i], data, len, due);
}

/* Reads up to BR_RX_BUDGET frames from port i and queues them. */
static void port_receive(struct bridge *b, int i)
{
    struct port *p = &b->ports[i];
    for (int got = 0; got < BR_RX_BUDGET;) {
        for (int k = 0; k < BR_BATCH; k++) {
            b->rx_msgs[k].msg_hdr.msg_namelen = sizeof b->rx_addr[k];
            b->rx_msgs[k].msg_hdr.msg_flags = 0;
        }
        int n = recvmmsg(p->fd, b->rx_msgs, BR_BATCH, MSG_DONTWAIT, NULL);
        if (n < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                b->rx_errors++;
            return;
        }
        uint64_t now = now_ns();
        for (int k = 0; k < n; k++) {
            const struct mmsghdr *m = &b->rx_msgs[k];
            if (b->rx_addr[k].sll_pkttype == PACKET_OUTGOING)
                continue;
            if (m->msg_hdr.msg_flags & MSG_TRUNC) {
                b->drop_trunc++;
                continue;
            }
            if (m->msg_len < (unsigned)BR_VNET_LEN + ETH_HLEN) {
                b->drop_runt++;
                continue;
            }
            p->rx_frames++;
            p->rx_bytes += m->msg_len - BR_VNET_LEN;
            forward(b, i, b->rx_iov[k].iov_base, m->msg_len, now);
        }
        got += n;
        if (n < BR_BATCH)
            return;
    }
}

/* Sends every frame on port p that is due by now, in batches, until one is
 * not yet due or the socket's send buffer is full. */
static void port_send(struct bridge *b, struct port *p, uint64_t now)
{
    struct mmsghdr msgs[BR_BATCH];
    struct iovec iov[BR_BATCH];
    while (p->head && p->head->due_ns <= now) {
        int n = 0;
        for (struct frame *f = p->head; f && f->due_ns <= now && n < BR_BATCH; f = f->next, n++) {
            iov[n] = (struct iovec){ .iov_base = f->data, .iov_len = f->len };
            msgs[n] = (struct mmsghdr){ .msg_hdr = { .msg_iov = &iov[n], .msg_iovlen = 1 } };
        }
        int sent = sendmmsg(p->fd, msgs, (unsigned)n, MSG_DONTWAIT);
        if (sent < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                p->blocked = true;
                return;
            }
            if (errno == EINTR)
                continue;
            /* The head frame is gone: refused by the qdisc (-ENOBUFS) or
             * the link (-ENETDOWN, -EMSGSIZE, ...). */
            if (errno == ENOBUFS)
                p->drop_qdisc++;
            else
                p->drop_tx++;
            dequeue_head(b, p);
            continue;
        }
        for (int k = 0; k < sent; k++) {
            p->tx_frames++;
            p->tx_bytes += p->head->len - BR_VNET_LEN;
            dequeue_head(b, p);
        }
    }
    p->blocked = false;
}

static void print_stats(const struct bridge *b)
{
    uint64_t rx = 0, tx = 0, dq = 0, dqd = 0, dtx = 0, flushed = 0;
    struct rusage ru;
    double cpu = 0;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
              (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
    for (int i = 0; i < b->nports; i++) {
        const struct port *p = &b->ports[i];
        fprintf(stderr,
                "{\"delay_bridge\":\"port\",\"name\":\"%s\",\"rx_frames\":%" PRIu64
                ",\"rx_bytes\":%" PRIu64 ",\"tx_frames\":%" PRIu64 ",\"tx_bytes\":%" PRIu64
                ",\"flooded\":%" PRIu64 ",\"drop_queue\":%" PRIu64 ",\"drop_qdisc\":%" PRIu64
                ",\"drop_tx\":%" PRIu64 ",\"max_queued_bytes\":%" PRIu64 ",\"flushed\":%" PRIu64 "}\n",
                p->name, p->rx_frames, p->rx_bytes, p->tx_frames, p->tx_bytes, p->flood_frames,
                p->drop_queue, p->drop_qdisc, p->drop_tx, p->max_queued_bytes, p->queued_frames);
        rx += p->rx_frames;
        tx += p->tx_frames;
        dq += p->drop_queue;
        dqd += p->drop_qdisc;
        dtx += p->drop_tx;
        flushed += p->queued_frames;
    }
    fprintf(stderr,
            "{\"delay_bridge\":\"total\",\"delay_ms\":%.3f,\"rx_frames\":%" PRIu64
            ",\"tx_frames\":%" PRIu64 ",\"drop_queue\":%" PRIu64 ",\"drop_qdisc\":%" PRIu64
            ",\"drop_tx\":%" PRIu64 ",\"drop_trunc\":%" PRIu64 ",\"drop_runt\":%" PRIu64
            ",\"drop_local\":%" PRIu64 ",\"drop_nomem\":%" PRIu64 ",\"rx_errors\":%" PRIu64
            ",\"flushed\":%" PRIu64 ",\"cpu_s\":%.3f}\n",
            (double)b->delay_ns / 1e6, rx, tx, dq, dqd, dtx, b->drop_trunc, b->drop_runt,
            b->drop_local, b->drop_nomem, b->rx_errors, flushed, cpu);
}

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-')
        return -EINVAL;
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    static struct bridge br;
    struct bridge *b = &br;
    b->max_bytes = 64ull << 20;
    b->max_frames = 65536;
    double delay_ms = 0;
    const char *ifaces[BR_MAX_PORTS];
    int n = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--delay-ms") && i + 1 < argc) {
            char *end;
            delay_ms = strtod(argv[++i], &end);
            if (*end || end == argv[i] || !(delay_ms >= 0 && delay_ms <= 60000)) {
                fprintf(stderr, "delay_bridge: --delay-ms wants 0..60000, not %s\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--max-bytes") && i + 1 < argc) {
            if (parse_u64(argv[++i], &b->max_bytes) < 0) {
                fprintf(stderr, "delay_bridge: bad --max-bytes %s\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--max-frames") && i + 1 < argc) {
            if (parse_u64(argv[++i], &b->max_frames) < 0) {
                fprintf(stderr, "delay_bridge: bad --max-frames %s\n", argv[i]);
                return 2;
            }
        } else if (a[0] == '-') {
            usage(stderr);
            return 2;
        } else if (n == BR_MAX_PORTS) {
            fprintf(stderr, "delay_bridge: at most %d interfaces\n", BR_MAX_PORTS);
            return 2;
        } else {
            ifaces[n++] = a;
        }
    }
    if (n < 2) {
        usage(stderr);
        return 2;
    }
    b->delay_ns = (uint64_t)(delay_ms * 1e6 + 0.5);
    for (int i = 0; i < BR_MACS; i++)
        b->macs[i].port = -1;
    b->rxbuf = malloc((size_t)BR_BATCH * BR_FRAME_MAX);
    if (!b->rxbuf) {
        fprintf(stderr, "delay_bridge: out of memory\n");
        return 1;
    }
    for (int k = 0; k < BR_BATCH; k++) {
        b->rx_iov[k] = (struct iovec){ .iov_base = b->rxbuf + (size_t)k * BR_FRAME_MAX,
                                       .iov_len = BR_FRAME_MAX };
        b->rx_msgs[k].msg_hdr = (struct msghdr){ .msg_name = &b->rx_addr[k],
                                                 .msg_namelen = sizeof b->rx_addr[k],
                                                 .msg_iov = &b->rx_iov[k], .msg_iovlen = 1 };
    }

    /* The signals stay blocked except inside ppoll, so that one arriving
     * between the flag check and the wait still ends the wait. */
    sigset_t block, waitmask;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &waitmask);
    sigdelset(&waitmask, SIGTERM);
    sigdelset(&waitmask, SIGINT);
    struct sigaction sa = { .sa_handler = on_signal };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    for (int i = 0; i < n; i++) {
        b->ports[i].fd = -1;
        if (port_open(&b->ports[i], ifaces[i]) < 0) {
            for (int j = 0; j < i; j++)
                close(b->ports[j].fd);
            free(b->rxbuf);
            return 1;
        }
        b->nports++;
    }
    fprintf(stderr, "delay_bridge: forwarding between %d ports, one-way delay %.3f ms\n",
            b->nports, delay_ms);

    struct pollfd pfd[BR_MAX_PORTS];
    while (!stop_signal) {
        uint64_t now = now_ns();
        uint64_t next = UINT64_MAX;
        for (int i = 0; i < b->nports; i++) {
            struct port *p = &b->ports[i];
            pfd[i] = (struct pollfd){ .fd = p->fd, .events = POLLIN };
            if (p->blocked)
                pfd[i].events |= POLLOUT;
            else if (p->head && p->head->due_ns < next)
                next = p->head->due_ns;
        }
        struct timespec ts, *tsp = NULL;
        if (next != UINT64_MAX) {
            uint64_t wait = next > now ? next - now : 0;
            ts.tv_sec = (time_t)(wait / 1000000000ull);
            ts.tv_nsec = (long)(wait % 1000000000ull);
            tsp = &ts;
        }
        int r = ppoll(pfd, (nfds_t)b->nports, tsp, &waitmask);
        if (r < 0 && errno != EINTR) {
            fprintf(stderr, "delay_bridge: ppoll: %s\n", strerror(errno));
            break;
        }
        for (int i = 0; r > 0 && i < b->nports; i++) {
            if (pfd[i].revents & (POLLIN | POLLERR))
                port_receive(b, i);
            if (pfd[i].revents & POLLOUT)
                b->ports[i].blocked = false;
        }
        now = now_ns();
        for (int i = 0; i < b->nports; i++)
            if (!b->ports[i].blocked)
                port_send(b, &b->ports[i], now);
    }

    print_stats(b);
    for (int i = 0; i < b->nports; i++) {
        while (b->ports[i].head)
            dequeue_head(b, &b->ports[i]);
        close(b->ports[i].fd);
    }
    free(b->rxbuf);
    return 0;
}
