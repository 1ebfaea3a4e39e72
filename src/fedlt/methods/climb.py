"""CLIMB (Shen et al., ICLR 2022): clients re-weighted by dual variables of a loss-constrained FL objective.

Shen, Wang, Lee, Zhang, Chen, Lu, "An Agnostic Approach to Federated Learning with Class Imbalance".

Class imbalance is handled without knowing it: the FL objective is constrained so that no client's loss
exceeds the average loss by more than epsilon,
    min_w (1/K) sum_k f_k(w)   s.t.   f_k(w) - f_bar(w) <= epsilon  for every k,
and solved by primal-dual updates on the Lagrangian with one dual variable lambda_k >= 0 per client. A client
whose loss stays high gets a growing lambda_k and so a larger aggregation weight.

Client: before training, the loss l_k = f_k(w) of the *received* global model on its training data (mean CE,
eval mode), uploaded as a one-element array ``climb.loss``; then plain CE local training from w.
Server, round t (S = this round's clients, K = all clients):
- Primal: w <- w + sum_{k in S} c_k (w_k - w), with c_k = (1 + lambda_k - mean_{j<=K} lambda_j) / |S|
  (``weighted=true``: c_k = n_k / sum_S n * (1 + lambda_k - mean lambda), the RedGrape port). The weights
  are not renormalised and may be <= 0, as in the official code.
- Dual, every ``dual_every`` rounds: lambda_k <- max(0, lambda_k + dual_lr * (l_k - mean l - epsilon) / K)
  for every client k whose loss was reported since the last dual step (mean over those clients).
Inference: the global model; no personalized model.

Communication beyond FedAvg: one float up per client per round. Server state: K floats.

Paper ("An Agnostic Approach to Federated Learning with Class Imbalance", ICLR 2022) / official code vs. here:
- Participation. The official code runs with every client active and, every ``n_p_steps`` = 5 primal rounds,
  evaluates every client's loss for a dual step. With partial participation the engine only reaches the
  round's clients, so each client's loss is measured when it is sampled (on that round's global model), kept
  until the next dual step, and the dual step uses the clients measured since the last one. The RedGrape port
  instead updates lambda every round for the sampled clients, with the n_k-weighted mean loss and without the
  1/K (``dual_every=1`` and ``weighted=true`` come closest). Its mean-loss bug (the mean is accumulated once
  per state-dict key, so lambda never leaves 0) is not reproduced.
- The official optional clipping of the client delta norms is not implemented.
Defaults: dual_lr 2.0 and epsilon 0.01 (the official MNIST/Fashion-MNIST settings; CIFAR-10: 0.1 and 0.1),
dual_every 5.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..core import Message, Method, load_weights, train_local, weighted_average, weights_of
from ..core.privacy import sent
from ..decl import setting
from ..registry import METHODS


@torch.no_grad()
def dataset_loss(model: torch.nn.Module, data, batch_size: int = 1000) -> float:
    """Mean CE of ``model`` (eval mode) over all of a client's training samples, without augmentation."""
    was = model.training
    model.eval()
    total = 0.0
    for x, y in data.batches(batch_size, None, shuffle=False, train=False):
        total = total + F.cross_entropy(model(x), y, reduction="sum")  # on the device; read once below
    model.train(was)
    return float(total) / max(len(data.y), 1)


def dual_step(lam: torch.Tensor, losses: dict[int, float], dual_lr: float, epsilon: float) -> torch.Tensor:
    """lambda_k <- max(0, lambda_k + dual_lr * (l_k - mean l - epsilon) / K) for the clients in ``losses``."""
    if not losses:
        return lam
    lam = lam.clone()
    ids = torch.tensor(sorted(losses), device=lam.device)
    l = torch.tensor([losses[k] for k in sorted(losses)], dtype=lam.dtype, device=lam.device)
    lam[ids] = (lam[ids] + dual_lr * (l - l.mean() - epsilon) / len(lam)).clamp_min(0)
    return lam


@METHODS.register("climb")
class CLIMB(Method):
    @dataclass
    class Params:
        dual_lr: float = setting(2.0, "eta_lambda (official MNIST/FMNIST; CIFAR-10: 0.1)", low=0)
        epsilon: float = setting(0.01, "tolerance (official MNIST/FMNIST; CIFAR-10: 0.1)", low=0)
        dual_every: int = setting(5, "primal rounds per dual step (official n_p_steps)", low=1, limit=10**6)
        weighted: bool = setting(False, "n_k-weighted primal step (RedGrape port); official: uniform over clients")

    @dataclass
    class State(Method.State):
        lam: torch.Tensor | None = None  # [K] the dual variables, one per client (cpu)
        pending: dict[int, float] = field(default_factory=dict)  # client -> its loss, since the last dual step

    sends = Method.sends + (
        sent("climb.loss", "scalars", "the received global model's mean loss on the client's training data, before "
             "training, [1]"),
    )

    # ------------------------------------------------------------------ server
    def init_server(self) -> "CLIMB.State":
        state = super().init_server()
        state.lam = torch.zeros(self.spec.num_clients, device="cpu")
        return state

    def aggregate(self, state, rnd, replies):
        w, lam = state.weights, state.lam
        keys = list(w)
        n = sum(r.meta["num_examples"] for _, r in replies)
        new = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies], keys)  # integer buffers
        for k in keys:
            if w[k].is_floating_point():
                step = torch.zeros_like(w[k])
                for cid, r in replies:
                    share = r.meta["num_examples"] / n if self.p.weighted else 1.0 / len(replies)
                    step += share * float(1 + lam[cid] - lam.mean()) * (r.arrays[k] - w[k])
                new[k] = w[k] + step
        state.weights = new
        for cid, r in replies:
            state.pending[cid] = float(r.arrays["climb.loss"][0])
        if rnd % self.p.dual_every == 0:
            state.lam = dual_step(lam, state.pending, self.p.dual_lr, self.p.epsilon)
            state.pending = {}
        return state

    # ------------------------------------------------------------------ client
    def local_train(self, payload, cstate, data, gen):
        net = self.net
        load_weights(net, payload.arrays)
        loss0 = dataset_loss(net, data)
        stats = train_local(net, data, self.spec, gen, lr=payload.lr)
        arrays = {**weights_of(net), "climb.loss": torch.tensor([loss0], device="cpu")}
        return Message(arrays, {"num_examples": len(data), **stats}), cstate
