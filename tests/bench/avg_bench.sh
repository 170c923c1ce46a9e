#!/usr/bin/env bash
# tests/bench/avg_bench.sh: training with replica averaging on loopback, per
# group size, averaging mode and averaging format.
#
# For each G (replicas of every stage), each --average-mode and each
# averaging format (--average-format, when the peer has it): a bootstrap
# node and G peers that each hold ALL six stages of fmnist-mlp (--blocks
# 0-5, one BLAS thread each, the same --seed, so every stage has G replicas
# that start from the same weights), averaging every PERIOD seconds, each
# serving its metrics (--metrics 127.0.0.1:0). They are waited for
# (bounded) until `starling monitor` shows each one online on all six
# stages; then `starling train --json` trains on the same samples in the
# same order (--seed), spreading its micro-batches over the replicas, and
# evaluates through the swarm. Around the training run the script reads
# every peer's /metrics (before and after) and the averaging lines the
# peers logged meanwhile.
#
# Prints one JSON line per configuration:
#   {"bench":"avg","G":G,"mode":M,"format":F,"samples":N,"samples_per_s":X,
#    "test_acc":A,"rounds":R,"abandoned":B,"bytes_per_round":Y,"round_s":T,
#    "full_groups":P,"log_bytes_per_round":Z,"period_s":S}
#   samples, samples_per_s, test_acc: the trainer's --json line (training
#     throughput, evaluation excluded; accuracy on the test samples after
#     the run, evaluated through the swarm's replicas);
#   rounds, abandoned: averaging rounds completed / abandoned during the
#     training run (training and its evaluation), from
#     starling_avg_rounds_total, per block and member: the counts summed over
#     the G members and 6 blocks, divided by 6 G;
#   bytes_per_round: averaging bytes one member received for one block in
#     one completed round (starling_avg_bytes_total{direction="received"},
#     summed over members and blocks, over the completed block rounds);
#     null when the peers do not export the counter;
#   round_s: median over the members' rounds of the round's time (begin to
#     apply, the slowest of the member's six blocks, whose rounds run at
#     once), from the peers' logs; null when no round completed;
#   full_groups: share of the completed block rounds (logged) whose group
#     held all G replicas;
#   log_bytes_per_round: as bytes_per_round, from the MB the peers log for
#     each round (0.1 MB resolution; received only);
# then a summary line
#   {"torch_local_acc":A,"torch_samples":N,"best":{"G","mode","format",
#    "test_acc"},"best_gap_points":D,"diloco_q8_bytes_reduction":X}
#   torch_local_acc: ../shared/bench/torch/train_local.py for one epoch cut
#     to the same number of samples (--max-steps N/128: batch 128, Adam,
#     test accuracy on all 10,000 test images), run once; null with -T;
#   best: the configuration with the highest test_acc; best_gap_points:
#     (torch_local_acc - its test_acc) x 100;
#   diloco_q8_bytes_reduction: bytes_per_round of mean f32 over that of
#     diloco q8, at the largest G where both ran (null otherwise).
#
# Every process it started is stopped and reaped on exit, also on failure,
# Ctrl-C or SIGTERM.
set -u -o pipefail

usage() {
    cat <<'EOF'
Usage: tests/bench/avg_bench.sh [options] [BUILD_DIR]     (default BUILD_DIR: build)

Trains fmnist-mlp on a loopback swarm of G peers that each hold all six stages
(G replicas of every stage, averaging every PERIOD s), for each G, averaging
mode and averaging format; prints one JSON line per configuration and a
summary line against torch's single-process training.

Options (environment variable in brackets):
  -g, --groups LIST        replicas per stage, space or comma separated
                                                      [SIZES; "2 4 8"]
  -m, --modes LIST         --average-mode values      [MODES; "mean diloco"]
  -f, --formats LIST       --average-format values: f32 f16 bf16 q8[:BLOCK]
                           [FORMATS; "f32 q8"] (only f32 when the peer has
                           no --average-format)
  -n, --train-samples N    training samples per run   [TRAIN_SAMPLES; 60000]
  -t, --test-samples N     test samples per evaluation [TEST_SAMPLES; 10000]
  -e, --average-every S    the peers' --average-every [PERIOD; 10]
  -s, --seed N             peers' initial weights, data order, torch's seed
                                                      [SEED; 0]
  -T, --no-torch           do not run train_local.py  [SKIP_TORCH=1]
      --train-timeout S    give up on one training run after S s
                                                      [TRAIN_TIMEOUT; 900]
  -h, --help               this text
Also: TRAIN_FLAGS (extra flags for starling train), PEER_ARGS (for every
peer), PYTHON (for the analysis and torch; default /usr/bin/python3),
TORCH_DIR (default ../shared/bench/torch beside the repository), KEEP_T=1
keeps the logs.
A default run (3 group sizes x 2 modes, f32 only, one epoch each, and torch)
took 7 minutes on a quiet 2-core machine (12 under load); with q8 too, about
twice that. -n 12000 takes about a third.
EOF
}

groups=${SIZES:-2 4 8}
modes=${MODES:-mean diloco}
formats=${FORMATS:-f32 q8}
train_samples=${TRAIN_SAMPLES:-60000}
test_samples=${TEST_SAMPLES:-10000}
period=${PERIOD:-10}
seed=${SEED:-0}
skip_torch=${SKIP_TORCH:-}
train_timeout=${TRAIN_TIMEOUT:-900}
build=""
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        -g|--groups) [ $# -ge 2 ] || { usage >&2; exit 2; }; groups=$2; shift ;;
        -m|--modes) [ $# -ge 2 ] || { usage >&2; exit 2; }; modes=$2; shift ;;
        -f|--formats) [ $# -ge 2 ] || { usage >&2; exit 2; }; formats=$2; shift ;;
        -n|--train-samples) [ $# -ge 2 ] || { usage >&2; exit 2; }; train_samples=$2; shift ;;
        -t|--test-samples) [ $# -ge 2 ] || { usage >&2; exit 2; }; test_samples=$2; shift ;;
        -e|--average-every) [ $# -ge 2 ] || { usage >&2; exit 2; }; period=$2; shift ;;
        -s|--seed) [ $# -ge 2 ] || { usage >&2; exit 2; }; seed=$2; shift ;;
        -T|--no-torch) skip_torch=1 ;;
        --train-timeout) [ $# -ge 2 ] || { usage >&2; exit 2; }; train_timeout=$2; shift ;;
        -*) echo "avg_bench: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) [ -z "$build" ] || { usage >&2; exit 2; }; build=$1 ;;
    esac
    shift
done
groups=$(echo "$groups" | tr ',' ' ')
modes=$(echo "$modes" | tr ',' ' ')
formats=$(echo "$formats" | tr ',' ' ')
for v in "$train_samples" "$test_samples" "$period" "$seed" "$train_timeout" $groups; do
    case $v in ''|*[!0-9]*) echo "avg_bench: not a number: '$v'" >&2; exit 2 ;; esac
done
for g in $groups; do
    [ "$g" -ge 2 ] || { echo "avg_bench: a group needs 2 replicas or more (got $g)" >&2; exit 2; }
done
for m in $modes; do
    case $m in mean|diloco) ;; *) echo "avg_bench: unknown mode '$m' (mean, diloco)" >&2; exit 2 ;; esac
done
[ "$period" -ge 1 ] || { echo "avg_bench: --average-every must be 1 or more" >&2; exit 2; }
[ -n "$groups" ] && [ -n "$modes" ] && [ -n "$formats" ] || { echo "avg_bench: no groups, modes or formats" >&2; exit 2; }

root=$(cd "$(dirname "$0")/../.." && pwd)
. "$root/tests/bench/bench_lib.sh"
build=$(cd "${build:-$root/build}" && pwd) || exit 1
S=$build/tools/starling
[ -x "$S" ] || { echo "avg_bench: build first ($S)" >&2; exit 1; }
PY=${PYTHON:-/usr/bin/python3}
[ -x "$PY" ] || PY=$(command -v python3) || { echo "avg_bench: needs python3" >&2; exit 1; }
torch_dir=${TORCH_DIR:-$root/../shared/bench/torch}

# The peer's averaging-format flag: without it, only f32 (what it sends).
# (The help is read whole first: grep -q quits at the first match, and with
# pipefail the writer's SIGPIPE would fail the test.)
peer_help=$("$S" peer --help 2>&1)
if grep -q -- '--average-format' <<<"$peer_help"; then
    has_fmt=1
else
    has_fmt=0
    if [ "$formats" != f32 ]; then
        echo "avg_bench: this starling peer has no --average-format: running f32 only" >&2
    fi
    formats=f32
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/starling-avgbench-XXXXXX") || exit 1
pids=""

cleanup() {
    stop_ours
    if [ -n "${KEEP_T:-}" ]; then echo "avg_bench: logs kept in $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 1' HUP INT TERM

export OPENBLAS_NUM_THREADS=1
die() { echo "avg_bench: $*" >&2; exit 1; }

# wait_announced I SECONDS: until `starling monitor` shows peer I online on
# as many stages as it announces (swarm_lib.sh's way).
wait_announced() {
    wait_announced_peer "$work/p$1.out" "$work/p$1.err" "$2" fmnist-mlp
}

# scrape I FILE: peer I's /metrics into FILE.
scrape() {
    url=$(sed -n 's#.*metrics on \(http://[^ ]*/metrics\).*#\1#p' "$work/p$1.err" | tail -1)
    [ -n "$url" ] || return 1
    curl -fsS --max-time 10 "$url" >"$2" 2>/dev/null && return 0
    "$PY" -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' \
        "$url" >"$2" 2>/dev/null
}

# run_one G MODE FORMAT: one training run on a fresh swarm; prints its line.
run_one() {
    g=$1; mode=$2; fmt=$3
    tag="g$g-$mode-$(echo "$fmt" | tr ':' '_')"
    rm -f "$work"/p*.out "$work"/p*.err "$work"/m*.txt "$work"/bs.*
    "$S" bootstrap --listen 127.0.0.1:0 >"$work/bs.out" 2>"$work/bs.err" &
    bs_pid=$!
    pids="$pids $bs_pid"
    wait_for "$work/bs.out" '/[0-9a-f]{40}$' 60 "$bs_pid" || { show "$work/bs.err"; die "$tag: the bootstrap node did not start"; }
    BS=$(head -1 "$work/bs.out")
    fmt_flag=()
    [ "$has_fmt" = 1 ] && fmt_flag=(--average-format "$fmt")
    for i in $(seq 1 "$g"); do
        # shellcheck disable=SC2086
        "$S" peer --initial-peers "$BS" --listen 127.0.0.1:0 --blocks 0-5 --blas-threads 1 --seed "$seed" \
            --average-every "$period" --average-mode "$mode" "${fmt_flag[@]}" --metrics 127.0.0.1:0 \
            ${PEER_ARGS:-} >"$work/p$i.out" 2>"$work/p$i.err" &
        eval "peer_pid$i=$!"
        pids="$pids $!"
    done
    for i in $(seq 1 "$g"); do
        eval "p=\$peer_pid$i"
        wait_for "$work/p$i.err" 'online: announcing' 180 "$p" ||
            { show "$work/p$i.out" "$work/p$i.err"; die "$tag: peer $i did not come online"; }
    done
    for i in $(seq 1 "$g"); do
        wait_announced "$i" 120 ||
            { show "$work/p$i.err" "$work/mon.json" "$work/mon.err"; die "$tag: peer $i is not announced after 120 s"; }
    done
    for i in $(seq 1 "$g"); do
        scrape "$i" "$work/m$i.before.txt" || { show "$work/p$i.err"; die "$tag: cannot read peer $i's metrics"; }
        wc -l <"$work/p$i.err" >"$work/p$i.skip"
    done
    # In the background, so that a signal interrupts the wait at once.
    # shellcheck disable=SC2086
    timeout "$train_timeout" "$S" train --initial-peers "$BS" --train-samples "$train_samples" \
        --test-samples "$test_samples" --seed "$seed" ${TRAIN_FLAGS:-} --json --metrics-log "" --plot "" \
        >"$work/train-$tag.out" 2>"$work/train-$tag.err" &
    tr_pid=$!
    pids="$pids $tr_pid"
    wait "$tr_pid"
    rc=$?
    pids=${pids% "$tr_pid"}
    [ "$rc" -eq 0 ] || { show "$work/train-$tag.err"; die "$tag: starling train exited $rc"; }
    for i in $(seq 1 "$g"); do
        scrape "$i" "$work/m$i.after.txt" || { show "$work/p$i.err"; die "$tag: cannot read peer $i's metrics"; }
    done
    stop_ours
    for i in $(seq 1 "$g"); do cp "$work/p$i.err" "$work/log-$tag-p$i.err"; done
    sps=$(json_num "$work/train-$tag.out" samples_per_s)
    n=$(json_num "$work/train-$tag.out" samples)
    acc=$(json_num "$work/train-$tag.out" test_acc)
    [ "$sps" != null ] && [ "$acc" != null ] || { show "$work/train-$tag.out"; die "$tag: no samples_per_s or test_acc in the trainer's line"; }
    "$PY" - "$work" "$g" "$mode" "$fmt" "$n" "$sps" "$acc" "$period" <<'PYEOF' | tee -a "$work/results"
import json, re, statistics, sys
work, g, mode, fmt, n, sps, acc, period = sys.argv[1:]
g = int(g)
sample = re.compile(r'^(starling_avg_(?:rounds|bytes)_total)\{([^}]*)\}\s+([0-9.eE+-]+)\s*$')

def scrape(path):
    out = {}
    for line in open(path):
        m = sample.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        key = (m.group(1), labels.get("block", ""), labels.get("result") or labels.get("direction"))
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out

def total(name, what):
    return sum(v for k, v in delta.items() if k[0] == name and k[2] == what)

# Counter increments over the training run, summed over the members.
delta, has_bytes = {}, False
for i in range(1, g + 1):
    b, a = scrape(f"{work}/m{i}.before.txt"), scrape(f"{work}/m{i}.after.txt")
    for k, v in a.items():
        delta[k] = delta.get(k, 0.0) + v - b.get(k, 0.0)
        if k[0] == "starling_avg_bytes_total":
            has_bytes = True
completed = total("starling_avg_rounds_total", "completed")
abandoned = total("starling_avg_rounds_total", "abandoned")
# Per block: bytes received per completed round and member; then the mean
# over the blocks that completed a round (the blocks differ in size, and
# the small ones complete more rounds, so a plain total / rounds would
# depend on which blocks' rounds fell inside the run).
per_block = []
for blk in sorted({k[1] for k in delta if k[0] == "starling_avg_rounds_total"}):
    c = delta.get(("starling_avg_rounds_total", blk, "completed"), 0.0)
    r = delta.get(("starling_avg_bytes_total", blk, "received"), 0.0)
    if c > 0:
        per_block.append(r / c)
bytes_per_round = round(statistics.mean(per_block)) if has_bytes and per_block else None

# The peers' logs since the training run began: one line per block round.
line = re.compile(r'fmnist-mlp\.(\d): averaged in a group of (\d+) \((?:diloco, )?round (\d+), '
                  r'our weight [^,]*, (?:[a-z0-9:]+ slices, )?([0-9.]+) MB in ([0-9.]+) s;')
per_round, mb, full, logged = {}, {}, 0, 0
for i in range(1, g + 1):
    skip = int(open(f"{work}/p{i}.skip").read())
    for l in open(f"{work}/p{i}.err").readlines()[skip:]:
        m = line.search(l)
        if not m:
            continue
        logged += 1
        full += int(m.group(2)) == g
        mb.setdefault(m.group(1), []).append(float(m.group(4)))
        key = (i, m.group(3))
        per_round[key] = max(per_round.get(key, 0.0), float(m.group(5)))
log_bytes = round(statistics.mean(statistics.mean(v) for v in mb.values()) * 1e6) if mb else None
round_s = round(statistics.median(per_round.values()), 3) if per_round else None
print(json.dumps({"bench": "avg", "G": g, "mode": mode, "format": fmt, "samples": int(float(n)),
                  "samples_per_s": float(sps), "test_acc": float(acc),
                  "rounds": round(completed / (6 * g), 2), "abandoned": round(abandoned / (6 * g), 2),
                  "bytes_per_round": bytes_per_round, "round_s": round_s,
                  "full_groups": round(full / logged, 3) if logged else None,
                  "log_bytes_per_round": log_bytes,
                  "period_s": float(period)}, separators=(",", ":")))
PYEOF
}

: >"$work/results"
for g in $groups; do
    for mode in $modes; do
        for fmt in $formats; do
            case "$mode:$fmt" in
            mean:q8* | mean:f16)
                # starling peer refuses these (AdamW's second moments).
                echo "avg_bench: G=$g: no mean run with $fmt (the peer takes it with diloco only; bf16 with mean)" >&2
                continue ;;
            esac
            run_one "$g" "$mode" "$fmt"
        done
    done
done

# torch in one process, for the same number of samples (batch 128: whole
# steps only), with the CPU's own kernels as starling uses by default.
torch_acc=null
torch_n=null
if [ -z "$skip_torch" ]; then
    if [ -f "$torch_dir/train_local.py" ]; then
        steps=$((train_samples / 128))
        [ "$steps" -ge 1 ] || steps=1
        (cd "$torch_dir" && exec env -u OPENBLAS_CORETYPE "$PY" train_local.py --epochs 1 --max-steps "$steps" \
            --seed "$seed" --threads 1:2) >"$work/torch.out" 2>"$work/torch.err" &
        t_pid=$!
        pids="$pids $t_pid"
        if wait "$t_pid"; then
            torch_acc=$(sed -n 's/.*"test_acc": *\([0-9.]*\).*/\1/p' "$work/torch.out" | tail -1)
            torch_n=$(sed -n 's/.*"samples": *\([0-9]*\).*/\1/p' "$work/torch.out" | tail -1)
            torch_acc=${torch_acc:-null}; torch_n=${torch_n:-null}
        else
            show "$work/torch.err"
            echo "avg_bench: train_local.py failed; torch_local_acc is null" >&2
        fi
        pids=${pids% "$t_pid"}
    else
        echo "avg_bench: no $torch_dir/train_local.py; torch_local_acc is null" >&2
    fi
fi

"$PY" - "$work/results" "$torch_acc" "$torch_n" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
torch_acc = None if sys.argv[2] == "null" else float(sys.argv[2])
torch_n = None if sys.argv[3] == "null" else int(sys.argv[3])
best = max(rows, key=lambda r: r["test_acc"]) if rows else None
red = None
for g in sorted({r["G"] for r in rows}, reverse=True):
    f32 = [r for r in rows if r["G"] == g and r["mode"] == "mean" and r["format"] == "f32"]
    q8 = [r for r in rows if r["G"] == g and r["mode"] == "diloco" and r["format"].startswith("q8")]
    if f32 and q8 and f32[0]["bytes_per_round"] and q8[0]["bytes_per_round"]:
        red = round(f32[0]["bytes_per_round"] / q8[0]["bytes_per_round"], 2)
        break
print(json.dumps({"torch_local_acc": torch_acc, "torch_samples": torch_n,
                  "best": {k: best[k] for k in ("G", "mode", "format", "test_acc")} if best else None,
                  "best_gap_points": round((torch_acc - best["test_acc"]) * 100, 2)
                  if best and torch_acc is not None else None,
                  "diloco_q8_bytes_reduction": red}, separators=(",", ":")))
PYEOF
