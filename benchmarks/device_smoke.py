"""Every registered method through the command line on one device (issue 11's device smoke): ``fedlt run
--method M --device D --rounds 2`` on fmnist-lt, ``--jobs`` runs at a time (on a GPU, start NVIDIA MPS first:
``nvidia-cuda-mps-control -d``), and a table of each run's exit status, final GM and PM (the first mode each
method reports) and wall time. Extra ``fedlt run`` options go after ``--``.

    python benchmarks/device_smoke.py [--device cuda] [--jobs 8] [--rounds 2] [--methods a,b] [--out DIR] [-- ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fedlt.registry import METHODS  # noqa: E402


def first_acc(side: dict) -> float | None:
    mode = next(iter(side.values()), None)
    return None if mode is None else mode["acc"]


def one(method: str, a, extra: list[str], out: Path) -> tuple[str, int, float | None, float | None, float, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "fedlt", "run", "--method", method, "--device", a.device, "--rounds", str(a.rounds),
           "--eval-every", str(a.rounds), "--no-progress", "--out", str(out), "--name", method, *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    gm = pm = None
    summary = out / method / "summary.json"
    if r.returncode == 0 and summary.exists():
        final = json.loads(summary.read_text())["final"]
        gm, pm = first_acc(final.get("global", {})), first_acc(final.get("personal", {}))
    err = (r.stderr.strip().splitlines() or [""])[-1] if r.returncode else ""
    return method, r.returncode, gm, pm, wall, err


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS.names()))
    ap.add_argument("--out", default=None, help="run directories (default: a temporary folder)")
    a = ap.parse_args(argv)
    methods = a.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out or tmp)
        print(f"{len(methods)} methods, fmnist-lt, {a.rounds} rounds, device {a.device}, {a.jobs} at a time"
              + (f", extra options: {' '.join(extra)}" if extra else ""), flush=True)
        print(f"{'method':<14} {'exit':>4} {'GM':>7} {'PM':>7} {'wall s':>7}", flush=True)
        fmt = lambda v: "-" if v is None else f"{100 * v:.2f}"  # noqa: E731
        failed = 0
        with ThreadPoolExecutor(a.jobs) as pool:
            for m, rc, gm, pm, wall, err in pool.map(lambda m: one(m, a, extra, out), methods):
                failed += rc != 0
                print(f"{m:<14} {rc:>4} {fmt(gm):>7} {fmt(pm):>7} {wall:7.1f}" + (f"   {err}" if err else ""),
                      flush=True)
        print(f"{len(methods) - failed} of {len(methods)} exited 0")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
