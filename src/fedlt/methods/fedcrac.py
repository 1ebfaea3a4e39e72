"""FedCRAC (Li et al., IEEE TMC 2024/25): "FedCRAC: Improving Federated Classification Performance on Long-Tailed
Data via Classifier Representation Adjustment and Calibration" -- a Class Similarity-Aware Margin in the clients'
softmax, and the aggregated classifier calibrated every round by self-distillation on pseudo representations.

Model: the run's backbone f and a bias-free linear classifier W (rows w_c).
Client k, round t, receiving w and the margin matrix M [C, C] (mu everywhere in round 1):
  E local epochs of SGD on CE(s (W f(x) + M[y] (1 - e_y)), y)        Class Similarity-Aware Margin (s = 5):
      every other class j gets M[y, j] added to its logit, so the classes most similar to y are pushed furthest
  then, with the trained model, per class c with n_{k,c} >= 2 samples: the mean mu_{k,c} and the per-dimension
  variance v_{k,c} of its features; reply w_k, n_k (class counts), mu_k, v_k.
Server:
  1. w <- FedAvg (n_k-weighted).
  2. Global class statistics, weighted by the class counts: mu_c = sum_k n_{k,c} mu_{k,c} / sum_k n_{k,c}, v_c
     likewise (over the clients that sent statistics of c; a class nobody sent keeps its last values).
  3. M_{ij} = mu_margin * cos(mu_i, mu_j).
  4. Self Distillation Classifier Calibration: N_c = sum_k n_{k,c} pseudo representations of class c drawn from
     N(mu_c, diag v_c); the teacher is the aggregated W (frozen; ``calib_start=previous``: the W broadcast this
     round), the student starts from it; ``crt_epochs`` full-batch steps of SGD (lr ``crt_lr``, by default the
     round's local lr, momentum 0.9, Nesterov, no weight decay) on
        (1 - a) CE(o, y) + a T^2 KL(softmax(o_T / T) || softmax(o / T))      (a = 0.5, T = 0.5)
     where o and o_T are the student's and the teacher's margin logits s (W h + M[y] (1 - e_y)).
  5. The calibrated W replaces the aggregated one: it is the broadcast and the inference classifier.
Inference: W f(x) (the margin is a training device). No personal model.
Communication beyond FedAvg: up 2 C d + 2 C floats (statistics, counts and which classes have them), down C^2 (M).

Paper vs. official code (xujli/fedcrac ``methods/fedcrac.py``, ``models/MarginLinear.py`` SoftmaxMargin,
``config.py`` at e0c4684; some modules it imports are not in the repository, so it was read, not run)
=========================  ===========================================  ==========================================
                           here (default)                               official code
=========================  ===========================================  ==========================================
KL term of the calibration the batch mean of the KL divergence           ``F.kl_div`` with its default reduction,
                           (``kd_reduction=batchmean``)                 the mean over batch x classes (C times
                                                                        smaller; ``kd_reduction=mean``)
FedAvg weights             n_k                                          batches x batch size
statistics of a class      classes with >= 2 samples; others not sent   the client object's arrays, shared by the
                                                                        clients a process trains in turn: a class
                                                                        with < 2 samples sends whatever an earlier
                                                                        client left there
features of the statistics eval mode (BN's running statistics), no      train mode, as local training left the
                           augmentation                                 model (BN normalises each batch by its own
                                                                        statistics and updates its running ones),
                                                                        the training loader; not reproduced
calibration start          student and teacher start from the           ``retrain()`` runs before the aggregate is
                           aggregated classifier                        loaded: both start from the previous server
                           (``calib_start=aggregate``)                  classifier, the one broadcast this round,
                                                                        and the clients' averaged classifier is
                                                                        discarded (``calib_start=previous``); the
                                                                        backbone is the aggregate either way
calibration loss per step  one full-batch mean (``calib_chunks=full``)  each step sums, over the chunks between
                                                                        the bounds range(0, N, N // 4) + [N], the
                                                                        chunk's mean loss / 4 (gradients
                                                                        accumulated chunk by chunk, then one
                                                                        optimiser step): a sample weighs
                                                                        1 / (4 m), m its chunk's size, not 1 / N.
                                                                        For N >= 12: four chunks of N // 4 and,
                                                                        when N % 4 = r > 0, a fifth of the last r
                                                                        samples (the last class's: the pseudo
                                                                        representations are ordered by class),
                                                                        each weighing 1 / (4 r)
                                                                        (``calib_chunks=official``; for N < 4,
                                                                        where N // 4 = 0 stops the official code,
                                                                        chunks of one sample)
calibration weight decay   none (``crt_weight_decay=0``)                ``SGD(..., weight_decay=args.wd)``, the
                                                                        run's weight decay, as local training
                                                                        has it (``crt_weight_decay=none``; 0 by
                                                                        the official default, where the two agree)
=========================  ===========================================  ==========================================
The paper's full text could not be read here (its abstract: a Class Similarity-Aware Margin matrix "to enlarge
class representation discrepancy" and a Self Distillation Classifier Calibration "with the assistance of
generated pseudo representation samples"); the values (mu 1, s 5, a 0.5, T 0.5, 300 calibration steps at the
run's lr, momentum 0.9 Nesterov) are the official code's. The official logits subtract each row's minimum before
the margin; CE does not change under that shift (value and gradient), so it is left out. The official local
optimiser is SGD lr 0.01 without momentum, batch 50, 3 local epochs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core import LocalSteps, Message, Method, derive_seed, load_weights, weighted_average
from ..core.personal import personal_net
from ..core.privacy import sent
from ..core.retrain import local_features
from ..decl import setting
from ..errors import ConfigError
from ..registry import METHODS

PSEUDO = 0xC4AC  # seed purpose: the pseudo representations of a round
REDUCTIONS = ("batchmean", "mean")
CALIB_STARTS = ("aggregate", "previous")
CALIB_CHUNKS = ("full", "official")


def margin_logits(h: torch.Tensor, weight: torch.Tensor, margin: torch.Tensor, y: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """s (W h + M[y] (1 - e_y)): every class but the label gets the margin M[y, j] added."""
    z = h @ weight.T
    others = torch.ones_like(z).scatter(1, y[:, None], 0.0)  # 1 - e_y (F.one_hot cannot run under vmap)
    return scale * (z + margin[y] * others)


def similarity_margin(means: torch.Tensor, mu: float) -> torch.Tensor:
    """M = mu * cos(mu_i, mu_j) for class means [C, d]."""
    return mu * F.cosine_similarity(means[:, None, :], means[None, :, :], dim=2)


def official_chunks(n: int) -> list[int]:
    """The official calibration's chunk bounds over ``n`` samples: range(0, n, n // 4) + [n], chunks of n // 4
    and a shorter last one (n >= 12: four chunks, and a fifth of the last n % 4 samples when n % 4 > 0; n < 4,
    where the official code fails: chunks of one sample)."""
    return list(range(0, n, max(1, n // 4))) + [n]


def calibrate(weight: torch.Tensor, margin: torch.Tensor, feats: torch.Tensor, labels: torch.Tensor, steps: int,
              lr: float, scale: float, alpha: float = 0.5, T: float = 0.5, reduction: str = "batchmean",
              chunks: str = "full", weight_decay: float = 0.0) -> torch.Tensor:
    """Self-distillation calibration: the classifier ``weight`` [C, d] trained for ``steps`` full-batch steps
    (SGD, momentum 0.9, Nesterov, ``weight_decay``: 0 the paper's, the run's the official code's) on
    (1 - alpha) CE + alpha T^2 KL towards the frozen ``weight`` itself, both on margin logits of the pseudo
    representations. ``chunks``: ``full``, the loss is the mean over all of them; ``official``, the sum over
    :func:`official_chunks` of each chunk's mean, divided by 4 (the official code accumulates the chunks'
    gradients and takes one step: the same step)."""
    if chunks not in CALIB_CHUNKS:
        raise ConfigError(f"fedcrac calibration chunks must be one of {', '.join(CALIB_CHUNKS)}, not {chunks!r}")
    W = weight.detach().clone().requires_grad_(True)
    opt = torch.optim.SGD([W], lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay)
    with torch.no_grad():
        teacher = F.softmax(margin_logits(feats, weight, margin, labels, scale) / T, 1)
    bounds = official_chunks(feats.shape[0])
    for _ in range(steps):
        out = margin_logits(feats, W, margin, labels, scale)
        if chunks == "full":
            kd = F.kl_div(F.log_softmax(out / T, 1), teacher, reduction=reduction)
            loss = alpha * T * T * kd + (1 - alpha) * F.cross_entropy(out, labels)
        else:
            loss = 0.0
            for a, b in zip(bounds, bounds[1:]):
                kd = F.kl_div(F.log_softmax(out[a:b] / T, 1), teacher[a:b], reduction=reduction)
                loss = loss + (alpha * T * T * kd + (1 - alpha) * F.cross_entropy(out[a:b], labels[a:b])) / 4
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return W.detach()


@METHODS.register("fedcrac")
class FedCRAC(Method):
    @dataclass
    class Params:
        mu: float = setting(1.0, "scale of the class-similarity margin matrix (official --mu)", low=0)
        scale: float = setting(5.0, "s, the logit scale of the margin softmax (official SoftmaxMargin scale_factor)",
                               low=0, low_open=True)
        crt_epochs: int = setting(300, "calibration steps per round (official --crt_epoch; full batch)", low=0,
                                  limit=10**5)
        crt_lr: float | None = setting(None, "calibration lr", low=0, low_open=True,
                                       none_means="the round's local lr (official: --lr)")
        kd_alpha: float = setting(0.5, "weight of the self-distillation term", low=0)
        kd_T: float = setting(0.5, "its temperature", low=0, low_open=True)
        kd_reduction: str = setting("batchmean", "batchmean | mean (official F.kl_div default: over batch x classes)",
                                    choices=REDUCTIONS)
        calib_start: str = setting("aggregate", "the calibration's student and teacher start from: aggregate (the "
                                   "clients' averaged classifier) | previous (official: the classifier broadcast "
                                   "this round; the averaged one is discarded)", choices=CALIB_STARTS)
        calib_chunks: str = setting("full", "calibration loss per step: full (one full-batch mean) | official (the "
                                    "sum over the chunks range(0, N, N // 4) + [N] of each chunk's mean, / 4)",
                                    choices=CALIB_CHUNKS)
        crt_weight_decay: float | None = setting(0.0, "weight decay of the calibration's SGD (none: the run's "
                                                 "--weight-decay, as the official retrain()'s args.wd)", low=0,
                                                 none_means="the run's --weight-decay (official: --wd)")

    @dataclass
    class State(Method.State):
        margin: torch.Tensor | None = None  # [C, C] class-similarity margins sent to the clients
        mean: torch.Tensor | None = None  # [C, d] global per-class feature means (a class no client had: kept)
        var: torch.Tensor | None = None  # [C, d] global per-class feature variances (likewise)

    sends = Method.sends + (
        sent("fedcrac.count", "class-counts", "the client's class counts, [C]"),
        sent("fedcrac.stat", "class-counts", "which classes it sends statistics of (those with at least 2 samples), "
             "[C] bool"),
        sent("fedcrac.mean", "class-means", "its per-class feature means under the trained model, [C, d]"),
        sent("fedcrac.var", "class-moments", "its per-class, per-dimension feature variances, [C, d]"),
    )

    def new_model(self):
        m = super().new_model()
        head = nn.Linear(m.feature_dim, m.num_classes, bias=False, device=self.spec.device)
        with torch.no_grad():
            head.weight.copy_(m.head.weight)
        m.head = head
        return m

    # ------------------------------------------------------------------ server
    def init_server(self):
        C, d, dev = self.spec.num_classes, self.net.feature_dim, self.spec.device
        state = super().init_server()
        state.margin = torch.full((C, C), self.p.mu, device=dev)
        state.mean, state.var = torch.zeros(C, d, device=dev), torch.zeros(C, d, device=dev)
        return state

    def configure(self, state, rnd, cid):
        return Message({**state.weights, "fedcrac.margin": state.margin})

    def aggregate(self, state, rnd, replies):
        p = self.p
        keys = list(state.weights)
        previous = state.weights["head.weight"]  # the classifier broadcast this round
        state.weights = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies], keys)
        a = [r.arrays for _, r in replies]
        n = torch.stack([x["fedcrac.count"] for x in a])  # [K, C]
        w = n * torch.stack([x["fedcrac.stat"] for x in a]).to(n.dtype)  # weights of the clients' statistics
        total = w.sum(0)
        has = total > 0

        def pooled(key, old):  # the clients' statistic, weighted; a class that no client has keeps its old value
            s = (w[..., None] * torch.stack([x[f"fedcrac.{key}"] for x in a])).sum(0) / total.clamp_min(1)[:, None]
            return torch.where(has[:, None], s, old)
        state.mean, state.var = pooled("mean", state.mean), pooled("var", state.var)
        state.margin = similarity_margin(state.mean, p.mu)
        counts = n.sum(0).round().long().tolist()
        gen = torch.Generator().manual_seed(derive_seed(self.spec.seed, PSEUDO, rnd))
        feats, labels = [], []
        for c, k in enumerate(counts):
            if k > 0:
                eps = torch.randn(k, state.mean.shape[1], generator=gen, device="cpu").to(self.spec.device)
                feats.append(state.mean[c] + eps * state.var[c].clamp_min(0).sqrt())
                labels.append(torch.full((k,), c, dtype=torch.long, device=self.spec.device))
        head = previous.clone() if p.calib_start == "previous" else state.weights["head.weight"]
        if feats:
            with torch.enable_grad():
                head = calibrate(
                    head, state.margin, torch.cat(feats), torch.cat(labels),
                    p.crt_epochs, self.spec.lr_at(rnd) if p.crt_lr is None else float(p.crt_lr), p.scale, p.kd_alpha, p.kd_T,
                    p.kd_reduction, p.calib_chunks,
                    self.spec.weight_decay if p.crt_weight_decay is None else float(p.crt_weight_decay))
        state.weights["head.weight"] = head
        return state

    # ------------------------------------------------------------------ client
    def local_steps(self, payload, cstate, data):
        weights = {k: v for k, v in payload.arrays.items() if k != "fedcrac.margin"}
        return LocalSteps(weights, self.step_loss, extra={"margin": payload.arrays["fedcrac.margin"]})

    def step_loss(self, model, x, y, extra):
        return F.cross_entropy(margin_logits(model.backbone(x), model.params["head.weight"], extra["margin"], y,
                                             self.p.scale), y)

    def local_reply(self, payload, cstate, data, out):
        """The trained model, the class counts, and the per-class feature means and variances of the classes with
        at least two samples (features of the trained model, eval mode, no augmentation)."""
        net = personal_net(self)  # a client-side copy apart from the working model the executor uses
        load_weights(net, out.weights)
        with torch.no_grad():
            h, y = local_features(net.backbone, data)
        C, dev = self.spec.num_classes, self.spec.device
        onehot = F.one_hot(y, C).to(h.dtype)  # [N, C]
        n = onehot.sum(0)
        mean = onehot.T @ h / n.clamp_min(1)[:, None]
        var = onehot.T @ (h - mean[y]).pow(2) / (n - 1).clamp_min(1)[:, None]
        arrays = {**out.weights, "fedcrac.count": torch.as_tensor(data.counts, dtype=torch.float32, device=dev),
                  "fedcrac.mean": mean, "fedcrac.var": var, "fedcrac.stat": n >= 2}
        return Message(arrays, {"num_examples": len(data), **out.stats}), cstate
