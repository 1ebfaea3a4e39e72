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

The released code's other loss (``loss=distance``, 18sym/FedLF ``algorithm/fedlf.py``)
--------------------------------------------------------------------------------------
The repository holds two FedLF losses: ``algorithm/our.py`` (at 99f98b3, run as ``--algorithm our``: the running
centres above, see the table) and ``algorithm/fedlf.py`` (stored at 127cbaf and eec2250 with the same local loss;
the file the README's ``main.py --algorithm fedlf`` runs, and the only algorithm of the later ``main.py``).
fedlf.py's client, receiving w only (no centres are exchanged, no warm-up):
  once, before training, with the received model and no gradient: one pass over the client's data in training
  mode (BatchNorm on batch statistics, its running statistics updated as by any training pass), shuffled and
  augmented batches of the training batch size:
      c_j = mean of f(x) over the client's samples of class j;  c_j = 1e-8 in every coordinate for a class it lacks
      g   = min(max_{i<j} |c_i - c_j|_2, 100)                  (the lacking classes' centres included)
  each step:  h = f(x),  D_ij = |h_i - c_j|_2
      L = CE(a * (h w^T), y) + mu * CE(-(D + g e_y), y) + beta * decorr(h)
  with a as above (alpha 0.25), mu = ``distance_weight`` 0.01 and beta = 0.01 (``decorr_weight=0.01``; decorr(h)
  is the term above, the official ``DecorrLoss``): the margin g on the true class's distance asks each feature to
  be nearer its own class's centre than to any other by g. Reply w_k. Server: FedAvg (n_k-weighted), nothing else:
  ``warmup_rounds``, ``centre_weight``, ``centre_detach`` and ``centre_init`` do not apply. Communication: FedAvg's.
  The released server also calls a CReFF leftover, ``update_feature_syn``, with an empty list of gradients: at
  eec2250 it computes nothing that is used; at 127cbaf the method is gone and the call would fail after the
  first aggregation. fedlt leaves it out.
  Not copied: fedlf.py takes D as sqrt(|h|^2 - 2 h.c + |c|^2). At distance 0 -- a class with one sample, whose
  feature equals its centre when neither augmentation nor batch statistics move it -- the square root's gradient
  is infinite and the chain rule gives NaN (inf x 0), and rounding can make the expanded square negative (a NaN
  loss). fedlt computes D from the differences themselves (``torch.cdist`` without the matrix-product shortcut:
  no cancellation), whose gradient at distance 0 is 0 and elsewhere has norm 1; where fedlf.py is finite the two
  agree to float precision.
  Released-code run: ``--set loss=distance --set decorr_weight=0.01`` (alpha 0.25 is the default).

Paper vs. official code
=========================  ===========================================  ==========================================
                           paper (default, ``loss=centres``)            official code (options)
=========================  ===========================================  ==========================================
which local loss           running class centres pulled towards the     our.py: the same structure (rows below);
                           server's global ones                         fedlf.py: CE on the negative distances to
                                                                        the received model's class centres, with
                                                                        a margin (``loss=distance``, above)
class-centre term          trains the features: the current batch's     our.py: the running sums are of *detached*
                           features enter F with their gradient         features, so the term is a constant and
                           (``centre_detach=false``)                    trains nothing (``centre_detach=true``)
feature decorrelation      a term of the local loss (abstract, Sec.      our.py: absent (``decorr_weight=0``);
                           3); its form and weight are not readable     fedlf.py: FedDecorr's form, as here, with
                           here: FedDecorr's (Shi et al., ICLR 2023)    weight 0.01 (``decorr_weight=0.01``)
                           loss and coefficient 0.1
first global centres       mean over the clients holding the class      our.py: mean over all of the round's
                           (``centre_init=holders``)                    clients, zero rows included
                                                                        (``centre_init=all``)
=========================  ===========================================  ==========================================
Which one the paper's equations describe: its full text could not be read here (its abstract and a third-party
summary of its Sec. 3: the adjustment a = alpha + (1 - alpha) ndist with a smoothing factor alpha, local class
centres kept per class, updated from the features of its samples and pulled towards global ones). That is the
``centres`` loss -- our.py's structure, the default -- not fedlf.py's fixed centres from the received model with
a margin and no global centres, which the paper's description does not mention; so fedlf.py is offered as the
released code's option, not as the paper's method. alpha 0.25 (both files' ``rs_alpha``), lambda 0.5 and the 10
warm-up rounds are the official options' values. The official cosine-weighted update divides by zero for a class
no client of the round holds; fedlt keeps that centre. The official local optimiser is SGD lr 0.1 without
momentum, 10 local epochs, batch 32 (``--lr 0.1 --momentum 0 --local-epochs 10 --batch-size 32``); fedlt trains
with the run's optimiser, as every method of a comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, Method, load_weights, make_optimizer, train_local, weighted_average, weights_of
from ..core.privacy import sent
from ..core.training import autocast
from ..decl import setting
from ..registry import METHODS

CENTRE_INITS = ("holders", "all")
LOSSES = ("centres", "distance")
ABSENT_CENTRE = 1e-8  # fedlf.py: every coordinate of the centre of a class the client lacks
GAP_CAP = 100.0  # fedlf.py: the margin is the largest distance between two class centres, at most this


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


@torch.no_grad()
def model_centres(model, data, spec, gen: torch.Generator) -> torch.Tensor:
    """fedlf.py's class centres [C, d]: the mean feature per class of ``model`` (the received one) over one pass of
    the client's ``data`` in training mode (BatchNorm on batch statistics, its running statistics updated), in
    shuffled, augmented batches of the run's batch size drawn from ``gen``, without gradient; ABSENT_CENTRE in
    every coordinate for a class the client lacks."""
    model.train()
    C = spec.num_classes
    sums = torch.zeros(C, model.feature_dim, device=spec.device)
    n = torch.zeros(C, device=spec.device)
    for x, y in data.batches(spec.batch_size, gen, epochs=1):
        with autocast(spec):
            h = model.backbone(x)
        sums.index_add_(0, y, h.float())
        n.index_add_(0, y, torch.ones_like(y, dtype=n.dtype))
    centres = sums / n.clamp_min(1)[:, None]
    return torch.where((n > 0)[:, None], centres, torch.full_like(centres, ABSENT_CENTRE))


def centre_gap(centres: torch.Tensor, cap: float = GAP_CAP) -> torch.Tensor:
    """fedlf.py's margin: the largest Euclidean distance between two of the class ``centres`` (those of the classes
    the client lacks included), at most ``cap``; a 0-d tensor. Computed a block of rows at a time."""
    rows = max(1, 2**24 // max(1, centres.numel()))
    far = [torch.linalg.vector_norm(block[:, None] - centres[None], dim=2).amax() for block in centres.split(rows)]
    return torch.stack(far).amax().clamp(max=cap)


def distance_ce(h: torch.Tensor, centres: torch.Tensor, y: torch.Tensor, gap) -> torch.Tensor:
    """CE(-(D + gap e_y), y), D_ij = |h_i - c_j|_2: the cross-entropy of the negative distances to the class
    centres, the true class's distance raised by the margin ``gap``. D from the differences (no cancellation, as
    fedlf.py's expanded square has), whose gradient at distance 0 is 0 where fedlf.py's is NaN."""
    d = torch.cdist(h.float(), centres, compute_mode="donot_use_mm_for_euclid_dist")
    margin = torch.zeros_like(d).scatter(1, y[:, None], 1.0) * gap
    return F.cross_entropy(-(d + margin), y)


def distance_loss(h: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
                  centres: torch.Tensor, gap, distance_weight: float, decorr_weight: float):
    """fedlf.py's local loss of a batch with features ``h``: CE(scale * (h W^T), y) + ``distance_weight`` *
    :func:`distance_ce` + ``decorr_weight`` * :func:`decorrelation_loss`; returns (loss, {name: part})."""
    ce = F.cross_entropy(h @ weight.T * scale, y)
    parts = {"loss_ce": ce, "loss_distance": distance_ce(h, centres, y, gap)}
    loss = ce + distance_weight * parts["loss_distance"]
    if decorr_weight:
        parts["loss_decorr"] = decorrelation_loss(h)
        loss = loss + decorr_weight * parts["loss_decorr"]
    return loss, parts


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
    @dataclass
    class Params:
        alpha: float = setting(0.25, "adaptive logit adjustment: scale alpha + (1 - alpha) n_c / max n (official "
                                     "rs_alpha)", low=0, high=1)
        centre_weight: float = setting(0.5, "lambda of the class-centre L1 term (official lambda_2, hard-coded 0.5)",
                                       low=0)
        warmup_rounds: int = setting(10, "rounds before the server builds the global class centres (official "
                                         "warm_up_epoch)", low=0, limit=10**6)
        decorr_weight: float = setting(0.1, "weight of the feature decorrelation (FedDecorr's coefficient; 0: "
                                            "official our.py; 0.01: official fedlf.py)", low=0)
        centre_detach: bool = setting(False, "official: class centres of detached features (the term then trains "
                                             "nothing)")
        centre_init: str = setting("holders", "first global centres: mean over the clients holding the class | all "
                                              "(official)", choices=CENTRE_INITS)
        loss: str = setting("centres", "local loss: running class centres pulled to the server's (the paper; "
                                       "official our.py with centre_detach=true, centre_init=all, decorr_weight=0) "
                                       "| distance (official fedlf.py: CE on distances to the received model's class "
                                       "centres with a margin, plain FedAvg server; with decorr_weight=0.01)",
                            choices=LOSSES)
        distance_weight: float = setting(0.01, "loss=distance: weight of the CE on the negative distances to the "
                                               "class centres (official fedlf.py, hard-coded 0.01)", low=0)

    @dataclass
    class State(Method.State):
        centres: torch.Tensor | None = None  # [C, d] global class centres (None: in the warm-up, or loss=distance)

    sends = Method.sends + (
        sent("fedlf.centres", "class-means", "the client's class centres: its mean feature of each class over the "
             "last local epoch, [C, d] (zero rows for the classes it lacks; loss=centres)"),
        sent("fedlf.held", "class-counts", "which classes the client holds, [C] bool (loss=centres)"),
    )

    # ------------------------------------------------------------------ server
    def configure(self, state, rnd, cid):
        arrays = dict(state.weights)
        if state.centres is not None:  # after the warm-up
            arrays["fedlf.centres"] = state.centres
        return Message(arrays)

    def aggregate(self, state, rnd, replies):
        keys = list(state.weights)
        state.weights = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies], keys)
        if self.p.loss == "centres" and rnd > self.p.warmup_rounds:
            state.centres = update_centres(state.centres, [r.arrays["fedlf.centres"] for _, r in replies],
                                           [r.arrays["fedlf.held"] for _, r in replies], self.p.centre_init)
        return state

    # ------------------------------------------------------------------ client
    def local_train(self, payload, cstate, data, gen):
        p, s, net = self.p, self.spec, self.net
        load_weights(net, payload.arrays)
        C, d = s.num_classes, net.feature_dim
        counts = torch.as_tensor(data.counts, dtype=torch.float32, device=s.device)
        scale = adjusted_scale(counts, p.alpha)
        if p.loss == "distance":
            return self._distance_train(payload, data, gen, scale), cstate
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

        names = ["loss_ce"] + (["loss_centre"] if G is not None else []) + (["loss_decorr"] if p.decorr_weight else [])
        stats = self._train(payload, data, gen, loss_fn, names, epoch_start)
        arrays = {**weights_of(net), "fedlf.centres": sums / seen.clamp_min(1)[:, None], "fedlf.held": counts > 0}
        return Message(arrays, {"num_examples": len(data), **stats}), cstate

    def _train(self, payload, data, gen, loss_fn, parts: list[str], epoch_start=None) -> dict:
        """The local epochs on ``loss_fn`` (returning the loss and its ``parts`` by name), the bias-free logits'
        parameters at the round's lr; the steps and the mean loss and parts."""
        net = self.net
        opt = make_optimizer([q for n_, q in net.named_parameters() if n_ != "head.bias"], self.spec,
                             lr=self.round_lr(payload))
        out = train_local(net, data, self.spec, gen, loss_fn, optimizer=opt, parts=True, epoch_start=epoch_start)
        return {"steps": out["steps"], **dict(zip(["loss", *parts], out["means"]))}

    def _distance_train(self, payload, data, gen, scale) -> Message:
        """``loss=distance``: fedlf.py's local training (centres and margin from the received model, then the
        epochs on :func:`distance_loss`); the reply is the model alone."""
        p, s, net = self.p, self.spec, self.net
        centres = model_centres(net, data, s, gen)
        gap = centre_gap(centres)

        def loss_fn(model, x, y):
            return distance_loss(model.backbone(x), model.head.weight, scale, y, centres, gap, p.distance_weight,
                                 p.decorr_weight)

        stats = self._train(payload, data, gen, loss_fn,
                            ["loss_ce", "loss_distance"] + (["loss_decorr"] if p.decorr_weight else []))
        return Message(weights_of(net), {"num_examples": len(data), **stats})
