"""Worker processes (issue 44): the round time of FedAvg and FedLoGe on the fmnist-lt protocol (10 clients a
round) and of FedAvg with 100 clients a round, with 1, 2, ... worker processes up to the cores of the machine
(one torch thread each), as ratios to the one-thread serial round, the configurations interleaved round by
round so that machine noise hits them alike.

Goal: N workers within 1.3x of the serial round / N while a round has >= N clients (so on a 2-core machine the
2-worker speed-up >= 2 / 1.3 = 1.54x), and never slower than serial.

    python benchmarks/workers.py [--reps 3] [--max-workers N] [--only fedavg|fedloge|fedavg-100]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from _common import simulation, timed

from fedlt.config import available_cores  # noqa: E402
from fedlt.engine.workers import Workers  # noqa: E402


def cases(only):
    out = {"fedavg": dict(method="fedavg"), "fedloge": dict(method="fedloge"),
           # 100 clients a round: 200 clients (the fmnist-lt samples spread over them), half a round
           "fedavg-100": dict(method="fedavg", clients=200, participation=0.5)}
    return {k: v for k, v in out.items() if not only or k in only}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-workers", type=int, default=0, help="default: the cores this process may use")
    ap.add_argument("--only", default="", help="comma-separated: fedavg, fedloge, fedavg-100")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cores = available_cores()
    top = a.max_workers or cores
    counts = [n for n in range(2, top + 1)]
    print(f"{cores} cores; serial = one client after another with 1 torch thread; N workers x 1 thread each; "
          f"medians of {a.reps} rounds, interleaved")
    print("| case | clients a round | serial round (s) | " + " | ".join(f"{n} workers: time (s), speed-up, "
                                                                          f"goal" for n in counts) + " |")
    print("|---|---|---|" + "---|" * len(counts))
    for name, over in cases(a.only.split(",") if a.only else None).items():
        sims = {0: simulation(rounds=a.reps + 2, **over)}
        for n in counts:
            s = simulation(rounds=a.reps + 2, **over)
            s.transport = Workers(s.method, s.fed, s.cfg.seed, n, s.transport.client_states)
            sims[n] = s
        per_round = len(sims[0].schedule[0])
        times = {n: [] for n in sims}
        for r in range(a.reps + 1):  # round 1: warm-up (the pool's start, first-call costs), not counted
            for n, s in sims.items():
                s.round = r
                t = timed(s.train_round)
                if r:
                    times[n].append(t)
        for s in sims.values():
            close = getattr(s.transport, "close", None)
            if close:
                close()
        base = statistics.median(times[0])
        cells = []
        for n in counts:
            t = statistics.median(times[n])
            goal = "met" if (base / t >= n / 1.3 if per_round >= n else t <= base) and t <= base else "missed"
            cells.append(f"{t:.2f}, {base / t:.2f}x, {goal}")
        print(f"| {name} | {per_round} | {base:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
