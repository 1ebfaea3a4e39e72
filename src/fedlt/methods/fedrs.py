"""FedRS (Li & Zhan, KDD 2021): "FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID
Data" -- FedAvg whose clients train through a *restricted softmax* that limits the update of the classes they
lack; the baseline FedLF and FedCRAC compare against.

Client k, round t, receiving w (backbone f, classifier rows w_c), with the class set C_k it holds:
    z_c = a_{k,c} * w_c^T f(x)              (no bias term in the local softmax, as both official codes)
    a_{k,c} = 1 for c in C_k,  alpha for c not in C_k            ("binary", the restricted softmax)
    E local epochs of SGD on CE(z, y); reply the whole model.
  A missing class's logit is scaled down by alpha, so its gradient -- the push of w_c away from the client's
  features -- shrinks by the same factor: the client barely moves the classifier rows of classes it never saw.
Server: FedAvg (n_k-weighted).
Inference: the global model as it is (w^T f(x) + b; the scaling is a training device only). No personal model.
Communication: FedAvg's.

Paper vs. official code (lxcnju/FedRepo ``algorithms/fedrs.py`` at 617ee01, as fixed in dc2cb6a; the same
scaling, computed from the counts at every step, in 18sym/FedLF ``algorithm/FedRS.py`` at 99f98b3 and in the
``get_cdist`` of xujli/fedcrac ``methods/fedrs.py`` at e0c4684). FedRepo's first upload, 18eeb6d, differs: it
writes the scaled vector back into ``dist`` at every step, so step s (from 1) of a round scales class c by
1 - (1 - alpha)^s (1 - n_{k,c} / max n): the restriction decays geometrically towards 1 (the plain softmax) within
a round. The fix of 2022-07-24 (dc2cb6a) scales into a new variable and keeps the counts: what fedlt reproduces.
=======================  =========================================  =============================================
                         paper (default)                            official code (option)
=======================  =========================================  =============================================
scale of class c         1 if the client holds c, alpha otherwise   alpha + (1 - alpha) n_{k,c} / max_c' n_{k,c'}:
                         (``scaling=binary``)                       proportional to the local count
                                                                    (``scaling=proportional``); the same as
                                                                    binary when a client's classes are equally
                                                                    frequent (the label-split settings)
alpha                    0.5 (the middle of the released grid       FedRepo's grid {0.9, 0.5, 0.1}; FedLF's code
                         {0.9, 0.5, 0.1})                           0.25
=======================  =========================================  =============================================
The paper's full text could not be read here (only its abstract: "limit the update of missing classes'
weights"); the binary form is the restricted softmax as its abstract and its journal extension (MAP, arXiv
2404.09232) state it. FedRepo also clips the local gradient norm (``max_grad_norm``); fedlt trains without
clipping, like every other method of a comparison. Under ``--dp sample`` (no DP in the paper) the scales come from
the client's class counts noised once (``--dp-counts-noise``, :mod:`fedlt.core.dpsgd`): a class it lacks may then
count as held.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import LocalSteps, Train
from ..decl import setting
from ..errors import ConfigError
from ..registry import METHODS
from .fedavg import FedAvg

SCALINGS = ("binary", "proportional")


def restricted_scale(counts: torch.Tensor, alpha: float, scaling: str = "binary") -> torch.Tensor:
    """Per class, the factor its logit is multiplied by in the client's restricted softmax: 1 for the classes the
    client holds and ``alpha`` for the others (binary), or alpha + (1 - alpha) n_c / max n (proportional)."""
    counts = counts.to(torch.float32)
    if scaling == "binary":
        return torch.where(counts > 0, torch.ones_like(counts), torch.full_like(counts, alpha))
    if scaling == "proportional":
        return alpha + (1 - alpha) * counts / counts.max().clamp_min(1)
    raise ConfigError(f"fedrs.scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")


def restricted_ce(h: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """CE of the restricted softmax: logits ``scale_c * w_c^T h`` (no bias)."""
    return F.cross_entropy(h @ weight.T * scale, y)


@METHODS.register("fedrs")
class FedRS(FedAvg):
    dp_sample = "counts"  # --dp sample: the restricted softmax's scales come from the class counts, given noised once
    @dataclass
    class Params:
        alpha: float = setting(0.5, "scale of the logits of the classes a client lacks (0: masked out, 1: FedAvg "
                                    "without bias)", low=0, high=1)
        scaling: str = setting("binary", "binary (paper) | proportional (official get_cdist: alpha + (1 - alpha) n_c / "
                                         "max n)", choices=SCALINGS)

    def local_steps(self, payload, cstate, data):
        counts = torch.as_tensor(data.counts, dtype=torch.float32, device=self.spec.device)
        scale = restricted_scale(counts, self.p.alpha, self.p.scaling)
        # the bias is outside the restricted softmax: it gets no gradient, so it does not train
        return LocalSteps(payload.arrays, self.step_loss, train=(Train(("backbone.", "head.weight")),),
                          extra={"scale": scale})

    @staticmethod
    def step_loss(model, x, y, extra):
        return restricted_ce(model.backbone(x), model.params["head.weight"], extra["scale"], y)
