#!/bin/sh
# A 4-process swarm on loopback (bootstrap + 3 peers, stages 2 and 3 with two
# replicas) trains fmnist-mlp on a subset and beats a fixed accuracy.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
start_peer a 0-2
start_peer b 3-5
start_peer c 2,3
timeout 300 "$S" train --initial-peers "$BS" --train-samples 6000 --test-samples 2000 --json \
    --metrics-log "$T/train.jsonl" --plot "$T/train.svg" >"$T/train.out" 2>"$T/train.err"
rc=$?
[ "$rc" -eq 0 ] || { fail "train exited $rc"; show "$T/train.err"; }
acc=$(json_field "$T/train.out" test_acc)
samples=$(json_field "$T/train.out" samples)
echo "test_acc=$acc samples=$samples"
awk "BEGIN { exit !($acc >= 0.55) }" || fail "test accuracy $acc below 0.55"
[ "$samples" = 6000 ] || fail "processed $samples samples, want 6000"
grep -q '"event":"epoch"' "$T/train.jsonl" || fail "no epoch line in the metrics log"
grep -q '<polyline' "$T/train.svg" || fail "no curve in the plot"
# Synchronous groups (--sync): 100-sample groups (not a multiple of the
# micro-batch, so groups cut micro-batches short) with 4 in flight still
# process every sample exactly once and learn.
timeout 300 "$S" train --initial-peers "$BS" --train-samples 3000 --test-samples 1000 --sync 100 --inflight 4 \
    --json --metrics-log "" --plot "" >"$T/sync.out" 2>"$T/sync.err"
rc=$?
[ "$rc" -eq 0 ] || { fail "train --sync exited $rc"; show "$T/sync.err"; }
acc=$(json_field "$T/sync.out" test_acc)
samples=$(json_field "$T/sync.out" samples)
echo "sync: test_acc=$acc samples=$samples"
awk "BEGIN { exit !($acc >= 0.55) }" || fail "--sync test accuracy $acc below 0.55"
[ "$samples" = 3000 ] || fail "--sync processed $samples samples, want 3000"
finish
