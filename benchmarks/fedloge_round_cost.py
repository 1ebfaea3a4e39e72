"""FedLoGe cost (docs/protocol.md B): one FedLoGe training round vs one FedAvg round in the same setting (fmnist-lt:
same federation, same clients, same batches), run alternately in one process. Goal: ratio <= 1.10 (paper, Table 5:
3m19s vs 3m11s per round). The SSE-C is built (or read from the disk cache) before any timing.

    python benchmarks/fedloge_round_cost.py [--reps 6] [--threads 1] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import federation_for, simulation, RunConfig


def clocked(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): on a shared machine the CPU time is the steadier one."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="FedLoGe parameter")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rounds = a.reps + 1
    fed = federation_for(RunConfig())
    params = dict(kv.split("=", 1) for kv in a.set)
    loge = simulation("fedloge", fed, rounds=rounds, params=params)
    avg = simulation("fedavg", fed, rounds=rounds)
    assert loge.schedule == avg.schedule  # the same clients in the same rounds
    rnd = {"r": 0}

    def train(sim, advance=False):
        def go():
            sim.round = rnd["r"] % rounds  # both methods train the same round's clients
            sim.train_round()
            rnd["r"] += advance  # FedAvg runs second in each A/B pair: then move to the next round
        return go

    a_loge, a_avg = train(loge), train(avg, advance=True)
    a_loge(), a_avg()  # warm-up (first-call allocations)
    pairs = [(clocked(a_loge), clocked(a_avg)) for _ in range(a.reps)]  # A B A B ...
    t_loge, t_avg = (statistics.median(p[i][0] for p in pairs) for i in (0, 1))
    c_loge, c_avg = (statistics.median(p[i][1] for p in pairs) for i in (0, 1))
    spec = avg.method.spec
    n = sum(len(fed.clients[c]) for c in avg.schedule[0])
    print(f"fmnist-lt round: {len(avg.schedule[0])} clients (~{n} samples in round 1) x {spec.local_epochs} epochs, "
          f"batch {spec.batch_size}, model {spec.model}, torch threads {torch.get_num_threads()}")
    print(f"FedLoGe round {t_loge:.3f} s wall, {c_loge:.3f} s CPU   FedAvg round {t_avg:.3f} s wall, {c_avg:.3f} s CPU"
          f"   (medians of {a.reps}, interleaved A/B)")
    print(f"FedLoGe / FedAvg round-time ratio: {t_loge / t_avg:.3f} wall, {c_loge / c_avg:.3f} CPU"
          f"   (goal <= 1.10; paper 199 s / 191 s = 1.04)")


if __name__ == "__main__":
    main()
