#!/bin/sh
# A fake holder (issue 18, attack 6): an attacker stores its own signed
# announcement for stage fmnist-mlp.3, throughput 10^9 samples/s, at an
# address that accepts TCP connections but never answers (a listening
# socket nobody accepts from: the secure handshake never completes). It
# needs no peer: `starling dht put --value-hex` with its own identity and
# the msgpack value of tests/fake_announce.c. Two honest holders serve the
# stage. A trainer must still train (exit 0, every sample exactly once,
# the usual accuracy) with few retries, having tried the fake holder and
# said so; the monitor must flag the fake holder, and only it, as suspect.
# Every wait is for an event, bounded.
. "$(dirname "$0")/swarm_lib.sh"
FA=${FAKE_ANNOUNCE:?FAKE_ANNOUNCE must point at tests/fake_announce}
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || { echo "no python3: skipped"; exit 77; }
start_bootstrap
start_peer a 0-5
start_peer c 3

# The black hole: listens (the kernel completes TCP handshakes into the
# backlog) and never accepts, reads or answers. Prints its port.
"$PY" -c '
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(128)
print(s.getsockname()[1], flush=True)
time.sleep(600)
' >"$T/hole.out" 2>"$T/hole.err" &
PIDS="$PIDS $!"
wait_for "$T/hole.out" '^[0-9]+$' 30 || { fail "the black hole did not start"; show "$T/hole.err"; finish; }
HOLE=127.0.0.1:$(head -1 "$T/hole.out")

# The attacker's identity and signed announcement.
"$S" keygen --out "$T/x.key" >"$T/x.id" 2>"$T/keygen.err" || { fail "keygen"; show "$T/keygen.err"; finish; }
X=$(grep -o '[0-9a-f]\{40\}' "$T/x.id" | head -1)
X8=$(echo "$X" | cut -c1-8)
[ -n "$X" ] || { fail "no node ID from keygen"; show "$T/x.id"; finish; }
HEX=$("$FA" fmnist-mlp 3 "$HOLE" 1e9 2>"$T/fa.err") || { fail "fake_announce"; show "$T/fa.err"; finish; }
"$S" dht put fmnist-mlp.3 "$HEX" --value-hex --identity "$T/x.key" --ttl 900 --initial-peers "$BS" \
    >"$T/put.out" 2>"$T/put.err" || { fail "the attacker's put failed"; show "$T/put.err"; finish; }

# The monitor lists the fake holder online on stage 3 and flags it.
ok=0
for i in $(seq 1 60); do
    "$S" monitor --initial-peers "$BS" --model fmnist-mlp --json --timeout 5 >"$T/mon.json" 2>"$T/mon.err"
    grep -q "\"id\":\"$X\",\"addr\":\"$HOLE\",\"state\":\"online\"" "$T/mon.json" && { ok=1; break; }
    sleep 0.5
done
[ "$ok" = 1 ] || { fail "the fake holder never showed in the monitor"; show "$T/mon.json" "$T/mon.err"; finish; }
grep -q "\"id\":\"$X\",[^}]*\"suspect\":\"throughput far above its replicas\"" "$T/mon.json" ||
    { fail "the monitor does not flag the fake holder"; show "$T/mon.json"; }
n=$(grep -o '"suspect":"[^"]*"' "$T/mon.json" | wc -l)
[ "$n" -eq 1 ] || fail "the monitor flags $n holders, want 1"
"$S" monitor --initial-peers "$BS" --model fmnist-mlp --timeout 5 >"$T/mon.txt" 2>&1
grep -q "SUSPECT: peer $X8: throughput far above its replicas" "$T/mon.txt" ||
    { fail "the monitor's text does not flag the fake holder"; show "$T/mon.txt"; }

# Training through the swarm with the fake holder in it. --timeout 1 bounds
# each handshake with the black hole (the honest calls take milliseconds).
N=6000
timeout 300 "$S" train --initial-peers "$BS" --train-samples $N --test-samples 1000 --json --timeout 1 \
    --metrics-log "$T/train.jsonl" --plot "" >"$T/train.out" 2>"$T/train.err"
rc=$?
[ "$rc" -eq 0 ] || { fail "train exited $rc"; show "$T/train.err"; }
cat "$T/train.out"
acc=$(json_field "$T/train.out" test_acc)
samples=$(json_field "$T/train.out" samples)
retries=$(json_field "$T/train.out" retries)
tries=$(grep -c "cannot connect to holder $X8" "$T/train.err")
echo "test_acc=$acc samples=$samples retries=$retries connection attempts to the fake holder=$tries"
[ "$samples" = "$N" ] || fail "processed $samples samples, want exactly $N"
awk "BEGIN { exit !(${acc:-0} >= 0.55) }" || fail "test accuracy $acc below 0.55"
# The trainer tried the fake holder, found it did not answer, and said so...
[ "$tries" -ge 1 ] || { fail "the trainer never tried the fake holder"; show "$T/train.err"; }
# ...but it got almost no calls: about 94 micro-batches x 12 calls + 16 x 6
# for the evaluation here; a trainer that believed the 10^9 claim would
# park most of stage 3's calls on it and re-send them.
[ -n "$retries" ] && [ "$retries" -le 30 ] || fail "retries=$retries, want <= 30 of about 1,200 calls"
grep -q '"event":"end","status":"ok"' "$T/train.jsonl" || fail "no end line with status ok in the metrics log"
finish
