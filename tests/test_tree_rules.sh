#!/bin/sh
# The tree's structural rules (tools/tree_check.py): the layers' includes,
# function length in dht/, net/, swarm/, routing/ and capi/, comments on every header
# prototype. First on the sources, then on a scratch copy with one breach of
# each rule planted, which must each be caught.
set -eu
ROOT=${STARLING_SOURCE_ROOT:?}
CHECK="$ROOT/tools/tree_check.py"
python3 "$CHECK" "$ROOT"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT INT TERM
for d in dht expert cuda net swarm peer routing capi tools; do
    mkdir -p "$TMP/$d"
done
printf '#include "peer/daemon.h"\n' > "$TMP/routing/bad_layer.c"
{
    printf 'int long_one(void)\n{\n    int x = 0;\n'
    i=0
    while [ $i -lt 100 ]; do printf '    x++;\n'; i=$((i + 1)); done
    printf '    return x;\n}\n'
} > "$TMP/net/bad_length.c"
printf '#ifndef X_H\n#define X_H\n\nint no_comment(int a);\n\n#endif\n' > "$TMP/swarm/bad_comment.h"
if out=$(python3 "$CHECK" "$TMP"); then
    echo "FAIL: planted breaches were not caught:"
    echo "$out"
    exit 1
fi
for want in "routing/ includes peer/" "long_one is 105 lines" "prototype without a comment: int no_comment"; do
    case "$out" in
        *"$want"*) ;;
        *) echo "FAIL: expected '$want' in:"; echo "$out"; exit 1 ;;
    esac
done
echo "tree rules hold; planted breaches caught"
