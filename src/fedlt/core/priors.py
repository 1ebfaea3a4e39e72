"""A client's class counts as the prior of its local loss: the count-aware losses of Balanced Softmax (FedAvg +
BSM), FedLC's calibration, FedETF's balanced loss, and the methods that change nothing but FedAvg's local loss.

- :func:`prior_counts`: the counts with a policy for the classes the client lacks;
- :class:`CountLoss`: a mixin for a method whose clients train on ``local_loss(logits, y, counts)``, described as
  local steps (so its clients can be batched); the counts stay on the client. Under ``--dp sample`` the loss reads
  them noised once (``dp_sample = "counts"``, :meth:`fedlt.core.dpsgd.DPSGD.client_data`).
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError
from .steps import LocalSteps


def prior_counts(counts, absent: float):
    """The client's class counts with ``absent`` in place of 0 (the absent-class policy of a count-based loss):
    a tensor for a tensor (same device and dtype), else a float64 array."""
    if absent < 0:
        raise ConfigError(f"absent_count must be >= 0, got {absent}")
    if isinstance(counts, torch.Tensor):
        return torch.where(counts > 0, counts, torch.full_like(counts, float(absent)))
    c = np.asarray(counts, dtype=np.float64)
    return np.where(c > 0, c, float(absent))


class CountLoss:
    """Mixin for a Method (before it in the bases: ``class FedLC(CountLoss, FedAvg)``) whose clients train the
    whole model on ``local_loss(logits, y, counts)`` instead of cross-entropy, ``counts`` being the client's class
    counts (a float tensor on the run's device, in the step's ``extra``: it never leaves the client)."""

    # --dp sample (core.dpsgd): a sample's loss reads its own logits and label and the client's class counts, which
    # DP-SGD gives it noised once (--dp-counts-noise); a subclass whose loss reads no counts declares True
    dp_sample = "counts"

    def local_loss(self, logits: torch.Tensor, y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def local_steps(self, payload, cstate, data):
        counts = torch.as_tensor(data.counts, dtype=torch.float32, device=self.spec.device)
        return LocalSteps(payload.arrays, self.step_loss, extra={"counts": counts})

    def step_loss(self, model, x, y, extra):
        return self.local_loss(model(x), y, extra["counts"])
