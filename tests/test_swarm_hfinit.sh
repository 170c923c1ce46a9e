#!/bin/sh
# Weights in and out as safetensors under GPT-2's Hugging Face names, on
# 3-peer loopback swarms of the model file tests/ref/micro-lm.json:
# - `starling peer --init-weights FILE.safetensors` (each peer reading its
#   own stages' tensors) evaluates, before any step, exactly the validation
#   loss of the flat file of the same weights, and not the seeded one's;
# - `starling export` writes a trained swarm's newest weights, and fresh
#   peers started from that file evaluate exactly the trained swarm's last
#   validation loss;
# - a file that is not safetensors, a model without Hugging Face names and
#   a model nobody serves fail with a sentence (exit 1).
# Every wait is bounded.
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

# run TAG STEPS [FILE]: three peers (one stage each) from FILE (none: the
# seeded initialisation) train STEPS steps with an evaluation before the
# first step and after the last; the validation losses into $T/TAG.first
# and $T/TAG.last. With $EXPORT set, `starling export` writes the peers'
# newest weights into that directory before they stop.
run() {
    for i in 0 1 2; do
        # shellcheck disable=SC2046
        start_peer_auto "$1$i" --blocks "$i" --model-file "$T/micro-lm.json" $([ -n "${3:-}" ] && echo --init-weights "$3")
    done
    timeout 300 "$S" train --initial-peers "$BS" --model-file "$T/micro-lm.json" --data "$T/corpus.txt" \
        --steps "$2" --eval-every "$2" --eval-batches 2 --json --metrics-log "$T/$1.jsonl" --plot "" \
        >"$T/$1.out" 2>"$T/$1.err" || { fail "train ($1) failed"; show "$T/$1.err"; }
    grep '"event":"eval"' "$T/$1.jsonl" | sed -n 's/.*"val_loss":\([0-9.e+-]*\).*/\1/p' >"$T/$1.losses"
    head -1 "$T/$1.losses" >"$T/$1.first"
    tail -1 "$T/$1.losses" >"$T/$1.last"
    if [ -n "${EXPORT:-}" ]; then
        timeout 120 "$S" export --initial-peers "$BS" --model-file "$T/micro-lm.json" --out "$EXPORT" \
            >"$T/export.out" 2>"$T/export.err" || { fail "export failed"; show "$T/export.err"; }
        cat "$T/export.err" >&2
    fi
    for i in 0 1 2; do
        eval "pid=\$PID_$1$i"
        stop_peer "$pid" 30 || fail "peer $1$i did not stop cleanly"
    done
}
run flat 1 "$T/init.bin"
run st 1 "$T/init.safetensors"
EXPORT="$T/export" run seeded 3
EXPORT="" run back 1 "$T/export/model.safetensors"
flat=$(cat "$T/flat.first") st=$(cat "$T/st.first") seeded=$(cat "$T/seeded.first")
trained=$(cat "$T/seeded.last") back=$(cat "$T/back.first")
echo "step-0 validation loss: flat file $flat, safetensors $st, seeded weights $seeded"
echo "after 3 steps: $trained; exported and loaded by fresh peers: $back"
[ -n "$flat" ] && [ "$flat" = "$st" ] || fail "the two files gave different weights ($flat vs $st)"
[ -n "$seeded" ] && [ "$seeded" != "$st" ] || fail "the file's weights evaluate like the seeded ones ($seeded)"
# Export, then --init-weights: the trained swarm's weights, loss for loss.
[ -n "$trained" ] && [ "$trained" = "$back" ] || fail "exported weights evaluate to $back, the swarm's to $trained"
[ "$trained" != "$seeded" ] || fail "3 steps did not change the loss"
grep -q 'weight versions 3,3,3' "$T/export.err" || fail "export: not the weight versions 3,3,3"
grep -q '"model_type": "gpt2"' "$T/export/config.json" || fail "export: no GPT2 config.json"
grep -q '"n_layer": 2' "$T/export/config.json" || fail "export: config.json's n_layer is not 2"
# A model that nobody serves: export fails and says which stage.
timeout 60 "$S" export --initial-peers "$BS" --model tiny-lm --out "$T/none" --timeout 5 \
    >"$T/none.out" 2>"$T/none.err"
rc=$?
[ "$rc" -eq 1 ] || fail "export of an unserved model: exit $rc, want 1"
grep -q "stage tiny-lm.0: no online holder" "$T/none.err" || { fail "no sentence for the unserved stage"; show "$T/none.err"; }
[ ! -e "$T/none/model.safetensors" ] || fail "a failed export wrote a file"
[ "$fails" -eq 0 ] || exit 1
echo "ok"
