#!/usr/bin/env bash
# tests/bench/train_bench.sh: Starling swarm training side by side with the
# PyTorch baselines in ../shared/bench/torch (same model, Adam lr 1e-3, batch
# 128, same epochs). Prints one JSON line per system and a final line with
# the ratios. Both sides run in the same OpenBLAS environment: Starling
# re-executes itself without $OPENBLAS_CORETYPE (its best kernels), so the
# torch runs get OPENBLAS_CORETYPE unset too unless BLAS=Haswell is given.
#
# Usage: tests/bench/train_bench.sh [BUILD_DIR]   (env: EPOCHS=3, SKIP_TORCH=1,
#        BLAS=Haswell to force AVX2 kernels on both sides,
#        TRAIN_FLAGS="--sync 128" extra flags for starling train,
#        SEED=N the peers' init seed and the trainer's data-order seed, 0,
#        PEER_ARGS="--keep-activations 0" extra flags for the peers,
#        SPANS="0-2 3-5" the peers' block ranges, one peer each, "0-1 2-3 4-5")
set -u -o pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
S=$build/tools/starling
epochs=${EPOCHS:-3}
torch_dir=$root/../shared/bench/torch
PY=$(PATH=$(getconf PATH) command -v python3)
work=$(mktemp -d "${TMPDIR:-/tmp}/starling-trainbench-XXXXXX")
pids=""
trap 'for p in $pids; do kill $p 2>/dev/null; done; wait 2>/dev/null; rm -rf "$work"' EXIT
if [ "${BLAS:-}" = Haswell ]; then
    export STARLING_BLAS_CORETYPE=Haswell OPENBLAS_CORETYPE=Haswell; blas=Haswell
else
    unset OPENBLAS_CORETYPE; blas=auto
fi

# Starling: a bootstrap node and three peers (stages 0-1, 2-3, 4-5, as the
# torch pipeline splits the model), one compute thread and one BLAS thread each.
export OPENBLAS_NUM_THREADS=1
"$S" bootstrap --listen 127.0.0.1:0 >"$work/bs.out" 2>/dev/null & pids="$pids $!"
for _ in $(seq 1 50); do [ -s "$work/bs.out" ] && break; sleep 0.1; done
BS=$(head -1 "$work/bs.out")
spans=${SPANS:-0-1 2-3 4-5}
for span in $spans; do
    "$S" peer --initial-peers "$BS" --blocks $span --lr 1e-3 --target-batch 128 --blas-threads 1 --seed "${SEED:-0}" ${PEER_ARGS:-} \
        >/dev/null 2>"$work/peer-$span.err" & pids="$pids $!"
done
n_peers=0
for span in $spans; do
    for _ in $(seq 1 100); do grep -q 'online: announcing' "$work/peer-$span.err" && break; sleep 0.1; done
    if ! grep -q 'online: announcing' "$work/peer-$span.err"; then
        echo "train_bench: the peer for blocks $span did not come online: $(head -1 "$work/peer-$span.err")" >&2
        exit 1
    fi
    n_peers=$((n_peers + 1))
done
"$S" train --initial-peers "$BS" --epochs "$epochs" --batch 64 --inflight 2 --seed "${SEED:-0}" ${TRAIN_FLAGS:-} --json \
    --metrics-log "" --plot "" 2>"$work/train.err" | tail -1 >"$work/starling.json"
ours=$(cat "$work/starling.json")
echo "{\"system\":\"starling-swarm\",\"blas\":\"$blas\",\"peers\":$n_peers,\"spans\":\"$spans\",\"result\":$ours}"
ours_sps=$(sed -n 's/.*"samples_per_s":\([0-9.]*\).*/\1/p' "$work/starling.json")
ours_acc=$(sed -n 's/.*"test_acc":\([0-9.]*\).*/\1/p' "$work/starling.json")
for p in $pids; do kill $p 2>/dev/null; done; wait 2>/dev/null; pids=""

if [ "${SKIP_TORCH:-0}" = 1 ] || ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "{\"ratios\":null,\"note\":\"torch not run\"}"
    exit 0
fi
unset OPENBLAS_NUM_THREADS
(cd "$torch_dir" && "$PY" train_local.py --epochs "$epochs" --threads 1:2 --seed "${SEED:-0}") 2>/dev/null | tail -1 >"$work/local.json"
(cd "$torch_dir" && "$PY" train_pipeline_rpc.py --epochs "$epochs" --stage-threads 1 --seed "${SEED:-0}") 2>/dev/null | tail -1 >"$work/rpc.json"
echo "{\"system\":\"torch-local\",\"blas\":\"$blas\",\"result\":$(cat "$work/local.json")}"
echo "{\"system\":\"torch-rpc-pipeline\",\"blas\":\"$blas\",\"result\":$(cat "$work/rpc.json")}"
"$PY" - "$ours_sps" "$ours_acc" "$work/local.json" "$work/rpc.json" <<'PYEOF'
import json, sys
ours, acc = float(sys.argv[1]), float(sys.argv[2])
def sps(path):
    d = json.load(open(path))
    for k in ("samples_per_s", "train_samples_per_s", "throughput"):
        if k in d: return float(d[k]), float(d.get("test_acc", d.get("accuracy", 0)))
    raise SystemExit("no samples_per_s in %s" % path)
l, la = sps(sys.argv[3]); r, ra = sps(sys.argv[4])
print(json.dumps({"ratios": {"vs_torch_local": round(ours / l, 3), "vs_torch_rpc": round(ours / r, 3)},
                  "test_acc": {"starling": acc, "torch_local": la, "torch_rpc": ra}}))
PYEOF
