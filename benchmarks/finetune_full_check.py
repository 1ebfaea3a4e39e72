"""Is ``--finetune full``'s collapse on the long tail the model's or the federation's? (docs/pretrained-long-tail.md)

Two checks on EfficientNet-Lite0 at 32 x 32, one torch thread, no network:

1. ``central``: the same backbone and linear head trained centrally on 1,500 *balanced* Fashion-MNIST training
   images (seeded), SGD momentum 0.9, batch 32, two epochs, per ``MODE:LR`` given (``head``: backbone frozen;
   ``full``: every weight), test accuracy on 1,000 test images after each epoch.
2. ``--run DIR``: a finished ``--finetune full`` run's final model evaluated on 2,000 test images with its averaged
   BatchNorm running statistics (eval mode, what fedlt reports) and with each balanced test batch's own statistics:
   if the second were far better, the averaged statistics would be what fails, not the weights.

    python benchmarks/finetune_full_check.py head:0.01 full:0.01 full:0.001
    python benchmarks/finetune_full_check.py --run runs/pretrained-long-tail-5rounds/full/fedavg/seed0
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

from fedlt import pretrained
from fedlt.data.datasets import load_fashion_mnist

MEAN, STD = (0.2860,), (0.3530,)


def images(x: torch.Tensor) -> torch.Tensor:
    return (x.float() / 255.0 - MEAN[0]) / STD[0]


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 250) -> tuple[float, list[int]]:
    with torch.no_grad():
        pred = torch.cat([model(x[i:i + batch]).argmax(1) for i in range(0, len(y), batch)])
    per = [round(100 * (pred[y == c] == c).float().mean().item()) for c in range(10)]
    return 100 * (pred == y).float().mean().item(), per


def central(specs: list[str]) -> None:
    ds = load_fashion_mnist()
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(len(ds.y_train), generator=g)[:1500]
    tidx = torch.randperm(len(ds.y_test), generator=g)[:1000]
    xtr, ytr = images(ds.x_train[idx]), ds.y_train[idx].long()
    xte, yte = images(ds.x_test[tidx]), ds.y_test[tidx].long()
    pre = pretrained.load(pretrained.EFFICIENTNET_LITE0, 32)
    for spec in specs:
        mode, lr = spec.split(":")
        torch.manual_seed(0)
        model = nn.Sequential(pre.backbone((MEAN, STD), trainable=(mode == "full")), nn.Linear(1280, 10))
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=float(lr), momentum=0.9)
        t = time.time()
        for epoch in range(2):
            model.train(mode == "full")
            perm = torch.randperm(len(ytr))
            for i in range(0, len(ytr), 32):
                b = perm[i:i + 32]
                loss = nn.functional.cross_entropy(model(xtr[b]), ytr[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
            model.eval()
            acc, _ = accuracy(model, xte, yte)
            print(f"central {mode} lr {lr} epoch {epoch + 1}: loss {loss.item():.3f}, test accuracy {acc:.1f} % "
                  f"({time.time() - t:.0f} s)", flush=True)


def run_model(run: str) -> None:
    from safetensors.torch import load_file

    ds = load_fashion_mnist()
    tidx = torch.randperm(len(ds.y_test), generator=torch.Generator().manual_seed(0))[:2000]
    xte, yte = images(ds.x_test[tidx]), ds.y_test[tidx].long()
    prefix = "/state/weights/"
    sd = {k[len(prefix):]: v for k, v in load_file(f"{run}/final_state.safetensors").items() if k.startswith(prefix)}
    model = nn.Module()
    model.backbone = pretrained.load(pretrained.EFFICIENTNET_LITE0, 32).backbone((MEAN, STD), trainable=True)
    model.head = nn.Linear(1280, 10)
    model.load_state_dict(sd, strict=True)
    model.eval()
    net = lambda x: model.head(model.backbone(x))  # noqa: E731
    print("averaged running statistics (eval mode): accuracy %.2f %%, per class %s" % accuracy(net, xte, yte))
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()
            m.momentum = 0.0  # each batch's own statistics; the running ones left as they are
    print("each balanced test batch's statistics:  accuracy %.2f %%, per class %s" % accuracy(net, xte, yte))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("specs", nargs="*", default=["head:0.01", "full:0.01", "full:0.001"], help="MODE:LR, MODE head|full")
    p.add_argument("--run", help="a finished --finetune full run directory: check its final model instead")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.run:
        run_model(a.run)
    else:
        central(a.specs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
