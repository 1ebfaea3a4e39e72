"""Engine overhead (BENCHMARKS.md B): one FedAvg round of the simulation engine vs a plain PyTorch loop that
trains the same model on the same clients' samples with the same batch size and epochs, in one process.
Goal: round time / plain time <= 1.10.

    python benchmarks/engine_overhead.py [--reps 5] [--threads N]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from _common import interleaved, simulation


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    sim = simulation("fedavg", rounds=a.reps + 1)
    fed, spec = sim.fed, sim.method.spec
    model = sim.method.new_model()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    # the plain loop gets its data ready-made: float, normalised, per client, no engine in between
    ready = {c.client_id: (fed.prep(c.x), c.y) for c in fed.clients}
    gen = torch.Generator().manual_seed(0)
    rnd = [0]

    def plain():
        cids = sim.schedule[rnd[0] % len(sim.schedule)]
        for cid in cids:
            model.load_state_dict(init)
            opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
            x, y = ready[cid]
            model.train()
            for _ in range(spec.local_epochs):
                perm = torch.randperm(len(y), generator=gen)
                for s in range(0, len(y), spec.batch_size):
                    i = perm[s:s + spec.batch_size]
                    opt.zero_grad()
                    F.cross_entropy(model(x[i]), y[i]).backward()
                    opt.step()

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
