"""GBME (Zeng et al., ICCV 2023): "Global Balanced Experts for Federated Long-Tailed Learning" -- a balanced
global objective without the clients' label distributions: a proxy of the global class prior, read from the
clients' classifier updates, re-balances every client's loss and groups the clients to train a multi-expert model.

Model: the run's backbone f and E classifier experts (cosine heads z_e = s cos(f(x), w_{e,c}), s = 30; the
prediction is their mean, (1/E) sum_e z_e).
Proxy (the client's first participation, k not yet known): plain CE on the mean logits from the received w; the
  server reads the classifier update Delta = W_k - W (averaged over the experts) as the client's estimated class
  counts: q_{k,c} = max(sum_j Delta_{c,j}, 1e-5), normalised, times n_k, rounded. The global proxy prior is
  P_c = max(sum_k q_{k,c}, 5) over the clients known so far; it is shared with every client.
Joint rounds (t <= expert_start x T): E local epochs of SGD on sum_e CE(z_e + log P / sum P, y) (balanced softmax
  with the global proxy prior, every expert).
Expert rounds (t > expert_start x T): the N known clients ranked by sum_c P_c q_{k,c} / n_k (head-heavy first)
  and cut into E groups as the official slices [floor(N e / E), floor(N (e + 1) / E)) (an uneven split's extra
  clients go to the later, tail-heavy groups); client k trains, with probability ``beta``, the expert of its
  group, otherwise one drawn uniformly (seeded by run, round and client): x CE(z_e + log prior, y) for that expert
  e alone (the other experts are not in the loss), x = E (``expert_factor`` unset) or the official 5.
Server: FedAvg (n_k-weighted) of the backbone; each expert's weights averaged over the clients that trained it
  (kept when none did).
Inference: f and the mean of the experts (the prior is not added: the balanced prediction). No personal model.
Communication: FedAvg's (the model has E heads).

Paper vs. official code (Spinozaaa/Federated-Long-tailed-Learning, ``fedml_api/clsimb_fedavg/fedavg_api.py``,
``multi_experts/loss.py`` FDGELoss and the expert ResNet, at 9944e7a; ``--method ldae_train_exp_esti_global``)
==========================  ==========================================  =========================================
                            here (default)                              official code
==========================  ==========================================  =========================================
the experts                 E heads on the run's backbone (fedlt's      E copies of the last two ResNet stages
                            models are backbone + one head)             and their cosine heads, sharing the stem
proxy estimation            from each client's first training (plain    a separate pass before training: every
                            CE, kept as training)                       client trains 1 epoch of CE from the
                                                                        initial model (that pass is discarded)
expert rounds               the engine's sampled clients, each training E sequential sub-rounds, each with m
                            one expert (beta: the share trained by      clients: beta m of the expert's group and
                            the expert of the client's group); one      (1 - beta) m drawn from all clients,
                            aggregation per round, so a round costs     aggregated before the next expert trains
                            FedAvg's                                    (E x the compute of a round)
cosine heads                ``normed_heads=true`` (config use_norm,     ``normed_heads=false``: linear heads
                            s = 30)                                     (the configuration's other choice)
initial head rows           nn.Linear's range U(-1/sqrt d, 1/sqrt d),   NormedLinear: U(-1, 1) renormed to unit
                            as every fedlt head (``head_init=linear``)  rows (``head_init=unit``)
expert-round loss factor    E, the model's expert count                 FDGELoss multiplies by ``num_experts``
                            (``expert_factor`` unset)                   of its JSON configuration, 5, whatever
                                                                        the model's count (``expert_factor=5``:
                                                                        5/3 the gradient at E = 3)
==========================  ==========================================  =========================================
The engine, not the method, picks a round's clients (every method of a comparison trains the same clients in the
same rounds); that forces the first and third rows. The paper's full text could not be read here (its abstract:
the proxy "derived from the accumulated gradients uploaded by the clients after local training ... shared by all
clients as the class prior for re-balance training ... guide the client grouping to train a multi-expert
model"); E = 3, beta 0.5 and the switch at 3/5 of the rounds are the official code's defaults. GBME-p (noise on
the proxy) is not implemented. Two defects of the official code are left out, not offered as options: its
estimator writes the estimated classifier into the global expert 0 in place (the global model's first expert
leaves the estimation pass changed), and for the first 60 % of the rounds its server does no FedAvg of the
backbone (the clients' updates are discarded until the expert phase); fedlt averages every round.

Small features: the cosine head's gradient with respect to a feature h is s / |h| times a vector of norm at most
2, so on small features (smallcnn on 8x8 digits) s = 30 can overshoot in the first local epoch and collapse the
global model to one class (the run warns in one line); ``--set scale=10`` or ``--lr 0.01`` trains there. What was
measured: docs/fmnist-lt-new-methods.md, "GBME's cosine heads on small features". The official local optimiser is
SGD lr 0.5 / momentum 0.9 / weight decay 5e-4, batch 64, 2 epochs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core import LocalSteps, Message, Method, derive_seed, weighted_average
from ..core.losses import log_prior
from ..core.privacy import sent
from ..decl import setting
from ..registry import METHODS

ROUTE, HEADS = 0x6B3E, 0x6B3F  # seed purposes: the expert a client outside its group trains; the heads
ESTIMATE, JOINT, EXPERT = "estimate", "joint", "expert"
HEAD_INITS = ("linear", "unit")


class ExpertHeads(nn.Module):
    """E classifiers on the same features: ``experts(h)`` [E, B, C]; ``forward(h)`` their mean [B, C]. Cosine
    heads (``scale`` cos(h, w_{e,c})) or linear ones (w_e h + b_e). Initial rows: nn.Linear's range, or (``unit``)
    the official NormedLinear's U(-1, 1) renormed to unit rows."""

    def __init__(self, dim: int, num_classes: int, experts: int, normed: bool = True, scale: float = 30.0,
                 gen: torch.Generator | None = None, unit: bool = False):
        super().__init__()
        self.normed, self.scale = normed, scale
        bound = 1 / math.sqrt(dim)  # nn.Linear's initial range, for every expert
        w = torch.rand(experts, num_classes, dim, generator=gen, device="cpu") * 2 - 1
        self.weight = nn.Parameter(F.normalize(w, dim=2) if unit else w * bound)
        b = torch.rand(experts, num_classes, generator=gen, device="cpu") * 2 - 1
        self.bias = None if normed else nn.Parameter(b * bound)

    def experts(self, h: torch.Tensor) -> torch.Tensor:
        return expert_logits(h, self.weight, self.bias, self.normed, self.scale)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.experts(h).mean(0)


def expert_logits(h, weight, bias, normed: bool, scale: float) -> torch.Tensor:
    """[E, B, C] logits of the experts ``weight`` [E, C, d] (and ``bias`` [E, C]) on features ``h`` [B, d]."""
    if normed:
        return scale * torch.einsum("bd,ecd->ebc", F.normalize(h, dim=1), F.normalize(weight, dim=2))
    return torch.einsum("bd,ecd->ebc", h, weight) + bias[:, None, :]


def estimated_counts(delta: torch.Tensor, n: int) -> torch.Tensor:
    """A client's class counts read from its classifier update ``delta`` [E, C, d]: the per-class sum over the
    feature dimension (mean over experts), negatives to 1e-5, normalised, times the client's size, rounded."""
    s = delta.sum(-1).mean(0).clamp_min(1e-5)
    return torch.round(s / s.sum() * n)


def global_prior(proxy: torch.Tensor, known: torch.Tensor, floor: float = 5.0) -> torch.Tensor:
    """P_c = max(sum of the known clients' estimated counts, ``floor``)."""
    return (proxy * known[:, None]).sum(0).clamp_min(floor)


def expert_groups(proxy: torch.Tensor, known: torch.Tensor, experts: int) -> dict[int, int]:
    """The known clients ranked by sum_c P_c q_{k,c} / n_k (most head-heavy first), cut into ``experts`` groups of
    (nearly) equal size, the official slices (the extra clients of an uneven split in the later groups): client ->
    group."""
    P = global_prior(proxy, known)
    ids = torch.nonzero(known).flatten().tolist()
    score = {k: float((P * proxy[k]).sum() / proxy[k].sum().clamp_min(1)) for k in ids}
    order = sorted(ids, key=lambda k: (-score[k], k))
    n = len(order)  # the official slices order[int(n e / E) : int(n (e + 1) / E)]
    return {order[i]: e for e in range(experts) for i in range(n * e // experts, n * (e + 1) // experts)}


@METHODS.register("gbme")
class GBME(Method):
    @dataclass
    class Params:
        experts: int = setting(3, "E, classifier experts (official num_experts)", low=1, limit=10**4)
        beta: float = setting(0.5, "in expert rounds, the share of clients training their own group's expert", low=0,
                              high=1)
        expert_start: float = setting(0.6, "expert rounds after this fraction of the rounds (official: 3/5)", low=0,
                                      high=1)
        normed_heads: bool = setting(True, "cosine heads scaled by ``scale`` (official config use_norm); false: linear")
        scale: float = setting(30.0, "s of the cosine heads", low=0, low_open=True)
        head_init: str = setting("linear", "initial head rows: linear (nn.Linear's range) | unit (official "
                                 "NormedLinear: unit rows)", choices=HEAD_INITS)
        expert_factor: float | None = setting(None, "expert rounds: the one expert's CE times this (official 5, "
                                              "its configuration's num_experts)", low=0, low_open=True,
                                              none_means="E, the model's expert count")

    @dataclass
    class State(Method.State):
        proxy: torch.Tensor | None = None  # [K, C] each client's estimated class counts (rows of unknown clients: 0)
        known: torch.Tensor | None = None  # [K] bool: the clients whose counts were estimated

    # the proxy of the client's class counts is read by the server from its first classifier update (the model)
    dp_client_refusal = ("its server reads each client's own classifier update, before any noise, to estimate that "
                         "client's class counts, and sends every client the prior they give")
    # --dp sample: the described steps' loss reads the sample and what the server sent (the prior, the mask); the
    # proxy the server reads from a client's DP-SGD-trained update is post-processing, mode and experts echoes
    dp_sample = True
    sends = Method.sends + (
        sent("mode", "echo", "the round's mode the server sent (estimate, joint, expert)", meta=True),
        sent("experts", "echo", "the experts it trained, from the server's mask (a list of expert ids)", meta=True),
    )

    # ------------------------------------------------------------------ model
    def new_model(self):
        m = super().new_model()
        p = self.p
        gen = torch.Generator().manual_seed(derive_seed(self.spec.seed, HEADS))  # the same on every process
        m.head = ExpertHeads(m.feature_dim, m.num_classes, p.experts, p.normed_heads, p.scale, gen,
                             unit=p.head_init == "unit").to(self.spec.device)
        return m

    # ------------------------------------------------------------------ server
    def init_server(self):
        K, C = self.spec.num_clients, self.spec.num_classes
        state = super().init_server()
        state.proxy = torch.zeros(K, C, device=self.spec.device)
        state.known = torch.zeros(K, dtype=torch.bool, device=self.spec.device)
        return state

    def expert_round(self, rnd: int) -> bool:
        return rnd > self.p.expert_start * self.spec.rounds

    def configure(self, state, rnd, cid):
        E = self.p.experts
        prior = torch.zeros(self.spec.num_classes, device=self.spec.device)
        mask = torch.ones(E, device=self.spec.device)
        if not bool(state.known[cid]):
            mode = ESTIMATE
        else:
            prior = log_prior(global_prior(state.proxy, state.known), device=self.spec.device)
            mode = JOINT
            if self.expert_round(rnd):
                mode = EXPERT
                rng = np.random.default_rng(derive_seed(self.spec.seed, ROUTE, rnd, cid))
                own = expert_groups(state.proxy, state.known, E)[cid]
                e = own if rng.random() < self.p.beta else int(rng.integers(E))
                mask = torch.zeros(E, device=self.spec.device)
                mask[e] = 1.0
        arrays = {**state.weights, "gbme.log_prior": prior, "gbme.mask": mask}
        return Message(arrays, {"mode": mode})

    def aggregate(self, state, rnd, replies):
        old = state.weights
        keys = [k for k in old if k != "head.weight"]
        new = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies], keys)
        W = old["head.weight"].clone()
        for e in range(self.p.experts):
            items = [(r.arrays, r.meta["num_examples"]) for _, r in replies if e in r.meta["experts"]]
            if items:
                W[e] = weighted_average([({"w": a["head.weight"][e]}, n) for a, n in items])["w"]
        for cid, r in replies:
            if r.meta["mode"] == ESTIMATE:
                state.proxy[cid] = estimated_counts(r.arrays["head.weight"] - old["head.weight"],
                                                    r.meta["num_examples"])
                state.known[cid] = True
        state.weights = {**old, **new, "head.weight": W}
        return state

    # ------------------------------------------------------------------ client
    def local_steps(self, payload, cstate, data):
        a = payload.arrays
        flag = torch.ones((), device=self.spec.device) * (payload.meta["mode"] == ESTIMATE)
        E, ef = self.p.experts, self.p.expert_factor
        factor = ef if payload.meta["mode"] == EXPERT and ef is not None else E  # joint rounds: the plain sum
        extra = {"log_prior": a["gbme.log_prior"], "mask": a["gbme.mask"], "plain": flag,
                 "factor": torch.full((), float(factor), device=self.spec.device)}
        weights = {k: v for k, v in a.items() if not k.startswith("gbme.")}
        return LocalSteps(weights, self.step_loss, extra=extra)

    def step_loss(self, model, x, y, extra):
        """plain: CE of the mean logits (the proxy's training); otherwise sum over the masked experts of
        CE(z_e + log prior, y), times E / |mask| (every expert: the sum; one expert: E x, or ``expert_factor`` x)."""
        h = model.backbone(x)
        z = expert_logits(h, model.params["head.weight"], model.params.get("head.bias"), self.p.normed_heads,
                          self.p.scale)  # [E, B, C]
        E = z.shape[0]
        plain = F.cross_entropy(z.mean(0), y)
        per = F.cross_entropy((z + extra["log_prior"]).flatten(0, 1), y.repeat(E), reduction="none")
        per = per.view(E, -1).mean(1)
        mask = extra["mask"]
        balanced = (per * mask).sum() * extra["factor"] / mask.sum()
        return extra["plain"] * plain + (1 - extra["plain"]) * balanced

    def local_reply(self, payload, cstate, data, out):
        mask = payload.arrays["gbme.mask"]
        meta = {"num_examples": len(data), "mode": payload.meta["mode"],
                "experts": [e for e in range(self.p.experts) if float(mask[e]) > 0], **out.stats}
        return Message(out.weights, meta), cstate
