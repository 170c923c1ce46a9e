#!/bin/sh
# Replica averaging: two replicas of every stage, trained by two trainers at
# once, drift apart; they average every 2 s, weighted by the samples each
# trained on, so after an exchange a replica's distance to the other is its
# own weight times the old distance (checked on the figures the peer
# computes from the real parameters). The monitor counts the exchanges.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
start_peer a 0-5 --average-every 2 --announce-every 1 --announce-ttl 5
start_peer b 0-5 --average-every 2 --announce-every 1 --announce-ttl 5
for n in 1 2; do
    "$S" train --initial-peers "$BS" --train-samples 4096 --test-samples 256 --seed $n \
        --metrics-log "" --plot "" >"$T/t$n.out" 2>"$T/t$n.err" &
    eval "TR$n=$!"
    PIDS="$PIDS $!"
done
wait "$TR1" || { fail "trainer 1 failed"; show "$T/t1.err"; }
wait "$TR2" || { fail "trainer 2 failed"; show "$T/t2.err"; }
# An exchange in which both sides had trained (our weight strictly between 0 and 1).
wait_for "$T/a.err" 'our weight 0\.[0-9]*[1-9][0-9]*; distance [0-9.e+-]*[1-9]' 30 || \
    wait_for "$T/b.err" 'our weight 0\.[0-9]*[1-9][0-9]*; distance [0-9.e+-]*[1-9]' 10 || \
    { fail "no weighted averaging exchange"; show "$T/a.err" "$T/b.err"; }
line=$(grep -hE 'our weight 0\.[0-9]*[1-9][0-9]*; distance [0-9.e+-]*[1-9]' "$T/a.err" "$T/b.err" | head -1)
echo "$line"
"${PYTHON:-python3}" - "$line" <<'PYEOF' || fail "distance did not fall by the expected factor"
import re, sys
m = re.search(r"our weight ([0-9.]+); distance ([0-9.e+-]+) -> ([0-9.e+-]+)", sys.argv[1])
w, d0, d1 = (float(x) for x in m.groups())
assert 0 < w < 1 and d0 > 0, (w, d0)
# new = w*ours + (1-w)*theirs, so |new - theirs| = w * |ours - theirs|
# (w is printed with 2 decimals)
assert abs(d1 - w * d0) <= 0.006 * d0, (w, d0, d1)
PYEOF
"$S" monitor --initial-peers "$BS" --model fmnist-mlp --json >"$T/mon.json" 2>&1
grep -q '"avg_rounds":[1-9]' "$T/mon.json" || fail "the monitor shows no averaging exchange"
# Kill one replica (-9) while the other keeps averaging every 2 s: the
# survivor's rounds fail or finish, never leaving it torn, and it still
# answers sensibly on its own.
kill -9 "$PID_b"
sleep 5
"$S" infer --initial-peers "$BS" --data test --samples 500 --json >"$T/after.json" 2>"$T/after.err"
[ $? -eq 0 ] || { fail "infer through the survivor failed"; show "$T/after.err" "$T/a.err"; }
acc=$(json_field "$T/after.json" accuracy)
awk "BEGIN { exit !($acc > 0.3) }" || fail "survivor accuracy $acc after the kill"
grep -q "averaging skipped: ERANGE\|non-finite" "$T/a.err" && fail "survivor produced non-finite weights"
finish
