#!/bin/sh
# Two peers started with one identity file: the second one meets the first
# one's node ID at another address while joining, gets it proven (the first
# one signs with the same key), says so and exits 1 without announcing
# anything; the first one keeps serving.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
"$S" keygen --out "$T/twin.key" >"$T/keygen.out" 2>&1 || { fail "keygen failed"; finish; }
id=$(cat "$T/keygen.out")
start_peer a 0-5 --identity "$T/twin.key"
addr_a=$(sed -n 's|^starling peer: address \([^/]*\)/.*|\1|p' "$T/a.out" | head -1)
[ -n "$addr_a" ] || { fail "peer a printed no address"; show "$T/a.out"; finish; }

start=$(date +%s)
timeout 60 "$S" peer --initial-peers "$BS" --blocks 0-5 --identity "$T/twin.key" >"$T/b.out" 2>"$T/b.err" &
pid_b=$!
PIDS="$PIDS $pid_b"
wait "$pid_b"
rc=$?
took=$(( $(date +%s) - start ))
[ "$rc" -eq 1 ] || { fail "second peer with the same identity exited $rc, want 1"; show "$T/b.out" "$T/b.err"; }
[ "$took" -le 30 ] || fail "second peer took $took s to refuse"
want="another peer is online with this identity (node ID $id) at $addr_a; refusing to start: use another --identity"
grep -qF "$want" "$T/b.err" || { fail "no clear message (want: $want)"; show "$T/b.err"; }
grep -q 'online: announcing' "$T/b.err" && fail "the second peer announced itself"

# The first one is still up and still the one the swarm sees.
kill -0 "$PID_a" 2>/dev/null || { fail "the first peer died"; show "$T/a.err"; }
timeout 60 "$S" monitor --initial-peers "$BS" --model fmnist-mlp --timeout 10 >"$T/mon.txt" 2>&1 ||
    { fail "monitor does not see every stage served"; show "$T/mon.txt"; }
grep -qF "$addr_a" "$T/mon.txt" || { fail "monitor does not list the first peer"; show "$T/mon.txt"; }
addr_b=$(sed -n 's|^starling peer: address \([^/]*\)/.*|\1|p' "$T/b.out" | head -1)
[ -n "$addr_b" ] && grep -qF "$addr_b" "$T/mon.txt" && fail "monitor lists the refused peer"
grep -q 'another peer is online' "$T/a.err" && fail "the first peer complained"
finish
