#!/bin/sh
# Refused backwards (issue 18): a holder whose gradient checks fail answers
# a backward with ERANGE and a sentence. The trainer must log the sentence
# (once per stage and error, not once per call), retry on another replica
# without banning the refuser, and, when every replica refuses a
# micro-batch's backward 3 times, drop that micro-batch's update instead of
# retrying forever (its samples count as processed: "refused_samples").
# Then, with an honest replica beside the refusers, training learns as
# usual and the refusers are backed off. Every wait is bounded.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
start_peer a 0-4
# Two replicas of the last stage that refuse every gradient (limit 1e-9).
start_peer r 5 --grad-max-norm 1e-9 --announce-every 2
start_peer r2 5 --grad-max-norm 1e-9

# 1. Every replica refuses: 10 micro-batches, each dropped after 3 refusals.
timeout 120 "$S" train --initial-peers "$BS" --train-samples 640 --test-samples 200 --json --timeout 5 \
    --metrics-log "$T/t1.jsonl" --plot "" >"$T/t1.out" 2>"$T/t1.err"
rc=$?
[ "$rc" -eq 0 ] || { fail "train (all refuse) exited $rc"; show "$T/t1.err"; }
cat "$T/t1.out"
[ "$(json_field "$T/t1.out" samples)" = 640 ] || fail "processed $(json_field "$T/t1.out" samples) samples, want 640"
[ "$(json_field "$T/t1.out" refused_samples)" = 640 ] || fail "refused_samples is not 640"
[ "$(json_field "$T/t1.out" refused_batches)" = 10 ] || fail "refused_batches is not 10"
[ "$(json_field "$T/t1.out" refused)" = 30 ] || fail "refused is not 30 (3 per micro-batch)"
[ "$(json_field "$T/t1.out" retries)" = 20 ] || fail "retries is not 20 (2 per micro-batch)"
grep -q 'stage fmnist-mlp.5 refused a backward: fmnist-mlp.5: backward per-sample [a-z_]* norm [^ ]* is above the limit 1e-09; refused' \
    "$T/t1.err" || { fail "the refusal's sentence is not logged"; show "$T/t1.err"; }
n=$(grep -c 'refused a backward:' "$T/t1.err")
[ "$n" -eq 1 ] || fail "the refusal is logged $n times, want once (the rest in summaries)"
grep -q 'its update is dropped' "$T/t1.err" || fail "the dropped update is not logged"
grep -q '"event":"end".*"refused":30,"refused_samples":640' "$T/t1.jsonl" || fail "no refusals in the metrics log's end line"
grep -q 'holders refused 30 backward calls' "$T/t1.err" || fail "no refusal count in the final lines"

# 2. An honest replica beside the refusers: every backward ends up accepted.
start_peer h 5
timeout 300 "$S" train --initial-peers "$BS" --train-samples 6000 --test-samples 1000 --json --timeout 5 \
    --metrics-log "" --plot "" >"$T/t2.out" 2>"$T/t2.err"
rc=$?
[ "$rc" -eq 0 ] || { fail "train (one honest replica) exited $rc"; show "$T/t2.err"; }
cat "$T/t2.out"
acc=$(json_field "$T/t2.out" test_acc)
[ "$(json_field "$T/t2.out" samples)" = 6000 ] || fail "processed $(json_field "$T/t2.out" samples) samples, want 6000"
[ "$(json_field "$T/t2.out" refused_samples)" = 0 ] || fail "updates were dropped with an honest replica up"
[ "$(json_field "$T/t2.out" refused)" -ge 1 ] || fail "no refusal counted"
awk "BEGIN { exit !(${acc:-0} >= 0.5) }" || fail "test accuracy $acc below 0.5"
grep -q 'accepted a backward that holder [0-9a-f]\{8\} refused; backing off' "$T/t2.err" ||
    { fail "the refusers were not backed off"; show "$T/t2.err"; }

# 3. A stage-4 replica whose learning rate is too small to change a float32
# weight: its steps apply gradients and change nothing, so it must report
# itself frozen after 2 such steps. (A separate run: half of stage 4's
# samples going to a replica that does not learn would blur part 2's
# accuracy check. It does not average: a round with a's stage 4, which
# happens when training is slow, would move its weights.)
start_peer z 4 --lr 1e-12 --frozen-steps 2 --announce-every 2 --average-every 0
# z needs two optimizer steps of its own (2 x 128 samples): the replicas
# share stage 4 at random in proportion to their measured speed, so one run
# may leave z short of that on a loaded machine. Train until z says it is
# frozen (the event), at most 5 runs.
for run in 1 2 3 4 5; do
    timeout 300 "$S" train --initial-peers "$BS" --train-samples 2048 --test-samples 100 --json --timeout 5 \
        --metrics-log "" --plot "" >"$T/t3.out" 2>"$T/t3.err"
    rc=$?
    [ "$rc" -eq 0 ] || { fail "train (frozen replica, run $run) exited $rc"; show "$T/t3.err"; break; }
    grep -q 'block fmnist-mlp.4: weights have not moved in [0-9]* steps' "$T/z.err" && break
done
grep -q 'block fmnist-mlp.4: weights have not moved in [0-9]* steps' "$T/z.err" ||
    { fail "the frozen replica did not log it after $run runs"; show "$T/z.err"; }
# 4. The monitor shows both, from the announcements (every 2 s here).
id_of() { sed -n 's#.*address .*/\([0-9a-f]\{40\}\)$#\1#p' "$T/$1.out" | tail -1; }
ZID=$(id_of z)
RID=$(id_of r)
seen=0
for i in $(seq 1 60); do
    "$S" monitor --json --initial-peers "$BS" >"$T/mon.json" 2>"$T/mon.err"
    if grep -q "\"id\":\"$ZID\"[^}]*\"frozen_steps\":[1-9]" "$T/mon.json" &&
       grep -q "\"id\":\"$RID\"[^}]*\"grads_refused\":[1-9]" "$T/mon.json"; then
        seen=1
        break
    fi
    sleep 1
done
[ "$seen" = 1 ] || { fail "the monitor's JSON does not show the frozen and the refusing holder"; cat "$T/mon.json" >&2; }
"$S" monitor --initial-peers "$BS" >"$T/mon.txt" 2>&1
grep -q "FROZEN: peer $(echo "$ZID" | cut -c1-8)" "$T/mon.txt" || { fail "the monitor's text does not show FROZEN"; cat "$T/mon.txt" >&2; }
grep -q "peer $(echo "$RID" | cut -c1-8) refused [0-9]* gradient" "$T/mon.txt" || fail "the monitor's text does not show the refusals"
finish
