"""FedAvg + Balanced Softmax (Ren et al., NeurIPS 2020, "Balanced Meta-Softmax for Long-Tailed Visual
Recognition"), with each client's own class counts: the "FedAvg + BSM" baseline of the Fed-LT literature.

Client: E local epochs of SGD on CE(z + log pi_k, y), where z are the model's logits and pi_k = n_k / |D_k| are
  the client's local label frequencies (adding log n_k instead changes the loss by nothing: a constant shift of
  every logit). The prior lowers the logits of the client's frequent classes during training, so the model
  itself learns to score rare classes higher. The counts never leave the client.
Server: FedAvg (sample-weighted).
Inference: the raw logits z (the prior is NOT added at test time).

Absent classes (a choice the papers leave open): a class with no
local sample gets the count ``absent_count``. 0 (default) keeps the formula literal, pi_c = 0: log pi_c is
log(1e-12) (``core.losses.log_prior``), so the class's logit is effectively masked out of the local softmax
(as PFLlib's FedRoD does). 1 is the FedETF code's clamp (the class stays in the softmax, strongly penalised).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.losses import balanced_softmax_loss
from ..core.priors import CountLoss, prior_counts
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


@METHODS.register("fedavg-bsm")
class FedAvgBSM(CountLoss, FedAvg):
    @dataclass
    class Params:
        absent_count: float = setting(0.0, "count used for classes the client lacks (0: masked; 1: FedETF's clamp)",
                                      low=0)

    def local_loss(self, logits, y, counts):
        return balanced_softmax_loss(logits, y, prior_counts(counts, self.p.absent_count))
