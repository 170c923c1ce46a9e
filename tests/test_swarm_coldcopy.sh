#!/bin/sh
# Cold copies: the sole holder of stages 3-5 dies (kill -9) before it ever
# wrote a checkpoint. Peer a, which serves 0-2, keeps cold copies of 3-5
# (and b of 0-2). The restarted holder (same identity and address) resumes
# from a's copies at the version it had when it died, not from its initial
# weights. Then both the holder and the keeper are gone: the restarted
# holder has nothing to resume from, and says so (STATE LOST), and so does
# the monitor. Every wait is for an event, bounded.
. "$(dirname "$0")/swarm_lib.sh"
PY=${PYTHON:-python3}
start_bootstrap
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$S" keygen --out "$T/b.key" >/dev/null 2>"$T/keygen.err" || { show "$T/keygen.err"; fail "keygen"; finish; }
FAST="--keep-every 1 --announce-every 1"
B_ARGS="$FAST --identity $T/b.key --listen 127.0.0.1:$PORT --checkpoint-dir $T/ckb"
start_peer a 0-2 $FAST
start_peer b 3-5 $B_ARGS
"$S" train --initial-peers "$BS" --train-samples 1536 --test-samples 128 --metrics-log "" --plot "" \
    >"$T/t1.out" 2>"$T/t1.err" || { fail "training failed"; show "$T/t1.err"; }
ls "$T/ckb"/*.ckpt >/dev/null 2>&1 && fail "b wrote a checkpoint before the kill (the test needs none)"

# versions.py MON: prints "ok" when every stage 3-5 has a cold copy at its
# holder's version (> 0), and the versions as "3:V 4:V 5:V".
cat >"$T/versions.py" <<'PYEOF'
import json, sys
m = json.load(open(sys.argv[1]))
st = m["models"][0]["stages"]
ok, out = True, []
for s in st[3:6]:
    v = max([h["weight_version"] for h in s["holders"] if h["state"] == "online"] or [0])
    ok &= v > 0 and s["cold_copies"] >= 1 and s["cold_version"] == v
    out.append(f"{s['index']}:{v}")
print(("ok " if ok else "waiting ") + " ".join(out))
PYEOF
# The holders may still apply queued updates after the trainer exits (on a
# loaded machine, for a while): wait until the copies match the same
# versions in three lookups in a row, at least 2 s apart in all.
ok=0 same=0 last=""
for i in $(seq 1 240); do
    "$S" monitor --initial-peers "$BS" --model fmnist-mlp --json --timeout 5 >"$T/mon.json" 2>"$T/mon.err"
    if "$PY" "$T/versions.py" "$T/mon.json" >"$T/ver.txt" 2>&1 && grep -q '^ok' "$T/ver.txt"; then
        [ "$(cat "$T/ver.txt")" = "$last" ] && same=$((same + 1)) || same=0
        last=$(cat "$T/ver.txt")
        [ "$same" -ge 2 ] && { ok=1; break; }
    fi
    sleep 1
done
[ "$ok" = 1 ] || { fail "a never held copies of 3-5 at b's versions"; show "$T/ver.txt" "$T/a.err"; finish; }
VERS=$(cut -d' ' -f2- "$T/ver.txt")
grep -q 'fmnist-mlp.0: keeping a cold copy' "$T/b.err" || fail "b keeps no copy of a's stages"

kill -9 "$PID_b"
wait "$PID_b" 2>/dev/null
start_peer b2 3-5 $B_ARGS
for st in 3 4 5; do
    want=$(echo "$VERS" | tr ' ' '\n' | sed -n "s/^$st://p")
    grep -q "fmnist-mlp.$st: downloaded the current state (weight version $want, .*) from a cold copy kept by" \
        "$T/b2.err" || { fail "stage $st did not resume from the cold copy at version $want"; show "$T/b2.err"; }
done
# The holder may have applied one more queued update after the copies were
# last refreshed; then (and only then) it says so, naming what it lost.
if grep -q 'STATE LOST' "$T/b2.err"; then
    grep 'STATE LOST' "$T/b2.err" | while read -r line; do
        st=$(echo "$line" | sed -n 's/.*fmnist-mlp\.\([0-9]\): STATE LOST.*/\1/p')
        a=$(echo "$line" | sed -n 's/.*weight version \([0-9]*\) existed.*/\1/p')
        b=$(echo "$line" | sed -n 's/.*serves version \([0-9]*\) .*/\1/p')
        want=$(echo "$VERS" | tr ' ' '\n' | sed -n "s/^$st://p")
        [ -n "$a" ] && [ "$b" = "$want" ] && [ "$a" -gt "$b" ] || echo bad
    done | grep -q bad && { fail "an inconsistent STATE LOST report"; show "$T/b2.err"; }
fi

# Keeper and holder both gone: nothing left to resume from.
kill -9 "$PID_b2"
wait "$PID_b2" 2>/dev/null
kill -TERM "$PID_a"
wait "$PID_a" 2>/dev/null
start_peer b3 3-5 $B_ARGS
grep -qE 'fmnist-mlp\.3: STATE LOST: weight version [1-9][0-9]* existed, this peer serves version 0' "$T/b3.err" || \
    { fail "the lost state was not reported"; show "$T/b3.err"; }
ok=0
for i in $(seq 1 60); do
    "$S" monitor --initial-peers "$BS" --model fmnist-mlp --json --timeout 5 >"$T/mon2.json" 2>/dev/null
    grep -qE '"state_lost":\{"from":[1-9][0-9]*,"to":0\}' "$T/mon2.json" && { ok=1; break; }
    sleep 0.5
done
[ "$ok" = 1 ] || { fail "the monitor does not show the lost state"; show "$T/mon2.json"; }
"$S" monitor --initial-peers "$BS" --model fmnist-mlp --timeout 5 >"$T/mon2.txt" 2>&1
grep -q 'STATE LOST: peer' "$T/mon2.txt" || { fail "the monitor's text does not show the lost state"; show "$T/mon2.txt"; }
finish
