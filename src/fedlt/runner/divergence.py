"""Divergence: a run whose training loss or global weights are no longer finite stops instead of training on
NaN and reporting chance accuracy as a result.

After each round's training and before its evaluation, :class:`DivergenceCheck` looks at the round's mean
training loss (already a Python float: clients report it once each) and at every floating tensor of the
server state, with one host synchronisation per round (per device), never per step. Optionally
(``diverge_factor`` F > 0) a training loss above F times the first round's also counts; F = 100 is a
reasonable choice for cross-entropy-like losses, which start near log(C) and stay below it when learning.

Without that option, a loss above ``WARN_FACTOR`` (1000) times the first round's prints one warning (the
run goes on): on a 2-core CPU, FedAvg on digits at ``--lr 50`` reached a loss of 4.6e10 in round 2 with
finite but dead weights, which no finiteness check sees.

``on_diverge = "stop"`` (default) raises :class:`~fedlt.errors.Diverged` (exit status 3; the caller writes a
summary that says ``diverged`` and keeps the last finite evaluation and the last good checkpoint);
``"continue"`` prints one warning at the first such round and trains on (fedlt 0.1's behaviour).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ..core.state import tree_of
from ..errors import Diverged


def floating_tensors(tree: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every floating-point tensor in a nested dict/list/tuple, with its path ``a/b/key``."""
    if isinstance(tree, torch.Tensor):
        return [(prefix, tree)] if tree.is_floating_point() or tree.is_complex() else []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    out = []
    for k, v in items:
        out += floating_tensors(v, f"{prefix}/{k}" if prefix else str(k))
    return out


def nonfinite_entry(tree: Any) -> str | None:
    """The path of the first tensor holding a NaN or an infinity, or None: one host sync per device."""
    tensors = floating_tensors(tree)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, t in tensors:
        by_device.setdefault(t.device, []).append(torch.isfinite(t).all())
    if all(bool(torch.stack(flags).all()) for flags in by_device.values()):
        return None
    return next(path for path, t in tensors if not bool(torch.isfinite(t).all()))


WARN_FACTOR = 1000.0


class DivergenceCheck:
    """An ``after_train`` hook of the simulation (see the module docstring)."""

    def __init__(self, method: str, lr: float, on_diverge: str = "stop", factor: float = 0.0,
                 echo: Callable[[str], None] = print):
        self.method, self.lr, self.on_diverge, self.factor, self.echo = method, lr, on_diverge, factor, echo
        self.first: dict | None = None  # round and reason of the first divergence seen (continue mode)
        self.warned = False

    def reason(self, sim, rec: dict) -> str | None:
        loss = rec.get("train_loss")
        if loss is not None and not math.isfinite(loss):
            return f"the training loss is {loss}"
        bad = nonfinite_entry(tree_of(sim.state))
        if bad is not None:
            return f"the global state holds non-finite values ({bad})"
        if loss is not None:
            first = next((h["train_loss"] for h in sim.history if h.get("train_loss") is not None), loss)
            if self.factor > 0 and first > 0 and loss > self.factor * first:
                return (f"the training loss {loss:.4g} is more than {self.factor:g} times the first round's "
                        f"{first:.4g} (--diverge-factor {self.factor:g})")
            if self.factor == 0 and not self.warned and first > 0 and loss > WARN_FACTOR * first:
                self.warned = True
                self.echo(f"warning: round {rec['round']} of {self.method}: the training loss {loss:.4g} is "
                          f"{loss / first:.3g} times the first round's {first:.4g}; the run has probably diverged "
                          f"(--diverge-factor 100 stops such a run, a smaller --lr than {self.lr:g} avoids it)")
        return None

    def __call__(self, sim, rec: dict) -> None:
        why = self.reason(sim, rec)
        if why is None:
            return
        if self.on_diverge == "continue":
            if self.first is None:
                self.first = {"round": rec["round"], "reason": why}
                self.echo(f"warning: round {rec['round']} of {self.method}: {why}; training on "
                          f"(--on-diverge continue)")
            return
        e = Diverged(f"run diverged in round {rec['round']} ({self.method}): {why}")
        e.round, e.reason, e.record = rec["round"], why, rec
        raise e

    def advice(self) -> str:
        return (f"try a smaller --lr than {self.lr:g} (e.g. {self.lr / 10:g}), or --on-diverge continue "
                f"to train on regardless")
