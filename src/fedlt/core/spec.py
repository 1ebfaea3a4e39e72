"""What the layers under the method interface share: the run's description (:class:`RunSpec`) and copying
weights out of and into a model.

The core is layered one way: this module, then the training loop (:mod:`fedlt.core.training`), then the
local-step description (:mod:`fedlt.core.steps`), then the method interface (:mod:`fedlt.core.method`), which
re-exports these names. None of them imports a layer above it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError


@dataclass
class RunSpec:
    """What both sides of a method know about the run (the same on every process)."""

    model: str
    in_shape: tuple[int, int, int]
    num_classes: int
    seed: int = 0
    lr: float = 0.05  # the local lr of round 1; each round's follows the schedule (lr_at), sent in its messages
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
    lr_schedule: str = "constant"  # constant | step | cosine (scheduled_lr)
    lr_milestones: tuple[int, ...] = ()
    lr_gamma: float = 0.1
    allow_large: bool = False  # --allow-large: method parameters past their limits were given on purpose
    # The data settings (dataset, data_dir, imbalance_ratio, lt_profile, tail_classes, n_max, seed), plain
    # values like the rest: a server that holds data of its own (Ratio Loss's auxiliary balanced set) can
    # rebuild which training samples the clients hold, and draw its own from the others; and input_mean /
    # input_std, the normalisation of the model's input (a pre-trained image tower undoes it). Empty: unknown.
    data: dict[str, Any] = field(default_factory=dict)

    def lr_at(self, rnd: int) -> float:
        """The local learning rate of round ``rnd`` by the run's schedule: what the driver sends to the clients in
        that round's messages (``Message.lr``), and what server-side training of that round uses."""
        return scheduled_lr(self.lr, self.lr_schedule, self.lr_milestones, self.lr_gamma, self.rounds, rnd)


LR_SCHEDULES = ("constant", "step", "cosine")


def scheduled_lr(lr: float, schedule: str, milestones, gamma: float, rounds: int, rnd: int) -> float:
    """The local learning rate of round ``rnd`` (1-based), a pure function of the settings and the round, so a
    resumed run needs nothing saved. Post-training phases use the last round's value.

    - ``constant``: ``lr``.
    - ``step``: ``lr * gamma^m``, m = the number of milestones before ``rnd`` (``--lr-milestones 160,240``: rounds
      1-160 at lr, 161-240 at 0.1 lr, then 0.01 lr, as FedDr+ decays at rounds 160 and 240; torch's MultiStepLR
      stepped once after every round).
    - ``cosine``: ``lr * (1 + cos(pi * (rnd - 1) / rounds)) / 2`` (CosineAnnealingLR over the rounds, to 0).
    """
    if schedule == "constant":
        return lr
    if schedule == "step":
        return lr * gamma ** sum(m < rnd for m in milestones)
    if schedule == "cosine":
        return lr * (1 + math.cos(math.pi * (min(rnd, rounds) - 1) / rounds)) / 2
    raise ConfigError(f"unknown lr-schedule {schedule!r}; choose {', '.join(LR_SCHEDULES)}")


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
