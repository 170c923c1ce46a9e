#!/usr/bin/env bash
# tools/gpu-check.sh: the checks a session runs on a machine with an NVIDIA
# GPU: what the machine has, every GPU test, then the GPU benchmarks (one
# JSON line each), all in a bounded time (default budget 7.5 minutes).
#
# Usage:
#   starling-bundle/tools/gpu-check.sh [OPTIONS]    inside a bundle (tools/bundle.sh)
#   tools/gpu-check.sh --build DIR [OPTIONS]        a source tree with a CUDA build
#
# Options:
#   --build DIR         the build directory (source-tree mode; default: the
#                       bundle when run from one, else ./build)
#   --tests-only        run the tests, no benchmarks
#   --bench-only        run the benchmarks, no tests
#   --quick             smaller benchmark shapes and fewer steps
#   --shape SPEC        the GPT benchmarks' shape (default
#                       d=768,heads=12,layers=12,ctx=1024,batch=8; --quick:
#                       d=256,heads=4,layers=6,ctx=256,batch=16)
#   --timeout-scale X   multiply every step's timeout and the budget by X
#   --budget S          total time budget, seconds (default 450); a step gets
#                       at most what is left, and is skipped under 10 s
#   --out DIR           logs (default: $OUT when set, else ./gpu-check-out)
#   --torch DIR         the PyTorch reference scripts (default: the bundle's
#                       torch/, else ../shared/bench/torch beside the source)
#   --strict            a failed benchmark fails the run too
#   --manifest          print the GPU tests and benchmarks of --build DIR (a
#                       tab-separated list tools/bundle.sh stores) and exit
#   -h, --help          this text
#
# What runs, in order:
#   1. The machine: nvidia-smi, driver, glibc, the CUDA library directories,
#      torch's version, CUDA and cuda.is_available(). LD_LIBRARY_PATH gets
#      /usr/local/cuda/lib64 and /usr/local/cuda/lib (those that exist), the
#      directories ldconfig -p gives for the CUDA libraries our binaries
#      need, and, for one still missing, torch's site-packages/nvidia/*/lib.
#   2. Tests: those of meson suite 'cuda', plus cuda_device, cuda_ops,
#      backend_kinds and swarm_device (SKIP when a build lacks one), the
#      compiled ones first, each under its meson timeout (at most 300 s)
#      and the budget; exit 77 is SKIP. The environment is meson's, with
#      STARLING_TEST_DEVICE=cuda:0 (tests/test_swarm_device.sh's device) and,
#      from a bundle without /usr/share/datasets/fashion-mnist, the bundle's
#      FASHION_MNIST_DIR. A build without swarm_device gets swarm_gpu_smoke
#      instead: one peer serving the three stages of tests/ref/micro-lm.json
#      with --device cuda, 20 training steps through it.
#   3. Benchmarks, in this order (the budget cuts the last first):
#      meson benchmarks of suite 'cuda' (else gpu_gpt_bench itself), given
#      --shape, --steps and --warmup when meson gives them no arguments and
#      their --help lists them; PyTorch's gpt_bench.py --device cuda --mode
#      bf16 --attn sdpa at the same shape; tests/bench/gpu_lm_bench.sh
#      --quick (with --quick: bf16 only) when present; gpt_bench.py again
#      with --compile. Python runs with the LD_LIBRARY_PATH we started with.
# Each prints PASS, FAIL, TIMEOUT or SKIP; a failure shows its log's tail.
# Output (under the output directory): gpu-check.log (everything printed),
# machine.txt, tests/NAME.log, bench/NAME.log, bench.jsonl (every
# benchmark's JSON line; a skipped or failed one gets a line with "ok":
# false), summary.tsv. The last line: "N passed, N failed, N skipped"
# (TIMEOUT counts as failed).
# Exit status: 0 when no test failed (benchmarks are measurements: their
# failures are counted but change it only with --strict), 1 when one did,
# 2 usage or setup error (no build directory, no starling binary).
#
# Environment: GPU_GPT_BENCH_ARGS, GPU_LM_BENCH_ARGS replace the arguments
# given to gpu_gpt_bench and gpu_lm_bench.sh; GPU_CHECK_SMOKE_DEVICE=cpu runs
# the swarm smoke test without a GPU (to check the script itself).
set -u -o pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
die() { echo "gpu-check: error: $*" >&2; exit 2; }

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd) || exit 2
ROOT=$(dirname "$HERE")
GPU_TEST_NAMES="cuda_device cuda_ops backend_kinds swarm_device"
CUDA_LIB_RE='^lib(cuda|cudart|cublas|cublasLt|cudnn[a-z_]*|nvrtc[a-z_-]*|nvJitLink|nvidia-[a-z_-]*)\.so'

# ---- the manifest: GPU tests and benchmarks of a meson build directory ----
# One line each: KIND NAME TIMEOUT SUITES ENV CMD (tab-separated; no field
# empty: "-" instead, as read collapses tabs), where ENV
# and CMD are single-quoted shell words and paths under the build directory
# and the source tree read @BUILD@ and @SRC@, so the list moves with a bundle.
print_manifest() {
    local build=$1
    [ -f "$build/meson-info/intro-tests.json" ] ||
        die "$build is not a configured meson build directory (no meson-info/intro-tests.json)"
    command -v python3 >/dev/null || die "python3 is needed to read $build/meson-info"
    python3 - "$build" "$GPU_TEST_NAMES" <<'EOF'
import json, os, sys
build = os.path.realpath(sys.argv[1])
names = set(sys.argv[2].split())
info = json.load(open(os.path.join(build, "meson-info", "meson-info.json")))
src = os.path.realpath(info["directories"]["source"])

def place(v):
    if not isinstance(v, str) or not v.startswith("/"):
        return v
    p = os.path.realpath(v)
    for root, tag in ((build, "@BUILD@"), (src, "@SRC@")):
        if p == root or p.startswith(root + "/"):
            return tag + p[len(root):]
    return v

def q(w):
    return "'" + str(w).replace("'", "'\\''") + "'"

def gpu(t):
    suites = {s.split(":")[-1] for s in t.get("suite", [])}
    n = t["name"]
    return bool(suites & {"cuda", "gpu"}) or n in names or "gpu" in n or n.startswith("cuda_")

for kind, fn in (("test", "intro-tests.json"), ("bench", "intro-benchmarks.json")):
    path = os.path.join(build, "meson-info", fn)
    if not os.path.exists(path):
        continue
    for t in json.load(open(path)):
        if not gpu(t):
            continue
        cmd = list(t["cmd"])
        if os.path.basename(cmd[0]) in ("sh", "dash", "bash"):
            cmd[0] = os.path.basename(cmd[0])
        cmd = [place(c) for c in cmd]   # meson's cmd holds the args too
        env = " ".join(q(k + "=" + place(v)) for k, v in sorted((t.get("env") or {}).items()))
        suites = ",".join(s.split(":")[-1] for s in t.get("suite", []))
        print("\t".join([kind, t["name"], str(t.get("timeout") or 60), suites or "-", env or "-",
                         " ".join(q(c) for c in cmd)]))
EOF
}

# ---- options ----
BUILD="" OUTDIR="" TORCH="" SHAPE=""
DO_TESTS=1 DO_BENCH=1 QUICK=0 SCALE=1 BUDGET=450 STRICT=0 MANIFEST=0 SMOKE_WORK=""
while [ $# -gt 0 ]; do
    case "$1" in
    --build) [ $# -ge 2 ] || die "--build needs a directory"; BUILD=$2; shift ;;
    --tests-only) DO_BENCH=0 ;;
    --bench-only) DO_TESTS=0 ;;
    --quick) QUICK=1 ;;
    --shape) [ $# -ge 2 ] || die "--shape needs a value"; SHAPE=$2; shift ;;
    --timeout-scale)
        [ $# -ge 2 ] || die "--timeout-scale needs a number"
        awk -v x="$2" 'BEGIN { exit !(x + 0 > 0 && x ~ /^[0-9]*\.?[0-9]+$/) }' ||
            die "--timeout-scale: '$2' is not a positive number"
        SCALE=$2; shift ;;
    --budget)
        [ $# -ge 2 ] || die "--budget needs seconds"
        case "$2" in ''|*[!0-9]*) die "--budget: '$2' is not a whole number of seconds" ;; esac
        BUDGET=$2; shift ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; OUTDIR=$2; shift ;;
    --torch) [ $# -ge 2 ] || die "--torch needs a directory"; TORCH=$2; shift ;;
    --strict) STRICT=1 ;;
    --manifest) MANIFEST=1 ;;
    --_swarm-smoke) SMOKE_WORK=${2:-}; shift ;;  # internal: the smoke test, under timeout
    -h|--help) usage; exit 0 ;;
    *) echo "gpu-check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[ "$DO_TESTS" = 1 ] || [ "$DO_BENCH" = 1 ] || die "--tests-only and --bench-only exclude each other"

if [ "$MANIFEST" = 1 ]; then
    [ -n "$BUILD" ] || die "--manifest needs --build DIR"
    print_manifest "$BUILD"
    exit $?
fi

# ---- the swarm smoke test (run by the main script under timeout) ----
# A bootstrap node, one peer with the three stages of micro-lm on the GPU,
# 20 steps of training on a generated corpus: status ok, 20 steps, and a
# validation loss well under the uniform 8 bits/byte.
swarm_smoke() {
    local w=$1 S=${STARLING:?} dev=${GPU_CHECK_SMOKE_DEVICE:-cuda} rc i
    pids=""   # global: the EXIT trap reads it
    local model="$STARLING_SOURCE_ROOT/tests/ref/micro-lm.json"
    stop() {
        for p in $pids; do kill -TERM "$p" 2>/dev/null; done
        for _ in $(seq 1 50); do
            i=0; for p in $pids; do kill -0 "$p" 2>/dev/null && i=1; done
            [ "$i" = 0 ] && break; sleep 0.1
        done
        for p in $pids; do kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
        pids=""
    }
    trap stop EXIT
    trap 'exit 1' INT TERM
    waitfor() { # FILE REGEX SECONDS PID
        for _ in $(seq 1 $(($3 * 10))); do
            grep -Eq "$2" "$1" 2>/dev/null && return 0
            kill -0 "$4" 2>/dev/null || break
            sleep 0.1
        done
        grep -Eq "$2" "$1" 2>/dev/null
    }
    [ -f "$model" ] || { echo "FAIL: no $model"; return 1; }
    awk 'BEGIN { srand(7); n = split("the a swarm peer trains model blocks of text on one GPU and " \
        "many machines while gradients flow back through holders quickly", w, " ");
        for (i = 0; i < 30000; i++) printf "%s%s", w[int(rand() * n) + 1], (i % 12 == 11) ? ".\n" : " " }' \
        >"$w/corpus.txt"
    "$S" bootstrap --listen 127.0.0.1:0 >"$w/bs.out" 2>"$w/bs.err" &
    pids="$pids $!"
    waitfor "$w/bs.out" '/[0-9a-f]{40}$' 30 $! || { echo "FAIL: bootstrap did not start"; tail "$w/bs.err"; return 1; }
    local bs; bs=$(head -1 "$w/bs.out")
    echo "bootstrap $bs"
    "$S" peer --initial-peers "$bs" --blocks 0-2 --model-file "$model" --device "$dev" --lr 3e-3 \
        >"$w/peer.out" 2>"$w/peer.err" &
    pids="$pids $!"
    if ! waitfor "$w/peer.err" 'online: announcing' 90 $!; then
        echo "FAIL: the peer (--device $dev) did not come online"; tail -20 "$w/peer.err"; return 1
    fi
    grep -i "cuda\|gpu\|device" "$w/peer.err" | head -5
    "$S" train --initial-peers "$bs" --model-file "$model" --data "$w/corpus.txt" --steps 20 \
        --eval-every 10 --eval-batches 2 --json --metrics-log "$w/train.jsonl" --plot "" \
        >"$w/train.out" 2>"$w/train.err"
    rc=$?
    tail -3 "$w/train.err"
    cat "$w/train.out"
    [ "$rc" -eq 0 ] || { echo "FAIL: train exited $rc"; tail -20 "$w/peer.err"; return 1; }
    local st steps bpb
    st=$(sed -n 's/.*"status":"\([a-z_]*\)".*/\1/p' "$w/train.out")
    steps=$(sed -n 's/.*"steps":\([0-9]*\).*/\1/p' "$w/train.out")
    bpb=$(sed -n 's/.*"val_bpb":\([0-9.]*\).*/\1/p' "$w/train.out")
    rc=0
    [ "$st" = ok ] || { echo "FAIL: status '$st', want ok"; rc=1; }
    [ "$steps" = 20 ] || { echo "FAIL: $steps steps, want 20"; rc=1; }
    awk -v b="$bpb" 'BEGIN { exit !(b != "" && b + 0 < 7.0) }' ||
        { echo "FAIL: validation '$bpb' bits/byte, want < 7 (uniform: 8)"; rc=1; }
    stop
    grep -q "ERROR\|error:" "$w/peer.err" && { echo "peer log errors:"; grep "ERROR\|error:" "$w/peer.err" | head; }
    [ "$rc" = 0 ] && echo "ok: $steps steps, val_bpb $bpb on --device $dev"
    return "$rc"
}
if [ -n "$SMOKE_WORK" ]; then
    swarm_smoke "$SMOKE_WORK"
    exit $?
fi

# ---- where things are ----
BUNDLE=0
if [ -z "$BUILD" ] && [ -f "$ROOT/gpu-tests.tsv" ] && [ -d "$ROOT/bin" ]; then
    BUNDLE=1
    BUILD=$ROOT/build   # the bundle's build-tree view: links into bin/ and lib/
    SRC=$ROOT
    [ -n "$TORCH" ] || TORCH=$ROOT/torch
else
    if [ -z "$BUILD" ]; then
        BUILD=$ROOT/build
        echo "gpu-check: no --build given and not inside a bundle: using $BUILD" >&2
    fi
    [ -d "$BUILD" ] || die "build directory '$BUILD' does not exist (tools/gpu-check.sh --build DIR)"
    BUILD=$(cd "$BUILD" && pwd)
    SRC=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["directories"]["source"])' \
        "$BUILD/meson-info/meson-info.json" 2>/dev/null) || SRC=$ROOT
    if [ -z "$TORCH" ]; then
        for d in "$SRC/../shared/bench/torch" "$SRC/shared/bench/torch"; do
            [ -d "$d" ] && { TORCH=$(cd "$d" && pwd); break; }
        done
    fi
fi
case "$BUILD$SRC" in *"'"*) die "paths with a single quote are not supported: $BUILD $SRC" ;; esac
[ -x "$BUILD/tools/starling" ] || die "no starling binary at $BUILD/tools/starling (build first: ninja -C $BUILD)"
if [ -z "$OUTDIR" ]; then
    if [ -n "${OUT:-}" ]; then OUTDIR=$OUT; else OUTDIR=$PWD/gpu-check-out; fi
fi
mkdir -p "$OUTDIR/tests" "$OUTDIR/bench" || die "cannot create the output directory $OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
: >"$OUTDIR/bench.jsonl"
command -v timeout >/dev/null || die "the timeout command (coreutils) is missing"

if [ -z "$SHAPE" ]; then
    if [ "$QUICK" = 1 ]; then SHAPE="d=256,heads=4,layers=6,ctx=256,batch=16"
    else SHAPE="d=768,heads=12,layers=12,ctx=1024,batch=8"; fi
fi
SHAPE_ARGS=()
IFS=, read -r -a _kv <<<"$SHAPE"
for kv in "${_kv[@]}"; do
    k=${kv%%=*} v=${kv#*=}
    case "$k" in d|heads|layers|ctx|batch|vocab) ;; *) die "--shape: unknown key '$k' (d, heads, layers, ctx, batch, vocab)" ;; esac
    case "$v" in ''|*[!0-9]*) die "--shape: $k=$v is not a whole number" ;; esac
    SHAPE_ARGS+=("--$k" "$v")
done
if [ "$QUICK" = 1 ]; then BENCH_STEPS=(--steps 10 --warmup 3); else BENCH_STEPS=(--steps 20 --warmup 5); fi

# ---- time ----
T_START=$(date +%s)
DEADLINE=$((T_START + $(awk -v b="$BUDGET" -v s="$SCALE" 'BEGIN { printf "%d", b * s }')))
MIN_STEP=10 TEST_CAP=300
# step_time NOMINAL [MIN]: the step's timeout: NOMINAL x scale, at most what
# is left of the budget; 0 (skip it) when less than MIN x scale (default
# MIN_STEP) or MIN_STEP is left.
step_time() {
    local t rem min
    t=$(awk -v a="$1" -v s="$SCALE" 'BEGIN { printf "%d", a * s + 0.5 }')
    min=$(awk -v a="${2:-$MIN_STEP}" -v s="$SCALE" 'BEGIN { printf "%d", a * s + 0.5 }')
    rem=$((DEADLINE - $(date +%s)))
    if [ "$rem" -lt "$min" ] || [ "$rem" -lt "$MIN_STEP" ]; then echo 0
    elif [ "$t" -gt "$rem" ]; then echo "$rem"
    else echo "$t"; fi
}
ms() { date +%s%3N; }
secs_since() { awk -v a="$1" -v b="$(ms)" 'BEGIN { printf "%.1f", (b - a) / 1000 }'; }

# ---- results ----
R_KIND=() R_NAME=() R_RES=() R_SECS=() R_NOTE=()
add_row() { # KIND NAME RESULT SECS NOTE
    R_KIND+=("$1"); R_NAME+=("$2"); R_RES+=("$3"); R_SECS+=("$4"); R_NOTE+=("$5")
    printf '%-8s %-30s %6ss  %s\n' "$3" "$2" "$4" "$5"
}
json_esc() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr -d '\n\r\t'; }
bench_line() { # NAME RESULT NOTE: a JSON line for a benchmark that gave none
    local l
    l="{\"bench\":\"$(json_esc "$1")\",\"ok\":false,\"result\":\"$2\",\"note\":\"$(json_esc "$3")\"}"
    echo "$l" >>"$OUTDIR/bench.jsonl"
    echo "$l"
}
show_tail() { echo "    --- last lines of $1"; tail -n "${2:-25}" "$1" | sed 's/^/    | /'; }

# ---- 1. the machine ----
GPUS=0 TORCH_OK=0 TORCH_CUDA=0 NVLIB_DIRS=()
ORIG_LD=${LD_LIBRARY_PATH-__unset__}
machine() {
    echo "== the machine ($(date -u '+%Y-%m-%d %H:%M:%SZ'), $(hostname 2>/dev/null))"
    if [ "$BUNDLE" = 1 ]; then
        echo "bundle: $ROOT"
        sed -n '/^files:/q; /./p' "$ROOT/BUNDLE-INFO.txt" 2>/dev/null | sed 's/^/  /'
    else
        echo "source tree: $SRC, build: $BUILD"
    fi
    echo "Fashion-MNIST: ${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}$([ -d "${FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}" ] || echo ' (absent)')"
    echo "kernel: $(uname -srm); $(sed -n 's/^PRETTY_NAME="*\([^"]*\)"*/\1/p' /etc/os-release 2>/dev/null)"
    echo "glibc: $(ldd --version 2>/dev/null | head -1)"
    if [ "$BUNDLE" = 1 ]; then
        local need have
        need=$(sed -n 's/^glibc_needed: *//p' "$ROOT/BUNDLE-INFO.txt" 2>/dev/null)
        have=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{ print $2 }')
        if [ -n "$need" ] && [ -n "$have" ] &&
            [ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" != "$need" ]; then
            echo "WARNING: the bundle needs glibc >= $need; this machine has $have: binaries will not start"
        fi
    fi
    echo "cpus: $(nproc 2>/dev/null); $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | sed 's/.*: //')"
    echo "memory: $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo 2>/dev/null)"
    if command -v nvidia-smi >/dev/null; then
        timeout 20 nvidia-smi 2>&1
        timeout 20 nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm,power.limit,compute_cap \
            --format=csv 2>&1
        GPUS=$(timeout 20 nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    else
        echo "nvidia-smi: not found"
        GPUS=$(find /dev -maxdepth 1 -name 'nvidia[0-9]*' 2>/dev/null | wc -l)
    fi
    [ -r /proc/driver/nvidia/version ] && sed -n 1p /proc/driver/nvidia/version
    echo "GPUs: $GPUS"
    local d listed=" "
    for d in /usr/local/cuda /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -e "$d" ] || { echo "$d: absent"; continue; }
        if [ -L "$d" ]; then echo "$d -> $(readlink -f "$d")"; fi
        case "$listed" in *" $(readlink -f "$d") "*) continue ;; esac
        listed="$listed$(readlink -f "$d") "
        case "$d" in */lib*) echo "ls $d:"; find "$d/" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort | tr '\n' ' ' | fold -s -w 110 | sed 's/^/  /'; echo ;; esac
    done
    find /usr/local -maxdepth 1 -name 'cuda-*' 2>/dev/null | sort | sed 's/^/installed: /'
    echo "ldconfig: $(ldconfig -p 2>/dev/null | grep -Eo 'lib(cuda|cudart|cublas|cublasLt|nvrtc)\.so[.0-9]*' | sort -u | tr '\n' ' ')"
    echo "python3: $(python3 --version 2>&1)"
    local py
    py=$(timeout 90 python3 - <<'EOF' 2>&1
import glob, os, sys
try:
    import torch
except Exception as e:
    print("torch: not importable:", e)
    sys.exit(3)
print("torch", torch.__version__, "cuda", torch.version.cuda, "is_available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("torch device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
    print("TORCH_CUDA=1")
sp = os.path.dirname(os.path.dirname(torch.__file__))
for d in sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib")) + glob.glob(os.path.join(sp, "nvidia", "*", "*", "lib"))):
    print("NVLIB=" + d)
print("TORCH_OK=1")
EOF
)
    echo "$py" | grep -v '^NVLIB=\|^TORCH_OK=\|^TORCH_CUDA='
    echo "$py" | grep -q '^TORCH_OK=1' && TORCH_OK=1
    echo "$py" | grep -q '^TORCH_CUDA=1' && TORCH_CUDA=1
    mapfile -t NVLIB_DIRS < <(echo "$py" | sed -n 's/^NVLIB=//p')
    [ "${#NVLIB_DIRS[@]}" -gt 0 ] && echo "torch's nvidia libraries: ${NVLIB_DIRS[*]}"
    return 0
}

# ELF binaries of the build (the GPU tests' and benchmarks' first words, and starling).
gpu_binaries() {
    echo "$BUILD/tools/starling"
    local kind name tmo envs cmd words=()
    while IFS=$'\t' read -r kind name tmo _ envs cmd; do
        eval "words=($cmd)"
        case "${words[0]:-}" in @BUILD@/*) echo "$BUILD/${words[0]#@BUILD@/}" ;; esac
    done <<<"$MANIFEST_TEXT"
    [ -x "$BUILD/tests/bench/gpu_gpt_bench" ] && echo "$BUILD/tests/bench/gpu_gpt_bench"
    return 0
}

# LD_LIBRARY_PATH: the CUDA directories that exist, then where ldconfig has
# the CUDA libraries the binaries need, then torch's copies of the missing.
setup_ld_path() {
    local dirs=() d so f found missing=() bins needed
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && dirs+=("$(readlink -f "$d")")
    done
    mapfile -t bins < <(gpu_binaries | sort -u)
    needed=$(for f in "${bins[@]}"; do [ -f "$f" ] && ldd "$f" 2>/dev/null; done |
        awk '{ print $1 }' | grep -E "$CUDA_LIB_RE" | sort -u)
    if [ -z "$needed" ]; then
        echo "the binaries need no CUDA library (a build without CUDA)"
    else
        echo "CUDA libraries the binaries need: $(echo "$needed" | tr '\n' ' ')"
    fi
    for so in $needed; do
        found=""
        for d in "${dirs[@]}"; do [ -e "$d/$so" ] && { found=$d/$so; break; }; done
        if [ -z "$found" ]; then
            found=$(ldconfig -p 2>/dev/null | awk -v s="$so" '$1 == s { print $NF; exit }')
            [ -n "$found" ] && [ ! -e "$found" ] && found=""   # a stale cache entry
            [ -n "$found" ] && dirs+=("$(dirname "$(readlink -f "$found")")")
        fi
        if [ -z "$found" ]; then
            for d in "${NVLIB_DIRS[@]}"; do
                [ -e "$d/$so" ] && { found=$d/$so; dirs+=("$d"); break; }
            done
        fi
        if [ -n "$found" ]; then echo "  $so: $found"; else echo "  $so: NOT FOUND"; missing+=("$so"); fi
    done
    # A bundle's C++ runtime (lib/compat), only when the machine lacks one.
    if [ "$BUNDLE" = 1 ] && [ -d "$ROOT/lib/compat" ]; then
        if LD_LIBRARY_PATH=$(IFS=:; echo "${dirs[*]}") ldd "$BUILD/tools/starling" "${bins[@]}" 2>&1 |
            grep -E 'lib(stdc\+\+|gcc_s)[^ ]* => not found|(GLIBCXX|CXXABI|GCC)_[0-9.]*. not found'; then
            echo "  the machine's C++ runtime is missing or too old: using the bundle's lib/compat"
            dirs+=("$ROOT/lib/compat")
        else
            echo "  C++ runtime: the machine's ($(ldconfig -p 2>/dev/null | awk '$1 == "libstdc++.so.6" { print $NF; exit }'))"
        fi
    fi
    local ld="" seen=" "
    for d in "${dirs[@]}"; do
        case "$seen" in *" $d "*) continue ;; esac
        seen="$seen$d "; ld="${ld:+$ld:}$d"
    done
    if [ "$ORIG_LD" != __unset__ ] && [ -n "$ORIG_LD" ]; then ld="${ld:+$ld:}$ORIG_LD"; fi
    if [ -n "$ld" ]; then export LD_LIBRARY_PATH=$ld; fi
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    [ "${#missing[@]}" -eq 0 ] || echo "WARNING: not found anywhere: ${missing[*]} (the CUDA tests cannot load)"
    for f in "${bins[@]}"; do
        [ -f "$f" ] || continue
        ldd "$f" 2>/dev/null | grep -q 'not found' &&
            echo "  $(basename "$f") cannot load: $(ldd "$f" 2>/dev/null | awk '/not found/ { print $1 }' | tr '\n' ' ')"
    done
    return 0
}

# ---- 2. tests ----
run_manifest_test() { # NAME TIMEOUT ENV CMD
    local name=$1 tmo=$2 envs=$3 cmd=$4 t log t0 rc note=""
    [ "$envs" = - ] && envs=""
    envs=${envs//@BUILD@/$BUILD}; envs=${envs//@SRC@/$SRC}
    cmd=${cmd//@BUILD@/$BUILD}; cmd=${cmd//@SRC@/$SRC}
    local env_words=()
    eval "env_words=($envs)"
    eval "set -- $cmd"
    log=$OUTDIR/tests/$name.log
    [ "$tmo" -gt "$TEST_CAP" ] && tmo=$TEST_CAP
    t=$(step_time "$tmo")
    if [ "$t" = 0 ]; then add_row test "$name" SKIP 0 "time budget spent"; return; fi
    if [ ! -e "$1" ] && [ "$1" != sh ] && [ "$1" != bash ]; then
        add_row test "$name" FAIL 0 "missing: $1"; return
    fi
    t0=$(ms)
    (cd "$BUILD" && timeout -k 5 "$t" env "${env_words[@]}" "STARLING_SOURCE_ROOT=$SRC" \
        "STARLING_TEST_DEVICE=${STARLING_TEST_DEVICE:-cuda:0}" "$@") >"$log" 2>&1 </dev/null
    rc=$?
    local secs; secs=$(secs_since "$t0")
    case "$rc" in
    0) # cmocka passes a run whose tests skipped some (a CUDA part without a GPU): say which
        note=$(sed -n 's/^\[  SKIPPED \] \([a-z_][a-z0-9_]*\)$/\1/p' "$log" | sort -u | tr '\n' ' ')
        add_row test "$name" PASS "$secs" "${note:+skipped inside: $note}" ;;
    77) note=$(grep -i 'skip' "$log" | tail -1 | cut -c1-100)
        add_row test "$name" SKIP "$secs" "${note:-exit 77}" ;;
    124|137) add_row test "$name" TIMEOUT "$secs" "killed after ${t}s"; show_tail "$log" ;;
    *)  if grep -q 'error while loading shared libraries' "$log"; then
            note="cannot load: $(grep -o 'libraries: [^:]*' "$log" | head -1 | sed 's/libraries: //')"
            if [ "$GPUS" = 0 ]; then add_row test "$name" SKIP "$secs" "no GPU; $note"; return; fi
            add_row test "$name" FAIL "$secs" "$note"
        else
            add_row test "$name" FAIL "$secs" "exit $rc"
        fi
        show_tail "$log" ;;
    esac
}

run_tests() {
    # The script tests start starling; when it cannot even start (a missing
    # library), say so once instead of waiting for each to time out.
    STARLING_BROKEN=""
    local sv
    if ! sv=$(timeout 20 "$BUILD/tools/starling" --version 2>&1); then
        STARLING_BROKEN=$(echo "$sv" | tail -1 | cut -c1-120)
        echo "starling cannot run: $sv"
    fi
    echo
    echo "== GPU tests ($(echo "$MANIFEST_TEXT" | grep -c '^test	') in the build's manifest)"
    local kind name tmo envs cmd seen=" " pass
    # Compiled tests first, then the (longer) script tests.
    for pass in compiled script; do
        while IFS=$'\t' read -r kind name tmo _ envs cmd; do
            [ "$kind" = test ] || continue
            case "$cmd" in "'sh' "*|"'bash' "*) [ "$pass" = script ] || continue ;;
            *) [ "$pass" = compiled ] || continue ;; esac
            seen="$seen$name "
            if [ "$pass" = script ] && [ -n "$STARLING_BROKEN" ]; then
                add_row test "$name" "$([ "$GPUS" = 0 ] && echo SKIP || echo FAIL)" 0 "starling cannot run: $STARLING_BROKEN"
                continue
            fi
            run_manifest_test "$name" "$tmo" "$envs" "$cmd"
        done <<<"$MANIFEST_TEXT"
    done
    local n
    for n in $GPU_TEST_NAMES; do
        case "$seen" in *" $n "*) ;; *) add_row test "$n" SKIP 0 "not in this build (no such meson test)" ;; esac
    done
    # The swarm on a GPU, when the build has no test of it (swarm_device).
    local t w log t0 rc secs
    log=$OUTDIR/tests/swarm_gpu_smoke.log
    case "$seen" in *" swarm_device "*) return ;; esac
    if [ "$GPUS" = 0 ] && [ -z "${GPU_CHECK_SMOKE_DEVICE:-}" ]; then
        add_row test swarm_gpu_smoke SKIP 0 "no GPU"; return
    fi
    if [ "$CUDA_BUILD" = 0 ] && [ -z "${GPU_CHECK_SMOKE_DEVICE:-}" ]; then
        add_row test swarm_gpu_smoke SKIP 0 "a build without CUDA"; return
    fi
    t=$(step_time 90)
    if [ "$t" = 0 ]; then add_row test swarm_gpu_smoke SKIP 0 "time budget spent"; return; fi
    w=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-swarm-XXXXXX") || { add_row test swarm_gpu_smoke FAIL 0 "mktemp"; return; }
    t0=$(ms)
    STARLING=$BUILD/tools/starling STARLING_SOURCE_ROOT=$SRC OPENBLAS_NUM_THREADS=1 \
        timeout -k 5 "$t" bash "$HERE/$(basename "${BASH_SOURCE[0]}")" --_swarm-smoke "$w" >"$log" 2>&1 </dev/null
    rc=$?
    secs=$(secs_since "$t0")
    cp "$w/peer.err" "$OUTDIR/tests/swarm_gpu_smoke.peer.log" 2>/dev/null
    rm -rf "$w"
    case "$rc" in
    0) add_row test swarm_gpu_smoke PASS "$secs" "$(grep '^ok:' "$log" | sed 's/^ok: //')" ;;
    124|137) add_row test swarm_gpu_smoke TIMEOUT "$secs" "killed after ${t}s"; show_tail "$log" ;;
    *) add_row test swarm_gpu_smoke FAIL "$secs" "$(grep -m1 '^FAIL' "$log" | cut -c1-100)"; show_tail "$log" ;;
    esac
}

# ---- 3. benchmarks ----
# run_bench NAME NOMINAL_TIMEOUT[:MIN] [VAR=VALUE...] -- CMD...: the JSON
# lines of its stdout go to bench.jsonl; a row with its figures. Skipped
# when less than MIN seconds of the budget are left.
run_bench() {
    local name=$1 nominal=${2%:*} min=${2#*:} t log json t0 rc secs envs=() note
    [ "$min" = "$2" ] && min=$MIN_STEP
    shift 2
    while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    log=$OUTDIR/bench/$name.log json=$OUTDIR/bench/$name.out
    t=$(step_time "$nominal" "$min")
    if [ "$t" = 0 ]; then
        add_row bench "$name" SKIP 0 "time budget spent (needs ${min}s x scale)"; bench_line "$name" SKIP "time budget spent"
        return
    fi
    echo "-- $name (timeout ${t}s): $*" >"$log"
    t0=$(ms)
    (cd "$BUILD" && timeout -k 5 "$t" env "${envs[@]}" "$@") >"$json" 2>>"$log" </dev/null
    rc=$?
    secs=$(secs_since "$t0")
    grep '^{' "$json" >>"$OUTDIR/bench.jsonl"
    grep '^{' "$json"
    note=$(grep '^{' "$json" | tail -1 | grep -o '"\(tokens_per_s\|mfu\|step_ms_median\|samples_per_s\|bpb_diff\|tokens_per_s_ratio\)": *[0-9.e+-]*' |
        tr -d '" ' | tr ':' '=' | tr '\n' ' ' | cut -c1-110)
    if [ "$rc" = 0 ] && grep -q '^{' "$json"; then
        add_row bench "$name" PASS "$secs" "$note"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        add_row bench "$name" TIMEOUT "$secs" "killed after ${t}s"; bench_line "$name" TIMEOUT "killed after ${t}s"
        show_tail "$log" 15
    else
        local why="exit $rc"
        [ "$rc" = 0 ] && why="no JSON line"
        if [ "$rc" = 77 ]; then
            note=$(cat "$json" "$log" | grep -v '^{' | grep -i -m1 'skip' | cut -c1-100)
            add_row bench "$name" SKIP "$secs" "${note:-exit 77}"
            grep -q '^{' "$json" || bench_line "$name" SKIP "${note:-exit 77}"
            return
        fi
        local err
        err=$(grep -o '"\(error\|reason\)": *"[^"]*' "$json" | head -1 | sed 's/^"[a-z]*": *"//' | cut -c1-80)
        add_row bench "$name" FAIL "$secs" "$why${err:+: $err}"
        grep -q '^{' "$json" || bench_line "$name" FAIL "$why"
        cat "$json" >>"$log"
        show_tail "$log" 15
    fi
}

# help_has PROG FLAG: PROG --help mentions FLAG.
help_has() { local h; h=$(timeout 10 "$1" --help 2>&1); grep -q -- "$2" <<<"$h"; }

run_benches() {
    echo
    echo "== GPU benchmarks (shape $SHAPE$([ "$QUICK" = 1 ] && echo ", quick"))"
    local kind name tmo envs cmd n=0 cap=120 words=() args=() env_words=()
    local gb=$BUILD/tests/bench/gpu_gpt_bench lb=$SRC/tests/bench/gpu_lm_bench.sh
    [ "$QUICK" = 1 ] && cap=60
    if [ "$GPUS" = 0 ]; then
        echo "no GPU: the benchmarks skip"
        for name in gpu_gpt_bench torch_sdpa_bf16 gpu_lm_bench torch_sdpa_bf16_compile; do
            add_row bench "$name" SKIP 0 "no GPU"; bench_line "$name" SKIP "no GPU"
        done
        return
    fi
    # Python (torch) runs with the LD_LIBRARY_PATH we were started with: ours
    # puts the system's CUDA libraries before the ones torch's wheel brings.
    local ld_env=(-u LD_LIBRARY_PATH) pywrap line
    [ "$ORIG_LD" != __unset__ ] && ld_env=("LD_LIBRARY_PATH=$ORIG_LD")
    pywrap=$(mktemp "${TMPDIR:-/tmp}/gpu-check-python-XXXXXX") || pywrap=""
    if [ -n "$pywrap" ]; then
        # shellcheck disable=SC2016  # "$@" is the wrapper's
        if [ "$ORIG_LD" = __unset__ ]; then line='exec env -u LD_LIBRARY_PATH python3 "$@"'
        else line="exec env LD_LIBRARY_PATH=$(printf %q "$ORIG_LD")"' python3 "$@"'; fi
        printf '#!/usr/bin/env bash\n%s\n' "$line" >"$pywrap" && chmod +x "$pywrap"
    fi

    # 1. Starling on one GPU: meson's benchmarks of suite cuda, else
    # gpu_gpt_bench itself.
    while IFS=$'\t' read -r kind name tmo _ envs cmd; do
        [ "$kind" = bench ] || continue
        [ "$QUICK" = 1 ] && [ "$n" -ge 1 ] && { add_row bench "$name" SKIP 0 "--quick: first only"; continue; }
        n=$((n + 1))
        [ "$envs" = - ] && envs=""
        envs=${envs//@BUILD@/$BUILD}; envs=${envs//@SRC@/$SRC}
        cmd=${cmd//@BUILD@/$BUILD}; cmd=${cmd//@SRC@/$SRC}
        eval "env_words=($envs)"
        eval "words=($cmd)"
        [ "$tmo" -gt "$cap" ] && tmo=$cap
        if [ -n "${GPU_GPT_BENCH_ARGS:-}" ] && [ "$(basename "${words[0]}")" = gpu_gpt_bench ]; then
            read -r -a args <<<"$GPU_GPT_BENCH_ARGS"
            words=("${words[0]}" "${args[@]}")
        elif [ "${#words[@]}" = 1 ] && help_has "${words[0]}" "--layers"; then
            words+=("${SHAPE_ARGS[@]}")
            help_has "${words[0]}" "--steps" && words+=("${BENCH_STEPS[@]}")
        fi
        run_bench "$name" "$tmo:20" "${env_words[@]}" "STARLING_SOURCE_ROOT=$SRC" -- "${words[@]}"
    done <<<"$MANIFEST_TEXT"
    if [ "$n" = 0 ]; then
        if [ -x "$gb" ]; then
            args=()
            if [ -n "${GPU_GPT_BENCH_ARGS:-}" ]; then
                read -r -a args <<<"$GPU_GPT_BENCH_ARGS"
            elif help_has "$gb" "--layers"; then
                args=("${SHAPE_ARGS[@]}")
                help_has "$gb" "--steps" && args+=("${BENCH_STEPS[@]}")
            fi
            run_bench gpu_gpt_bench "$cap:20" "STARLING_SOURCE_ROOT=$SRC" -- "$gb" "${args[@]}"
        else
            add_row bench gpu_gpt_bench SKIP 0 "absent (not built)"; bench_line gpu_gpt_bench SKIP "absent"
        fi
    fi

    # 2. PyTorch's reference at the same shape, eager.
    local gp=$TORCH/gpt_bench.py why=""
    if [ -z "$TORCH" ] || [ ! -f "$gp" ]; then why="no gpt_bench.py (--torch DIR; bundle: --extra ../shared/bench/torch)"
    elif [ "$TORCH_OK" = 0 ]; then why="torch is not importable"
    elif [ "$TORCH_CUDA" = 0 ]; then why="torch.cuda.is_available() is False"; fi
    local torch_args=(python3 "$gp" --device cuda --mode bf16 --attn sdpa "${SHAPE_ARGS[@]}" "${BENCH_STEPS[@]}")
    if [ -n "$why" ]; then
        add_row bench torch_sdpa_bf16 SKIP 0 "$why"; bench_line torch_sdpa_bf16 SKIP "$why"
    else
        run_bench torch_sdpa_bf16 "$((cap - cap / 4)):30" -- env "${ld_env[@]}" "${torch_args[@]}" --label gpu-check
    fi

    # 3. The swarm on one GPU beside train_lm.py (tests/bench/gpu_lm_bench.sh).
    if [ -f "$lb" ]; then
        args=(--quick)
        [ "$QUICK" = 1 ] && args+=(--precision bf16)
        [ -n "${GPU_LM_BENCH_ARGS:-}" ] && read -r -a args <<<"$GPU_LM_BENCH_ARGS"
        run_bench gpu_lm_bench "$((cap * 2)):90" "STARLING=$BUILD/tools/starling" "STARLING_SOURCE_ROOT=$SRC" \
            "TORCH_DIR=$TORCH" "PY=${pywrap:-python3}" -- sh "$lb" "${args[@]}"
    else
        add_row bench gpu_lm_bench SKIP 0 "absent (no tests/bench/gpu_lm_bench.sh)"; bench_line gpu_lm_bench SKIP "absent"
    fi

    # 4. PyTorch compiled (the slowest to start, and the first to go without a
    # C compiler on the machine).
    if [ -n "$why" ]; then
        add_row bench torch_sdpa_bf16_compile SKIP 0 "$why"; bench_line torch_sdpa_bf16_compile SKIP "$why"
    else
        run_bench torch_sdpa_bf16_compile "$((cap + cap / 2)):60" -- env "${ld_env[@]}" "${torch_args[@]}" --compile \
            --label gpu-check
    fi
    [ -n "$pywrap" ] && rm -f "$pywrap"
    return 0
}

summary() {
    local i p=0 f=0 s=0 tf=0 bf=0
    echo
    echo "== summary ($(( $(date +%s) - T_START )) s; logs in $OUTDIR)"
    printf '%-6s %-30s %-8s %8s  %s\n' kind name result seconds note
    for i in "${!R_NAME[@]}"; do
        printf '%-6s %-30s %-8s %8s  %s\n' "${R_KIND[$i]}" "${R_NAME[$i]}" "${R_RES[$i]}" "${R_SECS[$i]}" "${R_NOTE[$i]}"
        case "${R_RES[$i]}" in
        PASS) p=$((p + 1)) ;;
        SKIP) s=$((s + 1)) ;;
        *) f=$((f + 1)); if [ "${R_KIND[$i]}" = test ]; then tf=$((tf + 1)); else bf=$((bf + 1)); fi ;;
        esac
    done
    {
        printf 'kind\tname\tresult\tseconds\tnote\n'
        for i in "${!R_NAME[@]}"; do
            printf '%s\t%s\t%s\t%s\t%s\n' "${R_KIND[$i]}" "${R_NAME[$i]}" "${R_RES[$i]}" "${R_SECS[$i]}" "${R_NOTE[$i]}"
        done
    } >"$OUTDIR/summary.tsv"
    [ "$bf" -gt 0 ] && [ "$STRICT" = 0 ] && echo "($bf benchmark failure(s): counted, but the exit status follows the tests; --strict to fail)"
    echo "$p passed, $f failed, $s skipped"
    if [ "$tf" -gt 0 ] || { [ "$STRICT" = 1 ] && [ "$bf" -gt 0 ]; }; then return 1; fi
    return 0
}

main() {
    if [ -z "${FASHION_MNIST_DIR:-}" ] && [ ! -d /usr/share/datasets/fashion-mnist ] && [ -d "$SRC/data/fashion-mnist" ]; then
        export FASHION_MNIST_DIR=$SRC/data/fashion-mnist
    fi
    echo "gpu-check: $([ "$BUNDLE" = 1 ] && echo bundle || echo source tree) mode, budget $(( DEADLINE - T_START )) s, output $OUTDIR"
    machine >"$OUTDIR/machine.txt" 2>&1
    cat "$OUTDIR/machine.txt"
    echo
    echo "== CUDA libraries"
    setup_ld_path >>"$OUTDIR/machine.txt.ld" 2>&1
    cat "$OUTDIR/machine.txt.ld"
    cat "$OUTDIR/machine.txt.ld" >>"$OUTDIR/machine.txt"
    rm -f "$OUTDIR/machine.txt.ld"
    [ "$DO_TESTS" = 1 ] && run_tests
    [ "$DO_BENCH" = 1 ] && run_benches
    summary
}

# ---- go ----
if [ "$BUNDLE" = 1 ]; then
    MANIFEST_TEXT=$(grep -v '^#' "$ROOT/gpu-tests.tsv")
    CUDA_BUILD=$(sed -n 's/^cuda: *//p' "$ROOT/BUNDLE-INFO.txt" 2>/dev/null | head -1)
    [ "$CUDA_BUILD" = yes ] && CUDA_BUILD=1 || CUDA_BUILD=0
else
    MANIFEST_TEXT=$(print_manifest "$BUILD") || exit 2
    if grep -q '#define HAVE_CUDA 1' "$BUILD/config.h" 2>/dev/null; then CUDA_BUILD=1; else CUDA_BUILD=0; fi
fi
main 2>&1 | tee "$OUTDIR/gpu-check.log"
exit "${PIPESTATUS[0]}"
