#!/usr/bin/env python3
"""Median table of tests/bench/expert_compare.sh output (standard library only).

Usage: expert_compare.py [--best] OUT.jsonl... [--quiet GFLOPS]   -> markdown table.
--best reports each side's best run (highest samples/s) instead of the
median: on a machine shared with other work, interference only ever slows a
run down, so the best run is the least disturbed one.
--quiet G keeps only measurements taken while the machine was quiet: torch
runs whose torch.mm 1024^3 reached G GFLOP/s at that thread setting, and
block_bench runs (made with SGEMM_ALL=1) whose own sgemm reached G.
Starling threads T is compared with torch "1" for T=1 and torch "1:2" (its
best setting) for T=2.
"""
import json
import statistics
import sys
from collections import defaultdict


def main(paths, quiet=0.0, best=False):
    ours = defaultdict(list)     # (blas, d, b, t) -> [(samples/s, gflops, fwd samples/s)]
    torch = defaultdict(list)    # (blas, d, b, spec, kind) -> [samples/s]
    sgemm = defaultdict(list)    # (blas, t) -> [(gflops, pct)]
    cores = {}
    lines = [l for p in paths for l in open(p)]
    for line in lines:
        r = json.loads(line)
        if r["side"] == "starling":
            if quiet and r.get("sgemm_gflops", 0.0) < quiet:
                continue
            k = (r["blas"], r["d"], r["batch"], r["threads"])
            ours[k].append((r["samples_per_s"], r["gflops"], r["fwd_samples_per_s"]))
            cores[("starling", r["blas"])] = r["openblas_core"]
            if "sgemm_gflops" in r and r["d"] == 1024 and r["batch"] == 256:
                sgemm[(r["blas"], r["threads"])].append((r["sgemm_gflops"], r["pct_of_sgemm"]))
        else:
            cores[("torch", r["blas"])] = r["env"].get("openblas_core")
            mm = {x["threads"]: x["gflops"] for x in r["results"] if x["kind"] == "sgemm_torch_mm"}
            for x in r["results"]:
                if quiet and mm.get(x["threads"], 0.0) < quiet:
                    continue
                if x["kind"].startswith("resffn"):
                    torch[(r["blas"], x["d"], x["batch"], x["threads"], x["kind"])].append(
                        x["samples_per_s"])
                elif x["kind"] == "sgemm_torch_mm":
                    torch[(r["blas"], 0, 0, x["threads"], "sgemm")].append(x["gflops"])
    med = max if best else statistics.median
    for blas in sorted({k[0] for k in ours}):
        print(f"\n#### OPENBLAS_CORETYPE={blas}: Starling core {cores.get(('starling', blas))}, "
              f"torch core {cores.get(('torch', blas))}\n")
        print("| d | batch | threads (ours / torch) | fwd+bwd samples/s ours | torch | ratio "
              "| fwd samples/s ours | torch | ratio | ours GFLOP/s (fwd+bwd) | runs ours/torch |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for d in (256, 1024):
            for b in (32, 256):
                for t, spec in ((1, "1"), (2, "1:2")):
                    o = ours.get((blas, d, b, t))
                    tf = torch.get((blas, d, b, spec, "resffn_fwd_bwd"))
                    tw = torch.get((blas, d, b, spec, "resffn_fwd"))
                    if not o or not tf or not tw:
                        continue
                    of, og, ow = med([x[0] for x in o]), med([x[1] for x in o]), med([x[2] for x in o])
                    print(f"| {d} | {b} | {t} / {spec} | {of:.0f} | {med(tf):.0f} | "
                          f"**{of / med(tf):.2f}x** | {ow:.0f} | {med(tw):.0f} | {ow / med(tw):.2f}x | {og:.1f} "
                          f"| {len(o)}/{len(tf)} |")
        for t in (1, 2):
            s = sgemm.get((blas, t))
            if s:
                o = ours.get((blas, 1024, 256, t), [])
                print(f"\nd=1024 batch=256 threads {t}: fwd+bwd / cblas_sgemm 1024^3 in the same "
                      f"process: median {statistics.median([x[1] for x in s]):.1f} % over {len(s)} runs; "
                      f"best fwd+bwd {max(x[1] for x in o):.1f} / best sgemm "
                      f"{max(x[0] for x in s):.1f} GFLOP/s = "
                      f"{100 * max(x[1] for x in o) / max(x[0] for x in s):.1f} %")
        for spec in ("1", "1:2"):
            ts = torch.get((blas, 0, 0, spec, "sgemm"))
            if ts:
                print(f"torch.mm 1024^3 at threads {spec}: {med(ts):.1f} GFLOP/s")


if __name__ == "__main__":
    args = sys.argv[1:]
    best = "--best" in args
    args = [a for a in args if a != "--best"]
    q = 0.0
    if "--quiet" in args:
        i = args.index("--quiet")
        q = float(args[i + 1])
        del args[i:i + 2]
    main(args, q, best)
