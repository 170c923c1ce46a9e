#!/bin/sh
# A trainer against a swarm missing stages waits, says which stage, and gives
# up with exit 1 after --max-wait.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
start_peer a 0-2
# It gives up after --max-wait, not the default 120 s: timed from its
# "N training samples" line, so that loading the data and joining on a slow
# machine do not count (the timeout is a hang guard).
timeout 300 "$S" train --initial-peers "$BS" --train-samples 512 --test-samples 256 --max-wait 3 \
    --metrics-log "" --plot "" >"$T/train.out" 2>"$T/train.err" &
TR=$!
PIDS="$PIDS $TR"
wait_for "$T/train.err" 'training samples x' 300 "$TR"
start=$(date +%s)
wait "$TR"
rc=$?
took=$(( $(date +%s) - start ))
[ "$rc" -eq 1 ] || { fail "train exited $rc, want 1"; show "$T/train.err"; }
grep -q 'fmnist-mlp.3 has no online holder' "$T/train.err" || { fail "no clear message"; show "$T/train.err"; }
grep -q -- '--blocks 3' "$T/train.err" || fail "message does not say how to fix it"
[ "$took" -le 30 ] || fail "took $took s after training started"
# An unreachable swarm is a clear error too.
timeout 300 "$S" train --initial-peers 127.0.0.1:9 --train-samples 64 --metrics-log "" --plot "" \
    >"$T/t2.out" 2>"$T/t2.err"
rc=$?
[ "$rc" -eq 1 ] || fail "unreachable swarm: exit $rc, want 1"
grep -q 'cannot reach any initial peer' "$T/t2.err" || { fail "unreachable: no clear message"; show "$T/t2.err"; }
finish
