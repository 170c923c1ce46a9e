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

# wait_for FILE REGEX SECONDS [PID]: waits until FILE has a line matching
# REGEX; with PID, gives up early once that process has exited.
wait_for() {
    n=$(awk "BEGIN { print int($3 * 10) }")
    for i in $(seq 1 "$n"); do
        grep -Eq "$2" "$1" 2>/dev/null && return 0
        if [ -n "${4:-}" ] && ! kill -0 "$4" 2>/dev/null; then
            grep -Eq "$2" "$1" 2>/dev/null
            return
        fi
        sleep 0.1
    done
    return 1
}

# start_bootstrap: starts a bootstrap node; sets BS to its address string.
# (The files are emptied here, not by the background job's redirection: a
# second bootstrap must not be read from the first one's stale address.)
start_bootstrap() {
    : >"$T/bs.out"; : >"$T/bs.err"
    "$S" bootstrap --listen 127.0.0.1:0 >"$T/bs.out" 2>"$T/bs.err" &
    PIDS="$PIDS $!"
    wait_for "$T/bs.out" '/[0-9a-f]{40}$' 60 || { show "$T/bs.err"; echo "bootstrap did not start" >&2; exit 1; }
    BS=$(head -1 "$T/bs.out")
}

# start_peer NAME BLOCKS [extra flags]: starts a peer; sets PID_<NAME>.
# Returns once the peer is online and its announcements can be found.
start_peer() {
    name=$1; blocks=$2; shift 2
    : >"$T/$name.out"; : >"$T/$name.err"
    "$S" peer --initial-peers "$BS" --blocks "$blocks" "$@" >"$T/$name.out" 2>"$T/$name.err" &
    pid=$!
    PIDS="$PIDS $pid"
    eval "PID_$name=$pid"
    wait_for "$T/$name.err" 'online: announcing' 120 || { show "$T/$name.out" "$T/$name.err"; echo "peer $name did not come online" >&2; exit 1; }
    wait_announced "$name" 120 || { show "$T/$name.err" "$T/$name.ann" "$T/$name.ann.err"; echo "peer $name's announcements never became visible" >&2; exit 1; }
}

# start_peer_auto NAME [extra flags]: as start_peer, without --blocks: the
# peer picks the least served span itself (--num-blocks, its default).
# $AUTO_MON: extra flags for the monitor that checks its announcements
# (e.g. the model's).
start_peer_auto() {
    name=$1; shift
    : >"$T/$name.out"; : >"$T/$name.err"
    "$S" peer --initial-peers "$BS" "$@" >"$T/$name.out" 2>"$T/$name.err" &
    pid=$!
    PIDS="$PIDS $pid"
    eval "PID_$name=$pid"
    wait_for "$T/$name.err" 'online: announcing' 120 || { show "$T/$name.out" "$T/$name.err"; echo "peer $name did not come online" >&2; exit 1; }
    # shellcheck disable=SC2086
    wait_announced "$name" 120 --initial-peers "$BS" ${AUTO_MON:-} || { show "$T/$name.err" "$T/$name.ann" "$T/$name.ann.err"; echo "peer $name's announcements never became visible" >&2; exit 1; }
}

# wait_announced NAME SECONDS [MONITOR FLAGS...]: a peer logs "online:
# announcing" when it starts its DHT puts, not when they are stored; this
# waits until `starling monitor` (flags default: --initial-peers $BS) shows
# peer NAME online on as many stages as it announces, so that whoever looks
# the swarm up next finds it.
wait_announced() {
    wa_name=$1; wa_end=$(( $(date +%s) + $2 )); shift 2
    [ $# -gt 0 ] || set -- --initial-peers "$BS"
    while :; do
        wa_id=$(sed -n 's#.*address .*/\([0-9a-f]\{40\}\)$#\1#p' "$T/$wa_name.out" | tail -1)
        wa_n=$(sed -n 's/.*online: announcing \([0-9]*\) block.*/\1/p' "$T/$wa_name.err" | tail -1)
        if [ -n "$wa_id" ] && [ -n "$wa_n" ]; then
            "$S" monitor --json "$@" >"$T/$wa_name.ann" 2>"$T/$wa_name.ann.err"
            wa_got=$(grep -o "\"id\":\"$wa_id\",\"addr\":\"[^\"]*\",\"state\":\"online\"" "$T/$wa_name.ann" | wc -l)
            [ "$wa_got" -ge "$wa_n" ] && return 0
        fi
        [ "$(date +%s)" -lt "$wa_end" ] || return 1
        sleep 0.2
    done
}

# stop_peer PID SECONDS: SIGTERM, then waits (bounded) for the process to
# exit; returns its exit status, or 124 (after SIGKILL) if it did not exit.
stop_peer() {
    kill -TERM "$1" 2>/dev/null
    sp_end=$(( $(date +%s) + $2 ))
    while kill -0 "$1" 2>/dev/null && [ "$(date +%s)" -lt "$sp_end" ]; do sleep 0.1; done
    if kill -0 "$1" 2>/dev/null; then
        kill -KILL "$1" 2>/dev/null
        wait "$1" 2>/dev/null
        return 124
    fi
    wait "$1"
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
