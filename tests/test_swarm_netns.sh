#!/bin/sh
# A swarm across three "hosts": network namespaces joined by a bridge, with
# addresses from TEST-NET-1 (192.0.2.0/24, never routed). The bootstrap node
# and the trainer run on host 1, peers on hosts 2 and 3 (host 3 listens on
# 0.0.0.0 and announces its address). Needs root and iproute2: exits 77
# (skipped) otherwise.
. "$(dirname "$0")/swarm_lib.sh"
command -v ip >/dev/null 2>&1 || { echo "skipped: no ip(8)" >&2; exit 77; }
[ "$(id -u)" -eq 0 ] || { echo "skipped: needs root for network namespaces" >&2; exit 77; }
tag="st$$"
NS="${tag}h0 ${tag}h1 ${tag}h2 ${tag}h3"
netns_cleanup() {
    cleanup
    for n in $NS; do ip netns del "$n" 2>/dev/null; done
}
trap netns_cleanup EXIT
ip netns add "${tag}h0" 2>/dev/null || { echo "skipped: cannot create network namespaces" >&2; exit 77; }
ip -n "${tag}h0" link add br0 type bridge && ip -n "${tag}h0" link set br0 up || exit 1
for i in 1 2 3; do
    h="${tag}h$i"
    ip netns add "$h" || exit 1
    ip -n "$h" link set lo up
    ip link add "${tag}v$i" type veth peer name eth0 netns "$h" || exit 1
    ip link set "${tag}v$i" netns "${tag}h0"
    ip -n "${tag}h0" link set "${tag}v$i" master br0 up
    ip -n "$h" addr add "192.0.2.$i/24" dev eth0
    ip -n "$h" link set eth0 up
done
# The bridge needs a moment before it forwards: wait (bounded) until host 1
# reaches host 3, or without ping(8), until every bridge port forwards and
# every host's link is up. (The peers retry their join anyway.)
if command -v ping >/dev/null 2>&1; then
    for i in $(seq 1 50); do ip netns exec "${tag}h1" ping -c1 -W1 192.0.2.3 >/dev/null 2>&1 && break; sleep 0.2; done
else
    for i in $(seq 1 100); do
        up=1
        for j in 1 2 3; do
            ip -n "${tag}h0" -d link show dev "${tag}v$j" | grep -q 'bridge_slave state forwarding' || up=0
            ip -n "${tag}h$j" link show dev eth0 | grep -q 'LOWER_UP' || up=0
        done
        [ "$up" = 1 ] && break
        sleep 0.1
    done
fi

ip netns exec "${tag}h1" "$S" bootstrap --listen 192.0.2.1:4000 >"$T/bs.out" 2>"$T/bs.err" &
PIDS="$PIDS $!"
wait_for "$T/bs.out" '/[0-9a-f]{40}$' 60 || { show "$T/bs.err"; exit 1; }
BS=$(head -1 "$T/bs.out")
ip netns exec "${tag}h2" "$S" peer --initial-peers "$BS" --blocks 0-2 --listen 192.0.2.2:4001 \
    >"$T/a.out" 2>"$T/a.err" &
PIDS="$PIDS $!"
ip netns exec "${tag}h3" "$S" peer --initial-peers "$BS" --blocks 3-5 --listen 0.0.0.0:4001 \
    --announce 192.0.2.3 >"$T/b.out" 2>"$T/b.err" &
PIDS="$PIDS $!"
wait_for "$T/a.err" 'online: announcing' 120 || { fail "peer on host 2 did not join"; show "$T/a.err"; }
wait_for "$T/b.err" 'online: announcing' 120 || { fail "peer on host 3 did not join"; show "$T/b.err"; }
grep -q '192.0.2.3:4001/' "$T/b.out" || fail "host 3 does not announce its reachable address"

# A peer logs "online" when it starts its DHT puts: wait (bounded) until the
# monitor on host 1 finds every stage covered.
ok=0
end=$(( $(date +%s) + 120 ))
while [ "$(date +%s)" -lt "$end" ]; do
    ip netns exec "${tag}h1" "$S" monitor --initial-peers "$BS" >"$T/mon.txt" 2>&1 && { ok=1; break; }
    sleep 0.5
done
[ "$ok" = 1 ] || { fail "monitor on host 1 does not see every stage"; show "$T/mon.txt"; }
grep -q '192.0.2.3:4001' "$T/mon.txt" || fail "monitor lacks host 3's address"
ip netns exec "${tag}h1" timeout 300 "$S" train --initial-peers "$BS" --train-samples 2048 \
    --test-samples 1000 --json --metrics-log "" --plot "" >"$T/train.out" 2>"$T/train.err"
[ $? -eq 0 ] || { fail "training across hosts failed"; show "$T/train.err"; }
samples=$(json_field "$T/train.out" samples)
acc=$(json_field "$T/train.out" test_acc)
echo "samples=$samples test_acc=$acc"
[ "$samples" = 2048 ] || fail "processed $samples samples, want 2048"
awk "BEGIN { exit !($acc >= 0.4) }" || fail "test accuracy $acc below 0.4"
finish
