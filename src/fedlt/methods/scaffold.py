"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020).

State: a server control variate c and a control variate c_i on every client (both start at 0; c_i never
leaves its client -- only its change does). One per trainable parameter; none for buffers.

Client i (Algorithm 1), receiving (x, c):
    y <- x; for K local steps: y <- y - eta_l (grad f_i(y) - c_i + c)
    c_i+ = grad f_i(x)                                 (option I: one extra pass over the local data), or
    c_i+ = c_i - c + (x - y) / (K eta_l)                (option II, default: free)
    send (y, Delta c_i = c_i+ - c_i); keep c_i <- c_i+
Server, with S the round's clients and N the total number of clients:
    x <- x + eta_g * (1/|S|) sum_{i in S} (y_i - x)
    c <- c + (1/N) sum_{i in S} Delta c_i
so c is at all times the mean of the N client variates (tests check this invariant).
Inference: the global model x; no personal model.
Communication: c travels down with x and Delta c_i up with y_i, so each message is about twice FedAvg's
(FedDr+ Table 2 marks SCAFFOLD "(x2)"); the engine counts it from the Message arrays.

Implementation notes and differences between codes (Lee-Gihun/FedNTD, KarhouTam/FL-bench,
TsingZ0/PFLlib):
- The correction (c - c_i) is added to every local gradient, here as the gradient of the linear term
  <y, c - c_i> in the loss (exactly the same update; the logged loss is the cross-entropy alone).
- Local momentum: the paper's local steps are plain SGD. This benchmark's local optimiser has momentum rho
  (0.9), under which K SGD steps of a constant gradient move y by eta_l * K' * grad with
  K' = (K - rho (1 - rho^K) / (1 - rho)) / (1 - rho); option II then divides by K' instead of K
  (``momentum_corrected=true``, default; the FedNTD code does the same). With rho = 0, K' = K: the paper.
- Aggregation of y_i: uniform over the round's clients as in the paper (``weighting="uniform"``); FedAvg-style
  n_i weights with ``weighting="samples"``. Buffers (BatchNorm statistics) are averaged with the same weights.
- K is the number of local mini-batch steps actually taken (epochs x batches), as PFLlib; FL-bench reads its
  local-epoch setting as K steps.
- Default eta_g = 1 (the paper's experiments, the FedNTD and FedExP codes).

Under ``--dp sample`` (DP-SGD, ``fedlt.core.dpsgd``; option II only): each sample's loss carries the correction
term, clipped with its cross-entropy, and K is DP-SGD's steps (L Poisson batches an epoch, an empty one a step of
noise alone); Delta c_i, computed from the trained model, is post-processing. Under ``--dp client`` SCAFFOLD is
refused: Delta c_i is not an update of anything the client received, so it cannot be clipped and noised with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, load_weights, weighted_average
from ..core.steps import LocalSteps
from ..core.privacy import DERIVED, sent
from ..core.server_opt import ParamKeys, pseudo_gradient, server_step
from ..core.training import effective_steps
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg

C_DOWN, C_UP = "c/", "dc/"  # name prefixes of the control-variate arrays in messages


@METHODS.register("scaffold")
class Scaffold(ParamKeys, FedAvg):
    @dataclass
    class Params:
        server_lr: float = setting(1.0, "eta_g, the server's step size", low=0, low_open=True)
        option: str = setting("II", '"I": c_i+ = full local gradient at x; "II": from the model change',
                              choices=("I", "II"))
        momentum_corrected: bool = setting(True, "option II divides by K' (local momentum), = K without momentum")
        weighting: str = setting("uniform", "aggregation of the y_i: uniform (paper) | samples (n_i weights)",
                                 choices=("uniform", "samples"))

    @dataclass
    class State(FedAvg.State):
        c: dict[str, torch.Tensor] | None = None  # the server control variate (one tensor per trainable parameter)

    # --dp sample: a sample's loss reads it, the received model and the correction c - c_i (core.dpsgd); Delta c_i
    # is computed from the DP-SGD-trained model, x, c and c_i (post-processing, dp=DERIVED); option I's full
    # gradient reads every local sample and is refused
    dp_sample = True

    sends = FedAvg.sends + (
        sent(C_UP + "*", "model", "Delta c_i: the change of its control variate, one per trainable parameter (a "
             "model-sized update)", dp=DERIVED),
    )

    @classmethod
    def dp_sample_refusal(cls, p):
        return ("scaffold's option I computes c_i+ as the full gradient over every local sample, which DP-SGD does "
                "not cover; use --set option=II") if p.option == "I" else ""

    def _zeros(self, weights) -> dict[str, torch.Tensor]:
        return {k: torch.zeros_like(weights[k]) for k in self.param_keys}

    # ------------------------------------------------------------------ server
    def init_server(self) -> "Scaffold.State":
        state = super().init_server()
        state.c = self._zeros(state.weights)
        return state

    def configure(self, state: "Scaffold.State", rnd, cid):
        return Message({**state.weights, **{C_DOWN + k: v for k, v in state.c.items()}})

    def eval_payload(self, state: "Scaffold.State", cid):
        return Message(dict(state.weights))

    def aggregate(self, state: "Scaffold.State", rnd, replies):
        uniform = self.p.weighting == "uniform"
        avg = weighted_average([({k: v for k, v in r.arrays.items() if not k.startswith(C_UP)},
                                 1.0 if uniform else r.meta["num_examples"]) for _, r in replies])
        w = state.weights
        g = pseudo_gradient(w, avg, self.param_keys)
        state.weights = server_step(w, avg, g, self.p.server_lr)
        N = self.spec.num_clients
        for _, r in replies:
            for k in self.param_keys:
                state.c[k] = state.c[k] + r.arrays[C_UP + k] / N
        return state

    # ------------------------------------------------------------------ client
    def local_steps(self, payload, cstate, data):
        """K local steps on CE + <y, c - c_i> (the correction as a linear term); option I's c_i+ (the full local
        gradient at x) computed first and carried as a constant extra."""
        keys = self.param_keys
        x = {k: v for k, v in payload.arrays.items() if not k.startswith(C_DOWN)}
        ci = cstate.get("c") or self._zeros(x)
        extra = {f"corr.{k}": payload.arrays[C_DOWN + k] - ci[k] for k in keys}
        if self.p.option == "I":
            load_weights(self.net, x)
            extra.update({f"cnew.{k}": v for k, v in self._full_gradient(data).items()})
        return LocalSteps(x, self.corrected_loss, extra=extra)

    def corrected_loss(self, model, x, y, extra):
        ce = F.cross_entropy(model(x), y)
        return ce + sum((model.params[k] * extra[f"corr.{k}"]).sum() for k in self.param_keys), {"loss": ce}

    def local_reply(self, payload, cstate, data, out):
        keys = self.param_keys
        x, y = {k: v for k, v in payload.arrays.items() if not k.startswith(C_DOWN)}, out.weights
        c = {k: payload.arrays[C_DOWN + k] for k in keys}
        ci = cstate.get("c") or self._zeros(x)
        if self.p.option == "I":
            ci_new = {k: out.extra[f"cnew.{k}"] for k in keys}
        else:
            K = out.stats["steps"]
            rho = self.spec.momentum if self.p.momentum_corrected else 0.0
            denom = effective_steps(K, rho) * self.round_lr(payload)
            ci_new = {k: ci[k] - c[k] + (x[k] - y[k]) / denom for k in keys} if K else dict(ci)
        dc = {C_UP + k: ci_new[k] - ci[k] for k in keys}
        return Message({**y, **dc}, {"num_examples": len(data), **out.stats}), {**cstate, "c": ci_new}

    def _full_gradient(self, data) -> dict[str, torch.Tensor]:
        """Option I: grad f_i(x), the mean cross-entropy gradient over the whole local set at the received x."""
        net = self.net
        net.train()
        net.zero_grad(set_to_none=True)
        n = len(data)
        for xb, yb in data.batches(self.spec.batch_size, None, epochs=1, shuffle=False, train=False):
            (F.cross_entropy(net(xb), yb, reduction="sum") / n).backward()
        params = dict(net.named_parameters())
        out = {k: params[k].grad.detach().clone() if params[k].grad is not None else torch.zeros_like(params[k])
               for k in self.param_keys}
        net.zero_grad(set_to_none=True)
        return out
