"""Ratio Loss (Wang, Xu, Wang, Zhu, "Addressing Class Imbalance in Federated Learning", AAAI 2021).

The server estimates how under-represented each class is from the *gradients* that a small class-balanced
auxiliary set produces on the global model's last layer, and sends class weights alpha that the clients use
in a weighted cross-entropy.

**This method needs labelled data on the server.** The auxiliary set holds ``aux_per_class`` samples of every
class (32, the number RedGrape's appendix C.2 takes from the original study). Where it comes from here: a
seeded draw from the dataset's *training* set, preferring the samples the long-tailed subset left out (so no
client holds them); for a class whose every training sample is in the long-tailed subset (the head class of
Fashion-MNIST at rho 100 keeps all 6,000) the rest is drawn from the kept samples, i.e. the server then holds
copies of samples some client also holds (``aux_overlap`` counts them). The official code does the same kind
of thing: its auxiliary set is the first 63 samples of each class of the training set the clients are drawn
from. The balanced *test* set is never used. The data settings reach the method through ``RunSpec.data``.

Client: ``L = mean_i alpha_{y_i} * CE(z_i, y_i)`` (not normalised by the sum of the weights), with the alpha
received this round (all ones before the first estimate). Nothing else changes.
Server ("monitor"), every round, after the clients reply:
1. For each class c, a copy of the model broadcast this round is trained on D_aux,c alone (the run's local
   optimiser and epochs): last-layer weights W^(c). Deltas D_c = W^(c) - W.
2. Ownership: entry (i, j) of the last-layer weight belongs to c* = argmax_c D_c[i, j] when no other monitor
   has |D_c[i, j]| > ``outlier_threshold`` * |D_c*[i, j]|.
3. For each class, over the entries it owns: A_c = sum D_c, O_c = sum mean_{c' != c} D_c';
   R_c = |A_c| / |O_c| (10 when O_c = 0, capped at ``ratio_cap``).
4. alpha_c = alpha0 + beta * R_c (the paper's "alpha + beta * ratio"), broadcast next round.
Aggregation: FedAvg. Inference: the global model; no personalized model.

Communication beyond FedAvg: C floats down (alpha). Server compute: C monitor trainings per round.

Paper vs. official code (official repository balanced-fl/Addressing-Class-Imbalance-FL):
- The official code averages the client models without weights; the RedGrape port weights them by n_k. The
  default here is the n_k-weighted FedAvg (``uniform_average=true`` gives the official one).
- The official monitors use SGD momentum 0.9, weight decay 5e-4 and the clients' local epochs; here the run's
  local optimiser and epochs (weight decay via --weight-decay).
- The final-layer weight is found by name in the code ('fc1', 'linear', 'fc'); here it is the model's head.
Defaults: alpha0 = 1.0, beta = 0.1, threshold 0.8, cap 5000, 32 auxiliary samples per class.

Learning rate. R_c grows without bound as the global model stops predicting class c on the other classes'
data (O_c -> 0), so alpha_c can reach tens to hundreds (the cap allows 501), and the weights multiply the
step size: the official code trains with SGD lr 0.001, momentum 0.5. At the fmnist-lt protocol's lr 0.05,
momentum 0.9, local training diverged (NaN after round 23 on Fashion-MNIST-LT rho 100); lower --lr.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, Method, derive_seed, load_weights, train_local, weighted_average, weights_of
from ..core.auxiliary import auxiliary_set
from ..core.steps import LocalSteps
from ..decl import setting
from ..registry import METHODS

MONITOR = 122  # seed purpose (not fedlt.seeds.Purpose.AUX_DRAW's 121, the auxiliary set's draw)


def ratio_weights(w_last: torch.Tensor, monitors: torch.Tensor, threshold: float = 0.8, cap: float = 5000.0,
                  alpha0: float = 1.0, beta: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Class weights from the monitors' last-layer weights ``monitors[c]`` (trained on class c's auxiliary
    data from ``w_last``). Returns (alpha, R)."""
    D = (monitors - w_last[None]).double()  # [M, C, d], M = C monitors
    M = D.shape[0]
    cstar = D.argmax(0)  # signed maximum, as the official code
    Dmax = D.gather(0, cstar[None]).squeeze(0)
    near = (D.abs() > threshold * Dmax.abs()).sum(0)
    near = torch.where(Dmax == 0, (D == 0).sum(0), near)
    owned = near < 2
    others = (D.sum(0)[None] - D) / max(M - 1, 1)  # mean over the other monitors, per monitor
    R = torch.empty(M, dtype=torch.float64, device=D.device)
    for c in range(M):
        m = owned & (cstar == c)
        A, O = D[c][m].sum(), others[c][m].sum()
        R[c] = (A.abs() / O.abs()) if O != 0 else 10.0
    R = R.clamp(max=cap)
    return (alpha0 + beta * R).float(), R.float()


@METHODS.register("ratioloss")
class RatioLoss(Method):
    finetune_needs = {"images": "the server's auxiliary balanced images"}
    # --dp sample: a sample's loss reads it and the server's alpha (core.dpsgd); the server's monitors train on its
    # own auxiliary set
    dp_sample = True
    @dataclass
    class Params:
        aux_per_class: int = setting(32, "size of the server's auxiliary set per class", low=1, limit=10**6)
        alpha0: float = setting(1.0, "alpha_c = alpha0 + beta * R_c (step 4)", low=0)
        beta: float = setting(0.1, "the ratio's weight in alpha_c (step 4)", low=0)
        outlier_threshold: float = setting(0.8, "ownership of a weight entry: no other monitor above this fraction "
                                                "of its change (step 2)", low=0, high=1)
        ratio_cap: float = setting(5000.0, "R_c is capped at this (step 3)", low=0, low_open=True)
        uniform_average: bool = setting(False, "official code: unweighted mean of the client models")

    @dataclass
    class State(Method.State):
        alpha: torch.Tensor | None = None  # the class weights sent to the clients (C)
        ratio: torch.Tensor | None = None  # the last round's per-class ratios R_c (None before the first round)

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        self._aux = None

    def aux_by_class(self):
        """The auxiliary set split by class (drawn once per process, deterministically)."""
        if self._aux is None:
            from ..data.federated import ClientData

            aux, self.aux_overlap = auxiliary_set(self.spec, self.p.aux_per_class)
            self._aux = [ClientData(-1, aux.x[aux.y == c], aux.y[aux.y == c], aux.num_classes, aux.prep,
                                    aux.test_x, aux.test_y) for c in range(aux.num_classes)]
        return self._aux

    # ------------------------------------------------------------------ server
    def init_server(self) -> "RatioLoss.State":
        self.aux_by_class()  # fail early if the data settings are missing
        return self.State(weights=weights_of(self.new_model()),
                          alpha=torch.ones(self.spec.num_classes, device=self.spec.device))

    def configure(self, state, rnd, cid):
        return Message({**state.weights, "ratio.alpha": state.alpha.clone()})

    def monitors(self, weights, rnd) -> torch.Tensor:
        """Last-layer weights of one copy of ``weights`` trained on each class's auxiliary data."""
        if getattr(self, "_monitor_net", None) is None:
            self._monitor_net = self.new_model()
        net = self._monitor_net
        out = []
        for c, aux in enumerate(self.aux_by_class()):
            load_weights(net, weights)
            gen = torch.Generator().manual_seed(derive_seed(self.spec.seed, MONITOR, rnd, c))
            with torch.enable_grad():
                train_local(net, aux, self.spec, gen, lr=self.spec.lr_at(rnd))
            out.append(net.head.weight.detach().clone())
        return torch.stack(out)

    def aggregate(self, state, rnd, replies):
        keys = list(state.weights)
        w_last = state.weights["head.weight"]
        mons = self.monitors(state.weights, rnd)
        state.alpha, state.ratio = ratio_weights(w_last, mons, self.p.outlier_threshold, self.p.ratio_cap,
                                                 self.p.alpha0, self.p.beta)
        weight = (lambda r: 1.0) if self.p.uniform_average else (lambda r: r.meta["num_examples"])
        state.weights = weighted_average([(r.arrays, weight(r)) for _, r in replies], keys)
        return state

    # ------------------------------------------------------------------ client
    def local_steps(self, payload, cstate, data):
        """E local epochs of the alpha-weighted cross-entropy, alpha the server's of this round."""
        weights = {k: v for k, v in payload.arrays.items() if k != "ratio.alpha"}
        return LocalSteps(weights, self.weighted_ce, extra={"alpha": payload.arrays["ratio.alpha"].to(self.spec.device)})

    def weighted_ce(self, model, x, y, extra):
        return (extra["alpha"].gather(0, y) * F.cross_entropy(model(x), y, reduction="none")).mean()
