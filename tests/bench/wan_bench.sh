#!/usr/bin/env bash
# tests/bench/wan_bench.sh: swarm training across emulated wide-area links
# (tests/wan/wanbed.sh), per link profile and per wire format of the
# trainer's tensors (`starling train --wire-format`).
#
# For each profile and each format, on a fresh test bed of five namespace
# hosts: a bootstrap node on host 1, three peers holding fmnist-mlp's six
# stages (0-1 on host 2, 2-3 on host 3, 4-5 on host 4: every stage's
# activations and gradients cross the shaped links) and the trainer on host
# 5. The peers start from the same initial weights (--seed) each run, and are
# waited for (bounded) until `starling monitor` on host 5 shows each of them
# online on every stage it announces; then `starling train --json` trains on
# the same samples in the same order (--seed) and evaluates. Steps are
# synchronous by default (--sync 128, the peers' --target-batch): the
# weights after a run then depend on the data and the format only, not on
# the timing of the links, so test_acc differs between formats for the
# format's sake (asynchronous runs of the same format differ by several
# points of accuracy from run to run; on the shaped links --sync costs no
# throughput, as the trainer's two micro-batches of 64 in flight are one
# group of 128 anyway).
#
# Prints one JSON line per run:
#   {"bench":"wan","profile":P,"format":F,"samples":N,"samples_per_s":X,
#    "bytes_per_sample":B,"test_acc":A}
# (bytes_per_sample: request and reply bytes the trainer sent and received
# per training sample, from the trainer's --json line; null when it has no
# such field), then a last line
#   {"wan_vs_lan":R,"bytes_reduction":X,"acc_drop":D,"best_format":F}
# where F is the compressed format (not f32) with the highest samples/s on
# wan, R = F's samples/s on wan / f32's on lan, X = f32's bytes_per_sample /
# F's and D = f32's test_acc - F's (fractions), X and D from the wan runs.
# With --model tiny-lm the lines are {"bench":"wan","model":"tiny-lm",
# "profile":P,"format":F,"tokens":N,"tokens_per_s":X,"bytes_per_token":B,
# "val_bpb":V} and the summary's third figure is "bpb_increase" (F's val_bpb
# minus f32's, bits per byte; lower is better).
# When only f32 ran (or the trainer has no --wire-format), F is f32 itself
# (R = f32 on wan / f32 on lan, X = 1, D = 0); a figure whose runs are
# missing is null.
#
# Needs root, ip(8), tc(8) with tbf (shaped profiles), and the built
# tests/wan/delay_bridge and netprobe: exits 77 (skipped) when the test bed
# cannot be built. Every process it started is stopped and the namespaces
# deleted on exit, also on failure, Ctrl-C or SIGTERM.
set -u -o pipefail

usage() {
    cat <<'EOF'
Usage: tests/bench/wan_bench.sh [options] [BUILD_DIR]     (default BUILD_DIR: build)

Trains fmnist-mlp across emulated wide-area links (bootstrap, 3 peers and the
trainer on their own namespace hosts) for each link profile and wire format;
prints one JSON line per run and a summary line. Run as root.

Options (environment variable in brackets):
  -p, --profiles LIST      link profiles, space or comma separated: lan, wan,
                           slow, custom:MBIT:RTT_MS [PROFILES; "lan wan slow"]
  -f, --formats LIST       wire formats: f32 f16 bf16 q8[:BLOCK]  [FORMATS; "f32 q8"]
                           (only f32 when the trainer has no --wire-format)
  -n, --train-samples N    training samples per run         [TRAIN_SAMPLES; 6000]
  -t, --test-samples N     test samples per evaluation      [TEST_SAMPLES; 2000]
  -s, --seed N             peers' initial weights and data order [SEED; 0]
  -S, --sync N             starling train --sync: samples per synchronous step
                           group, 0 asynchronous                [SYNC; 128]
      --train-timeout S    give up on one training run after S s [TRAIN_TIMEOUT; 900]
  -m, --model NAME         fmnist-mlp or tiny-lm                    [MODEL; fmnist-mlp]
      --steps N            tiny-lm: optimizer steps of 32 windows, evaluated at
                           the end (-n, -t and -S do not apply)     [STEPS; 30]
  -h, --help               this text
Also: TRAIN_FLAGS (extra flags for starling train), PEER_ARGS (for the
peers), STARLING_DELAY_BRIDGE and STARLING_NETPROBE (default: BUILD_DIR/tests/wan/),
WANBED_TAG (namespace prefix, default wb<pid>), KEEP_T=1 keeps the logs.
A default run (3 profiles x 2 formats, 6000 samples) takes 7 to 8 minutes on
a 2-core machine (f32 alone: 5).
EOF
}

profiles=${PROFILES:-lan wan slow}
formats=${FORMATS:-f32 q8}
train_samples=${TRAIN_SAMPLES:-6000}
test_samples=${TEST_SAMPLES:-2000}
seed=${SEED:-0}
sync=${SYNC:-128}
train_timeout=${TRAIN_TIMEOUT:-900}
model=${MODEL:-fmnist-mlp}
steps=${STEPS:-30}
build=""
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        -p|--profiles) [ $# -ge 2 ] || { usage >&2; exit 2; }; profiles=$2; shift ;;
        -f|--formats) [ $# -ge 2 ] || { usage >&2; exit 2; }; formats=$2; shift ;;
        -n|--train-samples) [ $# -ge 2 ] || { usage >&2; exit 2; }; train_samples=$2; shift ;;
        -t|--test-samples) [ $# -ge 2 ] || { usage >&2; exit 2; }; test_samples=$2; shift ;;
        -s|--seed) [ $# -ge 2 ] || { usage >&2; exit 2; }; seed=$2; shift ;;
        -S|--sync) [ $# -ge 2 ] || { usage >&2; exit 2; }; sync=$2; shift ;;
        --train-timeout) [ $# -ge 2 ] || { usage >&2; exit 2; }; train_timeout=$2; shift ;;
        -m|--model) [ $# -ge 2 ] || { usage >&2; exit 2; }; model=$2; shift ;;
        --steps) [ $# -ge 2 ] || { usage >&2; exit 2; }; steps=$2; shift ;;
        -*) echo "wan_bench: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) [ -z "$build" ] || { usage >&2; exit 2; }; build=$1 ;;
    esac
    shift
done
profiles=$(echo "$profiles" | tr ',' ' ')
formats=$(echo "$formats" | tr ',' ' ')
case $model in fmnist-mlp|tiny-lm) ;; *) echo "wan_bench: --model takes fmnist-mlp or tiny-lm" >&2; exit 2 ;; esac
for v in "$train_samples" "$test_samples" "$seed" "$sync" "$train_timeout" "$steps"; do
    case $v in ''|*[!0-9]*) echo "wan_bench: not a number: '$v'" >&2; exit 2 ;; esac
done
[ -n "$profiles" ] && [ -n "$formats" ] || { echo "wan_bench: no profiles or no formats" >&2; exit 2; }

root=$(cd "$(dirname "$0")/../.." && pwd)
. "$root/tests/bench/bench_lib.sh"
build=$(cd "${build:-$root/build}" && pwd) || exit 1
S=$build/tools/starling
[ -x "$S" ] || { echo "wan_bench: build first ($S)" >&2; exit 1; }
export STARLING_DELAY_BRIDGE=${STARLING_DELAY_BRIDGE:-$build/tests/wan/delay_bridge}
export STARLING_NETPROBE=${STARLING_NETPROBE:-$build/tests/wan/netprobe}
[ -x "$STARLING_NETPROBE" ] || STARLING_NETPROBE=""

# The trainer's wire-format flag: without it, only f32 (what it sends).
# (The help is read whole first: grep -q quits at the first match, and with
# pipefail the writer's SIGPIPE would fail the test.)
train_help=$("$S" train --help 2>&1)
if grep -q -- '--wire-format' <<<"$train_help"; then
    has_wire=1
else
    has_wire=0
    if [ "$formats" != f32 ]; then
        echo "wan_bench: this starling train has no --wire-format: running f32 only" >&2
    fi
    formats=f32
fi

. "$root/tests/wan/wanbed.sh"
work=$(mktemp -d "${TMPDIR:-/tmp}/starling-wanbench-XXXXXX") || exit 1
pids=""

cleanup() {
    stop_ours
    wanbed_down
    if [ -n "${KEEP_T:-}" ]; then echo "wan_bench: logs kept in $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 1' HUP INT TERM

export OPENBLAS_NUM_THREADS=1
die() { echo "wan_bench: $*" >&2; exit 1; }

# Host 1: bootstrap; hosts 2..4: peers; host 5: trainer (and the monitor).
# tiny-lm has three stages (embed, decoder, head): one per peer. Its figures
# are per token: tokens_per_s, bytes_per_token and val_bpb (bits per byte of
# the validation windows) instead of samples_per_s, bytes_per_sample and
# test_acc.
spans="0-1 2-3 4-5"
[ "$model" = tiny-lm ] && spans="0 1 2"
trainer_host=5

# wait_announced HOST SECONDS: until the monitor on the trainer's host shows
# the peer on HOST online on as many stages as it announces.
wait_announced() {
    wait_announced_peer "$work/peer$1.out" "$work/peer$1.err" "$2" "$model" wanbed_exec "$trainer_host"
}

# run_one PROFILE FORMAT: one training run on a fresh test bed; prints its line.
run_one() {
    prof=$1; fmt=$2
    tag="$prof-$(echo "$fmt" | tr ':' '_')"
    wanbed_up "$prof" 5
    wanbed_exec 1 "$S" bootstrap --listen "$(wanbed_addr 1):4000" >"$work/bs.out" 2>"$work/bs.err" &
    bs_pid=$!
    pids="$pids $bs_pid"
    wait_for "$work/bs.out" '/[0-9a-f]{40}$' 60 "$bs_pid" || { show "$work/bs.err"; die "$prof: the bootstrap node did not start"; }
    BS=$(head -1 "$work/bs.out")
    h=2
    for span in $spans; do
        # shellcheck disable=SC2086
        wanbed_exec "$h" "$S" peer --initial-peers "$BS" --listen "$(wanbed_addr "$h"):4001" --blocks "$span" \
            --model "$model" --blas-threads 1 --seed "$seed" ${PEER_ARGS:-} >"$work/peer$h.out" 2>"$work/peer$h.err" &
        eval "peer_pid$h=$!"
        pids="$pids $!"
        h=$((h + 1))
    done
    for h in 2 3 4; do
        eval "p=\$peer_pid$h"
        wait_for "$work/peer$h.err" 'online: announcing' 120 "$p" ||
            { show "$work/peer$h.out" "$work/peer$h.err"; die "$prof: the peer on host $h did not come online"; }
    done
    for h in 2 3 4; do
        wait_announced "$h" 120 ||
            { show "$work/peer$h.err" "$work/mon.json" "$work/mon.err"; die "$prof: the peer on host $h is not announced after 120 s"; }
    done
    wire=()
    [ "$has_wire" = 1 ] && wire=(--wire-format "$fmt")
    # In the background, so that a signal interrupts the wait at once.
    # shellcheck disable=SC2086
    if [ "$model" = tiny-lm ]; then
        what=(--model tiny-lm --steps "$steps" --eval-every "$steps" --seed "$seed")
    else
        what=(--train-samples "$train_samples" --test-samples "$test_samples" --seed "$seed" --sync "$sync")
    fi
    wanbed_exec "$trainer_host" timeout "$train_timeout" "$S" train --initial-peers "$BS" \
        "${what[@]}" "${wire[@]}" ${TRAIN_FLAGS:-} --json --metrics-log "" --plot "" >"$work/train-$tag.out" 2>"$work/train-$tag.err" &
    tr_pid=$!
    pids="$pids $tr_pid"
    wait "$tr_pid"
    rc=$?
    pids=${pids% "$tr_pid"}
    [ "$rc" -eq 0 ] || { show "$work/train-$tag.err"; die "$prof $fmt: starling train exited $rc"; }
    stop_ours
    wanbed_down
    if [ "$model" = tiny-lm ]; then
        sps=$(json_num "$work/train-$tag.out" tokens_per_s)
        n=$(json_num "$work/train-$tag.out" tokens)
        acc=$(json_num "$work/train-$tag.out" val_bpb)
        bps=$(json_num "$work/train-$tag.out" bytes_per_token)
    else
        sps=$(json_num "$work/train-$tag.out" samples_per_s)
        n=$(json_num "$work/train-$tag.out" samples)
        acc=$(json_num "$work/train-$tag.out" test_acc)
        bps=$(json_num "$work/train-$tag.out" bytes_per_sample)
    fi
    [ "$sps" != null ] && [ "$acc" != null ] || { show "$work/train-$tag.out"; die "$prof $fmt: no speed or quality figure in the trainer's line"; }
    got_fmt=$(json_str "$work/train-$tag.out" wire_format)
    [ -z "$got_fmt" ] || [ "$got_fmt" = "$fmt" ] ||
        echo "wan_bench: $prof: asked for $fmt, the trainer says wire_format $got_fmt" >&2
    if [ "$model" = tiny-lm ]; then
        echo "{\"bench\":\"wan\",\"model\":\"tiny-lm\",\"profile\":\"$prof\",\"format\":\"$fmt\",\"tokens\":$n,\"tokens_per_s\":$sps,\"bytes_per_token\":$bps,\"val_bpb\":$acc}"
    else
        echo "{\"bench\":\"wan\",\"profile\":\"$prof\",\"format\":\"$fmt\",\"samples\":$n,\"samples_per_s\":$sps,\"bytes_per_sample\":$bps,\"test_acc\":$acc}"
    fi | tee -a "$work/results"
}

: >"$work/results"
for prof in $profiles; do
    for fmt in $formats; do
        run_one "$prof" "$fmt"
    done
done

# The summary, from the lines above.
awk -v lm="$([ "$model" = tiny-lm ] && echo 1 || echo 0)" '
function field(line, key,    m) {
    if (match(line, "\"" key "\":(\"[^\"]*\"|[^,}]*)")) {
        m = substr(line, RSTART + length(key) + 3, RLENGTH - length(key) - 3)
        gsub(/"/, "", m)
        return m
    }
    return "null"
}
{
    p = field($0, "profile"); f = field($0, "format")
    sps[p, f] = field($0, lm ? "tokens_per_s" : "samples_per_s")
    bps[p, f] = field($0, lm ? "bytes_per_token" : "bytes_per_sample")
    acc[p, f] = field($0, lm ? "val_bpb" : "test_acc"); fmts[f] = 1
}
function ratio(a, b) { return (a == "null" || b == "null" || b + 0 == 0) ? "null" : sprintf("%.3f", a / b) }
END {
    best = ""
    for (f in fmts)
        if (f != "f32" && ((("wan", f) in sps) && (best == "" || sps["wan", f] + 0 > sps["wan", best] + 0)))
            best = f
    if (best == "" && (("wan", "f32") in sps)) best = "f32"
    if (best == "") {
        printf "{\"wan_vs_lan\":null,\"bytes_reduction\":null,\"%s\":null,\"best_format\":null}\n", lm ? "bpb_increase" : "acc_drop"
        exit
    }
    r = (("lan", "f32") in sps) ? ratio(sps["wan", best], sps["lan", "f32"]) : "null"
    x = (("wan", "f32") in bps) ? ratio(bps["wan", "f32"], bps["wan", best]) : "null"
    d = (("wan", "f32") in acc) ? sprintf("%.4f", lm ? acc["wan", best] - acc["wan", "f32"] : acc["wan", "f32"] - acc["wan", best]) : "null"
    printf "{\"wan_vs_lan\":%s,\"bytes_reduction\":%s,\"%s\":%s,\"best_format\":\"%s\"}\n", r, x, lm ? "bpb_increase" : "acc_drop", d, best
}' "$work/results"
