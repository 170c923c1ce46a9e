#!/usr/bin/env bash
# tests/bench/infer_bench.sh: inference latency through a swarm, idle and
# while a trainer keeps the same peers busy. One request carries one input
# (--batch 1), one at a time (--inflight 1) for latency; then 8 in flight
# for requests/s. Prints one JSON line per phase and a summary line with
# p99(under load) / p99(idle) (target <= 2).
#
# Usage: tests/bench/infer_bench.sh [BUILD_DIR]
#   env: N=1000 requests per phase, PRIORITY=low|idle (peers' --training-priority; default: the peers' default, low),
#        INLINE (peers' --infer-inline-rows; 0 sends every request to the lane),
#        TRAIN_PREFIX (e.g. "nice -n 19" for the trainer),
#        PEER_ARGS (more flags for both peers, e.g. "--target-batch 4096")
set -u -o pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
S=$build/tools/starling
n=${N:-1000}
work=$(mktemp -d "${TMPDIR:-/tmp}/starling-inferbench-XXXXXX")
pids=""
trap 'for p in $pids; do kill $p 2>/dev/null; done; wait 2>/dev/null; rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1
"$S" bootstrap --listen 127.0.0.1:0 >"$work/bs.out" 2>/dev/null & pids="$pids $!"
for _ in $(seq 1 50); do [ -s "$work/bs.out" ] && break; sleep 0.1; done
BS=$(head -1 "$work/bs.out")
for span in 0-2 3-5; do
    "$S" peer --initial-peers "$BS" --blocks $span --blas-threads 1 --training-priority ${PRIORITY:-low} ${INLINE:+--infer-inline-rows $INLINE} ${PEER_ARGS:-} >/dev/null 2>"$work/peer-$span.err" &
    pids="$pids $!"
done
for span in 0-2 3-5; do
    for _ in $(seq 1 100); do grep -q 'online: announcing' "$work/peer-$span.err" && break; sleep 0.1; done
done
q() { sed -n "s/.*\"$2\":\([0-9.]*\).*/\1/p" "$1"; }
run() { # NAME INFLIGHT
    "$S" infer --initial-peers "$BS" --data test --samples "$n" --batch 1 --inflight "$2" --json \
        2>/dev/null | tail -1 >"$work/$1.json"
    echo "{\"phase\":\"$1\",\"p50_ms\":$(q "$work/$1.json" p50_ms),\"p99_ms\":$(q "$work/$1.json" p99_ms),\"requests_per_s\":$(q "$work/$1.json" requests_per_s)}"
}
run idle 1
run idle_rps 8
${TRAIN_PREFIX:-} "$S" train --initial-peers "$BS" --epochs 100 --metrics-log "" --plot "" >/dev/null 2>&1 &
tr=$!; pids="$pids $tr"
sleep 3
run load 1
run load_rps 8
kill $tr 2>/dev/null
i99=$(q "$work/idle.json" p99_ms); l99=$(q "$work/load.json" p99_ms)
echo "{\"p99_idle_ms\":$i99,\"p99_load_ms\":$l99,\"p99_ratio\":$(awk "BEGIN{printf \"%.3f\", $l99/$i99}")}"
