"""FedProx (Li et al., MLSys 2020).

Client: E local epochs on CE(w) + mu/2 * ||w - w_global||^2, where w_global is the model received this round.
Server: as FedAvg (sample-weighted mean).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from ..core import LocalSteps, strip
from ..core.proximal import proximity
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


@METHODS.register("fedprox")
class FedProx(FedAvg):
    dp_sample = True  # the proximal term reads the received model only: per sample with its cross-entropy

    @dataclass
    class Params:
        mu: float = setting(0.01, "proximal coefficient (the paper tunes mu in {0.001, 0.01, 0.1, 1})", low=0)

    def local_steps(self, payload, cstate, data):
        anchor = {f"anchor.{n}": payload.arrays[n] for n, _ in self.net.named_parameters()}  # w_global
        return LocalSteps(payload.arrays, self.prox_loss, extra=anchor)

    def prox_loss(self, model, x, y, extra):
        return F.cross_entropy(model(x), y) + 0.5 * self.p.mu * proximity(model.params, strip(extra, "anchor."))
