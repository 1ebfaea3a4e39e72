"""FedLF (Lu, Li & Jiang, ACML 2024): "FedLF: Adaptive Logit Adjustment and Feature Optimization in Federated
Long-Tailed Learning" -- three changes to FedAvg's local training: adaptive logit adjustment, continuous
class-centred optimisation and feature decorrelation.

Client k, round t, receiving w (backbone f, classifier rows w_c) and the global class centres G [C, d] (none
during the first ``warmup_rounds`` rounds); n_{k,c} its class counts:
  a_c = alpha + (1 - alpha) n_{k,c} / max_c' n_{k,c'}                        adaptive logit adjustment
  for each of the E local epochs, with running per-class feature sums S_c and counts m_c reset to 0:
      for each mini-batch (x, y):   h = f(x)
          z    = a * (h w^T)                                    (per-class scaled logits, no bias)
          S_c += sum_{i: y_i = c} h_i,  m_c += |{i: y_i = c}|,  F_c = S_c / m_c (0 for m_c = 0)
          L    = CE(z, y) + lambda * |F - G|_1 / (C d)                    (the centre term only once G exists)
                 + beta * mean_{j != l} (Z^T Z)_{jl}^2 / B,   Z = h z-scored per dimension over the batch
          one SGD step on L
  reply w_k and F^(k) = F after the last epoch (the client's class centres, zero rows for classes it lacks).
Server: w <- FedAvg (n_k-weighted). Class centres, from round ``warmup_rounds`` + 1 on:
  first time      G_c = mean of F^(k)_c over the round's clients holding c
  afterwards      G_c = sum_k cos(G_c, F^(k)_c) F^(k)_c / sum_k cos(G_c, F^(k)_c)   (clients holding c; a class
                  whose weights sum to <= 0 keeps its centre)
Inference: the global model as it is (w^T f(x) + b). No personal model.
Communication beyond FedAvg: up C x d floats (F^(k)), down C x d floats (G).
Local training is a loop of its own (the running centres carry state from step to step, which a batched step
description cannot), so FedLF's clients train one after another.

Paper vs. official code (18sym/FedLF ``algorithm/our.py`` at 99f98b3, run as ``--algorithm our``; options.py)
=========================  ===========================================  ==========================================
                           paper (default)                              official code (option)
=========================  ===========================================  ==========================================
class-centre term          trains the features: the current batch's     the running sums are of *detached*
                           features enter F with their gradient         features, so the term is a constant and
                           (``centre_detach=false``)                    trains nothing (``centre_detach=true``)
feature decorrelation      a term of the local loss (abstract, Sec.      absent from the released code
                           3); its form and weight are not readable     (``decorr_weight=0``)
                           here: FedDecorr's (Shi et al., ICLR 2023)
                           loss and coefficient 0.1
first global centres       mean over the clients holding the class      mean over all of the round's clients,
                           (``centre_init=holders``)                    zero rows included (``centre_init=all``)
=========================  ===========================================  ==========================================
The paper's full text could not be read here (its abstract and a third-party summary of its Sec. 3: the
adjustment a = alpha + (1 - alpha) ndist with a smoothing factor alpha, local class centres pulled towards
global ones); alpha 0.25, lambda 0.5 and the 10 warm-up rounds are the official options' values. The official
cosine-weighted update divides by zero for a class no client of the round holds; fedlt keeps that centre. The
official local optimiser is SGD lr 0.1 without momentum, 10 local epochs (``--lr 0.1 --momentum 0
--local-epochs 10``); fedlt trains with the run's optimiser, as every method of a comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, Method, load_weights, make_optimizer, train_local, weighted_average, weights_of
from ..decl import setting
from ..registry import METHODS

CENTRE_INITS = ("holders", "all")


def adjusted_scale(counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """The adaptive logit adjustment: alpha + (1 - alpha) n_c / max n per class."""
    counts = counts.to(torch.float32)
    return alpha + (1 - alpha) * counts / counts.max().clamp_min(1)


def decorrelation_loss(h: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """FedDecorr's regulariser: the mean squared off-diagonal entry of Z^T Z, divided by the batch size, Z the
    features z-scored per dimension over the batch (0 for a batch of one)."""
    n, d = h.shape
    if n == 1:
        return h.sum() * 0
    z = (h - h.mean(0, keepdim=True)) / torch.sqrt(eps + h.var(0, keepdim=True))
    corr = z.T @ z
    off = corr - torch.diag_embed(torch.diagonal(corr))
    return off.pow(2).sum() / (d * (d - 1)) / n


def running_centres(sums: torch.Tensor, seen: torch.Tensor, h: torch.Tensor, y: torch.Tensor, detach: bool = False):
    """The epoch's class centres after this batch: (S + the batch's per-class feature sums) / (m + its counts), 0
    for classes not seen yet; returns (centres [C, d], new sums, new counts). The batch's features carry their
    gradient into the centres unless ``detach`` (the official code)."""
    onehot = F.one_hot(y, sums.shape[0]).to(h.dtype)
    total = sums + onehot.T @ (h.detach() if detach else h)
    n = seen + onehot.sum(0)
    return total / n.clamp_min(1)[:, None], total.detach(), n


def update_centres(G: torch.Tensor | None, centres: list[torch.Tensor], held: list[torch.Tensor],
                   init: str = "holders") -> torch.Tensor:
    """The server's class centres from the clients' ``centres`` [C, d] (``held``: [C] bools, the classes each
    client holds): the first time (G None) their mean, afterwards the cosine-similarity weighted mean."""
    F_ = torch.stack(centres)  # [K, C, d]
    H = torch.stack(held).to(F_.dtype)  # [K, C]
    if G is None:
        if init == "all":
            return F_.mean(0)
        return (F_ * H[..., None]).sum(0) / H.sum(0).clamp_min(1)[:, None]
    sim = F.cosine_similarity(G[None], F_, dim=2) * H  # [K, C]
    total = sim.sum(0)
    new = (sim[..., None] * F_).sum(0) / total.clamp_min(1e-12)[:, None]
    return torch.where((total > 0)[:, None], new, G)


@METHODS.register("fedlf")
class FedLF(Method):
    name = "fedlf"

    @dataclass
    class Params:
        alpha: float = setting(0.25, "adaptive logit adjustment: scale alpha + (1 - alpha) n_c / max n (official "
                                     "rs_alpha)", low=0, high=1)
        centre_weight: float = setting(0.5, "lambda of the class-centre L1 term (official lambda_2, hard-coded 0.5)",
                                       low=0)
        warmup_rounds: int = setting(10, "rounds before the server builds the global class centres (official "
                                         "warm_up_epoch)", low=0, limit=10**6)
        decorr_weight: float = setting(0.1, "weight of the feature decorrelation (FedDecorr's coefficient; 0: "
                                            "official code)", low=0)
        centre_detach: bool = setting(False, "official: class centres of detached features (the term then trains "
                                             "nothing)")
        centre_init: str = setting("holders", "first global centres: mean over the clients holding the class | all "
                                              "(official)", choices=CENTRE_INITS)

    # ------------------------------------------------------------------ server
    def configure(self, state, rnd, cid):
        arrays = dict(state["weights"])
        if "centres" in state:  # after the warm-up
            arrays["fedlf.centres"] = state["centres"]
        return Message(arrays)

    def aggregate(self, state, rnd, replies):
        keys = list(state["weights"])
        state["weights"] = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies], keys)
        if rnd > self.p.warmup_rounds:
            state["centres"] = update_centres(state.get("centres"), [r.arrays["fedlf.centres"] for _, r in replies],
                                              [r.arrays["fedlf.held"] for _, r in replies], self.p.centre_init)
        return state

    # ------------------------------------------------------------------ client
    def local_train(self, payload, cstate, data, gen):
        p, s, net = self.p, self.spec, self.net
        load_weights(net, payload.arrays)
        C, d = s.num_classes, net.feature_dim
        counts = torch.as_tensor(data.counts, dtype=torch.float32, device=s.device)
        scale = adjusted_scale(counts, p.alpha)
        G = payload.arrays.get("fedlf.centres")
        sums = torch.zeros(C, d, device=s.device)
        seen = torch.zeros(C, device=s.device)

        def loss_fn(model, x, y):
            h = model.backbone(x)
            ce = F.cross_entropy(h @ model.head.weight.T * scale, y)
            centres, total, n = running_centres(sums, seen, h, y, p.centre_detach)
            sums.copy_(total)
            seen.copy_(n)
            parts = {"loss_ce": ce}
            loss = ce
            if G is not None:
                parts["loss_centre"] = (centres - G).abs().mean()
                loss = loss + p.centre_weight * parts["loss_centre"]
            if p.decorr_weight:
                parts["loss_decorr"] = decorrelation_loss(h)
                loss = loss + p.decorr_weight * parts["loss_decorr"]
            return loss, parts

        def epoch_start():  # the running class centres restart every epoch
            sums.zero_()
            seen.zero_()

        opt = make_optimizer([q for n_, q in net.named_parameters() if n_ != "head.bias"], s, lr=self.round_lr(payload))
        out = train_local(net, data, s, gen, loss_fn, optimizer=opt, parts=True, epoch_start=epoch_start)
        names = ["loss", "loss_ce"] + (["loss_centre"] if G is not None else []) + \
            (["loss_decorr"] if p.decorr_weight else [])
        stats = {"steps": out["steps"], **dict(zip(names, out["means"]))}
        arrays = {**weights_of(net), "fedlf.centres": sums / seen.clamp_min(1)[:, None], "fedlf.held": counts > 0}
        return Message(arrays, {"num_examples": len(data), **stats}), cstate
