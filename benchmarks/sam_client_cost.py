"""Client cost of the SAM methods (issue 58): one local round of FedSAM, MoFedSAM and FedWMSAM against FedAvg's,
as ratios. FedWMSAM claims FedAvg-like cost (one backward pass a step); FedSAM and MoFedSAM take two.

    python benchmarks/sam_client_cost.py [--samples 320] [--reps 3] [--threads 1]

One client of Fashion-MNIST's shape (random inputs: the cost does not depend on the values), the fmnist-lt
protocol's optimiser (the small CNN, batch 32, 2 local epochs, lr 0.05, momentum 0.9); the fastest of ``--reps``
rounds (the methods in turn) after one warm-up round, each from the same received model (the fastest, not the
median: on a shared machine the others' load only ever adds time).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from fedlt.core import RunSpec  # noqa: E402
from fedlt.data.federated import ClientData, Prep  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402

METHOD_NAMES = ("fedavg", "fedsam", "mofedsam", "fedwmsam")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=320)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (a.samples,), generator=g)
    x = torch.randn(a.samples, 1, 28, 28, generator=g)
    data = ClientData(0, x, y, 10, Prep((0.0,), (1.0,)), x[:0], y[:0])
    runs = {}
    for name in METHOD_NAMES:
        spec = RunSpec(model="smallcnn", in_shape=(1, 28, 28), num_classes=10, batch_size=32, local_epochs=2,
                       lr=0.05, momentum=0.9, num_clients=20)
        cls = METHODS.get(name)
        m = cls(spec, cls.make_params({}))
        runs[name] = (m, m.configure(m.init_server(), 1, 0))
        m.local_train(runs[name][1], {}, data, torch.Generator().manual_seed(0))  # warm-up
    reps = {name: [] for name in METHOD_NAMES}
    for _ in range(a.reps):  # the methods in turn, so that a busy spell of a shared machine hits them alike
        for name, (m, payload) in runs.items():
            t = time.perf_counter()
            m.local_train(payload, {}, data, torch.Generator().manual_seed(0))
            reps[name].append(time.perf_counter() - t)
    times = {name: min(r) for name, r in reps.items()}  # the least disturbed round of each
    for name in METHOD_NAMES:
        print(f"{name:10s} {times[name]:.3f} s a local round   x {times[name] / times['fedavg']:.2f} FedAvg's")


if __name__ == "__main__":
    main()
