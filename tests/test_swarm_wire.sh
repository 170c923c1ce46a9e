#!/bin/sh
# Compressed tensors on the wire (docs/rpc.md, "Tensor formats"): fresh
# loopback swarms (bootstrap + 2 peers) train fmnist-mlp on the same subset,
# with the same seeds and synchronous steps, once in float32 and once with
# 8-bit activations and gradients (q8); q8 must reach the float32 accuracy
# within 1 point while sending under a third of the bytes. Then a holder
# that accepts only f32 is sent f32 while the others get q8, and the peers'
# metrics count the bytes by format.
. "$(dirname "$0")/swarm_lib.sh"
N=6000
# run NAME FORMAT: a fresh swarm, one training run, its peers stopped.
run() {
    start_bootstrap
    start_peer "a$1" 0-2
    start_peer "b$1" 3-5 --metrics 127.0.0.1:0
    timeout 300 "$S" train --initial-peers "$BS" --train-samples "$N" --test-samples 2000 --sync 128 \
        --wire-format "$2" --json --metrics-log "" --plot "" >"$T/$1.out" 2>"$T/$1.err"
    rc=$?
    [ "$rc" -eq 0 ] || { fail "$1: train exited $rc"; show "$T/$1.err"; }
    echo "$1: $(tail -1 "$T/$1.out")"
}
run f32 f32
eval "stop_peer \$PID_af32 30; stop_peer \$PID_bf32 30"
run q8 q8
acc32=$(json_field "$T/f32.out" test_acc); acc8=$(json_field "$T/q8.out" test_acc)
b32=$(json_field "$T/f32.out" bytes_per_sample); b8=$(json_field "$T/q8.out" bytes_per_sample)
[ "$(json_field "$T/q8.out" samples)" = "$N" ] || fail "q8: not every sample was processed"
[ "$(json_field "$T/q8.out" f32_calls)" = 0 ] || fail "q8: some calls went in f32 though every holder takes q8"
[ "$(json_field "$T/q8.out" wire_format)" = q8 ] || fail "q8: the summary does not name the format"
awk "BEGIN { exit !($acc32 >= 0.55) }" || fail "f32: test accuracy $acc32 below 0.55"
awk "BEGIN { d = $acc32 - $acc8; exit !(d <= 0.01) }" || fail "q8 accuracy $acc8 is more than 1 point below f32's $acc32"
awk "BEGIN { exit !($b8 > 0 && $b32 / $b8 >= 3.5) }" || fail "q8 sends $b8 bytes/sample, f32 $b32: under 3.5x less"
echo "accuracy f32 $acc32 q8 $acc8; bytes/sample f32 $b32 q8 $b8"
# Peer b's metrics count the q8 bytes it received and sent.
mport=$(sed -n 's#.*metrics on http://127.0.0.1:\([0-9]*\)/metrics#\1#p' "$T/bq8.err")
if PY=$(command -v python3); then
    "$PY" - "$mport" <<'PYEOF' || fail "peer b's metrics do not count q8 bytes"
import re, sys, urllib.request
body = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=60).read().decode()
def val(method, fmt, d):
    m = re.search(r'^starling_tensor_bytes_total\{method="%s",format="%s",direction="%s"\} (\S+)$'
                  % (method, fmt, d), body, re.M)
    assert m, (method, fmt, d)
    return float(m.group(1))
for meth in ("forward", "backward"):
    for d in ("received", "sent"):
        assert val(meth, "q8", d) > 0, (meth, d)
        assert val(meth, "f32", d) == 0, (meth, d)
assert re.search(r'^starling_wire_formats_info\{formats="f32,f16,bf16,q8"\} 1$', body, re.M)
print("peer b: q8 bytes counted, no f32 tensors")
PYEOF
fi
grep -q 'tensor formats accepted: f32,f16,bf16,q8' "$T/aq8.err" || fail "peer a does not say which formats it accepts"
# A holder that takes only f32 (a replica of stages 3-5) gets f32; the
# monitor shows what each holder accepts.
start_peer c 3-5 --wire-formats f32
"$S" monitor --json --initial-peers "$BS" >"$T/mon.json" 2>"$T/mon.err"
grep -q "\"wire_formats\":\"f32\"" "$T/mon.json" || fail "the monitor does not show peer c's formats"
grep -q "\"wire_formats\":\"f32,f16,bf16,q8\"" "$T/mon.json" || fail "the monitor does not show peer b's formats"
eval "stop_peer \$PID_bq8 30"
timeout 300 "$S" train --initial-peers "$BS" --train-samples 1000 --test-samples 500 --wire-format q8 --json \
    --metrics-log "" --plot "" >"$T/mixed.out" 2>"$T/mixed.err" || { fail "mixed: train failed"; show "$T/mixed.err"; }
f32c=$(json_field "$T/mixed.out" f32_calls)
[ "${f32c:-0}" -gt 0 ] || fail "mixed: no call went to the f32-only holder in f32"
awk "BEGIN { exit !($(json_field "$T/mixed.out" test_acc) >= 0.4) }" || fail "mixed: did not learn"
echo "mixed: $f32c calls in f32 to the f32-only holder"
"$S" train --initial-peers "$BS" --wire-format q8:100 >"$T/bad.out" 2>"$T/bad.err"
[ $? -eq 2 ] || fail "--wire-format q8:100 is not a usage error"
grep -q "power of" "$T/bad.err" || fail "--wire-format q8:100: no clear error"
finish
