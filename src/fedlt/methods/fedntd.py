"""FedNTD (Lee et al., "Preservation of the Global Knowledge by Not-True Distillation in Federated Learning",
NeurIPS 2022). Official code: Lee-Gihun/FedNTD.

Client: E local epochs on
    L = CE(z, y) + beta * tau^2 * KL( softmax(z~_g / tau) || softmax(z~ / tau) )
where z are the local model's logits, z_g the logits of the global model received this round (a frozen
teacher, in eval mode), and ~ removes the true-class entry (C - 1 "not-true" logits per sample). The KL is
averaged over the batch. The true class is left to the cross-entropy alone: the distillation keeps the
global model's knowledge of the *other* classes, which local training on a skewed label distribution would
otherwise forget. No client state.
Server: FedAvg (sample-weighted mean). Inference: the global model; no personal model.

Defaults: tau = 1, beta = 1 (``config/fedntd.json`` of the official code; the NTD_Loss class defaults of
tau = 3 are overridden by that config). Differences between codes: the official teacher is a deepcopy that
keeps the student's train/eval mode (BN would use batch statistics); PFLlib and this file put the teacher in
eval mode (no difference for models without BN or dropout). PFLlib's default beta = 0 switches NTD off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import LocalSteps, strip
from ..decl import setting
from ..errors import ConfigError
from ..registry import METHODS
from .fedavg import FedAvg


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` logits without each row's true-class entry: ``[B, C - 1]`` (other classes in order). A gather,
    not a boolean mask: no data-dependent shape, so no wait for the device and no obstacle to vmap."""
    C = logits.shape[-1]
    others = torch.arange(C - 1, device=logits.device)
    return logits.gather(-1, others + (others >= y[..., None]))


def ntd_term(logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    """``tau^2 * KL(softmax(z~_g / tau) || softmax(z~ / tau))``, batch mean, on the not-true logits."""
    s = F.log_softmax(not_true_logits(logits, y) / tau, dim=1)
    t = F.softmax(not_true_logits(teacher_logits.detach(), y) / tau, dim=1)
    return tau * tau * F.kl_div(s, t, reduction="batchmean")


def ntd_loss(logits, teacher_logits, y, tau: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """FedNTD's local objective: cross-entropy plus beta times the not-true distillation term."""
    return F.cross_entropy(logits, y) + beta * ntd_term(logits, teacher_logits, y, tau)


@METHODS.register("fedntd")
class FedNTD(FedAvg):
    # --dp sample: a sample's loss reads the sample and the received model only (core.dpsgd)
    dp_sample = True

    @dataclass
    class Params:
        tau: float = setting(1.0, "distillation temperature", low=0, low_open=True)
        beta: float = setting(1.0, "weight of the not-true distillation term", low=0)

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        if spec.num_classes < 2:
            raise ConfigError("fedntd needs at least 2 classes (the not-true logits would be empty)")

    def local_steps(self, payload, cstate, data):
        teacher = {f"teacher.{k}": v for k, v in payload.arrays.items()}  # the received global model, frozen
        return LocalSteps(payload.arrays, self.ntd_step, extra=teacher)

    def ntd_step(self, model, x, y, extra):
        with torch.no_grad():
            tz = model.frozen(strip(extra, "teacher."))(x)  # eval mode
        return ntd_loss(model(x), tz, y, self.p.tau, self.p.beta)
