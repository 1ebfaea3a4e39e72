"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, NeurIPS 2020, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach").

Client: E local epochs of MAML meta-steps on the received theta. Each meta-step takes one mini-batch of 2B
samples (3B for the Hessian-free variant), split into D, D' (and D''):
    theta' = theta - alpha * grad f(theta; D)                                  (inner step)
    first-order (FO):  theta <- theta - beta * grad f(theta'; D')
    Hessian-free (HF): theta <- theta - beta * (I - alpha H(theta; D'')) grad f(theta'; D'),
        H v approximated by [grad f(theta + delta v; D'') - grad f(theta - delta v; D'')] / (2 delta).
The outer step uses the run's optimiser (SGD with its momentum) at lr beta; the inner one is a plain
gradient step. One epoch passes once over the local data, as FedAvg's does (with half as many steps).
Server: FedAvg (weighted by n_k) of theta.
Inference: GM = theta. PM = theta after ``personal_steps`` gradient steps of size alpha on the client's
training data (the gradient of its whole local loss, so it needs no random draw), on the client's test set.

No official code exists. Step sizes: FL-bench uses alpha = its local lr (0.01) and beta = 1e-3, PFLlib
alpha = beta = the local lr, the FedBABU repository alpha = its lr 0.1 and beta = 0.1 with momentum 0.9. The
paper's values could not be checked. Defaults here: beta, the outer optimiser's lr, is the run's lr (``beta``
None), the protocol's rule for every optimiser; alpha is FL-bench's 0.01. The inner step must stay small against
the curvature: the meta-gradient grad f(theta - alpha grad f) grows like (1 - alpha lambda) along a direction
of curvature lambda, and with alpha = the run's lr 0.05 fmnist-lt diverged (NaN loss from round 6), while
alpha = 0.01 learns (GM 58 %, PM 86 % after 6 rounds). The Hessian-free correction (I - alpha H) is the more
sensitive: with alpha = 0.05 it diverged even on the tests' digits problem. FL-bench averages uniformly; we
weight by n_k (FedAvg).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Meter, Message, Predictor, load_weights, make_optimizer, weights_of
from ..core.personal import personal_net
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


def loss_grads(model, params, x, y) -> list[torch.Tensor]:
    """Gradients of the mean CE on (x, y) with respect to ``params``."""
    return list(torch.autograd.grad(F.cross_entropy(model(x), y), params))


@torch.no_grad()
def add_(params, vectors, alpha: float) -> None:
    for p, v in zip(params, vectors):
        p.add_(v, alpha=alpha)


@torch.no_grad()
def restore_(params, values) -> None:
    for p, v in zip(params, values):
        p.copy_(v)


def hessian_vector(model, params, v, x, y, delta: float) -> list[torch.Tensor]:
    """H(theta; x, y) v by central finite differences of gradients, at the current theta (restored exactly)."""
    theta = [p.detach().clone() for p in params]
    add_(params, v, delta)
    g_plus = loss_grads(model, params, x, y)
    add_(params, v, -2 * delta)
    g_minus = loss_grads(model, params, x, y)
    restore_(params, theta)
    return [(a - b) / (2 * delta) for a, b in zip(g_plus, g_minus)]


@METHODS.register("perfedavg")
class PerFedAvg(FedAvg):
    fp16 = False  # a training loop of its own, without fp16's gradient scaler (bf16 and fp32 only)
    personalized = True

    @dataclass
    class Params:
        variant: str = setting("fo", "fo (first-order) | hf (Hessian-free)", choices=("fo", "hf"))
        alpha: float = setting(0.01, "inner / personalization step size (FL-bench's)", low=0, low_open=True)
        beta: float | None = setting(None, "outer (meta) step size", low=0, low_open=True, old_none="== 0",
                                     none_means="the round's lr (which follows --lr-schedule)")
        delta: float = setting(1e-3, "finite-difference step of the Hessian-free variant", low=0, low_open=True)
        personal_steps: int = setting(1, "gradient steps of size alpha that personalize theta", low=0, limit=10**6)

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        p = self.p
        self.alpha = p.alpha
        self.beta = p.beta  # the outer step; None: the round's lr

    def local_train(self, payload, cstate, data, gen):
        net, spec = self.net, self.spec
        load_weights(net, payload.arrays)
        net.train()
        params = [p for p in net.parameters() if p.requires_grad]
        opt = make_optimizer(params, spec, lr=payload.lr if self.beta is None else self.beta)
        parts = 3 if self.p.variant == "hf" else 2
        meter = Meter()
        for x, y in data.batches(parts * spec.batch_size, gen, epochs=spec.local_epochs):
            if len(y) < parts:
                continue  # a last batch too small to split
            meter.add(self.meta_step(net, params, opt, list(zip(x.tensor_split(parts), y.tensor_split(parts)))))
        return Message(weights_of(net), {"num_examples": len(data), "loss": meter.mean(),
                                         "steps": meter.steps}), cstate

    def meta_step(self, net, params, opt, batches) -> torch.Tensor:
        """One MAML step on theta (the params, in place); returns the loss at theta' on D' (a device scalar)."""
        (x0, y0), (x1, y1) = batches[:2]
        theta = [p.detach().clone() for p in params]
        add_(params, loss_grads(net, params, x0, y0), -self.alpha)  # theta'
        loss = F.cross_entropy(net(x1), y1)
        v = list(torch.autograd.grad(loss, params))  # grad f(theta'; D')
        restore_(params, theta)
        if self.p.variant == "hf":
            x2, y2 = batches[2]
            hv = hessian_vector(net, params, v, x2, y2, self.p.delta)
            v = [a - self.alpha * b for a, b in zip(v, hv)]
        opt.zero_grad(set_to_none=True)
        for p, g in zip(params, v):
            p.grad = g
        opt.step()
        return loss.detach()

    def personal_model(self, payload, cstate, data):
        net = personal_net(self)
        load_weights(net, payload.arrays)
        params = [p for p in net.parameters() if p.requires_grad]
        net.train()
        with torch.enable_grad():
            for _ in range(self.p.personal_steps):
                add_(params, full_gradient(net, params, data), -self.alpha)
        net.eval()
        return Predictor(net.backbone, net.head)


def full_gradient(net, params, data, chunk: int = 1024) -> list[torch.Tensor]:
    """Gradient of the mean CE over all of a client's training samples (no augmentation, fixed order)."""
    grads = [torch.zeros_like(p) for p in params]
    n = len(data)
    for x, y in data.batches(chunk, None, shuffle=False, train=False):
        loss = F.cross_entropy(net(x), y, reduction="sum") / n
        for g, d in zip(grads, torch.autograd.grad(loss, params)):
            g.add_(d)
    return grads
