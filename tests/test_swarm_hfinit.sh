#!/bin/sh
# Peers start from a safetensors file under GPT-2's Hugging Face names
# (`starling peer --init-weights FILE.safetensors`, each peer reading its
# own stages' tensors): a 3-peer loopback swarm of the model file
# tests/ref/micro-lm.json evaluates, before any step, exactly the
# validation loss it evaluates when its peers start from the flat file of
# the same weights, and not the loss of the seeded initialisation. A
# file that is not safetensors, and a model without Hugging Face names,
# stop the peer with a sentence (exit 1). Every wait is bounded.
. "$(dirname "$0")/swarm_lib.sh"
HW=${HF_WEIGHTS:?HF_WEIGHTS must point at tests/hf_weights}
cp "$(dirname "$0")/ref/micro-lm.json" "$T/micro-lm.json"
cat "$(dirname "$0")"/../docs/*.md >"$T/corpus.txt"
"$HW" "$T/micro-lm.json" 7 "$T/init.bin" "$T/init.safetensors" || { fail "hf_weights failed"; exit 1; }
start_bootstrap
AUTO_MON="--model-file $T/micro-lm.json"

# Refusals: the peer exits 1 and says why, naming the file.
printf 'these are not weights' >"$T/bad.safetensors"
timeout 60 "$S" peer --initial-peers "$BS" --model-file "$T/micro-lm.json" --blocks 0 \
    --init-weights "$T/bad.safetensors" >"$T/bad.out" 2>"$T/bad.err"
rc=$?
[ "$rc" -eq 1 ] || { fail "a garbage weight file: exit $rc, want 1"; show "$T/bad.err"; }
grep -q "bad.safetensors: not a safetensors file" "$T/bad.err" || { fail "no sentence for the garbage file"; show "$T/bad.err"; }
timeout 60 "$S" peer --initial-peers "$BS" --model fmnist-mlp --blocks 0 \
    --init-weights "$T/init.safetensors" >"$T/mlp.out" 2>"$T/mlp.err"
rc=$?
[ "$rc" -eq 1 ] || { fail "an MLP from safetensors: exit $rc, want 1"; show "$T/mlp.err"; }
grep -q "no Hugging Face names" "$T/mlp.err" || { fail "no sentence for the MLP"; show "$T/mlp.err"; }

# run TAG [FILE]: three peers (one stage each) from FILE (none: the seeded
# initialisation), one evaluation before a single training step; the
# step-0 validation loss into $T/TAG.loss.
run() {
    for i in 0 1 2; do
        # shellcheck disable=SC2046
        start_peer_auto "$1$i" --blocks "$i" --model-file "$T/micro-lm.json" $([ -n "${2:-}" ] && echo --init-weights "$2")
    done
    timeout 300 "$S" train --initial-peers "$BS" --model-file "$T/micro-lm.json" --data "$T/corpus.txt" \
        --steps 1 --eval-every 1 --eval-batches 2 --json --metrics-log "$T/$1.jsonl" --plot "" \
        >"$T/$1.out" 2>"$T/$1.err" || { fail "train ($1) failed"; show "$T/$1.err"; }
    grep '"event":"eval"' "$T/$1.jsonl" | head -1 | sed -n 's/.*"val_loss":\([0-9.e+-]*\).*/\1/p' >"$T/$1.loss"
    for i in 0 1 2; do
        eval "pid=\$PID_$1$i"
        stop_peer "$pid" 30 || fail "peer $1$i did not stop cleanly"
    done
}
run flat "$T/init.bin"
run st "$T/init.safetensors"
run seeded
flat=$(cat "$T/flat.loss") st=$(cat "$T/st.loss") seeded=$(cat "$T/seeded.loss")
echo "step-0 validation loss: flat file $flat, safetensors $st, seeded weights $seeded"
[ -n "$flat" ] && [ "$flat" = "$st" ] || fail "the two files gave different weights ($flat vs $st)"
[ -n "$seeded" ] && [ "$seeded" != "$st" ] || fail "the file's weights evaluate like the seeded ones ($seeded)"
[ "$fails" -eq 0 ] || exit 1
echo "ok"
