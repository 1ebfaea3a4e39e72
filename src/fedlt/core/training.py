"""The local training loop and optimiser construction shared by the methods."""
from __future__ import annotations

import collections
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .spec import RunSpec


def make_optimizer(params: Iterable, spec: RunSpec, lr: float | None = None, momentum: float | None = None,
                   weight_decay: float | None = None) -> "torch.optim.Optimizer | SGD":
    """SGD with the run's learning rate, momentum and weight decay (re-created every round, like the papers'
    code: no optimiser state survives between rounds unless a method keeps it); ``lr`` the round's (a client's
    ``payload.lr``), else ``spec.lr``. ``params``: parameters (those that require a gradient are taken) or
    parameter-group dicts. On the CPU :class:`SGD` (torch's algorithm there, without the cost of its import);
    elsewhere ``torch.optim.SGD``, under fp16 on CUDA its fused implementation, which skips a step with
    non-finite gradients without waiting for the device."""
    params = list(params)
    if not params or not isinstance(params[0], dict):
        params = [p for p in params if p.requires_grad]
    hyper = dict(lr=spec.lr if lr is None else lr, momentum=spec.momentum if momentum is None else momentum,
                 weight_decay=spec.weight_decay if weight_decay is None else weight_decay)
    tensors = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    if spec.precision != "fp16" and all(p.device.type == "cpu" for p in tensors):
        return SGD(params, **hyper)
    fused = True if spec.precision == "fp16" and torch.device(spec.device).type == "cuda" else None
    return torch.optim.SGD(params, **hyper, fused=fused)


class SGD:
    """``torch.optim.SGD`` on CPU tensors: the loop torch runs there (``torch.optim.sgd._single_tensor_sgd``: no
    foreach or fused kernels on the CPU), the same operations in the same order, so the same bits; its
    ``param_groups``, ``state`` (``momentum_buffer``), ``defaults``, ``zero_grad``, ``step``, ``state_dict`` and
    ``load_state_dict`` as torch has them (opacus's ``DPOptimizer`` wraps it as it wraps torch's). Why: constructing
    ``torch.optim.SGD`` imports ``torch._dynamo`` (its methods are wrapped in ``torch._disable_dynamo``), about 1 s
    per process, and a Flower SuperNode starts a process for each message, whose SGD steps take hundredths of that."""

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.defaults = {"lr": lr, "momentum": momentum, "dampening": 0.0, "weight_decay": weight_decay,
                         "nesterov": False, "maximize": False}
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**self.defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict = collections.defaultdict(dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("fedlt's SGD takes no closure")
        for g in self.param_groups:
            lr, momentum, dampening = float(g["lr"]), g["momentum"], g["dampening"]
            weight_decay, nesterov, maximize = g["weight_decay"], g["nesterov"], g["maximize"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if not maximize else -p.grad
                if weight_decay != 0:
                    grad = grad.add(p, alpha=weight_decay)
                if momentum != 0:
                    buf = self.state[p].get("momentum_buffer")
                    if buf is None:
                        buf = self.state[p]["momentum_buffer"] = grad.detach().clone()
                    else:
                        buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                    grad = grad.add(buf, alpha=momentum) if nesterov else buf
                p.add_(grad, alpha=-lr)

    def state_dict(self) -> dict:
        """As ``torch.optim.Optimizer.state_dict``: parameters by their index over the groups."""
        index: dict[int, int] = {}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index.setdefault(id(p), len(index)) for p in g["params"]]} for g in self.param_groups]
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index},
                "param_groups": groups}

    def load_state_dict(self, d: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict`` (a torch SGD's state dict too): the groups' settings and a copy
        of each parameter's momentum buffer, cast to the parameter's dtype and device."""
        params = [p for g in self.param_groups for p in g["params"]]
        for g, saved in zip(self.param_groups, d["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        by_index = {i: p for i, p in enumerate(params)}
        self.state = collections.defaultdict(dict)
        for i, s in d["state"].items():
            p = by_index[int(i)]
            self.state[p] = {k: (v.to(dtype=p.dtype, device=p.device, copy=True) if torch.is_tensor(v) and
                                 p.is_floating_point() else v) for k, v in s.items()}


def set_momentum(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    """Give SGD's momentum buffers to the parameters ``params`` by name (``buffers``: name -> buffer), as
    ``torch.optim.SGD`` keeps them: its first step then continues them."""
    for name, buf in buffers.items():
        opt.state[params[name]]["momentum_buffer"] = buf.detach().clone()


def momentum_of(opt: torch.optim.Optimizer, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SGD's momentum buffers of ``params`` (name -> parameter) by name, for those that have one."""
    return {n: opt.state[p]["momentum_buffer"].clone() for n, p in params.items()
            if opt.state[p].get("momentum_buffer") is not None}


def effective_steps(K: int, momentum: float) -> float:
    """K' such that K heavy-ball steps (momentum rho, lr eta) of a constant gradient g move by eta * K' * g: the
    step count that normalises a local update made with momentum (SCAFFOLD's option II, FedNova's ||a_i||_1)."""
    if momentum == 0.0:
        return float(K)
    r = momentum
    return (K - r * (1 - r**K) / (1 - r)) / (1 - r)


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(spec: RunSpec):
    """The autocast context of the run's precision (a no-op for fp32): forward passes and losses in bf16/fp16
    where PyTorch deems it safe, parameters and optimiser state stay fp32.

    Without autocast's weight-cast cache: that cache keeps the low-precision copy of each weight until the
    *outermost* autocast region ends, and the engines wrap a client's whole local training (methods with loops
    of their own included), so with it every forward after the first step would use the first step's weights
    (seen: FedAvg in bf16 went from loss 2.3 to 11 in a round). Each use re-casts the current weight instead."""
    dtype = PRECISIONS[spec.precision]
    return torch.autocast(torch.device(spec.device).type, dtype=dtype, enabled=dtype is not None,
                          cache_enabled=False)


def grad_scaler(spec: RunSpec):
    """fp16 only: a gradient scaler, fresh for each local training (so a client's steps do not depend on which
    clients trained before it in this process), starting at 2^10."""
    if spec.precision != "fp16":
        return None
    return torch.amp.GradScaler(torch.device(spec.device).type, init_scale=2.0 ** 10)


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class Meter:
    """Running sum of per-step losses kept on the device (in float64), read into Python once, by ``mean()``:
    reading a loss every step would make the host wait for the device every step."""

    def __init__(self):
        self.total: torch.Tensor | None = None
        self.steps = 0

    def add(self, value: torch.Tensor) -> None:
        if self.total is None:
            self.total = torch.zeros(value.shape, dtype=torch.float64, device=value.device)
        self.total.add_(value.detach())  # one kernel: float64 accumulation of the step's value
        self.steps += 1

    def mean(self):
        """The mean over the steps added: a float (a list of floats for vector values); 0.0 without steps."""
        if self.total is None:
            return 0.0
        m = (self.total / self.steps).tolist()
        return m


def ce_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def train_local(model: nn.Module, data, spec: RunSpec, gen: torch.Generator, loss_fn: LossFn = ce_loss,
                epochs: int | None = None, optimizer: torch.optim.Optimizer | None = None,
                params: Iterable[torch.nn.Parameter] | None = None, after_step: Callable[[], None] | None = None,
                parts: bool = False, lr: float | None = None, epoch_start: Callable[[], None] | None = None,
                clip_norm: float | None = None) -> dict:
    """Run ``epochs`` local epochs of mini-batch SGD on ``loss_fn(model, x, y)``, in the run's precision, at
    ``lr``: the round's, as the client's message carried it (``payload.lr``; None: the run's ``spec.lr``), for
    the optimiser made here (an ``optimizer`` given has its own). Returns the mean loss and the number of steps.
    With ``parts``, ``loss_fn`` may return ``(loss, {name: part})`` and the result is ``{"means": [loss,
    *parts], "steps": n}``; ``epoch_start`` is called before each epoch (state a loss keeps per epoch);
    ``clip_norm`` clips the gradient's total norm (over the parameters the optimiser steps) before each step.
    Nothing is read from the device before the last step."""
    model.train()
    opt = optimizer or make_optimizer(params if params is not None else model.parameters(), spec, lr=lr)
    scaler = grad_scaler(spec)
    meter = Meter()
    for x, y in _batches(data, spec.batch_size, gen, spec.local_epochs if epochs is None else epochs, epoch_start):
        opt.zero_grad(set_to_none=True)
        with autocast(spec):
            out = loss_fn(model, x, y)
        loss, extra = out if isinstance(out, tuple) else (out, {})
        if scaler is None:
            loss.backward()
            _clip(opt, clip_norm)
            opt.step()
        else:
            scaler.scale(loss).backward()
            if clip_norm is not None:
                scaler.unscale_(opt)
                _clip(opt, clip_norm)
            scaler.step(opt)
            scaler.update()
        if after_step is not None:
            after_step()
        meter.add(torch.stack([loss, *extra.values()]) if parts and extra else loss)
    if parts:
        means = meter.mean()
        return {"means": means if isinstance(means, list) else [means], "steps": meter.steps}
    return {"loss": meter.mean(), "steps": meter.steps}


def _clip(opt: torch.optim.Optimizer, clip_norm: float | None) -> None:
    """Clip the total gradient norm of ``opt``'s parameters to ``clip_norm`` (None: leave them)."""
    if clip_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], clip_norm)


def _batches(data, batch_size: int, gen: torch.Generator, epochs: int, epoch_start: Callable[[], None] | None):
    """``data.batches`` over ``epochs`` passes, calling ``epoch_start`` before each (the same batches and draws
    from ``gen`` as one call for all the passes)."""
    if epoch_start is None:
        yield from data.batches(batch_size, gen, epochs=epochs)
        return
    for _ in range(epochs):
        epoch_start()
        yield from data.batches(batch_size, gen, epochs=1)
