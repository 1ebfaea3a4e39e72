"""FedExP (Jhunjhunwala, Wang & Joshi, "FedExP: Speeding Up Federated Averaging via Extrapolation", ICLR 2023).

Client: as FedAvg (E local epochs of SGD on cross-entropy from the received model); no client state.
Server, round t, with client updates Delta_k = w_k - w and their average Delta = sum_k p_k Delta_k:
    eta_g = max(1, sum_k p_k ||Delta_k||^2 / (2 (||Delta||^2 + eps)))       (the extrapolated step, >= 1)
    w     = w + eta_g * Delta                   (= w - eta_g * g, with the pseudo-gradient g = -Delta)
With equal weights p_k = 1/M this is the paper's Eq. "eta_g = max{1, sum_i ||Delta_i||^2 / (2M(||Delta||^2 +
eps))}". Norms run over the trainable parameters; buffers (BatchNorm statistics) take the plain average.
Inference: the paper (Sec. 6) notes the last iterate oscillates and evaluates the average of the last two
global models, (w_t + w_{t-1}) / 2; that is the first ("avg2") global mode here, and the last iterate is
reported too ("last"). No personal model.

Paper vs. official code (Divyansh03/FedExP, main.py):
- weights p_k: the official code weights clients by n_k (normalised over the round's clients) in both the
  average and the mean of squared norms; ``weighting="samples"`` (default, and the same average as our
  FedAvg) does so, ``"uniform"`` uses 1/M.
- eps: the paper adds eps to ||Delta||^2; the code adds M * eps (M clients this round) and decays eps by
  0.998^2 per round together with its local learning rate. ``eps_mode="paper"`` (default) or ``"official"``
  (M * eps, no decay: the local learning rate does not decay in this framework). eps = 1e-3 is the
  official value for CIFAR-10/100 and CINIC-10 (0.1 for EMNIST).
- The FedDr+ authors' code base (etri-edgeai/nn-dist-train, used for FedDr+ Table 2) computes
  ``min(1, ...)`` on *unsquared* norms; that is not the paper's rule and is not offered here.
The official code also clips local gradients (norm 10) and uses weight decay 1e-4: training-setup choices of
its experiments, not part of the method; the run's local settings apply here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import Predictor, load_weights, weighted_average
from ..core.server_opt import ParamKeys, server_step, sq_norm
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg

WEIGHTINGS = ("samples", "uniform")
EPS_MODES = ("paper", "official")


def fedexp_step_size(client_deltas: list[dict], mean_delta: dict, weights: list[float], eps: float) -> float:
    """``max(1, sum_k p_k ||Delta_k||^2 / (2 (||Delta||^2 + eps)))`` with ``p_k = weights / sum(weights)``."""
    total = float(sum(weights))
    mean_sq = sum(w / total * sq_norm(d) for d, w in zip(client_deltas, weights))
    return max(1.0, mean_sq / (2.0 * (sq_norm(mean_delta) + eps)))


@METHODS.register("fedexp")
class FedExP(ParamKeys, FedAvg):
    @dataclass
    class Params:
        eps: float = setting(1e-3, "epsilon of the step-size denominator", low=0)
        eps_mode: str = setting("paper", "paper: ||Delta||^2 + eps; official: ||Delta||^2 + M * eps", choices=EPS_MODES)
        weighting: str = setting("samples", "samples (official code) | uniform (the paper's 1/M)", choices=WEIGHTINGS)
        eval_average_last_two: bool = setting(True, "the paper's evaluation model (w_t + w_{t-1}) / 2")

    @dataclass
    class State(FedAvg.State):
        prev_weights: dict[str, torch.Tensor] | None = None  # the previous round's global weights w_{t-1}
        eta_g: list[float] | None = None  # the server step size of every round so far

    def init_server(self) -> "FedExP.State":
        state = super().init_server()
        state.prev_weights, state.eta_g = dict(state.weights), []
        return state

    def aggregate(self, state: "FedExP.State", rnd, replies):
        w = state.weights
        wts = [float(r.meta["num_examples"]) if self.p.weighting == "samples" else 1.0 for _, r in replies]
        avg = weighted_average([(r.arrays, wt) for (_, r), wt in zip(replies, wts)])
        keys = self.param_keys
        deltas = [{k: r.arrays[k] - w[k] for k in keys} for _, r in replies]
        mean_delta = {k: avg[k] - w[k] for k in keys}
        eps = self.p.eps * (len(replies) if self.p.eps_mode == "official" else 1)
        eta = fedexp_step_size(deltas, mean_delta, wts, eps)
        state.prev_weights = w
        state.weights = server_step(w, avg, {k: -d for k, d in mean_delta.items()}, eta)
        state.eta_g.append(eta)
        return state

    def global_model(self, state: "FedExP.State"):
        last = self.eval_model(state.weights)
        modes = {}
        if self.p.eval_average_last_two:
            w, prev = state.weights, state.prev_weights
            avg = {k: (w[k] + prev[k]) / 2 if k in self.param_keys else w[k] for k in w}
            m = self._avg_model(avg)
            modes["avg2"] = Predictor(m.backbone, m.head, shared_backbone=True)
        modes["last"] = Predictor(last.backbone, last.head, shared_backbone=not modes)
        return modes

    def _avg_model(self, weights):
        if getattr(self, "_avg_net", None) is None:
            self._avg_net = self.new_model()
        load_weights(self._avg_net, weights)
        self._avg_net.eval()
        return self._avg_net
