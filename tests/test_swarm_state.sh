#!/bin/sh
# A newcomer downloads the current state of its blocks from a holder before
# it serves: after the swarm has trained, a peer started with other initial
# weights (--seed 5) answers exactly like the donor (a 2-path inference
# through both agrees on every input), and the log says where the state
# came from. The first peer of a swarm has nobody to ask and says so.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
start_peer a 0-5
grep -q "fmnist-mlp.0: no other holder; starting from our initial weights" "$T/a.err" ||
    { fail "the first peer did not say it starts from its initial weights"; show "$T/a.err"; }
"$S" train --initial-peers "$BS" --train-samples 1024 --test-samples 256 --metrics-log "" --plot "" \
    >"$T/train.out" 2>"$T/train.err" || { fail "training failed"; show "$T/train.err"; }
start_peer b 0-5 --seed 5
wait_for "$T/b.err" 'online: announcing' 120 || { fail "newcomer never went online"; show "$T/b.err"; }
grep -q "fmnist-mlp.0: downloaded the current state (weight version [1-9]" "$T/b.err" || \
    { fail "no state download logged"; show "$T/b.err"; }
n=$(grep -c "downloaded the current state" "$T/b.err")
[ "$n" -eq 6 ] || fail "downloaded $n of 6 stages"
"$S" infer --initial-peers "$BS" --data test --samples 500 --replicas 2 --json >"$T/inf.json" 2>"$T/inf.err"
[ $? -eq 0 ] || { fail "infer failed"; show "$T/inf.err"; }
unan=$(json_field "$T/inf.json" unanimous)
[ "$unan" = "1.000000" ] || fail "newcomer and donor disagree on some inputs (unanimous $unan)"
finish
