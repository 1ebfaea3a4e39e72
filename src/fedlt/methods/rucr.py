"""RUCR: local training towards unified class prototypes, then classifier re-training on mixed-up features.

Representation Unified Classifier Re-training for class-imbalanced federated learning (the method LongTailLib
ports as RUCR).

Two parts: local training pulls every client's features towards *unified* global class prototypes, so clients
learn one representation; after training, the classifier is re-trained on mixed-up features so that every class,
however rare, gets the same number of training points.

Training, client k in round t, receiving w and the unified prototypes m_c with the global class ratio pi
(both from the previous round; absent in round 1):
    L = CE(w; x, y) + lambda * CE(s(x), y),   s_c(x) = cos(f(x), m_c) / t  (0 for classes without a prototype)
                                               + [c = y] * kappa * log pi_y
(the prototype term adds the log global ratio of the true class to its own score: a rarer class must be matched
more closely). Before training, the client sends its per-class feature means under the received model (eval
mode, no augmentation) and its class counts.
Server: FedAvg; m_c = count-weighted mean of the round's client means; pi = the round's summed counts, normalised.
After training, two post-training phases:
``rucr-stats``: every client sends n_{k,c} and normalize(mu_{k,c}) of the final global model's features;
   the server forms m^_c = sum_k n_{k,c} normalize(mu_{k,c}) / sum_k n_{k,c}.
``rucr-crt``: every client builds ``crt_feat_num`` features per class c with a prototype,
       v = lam m^_c + (1 - lam) normalize(f_j),   lam ~ U(left, right) rounded to 0.01, f_j a random own feature,
   re-trains a copy of the global classifier on them (CE, SGD lr ``crt_lr``, ``crt_epochs`` epochs, batch
   ``crt_batch_size``) and sends it; the server averages them (weights n_k): the re-trained classifier.
Inference: GM "retrained" (FedAvg backbone + re-trained classifier) after the phases, "fedavg" always. No personal
model. Communication beyond FedAvg: C d + 2 C floats each way in training; C d + C up and C d down in the phases.

Defaults: the official README's recommended values as LongTailLib's port records them (lambda 0.15, t 1,
kappa 1, 100 features per class, 50 epochs, lr 0.01, batch 256, lam in [0.35, 0.95]).
Differences from the official code (read through LongTailLib's port, ``clientrucr.py`` / ``serverrucr.py``):
- The official round has two exchanges: the clients' means under the *current* model are gathered and the
  prototypes sent back before local training. One exchange per round here, so the prototypes a client uses are
  one round old (the previous round's clients, the previous model).
- The official re-training runs in each of the last ``crt_ep`` = 20 rounds, on the round's clients, starting from
  each one's locally trained classifier and with features of the round's starting model; the re-trained head is
  only evaluated (training continues from FedAvg's), so only the last round's survives. Here it runs once, on
  every client, after the last round, from the final global model: the post-training phases above.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, ce_loss, load_weights, train_local, weighted_average, weights_of
from ..core.privacy import sent
from ..core.retrain import local_features, retrain_head, retrained_head_modes
from ..decl import setting
from ..errors import ConfigError
from ..registry import METHODS
from .fedavg import FedAvg

HEAD = ("head.weight", "head.bias")


def class_means(feats: torch.Tensor, labels: torch.Tensor, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class means [C, d] (zero rows for absent classes) and counts [C]."""
    onehot = F.one_hot(labels, C).to(feats.dtype)
    counts = onehot.sum(0)
    return onehot.T @ feats / counts.clamp_min(1)[:, None], counts


def prototype_loss(f: torch.Tensor, y: torch.Tensor, protos: torch.Tensor, known: torch.Tensor,
                   ratio: torch.Tensor, t: float, kappa: float) -> torch.Tensor:
    """CE over cos(f, m_c)/t (0 for unknown classes) plus kappa * log pi_y on the true class's score."""
    sim = (F.normalize(f, dim=1) @ F.normalize(protos, dim=1).T).masked_fill(~known, 0.0) / t
    shift = kappa * ratio.clamp_min(1e-8).log()[y]
    return F.cross_entropy(sim + F.one_hot(y, sim.shape[1]).to(sim.dtype) * shift[:, None], y)


def mixup_features(means: torch.Tensor, known: torch.Tensor, own: torch.Tensor, per_class: int, left: float,
                   right: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_class`` features per known class c: lam m_c + (1 - lam) normalize(own feature), lam ~ U(left, right)
    rounded to two decimals, the own features drawn by a shuffled cycle."""
    dev = means.device
    classes = known.nonzero().flatten().to("cpu")
    out, labels = [], []
    for c in classes.tolist():
        lam = torch.round((left + (right - left) * torch.rand(per_class, generator=gen, device="cpu")) * 100) / 100
        pick = torch.randperm(len(own), generator=gen, device="cpu").repeat(per_class // len(own) + 1)[:per_class]
        lam, pick = lam.to(dev)[:, None], pick.to(dev)
        out.append(lam * means[c] + (1 - lam) * F.normalize(own[pick], dim=1))
        labels.append(torch.full((per_class,), c, dtype=torch.long, device=dev))
    return torch.cat(out), torch.cat(labels)


@METHODS.register("rucr")
class RUCR(FedAvg):
    phases = ("rucr-stats", "rucr-crt")

    @dataclass
    class Params:
        lam: float = setting(0.15, "weight of the prototype term (official feat_loss_arg)", low=0)
        t: float = setting(1.0, "its temperature", low=0, low_open=True)
        kappa: float = setting(1.0, "scale of the log global ratio (official times_arg)", low=0)
        crt_feat_num: int = setting(100, "mixed-up features per class", low=1, limit=10**6)
        crt_epochs: int = setting(50, "official local_bal_ep", low=0, limit=10**5)
        crt_lr: float = setting(0.01, "official lr_cls_balance (SGD, no momentum)", low=0, low_open=True)
        crt_batch_size: int = setting(256, "batch size of the classifier re-training", low=1, high=2**31 - 1)
        left: float = setting(0.35, "lam ~ U(left, right) (official uniform_left / uniform_right)", low=0, high=1)
        right: float = setting(0.95, "the upper end of that uniform, >= left", low=0, high=1)

    @dataclass
    class State(FedAvg.State):
        rucr: dict[str, torch.Tensor] | None = None  # last round's global protos / known / ratio (None: no round yet)
        norm_means: torch.Tensor | None = None  # rucr-stats phase: normalised global class means
        norm_known: torch.Tensor | None = None  # rucr-stats phase: classes some client holds
        retrained: dict[str, torch.Tensor] | None = None  # rucr-crt phase: the averaged re-trained head

    sends = FedAvg.sends + (
        sent("rucr.mean", "class-means", "its per-class feature means under the received model, [C, d]"),
        sent("rucr.count", "class-counts", "the client's class counts, [C]"),
        sent("rucr.mean", "class-means", "its normalised per-class feature means under the final model, [C, d]",
             when="rucr-stats"),
        sent("rucr.count", "class-counts", "the client's class counts, [C]", when="rucr-stats"),
        sent("num_examples", "size", "the number of training samples", meta=True, when="rucr-stats"),
        sent("head.*", "model-part", "the classifier it re-trained on mixed-up features of its own samples",
             when="rucr-crt"),
        sent("num_examples", "size", "the number of training samples", meta=True, when="rucr-crt"),
    )

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        if self.p.left > self.p.right:
            raise ConfigError(f"rucr: left {self.p.left:g} must be <= right {self.p.right:g}")

    # ------------------------------------------------------------------ training
    def configure(self, state, rnd, cid):
        extra = {f"rucr.{k}": v.clone() for k, v in state.rucr.items()} if state.rucr is not None else {}
        return Message({**state.weights, **extra})

    def eval_payload(self, state, cid):
        return Message(dict(state.weights))

    def aggregate(self, state, rnd, replies):
        keys = list(state.weights)
        state.weights = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies], keys)
        counts = sum(r.arrays["rucr.count"] for _, r in replies)
        sums = sum(r.arrays["rucr.mean"] * r.arrays["rucr.count"][:, None] for _, r in replies)
        state.rucr = {"protos": sums / counts.clamp_min(1)[:, None], "known": counts > 0,
                      "ratio": counts / counts.sum()}
        return state

    def local_train(self, payload, cstate, data, gen):
        net, p, C = self.net, self.p, self.spec.num_classes
        load_weights(net, {k: v for k, v in payload.arrays.items() if not k.startswith("rucr.")})
        f, y = local_features(net.backbone, data, 1024)
        means, counts = class_means(f, y, C)
        loss_fn = ce_loss
        if "rucr.protos" in payload.arrays:
            a = payload.arrays
            protos, known, ratio = a["rucr.protos"], a["rucr.known"], a["rucr.ratio"]

            def unified(model, x, yb):
                h = model.backbone(x)
                return F.cross_entropy(model.head(h), yb) + p.lam * prototype_loss(h, yb, protos, known, ratio,
                                                                                   p.t, p.kappa)
            loss_fn = unified
        stats = train_local(net, data, self.spec, gen, loss_fn, lr=payload.lr)
        arrays = {**weights_of(net), "rucr.mean": means, "rucr.count": counts}
        return Message(arrays, {"num_examples": len(data), **stats}), cstate

    # ------------------------------------------------------------------ classifier re-training
    def phase_configure(self, phase, state, cid):
        w = dict(state.weights)
        if phase == "rucr-crt":
            w.update({"rucr.norm_means": state.norm_means.clone(), "rucr.known": state.norm_known.clone()})
        return Message(w)

    def phase_client(self, phase, payload, cstate, data, gen):
        net, p = self.net, self.p
        load_weights(net, {k: v for k, v in payload.arrays.items() if not k.startswith("rucr.")})
        f, y = local_features(net.backbone, data, 1024)
        if phase == "rucr-stats":
            means, counts = class_means(f, y, self.spec.num_classes)
            return Message({"rucr.mean": F.normalize(means, dim=1), "rucr.count": counts},
                           {"num_examples": len(data)}), cstate
        v, vy = mixup_features(payload.arrays["rucr.norm_means"], payload.arrays["rucr.known"], f,
                               p.crt_feat_num, p.left, p.right, gen)
        retrain_head(v, vy, net.head, p.crt_epochs, p.crt_lr, p.crt_batch_size, gen)  # from the global head
        return Message(weights_of(net, HEAD), {"num_examples": len(data)}), cstate

    def phase_aggregate(self, phase, state, replies):
        if phase == "rucr-stats":
            counts = sum(r.arrays["rucr.count"] for _, r in replies)
            sums = sum(r.arrays["rucr.mean"] * r.arrays["rucr.count"][:, None] for _, r in replies)
            state.norm_means, state.norm_known = sums / counts.clamp_min(1)[:, None], counts > 0
        else:
            state.retrained = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies])
        return state

    # ------------------------------------------------------------------ inference
    def global_model(self, state):
        return retrained_head_modes(self.eval_model(state.weights), state.retrained, "retrained")
