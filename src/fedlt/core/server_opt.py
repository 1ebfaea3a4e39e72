"""Server-side steps on the aggregated update, shared by FedAvgM, FedAdam, FedExP and SCAFFOLD, and the
:class:`ServerOpt` mixin of the methods that are FedAvg plus a server optimiser (FedAvgM, FedAdam).

Notation (Reddi et al., ICLR 2021, "Adaptive Federated Optimization"): in round t the server holds ``w`` and
receives client models ``w_k``; their average ``w_avg`` gives the *pseudo-gradient*

    g = w - w_avg            (minus the averaged client update)

and a server optimiser turns it into the new global model ``w <- w - lr * direction(g, opt_state)``. With
``direction(g) = g`` and ``lr = 1`` that is FedAvg. FedAvgM uses heavy-ball momentum on ``g`` (Hsu et al.,
2019), FedAdam Adam without bias correction (Reddi et al.), FedExP an adaptive ``lr >= 1``, SCAFFOLD a fixed
global step ``eta_g``.

Only trainable parameters go through the optimiser. Buffers (BatchNorm running statistics, the integer
``num_batches_tracked``) have no gradient meaning and take the plain sample-weighted average.

The optimiser's state (momentum, Adam moments) lives in the server state under one field (``server_opt``), so
it is saved with checkpoints and never sent to a client.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from ..errors import ConfigError
from .aggregation import weighted_average
from .state import ServerState

Arrays = dict[str, torch.Tensor]


def parameter_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the model's floating-point parameters (buffers excluded), in state-dict order."""
    names = {n for n, p in model.named_parameters() if p.is_floating_point()}
    return [k for k in model.state_dict() if k in names]


class ParamKeys:
    """Mixin for a Method: ``param_keys``, the keys its server step and control variates act on (computed
    once from the method's model)."""

    @property
    def param_keys(self) -> list[str]:
        keys = self.__dict__.get("_param_keys")
        if keys is None:
            keys = self.__dict__["_param_keys"] = parameter_keys(self.net)
        return keys


class ServerOpt(ParamKeys):
    """Mixin for a Method (before it in the bases: ``class FedAvgM(ServerOpt, FedAvg)``): FedAvg's clients plus a
    server optimiser on the pseudo-gradient; the method gives ``direction(g, opt)``.

    ``Params`` must have ``server_lr``. The optimiser state is ``state.server_opt``.
    """

    @dataclass
    class State(ServerState):
        server_opt: dict[str, Any] = field(default_factory=dict)  # the optimiser's buffers (momentum, Adam moments)

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        if not self.p.server_lr > 0:
            raise ConfigError(f"{self.name}: server_lr must be > 0, got {self.p.server_lr}")

    def init_server(self) -> "ServerOpt.State":
        state = super().init_server()
        state.server_opt = {}
        return state

    def direction(self, g: Arrays, opt: dict) -> Arrays:
        raise NotImplementedError

    def aggregate(self, state: "ServerOpt.State", rnd, replies):
        avg = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies])
        g = pseudo_gradient(state.weights, avg, self.param_keys)
        d = self.direction(g, state.server_opt)
        state.weights = server_step(state.weights, avg, d, self.p.server_lr)
        return state


def pseudo_gradient(weights: Arrays, averaged: Arrays, keys: Iterable[str]) -> Arrays:
    """``g = w - w_avg`` on ``keys``."""
    return {k: weights[k] - averaged[k] for k in keys}


def server_step(weights: Arrays, averaged: Arrays, direction: Arrays, lr: float) -> Arrays:
    """The new global weights: ``w - lr * direction`` on the keys of ``direction``, ``averaged`` elsewhere
    (buffers), and ``w`` for any entry no client sent."""
    out = dict(weights)
    out.update(averaged)
    for k, d in direction.items():
        out[k] = weights[k] - lr * d
    return out


def sq_norm(arrays: Arrays) -> float:
    """Squared Euclidean norm of a set of arrays taken as one flat vector (accumulated in float64)."""
    return float(sum(float(a.double().pow(2).sum()) for a in arrays.values()))


# -------------------------------------------------------------------------------------------- optimiser rules
def momentum_direction(g: Arrays, opt: dict, beta: float, nesterov: bool = False) -> Arrays:
    """Heavy-ball server momentum (FedAvgM): ``v <- beta v + g``; direction ``v`` (or ``g + beta v`` with
    Nesterov). ``opt["v"]`` holds the buffer (zero before the first round)."""
    v = opt.setdefault("v", {})
    out = {}
    for k, gk in g.items():
        vk = v[k] = beta * v[k] + gk if k in v else gk.clone()
        out[k] = gk + beta * vk if nesterov else vk
    return out


def adam_direction(g: Arrays, opt: dict, beta1: float, beta2: float, tau: float,
                   bias_correction: bool = False) -> Arrays:
    """FedAdam (Reddi et al., Algorithm 2), written on the pseudo-gradient ``g = -Delta``:
    ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``, direction ``m / (sqrt(v) + tau)``; ``m`` starts at
    0 and ``v`` at ``tau^2`` (the paper's ``v_{-1} >= tau^2``). The paper has no bias correction;
    ``bias_correction=True`` divides by ``1 - b^t`` as in Adam (Kingma & Ba). ``opt`` holds ``m``, ``v``, ``t``."""
    m, v = opt.setdefault("m", {}), opt.setdefault("v", {})
    t = opt["t"] = int(opt.get("t", 0)) + 1
    out = {}
    for k, gk in g.items():
        mk = m[k] = beta1 * m[k] + (1 - beta1) * gk if k in m else (1 - beta1) * gk
        v0 = v[k] if k in v else torch.full_like(gk, tau * tau)
        vk = v[k] = beta2 * v0 + (1 - beta2) * gk * gk
        if bias_correction:
            mk, vk = mk / (1 - beta1 ** t), vk / (1 - beta2 ** t)
        out[k] = mk / (vk.sqrt() + tau)
    return out
