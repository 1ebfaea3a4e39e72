"""What running a Hugging Face ViT's attention "eager" under DP-SGD saves (fedlt.core.dpsgd.eager_attention): one
``--dp sample --finetune lora`` round of FedAvg on a random ViT saved offline (digits at 32 x 32, patches of 4: 64
tokens), with the switch and with it turned off (torch's vmap then runs scaled_dot_product_attention one sample at
a time). Prints the median round time of each and their ratio, and the largest difference of the two rounds'
aggregates (the same function, to float rounding)::

    .venv/bin/python benchmarks/dp_attention.py --threads 1 [--width 192 --layers 4 --rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import torch

from _common import simulation  # noqa: F401  (puts this tree's src on the path)
from fedlt.config import RunConfig
from fedlt.core import dpsgd
from fedlt.engine import EngineConfig, Simulation
from fedlt.runner.rundir import federation_for, prepare


def vit_dir(width: int, layers: int) -> str:
    from transformers import ViTConfig, ViTModel

    os.environ["HF_HUB_OFFLINE"] = "1"
    d = tempfile.mkdtemp(prefix="fedlt-bench-vit-")
    torch.manual_seed(0)
    ViTModel(ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=width, num_hidden_layers=layers,
                       num_attention_heads=max(1, width // 64), intermediate_size=4 * width)).save_pretrained(d)
    return f"hf:{d}"


def rounds(cfg: RunConfig, fed, n: int, eager: bool) -> tuple[list[float], dict]:
    switch = dpsgd.eager_attention
    if not eager:
        dpsgd.eager_attention = lambda *nets: contextlib.nullcontext([])
    try:
        pr = prepare(cfg, fed)
        sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
        times = []
        for _ in range(n):
            t = time.perf_counter()
            sim.train_round()
            times.append(time.perf_counter() - t)
        return times, {k: v.clone() for k, v in sim.state.weights.items()}
    finally:
        dpsgd.eager_attention = switch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import warnings

    warnings.filterwarnings("ignore", message="There is a performance drop")
    cfg = RunConfig(dataset="digits", imbalance_ratio=10.0, model=vit_dir(a.width, a.layers), pretrained_size=32,
                    finetune="lora", method="fedavg", clients=4, participation=0.5, local_epochs=1, batch_size=32,
                    rounds=a.rounds, dp="sample", dp_clip=1.0, dp_noise=1.0, seed=0, threads=a.threads)
    fed = federation_for(cfg)
    sdpa, w_sdpa = rounds(cfg, fed, a.rounds, eager=False)
    eager, w_eager = rounds(cfg, fed, a.rounds, eager=True)
    gap = max((w_sdpa[k].double() - w_eager[k].double()).abs().max().item() for k in w_sdpa)
    print(f"ViT width {a.width}, {a.layers} layers, 64 tokens; --dp sample --finetune lora, FedAvg, 2 clients a round, "
          f"{a.threads} thread(s)")
    print(f"round, sdpa under vmap (one sample at a time): median {statistics.median(sdpa):.2f} s  {sdpa}")
    print(f"round, eager attention (batched):             median {statistics.median(eager):.2f} s  {eager}")
    print(f"sdpa / eager: {statistics.median(sdpa) / statistics.median(eager):.2f}x; "
          f"largest difference of the aggregates after {a.rounds} rounds: {gap:.2e}")


if __name__ == "__main__":
    main()
