#!/usr/bin/python3
"""One decoder layer's forward+backward time: Starling's DECODER block
(tests/bench/lm_bench, layers=1, expert_block_forward_backward) against
torch's train_lm.py Block (y = blk(x); y.backward(dy), grads reset to None
each iteration, as compute.py's fwd_bwd_fn), shape by shape, interleaved so
background load hits both sides alike.

    /usr/bin/python3 tests/bench/lm_bench.py BUILD_DIR [--shapes d:T:B,...]
        [--heads 8] [--threads 1] [--min-time 1.5]

Both sides run with the same thread count (torch intra-op threads and
OpenBLAS threads = --threads on the torch side, expert_blas_set_threads on
ours) and the same OpenBLAS kernels: OPENBLAS_CORETYPE as in the
environment (lm_bench gets STARLING_BLAS_CORETYPE=env so it keeps it).
Timing is compute.py's: warm-up (>= 3 calls and 0.2 s), 5 chunks of about
min_time/5 s, the median per-iteration time. The model classes come from
../shared/bench/torch/train_lm.py, the timing loop from compute.py there.
Last stdout line: one JSON object; "ratio" = our time / torch's time
(< 1: we are faster), per shape and as a geometric mean.
tests/bench/lm_bench_results.jsonl: one run on the 2-core VM (Haswell
kernels, 1 thread, --min-time 1.0) while other work loaded it (load ~2.8),
so its figures are indicative only.
"""
import argparse
import json
import math
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(ROOT), "shared", "bench", "torch"))

import torch  # noqa: E402

import common  # noqa: E402
import compute  # noqa: E402  (bench, fwd_fn, fwd_bwd_fn)
import train_lm  # noqa: E402  (Block)

DEFAULT_SHAPES = "256:128:8,256:128:32,512:128:8,256:512:8,512:512:8"


def torch_side(d, T, B, heads, min_time):
    blk = train_lm.Block(d, heads, T)
    blk.train()
    x = torch.randn(B, T, d)
    fb, _ = compute.bench(compute.fwd_bwd_fn(blk, x), min_time, 5)
    fw, _ = compute.bench(compute.fwd_fn(blk, x), min_time, 5)
    return fb, fw


def our_side(exe, d, T, B, heads, threads, min_time):
    env = dict(os.environ, STARLING_BLAS_CORETYPE="env")
    out = subprocess.run([exe, "--d", str(d), "--seq", str(T), "--batch", str(B),
                          "--heads", str(heads), "--layers", "1", "--threads", str(threads),
                          "--min-time", str(min_time)],
                         env=env, capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return r["ms_per_iter"] / 1e3, r["fwd_ms_per_iter"] / 1e3, r["openblas_core"]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build", help="meson build directory (holds tests/bench/lm_bench)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"d:T:B list (default {DEFAULT_SHAPES})")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--min-time", type=float, default=1.5)
    a = ap.parse_args()
    exe = os.path.join(a.build, "tests", "bench", "lm_bench")
    if not os.access(exe, os.X_OK):
        raise SystemExit(f"no {exe}: build first")
    common.set_threads(a.threads, a.threads)
    torch.manual_seed(0)
    results, logs = [], []
    for spec in a.shapes.split(","):
        d, T, B = (int(v) for v in spec.split(":"))
        t_fb, t_fw = torch_side(d, T, B, a.heads, a.min_time)
        o_fb, o_fw, core = our_side(exe, d, T, B, a.heads, a.threads, a.min_time)
        fl = B * T * (2 * 12 * d * d + 4 * T * d)  # train_lm.py's count, one layer, forward
        r = dict(d=d, seq=T, batch=B, heads=a.heads,
                 torch_ms=round(t_fb * 1e3, 3), ours_ms=round(o_fb * 1e3, 3),
                 torch_fwd_ms=round(t_fw * 1e3, 3), ours_fwd_ms=round(o_fw * 1e3, 3),
                 torch_gflops=round(3 * fl / t_fb / 1e9, 2), ours_gflops=round(3 * fl / o_fb / 1e9, 2),
                 ratio=round(o_fb / t_fb, 3), fwd_ratio=round(o_fw / t_fw, 3), our_core=core)
        results.append(r)
        logs.append(math.log(max(o_fb, 1e-12) / t_fb))
        print(f"d={d:4d} T={T:4d} B={B:3d}: fwd+bwd torch {r['torch_ms']:9.2f} ms, ours "
              f"{r['ours_ms']:9.2f} ms (ratio {r['ratio']:.3f}); fwd torch {r['torch_fwd_ms']:.2f} "
              f"ms, ours {r['ours_fwd_ms']:.2f} ms", flush=True)
    geo = math.exp(sum(logs) / len(logs))
    common.emit(dict(bench="lm_bench", what="one decoder layer fwd+bwd, ours vs torch train_lm.Block",
                     threads=a.threads, openblas_coretype=os.environ.get("OPENBLAS_CORETYPE"),
                     torch_threads=common.thread_info(), results=results,
                     ratio_geomean=round(geo, 3)))


if __name__ == "__main__":
    main()
