"""Scale in participants (docs/protocol.md B): round time with 10 vs 20 participating clients, same data per
client (IID partition, so every client holds the same number of samples). Goal: about 2x.

    python benchmarks/participant_scaling.py [--reps 3]
"""
from __future__ import annotations

import argparse

import torch

from _common import federation_for, interleaved, simulation, RunConfig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--method", default="fedavg")
    a = ap.parse_args()
    over = dict(partition="iid", clients=20, rounds=a.reps + 1)
    fed = federation_for(RunConfig(**over))
    s10 = simulation(a.method, fed, participation=10, **over)
    s20 = simulation(a.method, fed, participation=20, **over)
    t10, t20 = interleaved(s10.train_round, s20.train_round, a.reps)
    print(f"{a.method}, IID over 20 clients of {len(fed.clients[0])} samples; threads {torch.get_num_threads()}")
    print(f"round with 10 clients {t10:.3f} s   with 20 clients {t20:.3f} s")
    print(f"participant scaling ratio 20/10: {t20 / t10:.3f}   (goal about 2)")


if __name__ == "__main__":
    main()
