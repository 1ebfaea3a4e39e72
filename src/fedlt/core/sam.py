"""Sharpness-aware minimisation's local step (Foret et al., ICLR 2021), shared by FedSAM, MoFedSAM and FedWMSAM.

A SAM step on a batch takes its gradient not at the weights ``w`` but at ``w + e``, a point at distance ``rho``
along a direction ``d``::

    e = rho * d / (||d|| + eps)          (||.||: the norm of all trained tensors as one vector)
    g = grad_w  L(w + e; batch)          (e a constant: the first-order SAM gradient)
    w <- SGD step of w with g            (weight decay and momentum at w, as torch.optim.SGD)

``d`` is the batch's own gradient at ``w`` (SAM, FedSAM, MoFedSAM: one more forward and backward pass a step,
:func:`batch_gradient`) or a direction the method already has (FedWMSAM: the momentum-guided one, no extra pass).
Here ``L(w + e)`` is evaluated by a functional call of the model at ``w + e`` (:func:`shifted`), so the weights
are never moved and put back (the released codes add ``e`` in place and subtract it after the backward pass, which
returns ``w`` only to float rounding). BatchNorm layers run in training mode in both passes and update their
running statistics in each, as the released codes' two forward passes do.

:func:`train_sam` runs a client's local epochs of such steps through the shared loop
(:func:`fedlt.core.training.train_local`: the run's optimiser at the round's lr, precision and batches, an optional
clip of the total gradient norm before each step). :func:`mean_gradient` is the server's momentum estimate that
MoFedSAM and FedWMSAM send their clients (FedCM's).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from .spec import load_weights, weights_of
from .steps import split_loss, stats_of
from .training import train_local

EPS = 1e-7  # the released codes' guard in rho / (||d|| + 1e-7) (FedWMSAM's optimizer/ESAM.py and WMSAM.py)
MOM = "mom/"  # name prefix of the server momentum's arrays in a payload (MoFedSAM, FedWMSAM)


def with_momentum(weights: dict, mom: dict) -> dict:
    """A payload's arrays: the model's ``weights`` and the server momentum ``mom`` under :data:`MOM`."""
    return {**weights, **{MOM + k: v for k, v in mom.items()}}


def split_momentum(arrays: dict) -> tuple[dict, dict]:
    """(weights, momentum) of a payload's arrays that :func:`with_momentum` made."""
    return ({k: v for k, v in arrays.items() if not k.startswith(MOM)},
            {k[len(MOM):]: v for k, v in arrays.items() if k.startswith(MOM)})

Tensors = dict[str, torch.Tensor]


def ascent(direction: Tensors, rho: float, eps: float = EPS) -> Tensors:
    """``e = rho * d / (||d|| + eps)`` for every tensor of ``d`` (``||d||``: of all of them as one vector). A zero
    direction gives ``e = 0``."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in direction.values()]))
    scale = rho / (norm + eps)
    return {k: d * scale for k, d in direction.items()}


def batch_gradient(net: nn.Module, params: Tensors, x: torch.Tensor, y: torch.Tensor) -> Tensors:
    """SAM's first pass: the gradient of the batch's cross-entropy at the current weights, detached (zero for a
    parameter the loss does not reach, which the released ESAM skips: it adds nothing to the norm either way)."""
    loss = F.cross_entropy(net(x), y)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {k: (torch.zeros_like(p) if g is None else g.detach()) for (k, p), g in zip(params.items(), grads)}


def shifted(net: nn.Module, params: Tensors, e: Tensors) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> logits`` of ``net`` at ``w + e`` (``params``: its live parameters ``w`` by name): the gradient of a
    loss of these logits reaches ``w`` as the gradient at ``w + e``."""
    at = {k: p + e[k] if k in e else p for k, p in params.items()}
    return lambda x: functional_call(net, at, (x,))


# loss_at(logits_at, x, y, params) -> the batch's loss to minimise (or (loss, {name: part}), a part "loss" reported
# as the loss, as a described loss's): logits_at(x) the model at w + e, params w
LossAt = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor, Tensors], torch.Tensor]
# perturb(net, params, x, y) -> e by name (detached)
Perturb = Callable[[nn.Module, Tensors, torch.Tensor, torch.Tensor], Tensors]


def sam_perturbation(rho: float) -> Perturb:
    """SAM's own perturbation: ``e = rho * g / (||g|| + eps)`` with ``g`` the batch's gradient at ``w``."""
    return lambda net, params, x, y: ascent(batch_gradient(net, params, x, y), rho)


def train_sam(method, weights: Tensors, data, gen: torch.Generator, lr: float, perturb: Perturb, loss_at: LossAt,
              clip_norm: float | None = None, after_step: Callable[[], None] | None = None) -> tuple[Tensors, dict]:
    """A client's local epochs of SAM steps from ``weights`` on ``method.net``: each batch's ``e`` from
    ``perturb``, its loss ``loss_at`` evaluated at ``w + e``, then the run's SGD at ``lr`` (the round's), the total
    gradient norm clipped to ``clip_norm`` first where given, ``after_step`` after each step. Returns the trained
    weights (every state-dict entry) and ``{"loss": mean loss, part: mean, "steps": n}``."""
    net = method.net
    load_weights(net, weights)
    params = dict(net.named_parameters())

    names: list[str] = []

    def loss_fn(model, x, y):
        e = perturb(model, params, x, y)
        loss, parts = split_loss(loss_at(shifted(model, params, e), x, y, params))
        names[:] = list(parts)
        return (loss, parts) if parts else loss

    raw = train_local(net, data, method.spec, gen, loss_fn, lr=lr, clip_norm=clip_norm, after_step=after_step,
                      parts=True)
    return weights_of(net), stats_of(names, raw["means"], raw["steps"])


def linear_term(params: Tensors, direction: Tensors) -> torch.Tensor:
    """``<w, d>`` over the tensors of ``d``: a loss term whose gradient is ``d`` (the released codes' way of adding a
    fixed direction to every local gradient, as FedCM's ``loss_correct``)."""
    return sum((params[k] * d).sum() for k, d in direction.items())


def mean_gradient(weights: Tensors, replies: list[Tensors], keys, steps: float, lr: float) -> Tensors:
    """The server's momentum estimate (FedCM's ``Delta``): ``-(1/S) sum_i (w_i - w) / (K eta)``, the uniform mean of
    the round's updates over ``keys`` read as the mean local gradient of ``K`` steps at learning rate ``eta``."""
    n = len(replies)
    return {k: -sum(r[k] - weights[k] for r in replies) / n / (steps * lr) for k in keys}
