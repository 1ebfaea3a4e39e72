"""FedETF (Li et al., ICCV 2023, "No Fear of Classifier Biases: Neural Collapse Inspired Federated Learning
with Synthetic and Fixed Classifier").

Model: backbone -> projection layer (linear, d_in -> d) -> L2 normalisation h^ -> logits = beta * M h^, with
  M [C, d] a fixed simplex ETF (``core.etf.fixed_classifier("etf", ...)``, seeded by the run seed) and beta a
  learnable scalar initialised at 1 (trained and averaged like every other parameter).
Client: E local epochs of SGD on the balanced softmax loss with the client's own class counts,
  CE(beta M h^ + log n_k, y) (``core.losses.balanced_softmax_loss``); trained: backbone, projection, beta.
Server: FedAvg (sample-weighted) of everything but M, which never changes and never travels: it is a function
  of the seed, so every process builds the same one.
Inference: generic model argmax_c (M h^)_c (beta left out, as the official code; it does not change the argmax).
Personalization (a post-training phase ``personalize``, every client once, after FL):
  1. from the final global model, one more local round (E epochs of the balanced loss);
  2. ``pers_rounds`` = 20 times: (i) fine-tune this client's copy of M only, with CE, SGD lr 0.1 (no momentum),
     3 epochs; (ii) fine-tune the projection layer only, with CE, SGD lr 0.05, momentum 0.9, weight decay 5e-4,
     3 epochs;
  3. the personalized model logits beta M_k h^_k stay on the client.

Paper vs. official code (official repository ZexiLee/ICCV-2023-FedETF):
- The code projects to d = C (``proj_dim`` None means C); M comes from the QR of a U[0,1) matrix, regenerated at
  random in every model's constructor (its pitfall 1); here from the QR of a seeded Gaussian matrix, identical
  everywhere (the paper: any random orthogonal basis).
- The code keeps each client's SGD momentum buffers across rounds (``keep_momentum=true``); the default is a
  fresh optimiser every round, as the paper describes plain local SGD and every other method here does.
- Missing classes: the code clamps the counts to >= 1 (log 1 = 0: the class stays in the softmax, strongly
  penalised); ``absent_count`` = 1 reproduces it (0 would mask the class instead).
- In step 2 the code leaves the frozen backbone in train mode (BatchNorm statistics still move); here the
  frozen backbone runs in eval mode, and without data augmentation its features are computed once.

Under ``--finetune head`` / ``lora`` (docs/finetune.md): the ETF classifier M stays fixed in every mode; its projection
layer (``backbone.proj``, on the pre-trained features) and beta train under head, with the LoRA adapters
under lora; the personalization alternations fine-tune the same entries per client.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core import Message, Method, Predictor, derive_seed, load_weights, make_optimizer, train_local, weights_of
from ..core.etf import fixed_classifier
from ..core.personal import personal_predictor
from ..core.steps import LocalSteps, Train
from ..core.training import momentum_of, set_momentum
from ..core.losses import balanced_softmax_loss
from ..core.priors import prior_counts
from ..core.privacy import MODEL, sent, sends_with
from ..decl import setting
from ..errors import ConfigError
from ..models import Model
from ..registry import METHODS

_PROJ_SEED = 0xE7F


class ProjectedBackbone(nn.Module):
    """``x -> normalize(proj(body(x)))``: FedETF's feature, on the unit sphere of R^d."""

    def __init__(self, body: nn.Module, in_dim: int, out_dim: int):
        super().__init__()
        self.body = body
        self.proj = nn.Linear(in_dim, out_dim)
        self.feature_dim = out_dim

    def project(self, f: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(f), dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.body(x))


class ETFHead(nn.Module):
    """``z -> beta * z M^T`` with M [C, d] fixed (requires_grad False) and beta a learnable scalar."""

    def __init__(self, M: torch.Tensor):
        super().__init__()
        self.M = nn.Parameter(M.clone(), requires_grad=False)
        self.beta = nn.Parameter(torch.ones((), device=M.device))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.beta * (z @ self.M.T)


def frozen_feature_batches(body: nn.Module, data, batch_size: int):
    """``epochs, gen -> iterator of (body features, y)`` for a frozen ``body`` (eval mode, no gradient). Without
    data augmentation the features are computed once and only reshuffled; with it, every batch is recomputed."""
    body.eval()
    if getattr(data.prep, "augment", "none") == "none":
        with torch.no_grad():
            parts = [(body(x), y) for x, y in data.batches(1024, None, shuffle=False, train=False)]
        f, fy = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

        def cached(epochs, gen):
            for _ in range(epochs):
                order = torch.randperm(len(fy), generator=gen, device="cpu").to(fy.device, non_blocking=True)
                for s in range(0, len(fy), batch_size):
                    idx = order[s : s + batch_size]
                    yield f[idx], fy[idx]

        return cached

    def fresh(epochs, gen):
        for x, y in data.batches(batch_size, gen, epochs=epochs):
            with torch.no_grad():
                yield body(x), y

    return fresh


@METHODS.register("fedetf")
class FedETF(Method):
    personalized = True
    secagg = True  # its server is FedAvg's weighted mean of the backbone, projection and beta (--secagg: core.secagg)
    # --dp sample: its balanced softmax reads the client's class counts, given noised once (core.dpsgd); the
    # personalization phase's model never leaves the client and trains by plain SGD, as Ditto's personal model does
    dp_sample = "counts"

    @dataclass
    class Params:
        proj_dim: int | None = setting(None, "dimension d of the ETF space, >= C-1 to hold a simplex ETF", low=1,
                                       none_means="the number of classes C (the official code)", old_none="== 0",
                                       limit=10**5)
        absent_count: float = setting(1.0, "count used in the balanced loss for classes the client lacks (code: "
                                           "clamp 1)", low=0)
        keep_momentum: bool = setting(False, "keep each client's SGD momentum across rounds (the official code does)")
        pers_rounds: int = setting(20, "personalization: alternations of (M only, projection only); 0: no phase",
                                   low=0, limit=10**4)
        pers_epochs: int = setting(3, "epochs of each half of an alternation", low=0, limit=10**4)
        pers_lr_m: float = setting(0.1, "SGD lr for M_k (no momentum, no weight decay)", low=0)
        pers_lr_proj: float = setting(0.05, "SGD lr for the projection (momentum 0.9)", low=0)
        pers_wd_proj: float = setting(5e-4, "weight decay for the projection", low=0)

    sends = sends_with(
        Method.sends,
        sent(MODEL, "model", "the trained backbone and projection (the fixed ETF classifier never travels)"),
        sent("num_examples", "size", "the number of training samples", meta=True, when="personalize"),
        sent("*", "scalars", "the personalization's balanced round: its mean loss and steps", meta=True,
             numbers_only=True, when="personalize"),
    )

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        p = self.p
        C = spec.num_classes
        if p.proj_dim is not None and p.proj_dim < C - 1:
            raise ConfigError(f"fedetf: proj_dim must be None (= C) or >= C-1 = {C - 1} to hold a simplex ETF, "
                              f"got {p.proj_dim}")
        self.phases = ("personalize",) if p.pers_rounds > 0 else ()
        self.sent = sorted(k for k in self.net.state_dict() if k != "head.M")
        self._pnet = None  # client-side model for personalization (its M changes)

    def new_model(self) -> Model:
        s = self.spec
        base = super().new_model()
        d = s.num_classes if self.p.proj_dim is None else self.p.proj_dim
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(derive_seed(s.seed, _PROJ_SEED))
            backbone = ProjectedBackbone(base.backbone, base.feature_dim, d)
        M = fixed_classifier("etf", d, s.num_classes, seed=s.seed)
        return Model(backbone, ETFHead(M), d, s.num_classes).to(s.device)

    # ---------------------------------------------------------------- server
    def configure(self, state, rnd, cid):
        return Message({k: state.weights[k] for k in self.sent})

    def global_model(self, state):
        m = self.eval_model(state.weights)
        M = m.head.M.detach()
        return Predictor(m.backbone, lambda z: z @ M.T, shared_backbone=True)

    # ---------------------------------------------------------------- client
    def _balanced_round(self, net, payload, cstate, data, gen):
        """E local epochs of the balanced softmax loss from the payload's arrays, at its lr; returns (stats,
        client state)."""
        load_weights(net, payload.arrays)
        counts = prior_counts(torch.as_tensor(data.counts, dtype=torch.float32, device=self.spec.device),
                              self.p.absent_count)  # on the device once, not copied every step
        opt = make_optimizer(net.parameters(), self.spec, lr=payload.lr)
        named = dict(net.named_parameters())
        if self.p.keep_momentum:
            set_momentum(opt, named, cstate.get("momentum", {}))
        stats = train_local(net, data, self.spec, gen,
                            lambda model, x, y: balanced_softmax_loss(model(x), y, counts), optimizer=opt)
        if self.p.keep_momentum:
            cstate = {**cstate, "momentum": momentum_of(opt, named)}
        return stats, cstate

    def local_steps(self, payload, cstate, data):
        """E local epochs of the balanced softmax loss on the backbone, the projection and beta (M fixed); with
        keep_momentum, from the client's momentum buffers of its last round."""
        counts = prior_counts(torch.as_tensor(data.counts, dtype=torch.float32, device=self.spec.device),
                              self.p.absent_count)
        weights = {"head.M": self.net.head.M.detach(), **payload.arrays}  # M: the same fixed ETF everywhere
        momentum = dict(cstate.get("momentum", {})) if self.p.keep_momentum else {}
        return LocalSteps(weights, self.balanced_loss, train=(Train(("backbone.", "head.beta")),),
                          extra={"counts": counts}, momentum=momentum)

    def balanced_loss(self, model, x, y, extra):
        return balanced_softmax_loss(model(x), y, extra["counts"])

    def local_reply(self, payload, cstate, data, out):
        if self.p.keep_momentum:
            cstate = {**cstate, "momentum": dict(out.momentum)}
        return Message({k: out.weights[k] for k in self.sent}, {"num_examples": len(data), **out.stats}), cstate

    # ---------------------------------------------------------------- personalization
    def phase_client(self, phase, payload, cstate, data, gen):
        if self._pnet is None:
            self._pnet = self.new_model()
        net, p = self._pnet, self.p
        load_weights(net, {"head.M": self.net.head.M})  # start from the fixed ETF (the last client changed it)
        stats, cstate = self._balanced_round(net, payload, cstate, data, gen)  # step 1
        batches = frozen_feature_batches(net.backbone.body, data, self.spec.batch_size)
        M, proj = net.head.M, net.backbone.proj
        net.requires_grad_(False)
        halves = ((M, lambda: torch.optim.SGD([M], lr=p.pers_lr_m)),
                  (proj, lambda: torch.optim.SGD(proj.parameters(), lr=p.pers_lr_proj, momentum=0.9,
                                                 weight_decay=p.pers_wd_proj)))
        for _ in range(p.pers_rounds):  # step 2, a fresh optimiser for every half (as the official code)
            for part, make in halves:
                part.requires_grad_(True)
                opt = make()
                for f, y in batches(p.pers_epochs, gen):
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(net.head(net.backbone.project(f)), y).backward()
                    opt.step()
                part.requires_grad_(False)
        net.requires_grad_(True)
        M.requires_grad_(False)
        cstate = {**cstate, "personal": weights_of(net)}
        return Message(meta={"num_examples": len(data), **stats}), cstate

    def personal_model(self, payload, cstate, data):
        if "personal" not in cstate:
            return None  # before the personalization phase: PM is the global model
        return personal_predictor(self, cstate["personal"])
