"""Kernels per local step (issues 11 and 12), counted on any machine: a device-independent view of the
GPU ratios of ``benchmarks/gpu.py`` and ``benchmarks/client_parallel.py``.

A small CNN on a GPU is launch-bound: each step's time is about the number of kernels it launches times the
host cost of one launch, whatever the arithmetic. This script counts the operators that launch kernels (every
ATen operator except views) during one fmnist-lt round, with the data placed as on a GPU (``device``) and SGD
in its CUDA form (``foreach``), and prints per client step:

- engine FedAvg vs a plain loop over the same clients (benchmarks/gpu.py 1, goal <= 1.10 in time);
- FedLoGe vs FedAvg (benchmarks/gpu.py 2, goal <= 1.15 in time);
- batched clients (all of the round's at once) vs one after another, and the ceiling that the clients' sizes
  put on a batched round's speed-up: a batched round takes as many steps as its largest client, so with the
  launch cost per step unchanged, time(sequential) / time(batched) <= sum(steps) / max(steps);
- batched with ``--cuda-graphs``: what the host launches (each step's data gather, the copies into the graph's
  inputs, one graph launch) and how many kernels one replay holds (static mode run eagerly, counted apart).

    python benchmarks/op_count.py [--clients 20] [--participation 0.5]
"""
from __future__ import annotations

import argparse
import collections
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _common import RunConfig, client_steps, federation_for, plain_round, simulation
from fedlt.engine.graphs import StepGraphs

VIEWS = {"view", "permute", "expand", "_unsafe_view", "transpose", "unsqueeze", "slice", "select", "squeeze",
         "detach", "t", "alias", "as_strided", "_reshape_alias", "split", "unbind", "lift_fresh", "view_as_real"}


class Kernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()
        self.inside = 0  # kernels counted apart: those a CUDA graph would replay (see Graphed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).split(".")[1] if str(func).startswith("aten.") else None
        if name is not None and name not in VIEWS:
            if getattr(self, "graph", False):
                self.inside += 1
            else:
                self.count[name] += 1
        return func(*args, **(kwargs or {}))


def counted(fn, graphs=None) -> int:
    with Kernels() as k:
        if graphs is not None:
            graphs.kernels = k
        fn()
    return sum(k.count.values())


class Graphed(StepGraphs):
    """--cuda-graphs without a GPU: the static-mode steps run eagerly, their kernels counted as what one replay
    launches (the graph) plus the copies of the step's inputs into the graph's own tensors."""

    def __init__(self):
        super().__init__(capture=False)
        self.kernels, self.steps = None, 0

    def run(self, b, key, fn, *inputs):
        k = self.kernels
        if k is None:  # not counting (the warm-up round)
            fn(*inputs)
            return
        k.graph = True
        fn(*inputs)
        k.graph = False
        k.count["graph_launch"] += 1
        k.count["copy_ (graph inputs)"] += len(inputs)
        self.steps += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--participation", type=float, default=0.5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.optim.SGD.__init__ = functools.partialmethod(torch.optim.SGD.__init__, foreach=True)  # CUDA's default
    base = dict(data_placement="device", clients=a.clients, participation=a.participation)
    fed = federation_for(RunConfig(**base))

    def round_of(method, cp, graphs=None):
        sim = simulation(method, fed, client_parallel=cp, **base)
        sim.graphs = graphs

        def go():
            sim.round = 0
            sim.train_round()
        return sim, go

    seq, go_avg = round_of("fedavg", "off")
    cids = seq.schedule[0]
    steps = client_steps(seq)
    n = sum(steps)
    plain = plain_round(seq)
    k_plain, k_avg = counted(lambda: plain(0)), counted(go_avg)
    k_loge = counted(round_of("fedloge", "off")[1])
    k_bavg = counted(round_of("fedavg", str(len(cids)))[1])
    k_bloge = counted(round_of("fedloge", str(len(cids)))[1])
    graph_counts = {}
    for method in ("fedavg", "fedloge"):
        g = Graphed()
        go = round_of(method, str(len(cids)), g)[1]
        go()  # the first round at this shape: the graph's part names, the persistent stacks
        g.steps = 0
        launched = counted(go, g)
        graph_counts[method] = (launched, g.kernels.inside, g.steps)
    print(f"fmnist-lt, {len(cids)} clients in round 1, {n} client steps (largest client {max(steps)}); kernels "
          f"launched (ATen operators other than views), SGD foreach, data on the device")
    print(f"{'':32} {'kernels/round':>14} {'per client step':>16}")
    for label, k in (("plain loop", k_plain), ("engine FedAvg", k_avg), ("engine FedLoGe", k_loge),
                     ("batched FedAvg", k_bavg), ("batched FedLoGe", k_bloge)):
        print(f"{label:32} {k:14d} {k / n:16.1f}")
    for method, (launched, inside, gsteps) in graph_counts.items():
        print(f"{'batched ' + method + ' --cuda-graphs':32} {launched:14d} {launched / n:16.1f}   "
              f"(launches; the {gsteps} replays hold {inside / gsteps:.0f} kernels per step)")
    print(f"engine / plain loop       {k_avg / k_plain:.3f}   (time goal on a GPU <= 1.10)")
    print(f"FedLoGe / FedAvg          {k_loge / k_avg:.3f}   (time goal on a GPU <= 1.15)")
    print(f"sequential / batched      FedAvg {k_avg / k_bavg:.2f}x, FedLoGe {k_loge / k_bloge:.2f}x in kernels; "
          f"step ceiling sum/max = {n / max(steps):.2f}x")
    print(f"sequential / graphs       FedAvg {k_avg / graph_counts['fedavg'][0]:.2f}x, FedLoGe "
          f"{k_loge / graph_counts['fedloge'][0]:.2f}x in launches from the host")


if __name__ == "__main__":
    main()
