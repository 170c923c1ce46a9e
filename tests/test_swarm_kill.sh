#!/bin/sh
# kill -9 of one of two replicas mid-training: training finishes, every
# sample is processed exactly once, accuracy stays above the threshold.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
start_peer a 0-2
start_peer b 3-5
start_peer c 2,3
timeout 300 "$S" train --initial-peers "$BS" --train-samples 6000 --test-samples 2000 --json \
    --timeout 5 --metrics-log "$T/train.jsonl" --plot "" >"$T/train.out" 2>"$T/train.err" &
TRAIN=$!
PIDS="$PIDS $TRAIN"
# Kill the replica once training is under way (the log shows >= 1000 samples;
# the bound is a hang guard).
wait_for "$T/train.jsonl" '"samples":(1[0-9]{3}|[2-9][0-9]{3})' 600 "$TRAIN" || fail "training did not start"
kill -9 "$PID_c"
echo "killed replica c"
wait "$TRAIN"
rc=$?
[ "$rc" -eq 0 ] || { fail "train exited $rc"; show "$T/train.err"; }
acc=$(json_field "$T/train.out" test_acc)
samples=$(json_field "$T/train.out" samples)
retries=$(json_field "$T/train.out" retries)
echo "test_acc=$acc samples=$samples retries=$retries"
[ "$samples" = 6000 ] || fail "processed $samples samples, want exactly 6000"
awk "BEGIN { exit !($acc >= 0.5) }" || fail "test accuracy $acc below 0.5"
finish
