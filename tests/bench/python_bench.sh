#!/usr/bin/env bash
# tests/bench/python_bench.sh: the Python binding (python/, docs/python.md)
# beside the C trainer on one loopback swarm. A bootstrap node and three
# peers holding fmnist-mlp (stages 0-1, 2-3, 4-5); then
#   - `starling train --json` on SAMPLES training samples (all six stages
#     remote, micro-batches pipelined: the trainer's --inflight default);
#   - python/examples/fmnist_remote.py --json on the same samples (stages
#     1-4 remote through RemoteStages, one call at a time; stage 0's and 5's
#     work done locally by torch);
#   - the binding's own cost: a ctypes call of starling_api_version (a
#     no-op: the Python -> C -> Python crossing) and the round trip of a
#     1-row inference forward through one remote stage (median).
# Prints ONE JSON line: {"c_samples_per_s", "py_samples_per_s", "ratio"
# (py / c), "binding_overhead_us", "rpc_round_trip_us"}.
#
# Usage: tests/bench/python_bench.sh [BUILD_DIR]   (default build; env
#        SAMPLES=6000, BATCH=64 rows per step on both sides)
set -u -o pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:-$root/build}" && pwd) || exit 1
S=$build/tools/starling
LIB=$build/capi/libstarling.so
PY=/usr/bin/python3
samples=${SAMPLES:-6000}
batch=${BATCH:-64}
[ -x "$S" ] && [ -f "$LIB" ] || { echo "python_bench: build first ($S, $LIB)" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/starling-pybench-XXXXXX") || exit 1
pids=""
cleanup() {
    for p in $pids; do kill -TERM "$p" 2>/dev/null; done
    for p in $pids; do
        for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null
    done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
wait_for() { # FILE REGEX SECONDS
    for _ in $(seq 1 $(($3 * 10))); do grep -Eq "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
    echo "python_bench: timed out waiting for '$2' in $1" >&2; tail -5 "$1" >&2; return 1
}
export OPENBLAS_NUM_THREADS=1
"$S" bootstrap --listen 127.0.0.1:0 >"$work/bs.out" 2>"$work/bs.err" & pids="$pids $!"
wait_for "$work/bs.out" '/[0-9a-f]{40}$' 30 || exit 1
BS=$(head -1 "$work/bs.out")
for span in 0-1 2-3 4-5; do
    "$S" peer --initial-peers "$BS" --blocks "$span" --blas-threads 1 >"$work/peer-$span.out" \
        2>"$work/peer-$span.err" & pids="$pids $!"
done
for span in 0-1 2-3 4-5; do wait_for "$work/peer-$span.err" 'online: announcing' 60 || exit 1; done
# Every stage visible before either trainer starts.
for _ in $(seq 1 100); do "$S" monitor --initial-peers "$BS" --timeout 5 >/dev/null 2>&1 && break; sleep 0.3; done

"$S" train --initial-peers "$BS" --train-samples "$samples" --test-samples 1000 --batch "$batch" --json \
    --metrics-log "" --plot "" >"$work/c.json" 2>"$work/c.err" ||
    { echo "python_bench: starling train failed" >&2; tail -5 "$work/c.err" >&2; exit 1; }
c_sps=$(tail -1 "$work/c.json" | sed -n 's/.*"samples_per_s":\([0-9.]*\).*/\1/p')

export STARLING_LIBRARY=$LIB STARLING=$S PYTHONPATH=$root/python PYTHONDONTWRITEBYTECODE=1
"$PY" "$root/python/examples/fmnist_remote.py" --initial-peers "$BS" --samples "$samples" --test-samples 1000 \
    --batch "$batch" --json >"$work/py.json" 2>"$work/py.err" ||
    { echo "python_bench: fmnist_remote.py failed" >&2; tail -5 "$work/py.err" >&2; exit 1; }
py_sps=$(tail -1 "$work/py.json" | sed -n 's/.*"samples_per_s": *\([0-9.]*\).*/\1/p')

"$PY" - "$BS" "$c_sps" "$py_sps" <<'PYEOF'
import json, statistics, sys, time
import torch
import starling
from starling import _lib
bs, c_sps, py_sps = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
torch.set_num_threads(1)
f = _lib.lib.starling_api_version
n = 200000
for _ in range(1000):
    f()
t0 = time.perf_counter()
for _ in range(n):
    f()
noop_us = (time.perf_counter() - t0) / n * 1e6
with starling.Swarm(bs) as s:
    rs = starling.RemoteStages(s, "fmnist-mlp", 2).eval()
    x = torch.randn(1, 512)
    for _ in range(50):
        rs(x)
    times = []
    for _ in range(500):
        t0 = time.perf_counter()
        rs(x)
        times.append((time.perf_counter() - t0) * 1e6)
print(json.dumps({"c_samples_per_s": c_sps, "py_samples_per_s": py_sps, "ratio": round(py_sps / c_sps, 3),
                  "binding_overhead_us": round(noop_us, 3), "rpc_round_trip_us": round(statistics.median(times), 1)}))
PYEOF
