"""FedVLS (Guo et al., AAAI 2025): "Exploring Vacant Classes in Label-Skewed Federated Learning" -- vacant-class
distillation and logit suppression in the clients' loss.

Client k, receiving the global model w (also kept frozen as the teacher g), with p = n_k / |D_k| its class prior
and O = {c : n_{k,c} = 0} its vacant classes, E local epochs of SGD on (Algorithm 1, lines 14-18)
    L = L_cal + lambda L_dis + L_logit                      (``lambda``; ``logit_weight`` scales L_logit, 1 here)
    L_cal   = CE(z + log(p + 1e-9), y)                      prior-calibrated (logit-adjusted) cross-entropy
    L_dis   = KL(softmax(z_g[O]) || softmax(z[O])), batch mean: the softmax over the vacant classes only, the
              teacher's (the received model, frozen) against the student's -- keeps what the global model knows
              about the classes this client cannot teach
    L_logit = sum_c p(c) log( (1/B) sum_i 1[y_i != c] exp(z_{i,c}) )            logit suppression (``paper``):
              for each class the client holds, the batch's scores of that class on samples of other classes are
              pushed down (minority samples stop being taken for majority classes); a class whose every sample
              in the batch is its own has no term
Server: FedAvg (n_k-weighted). Inference: the raw logits z. No personalized model.

Paper vs. official code (krumpguo/FedVLS, ``system/flcore/clients/clientvls.py`` and ``servers/servervls.py``
read at 7d8163f; the paper's Algorithm 1 read in its Technical Appendix, the main text not)
========================  ==========================================  ============================================
                          here (default: Algorithm 1)                 official code (option)
========================  ==========================================  ============================================
L_logit's form            log of the batch mean of 1[y != c] e^{z_c}  ``new_LADEloss``: the logits first shifted by
                          (samples of class c left out of the sum,    - log(p + 1e-9) + log(1/C), then multiplied
                          kept in the 1/B)                            by 1[y != c], so each sample of class c adds
                                                                      e^0 = 1 to the sum (``logit_form=official``;
                                                                      the shift matters only because of that)
L_logit's weight          1 (Algorithm 1 line 18)                     0.005, hard-coded (``logit_weight=0.005``;
                                                                      main.py's unused ``--beta`` is 0.005 too)
lambda                    1 (main.py ``--lamda`` default)             README's example: ``-lam 0.1``
teacher's forward         eval mode                                   the received model in train mode: with
                                                                      BatchNorm, batch statistics (not
                                                                      reproduced; the same without BatchNorm, as
                                                                      the table's smallcnn)
local optimiser           the run's (the table's: SGD lr 0.05,        SGD lr 0.01, momentum 0.9, weight decay
                          momentum 0.9, 2 epochs, batch 32)           forced to 0, 10 epochs, batch 64 (README)
========================  ==========================================  ============================================
In both the prior is the client's counts over its training set (computed once: they do not change) and the
vacant-class softmax is the one over the logits of O alone (``F.log_softmax(output[:, O])``); a client with no
vacant class has no L_dis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import LocalSteps
from ..core.steps import strip
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg

FORMS = ("paper", "official")
EPS = 1e-9  # the prior's floor in L_cal (and the official L_logit's shift): both as the official code


def calibrated_ce(logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """L_cal: CE(z + log(p + 1e-9), y)."""
    return F.cross_entropy(logits + torch.log(prior + EPS), y)


def vacant_kl(logits: torch.Tensor, teacher: torch.Tensor, vacant: torch.Tensor) -> torch.Tensor:
    """L_dis: batch-mean KL(softmax(teacher[:, O]) || softmax(logits[:, O])), ``vacant`` a [C] bool mask; 0 when
    the client has no vacant class."""
    if not bool(vacant.any()):
        return logits.sum() * 0.0
    s = F.log_softmax(logits[:, vacant], dim=1)
    t = F.softmax(teacher[:, vacant], dim=1)
    return F.kl_div(s, t, reduction="batchmean")


def logit_suppression(logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor, form: str = "paper") -> torch.Tensor:
    """L_logit = sum_c p(c) (logsumexp_i over the batch of the masked scores of class c, minus log B): ``paper``,
    the samples of class c left out (a class with no other sample in the batch: no term); ``official``, the scores
    shifted by -log(p + 1e-9) + log(1/C) and the samples of class c counted as a score of 0."""
    B, C = logits.shape
    other = y[:, None] != torch.arange(C, device=y.device)[None, :]  # [B, C]: 1[y_i != c]
    if form == "official":
        z = (logits - torch.log(prior + EPS) + math.log(1.0 / C + EPS)) * other
        per_class = torch.logsumexp(z, dim=0) - math.log(B)
        return (per_class * prior).sum()
    z = logits.masked_fill(~other, float("-inf"))
    per_class = torch.logsumexp(z, dim=0) - math.log(B)
    keep = other.any(0) & (prior > 0)
    return (per_class[keep] * prior[keep]).sum()


def fedvls_loss(logits, teacher, y, prior, lam: float = 1.0, logit_weight: float = 1.0, form: str = "paper"):
    """FedVLS's local loss of a batch: (total, {"loss_cal", "loss_dis", "loss_logit"})."""
    vacant = prior == 0
    cal = calibrated_ce(logits, y, prior)
    dis = vacant_kl(logits, teacher, vacant)
    sup = logit_suppression(logits, y, prior, form)
    return cal + lam * dis + logit_weight * sup, {"loss_cal": cal, "loss_dis": dis, "loss_logit": sup}


@METHODS.register("fedvls")
class FedVLS(FedAvg):
    # --dp sample: refused (L_logit couples the batch's samples)
    dp_sample = False
    dp_sample_why_not = ("its logit suppression is the log of a mean over the batch, so one sample's loss reads the "
                         "other samples' logits")
    # --secagg (core.secagg): its server is FedAvg's weighted mean
    secagg = True

    @dataclass
    class Params:
        lam: float = setting(1.0, "lambda, weight of the vacant-class distillation (official --lamda; README -lam 0.1)",
                             low=0)
        logit_weight: float = setting(1.0, "weight of the logit suppression L_logit (Algorithm 1: 1; official "
                                           "hard-coded 0.005)", low=0)
        logit_form: str = setting("paper", "L_logit: paper (Algorithm 1: the samples of class c left out) | official "
                                           "(prior-shifted logits, the samples of class c counted as e^0)",
                                  choices=FORMS)

    def local_steps(self, payload, cstate, data):
        counts = torch.as_tensor(data.counts, dtype=torch.float32, device=self.spec.device)
        teacher = {f"teacher.{k}": v for k, v in payload.arrays.items()}  # the received global model, frozen
        return LocalSteps(payload.arrays, self.vls_step, extra={"prior": counts / counts.sum(), **teacher})

    def vls_step(self, model, x, y, extra):
        with torch.no_grad():
            tz = model.frozen(strip(extra, "teacher."))(x)  # eval mode
        p = self.p
        return fedvls_loss(model(x), tz, y, extra["prior"], p.lam, p.logit_weight, p.logit_form)
