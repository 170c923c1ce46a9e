#!/bin/sh
# A peer joining mid-training: started without --blocks it picks the least
# served span (stages 3-5: the swarm has one holder there, two for 0-2),
# downloads their current state before it serves, takes a share of the
# training traffic, and the trainer's loss shows no jump when it joins (a
# newcomer serving its own random initial weights would send the loss back
# towards ln 10 = 2.3).
#
# The trainer has a fixed length, and how much of it is left when the
# newcomer comes online depends on the machine. A run in which training
# went on for less than 20 s after that proves nothing either way about the
# traffic and the loss after the join: it is repeated on a fresh swarm with
# a longer trainer (at most 3 runs). Every other check counts at once.
. "$(dirname "$0")/swarm_lib.sh"
PY=${PYTHON:-python3}

cat >"$T/check.py" <<'PYEOF'
import json, re, sys, urllib.request

def stage4_versions(path):
    mon = json.loads(open(path).read().strip().splitlines()[-1])
    stages = mon["models"][0]["stages"]
    return [h["weight_version"] for s in stages if s["index"] == 4 for h in s["holders"]]

if sys.argv[1] == "versions":
    # The newcomer served training traffic: its stage 4 took optimizer steps
    # beyond the version it downloaded (and so did the other holder's).
    vs, v0 = stage4_versions(sys.argv[2]), int(sys.argv[3])
    ok = len(vs) == 2 and max(vs) > v0 and min(vs) > v0
    print("stage 4 holders' weight versions %s, downloaded %d" % (vs, v0))
    sys.exit(0 if ok else 1)

# check MON METRICS JOIN_S V0 PORT: JOIN_S is when the newcomer went online,
# on the trainer's elapsed_s clock; PORT its metrics port. Exit 0 pass, 1
# fail, 3 inconclusive.
mon, metrics, join, v0 = sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
vs = stage4_versions(mon)
# A newer version alone could also come from an averaging round with the
# other holder: the newcomer's own optimizer steps on stage 4 tell.
body = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[6], timeout=60).read().decode()
m = re.search(r'^starling_steps_total\{block="fmnist-mlp.4"\} (\S+)$', body, re.M)
steps = float(m.group(1)) if m else 0
traffic = len(vs) == 2 and max(vs) > v0 and min(vs) > v0 and steps >= 1
pts = [json.loads(l) for l in open(metrics) if '"step"' in l]
end = pts[-1]["elapsed_s"] if pts else 0.0
# The trainer looks holders up every 2 s (--refresh), so the newcomer gets
# traffic within a few seconds of going online: compare the loss (a moving
# average over ~10 batches) in the 6 s after it joined with the 3 s before
# (each window at least 3 points: a slow trainer logs less often).
before = [p["loss"] for p in pts if join - 3 <= p["elapsed_s"] <= join]
if len(before) < 3:
    before = [p["loss"] for p in pts if p["elapsed_s"] <= join][-3:]
after = [p["loss"] for p in pts if join <= p["elapsed_s"] <= join + 6]
if len(after) < 3:
    after = [p["loss"] for p in pts if p["elapsed_s"] >= join][:3]
mb = sum(before) / max(len(before), 1)
# The peak of the loss after the join, as a mean of 3 consecutive points: one
# noisy point alone (a CPU hog beside the test) does not make a jump.
peak = max([sum(after[i:i + 3]) / 3 for i in range(len(after) - 2)] or [0])
print("join at %.1f s, training until %.1f s; loss before %.3f (%d points), after: peak %.3f, max %.3f "
      "(%d points); stage 4 versions %s, downloaded %d, newcomer's steps %d" %
      (join, end, mb, len(before), peak, max(after or [0]), len(after), vs, v0, steps))
enough = len(before) >= 3 and len(after) >= 3
# (measured, peak / before: 0.93-1.06 with the download, also beside a CPU
# hog, where the single largest point reached 1.185 once; 1.30-1.60 when the
# newcomer serves its own initial weights, --no-state-download)
if enough and peak > 1.18 * mb:
    print("the loss jumped when the newcomer joined")
    sys.exit(1)
if enough and traffic:
    sys.exit(0)
if end - join < 20:
    print("inconclusive: training ended %.1f s after the newcomer went online" % (end - join))
    sys.exit(3)
print("the newcomer took no traffic" if enough else "too few loss points around the join")
sys.exit(1)
PYEOF

# attempt K SAMPLES: one run on a fresh swarm; sets verdict (0 pass, 1 fail,
# 3 inconclusive).
attempt() {
    k=$1
    verdict=1
    start_bootstrap
    start_peer "a$k" 0-5 --announce-every 1 --announce-ttl 5
    start_peer "b$k" 0-2 --announce-every 1 --announce-ttl 5
    "$S" train --initial-peers "$BS" --train-samples "$2" --test-samples 500 --seed 3 --refresh 2 \
        --metrics-log "$T/m$k.jsonl" --plot "" >"$T/t$k.out" 2>"$T/t$k.err" &
    TR=$!
    PIDS="$PIDS $TR"
    # The zero of the trainer's elapsed_s clock: its training starts right
    # after this line (data loading and joining come before).
    wait_for "$T/t$k.err" 'training samples x' 300 "$TR" || { fail "training did not start"; show "$T/t$k.err"; return; }
    t0=$(date +%s.%N)
    wait_for "$T/m$k.jsonl" '"samples":[1-9][0-9]{4},' 600 "$TR" || { fail "training did not progress"; show "$T/t$k.err"; return; }
    : >"$T/c$k.out"; : >"$T/c$k.err"
    "$S" peer --initial-peers "$BS" --num-blocks 3 --announce-every 1 --announce-ttl 5 --seed 99 \
        --metrics 127.0.0.1:0 >"$T/c$k.out" 2>"$T/c$k.err" &
    PIDS="$PIDS $!"
    wait_for "$T/c$k.err" 'online: announcing' 120 || { fail "newcomer never went online"; show "$T/c$k.err"; return; }
    t1=$(date +%s.%N)
    grep -q "chose stages 3-5, the least served span" "$T/c$k.err" || { fail "newcomer did not pick stages 3-5"; show "$T/c$k.err"; return; }
    n=$(grep -c "downloaded the current state (weight version [1-9]" "$T/c$k.err")
    [ "$n" -eq 3 ] || { fail "newcomer downloaded $n of 3 trained stages"; show "$T/c$k.err"; return; }
    wait "$TR" || { fail "training failed"; show "$T/t$k.err"; return; }
    v0=$(sed -n 's/.*fmnist-mlp.4: downloaded the current state (weight version \([0-9]*\).*/\1/p' "$T/c$k.err")
    # The holders announce every second: wait (bounded) until the monitor
    # shows their last versions.
    end=$(( $(date +%s) + 30 ))
    while :; do
        "$S" monitor --initial-peers "$BS" --model fmnist-mlp --json >"$T/mon$k.json" 2>"$T/mon$k.err"
        "$PY" "$T/check.py" versions "$T/mon$k.json" "$v0" >/dev/null 2>&1 && break
        [ "$(date +%s)" -lt "$end" ] || break
        sleep 0.5
    done
    join=$(awk "BEGIN { print $t1 - $t0 }")
    mport=$(sed -n 's#.*metrics on http://127.0.0.1:\([0-9]*\)/metrics#\1#p' "$T/c$k.err")
    "$PY" "$T/check.py" check "$T/mon$k.json" "$T/m$k.jsonl" "$join" "$v0" "$mport"
    verdict=$?
}

samples=30000
for k in 1 2 3; do
    echo "run $k: $samples training samples"
    attempt "$k" "$samples"
    [ "$verdict" -eq 3 ] || break
    # Inconclusive: the next run on a fresh swarm, with a longer trainer.
    for p in $PIDS; do kill "$p" 2>/dev/null; done
    samples=60000
done
case $verdict in
0) ;;
3) fail "no traffic to the newcomer or too few loss points, and in all 3 runs training ended < 20 s after it joined" ;;
*) [ "$fails" -gt 0 ] || fail "loss jumped or the newcomer took no traffic" ;;
esac
finish
