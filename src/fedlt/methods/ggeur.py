"""GGEUR (Ma, Dai, Huang & Chen, CVPR 2025): "Geometric Knowledge-Guided Localized Global Distribution Alignment
for Federated Learning" -- each client augments its frozen (CLIP) image features along the global geometric
shape of each class (the principal directions and spreads of the class's covariance over all clients), so that
its local data stands in for the global distribution; a classifier on those features trains with FedAvg.

It needs features that do not change while it trains: it runs under ``--finetune head`` on a pre-trained
backbone (``--model hf:<a CLIP model or any vision backbone>``, ``efficientnet-lite0``), whose features each client
computes once, and is refused under ``full`` and ``lora`` (the backbone trains there, so statistics fitted on its
features go stale with every step; from-scratch features say nothing about a class's shape).

Single-domain GGEUR (the label-skew case, the paper's Algorithm 1):
Client k, for every class c it holds (n_{k,c} features z, the frozen backbone's):
    mu_{k,c} = mean z,   Sigma_{k,c} = sum (z - mu)(z - mu)^T / n_{k,c}   (1/n: the official ``calculate_covariance``)
    and sends (c, n_{k,c}, mu_{k,c}, Sigma_{k,c}) -- once, the first round it takes part (the features never change).
Server, per class, over every client whose statistics it holds (N_c = sum_k n_{k,c}; Eq. 4):
    mu_c    = sum_k n_{k,c} mu_{k,c} / N_c
    Sigma_c = sum_k n_{k,c} Sigma_{k,c} / N_c + sum_k n_{k,c} (mu_{k,c} - mu_c)(mu_{k,c} - mu_c)^T / N_c
              (the covariance of the union of the clients' samples of c; kept as running sums, so a client that
              first takes part in a later round adds its share exactly)
    GD_c = {xi_1..xi_d, lambda_1..lambda_d}: the eigenvectors and eigenvalues of Sigma_c (the class's geometric
    shape), sent to the clients with N_c.
Client k, each round, for every class c it holds that has a shape: m = T_c - n_{k,c} new features
(T_c = ``target``, or N_c: the class's global count) around its own samples as anchors -- m <= n: m distinct
anchors drawn at random, one each; m > n: ceil(m / n) around every anchor in order, the first m kept (the
official ``process_class_client``) -- each
    x_new = x + sum_j eps_j s(lambda_j) xi_j,   eps_j ~ N(0, 1),
    s(lambda) = lambda (``scale=paper``, the paper's generation) or sqrt(lambda) (``scale=official``: the released
    code draws N(x, Sigma_c), which spreads by sqrt(lambda))
and trains the classifier (the model's head: linear, or the run's ``--head``) for E local epochs of SGD on CE over
its own features and the new ones; a class it lacks gets none (single-domain Algorithm 1). Server: FedAvg of the
classifiers (n_k-weighted, n_k its own sample count).
Inference: the aggregated classifier on the frozen features. No personalized model.
Round 1 has no shape yet: its clients send their statistics and train on their own features (the official
pipeline fits every client's statistics offline before training; ``stats_round=true`` makes round 1 a
statistics-only round in which nobody trains). Under partial participation a client first taking part later
augments with the shapes of the clients heard so far and sends its statistics that round.
Communication: up, once per client: per held class 1 + d + d^2 floats (and its class id); down, each round, the
model and per class 1 + d + d^2 floats (its eigenvalues, eigenvectors and count) -- for every class the first
time, then for the classes the client holds. The covariances and means are a large disclosure of the client's
features (declared; refused under --dp client and sample, and --secagg, which do not cover them).

Paper vs. official code (WeiDai-David/2025CVPR_GGEUR, ``Single Domian/clip_image_tensor2aggregate_covariance_
matrix.py``, ``cov_matrix_generate_features.py`` and ``FL_MLP.py`` read at 455832a; the paper's generation as
reported from its Algorithm 1, its full text could not be read here)
========================  =======================================  =============================================
                          paper / here (default)                   official code
========================  =======================================  =============================================
spread along xi_j         eps_j lambda_j (``scale=paper``)          ``np.random.multivariate_normal(x, Sigma')``:
                                                                   eps_j sqrt(lambda_j) (``scale=official``),
                                                                   Sigma' with negative eigenvalues set to 0 and
                                                                   1e-6 I added (jitter: not reproduced)
which clients' Sigma      every client holding the class (Eq. 4)   README 4.1: a "guide" set of clients per class
                                                                   chosen by a threshold on their class counts
                                                                   (not reproduced)
target per class          N_c, the class's global count (None),   5000 hard-coded (CIFAR-10's per-class count:
                          or ``target``                            N_c there)
classifier's output       logits; CE (``softmax_output=false``)    ``MyNet``: softmax(fc(x)), then CrossEntropyLoss
                                                                   (a second softmax): ``softmax_output=true``
aggregation               n_k-weighted (FedAvg)                    the uniform mean of the clients' classifiers
                                                                   (``uniform_mean=true``)
local optimiser           the run's                                SGD lr 0.001, momentum 0.9, batch 32, 1 epoch
========================  =======================================  =============================================
Multi-domain GGEUR (Algorithm 2: other domains' class prototypes as further anchors) is not implemented: fedlt's
datasets are single-domain. Directions whose eigenvalue is below 1e-7 of the class's largest are left out of the
sum (their term is below float32's resolution of the rest).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, Method, ce_loss, load_weights, train_local, weights_of
from ..core.privacy import MODEL, sent
from ..core.retrain import class_statistics, local_features
from ..data.federated import ClientData
from ..decl import setting
from ..registry import METHODS

SCALES = ("paper", "official")
TOL = 1e-7  # eigenvalues below TOL x the largest are left out of the generation


def union_moments(count: torch.Tensor, total: torch.Tensor, outer: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and (1/N) covariance of a class's union from its running sums: N, sum_k n_k mu_k [d] and
    sum_k n_k (Sigma_k + mu_k mu_k^T) [d, d]: Eq. 4 (``sum n Sigma / N + sum n (mu_k - mu)(mu_k - mu)^T / N``),
    rewritten as ``S2 / N - mu mu^T``."""
    mu = total / count
    return mu, outer / count - torch.outer(mu, mu)


def geometric_shape(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GD: the eigenvalues (descending, negatives set to 0) and eigenvectors (columns) of a covariance matrix."""
    lam, vec = torch.linalg.eigh((cov + cov.T) / 2)
    return lam.flip(0).clamp_min(0), vec.flip(1)


def generate(anchors: torch.Tensor, lam: torch.Tensor, vec: torch.Tensor, m: int, gen: torch.Generator,
             scale: str = "paper") -> torch.Tensor:
    """``m`` new features around ``anchors`` [n, d] along the shape (``lam`` [d], ``vec`` [d, d]): x + sum_j eps_j
    s(lambda_j) xi_j, s = identity (paper) or sqrt (official); m <= n: m distinct random anchors, one each; m > n:
    ceil(m / n) per anchor in order, the first m."""
    n, d = anchors.shape
    dev = anchors.device
    if m <= 0 or n == 0:
        return anchors.new_zeros((0, d))
    if m <= n:
        idx = torch.randperm(n, generator=gen, device="cpu")[:m]
    else:
        idx = torch.arange(n, device="cpu").repeat_interleave(math.ceil(m / n))[:m]
    keep = lam > TOL * lam.max().clamp_min(torch.finfo(lam.dtype).tiny)
    spread = (lam[keep] if scale == "paper" else lam[keep].sqrt()).to(anchors.dtype)
    eps = torch.randn(m, int(keep.sum()), generator=gen, device="cpu", dtype=anchors.dtype).to(dev)
    return anchors[idx.to(dev)] + (eps * spread) @ vec[:, keep].to(anchors.dtype).T


@METHODS.register("ggeur")
class GGEUR(Method):
    # --finetune full / lora: refused by the run's settings (core.finetune.NEEDS); --dp: its class statistics are
    # not covered (declared below, refused by their category); --secagg: the server reads each client's statistics
    finetune_needs = {"frozen": "the per-class covariances of the clients' features, fitted once"}
    dp_sample = False
    secagg = False

    @dataclass
    class Params:
        target: int | None = setting(None, "features per held class after augmentation (official: 5000)", low=1,
                                     limit=10**7, none_means="the class's global count N_c")
        scale: str = setting("paper", "spread along eigenvector j: paper (eps lambda_j) | official (eps "
                                      "sqrt(lambda_j): N(x, Sigma))", choices=SCALES)
        softmax_output: bool = setting(False, "official: CE on softmax(logits) (MyNet's output), a second softmax")
        stats_round: bool = setting(False, "round 1 only gathers the statistics (nobody trains)")
        uniform_mean: bool = setting(False, "official: the uniform mean of the clients' classifiers "
                                            "(aggregate_client_models); default FedAvg's n_k-weighted mean")

    @dataclass
    class State(Method.State):
        count: torch.Tensor | None = None  # [C] N_c over the clients heard (float64)
        total: torch.Tensor | None = None  # [C, d] sum_k n_k mu_k
        outer: torch.Tensor | None = None  # [C, d, d] sum_k n_k (Sigma_k + mu_k mu_k^T)
        lam: torch.Tensor | None = None  # [C, d] eigenvalues of Sigma_c (descending; 0 for a class nobody holds)
        vec: torch.Tensor | None = None  # [C, d, d] eigenvectors (columns)
        held: torch.Tensor | None = None  # [K, C] bool: the classes of each client heard (a row of 0s: not yet)

    sends = (
        sent(MODEL, "model", "the trained classifier (under --finetune head the model is the head)"),
        sent("num_examples", "size", "the number of training samples", meta=True),
        sent("*", "scalars", "training statistics: the mean loss, the steps", meta=True, numbers_only=True),
        sent("ggeur.classes", "class-counts", "the classes the client holds, [|C_k|] ids (its first round)"),
        sent("ggeur.count", "class-counts", "its number of samples of each held class, [|C_k|] (its first round)"),
        sent("ggeur.mean", "class-means", "its per-class means of the frozen features, [|C_k|, d] (its first "
                                          "round)"),
        sent("ggeur.cov", "class-moments", "its per-class covariances (1/n) of the frozen features, [|C_k|, d, d] "
                                           "(its first round): the class's geometric shape as it sees it"),
    )

    # ------------------------------------------------------------------ server
    def configure(self, state, rnd, cid):
        arrays = dict(state.weights)
        heard = state.held is not None and bool(state.held[cid].any())
        if state.lam is not None and rnd >= 1:  # the shapes: of the client's classes once it was heard, else all
            have = state.count > 0
            classes = torch.nonzero(have & state.held[cid] if heard else have).flatten()
            arrays.update({"ggeur.shape_classes": classes, "ggeur.global_count": state.count[classes].float(),
                           "ggeur.lam": state.lam[classes], "ggeur.vec": state.vec[classes]})
        train = not (self.p.stats_round and rnd == 1)
        return Message(arrays, {"send_stats": not heard and rnd >= 1, "train": train})

    def aggregate(self, state, rnd, replies):
        from ..core.aggregation import weighted_average

        keys = set(state.weights)
        new = weighted_average([({k: v for k, v in r.arrays.items() if k in keys},
                                 1 if self.p.uniform_mean else r.meta["num_examples"]) for _, r in replies])
        state.weights = {**state.weights, **new}
        heard = [(cid, r.arrays) for cid, r in replies if "ggeur.cov" in r.arrays]
        if heard:
            self.pool(state, heard)
        return state

    def pool(self, state, heard):
        """Add the clients' statistics to the running sums and recompute the shapes of the classes they hold."""
        C = self.spec.num_classes
        first = heard[0][1]["ggeur.mean"]
        d, dev = first.shape[1], first.device
        if state.count is None:
            state.count = torch.zeros(C, dtype=torch.float64, device=dev)
            state.total = torch.zeros(C, d, dtype=torch.float64, device=dev)
            state.outer = torch.zeros(C, d, d, dtype=torch.float64, device=dev)
            state.lam = torch.zeros(C, d, dtype=torch.float32, device=dev)
            state.vec = torch.zeros(C, d, d, dtype=torch.float32, device=dev)
            state.held = torch.zeros(self.spec.num_clients, C, dtype=torch.bool, device=dev)
        changed = set()
        for cid, a in heard:
            for i, c in enumerate(a["ggeur.classes"].tolist()):
                n, mu, cov = a["ggeur.count"][i].double(), a["ggeur.mean"][i].double(), a["ggeur.cov"][i].double()
                state.count[c] += n
                state.total[c] += n * mu
                state.outer[c] += n * (cov + torch.outer(mu, mu))
                state.held[cid, c] = True
                changed.add(c)
        for c in sorted(changed):
            _, cov = union_moments(state.count[c], state.total[c], state.outer[c])
            lam, vec = geometric_shape(cov)
            state.lam[c], state.vec[c] = lam.float(), vec.float()

    # ------------------------------------------------------------------ client
    def local_train(self, payload, cstate, data, gen):
        net, p, a = self.net, self.p, payload.arrays
        load_weights(net, a)
        arrays = {}
        with torch.no_grad():
            feats, labels = local_features(net.backbone, data)
        if payload.meta.get("send_stats"):
            held = data.classes.tolist()
            n, mu, cov = class_statistics(feats, labels, held, biased=True)
            arrays.update({"ggeur.classes": torch.as_tensor(held, dtype=torch.long, device=feats.device),
                           "ggeur.count": n.float(), "ggeur.mean": mu.float(), "ggeur.cov": cov.float()})
        stats: dict = {}
        if payload.meta.get("train", True):
            x, y = self.augmented(feats, labels, a, data, gen)
            aug = ClientData(data.client_id, x, y, data.num_classes, data.prep, x[:0], y[:0])
            loss = self.softmax_ce if p.softmax_output else ce_loss
            stats = train_local(net, aug, self.spec, gen, loss, lr=payload.lr)
        return Message({**weights_of(net), **arrays}, {"num_examples": len(data), **stats}), cstate

    def augmented(self, feats, labels, a, data, gen):
        """The client's features with the new ones of every held class that has a shape (labels alike)."""
        xs, ys = [feats], [labels]
        if "ggeur.lam" in a:
            counts = data.counts
            for i, c in enumerate(a["ggeur.shape_classes"].tolist()):
                if counts[c] == 0:
                    continue
                goal = int(a["ggeur.global_count"][i]) if self.p.target is None else self.p.target
                new = generate(feats[labels == c], a["ggeur.lam"][i], a["ggeur.vec"][i], goal - int(counts[c]), gen,
                               self.p.scale)
                xs.append(new)
                ys.append(torch.full((len(new),), c, dtype=labels.dtype, device=labels.device))
        return torch.cat(xs), torch.cat(ys)

    @staticmethod
    def softmax_ce(model, x, y):
        """The official classifier's loss: CrossEntropyLoss on softmax(logits) (``MyNet`` ends in a softmax)."""
        return F.cross_entropy(F.softmax(model(x), dim=1), y)
