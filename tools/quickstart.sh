#!/usr/bin/env bash
# tools/quickstart.sh: the one command a new user runs.
#
# Installs what is missing (Debian 12, as root or with sudo), builds Starling
# in release mode into build-release/, then starts a local swarm on loopback:
# a bootstrap node and three peers holding the six stages of fmnist-mlp (one
# stage on two peers), trains one epoch of Fashion-MNIST through it, prints
# the test accuracy and a view of the swarm, and stops everything cleanly.
#
# Environment: EPOCHS (default 1), TRAIN_SAMPLES (default: all 60000),
# KEEP=1 leaves the swarm's logs in the work directory.
set -u -o pipefail
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

echo
echo "== starting a local swarm on 127.0.0.1 (logs in $work)"
"$S" bootstrap --listen 127.0.0.1:0 >"$work/bootstrap.out" 2>"$work/bootstrap.err" &
pids="$pids $!"
wait_for "$work/bootstrap.out" '/' 10 || exit 1
BS=$(head -1 "$work/bootstrap.out")
echo "   bootstrap node  $BS"
start_peer() { # NAME BLOCKS
    "$S" peer --initial-peers "$BS" --blocks "$2" --checkpoint-dir "$work/ckpt-$1" \
        --metrics 127.0.0.1:0 >"$work/$1.out" 2>"$work/$1.err" &
    pids="$pids $!"
    wait_for "$work/$1.err" 'online: announcing' 30 || exit 1
    echo "   peer $1          stages $2  ($(sed -n 's/.*address //p' "$work/$1.out"))"
}
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
