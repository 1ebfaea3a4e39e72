"""Overhead of Flower's simulation runtime (``fedlt flower simulate``: the fedlt ServerApp and ClientApp over Ray
actors) per round, against the simulation engine (``fedlt run``) on the same run: the median time of a training
round (metrics.jsonl ``round_time``, evaluation excluded) of each, and their ratio, for 10 and 100 clients per
round; also the whole command's wall time (Ray's start and the actors' torch import are the fixed cost).

    python benchmarks/flower_simulation_overhead.py [--clients 10,100] [--rounds 4] [--cpus-per-client 1]

A tiny model (mlp on Fashion-MNIST-LT, rho 10), one local epoch, one torch thread per process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def timed(argv: list[str], out: Path) -> tuple[float, float]:
    """(median training-round time after the first round, wall time of the command)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDLT_TENSORBOARD": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join(x for x in (str(SRC), os.environ.get("PYTHONPATH")) if x)}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "fedlt", *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        sys.exit(p.stdout[-2000:] + p.stderr[-2000:])
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rounds = [r["round_time"] for r in recs if "round" in r][1:]  # the first round warms up (actors, caches)
    return statistics.median(rounds), wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="10,100", help="clients per round (all of the federation's, each round)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cpus-per-client", type=float, default=1.0)
    a = ap.parse_args()
    print(f"{'clients/round':>13} {'simulator s/round':>18} {'flower sim s/round':>19} {'ratio':>6} "
          f"{'wall simulator':>15} {'wall flower sim':>16}")
    with tempfile.TemporaryDirectory() as tmp:
        for k in [int(x) for x in a.clients.split(",")]:
            run = ["--dataset", "fashion-mnist", "--rho", "10", "--clients", str(k), "--participation", "1.0",
                   "--rounds", str(a.rounds), "--eval-every", str(a.rounds), "--local-epochs", "1", "--model", "mlp",
                   "--threads", "1", "--out", tmp]
            sim_r, sim_w = timed(["run", *run, "--name", f"sim{k}", "--no-progress", "--checkpoint-every", "0"],
                                 Path(tmp) / f"sim{k}")
            fl_r, fl_w = timed(["flower", "simulate", *run, "--name", f"fl{k}", "--cpus-per-client",
                                str(a.cpus_per_client)], Path(tmp) / f"fl{k}")
            print(f"{k:>13} {sim_r:>18.3f} {fl_r:>19.3f} {fl_r / sim_r:>6.2f} {sim_w:>15.1f} {fl_w:>16.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
