"""MoFedSAM: FedSAM with the server's momentum mixed into every local step (Qu et al., "Generalized Federated
Learning via Sharpness Aware Minimization", ICML 2022), as FedWMSAM's repository runs it as a baseline
(Huang-Yongzhi/NeurlPS_FedWMSAM at a922a1d, ``client/mofedsam.py``, ``optimizer/ESAM.py``,
``server/MoFedSAM.py``).

Server, round t, sends (w, Delta) to every client, Delta = 0 in the first round.
Client k, from w (E local epochs, each batch B):
    g   = grad CE(w; B);  e = rho * g / (||g|| + 1e-7)                  (SAM's ascent: core.sam)
    v   = alpha * grad_w CE(w + e; B) + (1 - alpha) * Delta
    w  <- w - eta * v                                                   (the run's SGD: momentum, weight decay)
    (v as the gradient of alpha * CE(w + e) + (1 - alpha) <w, Delta>, the released code's way)
Server, S the round's clients, K the local steps, eta the round's lr:
    Delta <- -(1/|S|) sum_k (w_k - w) / (K eta)                         (FedCM's momentum: core.sam.mean_gradient)
    w     <- w + eta_g * (1/|S|) sum_k (w_k - w)
Inference: the global model.

Paper vs. released code (a922a1d)
==================  ======================  ===========================================  ===========================
                    paper                   released code                                here
==================  ======================  ===========================================  ===========================
local step          as above                the same                                     the same
gradient clipping   none                    ``clip_grad_norm_(max_norm=10)`` before      ``clip_norm`` (None; 10 as
                                            every step                                   the code)
K                   the local steps         ``local_epochs * n_0 / batchsize``: client   the mean of the round's
                                            0's size (every client's in its balanced     clients' steps
                                            splits)
Delta's lr          eta                     the previous round's lr (``lr * lr_decay``,  the round's lr
                                            its lr having decayed since)                 (``--lr-schedule``)
local momentum      none                    none                                         under the run's momentum
                                                                                         rho, K' = (K - rho (1 -
                                                                                         rho^K) / (1 - rho)) / (1 -
                                                                                         rho) for K
                                                                                         (``momentum_corrected``, as
                                                                                         SCAFFOLD); K' = K at rho 0
aggregation         uniform mean            the same                                     the same
==================  ======================  ===========================================  ===========================

Defaults: rho = 0.1, alpha = 0.1: FedWMSAM's ``train.py`` (its scripts run MoFedSAM with them).

Under ``--dp client``: refused, its server divides the mean update by the clients' local step counts, which are
not sent under it. ``--dp sample``: refused, SAM's ascent step (FedSAM's reason). ``--secagg``: refused, the
uniform mean (FedSAM's reason). Clients train one after another (a loop of its own), never batched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message
from ..core.sam import linear_term, mean_gradient, sam_perturbation, split_momentum, train_sam, with_momentum
from ..core.training import effective_steps
from ..decl import setting
from ..registry import METHODS
from .fedsam import FedSAM



@METHODS.register("mofedsam")
class MoFedSAM(FedSAM):
    dp_client_refusal = ("its server divides the mean update by the clients' local step counts, which --dp client "
                         "does not send")

    @dataclass
    class Params(FedSAM.Params):
        alpha: float = setting(0.1, "alpha, the weight of the local (SAM) gradient; 1 - alpha that of the server's "
                                    "momentum", low=0, high=1)
        momentum_corrected: bool = setting(True, "with local momentum rho, read the update as K' steps, not K "
                                                 "(the same at rho 0, the paper's and code's plain SGD)")

    @dataclass
    class State(FedSAM.State):
        momentum: dict[str, torch.Tensor] | None = None  # Delta, on the trainable parameters (None: zero)

    def configure(self, state, rnd, cid):
        mom = state.momentum or {k: torch.zeros_like(state.weights[k]) for k in self.param_keys}
        return Message(with_momentum(state.weights, mom))

    def eval_payload(self, state, cid):
        return Message(dict(state.weights))

    def local_train(self, payload, cstate, data, gen):
        w, mom = split_momentum(payload.arrays)
        a = self.p.alpha

        def loss_at(logits_at, x, y, params):
            ce = F.cross_entropy(logits_at(x), y)
            return a * ce + (1 - a) * linear_term(params, mom), {"loss": ce}  # reported: the CE at w + e

        w, stats = train_sam(self, w, data, gen, self.round_lr(payload), sam_perturbation(self.p.rho), loss_at,
                             self.p.clip_norm)
        return Message(w, {"num_examples": len(data), **stats}), cstate

    def steps_of(self, replies) -> float:
        """K of the server's momentum: the mean local steps of the round's replies (K' under local momentum)."""
        K = sum(r.meta["steps"] for _, r in replies) / len(replies)
        return effective_steps(K, self.spec.momentum) if self.p.momentum_corrected else K

    def aggregate(self, state, rnd, replies):
        w = state.weights
        models = [r.arrays for _, r in replies]
        state.momentum = mean_gradient(w, models, self.param_keys, self.steps_of(replies), self.spec.lr_at(rnd))
        state.weights = self.uniform_step(w, models)
        return state
