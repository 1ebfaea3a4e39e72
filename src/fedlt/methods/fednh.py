"""FedNH (Dai et al., AAAI 2023): smoothly updated class prototypes on the hypersphere as the classifier.

"Tackling Data Heterogeneity in Federated Learning with Class Prototypes" (Dai, Chen, Li, Heinecke, Sun & Xu).

The classifier is a set of class prototypes W [C, d] with unit rows, spread uniformly on the hypersphere at the
start and never trained by gradient; logits are s * cos(h, W_c) with a learnable scale s.
Client k, receiving (theta, s, W): E local epochs of SGD on CE(s * normalize(f_theta(x)) W^T, y) (theta and s
trained, W frozen). Then, with the trained model (eval mode), for every class c it holds, the normalised mean of
its normalised features, scaled by its count: p_{k,c} = n_{k,c} * normalize(mean_i normalize(f(x_i))); it sends
(theta, s, p_k [C, d], n_k [C]) and keeps its trained model as its personal model.
Server: theta, s <- FedAvg; for every class,
    W_c <- normalize(rho W_c + (1 - rho) normalize(sum_k p_{k,c} / sum_k n_{k,c}))        (rho = 0.9)
so the prototypes drift smoothly towards the classes' semantic centres (a class no client of the round holds
keeps its prototype).
Inference: GM = the global model; PM = each client's model after its last local training (the paper's
personalized evaluation; a client not yet sampled uses the global model). A full model is kept per client.
Communication beyond FedAvg: up, C d + C floats (prototypes and counts).

Paper vs. official code (Yutong-Dai/FedNH, ``strategies/FedNH.py``, ``FedUH.py``):
- Initialisation: the official code's ``orthogonal`` rows (orthonormal, so equally spaced when C <= d) is the
  default; ``init="etf"`` takes the simplex ETF (the maximal equal spread).
- Scale: learnable, initialised at 20 (``fix_scale=true``: fixed at 30, the official ``FedNH_fix_scaling``).
- Aggregation of theta and s: the official server averages the client models uniformly (server lr 1 over the
  round's clients); ``weighting="uniform"`` does that, ``"samples"`` (default) weights by n_k like FedAvg.
- Not offered: the official ``*_adv_prototype_agg`` variants (off by default there), and its training setup
  (gradient clipping at norm 10, stepwise lr decay), which is not part of the method.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core import Message, Predictor, derive_seed, load_weights, train_local, weighted_average, weights_of
from ..core.etf import init_classifier
from ..core.personal import personal_predictor
from ..core.privacy import sent
from ..core.retrain import local_features
from ..decl import setting
from ..models import Model
from ..registry import METHODS
from .fedavg import FedAvg

PROTO_INIT = 0x4E1  # seed purpose of the prototypes


class PrototypeHead(nn.Module):
    """``h -> s * normalize(h) normalize(W)^T``; W [C, d] frozen (updated by the server only), s learnable."""

    def __init__(self, W: torch.Tensor, scale: float, learn_scale: bool):
        super().__init__()
        self.prototype = nn.Parameter(W.clone(), requires_grad=False)
        self.scaling = nn.Parameter(torch.full((), float(scale), device=W.device), requires_grad=learn_scale)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.scaling * (F.normalize(h, dim=1) @ F.normalize(self.prototype, dim=1).T)


def class_prototypes(feats: torch.Tensor, labels: torch.Tensor, num_classes: int):
    """Per class: ``n_c * normalize(mean of normalize(feats))`` [C, d] (zero rows for absent classes) and n_c [C]."""
    onehot = F.one_hot(labels, num_classes).to(feats.dtype)  # [N, C]
    counts = onehot.sum(0)
    means = (onehot.T @ F.normalize(feats, dim=1)) / counts.clamp_min(1)[:, None]
    return F.normalize(means, dim=1) * counts[:, None], counts


def smooth_prototypes(W: torch.Tensor, scaled: torch.Tensor, counts: torch.Tensor, rho: float) -> torch.Tensor:
    """``normalize(rho W + (1 - rho) normalize(sum_k p_k / sum_k n_k))`` given the sums over the round's clients."""
    avg = F.normalize(scaled / counts.clamp_min(1e-12)[:, None], dim=1)
    return F.normalize(rho * W + (1 - rho) * avg, dim=1)


@METHODS.register("fednh")
class FedNH(FedAvg):
    personalized = True

    @dataclass
    class Params:
        rho: float = setting(0.9, "smoothing of the prototype update (official FedNH_smoothing)", low=0, high=1)
        init: str = setting("orthogonal", "orthogonal (official) | etf", choices=("orthogonal", "etf"))
        scale: float = setting(20.0, "initial s", low=0, low_open=True)
        fix_scale: bool = setting(False, "official FedNH_fix_scaling: s fixed at 30")
        weighting: str = setting("samples", "samples (n_k) | uniform (official)", choices=("samples", "uniform"))

    sends = FedAvg.sends + (
        sent("nh.proto", "class-means", "per-class prototypes: its count times the normalised mean of the "
             "normalised features of each class, [C, d]"),
        sent("nh.count", "class-counts", "the client's class counts, [C]"),
    )

    def new_model(self) -> Model:
        base = super().new_model()
        s, d, C = self.spec, base.feature_dim, self.spec.num_classes
        W = init_classifier(self.p.init, d, C, seed=derive_seed(s.seed, PROTO_INIT)).float().to(s.device)
        scale = 30.0 if self.p.fix_scale else self.p.scale
        return Model(base.backbone, PrototypeHead(F.normalize(W, dim=1), scale, not self.p.fix_scale), d, C)

    # ------------------------------------------------------------------ server
    def aggregate(self, state, rnd, replies):
        w = state.weights
        keys = [k for k in w if k != "head.prototype"]
        weight = (lambda r: 1.0) if self.p.weighting == "uniform" else (lambda r: r.meta["num_examples"])
        state.weights = {**w, **weighted_average([(r.arrays, weight(r)) for _, r in replies], keys)}
        scaled = sum(r.arrays["nh.proto"] for _, r in replies)
        counts = sum(r.arrays["nh.count"] for _, r in replies)
        state.weights["head.prototype"] = smooth_prototypes(w["head.prototype"], scaled, counts, self.p.rho)
        return state

    # ------------------------------------------------------------------ client
    def local_train(self, payload, cstate, data, gen):
        net = self.net
        load_weights(net, payload.arrays)
        stats = train_local(net, data, self.spec, gen, lr=payload.lr)
        f, y = local_features(net.backbone, data, 1024)
        proto, counts = class_prototypes(f, y, self.spec.num_classes)
        mine = weights_of(net)
        arrays = {**mine, "nh.proto": proto, "nh.count": counts}
        cstate = {**cstate, "local": {k: v.clone() for k, v in mine.items()}}
        return Message(arrays, {"num_examples": len(data), **stats}), cstate

    def personal_model(self, payload, cstate, data):
        return {"local": personal_predictor(self, payload.arrays, cstate.get("local", {}))}

    def global_model(self, state):
        m = self.eval_model(state.weights)
        return Predictor(m.backbone, m.head, shared_backbone=True)
