"""FedAvg + Balanced Softmax (Ren et al., NeurIPS 2020, "Balanced Meta-Softmax for Long-Tailed Visual
Recognition"), with each client's own class counts: the "FedAvg + BSM" baseline of the Fed-LT literature.

Client: E local epochs of SGD on CE(z + log pi_k, y), where z are the model's logits and pi_k = n_k / |D_k| are
  the client's local label frequencies (adding log n_k instead changes the loss by nothing: a constant shift of
  every logit). The prior lowers the logits of the client's frequent classes during training, so the model
  itself learns to score rare classes higher. The counts never leave the client.
Server: FedAvg (sample-weighted).
Inference: the raw logits z (the prior is NOT added at test time).

Absent classes (a choice the papers leave open; shared/reference/baseline-methods.md A10): a class with no
local sample gets the count ``absent_count``. 0 (default) keeps the formula literal, pi_c = 0: log pi_c is
log(1e-12) (``core.losses.log_prior``), so the class's logit is effectively masked out of the local softmax
(as PFLlib's FedRoD does). 1 is the FedETF code's clamp (the class stays in the softmax, strongly penalised).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core import Message, load_weights, train_local, weights_of
from ..core.losses import balanced_softmax_loss
from ..errors import ConfigError
from ..registry import METHODS
from .fedavg import FedAvg


class LocalLossFedAvg(FedAvg):
    """FedAvg whose clients train on ``local_loss(logits, y, data)`` instead of CE (the base of the methods
    that change only the local loss: Balanced Softmax, Fed-Focal, FedLC)."""

    def local_loss(self, logits: torch.Tensor, y: torch.Tensor, data) -> torch.Tensor:
        raise NotImplementedError

    def local_train(self, payload, cstate, data, gen):
        net = self.net
        load_weights(net, payload.arrays)
        stats = train_local(net, data, self.spec, gen, lambda model, x, y: self.local_loss(model(x), y, data))
        return Message(weights_of(net), {"num_examples": len(data), **stats}), cstate


def prior_counts(counts, absent: float) -> np.ndarray:
    """The client's class counts with ``absent`` in place of 0 (the absent-class policy of a count-based loss)."""
    c = np.asarray(counts, dtype=np.float64)
    if absent < 0:
        raise ConfigError(f"absent_count must be >= 0, got {absent}")
    return np.where(c > 0, c, float(absent))


@METHODS.register("fedavg-bsm")
class FedAvgBSM(LocalLossFedAvg):
    name = "fedavg-bsm"

    @dataclass
    class Params:
        absent_count: float = 0.0  # count used for classes the client lacks (0: masked; 1: FedETF's clamp)

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        prior_counts([1], self.p.absent_count)  # validate

    def local_loss(self, logits, y, data):
        return balanced_softmax_loss(logits, y, prior_counts(data.counts, self.p.absent_count))
