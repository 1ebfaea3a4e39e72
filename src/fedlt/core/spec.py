"""What the layers under the method interface share: the run's description (:class:`RunSpec`) and copying
weights out of and into a model.

The core is layered one way: this module, then the training loop (:mod:`fedlt.core.training`), then the
local-step description (:mod:`fedlt.core.steps`), then the method interface (:mod:`fedlt.core.method`), which
re-exports these names. None of them imports a layer above it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..decl import (DATA, FLOAT32_MAX, INT32, TRAIN, Relation, applies_when, declared_in, requires, setting,
                    show)
from ..errors import ConfigError
from ..pretrained import PretrainedSettings
from .finetune import Finetune


def parse_milestones(value: Any) -> tuple[int, ...]:
    """``"160,240"``, ``[160, 240]`` or ``()`` -> ``(160, 240)``; a one-line ConfigError for anything else."""
    bad = ConfigError(f"lr-milestones expects comma-separated round numbers (e.g. 160,240), got {show(value)}")
    if isinstance(value, str):  # "160,240" or "[160, 240]" (a Flower run config's text of a list)
        text = value.strip()
        text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        if "[" in text or "]" in text:
            raise bad
        items = text.split(",")
    elif isinstance(value, (list, tuple)) or not value:
        items = list(value or ())
    else:
        raise bad
    try:
        out = tuple(int(str(v).strip()) for v in items if str(v).strip() and str(v).strip().isascii())
    except ValueError:
        raise bad from None
    if len(out) != sum(bool(str(v).strip()) for v in items) or isinstance(value, bool):
        raise bad
    if any(m < 1 for m in out) or list(out) != sorted(set(out)):
        raise ConfigError(f"lr-milestones must be increasing round numbers >= 1, got {show(value)}")
    return out


def milestones_text(value: Any) -> str:
    """The canonical text of lr_milestones ("160,240"), from text or a TOML list."""
    return ",".join(map(str, parse_milestones(value)))


def clients_per_round(num_clients: int, participation: float, what: str = "participation") -> int:
    """participation <= 1 is a fraction of the clients, > 1 a count (the engine's sampling, and the settings'
    relations)."""
    if participation <= 0:
        raise ConfigError(f"{what} must be > 0, got {participation:g}")
    n = int(round(participation)) if participation > 1 else max(1, int(round(participation * num_clients)))
    if n > num_clients:
        raise ConfigError(f"{what} {participation:g} asks for {n} clients but there are "
                          f"{num_clients}; use at most {num_clients} or a fraction <= 1")
    return n


LR_SCHEDULES = ("constant", "step", "cosine")


@dataclass
class RunSpec:
    """What both sides of a method know about the run (the same on every process).

    The fields that are settings of the run are declared here, where the lowest layer that reads them is: their
    default, range and help, once. The run configuration (``fedlt.config.RunConfig``) includes each of them
    (``decl.declared_in``), and ``fedlt.runner.rundir.make_spec`` fills them from it (``decl.settings_values``:
    every setting whose declaration says the spec reads it); the others come from the data and the model."""

    model: str
    in_shape: tuple[int, int, int]
    num_classes: int
    seed: int = setting(0, "the one seed of the run", low=0, high=2**63 - 1, group=TRAIN, reads=("spec",))
    # the local lr of round 1; each round's follows the schedule (lr_at), sent in its messages
    lr: float = setting(0.05, "local learning rate", low=0, low_open=True, group=TRAIN, reads=("spec",))
    momentum: float = setting(0.9, "SGD momentum", low=0, high=1, high_open=True, group=TRAIN, reads=("spec",))
    weight_decay: float = setting(0.0, "weight decay", low=0, group=TRAIN, reads=("spec",))
    batch_size: int = setting(32, "local batch size", low=1, high=INT32, group=TRAIN, reads=("spec",))
    local_epochs: int = setting(2, "local epochs", low=0, limit=10**4, group=TRAIN, reads=("spec",))
    rounds: int = setting(50, "communication rounds", low=1, limit=10**6, group=TRAIN, reads=("spec",))
    num_clients: int = setting(20, "number of clients K", low=1, limit=10**6, group=DATA,
                               reads=("spec:num_clients",))
    device: str = setting("cpu", "torch device: cpu, cuda or cuda:N", group=TRAIN, result=False, reads=("spec",))
    precision: str = setting("fp32", "training precision: bf16 or fp16 autocast, fp16 with a gradient scaler "
                                     "(CUDA only)", choices=("fp32", "bf16", "fp16"), group=TRAIN,
                             reads=("spec",))  # core.training.autocast
    channels_last: str = setting("auto", "channels_last memory format for convolutional models (auto: on CUDA "
                                         "under bf16/fp16)", choices=("auto", "on", "off"), group=TRAIN,
                                 reads=("spec",))
    cache_dir: str | None = None  # $FEDLT_CACHE: decoded and pre-computed data kept between runs
    lr_schedule: str = setting("constant", "lr per round: constant, step (x lr-gamma after each milestone), cosine "
                                           "(to 0 over the rounds)", choices=LR_SCHEDULES, group=TRAIN,
                               reads=("spec",))
    lr_milestones: str = setting("", "step schedule: rounds after which the lr decays (FedDr+: 160,240; a TOML "
                                     "list too)", parse=milestones_text, metavar="R1,R2", group=TRAIN,
                                 reads=("spec",))
    lr_gamma: float = setting(0.1, "step schedule: decay factor", low=0, low_open=True, group=TRAIN,
                              reads=("spec",))
    # --allow-large: method parameters past their limits were given on purpose
    allow_large: bool = setting(False, "allow values past the limits (rounds, clients, local epochs, ...) that "
                                       "catch typos, on purpose", group=TRAIN, result=False, reads=("spec",))
    # how much of the model trains, and LoRA's settings (core.finetune, where they are declared)
    finetune: str = declared_in(Finetune, "finetune")
    lora_rank: int = declared_in(Finetune, "lora_rank")
    lora_alpha: float = declared_in(Finetune, "lora_alpha")
    lora_dropout: float = declared_in(Finetune, "lora_dropout")
    lora_targets: str | None = declared_in(Finetune, "lora_targets")
    lora_agg: str = declared_in(Finetune, "lora_agg")
    bn_stats: str = declared_in(Finetune, "bn_stats")
    # pre-trained models: the size they are fed, the classifier (fedlt.pretrained, where they are declared)
    pretrained_size: int | None = declared_in(PretrainedSettings, "pretrained_size")
    head: str = declared_in(PretrainedSettings, "head")
    head_fixed: bool = declared_in(PretrainedSettings, "head_fixed")
    # The data settings (dataset, data_dir, imbalance_ratio, lt_profile, tail_classes, n_max, seed), plain
    # values like the rest: a server that holds data of its own (Ratio Loss's auxiliary balanced set) can
    # rebuild which training samples the clients hold, and draw its own from the others; and input_mean /
    # input_std, the normalisation of the model's input (a pre-trained image tower undoes it). Empty: unknown.
    data: dict[str, Any] = field(default_factory=dict)

    def lr_at(self, rnd: int) -> float:
        """The local learning rate of round ``rnd`` by the run's schedule: what the driver sends to the clients in
        that round's messages (``Message.lr``), and what server-side training of that round uses."""
        return scheduled_lr(self.lr, self.lr_schedule, parse_milestones(self.lr_milestones), self.lr_gamma,
                            self.rounds, rnd)




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


# ------------------------------------------------------------------------------------------------ relations
def check_device(device: str) -> None:
    """cpu, cuda or cuda:N, and the GPU must be there."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda requested but no CUDA device is available; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device} does not exist: {torch.cuda.device_count()} GPU(s) are visible")


def _decays(cfg) -> int:
    """How many times a step schedule decays the lr within the run (its milestones before the last round)."""
    return len([m for m in parse_milestones(cfg.lr_milestones) if m < cfg.rounds])


def _peak_lr(cfg) -> float:
    try:
        return max(cfg.lr * cfg.lr_gamma ** k for k in range(_decays(cfg) + 1))
    except OverflowError:
        return math.inf


def relations(method_of: Callable[[Any], type]) -> list[Relation]:
    """The relations of the settings declared here, in the run configuration (``fedlt.config.RELATIONS`` includes
    them): the precision against the device and the method (``method_of(c)``: the configuration's method class),
    the step schedule's milestones and decay."""
    return [
        requires("precision", lambda c: c.device.startswith("cuda"),
                 "precision fp16 needs a CUDA device (a CPU has no fast fp16 training); use --precision bf16 or fp32 "
                 "on a CPU", when=lambda c: c.precision == "fp16", others=("device",), bad=({"precision": "fp16"},)),
        requires("precision", lambda c: getattr(method_of(c), "fp16", True),
                 "method {method} trains in a loop of its own, without fp16's gradient scaler; use --precision "
                 "bf16", when=lambda c: c.precision == "fp16", others=("method",)),
        applies_when("lr_milestones", lambda c: c.lr_schedule == "step", "lr-milestones apply to --lr-schedule step, "
                     "not {lr_schedule}; drop them or add --lr-schedule step", others=("lr_schedule",),
                     bad=({"lr_milestones": "1"},)),
        requires("lr_schedule", lambda c: bool(c.lr_milestones),
                 "--lr-schedule step needs --lr-milestones (e.g. 160,240)", when=lambda c: c.lr_schedule == "step",
                 others=("lr_milestones",), bad=({"lr_schedule": "step"},)),
        requires("lr_gamma", lambda c: _peak_lr(c) <= FLOAT32_MAX,
                 lambda c: f"lr-gamma {c.lr_gamma:g} takes the lr past a float32 ({c.lr:g} x {c.lr_gamma:g}^"
                           f"{_decays(c)}); a decay factor is below 1 (e.g. 0.1)",
                 when=lambda c: c.lr_schedule == "step", others=("lr", "lr_milestones", "rounds"),
                 bad=({"lr_schedule": "step", "lr_milestones": "1", "rounds": 2, "lr_gamma": 1e39},)),
    ]
