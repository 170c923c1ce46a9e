#!/bin/sh
# Golden output of `starling monitor --json`, `starling train --json` and
# `starling infer --json` on a small fixed loopback swarm, compared byte for
# byte (after normalisation) with tests/golden/swarm_cli_*.json, so that a
# change of a field's name, order, type, number format or deterministic value
# shows up as a diff.
#
# The swarm: a bootstrap node and two peers of fmnist-mlp, a (stages 0-2)
# and b (stages 3-5), no replicas, initial weights seed 0, no cold copies
# (--keep-every 0: a keeper's first look comes 5 s after joining, so the
# monitor's cold_copies would depend on timing). Then, in this order:
#   monitor  once both peers' announcements are visible (before any training)
#   train    512 samples (4 optimizer steps of 128 per stage), 256 test
#            samples, batch 64, one micro-batch in flight, data seed 0: one
#            call at a time, so the losses and the bytes are deterministic
#   infer    the first 100 test samples (a full and a partial request of 64),
#            one request in flight, on the trained weights (every stage at
#            weight version 4)
#
# Normalisation (the python3 filter below works on the raw text, not on a
# re-serialised parse, so everything it does not replace stays byte-exact;
# the raw output must still be one line of valid JSON):
#   - a volatile number becomes 0 with as many decimals as it had
#     (21203.4 -> 0.0, 136.346 -> 0.000, 1795807351432 -> 0), which keeps
#     its type and its printf format pinned:
#       monitor: time_ms (clock), throughput (stage and holder: the peers'
#                start-up benchmark), age_s (age of the announcement)
#       train:   samples_per_s, train_time_s (timing)
#       infer:   p50_ms, p99_ms, requests_per_s, samples_per_s (timing)
#   - monitor: a holder's "id" (a fresh identity each run) becomes "<id:a>"
#     or "<id:b>", the peer that printed it; its "addr" keeps the host and
#     loses the port (any free port): "127.0.0.1:<port:a>". An id or address
#     of no known peer is left as it is, so it shows in the diff.
#   - monitor: "bottleneck" (the stage with the least measured throughput)
#     becomes "<stage>" when it is one of the model's stage names.
# Everything else is kept: key names and order, counts, states, shapes,
# versions, device, precision, wire formats, losses, accuracies, bytes,
# predictions.
#
# The losses, accuracies and predictions are exact only on the kind of CPU
# they were recorded on: the sgemm kernel OpenBLAS picks and the ISA level of
# expert/'s target_clones (avx512f, avx2, default) change the float rounding.
# tests/golden/swarm_cli_platform.txt names that platform (architecture,
# OpenBLAS core as the peer reports it, ISA level). On another platform the
# test says so and compares those fields by shape only (train: test_acc,
# test_loss; infer: accuracy, each of the predictions), everything else
# exactly as above; a byte-for-byte check of a refactor needs the goldens
# recorded on the machine that checks it.
#
# STARLING_GOLDEN_UPDATE=1 writes the golden files (and the platform)
# instead of comparing; record them with the binary whose behaviour is the
# reference.
. "$(dirname "$0")/swarm_lib.sh"
PY=${PYTHON:-python3}
GOLDEN=$(cd "$(dirname "$0")" && pwd)/golden
UPDATE=${STARLING_GOLDEN_UPDATE:-0}

start_bootstrap
start_peer a 0-2 --seed 0 --keep-every 0
start_peer b 3-5 --seed 0 --keep-every 0

# node_of NAME: the peer's "HOST:PORT NODEID" from its address line.
node_of() {
    sed -n 's#.*address \([^ ]*\)/\([0-9a-f]\{40\}\)$#\1 \2#p' "$T/$1.out" | tail -1
}
NODE_a=$(node_of a)
NODE_b=$(node_of b)

# The monitor: a lookup that saw fewer than both peers' six stages (a slow
# machine) is asked again, a bounded number of times; the comparison below
# is strict either way.
for _ in 1 2 3 4 5; do
    "$S" monitor --json --initial-peers "$BS" >"$T/monitor.raw" 2>"$T/monitor.err"
    mrc=$?
    [ "$mrc" -eq 0 ] && grep -q '"peers":2,"blocks":6,' "$T/monitor.raw" && break
    sleep 1
done
[ "$mrc" -eq 0 ] || { fail "monitor exited $mrc"; show "$T/monitor.err"; }

timeout 120 "$S" train --initial-peers "$BS" --train-samples 512 --test-samples 256 --batch 64 \
    --inflight 1 --seed 0 --metrics-log "" --plot "" --json >"$T/train.raw" 2>"$T/train.err"
trc=$?
[ "$trc" -eq 0 ] || { fail "train exited $trc"; show "$T/train.err"; }

timeout 120 "$S" infer --initial-peers "$BS" --data test --samples 100 --inflight 1 --json \
    >"$T/infer.raw" 2>"$T/infer.err"
irc=$?
[ "$irc" -eq 0 ] || { fail "infer exited $irc"; show "$T/infer.err"; }

# The numeric platform (see the top); "?" where it cannot be told.
blas=$(sed -n 's/.*(cpu (OpenBLAS \([^,]*\),.*/\1/p' "$T/a.out" | head -1)
isa=default
grep -qw avx2 /proc/cpuinfo 2>/dev/null && isa=avx2
grep -qw avx512f /proc/cpuinfo 2>/dev/null && isa=avx512f
[ -r /proc/cpuinfo ] || isa="?"
PLATFORM="$(uname -m), OpenBLAS ${blas:-?}, $isa"

# normalize KIND IN OUT LOOSE: the filter described at the top; LOOSE=1 also
# reduces the platform-dependent numbers to their shape. Idempotent, so it
# also applies LOOSE to an already normalised golden file.
normalize() {
    "$PY" - "$1" "$2" "$3" "$4" "a $NODE_a" "b $NODE_b" <<'PYEOF'
import json, re, sys
kind, src, out, loose = sys.argv[1:5]
peers = [a.split() for a in sys.argv[5:]]      # [name, "HOST:PORT", id]
text = open(src, encoding="utf-8").read()
if not text.endswith("\n") or text.count("\n") != 1:
    sys.exit("%s: not exactly one line of output" % src)
try:
    doc = json.loads(text)
except ValueError as e:
    sys.exit("%s: not valid JSON: %s" % (src, e))

VOLATILE = {
    "monitor": ["time_ms", "throughput", "age_s"],
    "train": ["samples_per_s", "train_time_s"],
    "infer": ["p50_ms", "p99_ms", "requests_per_s", "samples_per_s"],
}[kind]
PLATFORM_DEPENDENT = {"monitor": [], "train": ["test_acc", "test_loss"], "infer": ["accuracy"]}[kind]
NUM = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"

def shape(num):
    """A number as 0 with as many decimals: 21203.4 -> 0.0, 17 -> 0."""
    frac = re.search(r"\.(\d+)", num)
    return "0" + ("." + "0" * len(frac.group(1)) if frac else "")

for key in VOLATILE + (PLATFORM_DEPENDENT if loose == "1" else []):
    text = re.sub(r'("%s":)(%s)' % (re.escape(key), NUM), lambda m: m.group(1) + shape(m.group(2)), text)
if loose == "1" and kind == "infer":
    text = re.sub(r'("predictions":\[)([^\]]*)\]',
                  lambda m: m.group(1) + re.sub(NUM, lambda n: shape(n.group(0)), m.group(2)) + "]", text)

if kind == "monitor":
    for name, addr, nid in peers:
        host, port = addr.rsplit(":", 1)
        text = text.replace('"id":"%s","addr":"%s"' % (nid, addr),
                            '"id":"<id:%s>","addr":"%s:<port:%s>"' % (name, host, name))
    stages = {st["name"] for m in doc.get("models", []) for st in m.get("stages", [])}
    text = re.sub(r'("bottleneck":)"([^"\\]*)"',
                  lambda m: m.group(1) + ('"<stage>"' if m.group(2) in stages else '"%s"' % m.group(2)), text)
open(out, "w", encoding="utf-8").write(text)
PYEOF
}

loose=0
if [ "$UPDATE" = 1 ]; then
    [ "$fails" -eq 0 ] || { echo "not writing the golden files: a command failed" >&2; finish; }
    mkdir -p "$GOLDEN" && echo "$PLATFORM" >"$GOLDEN/swarm_cli_platform.txt" &&
        echo "wrote $GOLDEN/swarm_cli_platform.txt ($PLATFORM)"
elif [ "$(cat "$GOLDEN/swarm_cli_platform.txt" 2>/dev/null)" != "$PLATFORM" ]; then
    loose=1
    echo "NOTE: the goldens were recorded on '$(cat "$GOLDEN/swarm_cli_platform.txt" 2>/dev/null)'," \
        "this is '$PLATFORM': losses, accuracies and predictions are compared by shape only" >&2
fi
for k in monitor train infer; do
    normalize "$k" "$T/$k.raw" "$T/$k.json" "$loose" ||
        { fail "$k: cannot normalise its output"; show "$T/$k.raw"; continue; }
    g="$GOLDEN/swarm_cli_$k.json"
    if [ "$UPDATE" = 1 ]; then
        cp "$T/$k.json" "$g" && echo "wrote $g"
        continue
    elif [ ! -f "$g" ]; then
        fail "$k: no golden file $g (STARLING_GOLDEN_UPDATE=1 writes it)"
        continue
    fi
    cp "$g" "$T/$k.golden"
    [ "$loose" = 0 ] || normalize "$k" "$g" "$T/$k.golden" 1 ||
        { fail "$k: cannot normalise $g"; continue; }
    if ! cmp -s "$T/$k.golden" "$T/$k.json"; then
        fail "$k --json differs from $g"
        diff -u "$T/$k.golden" "$T/$k.json" >&2
        # The same, one JSON member per line, to see which field moved.
        sed 's/,/,\n/g' "$T/$k.golden" >"$T/$k.golden.split"
        sed 's/,/,\n/g' "$T/$k.json" >"$T/$k.split"
        echo "--- the same, split at commas:" >&2
        diff -u "$T/$k.golden.split" "$T/$k.split" >&2
    fi
done
finish
