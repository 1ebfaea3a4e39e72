"""DFL-FS (Chen, Wu & Ji, 2024): "Decoupled Federated Learning on Long-Tailed and Non-IID data with Feature
Statistics" -- two stages: clients picked for aggregation by clustering masked feature statistics, then the
classifier re-trained on features regenerated from global feature statistics.

Stage 1, round t (FedAvg's local training, every sampled client):
  client k  E local epochs of SGD on CE from w; then its masked feature statistic s_k = m_t * mean of f_w(x) over
            its training data, f_w the *received* backbone (the same for every client of the round) and m_t a
            random 0/1 mask over the feature dimensions keeping ``mask_ratio`` of them, drawn from (seed, t) --
            the same for every client; the server never sees the other dimensions. Reply w_k, s_k.
  server    k-means (k = ``clusters``, k-means++ start from (seed, t), 20 Lloyd steps) on the s_k: clients whose
            data cover the same classes in the same proportions fall together, a client holding rare classes
            apart. From every cluster the client nearest its centre is kept; w <- n_k-weighted mean of the kept
            clients' models. A class held by a few clients (the tail) is no longer outvoted by the many clients
            that repeat the head classes.
Stage 2 (a post-training phase ``regenerate``, every client):
  client k  with the final backbone (frozen, eval mode), for every class c it holds: n_{k,c}, the mean and the
            covariance (1/(n-1)) of its features.
  server    per class the exact pooled mean and covariance of the union (CCVR's Eq. 3-4, "weighted covariance"),
            ``per_class`` features drawn from N(mu_c, Sigma_c) for every class (the same number for every class:
            "resampling"), and a freshly initialised linear classifier trained on them with CE (``epochs``
            epochs, SGD lr ``lr``, no momentum, batch 32).
Inference: GM "retrained" (the final backbone + the re-trained classifier) after stage 2; "fedavg" (the model's own
classifier) always -- per-round evaluations are stage 1's. No personal model.
Communication beyond FedAvg: up d floats per round (the masked statistic); in stage 2, per held class 1 + d + d^2
floats up.

What was read (CZX-Yui/DFL-FS at 8c99bdd: ``main-stage1.py``, ``main-stage2.py``, ``options.py``, ``run.sh``,
README) and what it says:
=========================  ===========================================  ==========================================
                           here (default)                               the released code
=========================  ===========================================  ==========================================
stage 1 selection          the clustering above (``select=cluster``),   plain FedAvg over every sampled client
                           our reading of the README and the abstract:  (``select=all``): the clustering is not in
                           neither the paper's text nor code for it     the released code
                           could be read here
stage 2 covariance         the pooled covariance with outer products    np.dot of two mean vectors is a scalar:
                           mu mu^T                                      the between-client term becomes a constant
                                                                        added to every entry (``official_cov``)
=========================  ===========================================  ==========================================
The released stage 2 also imports a module missing from the repository (``train_frame``, the client statistics);
fedlt computes them as CCVR does. The released stage 1 averages every entry of the state dict, BN's integer
``num_batches_tracked`` too, as sum_k n_k x_k / sum_k n_k, a float that ``load_state_dict`` truncates back to an
integer; fedlt rounds it (``weighted_average``; a counter only BN without momentum reads). Values from the released
code: 1,000 regenerated features per class, 100 epochs, lr 0.01, batch 32, a new classifier. ``clusters`` (default:
half the round's clients, rounded up) and ``mask_ratio`` (0.5) are fedlt's choices. The official local optimiser is
SGD lr 0.1 without momentum, 10 local epochs, batch 32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..core import LocalSteps, Message, Method, ce, derive_seed, load_weights, weighted_average
from ..core.personal import personal_net
from ..core.privacy import class_gaussian_sends, sent
from ..core.retrain import (class_gaussians, draw_class_features, local_features, pooled_gaussian, retrain_head,
                            retrained_head_modes)
from ..decl import setting
from ..registry import METHODS

MASK, KMEANS, SAMPLE, SHUFFLE, HEAD = 0xDF1, 0xDF2, 0xDF3, 0xDF4, 0xDF5  # seed purposes
SELECTS = ("cluster", "all")


def kmeans(x: torch.Tensor, k: int, gen: torch.Generator, steps: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """k-means of the rows of ``x`` [n, d] (k-means++ start from ``gen``, ``steps`` Lloyd iterations): the cluster
    of every row [n] and the centres [k, d]."""
    n = x.shape[0]
    k = min(k, n)
    first = int(torch.randint(n, (), generator=gen, device="cpu"))
    centres = [x[first]]
    for _ in range(1, k):
        d2 = torch.cdist(x, torch.stack(centres)).min(1).values.pow(2).cpu().double()
        if float(d2.sum()) <= 0:  # every row is already a centre
            d2 = torch.ones(n, dtype=torch.float64, device="cpu")
        centres.append(x[int(torch.multinomial(d2, 1, generator=gen))])
    C = torch.stack(centres)
    for _ in range(steps):
        assign = torch.cdist(x, C).argmin(1)
        new = torch.stack([x[assign == j].mean(0) if bool((assign == j).any()) else C[j] for j in range(k)])
        if torch.equal(new, C):
            break
        C = new
    return torch.cdist(x, C).argmin(1), C


def representatives(stats: torch.Tensor, k: int, gen: torch.Generator, sizes=None) -> list[int]:
    """The row indices kept for aggregation: k-means of the statistics into ``k`` clusters, from each the row
    nearest its centre (sorted). Distances within 1e-6 (relative) of the nearest count as ties -- the two
    members of a two-client cluster are equally far from its centre -- and go to the larger client (``sizes``),
    then the lower index, so float rounding cannot flip the choice."""
    assign, C = kmeans(stats, k, gen)
    dist = torch.cdist(stats, C)
    sizes = sizes or [0] * len(stats)
    keep = []
    for j in range(C.shape[0]):
        members = torch.nonzero(assign == j).flatten().tolist()
        if members:
            best = min(float(dist[i, j]) for i in members)
            tied = [i for i in members if float(dist[i, j]) <= best + 1e-6 * max(best, 1e-12) + 1e-12]
            keep.append(min(tied, key=lambda i: (-sizes[i], i)))
    return sorted(keep)


@METHODS.register("dfl-fs")
class DFLFS(Method):
    phases = ("regenerate",)

    @dataclass
    class Params:
        select: str = setting("cluster", "cluster: the masked-statistics clustering | all: plain FedAvg (released "
                                         "code)", choices=SELECTS)
        clusters: int | None = setting(None, "k of the k-means", low=1,
                                       none_means="half the round's clients, rounded up", limit=10**4)
        mask_ratio: float = setting(0.5, "share of the feature dimensions a masked statistic keeps", low=0,
                                    low_open=True, high=1)
        per_class: int = setting(1000, "regenerated features per class (stage 2)", low=1, limit=10**6)
        epochs: int = setting(100, "classifier re-training epochs", low=0, limit=10**4)
        lr: float = setting(0.01, "its SGD learning rate (no momentum)", low=0, low_open=True)
        batch_size: int = setting(32, "its batch size", low=1, high=2**31 - 1)
        official_cov: bool = setting(False, "the released code's scalar between-client covariance term")

    @dataclass
    class State(Method.State):
        selected: torch.Tensor | None = None  # the clients whose models the last round averaged (cpu, long)
        retrained: dict[str, torch.Tensor] | None = None  # stage 2's re-trained classifier (None: none yet)

    sends = Method.sends + (
        sent("dflfs.stat", "features", "the masked mean of its features under the received backbone, [d] (the "
             "server's mask keeps mask_ratio of the dimensions; select=cluster)"),
    ) + class_gaussian_sends("dflfs", "regenerate", "the final backbone")

    # ------------------------------------------------------------------ stage 1
    def feature_mask(self, rnd: int) -> torch.Tensor:
        d = self.net.feature_dim
        g = torch.Generator().manual_seed(derive_seed(self.spec.seed, MASK, rnd))
        keep = torch.randperm(d, generator=g, device="cpu")[:max(1, round(self.p.mask_ratio * d))]
        m = torch.zeros(d, device="cpu")
        m[keep] = 1.0
        return m.to(self.spec.device)

    def configure(self, state, rnd, cid):
        arrays = dict(state.weights)
        if self.p.select == "cluster":
            arrays["dflfs.mask"] = self.feature_mask(rnd)
        return Message(arrays)

    def local_steps(self, payload, cstate, data):
        return LocalSteps({k: v for k, v in payload.arrays.items() if not k.startswith("dflfs.")}, ce)

    def local_reply(self, payload, cstate, data, out):
        """The trained model and, when selecting, the masked mean feature of the client's data under the received
        backbone."""
        arrays = dict(out.weights)
        if "dflfs.mask" in payload.arrays:
            net = personal_net(self)  # a client-side copy apart from the working model the executor uses
            load_weights(net, payload.arrays)
            with torch.no_grad():
                h, _ = local_features(net.backbone, data)
            arrays["dflfs.stat"] = payload.arrays["dflfs.mask"] * h.mean(0)
        return Message(arrays, {"num_examples": len(data), **out.stats}), cstate

    def select(self, rnd: int, replies) -> list:
        """The replies kept for aggregation (all, or one per cluster of the masked statistics)."""
        if self.p.select == "all" or len(replies) <= 1:
            return replies
        k = self.p.clusters if self.p.clusters is not None else math.ceil(len(replies) / 2)
        stats = torch.stack([r.arrays["dflfs.stat"] for _, r in replies])
        gen = torch.Generator().manual_seed(derive_seed(self.spec.seed, KMEANS, rnd))
        sizes = [r.meta["num_examples"] for _, r in replies]
        return [replies[i] for i in representatives(stats, int(k), gen, sizes)]

    def aggregate(self, state, rnd, replies):
        kept = self.select(rnd, replies)
        keys = list(state.weights)
        state.weights = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in kept], keys)
        state.selected = torch.tensor([cid for cid, _ in kept], dtype=torch.long, device="cpu")
        return state

    # ------------------------------------------------------------------ stage 2
    def phase_configure(self, phase, state, cid):
        return Message(dict(state.weights))

    def phase_client(self, phase, payload, cstate, data, gen):
        net = self.net
        load_weights(net, payload.arrays)
        return Message(class_gaussians(net.backbone, data, "dflfs"), {"num_examples": len(data)}), cstate

    def phase_aggregate(self, phase, state, replies):
        dev, p = self.spec.device, self.p
        gen = torch.Generator().manual_seed(derive_seed(self.spec.seed, SAMPLE))
        drawn = draw_class_features([r for _, r in replies], "dflfs", p.per_class, gen, dev,
                                    official_pool if p.official_cov else pooled_gaussian)
        if drawn is not None:
            d, C = self.net.feature_dim, self.spec.num_classes
            g = torch.Generator().manual_seed(derive_seed(self.spec.seed, HEAD))
            head = nn.Linear(d, C, device=dev)  # a new classifier, nn.Linear's initial range, seeded
            with torch.no_grad():
                head.weight.copy_((torch.rand(C, d, generator=g, device="cpu") * 2 - 1) / d ** 0.5)
                head.bias.copy_((torch.rand(C, generator=g, device="cpu") * 2 - 1) / d ** 0.5)
            shuffle = torch.Generator().manual_seed(derive_seed(self.spec.seed, SHUFFLE))
            retrain_head(*drawn, head, p.epochs, p.lr, p.batch_size, shuffle)
            state.retrained = {"head.weight": head.weight.detach().clone(), "head.bias": head.bias.detach().clone()}
        return state

    # ------------------------------------------------------------------ inference
    def global_model(self, state):
        return retrained_head_modes(self.eval_model(state.weights), state.retrained, "retrained")


def official_pool(counts: torch.Tensor, means: torch.Tensor, covs: torch.Tensor):
    """The released stage 2's pooling: the pooled within-client covariance plus, in every entry, the scalar
    (sum_k n_k |mu_k|^2 - N |mu|^2) / (N - 1) (``np.dot`` of mean vectors where the outer product belongs)."""
    N = counts.sum()
    mu = (counts[:, None] * means).sum(0) / N
    if N <= 1:
        return mu, torch.zeros_like(covs[0])
    within = ((counts - 1)[:, None, None] * covs).sum(0) / (N - 1)
    between = ((counts * (means * means).sum(1)).sum() - N * (mu * mu).sum()) / (N - 1)
    return mu, within + between
