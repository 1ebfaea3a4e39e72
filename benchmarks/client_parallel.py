"""Batched clients (issue 12): one training round with the round's clients trained one after another
(``--client-parallel off``) vs together (``--client-parallel N``, N = clients per round), same federation,
same clients, same batches, timed alternately in one process.

Cases (fmnist-lt data; the ResNets take its 1x28x28 images as they are):
  smallcnn, 10 of 20 clients per round    FedAvg, FedLoGe      goal on a GPU >= 3x
  smallcnn, 100 of 100 clients per round  FedAvg, FedLoGe      goal on a GPU >= 10x
  resnet8 / resnet18, 10 of 20 clients    FedAvg, batch 32     goal on a GPU >= 2x (resnet18)
``ceiling``: sum(steps) / max(steps) over the round's clients -- a batched round takes as many steps as its
largest client, so at an unchanged cost per step it cannot be faster than that. It also times ``auto`` against
``off`` (on a CPU ``auto`` is sequential: it must never be slower) and, on CUDA, prints the peak GPU memory of
the batched round. On CUDA, ``+graphs`` times the batched round with ``--cuda-graphs`` (each step replayed as one
CUDA graph) against the same sequential round.

    python benchmarks/client_parallel.py [--device cuda] [--reps 3] [--threads 1] [--cases smallcnn,resnet8]
        [--local-epochs 1]
"""
from __future__ import annotations

import argparse

import torch

from _common import RunConfig, client_steps, federation_for, interleaved, simulation

CASES = {
    "smallcnn": [("fedavg", dict(model="smallcnn")), ("fedloge", dict(model="smallcnn")),
                 ("fedavg", dict(model="smallcnn", clients=100, participation=1.0)),
                 ("fedloge", dict(model="smallcnn", clients=100, participation=1.0))],
    "resnet8": [("fedavg", dict(model="resnet8"))],
    "resnet18": [("fedavg", dict(model="resnet18"))],
}


def one_round(sim, rnd: int):
    def go():
        sim.round = rnd  # the same round's clients every time
        sim.train_round()
        if sim.method.spec.device.startswith("cuda"):
            torch.cuda.synchronize()
    return go


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--cases", default="smallcnn,resnet8,resnet18" if torch.cuda.is_available() else "smallcnn,resnet8")
    ap.add_argument("--local-epochs", type=int, default=2)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cuda = a.device.startswith("cuda")
    print(f"device {a.device}" + (f" ({torch.cuda.get_device_name()})" if cuda else
                                  f", torch threads {torch.get_num_threads()}") + f", medians of {a.reps}, interleaved")
    print(f"{'case':<34} {'sequential':>11} {'batched':>10} {'speed-up':>9} {'+graphs':>9} {'speed-up':>9} "
          f"{'ceiling':>8} {'auto/off':>9} {'peak GPU MB':>12}")
    feds = {}
    for case in a.cases.split(","):
        for method, over in CASES[case]:
            base = dict(device=a.device, local_epochs=a.local_epochs, rounds=2, **over)
            key = (over.get("clients", 20),)
            if key not in feds:
                feds[key] = federation_for(RunConfig(**base))
            fed = feds[key]
            seq = simulation(method, fed, client_parallel="off", **base)
            k = len(seq.schedule[0])
            bat = simulation(method, fed, client_parallel=str(k), **base)
            auto = simulation(method, fed, client_parallel="auto", **base)
            gra = simulation(method, fed, client_parallel=str(k), cuda_graphs=True, **base) if cuda else None
            for s in (seq, bat, auto, gra):
                if s is not None:  # warm-up: first-call allocations, kernels, the fixed classifier, the graphs
                    one_round(s, 0)()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t_seq, t_bat = interleaved(one_round(seq, 0), one_round(bat, 0), a.reps)
            peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
            t_off, t_auto = interleaved(one_round(seq, 0), one_round(auto, 0), a.reps)
            graphs = "-"
            if gra is not None:
                t_s2, t_gra = interleaved(one_round(seq, 0), one_round(gra, 0), a.reps)
                graphs = f"{t_gra:8.3f}s {t_s2 / t_gra:8.2f}x" + ("" if gra.graphs.failed is None else " (no capture)")
            label = f"{method} {over['model']} {k} clients/round"
            steps = client_steps(seq)
            print(f"{label:<34} {t_seq:10.3f}s {t_bat:9.3f}s {t_seq / t_bat:8.2f}x {graphs:>19} "
                  f"{sum(steps) / max(steps):7.2f}x {t_auto / t_off:9.2f} {peak:12.0f}")
            if gra is not None and gra.graphs.failed is not None:
                print(f"  graph capture failed: {gra.graphs.failed}")


if __name__ == "__main__":
    main()
