#!/bin/sh
# A 3-peer loopback swarm trains a small byte-level language model (the
# model file tests/ref/micro-lm.json: d 64, 2 decoder layers, context 32) on a text corpus for a bounded
# number of steps; its validation loss falls well below the uniform 8
# bits/byte. Three peers started with --num-blocks left at its default
# cover the model's three stages between them.
. "$(dirname "$0")/swarm_lib.sh"
cp "$(dirname "$0")/ref/micro-lm.json" "$T/micro-lm.json"
# The corpus: this repository's own text (docs and sources), ~100 KB or
# more, so the test needs no package; the last 10% is validation.
cat "$(dirname "$0")"/../docs/*.md "$(dirname "$0")"/../expert/*.c >"$T/corpus.txt"
start_bootstrap
AUTO_MON="--model-file $T/micro-lm.json"
for p in a b c; do
    start_peer_auto "$p" --model-file "$T/micro-lm.json" --lr 3e-3
done
timeout 600 "$S" train --initial-peers "$BS" --model-file "$T/micro-lm.json" --data "$T/corpus.txt" \
    --steps 60 --eval-every 30 --eval-batches 2 --json --metrics-log "$T/lm.jsonl" --plot "$T/lm.svg" \
    >"$T/train.out" 2>"$T/train.err"
rc=$?
[ "$rc" -eq 0 ] || { fail "train exited $rc"; show "$T/train.err" "$T/a.err"; }
cat "$T/train.err" >&2
bpb=$(json_field "$T/train.out" val_bpb)
steps=$(json_field "$T/train.out" steps)
tps=$(json_field "$T/train.out" tokens_per_s)
status=$(json_field "$T/train.out" status)
echo "val_bpb=$bpb steps=$steps tokens_per_s=$tps status=$status"
[ "$steps" = 60 ] || fail "ran $steps steps, want 60"
[ "$status" = ok ] || fail "status $status"
# Uniform over 256 bytes is 8 bits/byte; a unigram model of English text is
# ~4.5. 60 steps of 16 windows reach well below 6.
awk "BEGIN { exit !($bpb < 6.0) }" || fail "validation $bpb bits/byte: not well below 8"
# The evaluation before the first step is near uniform.
first=$(grep '"event":"eval"' "$T/lm.jsonl" | head -1 | sed -n 's/.*"val_bpb":\([0-9.]*\).*/\1/p')
awk "BEGIN { exit !($first > 7.0) }" || fail "first evaluation $first bits/byte: not near uniform"
grep -c '"event":"eval"' "$T/lm.jsonl" | grep -qx 3 || fail "want 3 evaluations (steps 0, 30, 60)"
grep -q '<polyline' "$T/lm.svg" || fail "no curve in the plot"
# Generation through the swarm: 20 bytes, greedy (a majority of 2 paths)
# and sampled, with the weight versions each stage served: every stage
# stepped 60 times (a version per step).
for mode in "--temperature 0 --replicas 2" "--temperature 0.8 --seed 5"; do
    # shellcheck disable=SC2086
    timeout 120 "$S" generate --initial-peers "$BS" --model-file "$T/micro-lm.json" --prompt "The " \
        --tokens 20 --json $mode >"$T/gen.out" 2>"$T/gen.err" || { fail "generate $mode failed"; show "$T/gen.err"; }
    n=$(json_field "$T/gen.out" tokens)
    [ "$n" = 20 ] || fail "generate $mode: $n bytes, want 20"
    grep -q '"versions":\[{"stage":0,"min":60,"max":60},{"stage":1,"min":60,"max":60},{"stage":2,"min":60,"max":60}\]' \
        "$T/gen.out" || { fail "generate $mode: weight versions"; cat "$T/gen.out" >&2; }
    head -c 300 "$T/gen.out" >&2; echo >&2
done
# --max-seconds bounds a run: it stops after the first step that ends past
# the bound, evaluates, and says so; also when every step ends a stretch
# between evaluations (--eval-every 1).
timeout 300 "$S" train --initial-peers "$BS" --model-file "$T/micro-lm.json" --data "$T/corpus.txt" \
    --steps 1000000 --max-seconds 1 --eval-every 1 --eval-batches 1 --json --metrics-log "" --plot "" \
    >"$T/short.out" 2>"$T/short.err" || { fail "train --max-seconds failed"; show "$T/short.err"; }
early=$(json_field "$T/short.out" stopped_early)
steps=$(json_field "$T/short.out" steps)
echo "max-seconds run: $steps steps, stopped_early=$early"
[ "$early" = true ] || fail "--max-seconds: stopped_early=$early"
[ -n "$steps" ] && [ "$steps" -ge 1 ] && [ "$steps" -lt 1000000 ] || fail "--max-seconds: $steps steps"
# Each peer took a stage of its own.
for p in a b c; do grep -m1 'chose stages' "$T/$p.err" >&2; done
"$S" monitor --initial-peers "$BS" --model-file "$T/micro-lm.json" --timeout 10 >"$T/mon.txt" 2>&1 ||
    { fail "the three peers do not cover every stage"; show "$T/mon.txt"; }
finish
