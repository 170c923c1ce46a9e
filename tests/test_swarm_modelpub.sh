#!/bin/sh
# The model travels with the swarm (swarm/modeldesc.h). Peer A serves stages
# 0 and 2 of a model file's model (micro-lm) and publishes its description;
# peer B starts with `--model micro-lm` alone, fetches the description from
# the DHT (and says so) and serves stage 1; a monitor given only the name
# fetches it too and sees both peers online on every stage with the same
# stage hashes (none of another model version), and a trainer given only
# the name trains 2 steps through them. Then a forger with its own
# identity publishes, with `starling dht put` and tests/fake_modeldesc.c, a
# models index entry for "forged-lm" whose chunks do not hash to its "d",
# and one for "renamed-lm" whose chunks are a valid description of another
# model: `starling peer --model forged-lm` / `--model renamed-lm` refuse
# with a sentence and exit 1. A name nobody publishes is an unknown model.
# A third identity's valid but different description of micro-lm makes the
# name ambiguous: refused, naming both; --model-file still works.
# Every wait is for an event, bounded.
. "$(dirname "$0")/swarm_lib.sh"
FM=${FAKE_MODELDESC:?FAKE_MODELDESC must point at tests/fake_modeldesc}
# A long description, so that the canonical JSON takes two chunks.
LONG=$(awk 'BEGIN { s = "test: byte GPT, d 64, 2 layers, 4 heads, context 32."; while (length(s) < 900) s = s " The model travels with the swarm."; print s }')
# tests/ref/micro-lm.json (the model swarm_lm trains) with that description.
sed "s|\"description\": \"[^\"]*\"|\"description\": \"$LONG\"|" "$(dirname "$0")/ref/micro-lm.json" >"$T/micro-lm.json"
H=$("$FM" hash "$T/micro-lm.json") || { fail "fake_modeldesc hash"; finish; }
H8=$(echo "$H" | cut -c1-8)

# start_named NAME BLOCKS MONITOR_FLAGS -- PEER_FLAGS...: a peer, online and
# visible to a monitor run with MONITOR_FLAGS.
start_named() {
    sn_name=$1; sn_blocks=$2; sn_mon=$3; shift 4
    : >"$T/$sn_name.out"; : >"$T/$sn_name.err"
    "$S" peer --initial-peers "$BS" --blocks "$sn_blocks" "$@" >"$T/$sn_name.out" 2>"$T/$sn_name.err" &
    sn_pid=$!
    PIDS="$PIDS $sn_pid"
    wait_for "$T/$sn_name.err" 'online: announcing' 120 "$sn_pid" ||
        { show "$T/$sn_name.out" "$T/$sn_name.err"; echo "peer $sn_name did not come online" >&2; exit 1; }
    # shellcheck disable=SC2086
    wait_announced "$sn_name" 120 --initial-peers "$BS" $sn_mon ||
        { show "$T/$sn_name.err" "$T/$sn_name.ann" "$T/$sn_name.ann.err"; echo "peer $sn_name's announcements never became visible" >&2; exit 1; }
}

start_bootstrap
start_named a 0,2 "--model-file $T/micro-lm.json" -- --model-file "$T/micro-lm.json"
# B knows the name only. A's description may be stored a moment after its
# announcements: B is given a few tries (each one ends by itself).
ok=0
for i in $(seq 1 20); do
    "$S" monitor --initial-peers "$BS" --model micro-lm --timeout 5 >"$T/pre.txt" 2>&1
    grep -q "fetched from the swarm" "$T/pre.txt" && { ok=1; break; }
    sleep 0.5
done
[ "$ok" = 1 ] || { fail "the description of micro-lm never became visible"; show "$T/pre.txt" "$T/a.err"; finish; }
start_named b 1 "--model micro-lm" -- --model micro-lm
grep -q "model micro-lm: description $H8 fetched from the swarm ([0-9]* bytes, 3 stages)" "$T/b.err" ||
    { fail "peer b does not say it fetched micro-lm's description $H8"; show "$T/b.err"; }
bytes=$(sed -n 's/.*fetched from the swarm (\([0-9]*\) bytes.*/\1/p' "$T/b.err" | head -1)
[ "${bytes:-0}" -gt 700 ] || fail "the description ($bytes bytes) does not span two chunks"
grep -q "serving micro-lm stages" "$T/b.out" || { fail "peer b does not serve micro-lm"; show "$T/b.out"; }

# A monitor that knows only the name: both peers online, every stage
# covered, nobody on another version of a stage.
"$S" monitor --initial-peers "$BS" --model micro-lm --json --timeout 10 >"$T/mon.json" 2>"$T/mon.err"
rc=$?
[ "$rc" -eq 0 ] || { fail "monitor --model micro-lm exited $rc (not every stage covered?)"; show "$T/mon.json" "$T/mon.err"; }
grep -q "model micro-lm: description $H8 fetched from the swarm" "$T/mon.err" ||
    { fail "the monitor does not say it fetched the description"; show "$T/mon.err"; }
for p in a b; do
    id=$(sed -n 's#.*address .*/\([0-9a-f]\{40\}\)$#\1#p' "$T/$p.out" | tail -1)
    grep -q "\"id\":\"$id\",\"addr\":\"[^\"]*\",\"state\":\"online\"" "$T/mon.json" ||
        { fail "the monitor does not show peer $p online"; show "$T/mon.json"; }
done
grep -q '"wrong_version_holders":[1-9]' "$T/mon.json" && { fail "a holder runs another version of a stage"; show "$T/mon.json"; }
grep -q '"covered":false' "$T/mon.json" && { fail "a stage is not covered"; show "$T/mon.json"; }
# The same view from the file: B's stage hash is the file's.
"$S" monitor --initial-peers "$BS" --model-file "$T/micro-lm.json" --json --timeout 10 >"$T/mon2.json" 2>"$T/mon2.err" ||
    { fail "monitor --model-file does not see every stage covered"; show "$T/mon2.json" "$T/mon2.err"; }
grep -q '"wrong_version_holders":[1-9]' "$T/mon2.json" && fail "with the file, a holder runs another version"

# A trainer that knows only the name trains through both peers.
cat "$(dirname "$0")"/../docs/*.md >"$T/corpus.txt"
timeout 200 "$S" train --initial-peers "$BS" --model micro-lm --data "$T/corpus.txt" --steps 2 --eval-every 2 \
    --eval-batches 1 --json --metrics-log "$T/train.jsonl" --plot "" >"$T/train.out" 2>"$T/train.err"
rc=$?
[ "$rc" -eq 0 ] || { fail "train --model micro-lm exited $rc"; show "$T/train.err"; }
grep -q "model micro-lm: description $H8 fetched from the swarm" "$T/train.err" ||
    { fail "the trainer does not say it fetched the description"; show "$T/train.err"; }
[ "$(json_field "$T/train.out" steps)" = 2 ] || { fail "the trainer did not run 2 steps"; show "$T/train.out"; }

# The forgers: two identities, since one identity has one entry in the
# models index.
for x in x y; do
    "$S" keygen --out "$T/$x.key" >"$T/$x.id" 2>"$T/keygen.err" || { fail "keygen"; show "$T/keygen.err"; finish; }
done
X8=$(grep -o '[0-9a-f]\{40\}' "$T/x.id" | head -1 | cut -c1-8)
Y8=$(grep -o '[0-9a-f]\{40\}' "$T/y.id" | head -1 | cut -c1-8)
sed 's/"micro-lm"/"forged-lm"/' "$T/micro-lm.json" >"$T/forged.json"
sed 's/"micro-lm"/"forged-lm"/; s/"dim": 64/"dim": 128/g' "$T/micro-lm.json" >"$T/forged-other.json"
sed 's/"micro-lm"/"other-lm"/' "$T/micro-lm.json" >"$T/other.json"
# forged-lm: "d" = the hash of one description, the chunks another's.
"$FM" publish forged-lm 3 "$T/forged.json" "$T/forged-other.json" >"$T/forged.put" || { fail "fake_modeldesc publish"; finish; }
# renamed-lm: a valid description, of a model called other-lm.
"$FM" publish renamed-lm 3 "$T/other.json" "$T/other.json" >"$T/renamed.put" || { fail "fake_modeldesc publish"; finish; }
for x in x y; do
    [ "$x" = x ] && f="$T/forged.put" || f="$T/renamed.put"
    while read -r k v; do
        "$S" dht put "$k" "$v" --raw-key --value-hex --identity "$T/$x.key" --ttl 900 --initial-peers "$BS" \
            >>"$T/put.out" 2>>"$T/put.err" || echo "put failed: $k" >>"$T/put.fail"
    done <"$f"
done
[ -s "$T/put.fail" ] && { fail "the forger's puts failed"; show "$T/put.err"; finish; }

# refuse NAME REGEX: `starling peer --model NAME` exits 1 with a line
# matching REGEX, once the forger's entries are visible (a peer that finds
# nobody publishing NAME yet says "unknown model": tried again, bounded).
refuse() {
    rf_ok=0
    for i in $(seq 1 20); do
        timeout 120 "$S" peer --initial-peers "$BS" --blocks 0 --model "$1" --listen 127.0.0.1:0 \
            >"$T/$1.out" 2>"$T/$1.err"
        rf_rc=$?
        grep -q "unknown model" "$T/$1.err" && { sleep 0.5; continue; }
        rf_ok=1
        break
    done
    [ "$rf_ok" = 1 ] || { fail "$1: the forger's entries never became visible"; show "$T/$1.err"; return; }
    [ "$rf_rc" -eq 1 ] || { fail "peer --model $1 exited $rf_rc, want 1"; show "$T/$1.err"; }
    grep -Eq "$2" "$T/$1.err" || { fail "peer --model $1 does not say why it refuses"; show "$T/$1.err"; }
    grep -q "serving" "$T/$1.out" && fail "peer --model $1 served the forged model"
    cat "$T/$1.err" >&2
}
FH8=$("$FM" hash "$T/forged.json" | cut -c1-8)
refuse forged-lm "description $FH8: the chunks from peer $X8 hash to [0-9a-f]{8}, not $FH8: refused"
refuse renamed-lm "description [0-9a-f]{8} from peer $Y8 describes model 'other-lm', not 'renamed-lm': refused"

# A name nobody publishes.
timeout 120 "$S" peer --initial-peers "$BS" --blocks 0 --model nobody-lm --listen 127.0.0.1:0 \
    >"$T/nobody.out" 2>"$T/nobody.err"
rc=$?
[ "$rc" -eq 1 ] || fail "peer --model nobody-lm exited $rc, want 1"
grep -q "unknown model 'nobody-lm': no built-in model and no peer in the swarm publishes one by that name (known here: fmnist-mlp, tiny-lm)" "$T/nobody.err" ||
    { fail "no clear message for a model nobody publishes"; show "$T/nobody.err"; }

# The honest peers are unharmed.
"$S" monitor --initial-peers "$BS" --model micro-lm --timeout 10 >"$T/mon3.txt" 2>&1 ||
    { fail "after the forgery, micro-lm is no longer covered"; show "$T/mon3.txt"; }

# A conflict: a third identity lists under micro-lm a valid description of
# another model of that name. Nobody chooses between them by name any more;
# the file still works.
"$S" keygen --out "$T/z.key" >"$T/z.id" 2>"$T/keygen.err" || { fail "keygen"; show "$T/keygen.err"; finish; }
sed 's/test: byte GPT/another byte GPT/' "$T/micro-lm.json" >"$T/conflict.json"
"$FM" publish micro-lm 3 "$T/conflict.json" "$T/conflict.json" >"$T/conflict.put" || { fail "fake_modeldesc publish"; finish; }
while read -r k v; do
    "$S" dht put "$k" "$v" --raw-key --value-hex --identity "$T/z.key" --ttl 900 --initial-peers "$BS" \
        >>"$T/put.out" 2>>"$T/put.err" || { fail "the conflicting put failed"; show "$T/put.err"; }
done <"$T/conflict.put"
ok=0
for i in $(seq 1 20); do
    "$S" monitor --initial-peers "$BS" --model micro-lm --timeout 5 >"$T/conflict.txt" 2>&1
    rc=$?
    grep -q "2 different models are published under the name 'micro-lm' (descriptions .*): pass --model-file FILE" \
        "$T/conflict.txt" && { ok=1; break; }
    sleep 0.5
done
[ "$ok" = 1 ] || { fail "no conflict reported for two descriptions of micro-lm"; show "$T/conflict.txt"; }
[ "$rc" -ne 0 ] || fail "monitor --model micro-lm exited 0 despite the conflict"
cat "$T/conflict.txt" >&2
"$S" monitor --initial-peers "$BS" --model-file "$T/micro-lm.json" --timeout 10 >"$T/mon4.txt" 2>&1 ||
    { fail "with the file, micro-lm is not covered after the conflict"; show "$T/mon4.txt"; }
finish
