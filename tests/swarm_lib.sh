# tests/swarm_lib.sh: sourced by the multi-process swarm tests.
# Starts processes on loopback, waits for them with bounded loops, and kills
# and reaps every one of them on exit, whatever happens.
set -u
S=${STARLING:?STARLING must point at the starling binary}
export OPENBLAS_NUM_THREADS=1
T=$(mktemp -d "${TMPDIR:-/tmp}/starling-swarm-XXXXXX") || exit 1
PIDS=""
fails=0

cleanup() {
    for p in $PIDS; do kill -TERM "$p" 2>/dev/null; done
    for i in $(seq 1 50); do
        alive=0
        for p in $PIDS; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for p in $PIDS; do kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    [ -n "${KEEP_T:-}" ] || rm -rf "$T"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
show() { for f in "$@"; do echo "--- $f" >&2; tail -20 "$f" >&2; done; }

# wait_for FILE REGEX SECONDS: waits until FILE has a line matching REGEX.
wait_for() {
    n=$(awk "BEGIN { print int($3 * 10) }")
    for i in $(seq 1 "$n"); do
        grep -Eq "$2" "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}

# start_bootstrap: starts a bootstrap node; sets BS to its address string.
start_bootstrap() {
    "$S" bootstrap --listen 127.0.0.1:0 >"$T/bs.out" 2>"$T/bs.err" &
    PIDS="$PIDS $!"
    wait_for "$T/bs.out" '/' 10 || { show "$T/bs.err"; echo "bootstrap did not start" >&2; exit 1; }
    BS=$(head -1 "$T/bs.out")
}

# start_peer NAME BLOCKS [extra flags]: starts a peer; sets PID_<NAME>.
start_peer() {
    name=$1; blocks=$2; shift 2
    "$S" peer --initial-peers "$BS" --blocks "$blocks" "$@" >"$T/$name.out" 2>"$T/$name.err" &
    pid=$!
    PIDS="$PIDS $pid"
    eval "PID_$name=$pid"
    wait_for "$T/$name.err" 'online: announcing' 30 || { show "$T/$name.out" "$T/$name.err"; echo "peer $name did not come online" >&2; exit 1; }
}

# json_field FILE KEY: prints a number or string field of the last JSON line.
json_field() {
    tail -1 "$1" | sed -n "s/.*\"$2\":\"\{0,1\}\([^,\"}]*\).*/\1/p"
}

finish() {
    # A child process's sanitizer report would otherwise go unseen.
    for f in "$T"/*.err; do
        [ -f "$f" ] || continue
        if grep -qE "ERROR: (Address|Leak)Sanitizer|runtime error:" "$f"; then
            fail "sanitizer report in $(basename "$f")"
            grep -m5 -A12 -E "ERROR: (Address|Leak)Sanitizer|runtime error:" "$f" >&2
        fi
    done
    if [ "$fails" -ne 0 ]; then
        echo "$fails check(s) failed" >&2
        exit 1
    fi
    echo "ok"
    exit 0
}
