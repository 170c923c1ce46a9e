#!/bin/sh
# DiLoCo averaging (--average-mode diloco) among real peers: two replicas
# of every stage average their pseudo-gradients every 3 s while a trainer
# trains through them, with positive weights; a third replica in mean mode
# beside them never joins their group (nor finds one of its own). The
# diloco pair sends its slices in 8-bit (--average-format q8, with error
# feedback): the round lines and replica a's metrics count q8 bytes. The
# model still answers well afterwards and no weight goes non-finite.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
FAST="--average-every 3 --announce-every 1 --announce-ttl 5"
start_peer a 0-5 $FAST --average-mode diloco --average-format q8 --metrics 127.0.0.1:0
start_peer b 0-5 $FAST --average-mode diloco --average-format q8
start_peer m 0-5 $FAST
# How many rounds fall inside one training run depends on the machine:
# train again (at most 4 times) until both diloco replicas have logged a
# round with a positive weight, rather than betting on one run.
diloco_round() {
    grep -qE 'averaged in a group of 2 \(diloco, round [0-9]+, our weight (0\.[0-9]*)?[1-9]' "$T/$1.err"
}
for run in 1 2 3 4; do
    "$S" train --initial-peers "$BS" --train-samples 3072 --test-samples 256 --seed "$run" \
        --metrics-log "" --plot "" >"$T/t.out" 2>"$T/t.err" &
    TR=$!
    PIDS="$PIDS $TR"
    wait "$TR" || { fail "trainer failed"; show "$T/t.err"; }
    diloco_round a && diloco_round b && break
done
diloco_round a || { fail "replica a never averaged (diloco) with a positive weight"; show "$T/a.err"; }
diloco_round b || { fail "replica b never averaged (diloco) with a positive weight"; show "$T/b.err"; }
# The modes never mix: no group of 3, and the mean replica, alone in its
# mode, never averages.
grep -q 'averaged in a group of 3' "$T/a.err" "$T/b.err" "$T/m.err" && fail "a mean and diloco replicas formed a group"
grep -q 'averaged in a group' "$T/m.err" && { fail "the mean replica averaged with someone"; show "$T/m.err"; }
grep -q "ERANGE\|non-finite\|Numerical result" "$T/a.err" "$T/b.err" && fail "a diloco replica produced non-finite weights"
grep -q 'q8:64 slices' "$T/a.err" || { fail "replica a's rounds do not say q8 slices"; show "$T/a.err"; }
mport=$(sed -n 's#.*metrics on http://127.0.0.1:\([0-9]*\)/metrics#\1#p' "$T/a.err")
if PY=$(command -v python3); then
    "$PY" - "$mport" <<'PYEOF' || fail "replica a's metrics do not count averaging bytes"
import re, sys, urllib.request
body = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=60).read().decode()
got = [float(v) for v in re.findall(r'^starling_avg_bytes_total\{block="fmnist-mlp\.\d",direction="received"\} (\S+)$', body, re.M)]
assert len(got) == 6 and sum(got) > 0, got
print("replica a: averaging bytes received", int(sum(got)))
PYEOF
fi
"$S" infer --initial-peers "$BS" --data test --samples 500 --json >"$T/inf.json" 2>"$T/inf.err"
[ $? -eq 0 ] || { fail "infer failed"; show "$T/inf.err"; }
acc=$(json_field "$T/inf.json" accuracy)
awk "BEGIN { exit !($acc > 0.3) }" || { fail "accuracy $acc after diloco rounds"; show "$T/inf.err" "$T/a.err"; }
echo "diloco swarm: accuracy $acc; rounds: a $(grep -c '(diloco' "$T/a.err"), b $(grep -c '(diloco' "$T/b.err")" >&2
finish
