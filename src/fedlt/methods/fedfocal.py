"""Fed-Focal (Sarkar, Narang & Rai, FL-IJCAI'20 workshop, arXiv 2011.06283): FedAvg with the focal loss of
Lin et al. (2017) in local training.

Client: E local epochs of SGD on mean_i -(1 - p_{y_i})^gamma log p_{y_i}, gamma = 2 (``core.losses.focal_loss``):
  well-classified examples (p_y near 1) are down-weighted, so the hard ones -- often of rare classes -- weigh
  more. gamma = 0 is plain cross-entropy.
Server: FedAvg (sample-weighted). Inference: the global model.

Paper vs. public code (no official code exists): this is "Fed-Focal (gamma = 2, no alpha, no
sampling)", as the public ports (RedGrape's repo, the Ratio-Loss repo) implement it. The focal loss's class
weights alpha are 1, and the paper's loss-aware client-sampling scheme is not implemented (the engine draws the
client schedule up front, independent of the method, so every method of a comparison trains the same clients).
The RedGrape port adds 1e-6 inside the log; here log p is computed by log_softmax, which needs no epsilon.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.losses import focal_loss
from ..core.priors import CountLoss
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


@METHODS.register("fedfocal")
class FedFocal(CountLoss, FedAvg):
    dp_sample = True  # its loss reads no class counts (alpha 1): under --dp sample it needs no noised counts

    @dataclass
    class Params:
        gamma: float = setting(2.0, "focusing parameter (0: cross-entropy)", low=0)

    def local_loss(self, logits, y, counts):
        return focal_loss(logits, y, self.p.gamma)
