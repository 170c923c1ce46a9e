#!/usr/bin/env bash
# tests/bench/lm_curve.sh: tiny-lm through a 3-peer loopback swarm beside
# ../shared/bench/torch/train_lm.py (one process), from the SAME initial
# weights (train_lm.py --save-init, loaded by the peers with --init-weights)
# on the SAME windows (same seed, batch 32, context 128, the fortunes
# corpus), AdamW lr 1e-3 on both sides. The correctness gate of the whole
# stack: the two validation-loss curves must agree at every evaluation.
# Prints one JSON line per system and a last line
# {"steps":N,"max_rel_diff":D,"tokens_per_s_ratio":R,"curve":[[step,torch,ours],...]}.
#
# Usage: tests/bench/lm_curve.sh [BUILD_DIR]   (env: STEPS=200, EVAL_EVERY=50,
#        BLAS=Haswell to force AVX2 kernels on both sides (default: each
#        side's best; Starling re-executes itself without OPENBLAS_CORETYPE),
#        SKIP_TORCH=1 reuses $WORK/torch.json and $WORK/init.bin, WORK=DIR keeps
#        the files)
set -u -o pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
S=$build/tools/starling
steps=${STEPS:-200}
every=${EVAL_EVERY:-50}
torch_dir=$root/../shared/bench/torch
PY=/usr/bin/python3
if [ -n "${WORK:-}" ]; then work=$WORK; mkdir -p "$work"; keep=1; else
    work=$(mktemp -d "${TMPDIR:-/tmp}/starling-lmcurve-XXXXXX"); keep=0; fi
pids=""
trap 'for p in $pids; do kill $p 2>/dev/null; done; wait 2>/dev/null; [ "$keep" = 1 ] || rm -rf "$work"' EXIT
if [ "${BLAS:-}" = Haswell ]; then
    export STARLING_BLAS_CORETYPE=Haswell OPENBLAS_CORETYPE=Haswell; blas=Haswell
else
    unset OPENBLAS_CORETYPE; blas=auto
fi

# torch: its fastest setting here (1 torch thread, 2 OpenBLAS threads).
if [ -z "${SKIP_TORCH:-}" ]; then
    "$PY" "$torch_dir/train_lm.py" --steps "$steps" --eval-every "$every" --seed 0 \
        --save-init "$work/init.bin" >"$work/torch.log" 2>"$work/torch.err" ||
        { echo "train_lm.py failed" >&2; tail -5 "$work/torch.err" >&2; exit 1; }
    tail -1 "$work/torch.log" >"$work/torch.json"
fi

# Starling: a bootstrap node and three peers, one stage each (two decoder
# layers each; the first with the embedding, the last with the head), one
# BLAS thread each: three processes on this machine's cores.
export OPENBLAS_NUM_THREADS=1
"$S" bootstrap --listen 127.0.0.1:0 >"$work/bs.out" 2>/dev/null & pids="$pids $!"
for _ in $(seq 1 50); do [ -s "$work/bs.out" ] && break; sleep 0.1; done
BS=$(head -1 "$work/bs.out")
for b in 0 1 2; do
    "$S" peer --initial-peers "$BS" --model tiny-lm --blocks "$b" --init-weights "$work/init.bin" \
        --blas-threads 1 --average-every 0 >/dev/null 2>"$work/peer-$b.err" & pids="$pids $!"
done
for b in 0 1 2; do
    for _ in $(seq 1 600); do grep -q 'online: announcing' "$work/peer-$b.err" && break; sleep 0.1; done
done
timeout 3600 "$S" train --initial-peers "$BS" --model tiny-lm --steps "$steps" --eval-every "$every" \
    --seed 0 --json --metrics-log "$work/ours.jsonl" --plot "" >"$work/ours.json" 2>"$work/ours.err" ||
    { echo "starling train failed" >&2; tail -5 "$work/ours.err" >&2; exit 1; }

"$PY" - "$work" "$blas" <<'PYEOF'
import json, sys
work, blas = sys.argv[1], sys.argv[2]
torch = json.loads(open(f"{work}/torch.json").read())
ours = json.loads(open(f"{work}/ours.json").read().strip().splitlines()[-1])
evals = [json.loads(l) for l in open(f"{work}/ours.jsonl") if '"event":"eval"' in l]
ours_curve = {e["step"]: e["val_loss"] for e in evals}
curve, worst = [], 0.0
for step, _tokens, tl in torch["curve"]:
    if step in ours_curve:
        ol = ours_curve[step]
        curve.append([step, tl, round(ol, 5)])
        worst = max(worst, abs(ol - tl) / tl)
print(json.dumps({"system": "torch", "tokens_per_s": torch["tokens_per_s"],
                  "val_loss": torch["curve"][-1][2], "threads": torch.get("threads"), "blas": blas}))
print(json.dumps({"system": "starling", "tokens_per_s": ours["tokens_per_s"], "val_loss": ours["val_loss"],
                  "retries": ours["retries"], "blas": blas}))
print(json.dumps({"steps": torch["curve"][-1][0], "max_rel_diff": round(worst, 5),
                  "tokens_per_s_ratio": round(ours["tokens_per_s"] / torch["tokens_per_s"], 3),
                  "curve": curve}))
PYEOF
