#!/bin/sh
# A poisoned donor (issue 18, 5b and 6): a participant announces weight
# version 10^9 for a stage and serves a CRC-valid state of zeros. Here the
# attacker is an ordinary peer restarted from a checkpoint edited to say
# version 1000000000 with every weight zero (the format's CRC recomputed).
# A newcomer to that stage must not take its word: it ignores the claim,
# far above the honest holder's, says so, and downloads the honest state;
# the monitor flags the attacker as suspect. Every wait is for an event,
# bounded.
. "$(dirname "$0")/swarm_lib.sh"
PY=${PYTHON:-python3}
start_bootstrap
start_peer a 0-5 --announce-every 1
"$S" train --initial-peers "$BS" --train-samples 1024 --test-samples 128 --metrics-log "" --plot "" \
    >"$T/train.out" 2>"$T/train.err" || { fail "training failed"; show "$T/train.err"; finish; }
# The honest holder's trained version must be announced (a claim of 0,
# initial weights, is no evidence against anyone).
A=$(sed -n 's#.*address .*/\([0-9a-f]\{40\}\)$#\1#p' "$T/a.out" | tail -1)
cat >"$T/version.py" <<'PYEOF'
import json, sys
m = json.load(open(sys.argv[1]))
for h in m["models"][0]["stages"][3]["holders"]:
    if h["id"] == sys.argv[2] and h["state"] == "online":
        print(h["weight_version"])
PYEOF
ok=0
for i in $(seq 1 60); do
    "$S" monitor --initial-peers "$BS" --model fmnist-mlp --json --timeout 5 >"$T/mon0.json" 2>/dev/null
    v=$("$PY" "$T/version.py" "$T/mon0.json" "$A" 2>/dev/null)
    [ -n "$v" ] && [ "$v" -gt 0 ] && { ok=1; break; }
    sleep 0.5
done
[ "$ok" = 1 ] || { fail "the honest holder never announced its trained version"; show "$T/mon0.json"; finish; }

# The attacker: a peer of stage 3 that writes its checkpoint when stopped...
start_peer x 3 --checkpoint-dir "$T/ckx"
stop_peer "$PID_x" 60 || fail "the attacker's first run did not stop cleanly"
CK=$(ls "$T/ckx"/*.ckpt 2>/dev/null | head -1)
[ -n "$CK" ] || { fail "no checkpoint written"; finish; }
# ...edited: version 10^9, every tensor zero, checksum recomputed.
"$PY" - "$CK" <<'PYEOF' || { fail "cannot edit the checkpoint"; finish; }
import struct, sys, zlib
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
fmt = struct.unpack_from("<I", b, 8)[0]
assert b[:8] == b"STRLCKPT" and fmt in (2, 4)
hdr = 260 if fmt == 4 else 200
struct.pack_into("<Q", b, 24, 10**9)
n = struct.unpack_from("<I", b, 60)[0]
for k in range(n):
    off, count = struct.unpack_from("<QQ", b, hdr + 48 * k + 32)
    b[off:off + 4 * count] = bytes(4 * count)
struct.pack_into("<I", b, len(b) - 4, zlib.crc32(bytes(b[:-4])) & 0xffffffff)
open(p, "wb").write(b)
PYEOF
start_peer x2 3 --checkpoint-dir "$T/ckx"
grep -q "restored fmnist-mlp.3 from its checkpoint (weight version 1000000000)" "$T/x2.err" ||
    { fail "the attacker did not restore the poisoned state"; show "$T/x2.err"; finish; }
X=$(sed -n 's#.*address .*/\([0-9a-f]\{40\}\)$#\1#p' "$T/x2.out" | tail -1)
X8=$(echo "$X" | cut -c1-8)

# The newcomer (other initial weights, so a download shows).
start_peer n 3 --seed 5
grep -q "fmnist-mlp.3: ignored holder $X8: it claims weight version 1000000000" "$T/n.err" ||
    { fail "the newcomer did not say it ignored the attacker's claim"; show "$T/n.err"; }
grep -q "fmnist-mlp.3: downloaded the current state (weight version 1000000000" "$T/n.err" &&
    fail "the newcomer took the poisoned state"
grep -qE "fmnist-mlp.3: downloaded the current state \(weight version [1-9][0-9]{0,5}, .* from an online holder" \
    "$T/n.err" || { fail "the newcomer did not download the honest state"; show "$T/n.err"; }

# The monitor flags the attacker, and only the attacker.
ok=0
for i in $(seq 1 60); do
    "$S" monitor --initial-peers "$BS" --model fmnist-mlp --json --timeout 5 >"$T/mon.json" 2>"$T/mon.err"
    grep -q "\"id\":\"$X\",[^}]*\"suspect\":\"version far above its replicas\"" "$T/mon.json" && { ok=1; break; }
    sleep 0.5
done
[ "$ok" = 1 ] || { fail "the monitor does not flag the attacker"; show "$T/mon.json"; }
n=$(grep -o '"suspect":"[^"]*"' "$T/mon.json" | wc -l)
[ "$n" -eq 1 ] || fail "the monitor flags $n holders, want 1"
"$S" monitor --initial-peers "$BS" --model fmnist-mlp --timeout 5 >"$T/mon.txt" 2>&1
grep -q "SUSPECT: peer $X8: version far above its replicas" "$T/mon.txt" ||
    { fail "the monitor's text does not flag the attacker"; show "$T/mon.txt"; }
finish
