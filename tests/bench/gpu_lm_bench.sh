#!/bin/sh
# tests/bench/gpu_lm_bench.sh: tiny-lm trained through a swarm of three peers
# sharing one GPU, beside ../shared/bench/torch/train_lm.py on that GPU, from
# the SAME initial weights (train_lm.py --save-init, loaded by the peers with
# --init-weights) on the SAME windows (seed 0, 32 windows of 128+1 bytes per
# step, the same 256 validation windows), AdamW lr 1e-3 on both sides.
#
# Per round (precision): a bootstrap node and three peers
#     starling peer --model tiny-lm --blocks i --device cuda:0 --precision P
# (one stage each; no averaging, no cold copies), then
#     starling train --model tiny-lm --steps N --eval-every N --seed 0
# then, with the swarm stopped (the GPU to itself),
#     python3 train_lm.py --device cuda:0 --amp bf16|none --steps N --load-init FILE
# Rounds: bf16 (train_lm.py --amp bf16) and fp32 (--amp none, no TF32).
# The comparison: tokens/s (training only, evaluations excluded, both
# sides), the validation loss and bits/byte after the same N steps, and
# their difference; the target is |ours - torch| <= 0.02 bits/byte in bf16.
#
# Usage: tests/bench/gpu_lm_bench.sh [--quick] [--steps N] [--eval-every N]
#            [--data FILE] [--precision bf16|fp32|both] [--device cuda:N]
#            [--keep] [BUILD_DIR]
#   BUILD_DIR      where starling is (BUILD_DIR/tools/starling) when STARLING
#                  is not set (default: <tree>/build)
#   --quick        50 steps (about 2 minutes in all) instead of 200; also
#                  QUICK=1 in the environment
#   --steps N      optimizer steps per run (default 200)
#   --eval-every N evaluations every N steps (default: only at 0 and N)
#   --data FILE    the corpus, passed to both sides (default: the Debian
#                  fortunes files; without them FILE=fortunes.bin, made as
#                  ../shared/bench/torch/README.md "Corpus without apt" says;
#                  $TORCH_DIR/fortunes.bin or one beside this script is used
#                  when it exists; failing all of these, this tree's own text,
#                  ../../docs/*.md and ../../expert/*.c, as tests/test_swarm_lm.sh
#                  uses it: the comparison holds on any corpus, the JSON's
#                  "corpus" says which)
#   --precision P  the rounds to run (default both)
#   --device D     the GPU (default cuda:0); "cpu" runs the fp32 round on the
#                  CPU, to test this script on a machine without a GPU
#   --keep         keep the work directory (logs, JSON, init weights)
#
# Environment (a source tree needs none of it; a bundle sets the first two):
#   STARLING   the starling binary (default: <tree>/build/tools/starling)
#   TORCH_DIR  the folder with train_lm.py (default: $STARLING_TORCH_BENCH, then
#              <tree>/../shared/bench/torch, then <tree>/torch as in a bundle)
#   PY         the Python with torch (+ numpy) (default: python3)
#   WORK       the work directory, kept afterwards (default: a new one under
#              $TMPDIR, removed at the end unless --keep)
#   PEER_ARGS  extra flags for every peer; TRAIN_TIMEOUT, TORCH_TIMEOUT
#              seconds per run (default 900 each)
#
# Output: progress on stderr, one JSON line per finished run on stderr, and
# the last stdout line one JSON object:
#   {"bench":"gpu_lm_bench","ok":..,"steps":N,"device":..,"gpu":..,"corpus":..,
#    "target_bpb_diff":0.02,"rounds":[{"precision":"bf16","torch_amp":"bf16",
#      "starling":{"tokens_per_s","val_loss","val_bpb","val_loss_init","steps",
#                  "train_time_s","retries","refused","status",..},
#      "torch":{"tokens_per_s","val_loss","val_bpb","val_loss_init","steps",
#               "train_time_s","step_ms_median",..},
#      "bpb_diff" (ours - torch),"abs_bpb_diff","init_loss_diff",
#      "tokens_per_s_ratio" (ours / torch),"within_target"},...]}
# Exit status: 0 when every round ran and the bf16 round is within the
# target; 1 otherwise (the JSON says what failed); 2 usage; 77 skipped (no
# CUDA in this build, or no GPU).
set -u

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." 2>/dev/null && pwd) || root=$here
build=$root/build
TORCH_DIR=${TORCH_DIR:-${STARLING_TORCH_BENCH:-}}
if [ -z "$TORCH_DIR" ]; then
    TORCH_DIR=$root/../shared/bench/torch
    [ ! -f "$TORCH_DIR/train_lm.py" ] && [ -f "$root/torch/train_lm.py" ] && TORCH_DIR=$root/torch
fi
PY=${PY:-python3}
steps=200
[ "${QUICK:-0}" = 1 ] && steps=50
every=""
data=""
precisions="bf16 fp32"
dev=cuda:0
keep=0
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) steps=50 ;;
        --steps) [ $# -ge 2 ] || { usage >&2; exit 2; }; steps=$2; shift ;;
        --eval-every) [ $# -ge 2 ] || { usage >&2; exit 2; }; every=$2; shift ;;
        --data) [ $# -ge 2 ] || { usage >&2; exit 2; }; data=$2; shift ;;
        --precision)
            [ $# -ge 2 ] || { usage >&2; exit 2; }
            case "$2" in
                both) precisions="bf16 fp32" ;;
                bf16|fp32) precisions=$2 ;;
                *) echo "gpu_lm_bench: --precision must be bf16, fp32 or both" >&2; exit 2 ;;
            esac
            shift ;;
        --device) [ $# -ge 2 ] || { usage >&2; exit 2; }; dev=$2; shift ;;
        --keep) keep=1 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "gpu_lm_bench: unknown option '$1'" >&2; usage >&2; exit 2 ;;
        *) build=$1 ;;
    esac
    shift
done
case "$steps" in ''|*[!0-9]*) echo "gpu_lm_bench: --steps must be a number" >&2; exit 2 ;; esac
[ "$steps" -ge 1 ] || { echo "gpu_lm_bench: --steps must be 1 or more" >&2; exit 2; }
[ -n "$every" ] || every=$steps
case "$every" in ''|*[!0-9]*) echo "gpu_lm_bench: --eval-every must be a number" >&2; exit 2 ;; esac
case "$dev" in
    cuda|cuda:[0-9]*) ;;
    cpu) precisions=fp32 ;;
    *) echo "gpu_lm_bench: --device must be cuda:N (or cpu, to test the script)" >&2; exit 2 ;;
esac
S=${STARLING:-$build/tools/starling}
train_timeout=${TRAIN_TIMEOUT:-900}
torch_timeout=${TORCH_TIMEOUT:-900}

log() { echo "gpu_lm_bench: $*" >&2; }
[ -x "$S" ] || { log "no starling binary at '$S' (set STARLING)"; exit 1; }

if [ -n "${WORK:-}" ]; then work=$WORK; mkdir -p "$work" || exit 1; keep=1; else
    work=$(mktemp -d "${TMPDIR:-/tmp}/starling-gpulm-XXXXXX") || exit 1; fi
pids=""

# stop_ours, show, wait_for, wait_announced_peer: the swarm benchmarks'
# shared helpers (they read $work, $pids, $S and $BS).
# shellcheck source=tests/bench/bench_lib.sh
. "$(dirname "$0")/bench_lib.sh"
cleanup() {
    stop_ours
    if [ "$keep" = 1 ]; then log "files kept in $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# run_fg CMD...: runs CMD in the background and waits for it, so that a
# signal to this script runs the trap (which then stops CMD) at once.
# Returns CMD's exit status.
run_fg() {
    "$@" &
    rf_pid=$!
    pids="$pids $rf_pid"
    wait "$rf_pid"
    rf_rc=$?
    pids=$(echo "$pids" | tr ' ' '\n' | grep -vx "$rf_pid" | tr '\n' ' ')
    return "$rf_rc"
}

# ---- 1. Is there a GPU? (a peer's device check: no network is touched)
if [ "$dev" != cpu ]; then
    timeout 120 "$S" peer --device "$dev" --model tiny-lm --blocks 99 >"$work/probe.out" 2>"$work/probe.err"
    rc=$?
    if grep -q "cannot use device" "$work/probe.err"; then
        echo "skipped: $(grep -m1 "cannot use device" "$work/probe.err")"
        exit 77
    fi
    if [ "$rc" -ne 2 ] || ! grep -q "has stages" "$work/probe.err"; then
        log "the device probe ('starling peer --device $dev --blocks 99') exited $rc unexpectedly"
        show "$work/probe.err"
        exit 1
    fi
fi

# ---- 2. The corpus, Python and torch
corpus_desc=""
corpus_kind=""
if [ -z "$data" ]; then
    if dpkg -L fortunes >/dev/null 2>&1 && [ -d /usr/share/games/fortunes ]; then
        corpus_desc="fortunes packages"
    elif [ -f "$TORCH_DIR/fortunes.bin" ]; then
        data=$TORCH_DIR/fortunes.bin
    elif [ -f "$here/fortunes.bin" ]; then
        data=$here/fortunes.bin
    elif [ -f "$root/fortunes.bin" ]; then
        data=$root/fortunes.bin
    elif cat "$here"/../../docs/*.md "$here"/../../expert/*.c >"$work/corpus.txt" 2>/dev/null &&
        [ "$(wc -c <"$work/corpus.txt")" -gt 100000 ]; then
        data=$work/corpus.txt
        corpus_kind="this tree's docs/*.md + expert/*.c"
        log "no fortunes packages and no fortunes.bin (see $TORCH_DIR/README.md 'Corpus without apt'):"
        log "the corpus is this tree's docs/*.md and expert/*.c instead"
    else
        log "no corpus: the fortunes packages are not installed; make fortunes.bin as"
        log "$TORCH_DIR/README.md 'Corpus without apt' says and pass --data fortunes.bin"
        exit 1
    fi
fi
if [ -n "$data" ]; then
    [ -r "$data" ] || { log "--data $data: cannot read it"; exit 1; }
    data=$(cd "$(dirname "$data")" && pwd)/$(basename "$data")
    corpus_desc=${corpus_kind:-$data}
    if command -v sha256sum >/dev/null; then
        corpus_desc="$corpus_desc sha256 $(sha256sum "$data" | cut -c1-16) ($(wc -c <"$data") bytes)"
    fi
fi
log "corpus: $corpus_desc; steps $steps, evaluations every $every; rounds: $precisions on $dev"

torch_ok=0 torch_cuda=0 torch_why=""
if ! command -v "$PY" >/dev/null 2>&1; then
    torch_why="no '$PY' (set PY)"
elif [ ! -f "$TORCH_DIR/train_lm.py" ]; then
    torch_why="no train_lm.py in '$TORCH_DIR' (set TORCH_DIR)"
elif ! "$PY" -c 'import torch, numpy' >"$work/py.out" 2>&1; then
    torch_why="'$PY' cannot import torch and numpy: $(tail -1 "$work/py.out")"
else
    torch_ok=1
    if [ "$dev" = cpu ] || "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        torch_cuda=1
    else
        torch_why="torch.cuda.is_available() is False for '$PY'"
    fi
fi
[ -z "$torch_why" ] || log "torch side unavailable: $torch_why"

# ---- 3. The initial weights: train_lm.py's (its torch init, seed 0), on the CPU
init=""
if [ "$torch_ok" = 1 ]; then
    log "initial weights: train_lm.py --steps 0 --save-init"
    if run_fg timeout 600 "$PY" "$TORCH_DIR/train_lm.py" --steps 0 --eval-batches 1 --threads 4 --seed 0 \
        --save-init "$work/init.bin" ${data:+--data "$data"} >"$work/init.log" 2>"$work/init.err" &&
        [ -s "$work/init.bin" ]; then
        init=$work/init.bin
    else
        torch_ok=0 torch_cuda=0 torch_why="train_lm.py --save-init failed: $(tail -1 "$work/init.err")"
        log "$torch_why"
    fi
fi
[ -n "$init" ] || log "the peers start from their own initial weights (--seed 0): the curves cannot be compared"

# ---- 4. The rounds
# starling_round P: the swarm's run at precision P; writes $work/starling-P.json
# (the train's --json line) and $work/starling-P.jsonl (its metrics log).
# The swarm is stopped at the end, whatever happened.
starling_round() {
    swarm_run "$1"
    sr_rc=$?
    stop_ours
    return "$sr_rc"
}
swarm_run() {
    prec=$1
    : >"$work/bs.out"
    "$S" bootstrap --listen 127.0.0.1:0 >"$work/bs.out" 2>"$work/bs.err" &
    bs_pid=$!
    pids="$pids $bs_pid"
    wait_for "$work/bs.out" '/[0-9a-f]{40}$' 60 "$bs_pid" || { log "bootstrap did not start"; show "$work/bs.err"; return 1; }
    BS=$(head -1 "$work/bs.out")
    prec_flag=$prec
    [ "$dev" = cpu ] && prec_flag=""
    for b in 0 1 2; do
        : >"$work/peer-$prec-$b.out"; : >"$work/peer-$prec-$b.err"
        # shellcheck disable=SC2086
        "$S" peer --initial-peers "$BS" --model tiny-lm --blocks "$b" --device "$dev" ${prec_flag:+--precision "$prec_flag"} \
            ${init:+--init-weights "$init"} --average-every 0 --keep-every 0 --blas-threads 1 ${PEER_ARGS:-} \
            >"$work/peer-$prec-$b.out" 2>"$work/peer-$prec-$b.err" &
        eval "peer_pid_$b=$!"
        pids="$pids $!"
    done
    for b in 0 1 2; do
        eval "pp=\$peer_pid_$b"
        # shellcheck disable=SC2154
        wait_for "$work/peer-$prec-$b.err" 'online: announcing' 180 "$pp" ||
            { log "peer $b ($prec) did not come online"; show "$work/peer-$prec-$b.err"; return 1; }
        wait_announced_peer "$work/peer-$prec-$b.out" "$work/peer-$prec-$b.err" 120 tiny-lm timeout 30 ||
            { log "peer $b's announcements never became visible"; show "$work/peer-$prec-$b.err"; return 1; }
    done
    grep -m1 "blocks on" "$work/peer-$prec-0.err" >&2
    log "starling train ($prec): $steps steps"
    run_fg timeout "$train_timeout" "$S" train --initial-peers "$BS" --model tiny-lm --steps "$steps" \
        --eval-every "$every" --seed 0 ${data:+--data "$data"} --json --metrics-log "$work/starling-$prec.jsonl" \
        --plot "" >"$work/starling-$prec.json" 2>"$work/starling-$prec.err"
    rc=$?
    if [ "$rc" -ne 0 ]; then
        log "starling train ($prec) exited $rc"
        show "$work/starling-$prec.err" "$work/peer-$prec-0.err" "$work/peer-$prec-1.err" "$work/peer-$prec-2.err"
    else
        tail -1 "$work/starling-$prec.json" >&2
    fi
    for b in 0 1 2; do
        if grep -Eq "ERROR|error:|refused" "$work/peer-$prec-$b.err"; then
            log "peer $b ($prec) said:"; grep -Em5 "ERROR|error:|refused" "$work/peer-$prec-$b.err" >&2
        fi
    done
    return "$rc"
}

# torch_round P: train_lm.py at P (bf16: --amp bf16; fp32: --amp none);
# writes $work/torch-P.json (its JSON line).
torch_round() {
    prec=$1
    amp=none
    [ "$prec" = bf16 ] && amp=bf16
    log "train_lm.py --device $dev --amp $amp: $steps steps"
    run_fg timeout "$torch_timeout" "$PY" "$TORCH_DIR/train_lm.py" --device "$dev" --amp "$amp" \
        --steps "$steps" --eval-every "$every" --seed 0 --load-init "$init" ${data:+--data "$data"} \
        >"$work/torch-$prec.log" 2>"$work/torch-$prec.err"
    rc=$?
    tail -1 "$work/torch-$prec.log" >"$work/torch-$prec.json"
    if [ "$rc" -ne 0 ]; then
        log "train_lm.py ($prec) exited $rc"; show "$work/torch-$prec.err"
    else
        grep -E '^step ' "$work/torch-$prec.log" | tail -1 >&2
    fi
    return "$rc"
}

for prec in $precisions; do
    starling_round "$prec"
    echo "$?" >"$work/starling-$prec.rc"
    if [ "$torch_cuda" = 1 ] && [ -n "$init" ]; then
        torch_round "$prec"
        echo "$?" >"$work/torch-$prec.rc"
    fi
done

# ---- 5. The report
if ! command -v "$PY" >/dev/null 2>&1; then
    # No Python at all: the swarm's own lines, as they are.
    for prec in $precisions; do
        printf '{"bench":"gpu_lm_bench","precision":"%s","starling":%s}\n' "$prec" \
            "$(tail -1 "$work/starling-$prec.json" 2>/dev/null || echo null)" >&2
    done
    echo "{\"bench\":\"gpu_lm_bench\",\"ok\":false,\"error\":\"no python: $torch_why\"}"
    exit 1
fi
# shellcheck disable=SC2086
"$PY" - "$work" "$steps" "$every" "$dev" "$corpus_desc" "$torch_why" $precisions <<'PYEOF'
import json, math, os, sys

work, steps, every, dev, corpus_desc, torch_why = sys.argv[1:7]
precisions = sys.argv[7:]
steps, every = int(steps), int(every)
TARGET = 0.02
LN2 = math.log(2)


def last_json(path):
    try:
        with open(path) as f:
            lines = [l for l in f.read().splitlines() if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def rc_of(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def tail(path, n=3):
    try:
        with open(path, errors="replace") as f:
            return [l.rstrip() for l in f.readlines()[-n:]]
    except OSError:
        return []


gpu = None
rounds, ok = [], True
for p in precisions:
    r = {"precision": p, "torch_amp": "bf16" if p == "bf16" else "none"}
    ours = last_json(f"{work}/starling-{p}.json")
    evals = []
    try:
        with open(f"{work}/starling-{p}.jsonl") as f:
            evals = [json.loads(l) for l in f if '"event":"eval"' in l]
    except (OSError, ValueError):
        pass
    src = rc_of(f"{work}/starling-{p}.rc")
    if ours and src == 0:
        s = {k: ours.get(k) for k in ("tokens_per_s", "val_loss", "val_bpb", "val_acc", "steps", "tokens",
                                       "train_time_s", "retries", "refused", "refused_samples", "errors",
                                       "status", "stopped_early")}
        s["val_loss_init"] = evals[0]["val_loss"] if evals and evals[0].get("step") == 0 else None
        s["curve"] = [[e["step"], round(e["val_loss"], 6)] for e in evals]
        for b in range(3):
            for line in tail(f"{work}/peer-{p}-{b}.err", 400):
                if "blocks on" in line:
                    s.setdefault("peers", []).append(line.split("blocks on", 1)[1].strip())
                    break
    else:
        s = {"ok": False, "rc": src, "error": tail(f"{work}/starling-{p}.err")}
        ok = False
    r["starling"] = s

    t = last_json(f"{work}/torch-{p}.json")
    trc = rc_of(f"{work}/torch-{p}.rc")
    if t and trc == 0:
        gpu = gpu or (t.get("gpu") or {}).get("name")
        r["torch"] = {"tokens_per_s": t.get("tokens_per_s"), "val_loss": t.get("val_loss_final"),
                      "val_bpb": t.get("val_bpb_final"), "val_loss_init": t.get("val_loss_init"),
                      "steps": t.get("steps_done"), "train_time_s": t.get("train_time_s"),
                      "step_ms_median": t.get("step_ms_median"), "amp": t.get("amp"),
                      "device": t.get("device"), "corpus_sha256_16": (t.get("corpus") or {}).get("sha256_16"),
                      "curve": [[c[0], c[2]] for c in t.get("curve", [])],
                      "max_memory_allocated_mib": (t.get("gpu") or {}).get("max_memory_allocated_mib")}
    elif trc is None:
        r["torch"] = {"ok": False, "error": torch_why or "not run"}
        ok = False
    else:
        r["torch"] = {"ok": False, "rc": trc, "error": tail(f"{work}/torch-{p}.err")}
        ok = False

    s, tt = r["starling"], r["torch"]
    if s.get("val_bpb") is not None and tt.get("val_bpb") is not None:
        # Both from the losses (bits = nats / ln 2), at full precision.
        d = s["val_loss"] / LN2 - tt["val_loss"] / LN2
        r["bpb_diff"] = round(d, 5) + 0.0  # no "-0.0"
        r["abs_bpb_diff"] = round(abs(d), 5)
        r["same_steps"] = s.get("steps") == tt.get("steps") == steps
        if s.get("val_loss_init") is not None and tt.get("val_loss_init") is not None:
            r["init_loss_diff"] = round(s["val_loss_init"] - tt["val_loss_init"], 6)
        if s.get("tokens_per_s") and tt.get("tokens_per_s"):
            r["tokens_per_s_ratio"] = round(s["tokens_per_s"] / tt["tokens_per_s"], 3)
        r["within_target"] = abs(d) <= TARGET and r["same_steps"]
        if p == "bf16" and not r["within_target"]:
            ok = False
    else:
        r["within_target"] = None
    rounds.append(r)
    print(json.dumps(r), file=sys.stderr)

out = {"bench": "gpu_lm_bench", "ok": ok, "model": "tiny-lm", "steps": steps, "eval_every": every,
       "device": dev, "gpu": gpu, "corpus": corpus_desc, "target_bpb_diff": TARGET,
       "target_precision": "bf16", "rounds": rounds}
print(json.dumps(out), flush=True)
sys.exit(0 if ok else 1)
PYEOF
