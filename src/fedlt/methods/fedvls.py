"""FedVLS (Guo et al., AAAI 2025): "Exploring Vacant Classes in Label-Skewed Federated Learning" -- vacant-class
distillation and logit suppression in the clients' loss.

Client k, receiving the global model w (also kept frozen as the teacher g), with p = n_k / |D_k| its class prior
and O = {c : n_{k,c} = 0} its vacant classes, E local epochs of SGD on (Algorithm 1, lines 14-18)
    L = L_cal + lambda L_dis + w_logit L_logit              (``lam``; ``logit_weight`` w_logit, 0.005)
    L_cal   = CE(z + log(p + 1e-9), y)                      prior-calibrated (logit-adjusted) cross-entropy
    L_dis   = KL(softmax(z_g[O]) || softmax(z[O])), batch mean: the softmax over the vacant classes only, the
              teacher's (the received model, frozen) against the student's -- keeps what the global model knows
              about the classes this client cannot teach
    L_logit = sum_c p(c) (log sum_i exp(s_{i,c}) - log B), s_{i,c} = (z_{i,c} - log(p_c + 1e-9) + log(1/C))
              1[y_i != c]: logit suppression, the batch's scores of each held class on the samples of other
              classes pushed down (minority samples stop being taken for majority classes); a sample of class c
              itself counts as a score of 0 (``logit_form=official``, the released ``new_LADEloss``)
Server: FedAvg (n_k-weighted). Inference: the raw logits z. No personalized model.

Paper vs. official code (krumpguo/FedVLS, ``system/flcore/clients/clientvls.py`` and ``servers/servervls.py``
read at 7d8163f; the paper's Algorithm 1 read in its Technical Appendix, the main text not)
========================  ==========================================  ============================================
                          paper / here                                official code
========================  ==========================================  ============================================
L_logit's form            Algorithm 1: log of the batch mean of       ``new_LADEloss``: the logits first shifted by
                          1[y != c] e^{z_c} (samples of class c left  - log(p + 1e-9) + log(1/C), then multiplied
                          out of the sum, kept in the 1/B):           by 1[y != c], so each sample of class c adds
                          ``logit_form=paper``                        e^0 = 1 to the sum (the shift matters only
                                                                      because of that): the default
L_logit's weight          Algorithm 1: 1 (``logit_weight=1``)         0.005, hard-coded (main.py's unused
                                                                      ``--beta`` is 0.005 too): the default
lambda                    here 1 (main.py ``--lamda`` default)        README's example: ``-lam 0.1``
teacher's forward         here eval mode                              the received model in train mode: with
                                                                      BatchNorm, batch statistics (not
                                                                      reproduced; the same without BatchNorm, as
                                                                      the table's smallcnn)
local optimiser           here the run's (the table's: SGD lr 0.05,   SGD lr 0.01, momentum 0.9, weight decay
                          momentum 0.9, 2 epochs, batch 32)           forced to 0, 10 epochs, batch 64 (README)
========================  ==========================================  ============================================
In both the prior is the client's counts over its training set (computed once: they do not change) and the
vacant-class softmax is the one over the logits of O alone (``F.log_softmax(output[:, O])``); a client with no
vacant class has no L_dis.

Why the default is the code's: Algorithm 1's L_logit is unbounded below -- every score of a class on the other
classes' samples can go to -inf, and the log of their mean with it (as FedLC's paper loss) -- and on the table's
protocol (fmnist-lt, lr 0.05, momentum 0.9) ``--set logit_form=paper --set logit_weight=1`` gave NaN in round 1
(seed 0). The released form is bounded: the samples of class c keep e^0 = 1 each in the sum, so the term is at
least p_c log(n_{c,batch} / B) whenever the batch has a sample of c.
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
    the client has no vacant class. The other classes are masked with a finite -1e9 rather than selected (their
    softmax weight is exactly 0 in float32), so the loss has no data-dependent branch or shape: the batched
    executor runs it under vmap and a step reads nothing back to the host."""
    s = F.log_softmax(logits.masked_fill(~vacant, -1e9), dim=1)
    log_t = F.log_softmax(teacher.masked_fill(~vacant, -1e9), dim=1)
    terms = torch.where(vacant, log_t.exp() * (log_t - s), torch.zeros_like(s))
    return terms.sum() / logits.shape[0]


def logit_suppression(logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor, form: str = "official"
                      ) -> torch.Tensor:
    """L_logit = sum_c p(c) (logsumexp_i over the batch of the masked scores of class c, minus log B): ``paper``,
    the samples of class c left out (a class with no other sample in the batch: no term); ``official``, the scores
    shifted by -log(p + 1e-9) + log(1/C) and the samples of class c counted as a score of 0."""
    B, C = logits.shape
    other = y[:, None] != torch.arange(C, device=y.device)[None, :]  # [B, C]: 1[y_i != c]
    if form == "official":
        z = (logits - torch.log(prior + EPS) + math.log(1.0 / C + EPS)) * other
        per_class = torch.logsumexp(z, dim=0) - math.log(B)
        return (per_class * prior).sum()
    has = other.any(0)  # a class whose every sample in the batch is its own has no term: its column becomes 0s
    z = torch.where(has[None, :], logits.masked_fill(~other, float("-inf")), torch.zeros_like(logits))
    per_class = torch.logsumexp(z, dim=0) - math.log(B)  # (all -inf would make logsumexp's gradient NaN)
    keep = has & (prior > 0)
    return (per_class[keep] * prior[keep]).sum()


def fedvls_loss(logits, teacher, y, prior, lam: float = 1.0, logit_weight: float = 0.005, form: str = "official"):
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
        logit_weight: float = setting(0.005, "weight of the logit suppression L_logit (official hard-coded 0.005; "
                                             "Algorithm 1: 1)", low=0)
        logit_form: str = setting("official", "L_logit: official (prior-shifted logits, the samples of class c "
                                              "counted as e^0; bounded) | paper (Algorithm 1: the samples of class c "
                                              "left out; unbounded below, NaN in round 1 on fmnist-lt)",
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
