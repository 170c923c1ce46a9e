#!/bin/sh
# A 4-process swarm on loopback (bootstrap + 3 peers, stages 2 and 3 with two
# replicas) trains fmnist-mlp on a subset and beats a fixed accuracy.
. "$(dirname "$0")/swarm_lib.sh"
start_bootstrap
start_peer a 0-2
start_peer b 3-5 --metrics 127.0.0.1:0
start_peer c 2,3
# train_ok NAME SAMPLES [FLAGS...]: trains on SAMPLES training samples; it
# must exit 0, process every sample exactly once and beat 0.55 accuracy.
train_ok() {
    name=$1 n=$2
    shift 2
    timeout 300 "$S" train --initial-peers "$BS" --train-samples "$n" --json "$@" \
        >"$T/$name.out" 2>"$T/$name.err"
    rc=$?
    [ "$rc" -eq 0 ] || { fail "$name: train exited $rc"; show "$T/$name.err"; }
    acc=$(json_field "$T/$name.out" test_acc)
    samples=$(json_field "$T/$name.out" samples)
    echo "$name: test_acc=$acc samples=$samples"
    awk "BEGIN { exit !($acc >= 0.55) }" || fail "$name: test accuracy $acc below 0.55"
    [ "$samples" = "$n" ] || fail "$name: processed $samples samples, want $n"
}
train_ok train 6000 --test-samples 2000 --metrics-log "$T/train.jsonl" --plot "$T/train.svg"
grep -q '"event":"epoch"' "$T/train.jsonl" || fail "no epoch line in the metrics log"
grep -q '<polyline' "$T/train.svg" || fail "no curve in the plot"
# Peer b alone holds stages 4 and 5, so it serves both halves of their
# samples: its backwards take the kept forward activations (the peer's
# default --keep-activations 16) instead of recomputing.
mport=$(sed -n 's#.*metrics on http://127.0.0.1:\([0-9]*\)/metrics#\1#p' "$T/b.err")
if PY=$(command -v python3); then
    "$PY" - "$mport" <<'PYEOF' || fail "peer b's backwards did not use kept activations"
import re, sys, urllib.request
body = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=60).read().decode()
def val(name):
    m = re.search(r'^%s\{block="fmnist-mlp.4"\} (\S+)$' % name, body, re.M)
    assert m, name
    return float(m.group(1))
kept, recomputed = val("starling_backward_kept_samples_total"), val("starling_backward_recomputed_samples_total")
print("stage 4 backward rows: kept", kept, "recomputed", recomputed)
assert kept >= 3000, (kept, recomputed)  # of 6000; the rest: slots reused, retries
PYEOF
    # Honest training: the gradient checks refused nothing and no block is
    # frozen; the limits' counters are exported.
    "$PY" - "$mport" <<'PYEOF' || fail "peer b's metrics: gradient checks or limits"
import re, sys, urllib.request
body = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=60).read().decode()
for blk in ("fmnist-mlp.3", "fmnist-mlp.4", "fmnist-mlp.5"):
    for kind in ("request", "step"):
        m = re.search(r'^starling_gradients_refused_total\{block="%s",kind="%s"\} (\S+)$' % (blk, kind), body, re.M)
        assert m and float(m.group(1)) == 0, (blk, kind, m and m.group(0))
    m = re.search(r'^starling_weights_frozen\{block="%s"\} (\S+)$' % blk, body, re.M)
    assert m and float(m.group(1)) == 0, (blk, m and m.group(0))
for name in ('starling_rpc_refused_total{reason="per_ip"}', 'starling_rpc_closed_total{reason="idle"}',
             'starling_rpc_queued_bytes', 'starling_metrics_endpoint_refused_total{reason="per_ip"}',
             'starling_dht_refused_total{where="table"}'):
    assert re.search(r'^%s \S+$' % re.escape(name), body, re.M), name
print("peer b: no gradient refused, no block frozen, limit counters exported")
PYEOF
fi
# Synchronous groups (--sync): 100-sample groups (not a multiple of the
# micro-batch, so groups cut micro-batches short) with 4 in flight still
# process every sample exactly once and learn.
train_ok sync 3000 --test-samples 1000 --sync 100 --inflight 4 --metrics-log "" --plot ""
finish
