"""FedWMSAM: weighted momentum and sharpness-aware minimisation (Li, Huang et al., "FedWMSAM: Fast and Flat
Federated Learning via Weighted Momentum and Sharpness-Aware Minimization", NeurIPS 2025; released code
Huang-Yongzhi/NeurlPS_FedWMSAM at a922a1d: ``client/fedwmsam.py``, ``optimizer/WMSAM.py``,
``server/FedWMSAM.py``). "Purpose-built for non-IID and long-tailed data": one backward pass a local step, the
momentum-guided direction standing in for SAM's ascent gradient.

The equations are the paper's as its repository's README restates them (C1-C3; the paper's full text could not be
read here, only its abstract); the adaptive rule C3, which the README gives only in words, is the released code's.

Server state: the global w, the momentum Delta (0 at first), SCAFFOLD's control variates c and c_k (0 at first;
c_k of each client that trained, kept on the server, computed from the update the client sent), alpha (alpha_0).
Server, round r, to client k (C2, personalised momentum):
    Delta_k = Delta + alpha / (1 - alpha) * (c - c_k)                   sent with w: one message per client
Client k, from x_0 = w (b = 0, 1, ... over E local epochs of batches B_b; C1, one backward pass):
    delta_b = (w + b * Delta_k) - x_b                                   (where the global model heads, less x_b)
    e_b     = rho * delta_b / (||delta_b|| + 1e-7)                      (0 at b = 0; core.sam.ascent)
    v_b     = alpha * grad CE(x_b + e_b; B_b) + (1 - alpha) * Delta_k
    x_b+1   = x_b - eta * v_b                                           (the run's SGD: momentum, weight decay)
Client k sends x_B (the model only).
Server, S the round's clients, u_k = x_k - w, K the local steps, eta the round's lr, N the clients:
    s_k    = cos(u_k, Delta) + 1   (0 where either is zero)             (C3: agreement with last round's momentum)
    c_k   <- c_k - c - u_k / (K eta);  c <- c + (1/N) sum_k (new c_k - old c_k)     (SCAFFOLD's option II)
    alpha <- 0.99 alpha + 0.01 clip(mean_k s_k, 0.1, 0.9)
    Delta <- -(1/|S|) sum_k u_k / (K eta)                               (core.sam.mean_gradient)
    w     <- w + eta_g (1/|S|) sum_k u_k
Inference: the global model.

Paper vs. released code (a922a1d)
==================  =========================  ==========================================  ========================
                    paper (README's            released code                               here
                    equations)
==================  =========================  ==========================================  ========================
perturbation        e = +rho delta/||delta||   ``WMSAM.first_step`` indexes the flat       ``perturbation``:
                    over every parameter       delta by the *tensor's* index: tensor i     "paper" (default) or
                                               moves by the scalar -rho delta[i] /         "released"
                                               (sum_{j<n} abs(delta[j]) + 1e-7), n the
                                               number of tensors (only delta's first n
                                               entries, all in the first layer, are
                                               read; the sign is the opposite)
gradient clipping   none                       ``clip_grad_norm_(max_norm=10)`` before     ``clip_norm`` (None;
                                               every step                                  10 as the code)
K                   the local steps            ``local_epochs * n_0 / batchsize``: client  each client's own
                                               0's size (every client's in its balanced    steps for its c_k,
                                               splits)                                     their mean for Delta
Delta's lr          eta                        the round's lr x ``lr_decay`` (0.998: one   the round's lr
                                               round's decay too many)                     (``--lr-schedule``)
local momentum      none                       none                                        K' for K under the
                                                                                           run's momentum
                                                                                           (``momentum_corrected``,
                                                                                           as MoFedSAM)
aggregation         uniform mean               the same                                    the same
==================  =========================  ==========================================  ========================

Defaults (the released ``train.py``, which every script of the repository runs FedWMSAM with): rho = 0.1 (the
README's rho study finds 0.01 best: ``--set rho=0.01``), alpha_0 = 0.1; the rule's 0.99 and [0.1, 0.9] are the
code's constants.

Under ``--dp client``: refused, its server reads each client's own update (its cosine with the momentum for alpha,
and the client's control variate). ``--dp sample``: refused, see :data:`DP_SAMPLE`. ``--secagg``: refused, its
server reads each client's own update. Clients train one after another (a loop of its own), never batched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..core import Message
from ..core.sam import EPS, ascent, linear_term, mean_gradient, split_momentum, train_sam, with_momentum
from ..core.training import effective_steps
from ..decl import setting
from ..registry import METHODS
from .mofedsam import MoFedSAM

ALPHA_KEEP, ALPHA_STEP = 0.99, 0.01  # alpha <- 0.99 alpha + 0.01 clip(s, ...): server/FedWMSAM.py's global_update
SCORE_RANGE = (0.1, 0.9)  # the clip of the mean agreement s (the same line)
DP_SAMPLE = ("its perturbation reads how many steps the client has taken (w + b * Delta_k), so its local training is "
             "a loop of its own, and fedlt's DP-SGD runs described steps only (the perturbation itself reads only "
             "the received model, the momentum and the DP-trained weights: per-sample clipping would cover it)")
SERVER_READS = ("its server reads each client's own update: its cosine with the momentum (alpha's schedule) and the "
                "client's control variate c_k")


def agreement(u: dict[str, torch.Tensor], m: dict[str, torch.Tensor]) -> float:
    """C3's score of one client: ``cos(u, m) + 1`` over all tensors as one vector, 0 where either is zero (the
    released ``cosine_similarity``)."""
    a = torch.cat([v.reshape(-1) for v in u.values()]).double()
    b = torch.cat([m[k].reshape(-1) for k in u]).double()
    den = a.norm() * b.norm()
    return 0.0 if float(den) == 0 else float(a @ b / den) + 1.0


def released_perturbation(delta: dict[str, torch.Tensor], rho: float) -> dict[str, torch.Tensor]:
    """The released ``WMSAM.first_step``: tensor i (in parameter order) moves by the scalar ``-rho * d[i] /
    (sum_{j < n} |d[j]| + 1e-7)``, ``d`` the flat delta and ``n`` the number of tensors."""
    flat = torch.cat([d.reshape(-1) for d in delta.values()])
    head = flat[:len(delta)]
    scale = rho / (head.abs().sum() + EPS)
    return {k: torch.full_like(d, 0.0) - head[i] * scale for i, (k, d) in enumerate(delta.items())}


@METHODS.register("fedwmsam")
class FedWMSAM(MoFedSAM):
    dp_client_refusal = SERVER_READS
    dp_sample_why_not = DP_SAMPLE
    secagg_refusal = SERVER_READS

    @dataclass
    class Params(MoFedSAM.Params):
        alpha: float = setting(0.1, "alpha_0, the first round's weight of the local gradient (then adapted each round)",
                               low=0, high=1, high_open=True)
        perturbation: str = setting("paper", '"paper": +rho delta/||delta|| over every parameter; "released": the '
                                             "released WMSAM.first_step's scalar per tensor (see the method's table)",
                                    choices=("paper", "released"))

    @dataclass
    class State(MoFedSAM.State):
        alpha: float | None = None  # the current alpha (None: alpha_0)
        c: dict[str, torch.Tensor] | None = None  # the server control variate (None: zero)
        ci: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # c_k of the clients that trained

    def _alpha(self, state) -> float:
        return self.p.alpha if state.alpha is None else state.alpha

    def _zeros(self, w):
        return {k: torch.zeros_like(w[k]) for k in self.param_keys}

    def configure(self, state, rnd, cid):
        w = state.weights
        a = self._alpha(state)
        mom = state.momentum or self._zeros(w)
        c = state.c or self._zeros(w)
        ck = state.ci.get(cid) or self._zeros(w)
        personal = {k: mom[k] + (c[k] - ck[k]) * a / (1 - a) for k in self.param_keys}
        return Message(with_momentum(w, personal), {"alpha": a})

    def local_train(self, payload, cstate, data, gen):
        w, mom = split_momentum(payload.arrays)
        a, rho = float(payload.meta["alpha"]), self.p.rho
        target = {k: w[k].clone() for k in mom}  # w + b * Delta_k

        def perturb(net, params, x, y):
            delta = {k: target[k] - params[k].detach() for k in mom}
            return ascent(delta, rho) if self.p.perturbation == "paper" else released_perturbation(delta, rho)

        def loss_at(logits_at, x, y, params):
            ce = F.cross_entropy(logits_at(x), y)
            return a * ce + (1 - a) * linear_term(params, mom), {"loss": ce}  # reported: the CE at w + e

        def after_step():
            for k in target:
                target[k] += mom[k]

        w, stats = train_sam(self, w, data, gen, self.round_lr(payload), perturb, loss_at, self.p.clip_norm,
                             after_step)
        return Message(w, {"num_examples": len(data), **stats}), cstate

    def aggregate(self, state, rnd, replies):
        w, keys, lr = state.weights, self.param_keys, self.spec.lr_at(rnd)
        mom = state.momentum or self._zeros(w)
        c = state.c or self._zeros(w)
        rho = self.spec.momentum if self.p.momentum_corrected else 0.0
        dc = self._zeros(w)
        scores = []
        for cid, r in replies:
            u = {k: r.arrays[k] - w[k] for k in keys}
            scores.append(agreement(u, mom))
            ck = state.ci.get(cid) or self._zeros(w)
            K = effective_steps(r.meta["steps"], rho)
            new = {k: ck[k] - c[k] - u[k] / (K * lr) for k in keys}
            for k in keys:
                dc[k] = dc[k] + new[k] - ck[k]
            state.ci[cid] = new
        lo, hi = SCORE_RANGE
        s = sum(scores) / len(scores)
        state.alpha = ALPHA_KEEP * self._alpha(state) + ALPHA_STEP * max(lo, min(s, hi))
        N = self.spec.num_clients
        state.c = {k: c[k] + dc[k] / N for k in keys}
        return super().aggregate(state, rnd, replies)  # Delta and w as MoFedSAM's
