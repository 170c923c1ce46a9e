# tests/bench/bench_lib.sh: shell helpers the swarm benchmarks share
# (wan_bench.sh, avg_bench.sh). Sourced by bash; the caller sets $work (its
# temporary directory), $pids (the processes it started), $S (starling) and
# $BS (the bootstrap's address) and defines die().

# stop_ours: SIGTERM to the processes in $pids, at most 10 s for all of
# them (a zombie counts as gone), then SIGKILL; reaps them.
stop_ours() {
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null
    for _ in $(seq 1 100); do
        alive=0
        for p in $pids; do
            kill -0 "$p" 2>/dev/null &&
                [ "$(sed -n 's/.*) \([A-Z]\).*/\1/p' "/proc/$p/stat" 2>/dev/null)" != Z ] && alive=1
        done
        [ "$alive" = 1 ] || break
        sleep 0.1
    done
    for p in $pids; do kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    pids=""
}

show() { for f in "$@"; do echo "--- $f" >&2; tail -20 "$f" >&2; done; }

# wait_for FILE REGEX SECONDS PID: until FILE has a line matching REGEX;
# fails early once PID has exited.
wait_for() {
    for _ in $(seq 1 $(($3 * 10))); do
        grep -Eq "$2" "$1" 2>/dev/null && return 0
        kill -0 "$4" 2>/dev/null || break
        sleep 0.1
    done
    grep -Eq "$2" "$1" 2>/dev/null
}

# json_num FILE KEY: a number field of FILE's last line, or "null";
# json_str FILE KEY: a string field's value, or nothing.
json_num() {
    v=$(tail -1 "$1" | sed -n "s/.*\"$2\":\([-0-9.eE+]*\)[,}].*/\1/p")
    echo "${v:-null}"
}
json_str() {
    tail -1 "$1" | sed -n "s/.*\"$2\":\"\([^\"]*\)\".*/\1/p"
}

# wait_announced_peer OUT ERR SECONDS MODEL [PREFIX...]: until `starling
# monitor` (run after PREFIX, e.g. wanbed_exec 5) shows the peer whose
# stdout is OUT and stderr ERR online on as many stages as it announces
# (swarm_lib.sh's way), bounded by SECONDS.
wait_announced_peer() {
    wa_out=$1 wa_err=$2 wa_end=$(( $(date +%s) + $3 )) wa_model=$4
    shift 4
    while :; do
        id=$(sed -n 's#.*address .*/\([0-9a-f]\{40\}\)$#\1#p' "$wa_out" | tail -1)
        n=$(sed -n 's/.*online: announcing \([0-9]*\) block.*/\1/p' "$wa_err" | tail -1)
        if [ -n "$id" ] && [ -n "$n" ]; then
            "$@" "$S" monitor --initial-peers "$BS" --model "$wa_model" --json >"$work/mon.json" 2>"$work/mon.err"
            got=$(grep -o "\"id\":\"$id\",\"addr\":\"[^\"]*\",\"state\":\"online\"" "$work/mon.json" | wc -l)
            [ "$got" -ge "$n" ] && return 0
        fi
        [ "$(date +%s)" -lt "$wa_end" ] || return 1
        sleep 0.3
    done
}
