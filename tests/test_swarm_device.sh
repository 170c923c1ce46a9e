#!/bin/sh
# Peers that host their blocks on a device, in one loopback swarm with CPU
# peers: the device is $STARLING_TEST_DEVICE (default "sim", the simulated
# device: the CPU's math behind device memory, so every copy a GPU peer
# makes runs here too; tools/gpu-check.sh sets cuda:0).
#  1. fmnist-mlp through a device peer (stages 0-2), a CPU peer (3-5) and a
#     device peer (2,3) trains to the CPU swarm test's bar, every sample
#     once; the monitor shows each holder's device and precision.
#  2. A CPU newcomer on stages 0-2 downloads the device peer's trained state,
#     and replicas on the device and on the CPU average together.
#  3. A stage that does not fit the device's memory is refused in one
#     sentence naming the bytes needed and free; the peer exits 1.
#  4. A small language model with one stage on the device learns.
. "$(dirname "$0")/swarm_lib.sh"
DEV=${STARLING_TEST_DEVICE:-sim}
case "$DEV" in
cuda*)
    "$S" peer --device "$DEV" --blocks 99 >"$T/probe.out" 2>"$T/probe.err"
    grep -q "cannot use device" "$T/probe.err" && { echo "skip: $(head -1 "$T/probe.err")"; exit 77; } ;;
esac
FAST="--announce-every 1 --announce-ttl 5"

start_bootstrap
# shellcheck disable=SC2086
start_peer a 0-2 --device "$DEV" $FAST --average-every 4
# shellcheck disable=SC2086
start_peer b 3-5 $FAST --average-every 4
# shellcheck disable=SC2086
start_peer c 2,3 --device "$DEV" $FAST --average-every 4
grep -q "blocks on $DEV" "$T/a.err" || fail "peer a does not say it hosts its blocks on $DEV"

# 1. Training through them.
timeout 300 "$S" train --initial-peers "$BS" --train-samples 6000 --test-samples 2000 --json \
    --metrics-log "" --plot "" >"$T/train.out" 2>"$T/train.err"
rc=$?
[ "$rc" -eq 0 ] || { fail "train exited $rc"; show "$T/train.err" "$T/a.err" "$T/c.err"; }
acc=$(json_field "$T/train.out" test_acc)
samples=$(json_field "$T/train.out" samples)
echo "fmnist-mlp through $DEV and cpu peers: test_acc=$acc samples=$samples"
awk "BEGIN { exit !($acc >= 0.55) }" || fail "test accuracy $acc below 0.55"
[ "$samples" = 6000 ] || fail "processed $samples samples, want 6000"

"$S" monitor --initial-peers "$BS" --model fmnist-mlp --json --timeout 10 >"$T/mon.json" 2>"$T/mon.err" ||
    { fail "monitor failed"; show "$T/mon.err"; }
grep -q "\"device\":\"$DEV\",\"precision\":\"[a-z0-9]*\"" "$T/mon.json" ||
    { fail "the monitor's JSON does not show the $DEV holders"; show "$T/mon.json"; }
grep -q '"device":"cpu","precision":"fp32"' "$T/mon.json" ||
    { fail "the monitor's JSON does not show the cpu holder"; show "$T/mon.json"; }
"$S" monitor --initial-peers "$BS" --model fmnist-mlp --timeout 10 >"$T/mon.txt" 2>&1
grep -q " $DEV/" "$T/mon.txt" || { fail "the monitor's table does not show $DEV"; show "$T/mon.txt"; }

# 2. State across devices: replicas of stages 2 and 3 (a and c on the device,
# b on the CPU for stage 3) average; a CPU newcomer takes stage 0-2's state
# from the device peer.
wait_for "$T/a.err" 'fmnist-mlp\.2: averaged in a group of 2' 60 ||
    { fail "the device replicas of stage 2 never averaged"; show "$T/a.err" "$T/c.err"; }
wait_for "$T/b.err" 'fmnist-mlp\.3: averaged in a group of 2' 60 ||
    { fail "stage 3's replicas on the CPU and the device never averaged"; show "$T/b.err" "$T/c.err"; }
# shellcheck disable=SC2086
start_peer d 0-2 $FAST
grep -q "downloaded the current state (weight version [1-9]" "$T/d.err" ||
    { fail "the CPU newcomer did not download the trained state"; show "$T/d.err"; }
stop_peer "$PID_d" 30 || fail "peer d did not stop cleanly"

# 3. A stage that does not fit: micro-lm's stages need more than 1 MiB.
cp "$(dirname "$0")/ref/micro-lm.json" "$T/micro-lm.json"
case "$DEV" in
sim*) small="sim:1" ;;
*) small="" ;;
esac
if [ -n "$small" ]; then
    timeout 60 "$S" peer --initial-peers "$BS" --model-file "$T/micro-lm.json" --blocks 0 --device "$small" \
        >"$T/small.out" 2>"$T/small.err"
    rc=$?
    [ "$rc" -eq 1 ] || fail "a stage too big for the device: exit $rc, want 1"
    grep -Eq "stage micro-lm\.0 needs [0-9.]+ [KMG]iB on sim .* but [0-9.]+ [KMG]iB is free" "$T/small.err" ||
        { fail "no sentence naming the bytes needed and free"; show "$T/small.err"; }
fi

# 4. A language model with its middle stage on the device.
# (start_peer_auto: its monitor check reads the model file.)
AUTO_MON="--model-file $T/micro-lm.json"
start_peer_auto e --blocks 0 --model-file "$T/micro-lm.json" --lr 3e-3
start_peer_auto f --blocks 1 --model-file "$T/micro-lm.json" --lr 3e-3 --device "$DEV"
start_peer_auto g --blocks 2 --model-file "$T/micro-lm.json" --lr 3e-3
cat "$(dirname "$0")"/../docs/*.md "$(dirname "$0")"/../expert/*.c >"$T/corpus.txt"
timeout 600 "$S" train --initial-peers "$BS" --model-file "$T/micro-lm.json" --data "$T/corpus.txt" \
    --steps 60 --eval-every 30 --eval-batches 2 --json --metrics-log "" --plot "" \
    >"$T/lm.out" 2>"$T/lm.err"
rc=$?
[ "$rc" -eq 0 ] || { fail "language model train exited $rc"; show "$T/lm.err" "$T/f.err"; }
bpb=$(json_field "$T/lm.out" val_bpb)
echo "micro-lm with stage 1 on $DEV: val_bpb=$bpb"
awk "BEGIN { exit !($bpb < 6.0) }" || fail "validation $bpb bits/byte: not well below 8"
finish
