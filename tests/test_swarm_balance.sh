#!/bin/sh
# Peers started without --blocks pick the least served span: three that
# join an empty swarm at once end up covering every stage (moving when
# their spans overlap, a bounded number of times), and a newcomer to a
# lopsided swarm takes the weakest span.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
FAST="--announce-every 1 --announce-ttl 4 --rebalance-every 2"
for n in 1 2 3; do
    "$S" peer --initial-peers "$BS" --num-blocks 2 $FAST >"$T/p$n.out" 2>"$T/p$n.err" &
    PIDS="$PIDS $!"
done
# (The bounds below are hang guards: on an idle machine coverage comes in
# seconds.)
ok=0
end=$(( $(date +%s) + 240 ))
while [ "$(date +%s)" -lt "$end" ]; do
    sleep 1
    "$S" monitor --initial-peers "$BS" --model fmnist-mlp --timeout 10 >"$T/mon.txt" 2>&1 && { ok=1; break; }
done
[ "$ok" = 1 ] || { fail "stages still uncovered after 240 s"; show "$T/mon.txt" "$T/p1.err" "$T/p2.err" "$T/p3.err"; }
# Moves are uncoordinated, so a gap can open for a moment while a peer
# restarts elsewhere; coverage must come back (and stay) on its own.
sleep 4
ok=0
end=$(( $(date +%s) + 120 ))
while [ "$(date +%s)" -lt "$end" ]; do
    "$S" monitor --initial-peers "$BS" --model fmnist-mlp --timeout 10 >"$T/mon2.txt" 2>&1 && { ok=1; break; }
    sleep 1
done
[ "$ok" = 1 ] || { fail "coverage lost after settling"; show "$T/mon2.txt"; }
# Moves so far, settling included (counted once coverage is back, not while
# a move may still be under way).
for n in 1 2 3; do
    moves=$(grep -c "moving from stages" "$T/p$n.err")
    echo "peer $n: $(grep -m1 'chose stages' "$T/p$n.err" | sed 's/.*chose/chose/'), $moves move(s)"
    [ "$moves" -le 3 ] || fail "peer $n moved $moves times"
done

# A lopsided swarm: 0-2 once, 3-5 twice. A newcomer of three stages picks 0-2
# (start_peer returns once a peer's announcements can be found, so the
# newcomer sees all three).
for p in $PIDS; do kill "$p" 2>/dev/null; done
start_bootstrap
start_peer a 0-2
start_peer b 3-5
start_peer c 3-5
"$S" peer --initial-peers "$BS" --num-blocks 3 --rebalance-every 0 >"$T/n.out" 2>"$T/n.err" &
PIDS="$PIDS $!"
wait_for "$T/n.err" 'online: announcing' 120 || { fail "newcomer did not come online"; show "$T/n.err"; }
grep -q "chose stages 0-2" "$T/n.err" || { fail "newcomer did not take the least served span"; show "$T/n.err"; }
finish
