"""Local training described, not run.

Most methods' local training is "these tensors train, at these learning rates, on this loss of a batch, for E
epochs of the client's batches". A method that says so in :meth:`Method.local_steps` returns a
:class:`LocalSteps`; the engine then runs it -- one client at a time with ordinary autograd and
``torch.optim.SGD`` (:func:`run_steps`, used everywhere, including the Flower clients), or the round's
clients together on a GPU (``fedlt.engine.batched``: parameters stacked along a client axis, one vectorised
forward and backward per step). Both give the method a :class:`Trained` to build its reply from
(:meth:`Method.local_reply`).

A description names:

- ``weights``: the model state to start from (every state-dict entry, buffers included);
- ``loss(model, x, y, extra)``: the loss of one batch, a scalar, or ``(scalar, {name: scalar})`` to report
  parts (a part named ``loss`` is reported as the loss; otherwise the scalar is). ``model`` is a
  :class:`StepModel`: ``model(x)``, ``model.backbone(x)``, ``model.head(h)``, ``model.params`` (the trainable
  model parameters by name) and ``model.frozen(weights)(x)`` (the same architecture in eval mode with other
  weights, e.g. a distillation teacher; ``model.frozen(weights, "backbone")(x)``: its features). ``extra`` holds the client's own tensors (a personal head, class
  counts, an anchor): everything the loss reads that differs between clients must come through ``extra``,
  never through a closure, so that one loss function serves every client of a batch;
- ``train``: which tensors train, by name prefix (model parameters like ``backbone.`` / ``head.`` and keys of
  ``extra``), each group with its SGD settings (None: the run's). A name goes to the first group it matches;
  the empty prefix (the default group) matches every model parameter but no extra tensor (an extra trains only
  under a group that names it); model parameters matched by no group stay frozen, extra tensors matched by
  none are constants;
- ``momentum``: initial SGD momentum buffers by name (none: the optimiser starts fresh, as every method's
  code re-creates it each round); ``epochs`` (None: the run's local epochs).

The loss must be a pure function of its arguments (no global RNG, no Python side effects) and every trained
tensor must take part in it (a tensor without a gradient is skipped by ``torch.optim.SGD`` but would get a
zero gradient -- and a momentum and weight-decay step -- in the batched executor).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from .spec import load_weights, weights_of
from .training import make_optimizer, momentum_of, set_momentum, train_local


@dataclass(frozen=True)
class Train:
    """Tensors that train together: those whose name starts with ``prefix`` ("" matches every model parameter),
    with their SGD learning rate, momentum and weight decay (None: the run's)."""

    prefix: str | tuple[str, ...] = ""
    lr: float | None = None
    momentum: float | None = None
    weight_decay: float | None = None

    def matches(self, name: str, extra: bool = False) -> bool:
        """Whether ``name`` belongs here; an extra tensor only under a prefix that names it (not "")."""
        prefixes = (self.prefix,) if isinstance(self.prefix, str) else self.prefix
        return any(name.startswith(p) and (p or not extra) for p in prefixes)

    def settings(self, spec, lr: float | None = None) -> tuple[float, float, float]:
        """(lr, momentum, weight decay): this group's own, else the run's -- ``lr`` being the round's (the one
        its message carried; None: ``spec.lr``)."""
        run_lr = spec.lr if lr is None else lr
        return (run_lr if self.lr is None else self.lr, spec.momentum if self.momentum is None else self.momentum,
                spec.weight_decay if self.weight_decay is None else self.weight_decay)


@dataclass
class LocalSteps:
    """One client's local training: ``epochs`` passes of mini-batch SGD on ``loss`` (see the module doc)."""

    weights: dict[str, torch.Tensor]
    loss: Callable[..., Any]
    train: tuple[Train, ...] = (Train(),)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)
    epochs: int | None = None


@dataclass
class Trained:
    """What local training produced: the model's state dict, the extra tensors (trained ones updated), the
    final momentum buffers of the trained tensors, and ``stats`` (mean loss and parts over the steps, and
    ``steps``)."""

    weights: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    stats: dict[str, Any]


def split_loss(out) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss function's value as (scalar to minimise, parts to report)."""
    if isinstance(out, tuple):
        return out[0], dict(out[1])
    return out, {}


def stats_of(names: list[str], means, steps: int) -> dict[str, Any]:
    """``{"loss": ..., part: ..., "steps": n}`` from the means of [total, *parts] (0.0 each without steps)."""
    means = means if steps else [0.0] * (len(names) + 1)
    out = {"loss": means[0]}
    out.update(zip(names, means[1:]))
    return {**out, "steps": steps}


def by_setting(groups: dict[str, Train], spec, lr: float | None = None) -> dict[tuple[float, float, float], list[str]]:
    """The trained names grouped by their (lr, momentum, weight decay) at the round's ``lr``: groups with equal
    settings share one update, so one optimiser group -- one foreach kernel per operation instead of one per
    group."""
    out: dict[tuple, list[str]] = {}
    for n, g in groups.items():
        out.setdefault(g.settings(spec, lr), []).append(n)
    return out


def groups_of(steps: LocalSteps, param_names, extra_names) -> dict[str, Train]:
    """The trained names (model parameters, then extras) and the group each belongs to."""
    out: dict[str, Train] = {}
    for names, extra in ((param_names, False), (extra_names, True)):
        for name in names:
            g = next((g for g in steps.train if g.matches(name, extra)), None)
            if g is not None:
                out[name] = g
    return out


class StepModel:
    """What a described loss sees of the model (see the module doc). ``tensors`` None: ``net`` is a live module
    trained by autograd; otherwise ``net`` is a template and ``tensors`` its (per-client) state by name."""

    def __init__(self, net: nn.Module, params: dict[str, torch.Tensor], frozen_net: nn.Module,
                 tensors: dict[str, torch.Tensor] | None = None):
        self._net, self._frozen, self._t = net, frozen_net, tensors
        self.params = params

    def _call(self, module: nn.Module, prefix: str, x: torch.Tensor) -> torch.Tensor:
        if self._t is None:
            return module(x)
        n = len(prefix)
        return functional_call(module, {k[n:]: v for k, v in self._t.items() if k.startswith(prefix)}, (x,))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(self._net, "", x)

    def backbone(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(self._net.backbone, "backbone.", x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self._call(self._net.head, "head.", h)

    def frozen(self, weights: dict[str, torch.Tensor], part: str = "") -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> logits`` of the same architecture in eval mode with ``weights`` (e.g. a teacher's); ``part``
        "backbone": ``x -> features`` of its backbone (``weights`` the whole model's)."""
        if not part:
            return lambda x: functional_call(self._frozen, weights, (x,))
        return lambda x: functional_call(getattr(self._frozen, part), strip(weights, f"{part}."), (x,))


def ce(model: StepModel, x: torch.Tensor, y: torch.Tensor, extra: dict) -> torch.Tensor:
    """Cross-entropy of the model's logits: FedAvg's local loss."""
    return F.cross_entropy(model(x), y)


def frozen_net(method) -> nn.Module:
    """The method's eval-mode copy of the model that :meth:`StepModel.frozen` evaluates other weights with."""
    if getattr(method, "_frozen_net", None) is None:
        method._frozen_net = method.new_model().eval().requires_grad_(False)
    return method._frozen_net


def strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under ``prefix``, with the prefix removed (e.g. a teacher's weights kept in ``extra``)."""
    n = len(prefix)
    return {k[n:]: v for k, v in tensors.items() if k.startswith(prefix)}


class StepRunner(Protocol):
    """How a client's described steps run (:attr:`fedlt.core.method.Method.step_runner`): plain SGD
    (:data:`PLAIN_STEPS`, the default) or, under ``--dp sample``, DP-SGD (:class:`fedlt.core.dpsgd.DPSGD`, which the
    run's privacy mechanism selects for the clients it trains in process, and a Flower SuperNode for its own)."""

    # each sample's gradient is bounded alone (DP-SGD): the round's clients are not batched together (their
    # per-sample gradients are vectorised instead), and a method whose loop of its own would escape the bound runs
    # its described steps
    per_sample: bool
    # the std of the noise on the class counts that :meth:`client_data` gives the loss; None: the counts as they are
    counts_noise: float | None

    def client_data(self, data):
        """``data`` as the client's loss may read it (DP-SGD: its class counts noised once)."""

    def run_steps(self, method, steps: LocalSteps, data, gen: torch.Generator, lr: float | None = None) -> Trained:
        """Run the description ``steps`` for one client at the round's ``lr`` (None: the run's ``spec.lr``)."""


class PlainSteps:
    """The method's working model, ``torch.optim.SGD`` with one parameter group per :class:`Train` group, the shared
    loop :func:`fedlt.core.training.train_local`: the :class:`StepRunner` of every run without ``--dp sample``."""

    per_sample = False
    counts_noise = None

    def client_data(self, data):
        return data

    def run_steps(self, method, steps: LocalSteps, data, gen: torch.Generator, lr: float | None = None) -> Trained:
        run = StepRun(method, steps, lr)
        part_names: list[str] = []

        def loss_fn(model, x, y):
            loss, parts = split_loss(steps.loss(run.view, x, y, run.extra))
            part_names[:] = list(parts)
            return (loss, parts) if parts else loss

        raw = train_local(run.net, data, method.spec, gen, loss_fn, epochs=steps.epochs, optimizer=run.opt,
                          parts=True)
        return run.trained(stats_of(part_names, raw["means"], raw["steps"]))


PLAIN_STEPS = PlainSteps()


def run_steps(method, steps: LocalSteps, data, gen: torch.Generator, lr: float | None = None) -> Trained:
    """Run a description for one client at the round's ``lr`` (the one its message carried; None: the run's
    ``spec.lr``) by the method's :class:`StepRunner` (``method.step_runner``: plain SGD, or DP-SGD under
    ``--dp sample``)."""
    return method.step_runner.run_steps(method, steps, data, gen, lr)


class StepRun:
    """One client's description made live on the method's working model: the weights loaded, the trained names and
    their groups, the extra tensors (trained ones as fresh leaves), ``torch.optim.SGD`` with one parameter group
    per setting and the momentum carried in, and the :class:`StepModel` the loss sees (:class:`PlainSteps`; DP-SGD's
    ``fedlt.core.dpsgd`` trains the same)."""

    def __init__(self, method, steps: LocalSteps, lr: float | None = None):
        spec, net = method.spec, method.net
        load_weights(net, steps.weights)
        self.net = net
        self.params = dict(net.named_parameters())
        self.groups = groups_of(steps, self.params, steps.extra)
        self.extra = {k: (v.detach().clone().requires_grad_(True) if k in self.groups else v)
                      for k, v in steps.extra.items()}
        self.live = {**self.params, **self.extra}
        param_groups = [{"params": [self.live[n] for n in names], "lr": g_lr, "momentum": mom, "weight_decay": wd}
                        for (g_lr, mom, wd), names in by_setting(self.groups, spec, lr).items()]
        self.opt = make_optimizer(param_groups, spec)
        set_momentum(self.opt, self.live, steps.momentum)
        self.view = StepModel(net, {n: p for n, p in self.params.items() if n in self.groups}, frozen_net(method))

    def trained(self, stats: dict[str, Any]) -> Trained:
        """The result once the steps have run: the model, the extras, the trained tensors' momentum, ``stats``."""
        momentum = momentum_of(self.opt, {n: self.live[n] for n in self.groups})
        return Trained(weights_of(self.net), {k: v.detach() for k, v in self.extra.items()}, momentum, stats)
