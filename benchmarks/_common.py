"""Shared set-up for the benchmark scripts: build a simulation of the fmnist-lt protocol (BENCHMARKS.md A)."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fedlt.config import RunConfig  # noqa: E402
from fedlt.engine import EngineConfig, Simulation  # noqa: E402
from fedlt.experiment import federation_for, prepare  # noqa: E402


def simulation(method="fedavg", fed=None, **over) -> Simulation:
    cfg = RunConfig(method=method, **over)
    pr = prepare(cfg, fed)
    return Simulation(pr.method, pr.fed, EngineConfig(cfg.rounds, cfg.participation, cfg.eval_every, cfg.seed,
                                                      cfg.split, progress=False))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(a, b, reps: int) -> tuple[float, float]:
    """Median times of a() and b(), run alternately (A B A B ...) so machine noise hits both alike."""
    ta, tb = [], []
    for _ in range(reps):
        ta.append(timed(a))
        tb.append(timed(b))
    return statistics.median(ta), statistics.median(tb)


__all__ = ["simulation", "federation_for", "RunConfig", "timed", "interleaved"]
