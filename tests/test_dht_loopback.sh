#!/bin/sh
# Multi-process DHT on loopback: a bootstrap node and four more nodes (one of
# them with a persistent identity), `starling dht put` through one node and
# `starling dht get` through another, a peer string with the wrong node ID,
# a private swarm, and clean exits on SIGINT/SIGTERM. Every child is killed
# and reaped; every command is bounded by `timeout`.
set -u
S=${STARLING:?STARLING must point at the starling binary}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/starling-dht-XXXXXX") || exit 1
pids=""
cleanup() {
    for p in $pids; do kill -KILL "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
    rm -rf "$tmp"
}
trap cleanup EXIT INT TERM
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }

# start NAME ARGS...: runs `starling bootstrap ARGS` in the background and
# waits (up to 60 s: a hang guard) for its whole address line; sets $addr.
start() {
    name=$1; shift
    "$S" bootstrap "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
    pid=$!
    pids="$pids $pid"
    eval "pid_$name=$pid"
    i=0
    while ! grep -q '/[0-9a-f]\{40\}$' "$tmp/$name.out" 2>/dev/null && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
    addr=$(head -n 1 "$tmp/$name.out")
    echo "$addr" | grep -Eq '^(127\.0\.0\.1|\[::1\]):[0-9]+/[0-9a-f]{40}$' ||
        { fail "$name printed '$addr'"; cat "$tmp/$name.err" >&2; }
}

start boot --listen 127.0.0.1:0
B=$addr
"$S" keygen --out "$tmp/n1.key" >"$tmp/n1.id" || fail "keygen"
start n1 --listen 127.0.0.1:0 --identity "$tmp/n1.key" --initial-peers "$B"
N1=$addr
[ "${N1##*/}" = "$(cat "$tmp/n1.id")" ] || fail "n1 ID ${N1##*/} is not its identity's"
start n2 --listen 127.0.0.1:0 --initial-peers "$B"
start n3 --listen 127.0.0.1:0 --initial-peers "$N1"
N3=$addr
start n4 --listen 127.0.0.1:0 --initial-peers "$B,$N1"
# The nodes print their address before they have joined: wait (bounded)
# until puts through n1 and through n3 (under a key of their own) reach the
# five nodes, i.e. until the joins are done.
for i in $(seq 1 60); do
    timeout 20 "$S" dht put probe x --initial-peers "$N1" >"$tmp/probe1.out" 2>&1
    timeout 20 "$S" dht put probe x --initial-peers "$N3" >"$tmp/probe3.out" 2>&1
    grep -Eq '^stored on ([5-9]|[1-9][0-9]+) nodes' "$tmp/probe1.out" &&
        grep -Eq '^stored on ([5-9]|[1-9][0-9]+) nodes' "$tmp/probe3.out" && break
    sleep 1
done

timeout 20 "$S" dht put fmnist-mlp.2 "holder-a" --ttl 120 --initial-peers "$N1" >"$tmp/put.out" 2>&1 ||
    { fail "dht put"; cat "$tmp/put.out" >&2; }
grep -Eq '^stored on [2-9] nodes' "$tmp/put.out" || { fail "put stored on too few nodes"; cat "$tmp/put.out" >&2; }
timeout 20 "$S" dht put fmnist-mlp.2 "holder-b" --initial-peers "$B" >"$tmp/put2.out" 2>&1 || fail "second put"
timeout 20 "$S" dht get fmnist-mlp.2 --initial-peers "$N3" >"$tmp/get.out" 2>&1 ||
    { fail "dht get"; cat "$tmp/get.out" >&2; }
grep -Eq '^[0-9a-f]{40} signed [0-9]+ holder-a$' "$tmp/get.out" || { fail "get lacks holder-a"; cat "$tmp/get.out" >&2; }
grep -Eq ' holder-b$' "$tmp/get.out" || { fail "get lacks holder-b"; cat "$tmp/get.out" >&2; }
[ "$(wc -l <"$tmp/get.out")" -eq 2 ] || { fail "get: want 2 entries"; cat "$tmp/get.out" >&2; }
timeout 20 "$S" dht get no-such-key --initial-peers "$B" >"$tmp/none.out" 2>&1
[ $? -eq 1 ] || fail "get of a missing key should exit 1"

# A peer string whose ID is not the node's: refused.
wrong="${B%/*}/0000000000000000000000000000000000000000"
timeout 20 "$S" dht get fmnist-mlp.2 --initial-peers "$wrong" --timeout 5 >"$tmp/wrong.out" 2>&1
[ $? -eq 1 ] || { fail "wrong node ID accepted"; cat "$tmp/wrong.out" >&2; }

# Usage errors.
timeout 5 "$S" dht get >/dev/null 2>&1; [ $? -eq 2 ] || fail "dht get without KEY: want 2"
timeout 5 "$S" dht get k --initial-peers nonsense >/dev/null 2>&1; [ $? -eq 2 ] || fail "bad peer list: want 2"
timeout 5 "$S" bootstrap --listen localhost:1 >/dev/null 2>&1; [ $? -eq 2 ] || fail "non-numeric listen: want 2"

# A private swarm: the key's holders talk, others are ignored.
printf '%064d\n' 7 >"$tmp/swarm.key"
chmod 600 "$tmp/swarm.key"
start priv --listen 127.0.0.1:0 --swarm-key "$tmp/swarm.key"
P=$addr
timeout 20 "$S" dht put secret v --initial-peers "$P" --swarm-key "$tmp/swarm.key" >"$tmp/p1.out" 2>&1 ||
    { fail "put into private swarm"; cat "$tmp/p1.out" >&2; }
timeout 20 "$S" dht get secret --initial-peers "$P" --timeout 5 >"$tmp/p2.out" 2>&1
[ $? -eq 1 ] || { fail "node without the swarm key got in"; cat "$tmp/p2.out" >&2; }
timeout 20 "$S" dht get secret --initial-peers "$P" --swarm-key "$tmp/swarm.key" >"$tmp/p3.out" 2>&1 ||
    { fail "get from private swarm"; cat "$tmp/p3.out" >&2; }

# Clean exits: SIGTERM for one, SIGINT for the rest.
# stop PID SIGNAL: sends SIGNAL, waits (bounded) for the exit; sets rc (124
# when the process was still running after 60 s and had to be killed).
stop() {
    kill "-$2" "$1"
    i=0
    while kill -0 "$1" 2>/dev/null && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
    if kill -0 "$1" 2>/dev/null; then
        kill -KILL "$1"; wait "$1"; rc=124
    else
        wait "$1"; rc=$?
    fi
}
stop "$pid_boot" TERM
[ $rc -eq 0 ] || fail "bootstrap exit status $rc after SIGTERM"
for n in n1 n2 n3 n4 priv; do
    eval "p=\$pid_$n"
    stop "$p" INT
    [ $rc -eq 0 ] || { fail "$n exit status $rc after SIGINT"; cat "$tmp/$n.err" >&2; }
done
pids=""

[ $fails -eq 0 ] && echo "dht loopback: all checks passed"
exit $((fails > 0))
