#!/bin/sh
# Group averaging: three replicas of every stage, trained by two trainers at
# once, drift apart; every 3 s they find each other under the matchmaking
# key and run an all-reduce weighted by the samples each trained on. A
# fourth replica with initial weights and a 6 s period joins with weight 0.
# Once
# training stops, a round leaves all three with the same weights: each
# one's distance to the group average falls to ~0 (figures the peers compute
# from their real parameters) and a 3-path inference agrees on every input.
# Then a member is killed (-9): the survivors never end up with non-finite
# or torn weights, keep averaging as a group of two, and still answer well.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
FAST="--average-every 3 --announce-every 1 --announce-ttl 5"
start_peer a 0-5 $FAST
start_peer b 0-5 $FAST
start_peer c 0-5 $FAST
# Rounds run in groups of 3 while training (weights strictly between 0 and
# 1). Two trainers train at once; how many rounds fall inside one run
# depends on the machine's speed, so the test trains again (at most 6
# times) until such a round has been logged, rather than betting on one run.
weighted() {
    grep -qE 'averaged in a group of 3 .*our weight (0\.[0-9]*)?[1-9]' "$T/a.err" "$T/b.err" "$T/c.err"
}
for run in 1 2 3 4 5 6; do
    for n in 1 2; do
        "$S" train --initial-peers "$BS" --train-samples 3072 --test-samples 256 --seed $((run * 10 + n)) \
            --metrics-log "" --plot "" >"$T/t$n.out" 2>"$T/t$n.err" &
        eval "TR$n=$!"
        PIDS="$PIDS $!"
    done
    wait "$TR1" || { fail "trainer 1 failed"; show "$T/t1.err"; }
    wait "$TR2" || { fail "trainer 2 failed"; show "$T/t2.err"; }
    weighted && break
done
weighted || { fail "no weighted group round while training (6 runs)"; show "$T/a.err"; }
# The rounds are counted (completed and abandoned) and shown by the monitor;
# rounds do complete while training.
"$S" monitor --initial-peers "$BS" --model fmnist-mlp --json >"$T/mon0.json" 2>&1
"${PYTHON:-python3}" - "$T/mon0.json" <<'PYEOF' || fail "no averaging round completed, or the monitor does not count them"
import json, sys
m = json.load(open(sys.argv[1]))
done = ab = 0
for st in m["models"][0]["stages"]:
    for h in st["holders"]:
        done += h["avg_rounds"]; ab += h["avg_abandoned"]
print(f"averaging rounds: {done} completed, {ab} abandoned", file=sys.stderr)
assert done > 0, (done, ab)
PYEOF
# After training stops, a round leaves every replica of every block on the
# same weights: it moves each block from where it had drifted (distance to
# the group average d0 > 0) onto the average (d1 ~ 0: nothing trained during
# the round, so nothing is kept aside). Blocks average independently and a
# round can take several seconds on a loaded machine, so wait (bounded) until
# each peer has logged such a round for each of the six blocks.
for p in a b c; do eval "L_$p=\$(wc -l <\"\$T/\$p.err\")"; done
converged() {
    "${PYTHON:-python3}" - "$T" "$L_a" "$L_b" "$L_c" <<'PYEOF'
import re, sys
t, skip = sys.argv[1], dict(zip("abc", map(int, sys.argv[2:5])))
pat = re.compile(r"fmnist-mlp\.(\d): averaged in a group of 3 .*group average ([0-9.e+-]+) -> ([0-9.e+-]+)\)")
missing = []
for p in "abc":
    done = set()
    for line in open(f"{t}/{p}.err").readlines()[skip[p]:]:
        m = pat.search(line)
        if m and float(m.group(3)) <= 1e-6:
            done.add(int(m.group(1)))
    missing += [f"{p}:{b}" for b in range(6) if b not in done]
if missing:
    print("not yet on the average:", " ".join(missing))
    sys.exit(1)
PYEOF
}
ok=0
for i in $(seq 1 90); do
    converged >"$T/conv.txt" && { ok=1; break; }
    sleep 0.5
done
[ "$ok" = 1 ] || { fail "replicas did not all reach the group average after training"; show "$T/conv.txt" "$T/a.err" "$T/b.err" "$T/c.err"; }
grep -hE 'averaged in a group of 3' "$T/a.err" "$T/b.err" "$T/c.err" >"$T/rounds.txt"
"${PYTHON:-python3}" - "$T/rounds.txt" <<'PYEOF' || fail "no round took the replicas onto the group average"
import re, sys
rounds = [tuple(float(x) for x in re.search(r"group average ([0-9.e+-]+) -> ([0-9.e+-]+)", l).groups())
          for l in open(sys.argv[1])]
assert any(d0 > 1e-3 and d1 <= 1e-3 * d0 for d0, d1 in rounds), rounds
PYEOF
"$S" infer --initial-peers "$BS" --data test --samples 300 --replicas 3 --json >"$T/inf3.json" 2>"$T/inf3.err"
[ $? -eq 0 ] || { fail "3-path infer failed"; show "$T/inf3.err"; }
u=$(json_field "$T/inf3.json" unanimous)
awk "BEGIN { exit !($u >= 0.999) }" || fail "replicas disagree after averaging (unanimous $u)"
"$S" monitor --initial-peers "$BS" --model fmnist-mlp --json >"$T/mon.json" 2>&1
grep -q '"avg_rounds":[1-9]' "$T/mon.json" || fail "the monitor shows no averaging rounds"
grep -q '"avg_group":3' "$T/mon.json" || fail "the monitor shows no group of 3"
# A replica with initial weights (no state download) and another period
# joins the trained group: it says how often the periods meet, averages at
# their common multiples with weight 0 (it takes the group's average and
# does not pull the trained replicas toward its random weights).
start_peer d 0-5 --average-every 6 --announce-every 1 --announce-ttl 5 --no-state-download
# (Its first round may find only some of the trained replicas free, under
# load: any group counts; once it has averaged it is no longer fresh.)
wait_for "$T/d.err" 'averaged in a group of [0-9]+ .*our weight 0,' 60 || \
    { fail "the fresh replica never averaged with weight 0"; show "$T/d.err" "$T/a.err"; }
grep -q 'a replica averages every 3.0 s, this peer every 6.0 s: they average together only every 6 s' "$T/d.err" || \
    fail "the period mismatch was not reported"
# The trained replicas' rounds with it (a group of 4, at the periods'
# common multiples; the fresh replica's first round may have been a smaller
# group) give them positive weights. Wait (bounded) for one.
g4=0
for i in $(seq 1 900); do
    grep -hE 'averaged in a group of 4' "$T/a.err" "$T/b.err" "$T/c.err" >"$T/g4.txt" 2>/dev/null && { g4=1; break; }
    sleep 0.1
done
if [ "$g4" = 0 ]; then
    fail "no trained replica averaged in a group of 4 with the fresh one"; show "$T/a.err" "$T/d.err"
elif grep -vqE 'our weight (0\.[0-9]*)?[1-9]' "$T/g4.txt"; then
    fail "a trained replica's weight in a group of 4 is not positive"; show "$T/g4.txt"
fi
kill -TERM "$PID_d"
wait "$PID_d"
# Kill one member; the survivors' next rounds are abandoned or run as a
# pair, never leaving them torn.
kill -9 "$PID_c"
wait_for "$T/a.err" 'averaged in a group of 2' 30 || \
    { fail "survivors never averaged as a pair"; show "$T/a.err" "$T/b.err"; }
"$S" infer --initial-peers "$BS" --data test --samples 500 --json >"$T/after.json" 2>"$T/after.err"
[ $? -eq 0 ] || { fail "infer through the survivors failed"; show "$T/after.err" "$T/a.err"; }
acc=$(json_field "$T/after.json" accuracy)
awk "BEGIN { exit !($acc > 0.3) }" || { fail "survivors' accuracy $acc after the kill"; show "$T/after.err" "$T/a.err" "$T/b.err"; }
grep -q "ERANGE\|non-finite\|Numerical result" "$T/a.err" "$T/b.err" && fail "a survivor produced non-finite weights"
finish
