"""What the layers under the method interface share: the run's description (:class:`RunSpec`) and copying
weights out of and into a model.

The core is layered one way: this module, then the training loop (:mod:`fedlt.core.training`), then the
local-step description (:mod:`fedlt.core.steps`), then the method interface (:mod:`fedlt.core.api`), which
re-exports these names. None of them imports a layer above it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class RunSpec:
    """What both sides of a method know about the run (the same on every process)."""

    model: str
    in_shape: tuple[int, int, int]
    num_classes: int
    seed: int = 0
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    batch_size: int = 32
    local_epochs: int = 2
    rounds: int = 50
    num_clients: int = 20
    device: str = "cpu"
    precision: str = "fp32"  # fp32 | bf16 | fp16 (core.training.autocast)
    channels_last: str = "auto"  # auto (on CUDA under bf16/fp16, for models with convolutions) | on | off
    cache_dir: str | None = None
    # The data settings (dataset, data_dir, imbalance_ratio, lt_profile, tail_classes, n_max, seed), plain
    # values like the rest: a server that holds data of its own (Ratio Loss's auxiliary balanced set) can
    # rebuild which training samples the clients hold, and draw its own from the others. Empty: unknown.
    data: dict[str, Any] = field(default_factory=dict)


def weights_of(model: nn.Module, keys=None) -> dict[str, torch.Tensor]:
    """Detached copies of the state-dict entries (all, or those in ``keys``)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if keys is None or k in keys}


def load_weights(model: nn.Module, arrays: dict[str, torch.Tensor]) -> None:
    """Copy the given entries into the model (entries not in the model's state dict are ignored)."""
    sd = model.state_dict()
    with torch.no_grad():
        for k, v in arrays.items():
            if k in sd:
                sd[k].copy_(v)
