"""SSE-C construction time: d=512, C=100, 10,000 Adam steps (the paper's setting; paper: 11m52s on an RTX 3090).

Usage: python benchmarks/sse_c_construction.py [--variant paper|official] [--steps N] [--threads T]
                                                [--precision float64|float32]
Prints the wall time of the construction and the geometry report (the paper's Table 6 quantities).
--precision: the dtype of the Adam steps (fedlt.core.etf: float64, the default, gives the same matrix on every
CPU; float32 is the official code's).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from fedlt.core.etf import PRECISIONS, SSE_PRECISION, etf_report, resolve_spec, sparse_etf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--C", type=int, default=100)
    ap.add_argument("--beta", type=float, default=0.6)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--variant", default="paper", choices=["paper", "official"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", default=SSE_PRECISION, choices=list(PRECISIONS))
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for the refinement loop (default: the library's choice, 1 thread for C <= 256)")
    args = ap.parse_args()

    spec = resolve_spec("sse-c", args.d, args.C, args.beta, args.seed, variant=args.variant, steps=args.steps,
                        precision=args.precision)
    threads = args.threads if args.threads is not None else (1 if args.C <= 256 else torch.get_num_threads())
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s), refinement on {threads} thread(s); spec {spec}")
    t0 = time.perf_counter()
    W = sparse_etf(args.d, args.C, beta=args.beta, steps=args.steps, seed=args.seed, variant=args.variant,
                   threads=args.threads, precision=args.precision)
    wall = time.perf_counter() - t0
    print(f"SSE-C construction d={args.d} C={args.C} steps={args.steps}: {wall:.2f} s wall "
          f"({1e3 * wall / max(args.steps, 1):.3f} ms/step); paper: 712 s (11m52s) on an RTX 3090")
    rep = etf_report(W)
    width = max(len(k) for k in rep)
    for k, v in rep.items():
        print(f"  {k:<{width}}  {v:.6g}" if isinstance(v, float) else f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    main()
