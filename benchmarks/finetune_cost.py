"""What --finetune costs (issue 56, docs/finetune.md): a ``lora`` step against a ``full`` step on EfficientNet-Lite0
(the same batch, SGD on what trains), and a ``head`` round on the cached features against a round of the same
method on ``mlp`` over those features (the feature pass, once per sample, printed apart). Prints ratios; short on
a CPU at the default size (64 x 64 input)::

    .venv/bin/python benchmarks/finetune_cost.py --threads 1 [--memory]

``--memory`` adds the peak memory of a 100-client ``lora`` round against a 10-client one (Ditto, whose clients
each keep a personal model: 100 sets of adapters over the one shared backbone), each in a fresh process.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from _common import simulation  # noqa: F401  (puts this tree's src on the path)
from fedlt.config import RunConfig
from fedlt.engine import EngineConfig, Simulation
from fedlt.runner.rundir import federation_for, prepare


def step_time(cfg: RunConfig, fed, batch: int, steps: int) -> float:
    """Median seconds of one SGD step (forward, backward, update of what trains) on one batch of the first client."""
    pr = prepare(cfg, fed)
    model = pr.method.new_model().train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    x, y = next(pr.fed.clients[0].batches(batch, torch.Generator().manual_seed(0)))
    times = []
    for i in range(steps + 1):  # the first is a warm-up
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def round_times(sim: Simulation, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        sim.train_round()
        out.append(time.perf_counter() - t)
    return out


def round_memory(clients: int, size: int, threads: int) -> None:
    """(A child process's work.) One ``lora`` round of Ditto -- a personal model kept per client -- with every one of
    ``clients`` clients training, on digits at full size; prints the process's peak resident memory in MB."""
    import resource

    torch.set_num_threads(threads)
    cfg = RunConfig(dataset="digits", imbalance_ratio=1.0, lt_profile="none", model="efficientnet-lite0",
                    pretrained_size=size, finetune="lora", method="ditto", clients=clients, participation=1.0,
                    local_epochs=1, batch_size=8, rounds=1, seed=0, threads=threads)
    pr = prepare(cfg)
    Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False)).train_round()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def memory(size: int, threads: int) -> None:
    """Peak memory of a 100-client round against a 10-client round, each in a fresh process."""
    import subprocess
    import sys

    peak = {}
    for k in (10, 100):
        out = subprocess.run([sys.executable, __file__, "--child-memory", str(k), "--size", str(size), "--threads",
                              str(threads)], capture_output=True, text=True, check=True).stdout
        peak[k] = float(out.strip().splitlines()[-1])
    print(f"peak memory of a lora round (Ditto, every client training, {size}x{size}): 10 clients "
          f"{peak[10]:.0f} MB, 100 clients {peak[100]:.0f} MB, 100 / 10 {peak[100] / peak[10]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", action="store_true", help="also a 100-client round's peak memory against 10's")
    ap.add_argument("--child-memory", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=64, help="EfficientNet-Lite0's input size (--pretrained-size)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the head/mlp comparison (the first encodes)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.child_memory:
        return round_memory(a.child_memory, a.size, a.threads)
    torch.set_num_threads(a.threads)
    base = dict(dataset="digits", model="efficientnet-lite0", pretrained_size=a.size, clients=10, participation=1.0,
                local_epochs=1, batch_size=a.batch, rounds=a.rounds + 1, seed=0, threads=a.threads)
    fed = federation_for(RunConfig(**base))

    full = step_time(RunConfig(**base), fed, a.batch, a.steps)
    lora = step_time(RunConfig(**base, finetune="lora"), fed, a.batch, a.steps)
    print(f"EfficientNet-Lite0 at {a.size}x{a.size}, batch {a.batch}: full step {full * 1e3:.1f} ms, lora step "
          f"{lora * 1e3:.1f} ms, lora / full {lora / full:.2f}")

    pr = prepare(RunConfig(**base, finetune="head"), fed)
    head = Simulation(pr.method, pr.fed, EngineConfig.of(RunConfig(**base, finetune="head"), progress=False))
    t_head = round_times(head, a.rounds)
    stores = pr.fed.stores
    mlp_cfg = RunConfig(**{**base, "model": "mlp", "pretrained_size": None})
    mlp_pr = prepare(mlp_cfg, pr.fed)  # the same features, an MLP on them
    mlp = Simulation(mlp_pr.method, mlp_pr.fed, EngineConfig.of(mlp_cfg, progress=False))
    t_mlp = round_times(mlp, a.rounds)
    later_head, later_mlp = statistics.median(t_head[1:]), statistics.median(t_mlp[1:])
    print(f"feature pass: {sum(s.encoded for s in stores)} samples in {sum(s.calls for s in stores)} backbone calls, "
          f"round 1 {t_head[0]:.2f} s (with it)")
    print(f"a round of 10 clients on the cached features: head {later_head * 1e3:.1f} ms, mlp over the features "
          f"{later_mlp * 1e3:.1f} ms, head / mlp {later_head / later_mlp:.2f}")
    if a.memory:
        memory(a.size, a.threads)


if __name__ == "__main__":
    main()
