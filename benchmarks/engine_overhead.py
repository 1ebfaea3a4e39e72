"""Engine overhead (docs/protocol.md B): one FedAvg round of the simulation engine vs a plain PyTorch loop that
trains the same model on the same clients' samples with the same batch size and epochs, in one process.
Goal: round time / plain time <= 1.10.

    python benchmarks/engine_overhead.py [--reps 5] [--threads N]
"""
from __future__ import annotations

import argparse

import torch

from _common import interleaved, plain_round, simulation


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    sim = simulation("fedavg", rounds=a.reps + 1)
    fed, spec = sim.fed, sim.method.spec
    plain_r = plain_round(sim)
    rnd = [0]

    def plain():
        plain_r(rnd[0])

    def engine():
        sim.round = rnd[0]
        sim.train_round()
        rnd[0] += 1

    samples = sum(len(fed.clients[c]) for c in sim.schedule[0])
    engine()  # warm-up (allocations, first-call costs)
    rnd[0] = 0
    t_engine, t_plain = interleaved(engine, plain, a.reps)
    print(f"fmnist-lt FedAvg round: {len(sim.schedule[0])} clients, ~{samples} samples x {spec.local_epochs} "
          f"epochs, batch {spec.batch_size}, torch threads {torch.get_num_threads()}")
    print(f"engine round {t_engine:.3f} s   plain loop {t_plain:.3f} s   (medians of {a.reps}, interleaved)")
    print(f"engine overhead ratio: {t_engine / t_plain:.3f}   (goal <= 1.10)")


if __name__ == "__main__":
    main()
