#!/bin/sh
# tests/bench/expert_compare.sh: ResFFN block throughput, Starling's
# block_bench against PyTorch's ../shared/bench/torch/compute.py, side by side
# on the same shapes and the same OpenBLAS kernel family, interleaved per
# repeat so background load hits both sides alike.
#
#   tests/bench/expert_compare.sh BUILD_DIR [OUT.jsonl]
#   env: REPS (3), CORES ("Haswell auto"), MIN_TIME (1.5), PY (/usr/bin/python3),
#        TORCH_THREADS ("1,1:2"), OUR_THREADS ("1 2"), SGEMM_ALL (0: --sgemm only
#        at d=1024 batch=256; 1: every run, so each run records how loaded the
#        machine was; expert_compare.py --quiet uses it)
# "auto" runs with OPENBLAS_CORETYPE unset (OpenBLAS detects the CPU);
# a name sets OPENBLAS_CORETYPE for both sides (block_bench keeps it because
# STARLING_BLAS_CORETYPE=env). Summarise: tests/bench/expert_compare.py OUT.jsonl
set -eu
BUILD=${1:?usage: expert_compare.sh BUILD_DIR [OUT.jsonl]}
OUT=${2:-expert_compare.jsonl}
REPS=${REPS:-3}
CORES=${CORES:-"Haswell auto"}
MIN_TIME=${MIN_TIME:-1.5}
TORCH_THREADS=${TORCH_THREADS:-1,1:2}
OUR_THREADS=${OUR_THREADS:-1 2}
SGEMM_ALL=${SGEMM_ALL:-0}
PY=${PY:-/usr/bin/python3}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
TORCH="$ROOT/../shared/bench/torch/compute.py"
BENCH="$BUILD/tests/bench/block_bench"
[ -x "$BENCH" ] || { echo "no $BENCH: build first" >&2; exit 1; }
: > "$OUT"
for rep in $(seq 1 "$REPS"); do
  for core in $CORES; do
    if [ "$core" = auto ]; then set -- env -u OPENBLAS_CORETYPE; else set -- env OPENBLAS_CORETYPE="$core"; fi
    "$@" "$PY" "$TORCH" --threads "$TORCH_THREADS" --d 256,1024 --batch 32,256 --no-xformer \
        --min-time "$MIN_TIME" | tail -n 1 |
      sed "s/^{/{\"side\": \"torch\", \"blas\": \"$core\", \"rep\": $rep, /" >> "$OUT"
    for d in 256 1024; do
      for b in 32 256; do
        for t in $OUR_THREADS; do
          extra=""
          if [ "$SGEMM_ALL" = 1 ] || { [ "$d" = 1024 ] && [ "$b" = 256 ]; }; then extra="--sgemm"; fi
          "$@" STARLING_BLAS_CORETYPE=env "$BENCH" --d "$d" --batch "$b" --threads "$t" \
              --min-time "$MIN_TIME" $extra | tail -n 1 |
            sed "s/^{/{\"side\":\"starling\",\"blas\":\"$core\",\"rep\":$rep,/" >> "$OUT"
        done
      done
    done
  done
done
echo "wrote $OUT" >&2
