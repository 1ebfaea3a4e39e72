"""FedDyn (Acar et al., ICLR 2021): a dynamic linear + proximal regulariser aligns the local and global optima.

"Federated Learning Based on Dynamic Regularization" (Acar, Zhao, Matas, Mattina, Whatmough & Saligrama).

Each client's objective is changed dynamically so that its local optimum agrees with the global one.

State: on client k a vector g_k (one tensor per trainable parameter, zero at first) that tracks grad L_k at its
last local model; it never leaves the client. On the server h (same shapes, zero at first).
Client k in round t, receiving theta^{t-1}: E local epochs of SGD on
    L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2
then g_k <- g_k - alpha (theta_k^t - theta^{t-1}); it sends theta_k^t.
Server, P_t the round's clients, m the number of all clients:
    h       <- h - alpha/m * sum_{k in P_t} (theta_k^t - theta^{t-1})
    theta^t  = (1/|P_t|) sum_{k in P_t} theta_k^t - h/alpha
Buffers (BatchNorm statistics) take the plain average. Inference: the global mode "server" is theta^t
(Algorithm 1's model); "average" is the plain mean of the round's client models, without the -h/alpha term
(the model the official code evaluates). No personal model. Messages: exactly FedAvg's.

Paper vs. official code (alpaemreacar/FedDyn, ``utils_methods.py``):
- alpha: the code divides it per client by n_k / mean(n) over all clients (clients with more data are
  regularised less). Not offered: a client does not know the other clients' sizes; the paper's one alpha.
- Default alpha 0.01 (the code's ``alpha_coef``; the paper tunes alpha in {0.1, 0.01, 0.001}). The code also
  uses weight decay 1e-3 and gradient clipping in local training: training-setup choices, not the method.
- The linear term is applied as the gradient of <-g_k, theta> (the same update; the logged loss is the
  cross-entropy alone).

Under ``--dp sample`` (DP-SGD, ``fedlt.core.dpsgd``) each sample's loss carries the whole regulariser, clipped with
its cross-entropy (as FedProx's proximal term): on average the regulariser's gradient still counts once a step,
but clipping shortens it with the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, Predictor, load_weights, weighted_average
from ..core.steps import LocalSteps
from ..core.server_opt import ParamKeys
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


@METHODS.register("feddyn")
class FedDyn(ParamKeys, FedAvg):
    # --dp sample: a sample's loss reads it, the received model and the client's own g_k (core.dpsgd); g_k's update
    # after training is post-processing of the DP-SGD-trained model
    dp_sample = True
    @dataclass
    class Params:
        alpha: float = setting(0.01, "strength of the dynamic regulariser", low=0, low_open=True)

    @dataclass
    class State(FedAvg.State):
        h: dict[str, torch.Tensor] | None = None  # the server's h (one tensor per trainable parameter)
        average: dict[str, torch.Tensor] | None = None  # the plain mean of the last round's client models

    def _zeros(self, weights) -> dict[str, torch.Tensor]:
        return {k: torch.zeros_like(weights[k]) for k in self.param_keys}

    # ------------------------------------------------------------------ server
    def init_server(self) -> "FedDyn.State":
        state = super().init_server()
        state.h, state.average = self._zeros(state.weights), dict(state.weights)
        return state

    def aggregate(self, state: "FedDyn.State", rnd, replies):
        theta, keys, a = state.weights, self.param_keys, self.p.alpha
        avg = weighted_average([(r.arrays, 1.0) for _, r in replies])
        m = self.spec.num_clients
        for k in keys:
            drift = sum(r.arrays[k] - theta[k] for _, r in replies)
            state.h[k] = state.h[k] - a / m * drift
        state.average = avg
        state.weights = {**theta, **avg, **{k: avg[k] - state.h[k] / a for k in keys}}
        return state

    def global_model(self, state: "FedDyn.State"):
        m = self.eval_model(state.weights)
        if getattr(self, "_avg_net", None) is None:
            self._avg_net = self.new_model()
        load_weights(self._avg_net, state.average)
        self._avg_net.eval()
        return {"server": Predictor(m.backbone, m.head, shared_backbone=True),
                "average": Predictor(self._avg_net.backbone, self._avg_net.head)}

    # ------------------------------------------------------------------ client
    def local_steps(self, payload, cstate, data):
        keys = self.param_keys
        g = cstate.get("g") or self._zeros(payload.arrays)
        extra = {**{f"anchor.{k}": payload.arrays[k] for k in keys}, **{f"g.{k}": g[k] for k in keys}}
        return LocalSteps(payload.arrays, self.dyn_loss, extra=extra)

    def dyn_loss(self, model, x, y, extra):
        """CE - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2; the cross-entropy alone reported as the loss."""
        ce = F.cross_entropy(model(x), y)
        a, p = self.p.alpha, model.params
        reg = sum((-(p[k] * extra[f"g.{k}"]).sum() + 0.5 * a * ((p[k] - extra[f"anchor.{k}"]) ** 2).sum())
                  for k in self.param_keys)
        return ce + reg, {"loss": ce}

    def local_reply(self, payload, cstate, data, out):
        keys, a = self.param_keys, self.p.alpha
        g = cstate.get("g") or self._zeros(payload.arrays)
        g = {k: g[k] - a * (out.weights[k] - payload.arrays[k]) for k in keys}
        return Message(out.weights, {"num_examples": len(data), **out.stats}), {**cstate, "g": g}
