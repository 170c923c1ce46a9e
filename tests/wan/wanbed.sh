# tests/wan/wanbed.sh: an emulated wide-area network of network namespaces,
# for tests that want Starling's processes to talk across real latency and
# limited bandwidth. Source it from a POSIX sh script; it needs root, ip(8),
# and for the shaped profiles tc(8) with the tbf qdisc.
#
#   . "$(dirname "$0")/wan/wanbed.sh"
#   wanbed_up wan 3                     # hosts 1..3 on a 100 Mbit/s, 50 ms RTT WAN
#   wanbed_exec 2 "$S" peer --listen "$(wanbed_addr 2):4001" ... &
#   wanbed_exec 1 "$S" train ...
#   wanbed_down                         # also done on EXIT, INT and TERM
#
# Layout: namespace "<tag>r" is the router; namespaces "<tag>h1" .. "<tag>hN"
# are the hosts. Host i's eth0 (192.0.2.i/24, TEST-NET-1, and 2001:db8::i/64,
# both documentation ranges that are never routed) is a veth pair with port
# "p<i>" in the router. <tag> is $WANBED_TAG (default
# "wb<pid>"; at most 10 characters, as the veth's name in the root namespace
# during set-up is "<tag>p<i>").
#
# Profiles (rate per host link, each direction; round trip between any two
# hosts):
#   lan    no shaping, no delay: a kernel bridge in the router
#   wan    100 Mbit/s, 50 ms RTT
#   slow   20 Mbit/s, 100 ms RTT
#   custom:MBIT:RTT_MS   any other pair (MBIT 0: no shaping)
#
# How: this kernel has no netem, so the delay comes from tests/wan/delay_bridge
# (path in $WANBED_BRIDGE, default $STARLING_DELAY_BRIDGE, which meson sets
# for the tests): a userspace learning bridge in the router holding every frame
# RTT/2 before forwarding it. A frame between two hosts crosses it once, so a
# round trip costs RTT. The bandwidth comes from tc's token bucket filter
# (tbf), on each host's eth0 (what the host sends) and on each router port
# (what the host receives), so both directions of every link are limited:
#   rate    the profile's rate (of Ethernet frames: TCP payload gets ~95%)
#   burst   80000 bytes: above one 64 KiB GSO frame, so that tbf never has to
#           cut the host's TSO frames into MTU-sized ones (costly in CPU),
#           and small against a second's worth of data (6 ms at 100 Mbit/s)
#   limit   the bandwidth-delay product (rate * RTT; 625000 bytes for wan,
#           250000 for slow), at least 2 * burst: one round trip of queue
#           lets a loss-based TCP (reno, cubic) keep the link full after
#           halving its window, and bounds the queueing delay under load to
#           one more RTT.
# The hosts' TCP buffers are set (per namespace) so that one connection can
# keep a whole bandwidth-delay product in flight: net.ipv4.tcp_rmem and
# tcp_wmem "4096 131072 16777216" (16 MiB maximum; the 625 KB of wan need
# about twice that in the receiver's window). The hosts keep the kernel's
# congestion control (net.ipv4.tcp_congestion_control, inherited from the
# root namespace).
#
# Waits are bounded: wanbed_up returns once host 1 reaches every other host
# (a TCP connect to a closed port, answered by a reset, with
# $WANBED_NETPROBE, default $STARLING_NETPROBE; ping(8) without it; only the
# links' state without either), or exits 1 after about 10 s.
#
# Skips: wanbed_up exits 77 when not root, without ip(8), when namespaces
# cannot be created, or (shaped profiles) without tc(8) or tbf.
#
# Clean-up: sourcing this sets an EXIT trap that calls wanbed_down (and makes
# HUP, INT and TERM exit 1, which runs it; SIGKILL leaves the namespaces
# behind: `ip netns list` shows them, `ip netns pids NS` what runs there). A script that sets its own EXIT trap
# must call wanbed_down from it. wanbed_down stops the bridge (SIGTERM; its
# counters go to stderr), ends every process still running in the
# namespaces, and deletes them; it can be called any number of times.
#
# Functions:
#   wanbed_up PROFILE NHOSTS   builds the network (NHOSTS 1..60)
#   wanbed_exec HOST CMD...    runs CMD in host HOST's namespace (HOST 1..N,
#                              or "r" for the router)
#   wanbed_ns HOST             prints the namespace's name
#   wanbed_addr HOST           prints host HOST's address (192.0.2.HOST)
#   wanbed_addr6 HOST          prints its IPv6 address (2001:db8::HOST)
#   wanbed_down                tears it all down
# Variables set by wanbed_up: WANBED_N (hosts), WANBED_RATE_MBIT,
# WANBED_RTT_MS, WANBED_BRIDGE_PID (empty for lan), WANBED_DIR (a temporary
# directory; the bridge's log is $WANBED_DIR/bridge.log). wanbed_down sets
# WANBED_BRIDGE_STATS to the bridge's line of total counters (empty if it
# printed none: it did not exit cleanly).

WANBED_TAG=${WANBED_TAG:-wb$$}
WANBED_BRIDGE=${WANBED_BRIDGE:-${STARLING_DELAY_BRIDGE:-}}
WANBED_NETPROBE=${WANBED_NETPROBE:-${STARLING_NETPROBE:-}}
WANBED_N=0
WANBED_NSLIST=""
WANBED_BRIDGE_PID=""
WANBED_BRIDGE_STATS=""
wanbed__said=""
WANBED_DIR=""
WANBED_RATE_MBIT=0
WANBED_RTT_MS=0
WANBED_BURST=${WANBED_BURST:-80000}
WANBED_TCP_MEM="4096 131072 16777216"

wanbed_ns() {
    if [ "$1" = r ]; then echo "${WANBED_TAG}r"; else echo "${WANBED_TAG}h$1"; fi
}

wanbed_addr() {
    echo "192.0.2.$1"
}

wanbed_addr6() {
    echo "2001:db8::$1"
}

wanbed_exec() {
    wanbed__eh=$1; shift
    ip netns exec "$(wanbed_ns "$wanbed__eh")" "$@"
}

wanbed__skip() {
    echo "skipped: $*" >&2
    exit 77
}

wanbed__die() {
    echo "wanbed: $*" >&2
    exit 1
}

# wanbed__tbf NS DEV: limits DEV's egress in namespace NS to the profile's rate.
wanbed__tbf() {
    wanbed__limit=$(awk "BEGIN { l = int($WANBED_RATE_MBIT * 1e6 / 8 * $WANBED_RTT_MS / 1000);
                               m = 2 * $WANBED_BURST; print (l > m ? l : m) }")
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "${WANBED_RATE_MBIT}mbit" \
        burst "$WANBED_BURST" limit "$wanbed__limit"
}

# wanbed__reachable J: true once host 1 reaches host J (bounded by the probe).
wanbed__reachable() {
    if [ -n "$WANBED_NETPROBE" ]; then
        wanbed_exec 1 "$WANBED_NETPROBE" reach "$(wanbed_addr "$1")" 9 1000 >/dev/null 2>&1
    elif command -v ping >/dev/null 2>&1; then
        wanbed_exec 1 ping -c1 -W1 "$(wanbed_addr "$1")" >/dev/null 2>&1
    else
        ip -n "$(wanbed_ns 1)" link show dev eth0 | grep -q LOWER_UP &&
            ip -n "$(wanbed_ns "$1")" link show dev eth0 | grep -q LOWER_UP
    fi
}

wanbed_up() {
    [ $# -eq 2 ] || wanbed__die "usage: wanbed_up PROFILE NHOSTS"
    [ "$WANBED_N" = 0 ] || wanbed__die "already up: wanbed_down first"
    case $2 in ''|*[!0-9]*) wanbed__die "NHOSTS must be 1..60, not $2" ;; esac
    [ "$2" -ge 1 ] && [ "$2" -le 60 ] || wanbed__die "NHOSTS must be 1..60, not $2"
    case $1 in
        lan) WANBED_RATE_MBIT=0; WANBED_RTT_MS=0 ;;
        wan) WANBED_RATE_MBIT=100; WANBED_RTT_MS=50 ;;
        slow) WANBED_RATE_MBIT=20; WANBED_RTT_MS=100 ;;
        custom:*:*:*) wanbed__die "bad profile $1 (custom:MBIT:RTT_MS)" ;;
        custom:*:*)
            WANBED_RATE_MBIT=$(echo "$1" | cut -d: -f2)
            WANBED_RTT_MS=$(echo "$1" | cut -d: -f3)
            for wanbed__v in "$WANBED_RATE_MBIT" "$WANBED_RTT_MS"; do
                case $wanbed__v in
                    ''|.|*[!0-9.]*|*.*.*) wanbed__die "bad profile $1 (custom:MBIT:RTT_MS, numbers)" ;;
                esac
            done ;;
        *) wanbed__die "unknown profile $1 (lan, wan, slow, custom:MBIT:RTT_MS)" ;;
    esac
    case $WANBED_TAG in
        ''|*[!A-Za-z0-9_]*|???????????*) wanbed__die "WANBED_TAG must be 1..10 letters, digits or _, not '$WANBED_TAG'" ;;
    esac
    [ "$(id -u)" -eq 0 ] || wanbed__skip "needs root for network namespaces"
    command -v ip >/dev/null 2>&1 || wanbed__skip "no ip(8)"
    wanbed__shaped=$(awk "BEGIN { print ($WANBED_RATE_MBIT > 0) }")
    wanbed__delayed=$(awk "BEGIN { print ($WANBED_RTT_MS > 0) }")
    if [ "$wanbed__shaped" = 1 ]; then
        command -v tc >/dev/null 2>&1 || wanbed__skip "no tc(8) for the $1 profile"
    fi
    if [ "$wanbed__delayed" = 1 ]; then
        [ -n "$WANBED_BRIDGE" ] && [ -x "$WANBED_BRIDGE" ] ||
            wanbed__die "no delay bridge: set STARLING_DELAY_BRIDGE (or WANBED_BRIDGE) to build-dir/tests/wan/delay_bridge"
    fi
    WANBED_BRIDGE_STATS=""
    WANBED_DIR=$(mktemp -d "${TMPDIR:-/tmp}/wanbed-XXXXXX") || wanbed__die "mktemp failed"
    wanbed__r=$(wanbed_ns r)
    [ ! -e "/run/netns/$wanbed__r" ] || wanbed__die "namespace $wanbed__r exists (a leftover? see ip netns pids, ip netns del)"
    ip netns add "$wanbed__r" 2>/dev/null || wanbed__skip "cannot create network namespaces"
    WANBED_NSLIST=$wanbed__r
    WANBED_N=$2
    ip -n "$wanbed__r" link set lo up
    # The router only carries frames: no addresses, no IPv6 chatter of its own.
    ip netns exec "$wanbed__r" sh -c 'echo 1 >/proc/sys/net/ipv6/conf/all/disable_ipv6' 2>/dev/null
    ip netns exec "$wanbed__r" sh -c 'echo 1 >/proc/sys/net/ipv6/conf/default/disable_ipv6' 2>/dev/null
    wanbed__i=1
    while [ "$wanbed__i" -le "$WANBED_N" ]; do
        wanbed__h=$(wanbed_ns "$wanbed__i")
        ip netns add "$wanbed__h" || wanbed__die "cannot create namespace $wanbed__h"
        WANBED_NSLIST="$WANBED_NSLIST $wanbed__h"
        ip -n "$wanbed__h" link set lo up
        ip link add "${WANBED_TAG}p$wanbed__i" type veth peer name eth0 netns "$wanbed__h" ||
            wanbed__die "cannot create veth ${WANBED_TAG}p$wanbed__i"
        ip link set "${WANBED_TAG}p$wanbed__i" netns "$wanbed__r" || wanbed__die "cannot move veth to $wanbed__r"
        ip -n "$wanbed__r" link set "${WANBED_TAG}p$wanbed__i" name "p$wanbed__i" || wanbed__die "cannot rename port"
        ip -n "$wanbed__r" link set "p$wanbed__i" up
        ip -n "$wanbed__h" addr add "$(wanbed_addr "$wanbed__i")/24" dev eth0
        ip -n "$wanbed__h" addr add "$(wanbed_addr6 "$wanbed__i")/64" dev eth0 nodad 2>/dev/null
        ip -n "$wanbed__h" link set eth0 up
        ip netns exec "$wanbed__h" sh -c "echo '$WANBED_TCP_MEM' >/proc/sys/net/ipv4/tcp_rmem &&
            echo '$WANBED_TCP_MEM' >/proc/sys/net/ipv4/tcp_wmem" 2>/dev/null ||
            echo "wanbed: could not set tcp_rmem/tcp_wmem in $wanbed__h: kept the defaults" >&2
        wanbed__i=$((wanbed__i + 1))
    done
    wanbed__ports=$(seq -f 'p%g' 1 "$WANBED_N")
    if [ "$wanbed__delayed" = 1 ]; then
        : >"$WANBED_DIR/bridge.log"
        # shellcheck disable=SC2086
        ip netns exec "$wanbed__r" "$WANBED_BRIDGE" --delay-ms "$(awk "BEGIN { print $WANBED_RTT_MS / 2 }")" \
            $wanbed__ports 2>"$WANBED_DIR/bridge.log" &
        WANBED_BRIDGE_PID=$!
        wanbed__i=0
        until grep -q 'delay_bridge: forwarding' "$WANBED_DIR/bridge.log"; do
            kill -0 "$WANBED_BRIDGE_PID" 2>/dev/null || { cat "$WANBED_DIR/bridge.log" >&2; wanbed__die "the delay bridge did not start"; }
            wanbed__i=$((wanbed__i + 1))
            [ "$wanbed__i" -le 100 ] || wanbed__die "the delay bridge did not start within 10 s"
            sleep 0.1
        done
    else
        ip -n "$wanbed__r" link add br0 type bridge || wanbed__die "cannot create a bridge in $wanbed__r"
        for wanbed__p in $wanbed__ports; do
            ip -n "$wanbed__r" link set "$wanbed__p" master br0 || wanbed__die "cannot add $wanbed__p to br0"
        done
        ip -n "$wanbed__r" link set br0 up
    fi
    if [ "$wanbed__shaped" = 1 ]; then
        wanbed__i=1
        while [ "$wanbed__i" -le "$WANBED_N" ]; do
            wanbed__tbf "$(wanbed_ns "$wanbed__i")" eth0 && wanbed__tbf "$wanbed__r" "p$wanbed__i" ||
                wanbed__skip "tc cannot add a tbf qdisc"
            wanbed__i=$((wanbed__i + 1))
        done
    fi
    wanbed__i=2
    while [ "$wanbed__i" -le "$WANBED_N" ]; do
        wanbed__try=0
        until wanbed__reachable "$wanbed__i"; do
            wanbed__try=$((wanbed__try + 1))
            [ "$wanbed__try" -lt 10 ] || wanbed__die "host 1 does not reach host $wanbed__i"
            sleep 0.2
        done
        wanbed__i=$((wanbed__i + 1))
    done
    return 0
}

# wanbed__stop TENTHS PID...: SIGTERM to each, at most TENTHS/10 s of waiting
# for all of them together, then SIGKILL to those left; reaps our children.
wanbed__stop() {
    wanbed__t=$1; shift
    [ $# -gt 0 ] || return 0
    kill -TERM "$@" 2>/dev/null
    while [ "$wanbed__t" -gt 0 ]; do
        wanbed__alive=0
        for wanbed__q in "$@"; do
            # A child of this shell stays a zombie (and "alive") until reaped.
            kill -0 "$wanbed__q" 2>/dev/null &&
                [ "$(sed -n 's/.*) \([A-Z]\).*/\1/p' "/proc/$wanbed__q/stat" 2>/dev/null)" != Z ] &&
                wanbed__alive=1
        done
        [ "$wanbed__alive" = 1 ] || break
        sleep 0.1
        wanbed__t=$((wanbed__t - 1))
    done
    kill -KILL "$@" 2>/dev/null
    for wanbed__q in "$@"; do wait "$wanbed__q" 2>/dev/null; done
    return 0
}

wanbed_down() {
    if [ -n "$WANBED_BRIDGE_PID" ]; then
        wanbed__stop 50 "$WANBED_BRIDGE_PID"
        WANBED_BRIDGE_STATS=$(grep '"delay_bridge":"total"' "$WANBED_DIR/bridge.log" 2>/dev/null)
        WANBED_BRIDGE_PID=""
        wanbed__said=$WANBED_BRIDGE_STATS
    fi
    # Whatever still runs in the namespaces would keep them alive (unnamed)
    # after `ip netns del`.
    wanbed__pids=""
    for wanbed__ns in $WANBED_NSLIST; do
        wanbed__pids="$wanbed__pids $(ip netns pids "$wanbed__ns" 2>/dev/null | tr '\n' ' ')"
    done
    # shellcheck disable=SC2086
    wanbed__stop 30 $wanbed__pids
    for wanbed__ns in $WANBED_NSLIST; do
        ip netns del "$wanbed__ns" 2>/dev/null
    done
    wanbed__i=1
    while [ "$wanbed__i" -le "$WANBED_N" ]; do
        ip link del "${WANBED_TAG}p$wanbed__i" 2>/dev/null
        wanbed__i=$((wanbed__i + 1))
    done
    WANBED_NSLIST=""
    WANBED_N=0
    [ -n "$WANBED_DIR" ] && [ -z "${KEEP_T:-}" ] && rm -rf "$WANBED_DIR"
    WANBED_DIR=""
    # Said last: stderr may be a pipe whose reader is gone (SIGPIPE would end
    # the shell here, and nothing above may be left undone).
    if [ -n "$wanbed__said" ]; then
        wanbed__said=""
        echo "$WANBED_BRIDGE_STATS" >&2
    fi
    return 0
}

trap wanbed_down EXIT
trap 'exit 1' HUP INT TERM
