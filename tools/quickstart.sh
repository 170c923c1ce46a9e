#!/usr/bin/env bash
# tools/quickstart.sh: the one command a new user runs.
#
# Installs what is missing (Debian 12, as root or with sudo), builds Starling
# in release mode into build-release/, then starts a local swarm on loopback:
# a bootstrap node and three peers holding the six stages of fmnist-mlp (one
# stage on two peers), trains one epoch of Fashion-MNIST through it, prints
# the test accuracy and a view of the swarm, and stops everything cleanly.
#
# tools/quickstart.sh --model tiny-lm: the same with the byte-level language
# model tiny-lm instead: three peers that pick their stages themselves,
# STEPS (default 150) optimizer steps on the fortunes corpus, the
# validation bits per byte, and a sample of text generated through the
# swarm at the end.
#
# Environment: EPOCHS (default 1), TRAIN_SAMPLES (default: all 60000),
# STEPS (tiny-lm, default 150), KEEP=1 leaves the swarm's logs in the work
# directory.
set -u -o pipefail
model=fmnist-mlp
case "${1:-}" in
    "") ;;
    --model)
        model=${2:-}
        [ "$model" = fmnist-mlp ] || [ "$model" = tiny-lm ] ||
            { echo "usage: tools/quickstart.sh [--model fmnist-mlp|tiny-lm]" >&2; exit 2; } ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: tools/quickstart.sh [--model fmnist-mlp|tiny-lm]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.." || exit 1
. tools/deps.sh

starling_install_deps || exit 1
starling_configure build-release -Dbuildtype=release -Dtests=false || exit 1
ninja -C build-release || exit 1
S=$PWD/build-release/tools/starling

work=$(mktemp -d "${TMPDIR:-/tmp}/starling-quickstart-XXXXXX") || exit 1
pids=""
stop_all() {
    for p in $pids; do kill -TERM "$p" 2>/dev/null; done
    for p in $pids; do wait "$p" 2>/dev/null; done
    pids=""
}
cleanup() {
    stop_all
    if [ "${KEEP:-0}" = 1 ]; then echo "logs kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_for() { # FILE REGEX SECONDS
    for _ in $(seq 1 $(( $3 * 10 ))); do grep -Eq "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
    echo "error: timed out waiting for '$2' in $1" >&2; tail -5 "$1" >&2; return 1
}

# The language model's run: train, evaluate, generate, report.
lm_quickstart() {
    echo
    echo "== training tiny-lm through the swarm (${STEPS:-150} steps on the fortunes corpus)"
    "$S" train --initial-peers "$BS" --model tiny-lm --steps "${STEPS:-150}" --eval-every 50 --json \
        --metrics-log "$work/train.jsonl" --plot "$PWD/starling-train.svg" >"$work/train.json"
    rc=$?
    [ -s "$work/train.json" ] && cat "$work/train.json"
    [ "$rc" -eq 0 ] || { echo "error: training failed (exit $rc)" >&2; return 1; }
    echo
    echo "== a sample through the swarm (temperature 0.8)"
    "$S" generate --initial-peers "$BS" --model tiny-lm --prompt "The " --tokens 200 ||
        { echo "error: generation failed" >&2; return 1; }
    echo
    echo "== the swarm"
    "$S" monitor --initial-peers "$BS" --model tiny-lm 2>&1 || true
    stop_all
    bpb=$(sed -n 's/.*"val_bpb":\([0-9.]*\).*/\1/p' "$work/train.json")
    tps=$(sed -n 's/.*"tokens_per_s":\([0-9.]*\).*/\1/p' "$work/train.json")
    echo
    echo "Validation: $bpb bits/byte (uniform: 8)   ($tps training tokens/s)"
    echo "Loss plot: $PWD/starling-train.svg"
}

echo
echo "== starting a local swarm on 127.0.0.1 (logs in $work)"
"$S" bootstrap --listen 127.0.0.1:0 >"$work/bootstrap.out" 2>"$work/bootstrap.err" &
pids="$pids $!"
wait_for "$work/bootstrap.out" '/' 10 || exit 1
BS=$(head -1 "$work/bootstrap.out")
echo "   bootstrap node  $BS"
start_peer() { # NAME BLOCKS|auto
    blocks=(--blocks "$2")
    [ "$2" = auto ] && blocks=(--model "$model")
    "$S" peer --initial-peers "$BS" "${blocks[@]}" --checkpoint-dir "$work/ckpt-$1" \
        --metrics 127.0.0.1:0 >"$work/$1.out" 2>"$work/$1.err" &
    pids="$pids $!"
    wait_for "$work/$1.err" 'online: announcing' 60 || exit 1
    [ "$2" = auto ] && set -- "$1" "$(sed -n 's/.*chose stages \([0-9-]*\).*/\1/p' "$work/$1.err" | tail -1)"
    echo "   peer $1          stages $2  ($(sed -n 's/.*address //p' "$work/$1.out"))"
}
if [ "$model" = tiny-lm ]; then
    # Each peer picks the stage nobody serves yet (--num-blocks: a third of
    # the model): the next starts once the swarm shows this one online.
    n=0
    for p in a b c; do
        start_peer "$p" auto
        n=$((n + 1))
        for _ in $(seq 1 100); do
            [ "$("$S" monitor --initial-peers "$BS" --model tiny-lm --json 2>/dev/null |
                grep -o '"state":"online"' | wc -l)" -ge "$n" ] && break
            sleep 0.3
        done
    done
    lm_quickstart
    exit $?
fi
start_peer a 0-2
start_peer b 3-5
start_peer c 2,3

echo
echo "== training fmnist-mlp through the swarm"
args=(--initial-peers "$BS" --epochs "${EPOCHS:-1}" --json
      --metrics-log "$work/train.jsonl" --plot "$PWD/starling-train.svg")
[ -n "${TRAIN_SAMPLES:-}" ] && args+=(--train-samples "$TRAIN_SAMPLES")
"$S" train "${args[@]}" >"$work/train.json"
rc=$?
[ -s "$work/train.json" ] && cat "$work/train.json"
if [ "$rc" -ne 0 ]; then
    echo "error: training failed (exit $rc)" >&2
    exit 1
fi
acc=$(sed -n 's/.*"test_acc":\([0-9.]*\).*/\1/p' "$work/train.json")
sps=$(sed -n 's/.*"samples_per_s":\([0-9.]*\).*/\1/p' "$work/train.json")

echo
echo "== the swarm"
"$S" monitor --initial-peers "$BS" 2>&1 || true

echo
echo "== stopping the swarm"
stop_all
echo
echo "Test accuracy: $acc   ($sps training samples/s)"
echo "Loss/accuracy plot: $PWD/starling-train.svg"
