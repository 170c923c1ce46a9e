#!/usr/bin/env bash
# tests/bench/avg_round_bench.sh: group averaging and newcomer state on loopback.
#
# For each group size G: a bootstrap node and G peers hosting stages 1-2
# of fmnist-mlp (two ResFFN 512/2048 blocks of 2,100,736 parameters: 4.2M
# parameters, 50.4 MB with the AdamW moments) average every PERIOD seconds
# (the two blocks' rounds run at once); after ROUNDS rounds the script
# prints one JSON line with the median and max round time over all members
# (begin to apply, the slower of the two blocks, from the peers' own logs)
# and the MB each member received per round. Then a newcomer joins the last
# swarm for the same stages: the time from its start to "online" and its
# state download (MB, seconds).
#
# Usage: tests/bench/avg_round_bench.sh [BUILD_DIR]  (env: SIZES="2 3 4 6 8",
#        PERIOD=4, ROUNDS=3)
set -u -o pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
S=$build/tools/starling
sizes=${SIZES:-2 3 4 6 8}
period=${PERIOD:-4}
rounds=${ROUNDS:-3}
work=$(mktemp -d "${TMPDIR:-/tmp}/starling-avgbench-XXXXXX")
pids=""
stop_all() { for p in $pids; do kill $p 2>/dev/null; done; wait 2>/dev/null; pids=""; }
trap 'stop_all; rm -rf "$work"' EXIT
export OPENBLAS_NUM_THREADS=1
last=0
for g in $sizes; do
    stop_all
    rm -f "$work"/*
    "$S" bootstrap --listen 127.0.0.1:0 >"$work/bs.out" 2>/dev/null & pids="$pids $!"
    for _ in $(seq 1 50); do [ -s "$work/bs.out" ] && break; sleep 0.1; done
    BS=$(head -1 "$work/bs.out")
    for i in $(seq 1 "$g"); do
        "$S" peer --initial-peers "$BS" --blocks 1-2 --blas-threads 1 --average-every "$period" \
            --announce-every 1 --announce-ttl 5 >/dev/null 2>"$work/p$i.err" &
        pids="$pids $!"
    done
    # Bounded: each member needs ROUNDS completed rounds in a group of G.
    for _ in $(seq 1 $(( (rounds + 3) * period * 10 + 300 ))); do
        done_n=0
        for i in $(seq 1 "$g"); do
            c=$(grep -c "averaged in a group of $g " "$work/p$i.err" 2>/dev/null)
            [ "${c:-0}" -ge $((2 * rounds)) ] && done_n=$((done_n + 1))
        done
        [ "$done_n" -eq "$g" ] && break
        sleep 0.1
    done
    python3 - "$g" "$period" "$work"/p*.err <<'EOF'
import json, re, statistics, sys
g = int(sys.argv[1])
per = {}  # (peer, round) -> [MB in, slowest block s, blocks]
for f in sys.argv[3:]:
    for l in open(f):
        m = re.search(r"averaged in a group of (\d+) \(round (\d+), .*?([0-9.]+) MB in ([0-9.]+) s;", l)
        if m and int(m.group(1)) == g:
            r = per.setdefault((f, m.group(2)), [0.0, 0.0, 0])
            r[0] += float(m.group(3))
            r[1] = max(r[1], float(m.group(4)))
            r[2] += 1
rows = [r for r in per.values() if r[2] == 2]
t = sorted(r[1] for r in rows)
print(json.dumps({"bench": "avg_round", "group": g, "params": 4201472, "state_mb": 50.4,
                  "period_s": float(sys.argv[2]), "member_rounds": len(rows),
                  "round_s_median": statistics.median(t) if t else None,
                  "round_s_max": t[-1] if t else None,
                  "mb_in_per_member": statistics.median(r[0] for r in rows) if rows else None}))
EOF
    last=$g
done
# A newcomer to the last swarm: start to online, and the download itself.
t0=$(date +%s.%N)
"$S" peer --initial-peers "$BS" --blocks 1-2 --blas-threads 1 >/dev/null 2>"$work/new.err" & pids="$pids $!"
for _ in $(seq 1 600); do grep -q 'online: announcing' "$work/new.err" && break; sleep 0.05; done
t1=$(date +%s.%N)
mb=$(sed -n 's/.*downloaded the current state.*, \([0-9.]*\) MB in \([0-9.]*\) s.*/\1/p' "$work/new.err" | awk '{ s += $1 } END { print s }')
secs=$(sed -n 's/.*downloaded the current state.*, \([0-9.]*\) MB in \([0-9.]*\) s.*/\2/p' "$work/new.err" | awk '{ s += $1 } END { print s }')
echo "{\"bench\":\"newcomer\",\"params\":4201472,\"holders\":$last,\"download_mb\":${mb:-null},\"download_s\":${secs:-null},\"start_to_online_s\":$(awk "BEGIN { printf \"%.2f\", $t1 - $t0 }")}"
