"""MOON (Li, He & Song, CVPR 2021): a contrastive loss between local, global and previous-local representations.

"Model-Contrastive Federated Learning".

Model: base encoder -> projection head (Linear(d, d), ReLU, Linear(d, out_dim)) -> output layer. The projected
vector z is the representation the contrast uses, and the output layer classifies it (the paper's three parts;
here the backbone is the run's model's backbone followed by the projection head, and the head maps out_dim to C).
Client k in round t, receiving the global model w^t, holding its previous local model w_k^{t-1}:
    z = R_w(x), z_glob = R_{w^t}(x), z_prev = R_{w_k^{t-1}}(x)       (w^t and w_k^{t-1} frozen, eval mode)
    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )
    L = CE(w; x, y) + mu * mean_batch(l_con)                              (sim: cosine similarity)
E local epochs of SGD on L from w^t; then w_k^{t-1} <- the new local model (kept in the client state, never
sent; a client that never trained uses the common initial model, as the official code's initial pool).
Server: FedAvg (sample-weighted mean). Inference: the global model; no personal model. Messages: FedAvg's.

Defaults: mu = 5 (the paper's best for CIFAR-10; 1 for CIFAR-100 and Tiny-ImageNet), tau = 0.5, out_dim 256,
one previous model (the paper's default model buffer size).
Paper vs. official code (QinbinLi/MOON) and ports:
- ``projection="none"`` drops the projection head and contrasts the backbone's features directly (PFLlib and
  LongTailLib's port do this); default ``mlp`` as the paper and the official code.
- The official teachers are run as they are (train mode: BatchNorm would use batch statistics); here eval mode
  (no difference for models without BatchNorm or dropout).

Learning rate. With mu = 5 the contrastive term dominates the gradient. At the fmnist-lt protocol's lr 0.05,
momentum 0.9 training went well until round 33 (GM 81.8 % at round 30) and then diverged (NaN from round 34, GM
10 %). The official code trains with lr 0.01 (momentum 0.9): ``--lr 0.01``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core import Message, derive_seed
from ..core.personal import initial_weights
from ..core.steps import LocalSteps, strip
from ..decl import setting
from ..models import Model
from ..registry import METHODS
from .fedavg import FedAvg

PROJ_INIT = 0x300  # seed purpose of the projection head's initialisation


class Projected(nn.Module):
    """``x -> proj(body(x))`` with ``proj`` = Linear(d, d), ReLU, Linear(d, out_dim): MOON's representation."""

    def __init__(self, body: nn.Module, d: int, out_dim: int, device):
        super().__init__()
        self.body = body
        # drawn on the CPU generator (seeded by the caller), then moved: the same head on every device
        self.proj = nn.Sequential(nn.Linear(d, d), nn.ReLU(inplace=True), nn.Linear(d, out_dim)).to(device)
        self.feature_dim = out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.body(x))


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """``-log(e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}))`` per sample."""
    pos = F.cosine_similarity(z, z_glob, dim=1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=1) / tau
    return -(pos - torch.logaddexp(pos, neg))


@METHODS.register("moon")
class MOON(FedAvg):
    # --dp sample: a sample's loss reads it, the received model and the client's previous model, itself trained by
    # DP-SGD (core.dpsgd)
    dp_sample = True

    @dataclass
    class Params:
        mu: float = setting(5.0, "weight of the model-contrastive loss", low=0)
        tau: float = setting(0.5, "temperature", low=0, low_open=True)
        projection: str = setting("mlp", "mlp (paper, official: 2-layer projection head) | none (PFLlib / "
                                         "LongTailLib)", choices=("mlp", "none"))
        out_dim: int = setting(256, "output dimension of the projection head", low=1, limit=10**5)

    def new_model(self) -> Model:
        base = super().new_model()
        if self.p.projection == "none":
            return base
        s, d = self.spec, base.feature_dim
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(derive_seed(s.seed, PROJ_INIT))
            backbone = Projected(base.backbone, d, self.p.out_dim, s.device)
            head = nn.Linear(self.p.out_dim, s.num_classes).to(s.device)  # CPU draw, as above
        return Model(backbone, head, self.p.out_dim, s.num_classes)

    def init_client(self, cid, data):
        return {"prev": initial_weights(self)}

    def local_steps(self, payload, cstate, data):
        """E epochs of SGD on CE + mu l_con, the received (global) and the client's previous model frozen."""
        extra = {**{f"glob.{k}": v for k, v in payload.arrays.items()},
                 **{f"prev.{k}": v for k, v in cstate["prev"].items()}}
        return LocalSteps(payload.arrays, self.moon_loss, extra=extra)

    def moon_loss(self, model, x, y, extra):
        """CE + mu l_con of the batch (its mean); the cross-entropy alone reported as the loss."""
        z = model.backbone(x)
        ce = F.cross_entropy(model.head(z), y)
        with torch.no_grad():
            zg = model.frozen(strip(extra, "glob."), "backbone")(x)
            zp = model.frozen(strip(extra, "prev."), "backbone")(x)
        return ce + self.p.mu * model_contrastive_loss(z, zg, zp, self.p.tau).mean(), {"loss": ce}

    def local_reply(self, payload, cstate, data, out):
        meta = {"num_examples": len(data), **out.stats}
        return Message(out.weights, meta), {**cstate, "prev": {k: v.clone() for k, v in out.weights.items()}}
