"""Memory with many clients (docs/protocol.md B): peak RSS of a FedLoGe run with 200 clients vs 20 clients, same
data (the fmnist-lt long-tailed train set, split by Dirichlet 0.5), the same 10 clients per round, a few rounds,
a per-round evaluation of every client's personal models and both post-training phases. Each size runs in its own
subprocess (peak RSS is per process). Goal: ratio <= 1.3 -- a client costs its state (a head), never a model copy.

    python benchmarks/many_clients_memory.py [--rounds 3] [--method fedloge] [--small 20] [--large 200]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path


def child(method: str, clients: int, rounds: int) -> None:
    import torch

    from _common import simulation

    torch.set_num_threads(1)
    sim = simulation(method, None, clients=clients, participation=10, rounds=rounds, eval_every=rounds,
                     min_client_size=1)  # 200 Dirichlet clients: redraw until none is empty (same for both)
    final = sim.run()
    state_bytes = sum(t.numel() * t.element_size() for cs in sim.client_states.values() for t in cs.values()
                      if hasattr(t, "numel"))
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"clients": clients, "peak_rss_mb": peak_kb / 1024, "client_state_mb": state_bytes / 2**20,
                      "train_samples": int(sim.fed.train_counts.sum()),
                      "GM": next(iter(final["global"].values()))["acc"]}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--method", default="fedloge")
    ap.add_argument("--small", type=int, default=20)
    ap.add_argument("--large", type=int, default=200)
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.method, a.child, a.rounds)
    res = {}
    for k in (a.small, a.large):
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(k), "--rounds",
                              str(a.rounds), "--method", a.method], capture_output=True, text=True, check=True)
        res[k] = json.loads(out.stdout.strip().splitlines()[-1])
        r = res[k]
        print(f"{a.method} with {k:>4} clients: peak RSS {r['peak_rss_mb']:.1f} MB, all client states "
              f"{r['client_state_mb']:.3f} MB, {r['train_samples']} training samples, GM {100 * r['GM']:.2f}")
    ratio = res[a.large]["peak_rss_mb"] / res[a.small]["peak_rss_mb"]
    print(f"peak RSS {a.large} clients / {a.small} clients: {ratio:.3f}   (goal <= 1.3)")


if __name__ == "__main__":
    main()
