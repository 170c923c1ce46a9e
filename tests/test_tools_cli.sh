#!/bin/sh
# The `starling` command line: help, exit codes, keygen. Run by meson with
# $STARLING pointing at the binary.
set -u
S=${STARLING:?STARLING must point at the starling binary}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/starling-cli-XXXXXX") || exit 1
BS_PID=""
cleanup() {
    if [ -n "$BS_PID" ]; then
        kill -TERM "$BS_PID" 2>/dev/null
        for i in $(seq 1 50); do kill -0 "$BS_PID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$BS_PID" 2>/dev/null
        wait "$BS_PID" 2>/dev/null
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
fails=0

fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }

# expect STATUS DESCRIPTION -- command...   (stdout+stderr go to $tmp/out)
expect() {
    want=$1; what=$2; shift 3
    "$@" >"$tmp/out" 2>&1
    got=$?
    if [ "$got" -ne "$want" ]; then
        fail "$what: exit $got, want $want"; sed 's/^/    /' "$tmp/out" >&2
    fi
}
contains() { grep -q -- "$1" "$tmp/out" || { fail "$2: output lacks '$1'"; sed 's/^/    /' "$tmp/out" >&2; }; }

expect 0 "top help" -- "$S" --help
for c in peer bootstrap monitor train infer generate keygen; do contains "  $c " "top help lists $c"; done
expect 2 "no command" -- "$S"
expect 2 "unknown command" -- "$S" frobnicate
contains "unknown command 'frobnicate'" "unknown command message"
expect 2 "unknown top option" -- "$S" --frob
expect 0 "version" -- "$S" --version
contains "starling" "version text"

for c in peer bootstrap monitor train infer generate keygen; do
    expect 0 "$c --help" -- "$S" $c --help
    contains "Usage: starling $c" "$c help text"
    expect 2 "$c bad flag" -- "$S" $c --no-such-flag
    contains "unknown option '--no-such-flag'" "$c bad flag message"
    expect 2 "$c stray argument" -- "$S" $c stray
done
expect 2 "missing flag value" -- "$S" bootstrap --listen
contains "needs a value" "missing value message"
expect 2 "bad device" -- "$S" peer --device gpu7
contains "invalid device" "bad device message"
# The device flags: malformed values are usage errors; bf16 needs a GPU; a
# GPU this build or machine lacks is a failure that says which.
for d in "cuda:" "cuda:-1" "sim:" "sim:0" "sim:x" "AUTO"; do
    expect 2 "peer --device $d" -- "$S" peer --device "$d"
    contains "invalid device" "peer --device $d message"
done
expect 2 "bf16 on the cpu" -- "$S" peer --device cpu --precision bf16
contains "bf16 needs a GPU" "bf16 on the cpu message"
expect 2 "bf16 on the simulated device" -- "$S" peer --device sim --precision bf16
expect 2 "unknown precision" -- "$S" peer --precision fp64
contains "invalid precision 'fp64'" "unknown precision message"
expect 1 "a GPU that is not there" -- "$S" peer --device cuda:4096 --blocks 0
contains "cannot use device 'cuda:4096'" "missing GPU message"

# export: flags checked before any network starts.
expect 2 "export without --out" -- "$S" export --initial-peers 127.0.0.1:1
contains "--out DIR is required" "export --out message"
expect 2 "export without --initial-peers" -- "$S" export --out "$tmp/x"
expect 2 "export --timeout garbage" -- "$S" export --initial-peers 127.0.0.1:1 --out "$tmp/x" --timeout abc
contains "expects a number, got 'abc'" "export --timeout message"
expect 2 "export of an MLP" -- "$S" export --initial-peers 127.0.0.1:1 --out "$tmp/x" --model fmnist-mlp
contains "without Hugging Face names" "export MLP message"
expect 2 "export with a positional" -- "$S" export --initial-peers 127.0.0.1:1 --out "$tmp/x" extra
expect 0 "export --help" -- "$S" export --help
contains "model.safetensors" "export help"

# Garbage flag values are usage errors (exit 2) with a sentence, before any
# network or compute starts.
for b in "1,,2" "1-" "x" "3-1" "1,2," "-1" "99"; do
    expect 2 "peer --blocks $b" -- "$S" peer --blocks "$b"
done
contains "stages 0..5, not 99" "out-of-range stage message"
expect 2 "peer --num-blocks 0" -- "$S" peer --num-blocks 0
expect 2 "peer --num-blocks 7" -- "$S" peer --num-blocks 7
contains "only 6 stages" "num-blocks message"
expect 2 "peer blocks and num-blocks" -- "$S" peer --blocks 1 --num-blocks 2
expect 2 "peer --listen garbage" -- "$S" peer --blocks 1 --listen nohost
expect 2 "peer --training-priority bad" -- "$S" peer --blocks 1 --training-priority realtime
contains "low or idle" "training-priority message"
expect 2 "peer --keep-activations bad" -- "$S" peer --blocks 1 --keep-activations -1
contains "between 0 and 1024" "keep-activations message"
expect 2 "peer --keep-every garbage" -- "$S" peer --blocks 1 --keep-every abc
contains "expects a number, got 'abc'" "keep-every message"
expect 2 "peer --keep-copies 0" -- "$S" peer --blocks 1 --keep-copies 0
contains "between 1 and 64" "keep-copies message"
expect 2 "peer --keep-mb -5" -- "$S" peer --blocks 1 --keep-mb -5
contains "between 1 and 1048576" "keep-mb message"
expect 2 "peer --infer-inline-rows > --max-batch" -- "$S" peer --blocks 1 --infer-inline-rows 40 --max-batch 32
contains "cannot exceed --max-batch" "infer-inline-rows message"
expect 2 "peer --optimizer" -- "$S" peer --blocks 1 --optimizer adagrad
expect 2 "peer --average-mode bogus" -- "$S" peer --blocks 1 --average-mode bogus
contains "--average-mode takes mean or diloco, not 'bogus'" "average-mode message"
expect 2 "peer --outer-lr without diloco" -- "$S" peer --blocks 1 --outer-lr 0.5
contains "apply to --average-mode diloco only" "outer-lr needs diloco"
expect 2 "peer --outer-momentum 1" -- "$S" peer --blocks 1 --average-mode diloco --outer-momentum 1
expect 2 "peer --outer-lr 0" -- "$S" peer --blocks 1 --average-mode diloco --outer-lr 0
expect 2 "peer --average-format bogus" -- "$S" peer --blocks 1 --average-format f8
contains "--average-format takes f32, f16, bf16, q8 or q8:BLOCK" "average-format message"
contains "not 'f8'" "average-format message names the value"
expect 2 "peer --average-format q8:100" -- "$S" peer --blocks 1 --average-format q8:100
expect 2 "peer --average-format q8:8192" -- "$S" peer --blocks 1 --average-format q8:8192
expect 2 "peer --average-format f16:64" -- "$S" peer --blocks 1 --average-format f16:64
expect 2 "peer --average-format empty" -- "$S" peer --blocks 1 --average-format ""
expect 2 "peer --average-format missing value" -- "$S" peer --blocks 1 --average-format
expect 0 "peer --average-format q8:128 accepted" -- "$S" peer --average-format q8:128 --average-mode diloco --help
expect 2 "peer --wire-formats bogus" -- "$S" peer --blocks 1 --wire-formats f32,q9
contains "--wire-formats takes a comma-separated list" "wire-formats message"
contains "not 'f32,q9'" "wire-formats message names the value"
expect 2 "peer --wire-formats empty item" -- "$S" peer --blocks 1 --wire-formats "f32,,q8"
expect 2 "train --wire-format bogus" -- "$S" train --initial-peers 127.0.0.1:1/0000000000000000000000000000000000000000 --wire-format q4
contains "--wire-format takes f32, f16, bf16, q8 or q8:BLOCK" "wire-format message"
expect 2 "train --wire-format block on f16" -- "$S" train --initial-peers 127.0.0.1:1/0000000000000000000000000000000000000000 --wire-format f16:64
expect 2 "peer --average-format q8 with mean" -- "$S" peer --blocks 1 --average-format q8
contains "needs --average-mode diloco" "q8 with mean: message"
expect 2 "peer --average-format f16 with mean" -- "$S" peer --blocks 1 --average-mode mean --average-format f16
"$S" peer --help | grep -q -- "--average-format F" || fail "peer help lacks --average-format"
expect 2 "peer --announce-ttl" -- "$S" peer --blocks 1 --announce-every 30 --announce-ttl 10
expect 2 "peer --model" -- "$S" peer --blocks 1 --model nope
contains "unknown model 'nope'" "unknown model message"
contains "known: fmnist-mlp, tiny-lm" "unknown model message lists the built-ins"
# --model-file: every command reads a model file the same way; errors name
# the file and the key, before any network or compute starts.
cat >"$tmp/m.json" <<'EOF'
{ "format": "starling.model.v1", "name": "cli-test.v1",
  "task": { "kind": "classes", "inputs": 784, "classes": 10 },
  "stages": [ { "kind": "linear", "in": 784, "out": 64 },
              { "kind": "head", "in": 64, "out": 10 } ] }
EOF
printf '{ "format": "starling.model.v1", "name": ' >"$tmp/bad.json"
sed 's/"out": 64 }/"out": 64, "hiden": 3 }/' "$tmp/m.json" >"$tmp/key.json"
for c in peer train infer monitor; do
    extra=""
    [ "$c" = infer ] && extra="--data test" # infer checks that first
    expect 2 "$c --model-file missing" -- "$S" $c $extra --model-file "$tmp/none.json"
    contains "model file $tmp/none.json: cannot open: No such file or directory" "$c missing model file message"
    expect 2 "$c --model-file bad JSON" -- "$S" $c $extra --model-file "$tmp/bad.json"
    contains "model file $tmp/bad.json: line 1, column" "$c bad JSON message"
    expect 2 "$c --model-file unknown key" -- "$S" $c $extra --model-file "$tmp/key.json"
    contains "stages\[0\].hiden: unknown key (known for linear: kind, in, out, repeat)" "$c unknown key message"
    expect 2 "$c --model-file vs --model" -- "$S" $c $extra --model-file "$tmp/m.json" --model fmnist-mlp
    contains "--model 'fmnist-mlp' is not the model in $tmp/m.json ('cli-test.v1')" "$c name mismatch message"
    "$S" $c --help | grep -q -- "--model-file FILE" || fail "$c help lacks --model-file"
done
# A good file is registered and selected: the checks that follow see its stages.
expect 2 "peer --model-file, stage out of range" -- "$S" peer --model-file "$tmp/m.json" --blocks 2
contains "model cli-test.v1 has stages 0..1, not 2" "peer uses the file's model"
expect 2 "peer --model-file and the same --model" -- "$S" peer --model cli-test.v1 --model-file "$tmp/m.json" --num-blocks 3
contains "model cli-test.v1 has only 2 stages" "peer --model NAME matching the file"
expect 2 "train --model-file, no peers" -- "$S" train --model-file "$tmp/m.json"
contains "--initial-peers LIST is required" "train goes past the model file"
# A language model: its own flags, its data (a file's bytes, checked before
# any network), and the commands it does not go with.
P=127.0.0.1:1/0000000000000000000000000000000000000000
expect 2 "train tiny-lm --epochs" -- "$S" train --initial-peers "$P" --model tiny-lm --epochs 2
contains "--epochs does not apply to tiny-lm, a language model" "train LM epochs message"
expect 2 "train fmnist --steps" -- "$S" train --initial-peers "$P" --steps 5
contains "--steps does not apply to fmnist-mlp, a model of images" "train images steps message"
expect 2 "train tiny-lm --sync 0" -- "$S" train --initial-peers "$P" --model tiny-lm --sync 0
contains "a language model trains in synchronous steps" "train LM sync message"
expect 1 "train tiny-lm missing corpus" -- "$S" train --initial-peers "$P" --model tiny-lm --data "$tmp/none.txt"
contains "$tmp/none.txt: No such file or directory" "train LM missing corpus message"
expect 1 "train tiny-lm corpus is a directory" -- "$S" train --initial-peers "$P" --model tiny-lm --data "$tmp"
contains "is a directory" "train LM directory message"
: >"$tmp/empty.txt"
expect 1 "train tiny-lm empty corpus" -- "$S" train --initial-peers "$P" --model tiny-lm --data "$tmp/empty.txt"
contains "$tmp/empty.txt: empty" "train LM empty corpus message"
head -c 1000 /dev/urandom >"$tmp/short.txt"
expect 1 "train tiny-lm short corpus" -- "$S" train --initial-peers "$P" --model tiny-lm --data "$tmp/short.txt"
contains "too few for context 128" "train LM short corpus message"
expect 2 "infer tiny-lm" -- "$S" infer --initial-peers "$P" --model tiny-lm --data test
contains "tiny-lm is a language model: sample from it with 'starling generate'" "infer LM message"
expect 2 "generate fmnist" -- "$S" generate --initial-peers "$P" --model fmnist-mlp
contains "fmnist-mlp is not a language model" "generate images message"
expect 2 "generate no peers" -- "$S" generate --prompt hi
contains "--initial-peers LIST is required" "generate peers message"
expect 2 "generate empty prompt" -- "$S" generate --initial-peers "$P" --prompt ""
contains "--prompt must hold at least one byte" "generate prompt message"
expect 2 "generate --temperature -1" -- "$S" generate --initial-peers "$P" --temperature -1
expect 2 "generate --replicas 10" -- "$S" generate --initial-peers "$P" --replicas 10
# dht put --value-hex: odd length, non-hex digits, over the value limit.
n=0
for v in "abc" "zz" "$(head -c 1538 /dev/zero | tr '\0' 'a')"; do
    n=$((n + 1))
    expect 2 "dht put --value-hex garbage $n" -- "$S" dht put k "$v" --value-hex --initial-peers 127.0.0.1:1/0000000000000000000000000000000000000000
    contains "--value-hex: VALUE must be an even number of hex digits" "value-hex message"
done
expect 2 "peer --max-batch 0" -- "$S" peer --blocks 1 --max-batch 0
# Gradient checks and the limits against hostile clients.
expect 2 "peer --grad-factor garbage" -- "$S" peer --blocks 1 --grad-factor lots
contains "--grad-factor expects a number, got 'lots'" "grad-factor message"
expect 2 "peer --grad-max-norm -1" -- "$S" peer --blocks 1 --grad-max-norm -1
contains "--grad-max-norm must be between" "grad-max-norm message"
expect 2 "peer --grad-warmup 0" -- "$S" peer --blocks 1 --grad-warmup 0
contains "--grad-warmup must be between 1 and" "grad-warmup message"
expect 2 "peer --frozen-steps x" -- "$S" peer --blocks 1 --frozen-steps x
contains "--frozen-steps expects an integer, got 'x'" "frozen-steps message"
expect 2 "peer --max-conns-per-ip 0" -- "$S" peer --blocks 1 --max-conns-per-ip 0
contains "--max-conns-per-ip must be between 1 and 65536, got 0" "max-conns-per-ip message"
expect 2 "peer --max-conns-per-ip garbage" -- "$S" peer --blocks 1 --max-conns-per-ip many
contains "--max-conns-per-ip expects an integer, got 'many'" "max-conns-per-ip garbage message"
expect 2 "peer --max-conns -1" -- "$S" peer --blocks 1 --max-conns -1
contains "--max-conns must be between 1 and 65536, got -1" "max-conns message"
expect 2 "peer --idle-timeout garbage" -- "$S" peer --blocks 1 --idle-timeout 2m
contains "--idle-timeout expects a number, got '2m'" "idle-timeout message"
expect 2 "peer --idle-timeout 0" -- "$S" peer --blocks 1 --idle-timeout 0
contains "--idle-timeout must be between 1 and 86400, got 0" "idle-timeout range message"
expect 2 "peer --dht-limits garbage" -- "$S" peer --blocks 1 --dht-limits some
contains "--dht-limits takes public, all or off, not 'some'" "peer dht-limits message"
expect 2 "bootstrap --dht-limits garbage" -- "$S" bootstrap --listen 127.0.0.1:0 --dht-limits ALL
contains "--dht-limits takes public, all or off, not 'ALL'" "bootstrap dht-limits message"
expect 2 "STARLING_DHT_LIMITS garbage" -- env STARLING_DHT_LIMITS=bogus "$S" peer --blocks 99
contains "STARLING_DHT_LIMITS='bogus' is not public, all or off; using public" "STARLING_DHT_LIMITS warning"
expect 2 "train --lr" -- "$S" train --initial-peers 127.0.0.1:9 --lr 0.1
contains "starling peer --lr" "train --lr message"
expect 2 "train --batch x" -- "$S" train --initial-peers 127.0.0.1:9 --batch x
expect 2 "train --refresh 0" -- "$S" train --initial-peers 127.0.0.1:9 --refresh 0
expect 2 "train --sync -1" -- "$S" train --initial-peers 127.0.0.1:9 --sync -1
expect 2 "train no peers" -- "$S" train
expect 2 "train bad peers" -- "$S" train --initial-peers "127.0.0.1:9/zz"
expect 2 "infer --data foo" -- "$S" infer --initial-peers 127.0.0.1:9 --data foo
expect 2 "infer data and input" -- "$S" infer --initial-peers 127.0.0.1:9 --data test --input x
expect 2 "infer --replicas 10" -- "$S" infer --initial-peers 127.0.0.1:9 --data test --replicas 10
expect 2 "monitor --watch x" -- "$S" monitor --initial-peers 127.0.0.1:9 --watch x
expect 2 "monitor no peers" -- "$S" monitor

# keygen: writes mode 0600, prints 40 hex digits, and --show agrees.
expect 0 "keygen" -- "$S" keygen --out "$tmp/a.key"
id=$(cat "$tmp/out")
echo "$id" | grep -Eq '^[0-9a-f]{40}$' || fail "keygen printed '$id', want 40 hex digits"
mode=$(stat -c %a "$tmp/a.key")
[ "$mode" = 600 ] || fail "key file mode $mode, want 600"
expect 0 "keygen --show" -- "$S" keygen --show "$tmp/a.key"
[ "$(cat "$tmp/out")" = "$id" ] || fail "--show printed $(cat "$tmp/out"), want $id"
expect 1 "keygen refuses overwrite" -- "$S" keygen --out "$tmp/a.key"
contains "already exists" "overwrite message"
expect 0 "keygen --force" -- "$S" keygen --out "$tmp/a.key" --force
[ "$(cat "$tmp/out")" != "$id" ] || fail "--force kept the old identity"
expect 2 "keygen needs a file" -- "$S" keygen
expect 2 "keygen both" -- "$S" keygen --out "$tmp/b.key" --show "$tmp/a.key"

chmod 644 "$tmp/a.key"
expect 1 "world-readable key" -- "$S" keygen --show "$tmp/a.key"
contains "chmod 600" "world-readable message"
chmod 600 "$tmp/a.key"
printf 'starling-ed25519-v1 nothex\n' >"$tmp/c.key"; chmod 600 "$tmp/c.key"
expect 1 "corrupt key" -- "$S" keygen --show "$tmp/c.key"
contains "not a valid Starling identity" "corrupt key message"
expect 1 "missing key" -- "$S" keygen --show "$tmp/none.key"
contains "no such file" "missing key message"
expect 1 "unwritable dir" -- "$S" keygen --out "$tmp/a.key/sub/k"
contains "cannot create directory" "unwritable dir message"

# keygen creates missing parent directories (mode 0700), only the missing
# ones: README's `--out ~/.starling/identity.key` on a fresh machine.
mkdir "$tmp/home" && chmod 755 "$tmp/home"
expect 0 "keygen into new dirs" -- "$S" keygen --out "$tmp/home/.starling/sub/identity.key"
[ -f "$tmp/home/.starling/sub/identity.key" ] || fail "keygen did not write into new directories"
for d in "$tmp/home/.starling" "$tmp/home/.starling/sub"; do
    mode=$(stat -c %a "$d" 2>/dev/null)
    [ "$mode" = 700 ] || fail "created directory $d has mode '$mode', want 700"
done
mode=$(stat -c %a "$tmp/home")
[ "$mode" = 755 ] || fail "existing directory changed to mode $mode, want 755 kept"
expect 0 "keygen help" -- "$S" keygen --help
contains "0700" "keygen help mentions created directories"

# infer --input with images of the wrong size names both shapes.
{ printf '\000\000\010\003\000\000\000\001\000\000\000\040\000\000\000\040'
  head -c 1024 /dev/zero; } >"$tmp/img32.idx"
expect 1 "infer 32x32 input" -- "$S" infer --initial-peers 127.0.0.1:9 --input "$tmp/img32.idx"
contains "img32.idx: images are 32x32 (1024 values); fmnist-mlp expects 28x28 (784)" "infer shape message"

# A swarm key file that is not one: a clear sentence before any network.
echo zz >"$tmp/bad.key"; chmod 600 "$tmp/bad.key"
expect 2 "monitor, garbage swarm key" -- "$S" monitor --initial-peers 127.0.0.1:9 --swarm-key "$tmp/bad.key"
contains "cannot load swarm key '$tmp/bad.key': expected 64 hex digits" "garbage swarm key message"
printf '%064d\n' 7 >"$tmp/open.key"; chmod 644 "$tmp/open.key"
expect 2 "monitor, world-readable swarm key" -- "$S" monitor --initial-peers 127.0.0.1:9 --swarm-key "$tmp/open.key"
contains "readable by group or others; chmod 600 it" "open swarm key message"
expect 1 "peer, garbage swarm key" -- "$S" peer --initial-peers 127.0.0.1:9 --blocks 0 --swarm-key "$tmp/bad.key"
contains "cannot load swarm key '$tmp/bad.key': expected 64 hex digits" "peer garbage swarm key message"

# A join whose initial peer answers, but as another node or under another
# swarm key, says so (not "cannot reach"). monitor exits 2 on connection
# errors.
"$S" bootstrap --listen 127.0.0.1:0 >"$tmp/bs.out" 2>"$tmp/bs.err" &
BS_PID=$!
for i in $(seq 1 100); do grep -q / "$tmp/bs.out" 2>/dev/null && break; sleep 0.1; done
BS=$(head -1 "$tmp/bs.out")
case "$BS" in
*:*/*)
    bs_host=${BS%/*}
    bs_id=${BS##*/}
    other=abababababababababababababababababababab
    expect 2 "monitor, wrong node ID" -- "$S" monitor --initial-peers "$bs_host/$other" --timeout 10
    contains "$bs_host answered as node $bs_id, not $other: check the node ID in --initial-peers" \
        "wrong node ID message"
    printf '%064d\n' 7 >"$tmp/swarm.key"; chmod 600 "$tmp/swarm.key"
    expect 2 "monitor, wrong swarm key" -- "$S" monitor --initial-peers "$BS" --swarm-key "$tmp/swarm.key" --timeout 10
    contains "$bs_host answers, but not under our swarm key: check --swarm-key" "swarm key message"
    ;;
*)
    fail "bootstrap did not print its address"; sed 's/^/    /' "$tmp/bs.err" >&2
    ;;
esac

if [ "$fails" -ne 0 ]; then
    echo "$fails check(s) failed" >&2
    exit 1
fi
echo "all CLI checks passed"
