"""FedSAM: FedAvg whose clients train by sharpness-aware minimisation (Qu et al., "Generalized Federated Learning
via Sharpness Aware Minimization", ICML 2022; Caldarola et al., ECCV 2022), as FedWMSAM's repository runs it as a
baseline (Huang-Yongzhi/NeurlPS_FedWMSAM at a922a1d, ``client/fedsam.py``, ``optimizer/ESAM.py``,
``server/FedSAM.py``).

Client k, from the received w (E local epochs, each batch B):
    g   = grad CE(w; B)                                  (first forward and backward pass)
    e   = rho * g / (||g|| + 1e-7)                       (ascent: core.sam.ascent)
    w  <- w - eta * grad_w CE(w + e; B)                  (second pass at w + e; the run's SGD: momentum, weight decay)
Server, S the round's clients:
    w  <- w + eta_g * (1/|S|) sum_k (w_k - w)            (uniform mean of the updates; buffers: their uniform mean)
Inference: the global model.

Paper vs. released code (a922a1d)
==================  ===============================  ====================================  =======================
                    paper                            released code                         here
==================  ===============================  ====================================  =======================
local step          SAM, two passes                  ESAM (``adaptive`` False): the same   the same (core.sam)
gradient clipping   none                             ``clip_grad_norm_(max_norm=10)``      ``clip_norm`` (None;
                                                     before every step                     10 as the code)
aggregation         uniform mean of the round's      the same (``torch.mean`` of the       the same
                    clients                          updates)
the ascent          w moved to w + e and back        ``p.add_(e)``, ``p.sub_(e)``: w       evaluated at w + e, w
                                                     again only to float rounding          never moved
lr schedule                                          x 0.998 a round (``--lr-decay``)      ``--lr-schedule``
==================  ===============================  ====================================  =======================

Defaults: rho = 0.1, FedWMSAM's ``train.py`` (the value its scripts run every SAM baseline with; the FedSAM papers
tune rho per dataset).

Under ``--dp client``: the server takes the uniform mean of the replies, which is what the noised mean gives (every
client weighs 1 there). ``--dp sample`` is refused: the ascent step moves the weights along the batch's mean
gradient, of unclipped per-sample gradients, so the trained model would carry what DP-SGD's clipping and noise are
there to bound. ``--secagg`` is refused: SecAgg+ hands the server the num_examples-weighted mean of the updates,
and FedSAM's server takes their uniform mean. Clients train one after another (a loop of its own: two passes a
step), never batched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from ..core import Message
from ..core.sam import sam_perturbation, train_sam
from ..core.server_opt import ParamKeys, pseudo_gradient, server_step
from ..core.aggregation import weighted_average
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg

SAM_DP_SAMPLE = ("SAM's ascent step moves the weights along the batch's mean gradient, of unclipped per-sample "
                 "gradients, which DP-SGD's per-sample clipping and noise do not cover")
UNIFORM_SECAGG = ("its server takes the uniform mean of the round's updates (the paper's and the released code's), "
                  "SecAgg+ hands it the num_examples-weighted one")


@METHODS.register("fedsam")
class FedSAM(ParamKeys, FedAvg):
    fp16 = False  # a loop of its own (two passes a step)
    dp_sample = False
    dp_sample_why_not = SAM_DP_SAMPLE
    secagg = False
    secagg_refusal = UNIFORM_SECAGG

    @dataclass
    class Params:
        rho: float = setting(0.1, "rho, SAM's perturbation radius", low=0)
        clip_norm: float | None = setting(None, "clip each local gradient's total norm to this before the step (the "
                                                "released code: 10)", low=0, low_open=True,
                                          none_means="no clip (the paper)")
        server_lr: float = setting(1.0, "eta_g, the server's step on the mean update", low=0, low_open=True)

    def local_steps(self, payload, cstate, data):
        return None

    def local_train(self, payload, cstate, data, gen):
        w, stats = train_sam(self, dict(payload.arrays), data, gen, self.round_lr(payload),
                             sam_perturbation(self.p.rho), self.sam_loss, self.p.clip_norm)
        return Message(w, {"num_examples": len(data), **stats}), cstate

    def sam_loss(self, logits_at, x, y, params):
        return F.cross_entropy(logits_at(x), y)

    def aggregate(self, state, rnd, replies):
        state.weights = self.uniform_step(state.weights, [r.arrays for _, r in replies])
        return state

    def uniform_step(self, weights, models):
        """``w + eta_g * mean_k (w_k - w)`` on the parameters, the uniform mean of the buffers."""
        avg = weighted_average([(m, 1.0) for m in models])
        return server_step(weights, avg, pseudo_gradient(weights, avg, self.param_keys), self.p.server_lr)
