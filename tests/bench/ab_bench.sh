#!/bin/sh
# tests/bench/ab_bench.sh: the CPU path of two builds side by side: the
# block, model and language-model benchmarks of build A (e.g. the commit
# before a change) and build B, alternated round by round so that a noisy
# machine slows both alike; medians per side and the ratios B/A.
#
# Usage: tests/bench/ab_bench.sh [--rounds N] [--min-time S] BUILD_A BUILD_B
#   BUILD_A/B: build directories holding tests/bench/{block,model,lm}_bench
# Both sides run with the same OpenBLAS kernels: $STARLING_BLAS_CORETYPE
# (default Haswell, the family this project's VMs export), one thread for
# model and language model, two for the block (as meson's benchmark()s).
# Prints one JSON line: per benchmark the median and the best throughput of
# A and B over the rounds and B/A of each (>= 0.98 means B kept A's speed;
# on a shared machine interference only slows a run, so the best is the
# steadier figure). Exit 0, or 2 on bad usage.
set -u
rounds=5 min_time=1.0
while [ $# -gt 2 ]; do
    case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --min-time) min_time=$2; shift 2 ;;
    -h|--help) sed -n "2,15p" "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "ab_bench: unknown option $1" >&2; exit 2 ;;
    esac
done
[ $# -eq 2 ] || { sed -n "2,15p" "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
A=$1 B=$2
for d in "$A" "$B"; do
    for p in block_bench model_bench lm_bench; do
        [ -x "$d/tests/bench/$p" ] || { echo "ab_bench: $d/tests/bench/$p is missing (ninja -C $d tests/bench/$p)" >&2; exit 2; }
    done
done
export STARLING_BLAS_CORETYPE="${STARLING_BLAS_CORETYPE:-Haswell}"
out=$(mktemp -d "${TMPDIR:-/tmp}/ab-bench-XXXXXX") || exit 1
trap 'rm -rf "$out"' EXIT

# field FILE KEY: a number from the last JSON line of FILE.
field() { tail -1 "$1" | sed -n "s/.*\"$2\":\([0-9.eE+-]*\).*/\1/p"; }

run() { # run SIDE DIR ROUND
    "$2/tests/bench/block_bench" --d 1024 --batch 256 --threads 2 --min-time "$min_time" \
        >"$out/block.$1.$3" 2>/dev/null
    "$2/tests/bench/block_bench" --d 256 --batch 32 --threads 2 --min-time "$min_time" \
        >"$out/block_small.$1.$3" 2>/dev/null
    "$2/tests/bench/lm_bench" --d 256 --seq 128 --batch 8 --threads 1 --min-time "$min_time" \
        >"$out/lm.$1.$3" 2>/dev/null
    "$2/tests/bench/model_bench" --threads 1 --batch 128 --min-time "$min_time" \
        >"$out/model.$1.$3" 2>/dev/null
}

i=1
while [ "$i" -le "$rounds" ]; do
    # A first in odd rounds, B first in even ones.
    if [ $((i % 2)) -eq 1 ]; then run a "$A" "$i"; run b "$B" "$i"; else run b "$B" "$i"; run a "$A" "$i"; fi
    i=$((i + 1))
done

# best KIND SIDE KEY: the highest throughput of the rounds.
best() {
    for f in "$out/$1.$2".*; do field "$f" "$3"; done | sort -g | tail -n 1
}

# median KIND SIDE KEY
median() {
    for f in "$out/$1.$2".*; do field "$f" "$3"; done | sort -g |
        awk '{ v[NR] = $1 } END { if (NR == 0) print "null"; else if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

json="{\"bench\":\"ab_bench\",\"rounds\":$rounds,\"openblas_core\":\"$STARLING_BLAS_CORETYPE\",\"a\":\"$A\",\"b\":\"$B\""
for k in "block samples_per_s" "block_small samples_per_s" "lm tokens_per_s" "model samples_per_s"; do
    set -- $k
    ma=$(median "$1" a "$2") mb=$(median "$1" b "$2")
    ba=$(best "$1" a "$2") bb=$(best "$1" b "$2")
    ratio=$(awk -v a="$ma" -v b="$mb" 'BEGIN { if (a > 0) printf "%.4f", b / a; else print "null" }')
    bratio=$(awk -v a="$ba" -v b="$bb" 'BEGIN { if (a > 0) printf "%.4f", b / a; else print "null" }')
    json="$json,\"${1}_a\":$ma,\"${1}_b\":$mb,\"${1}_ratio\":$ratio"
    json="$json,\"${1}_best_a\":${ba:-null},\"${1}_best_b\":${bb:-null},\"${1}_best_ratio\":$bratio"
done
echo "$json}"
