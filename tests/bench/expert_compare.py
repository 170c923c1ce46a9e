#!/usr/bin/env python3
"""Median table of tests/bench/expert_compare.sh output (standard library only).

Usage: expert_compare.py OUT.jsonl   -> markdown table on stdout.
Starling threads T is compared with torch "1" for T=1 and torch "1:2" (its
best setting) for T=2.
"""
import json
import statistics
import sys
from collections import defaultdict


def main(path):
    ours = defaultdict(list)     # (blas, d, b, t) -> [(samples/s, gflops, fwd samples/s)]
    torch = defaultdict(list)    # (blas, d, b, spec, kind) -> [samples/s]
    sgemm = defaultdict(list)    # (blas, t) -> [(gflops, pct)]
    cores = {}
    for line in open(path):
        r = json.loads(line)
        if r["side"] == "starling":
            k = (r["blas"], r["d"], r["batch"], r["threads"])
            ours[k].append((r["samples_per_s"], r["gflops"], r["fwd_samples_per_s"]))
            cores[("starling", r["blas"])] = r["openblas_core"]
            if "sgemm_gflops" in r:
                sgemm[(r["blas"], r["threads"])].append((r["sgemm_gflops"], r["pct_of_sgemm"]))
        else:
            cores[("torch", r["blas"])] = r["env"].get("openblas_core")
            for x in r["results"]:
                if x["kind"].startswith("resffn"):
                    torch[(r["blas"], x["d"], x["batch"], x["threads"], x["kind"])].append(
                        x["samples_per_s"])
                elif x["kind"] == "sgemm_torch_mm":
                    torch[(r["blas"], 0, 0, x["threads"], "sgemm")].append(x["gflops"])
    med = statistics.median
    for blas in sorted({k[0] for k in ours}):
        print(f"\n#### OPENBLAS_CORETYPE={blas}: Starling core {cores.get(('starling', blas))}, "
              f"torch core {cores.get(('torch', blas))}\n")
        print("| d | batch | threads (ours / torch) | fwd+bwd samples/s ours | torch | ratio "
              "| fwd samples/s ours | torch | ratio | ours GFLOP/s (fwd+bwd) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
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
                          f"**{of / med(tf):.2f}x** | {ow:.0f} | {med(tw):.0f} | {ow / med(tw):.2f}x | {og:.1f} |")
        for t in (1, 2):
            s = sgemm.get((blas, t))
            if s:
                print(f"\nd=1024 batch=256 threads {t}: fwd+bwd at "
                      f"{med([x[1] for x in s]):.1f} % of cblas_sgemm 1024^3 "
                      f"({med([x[0] for x in s]):.1f} GFLOP/s, same process, median of {len(s)})")
        for spec in ("1", "1:2"):
            ts = torch.get((blas, 0, 0, spec, "sgemm"))
            if ts:
                print(f"torch.mm 1024^3 at threads {spec}: {med(ts):.1f} GFLOP/s")


if __name__ == "__main__":
    main(sys.argv[1])
