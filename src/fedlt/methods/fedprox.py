"""FedProx (Li et al., MLSys 2020).

Client: E local epochs on CE(w) + mu/2 * ||w - w_global||^2, where w_global is the model received this round.
Server: as FedAvg (sample-weighted mean).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, load_weights, train_local, weights_of
from ..registry import METHODS
from .fedavg import FedAvg


def proximal_term(model: torch.nn.Module, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over parameters of ||w - w_anchor||^2 (buffers excluded)."""
    return sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters() if p.requires_grad)


@METHODS.register("fedprox")
class FedProx(FedAvg):
    name = "fedprox"

    @dataclass
    class Params:
        mu: float = 0.01  # proximal coefficient (the paper tunes mu in {0.001, 0.01, 0.1, 1})

    def local_train(self, payload, cstate, data, gen):
        net = self.net
        load_weights(net, payload.arrays)
        anchor = {n: p.detach().clone() for n, p in net.named_parameters()}
        mu = self.p.mu

        def loss_fn(model, x, y):
            return F.cross_entropy(model(x), y) + 0.5 * mu * proximal_term(model, anchor)

        stats = train_local(net, data, self.spec, gen, loss_fn)
        return Message(weights_of(net), {"num_examples": len(data), **stats}), cstate
