"""Speed on one GPU (docs/protocol.md C; issue 11): ratios measured in one process, A and B interleaved.

1. engine round vs a plain GPU loop on the same clients' samples (FedAvg, fmnist-lt)   goal <= 1.10
2. FedLoGe round vs FedAvg round (fmnist-lt, same clients and batches)                goal <= 1.15
   2b. the same with each client's steps replayed as CUDA graphs (--client-parallel 1 --cuda-graphs)
3. resnet18 round in bf16 vs fp32 (10 clients, batch 32, fmnist-lt images)            goal >= 1.5x
4. 15 fmnist-lt runs (5 seeds x 3 methods) with `fedlt sweep --jobs 15` vs one after another, the latter
   extrapolated from --sample runs                                                     goal >= 5x
It refuses, in one line, on a machine without CUDA.

    python benchmarks/gpu.py [--reps 5] [--rounds 50] [--sample 2] [--skip-sweep]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import RunConfig, federation_for, interleaved, plain_round, simulation


def sync(fn):
    def go():
        fn()
        torch.cuda.synchronize()
    return go


def engine_vs_plain(reps: int) -> float:
    sim = simulation("fedavg", rounds=reps + 1, device="cuda", client_parallel="off")
    plain_r = plain_round(sim)  # the same clients' samples, ready on the GPU
    rnd = [0]

    def plain():
        plain_r(rnd[0])

    def engine():
        sim.round = rnd[0] % len(sim.schedule)
        sim.train_round()
        rnd[0] += 1

    sync(engine)()
    t_e, t_p = interleaved(sync(engine), sync(plain), reps)
    print(f"1. engine round {t_e:.3f} s   plain GPU loop {t_p:.3f} s   ratio {t_e / t_p:.3f}   (goal <= 1.10)")
    return t_e / t_p


def rounds_ab(a_sim, b_sim, reps: int) -> tuple[float, float]:
    def go(sim):
        def f():
            sim.round = 0
            sim.train_round()
        return sync(f)
    go(a_sim)(), go(b_sim)()
    return interleaved(go(a_sim), go(b_sim), reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=50, help="rounds of each run of the sweep comparison")
    ap.add_argument("--sample", type=int, default=2, help="runs timed one after another, extrapolated to 15")
    ap.add_argument("--skip-sweep", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.stderr.write("benchmarks/gpu.py: no CUDA device here; run it on a machine with an NVIDIA GPU\n")
        raise SystemExit(2)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    engine_vs_plain(a.reps)
    fed = federation_for(RunConfig(device="cuda"))
    t_l, t_a = rounds_ab(simulation("fedloge", fed, device="cuda", client_parallel="off"),
                         simulation("fedavg", fed, device="cuda", client_parallel="off"), a.reps)
    print(f"2. FedLoGe round {t_l:.3f} s   FedAvg round {t_a:.3f} s   ratio {t_l / t_a:.3f}   (goal <= 1.15)")
    g = dict(device="cuda", client_parallel="1", cuda_graphs=True)  # one client at a time, each step one graph
    sims = simulation("fedloge", fed, **g), simulation("fedavg", fed, **g)
    t_lg, t_ag = rounds_ab(*sims, a.reps)
    failed = next((s.graphs.failed for s in sims if s.graphs.failed), None)
    print(f"2b. --client-parallel 1 --cuda-graphs: FedLoGe round {t_lg:.3f} s   FedAvg round {t_ag:.3f} s   ratio "
          f"{t_lg / t_ag:.3f}; FedAvg {t_a / t_ag:.2f}x faster than without graphs"
          + (f"   (capture failed: {failed})" if failed else ""))
    t_b, t_f = rounds_ab(simulation("fedavg", fed, device="cuda", model="resnet18", precision="bf16"),
                         simulation("fedavg", fed, device="cuda", model="resnet18", precision="fp32"), a.reps)
    print(f"3. resnet18 round bf16 {t_b:.3f} s   fp32 {t_f:.3f} s   speed-up {t_f / t_b:.2f}x   (goal >= 1.5x)")
    if a.skip_sweep:
        return
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Path(tmp) / "s.toml"
        sweep.write_text(f'seeds = [0, 1, 2, 3, 4]\nmethods = ["fedavg", "fedloge", "fedprox"]\n'
                         f'[base]\ndevice = "cuda"\nrounds = {a.rounds}\n')
        cmd = [sys.executable, "-m", "fedlt", "sweep", str(sweep), "--no-progress", "--no-report",
               "--checkpoint-every", "0"]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
        one = Path(tmp) / "one.toml"
        one.write_text(f'seeds = {list(range(a.sample))}\nmethods = ["fedavg"]\n[base]\ndevice = "cuda"\n'
                       f'rounds = {a.rounds}\n')
        t0 = time.perf_counter()
        subprocess.run(cmd[:4] + [str(one)] + cmd[5:] + ["--out", str(Path(tmp) / "seq")], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        per_run = (time.perf_counter() - t0) / a.sample
        t0 = time.perf_counter()
        subprocess.run(cmd + ["--jobs", "15", "--out", str(Path(tmp) / "par")], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        t_par = time.perf_counter() - t0
    print(f"4. 15 runs with --jobs 15: {t_par:.1f} s   one after another (extrapolated from {a.sample} FedAvg runs of "
          f"{per_run:.1f} s): {15 * per_run:.1f} s   speed-up {15 * per_run / t_par:.2f}x   (goal >= 5x)")


if __name__ == "__main__":
    main()
