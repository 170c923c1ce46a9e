#!/bin/sh
# tests/bench/icount_ab.sh: instructions (callgrind) of the CPU block path of
# two builds: tests/bench/icount_drv.c compiled against each build's expert
# library and run under valgrind --tool=callgrind, one thread, Haswell
# kernels on both. Deterministic: the same build gives the same count on a
# busy or an idle machine.
#
# Usage: tests/bench/icount_ab.sh BUILD_A BUILD_B
#   BUILD_A/B: build directories (their source trees beside them, as meson
#   sets up: BUILD/.. holds the sources) with expert/libstarling_expert.a
# Prints one JSON line: per workload the instructions of A and B and B/A.
# Needs valgrind and gcc. Takes a few minutes.
set -u
[ $# -eq 2 ] || { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
command -v valgrind >/dev/null || { echo "icount_ab: needs valgrind (apt-get install valgrind)" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d "${TMPDIR:-/tmp}/icount-XXXXXX") || exit 1
trap 'rm -rf "$out"' EXIT
blas_inc=$(pkg-config --cflags openblas 2>/dev/null)
side=0
for b in "$1" "$2"; do
    src=$(cd "$b/.." && pwd) bdir=$(cd "$b" && pwd)
    [ -f "$bdir/expert/libstarling_expert.a" ] || { echo "icount_ab: $b/expert/libstarling_expert.a is missing" >&2; exit 2; }
    # shellcheck disable=SC2086
    gcc -O2 -std=c11 -D_GNU_SOURCE -I"$src" -I"$bdir" $blas_inc "$here/icount_drv.c" \
        "$bdir/expert/libstarling_expert.a" -lopenblas -ljansson -lz -lm -lpthread -o "$out/drv$side" ||
        { echo "icount_ab: cannot build the driver against $b" >&2; exit 1; }
    side=$((side + 1))
done
json="{\"bench\":\"icount_ab\",\"a\":\"$1\",\"b\":\"$2\",\"openblas_core\":\"Haswell\""
for w in 0 1; do
    for s in 0 1; do
        OPENBLAS_CORETYPE=Haswell OPENBLAS_NUM_THREADS=1 valgrind --tool=callgrind \
            --callgrind-out-file="$out/cg.$s.$w" "$out/drv$s" "$w" >/dev/null 2>"$out/err.$s.$w"
        eval "ir$s=\$(sed -n 's/.*Collected : \([0-9]*\).*/\1/p' \"\$out/err.$s.$w\" | tail -n 1)"
    done
    name=$([ "$w" = 0 ] && echo fmnist || echo transformer)
    # shellcheck disable=SC2154
    ratio=$(awk -v a="$ir0" -v b="$ir1" 'BEGIN { if (a > 0) printf "%.6f", b / a; else print "null" }')
    json="$json,\"${name}_a\":${ir0:-null},\"${name}_b\":${ir1:-null},\"${name}_ratio\":$ratio"
done
echo "$json}"
