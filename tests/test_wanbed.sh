#!/bin/sh
# The emulated wide-area test bed (tests/wan/wanbed.sh): two hosts on the
# `wan` profile, then on `slow`; netprobe measures the round trip (median of
# 20 UDP echoes) and the bandwidth (TCP, both directions at once, 3 s each,
# at the receiver) between them, which must be within 20 % of the profile's
# (50 ms and 100 Mbit/s; 100 ms and 20 Mbit/s); the round trip over IPv6 too
# (5 echoes). TCP payload gets about 95 %
# of the shaped rate (the rest is headers), well inside the margin. A profile
# whose figures miss is measured again, at most three times in all: the
# figures only miss when the machine is too busy to run the bridge on time,
# and each try is printed. After each wanbed_down no namespace with the
# test's tag may remain, the bridge must be gone, and it must have printed
# its counters (it exited on SIGTERM) without dropping a frame for want of
# queue room or for being too large. Needs root, ip(8) and tc(8) with tbf:
# exits 77 (skipped) otherwise.
. "$(dirname "$0")/wan/wanbed.sh"
NP=${STARLING_NETPROBE:?STARLING_NETPROBE must point at tests/wan/netprobe}
T=$(mktemp -d "${TMPDIR:-/tmp}/starling-wanbed-XXXXXX") || exit 1
trap 'wanbed_down; [ -n "${KEEP_T:-}" ] || rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
show() { for f in "$@"; do echo "--- $f" >&2; tail -20 "$f" >&2; done; }
json_field() { tail -1 "$1" | sed -n "s/.*\"$2\":\"\{0,1\}\([^,\"}]*\).*/\1/p"; }
# within GOT WANT: |GOT - WANT| <= 20 % of WANT.
within() { awk "BEGIN { g = \"$1\" + 0; exit !(\"$1\" != \"\" && g >= 0.8 * $2 && g <= 1.2 * $2) }"; }

# check_profile PROFILE RTT_MS MBIT
check_profile() {
    start=$(date +%s)
    wanbed_up "$1" 2
    for h in 1 2; do
        wanbed_exec "$h" "$NP" serve 5201 60 >"$T/serve$h.out" 2>"$T/serve$h.err" &
    done
    for h in 1 2; do
        n=0
        until grep -q '"serve"' "$T/serve$h.out" 2>/dev/null; do
            n=$((n + 1))
            [ "$n" -le 50 ] || { show "$T/serve$h.err"; echo "netprobe serve did not start on host $h" >&2; exit 1; }
            sleep 0.1
        done
    done
    try=1
    while :; do
        wanbed_exec 1 "$NP" rtt "$(wanbed_addr 2)" 5201 20 >"$T/rtt.out" 2>"$T/rtt.err"
        wanbed_exec 1 "$NP" bw "$(wanbed_addr 2)" 5201 3 >"$T/bw12.out" 2>"$T/bw12.err" &
        p12=$!
        wanbed_exec 2 "$NP" bw "$(wanbed_addr 1)" 5201 3 >"$T/bw21.out" 2>"$T/bw21.err" &
        p21=$!
        wait "$p12"; wait "$p21"
        rtt=$(json_field "$T/rtt.out" median_ms)
        bw12=$(json_field "$T/bw12.out" mbit_s)
        bw21=$(json_field "$T/bw21.out" mbit_s)
        echo "$1 try $try: rtt ${rtt:-?} ms (want $2), Mbit/s host 1->2 ${bw12:-?}, 2->1 ${bw21:-?} (want $3)"
        within "$rtt" "$2" && within "$bw12" "$3" && within "$bw21" "$3" && break
        if [ "$try" -ge 3 ]; then
            within "$rtt" "$2" || { fail "$1: rtt ${rtt:-?} ms, want $2 +- 20 %"; show "$T/rtt.out" "$T/rtt.err"; }
            within "$bw12" "$3" || { fail "$1: host 1->2 ${bw12:-?} Mbit/s, want $3 +- 20 %"; show "$T/bw12.out" "$T/bw12.err"; }
            within "$bw21" "$3" || { fail "$1: host 2->1 ${bw21:-?} Mbit/s, want $3 +- 20 %"; show "$T/bw21.out" "$T/bw21.err"; }
            break
        fi
        try=$((try + 1))
    done
    # IPv6 crosses the bridge too (neighbour discovery is multicast: flooded).
    wanbed_exec 1 "$NP" rtt "$(wanbed_addr6 2)" 5201 5 >"$T/rtt6.out" 2>"$T/rtt6.err"
    rtt6=$(json_field "$T/rtt6.out" median_ms)
    echo "$1: IPv6 rtt ${rtt6:-?} ms"
    within "$rtt6" "$2" || { fail "$1: IPv6 rtt ${rtt6:-?} ms, want $2 +- 20 %"; show "$T/rtt6.out" "$T/rtt6.err"; }
    bridge=$WANBED_BRIDGE_PID
    tag=$WANBED_TAG
    wanbed_down
    left=$(ip netns list | awk -v t="$tag" 'index($1, t) == 1 { print $1 }')
    [ -z "$left" ] || fail "$1: namespaces left after wanbed_down: $left"
    [ -n "$bridge" ] || fail "$1: no delay bridge was started"
    if [ -n "$bridge" ] && kill -0 "$bridge" 2>/dev/null; then fail "$1: bridge $bridge still runs"; fi
    case $WANBED_BRIDGE_STATS in
        *'"drop_queue":0,'*'"drop_trunc":0,'*) ;;
        '') fail "$1: the bridge printed no counters on SIGTERM" ;;
        *) fail "$1: the bridge dropped frames: $WANBED_BRIDGE_STATS" ;;
    esac
    echo "$1: $(( $(date +%s) - start )) s"
}

check_profile wan 50 100
check_profile slow 100 20
if [ "$fails" -ne 0 ]; then
    echo "$fails check(s) failed" >&2
    exit 1
fi
echo "ok"
