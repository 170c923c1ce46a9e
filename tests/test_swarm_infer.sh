#!/bin/sh
# starling infer: predictions equal a local forward with the same weights;
# a majority vote over replicas outvotes one stale replica; inference runs
# while a trainer trains the same swarm, and reports the versions it used.
. "$(dirname "$0")/swarm_lib.sh"
REF=${INFER_REF:?INFER_REF must point at tests/infer_ref}
start_bootstrap
start_peer a 0-2
start_peer b 3-5
"$REF" 0 1000 64 | cut -d' ' -f2 >"$T/ref.txt" || { fail "infer_ref failed"; finish; }
"$S" infer --initial-peers "$BS" --data test --samples 1000 --output "$T/pred.txt" 2>"$T/i1.err"
[ $? -eq 0 ] || { fail "infer failed"; show "$T/i1.err"; }
cut -d' ' -f2 "$T/pred.txt" >"$T/got.txt"
cmp -s "$T/ref.txt" "$T/got.txt" || fail "swarm predictions differ from the local forward ($(diff "$T/ref.txt" "$T/got.txt" | grep -c '^<') of 1000)"
grep -q 'weight versions used: 0:0-0' "$T/i1.err" || { fail "versions not reported"; show "$T/i1.err"; }

# A second swarm of three whole-model replicas, one of them "stale" (other
# weights): with --replicas 3 the two agreeing paths win every vote.
kill "$PID_a" "$PID_b"
start_bootstrap
start_peer c 0-5
start_peer d 0-5
start_peer e 0-5 --seed 9 --no-state-download --average-every 0
"$S" infer --initial-peers "$BS" --data test --samples 1000 --replicas 3 --output "$T/vote.txt" \
    --json >"$T/vote.json" 2>"$T/i2.err"
[ $? -eq 0 ] || { fail "infer --replicas 3 failed"; show "$T/i2.err"; }
cut -d' ' -f2 "$T/vote.txt" >"$T/vgot.txt"
cmp -s "$T/ref.txt" "$T/vgot.txt" || fail "majority vote differs from the good replicas ($(diff "$T/ref.txt" "$T/vgot.txt" | grep -c '^<') of 1000)"
unan=$(json_field "$T/vote.json" unanimous)
awk "BEGIN { exit !($unan < 0.9) }" || fail "the stale replica never disagreed (unanimous $unan)"

# Inference while training: both succeed; replies name newer versions.
# The stale replica leaves first (SIGTERM: it announces itself offline): the
# trainer would otherwise mix its unrelated weights into the others' stages,
# and a path through one peer would then score near chance.
stop_peer "$PID_e" 120 || { fail "the stale replica did not stop cleanly"; show "$T/e.err"; }
"$S" train --initial-peers "$BS" --train-samples 4096 --test-samples 500 --metrics-log "" --plot "" \
    >"$T/train.out" 2>"$T/train.err" &
TR=$!
PIDS="$PIDS $TR"
wait_for "$T/train.err" 'progress [1-9]' 300 "$TR" || fail "training did not start"
"$S" infer --initial-peers "$BS" --data test --samples 2000 --json >"$T/i3.json" 2>"$T/i3.err"
[ $? -eq 0 ] || { fail "infer during training failed"; show "$T/i3.err"; }
wait "$TR" || { fail "training failed"; show "$T/train.err"; }
"$S" infer --initial-peers "$BS" --data test --samples 500 --json >"$T/i4.json" 2>"$T/i4.err"
"${PYTHON:-python3}" - "$T/i4.json" <<'PYEOF' || fail "no newer weight version after training"
import json, sys
d = json.load(open(sys.argv[1]))
assert any(v["max"] > 0 for v in d["versions"]), d["versions"]
assert d["accuracy"] > 0.3, d["accuracy"]
PYEOF
finish
