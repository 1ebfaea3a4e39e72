"""PM evaluation cost (docs/protocol.md B): evaluating the K = 20 clients' personalized models (each on its own
test set) together with the global model, vs evaluating the global model alone on the balanced test set.
Goal: <= 2x, not Kx (the backbone's test features are computed once and reused by every personal head).

    python benchmarks/pm_evaluation.py [--method fedloge] [--reps 5]
"""
from __future__ import annotations

import argparse

import torch

from _common import interleaved, simulation
from fedlt.metrics import evaluate
from fedlt.registry import METHODS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="fedloge" if "fedloge" in METHODS else "fedavg")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="train this many rounds first")
    a = ap.parse_args()
    sim = simulation(a.method, rounds=a.rounds)
    for _ in range(a.rounds):
        sim.train_round()
    for c in range(len(sim.fed.clients)):
        sim.client_state(c)
    gm = lambda: evaluate(sim.method, sim.state, sim.client_states, sim.fed, personal=False)  # noqa: E731
    both = lambda: evaluate(sim.method, sim.state, sim.client_states, sim.fed, personal=True)  # noqa: E731
    ev = both()
    t_both, t_gm = interleaved(both, gm, a.reps)
    modes = {side: list(ev[side]) for side in ("global", "personal")}
    print(f"method {a.method}: {len(sim.fed.clients)} clients, {sum(len(c.test_y) for c in sim.fed.clients)} "
          f"personal test samples, 10000 balanced test samples; modes {modes}; threads {torch.get_num_threads()}")
    print(f"GM only {t_gm:.3f} s   GM + PM of {len(sim.fed.clients)} clients {t_both:.3f} s")
    print(f"PM evaluation ratio (GM+PM) / GM: {t_both / t_gm:.3f}   (goal <= 2, not K = {len(sim.fed.clients)})")


if __name__ == "__main__":
    main()
