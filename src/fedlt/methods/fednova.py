"""FedNova (Wang et al., NeurIPS 2020): client updates normalised by their number of local steps.

"Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization" (Wang, Liu, Liang, Joshi &
Poor).

Clients run different numbers of local steps (tau_i = epochs x batches, so a client with more data takes more);
FedAvg then over-weights the clients that moved furthest and converges to a mismatched objective. FedNova
averages *normalised* updates instead.

Client i, from the received x: E local epochs of SGD (momentum rho) on cross-entropy -> y_i after tau_i steps.
    ||a_i||_1 = sum_{k=1}^{tau_i} (1 - rho^k) / (1 - rho)      (= tau_i without momentum)
(the total weight of the tau_i gradients in y_i - x: heavy-ball momentum makes early gradients count more);
it sends y_i and ||a_i||_1 (a number in the reply's meta).
Server, with p_i = n_i / sum_{j in round} n_j:
    d_i     = (x - y_i) / ||a_i||_1                      (the normalised update, per unit of lr)
    tau_eff = sum_i p_i ||a_i||_1                        (the paper's choice: FedAvg's step when all tau_i agree)
    x      <- x - tau_eff * sum_i p_i d_i
Only trainable parameters take this step; buffers (BatchNorm statistics) take the plain n_i-weighted average.
Inference: the global model; no personal model. Messages: FedAvg's plus one number.

Paper vs. official code (JYWa/FedNova, ``distoptim/FedNova.py``):
- p_i: the official code weights by each client's share of *all* training data and also offers a global
  momentum ``gmf`` (default 0, not offered here) and a FedProx term (see ``fedprox``); here p_i is normalised
  over the round's clients, so full participation gives the paper's rule exactly.
- ||a_i||_1 with momentum is the official ``local_normalizing_vec`` (it counts momentum the same way; weight
  decay is not counted there either). ``normalize_momentum=false`` uses tau_i instead (momentum ignored).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core import Message, weighted_average
from ..core.privacy import sent, sends_with
from ..core.server_opt import ParamKeys, server_step
from ..core.training import effective_steps
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


@METHODS.register("fednova")
class FedNova(ParamKeys, FedAvg):
    # --dp client weighs every update alike (num_examples 1), which this server's per-client normalisation undoes
    dp_client_refusal = ("its server weighs each update by its own client's local steps (a_norm), which --dp client's "
                         "noise calibration for a uniformly weighted mean does not cover")
    # --dp sample: FedAvg's steps as DP-SGD; a_norm follows from the client's size, public as num_examples is
    dp_sample = True
    @dataclass
    class Params:
        normalize_momentum: bool = setting(True, "||a_i||_1 counts local momentum (paper, official); false: tau_i")

    sends = sends_with(
        FedAvg.sends,
        sent("a_norm", "size", "||a_i||_1, the weight of its local steps (their count, with momentum): a function of "
             "its number of samples and the run's settings", meta=True),
    )

    def local_reply(self, payload, cstate, data, out):
        """FedAvg's local steps, answered with ||a_i||_1 from their count."""
        rho = self.spec.momentum if self.p.normalize_momentum else 0.0
        a_norm = effective_steps(out.stats["steps"], rho)
        return Message(out.weights, {"num_examples": len(data), "a_norm": a_norm, **out.stats}), cstate

    def aggregate(self, state: "FedNova.State", rnd, replies):
        x = state.weights
        live = [(r, r.meta["a_norm"]) for _, r in replies if r.meta["a_norm"] > 0]  # no step: nothing moved
        avg = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies])
        if not live:
            state.weights = server_step(x, avg, {}, 1.0)
            return state
        total = float(sum(r.meta["num_examples"] for r, _ in live))
        p = [r.meta["num_examples"] / total for r, _ in live]
        tau_eff = sum(pi * a for pi, (_, a) in zip(p, live))
        direction = {k: sum(pi * (x[k] - r.arrays[k]) / a for pi, (r, a) in zip(p, live)) for k in self.param_keys}
        state.weights = server_step(x, avg, direction, tau_eff)
        return state
