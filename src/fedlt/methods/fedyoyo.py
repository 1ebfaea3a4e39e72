"""FedYoYo (ICCV 2025): augmented self-distillation plus logit adjustment by a feature-dispersion class prior.

"You Are Your Own Best Teacher: Achieving Centralized-level Performance in Federated Learning under Heterogeneous
and Long-tailed Data".

Two parts. Augmented Self-bootstrap Distillation (ASD): each sample is seen twice, weakly and strongly augmented,
and the model's own prediction on the weak view teaches the strong view. Distribution-aware Logit Adjustment
(DLA): training logits are shifted by tau * log of a class prior that blends a global estimate -- from how
dispersed each class's features are -- with the client's own label distribution.

Client k, receiving w and the global prior pi (uniform before the first estimate), local distribution q_k:
1. Dispersion statistic under the received model (eval mode, no augmentation): over the client's data in
   shuffled batches, for every class c in a batch, with centred features h~_i = h_i - mu_{k,c} (mu_{k,c} the
   class mean over the whole local set) and their cosine similarities r_ij:
       eff_{k,c} += 1 / max(mean_{i,j in c} r_ij, 1e-6)          (a lone sample counts 1)
   eff_k [C] is sent with the model.
2. E epochs; per batch, with prior p (starting from pi, kept across the client's batches):
       p <- (1 - gamma) p + gamma q_k;     z~ = z + log(p^tau + 1e-9)
       x_w, x_s = weak(x), strong(x);   z~_w, z~_s the adjusted logits of the two views
       L = CE([z~_w; z~_s], [y; y]) + lambda * min(t / warmup, 1) * KL(softmax(z~_w / T) || softmax(z~_s / T))
   the KL (batch mean, teacher detached) taken over the samples whose weak-view prediction is correct.
Server: FedAvg of the models; E = 1 + sum_k eff_k over the round's clients; from the third estimate on
E <- 0.9 E_prev + 0.1 E, keeping E_prev's entry where it changed by more than a factor 100; before that, entries
above 1e4 are replaced by the mean of the others; pi = E / sum E, sent next round.
Inference: the global model's plain logits (no adjustment). No personal model. Communication beyond FedAvg: C
floats each way.

Defaults (official scripts, as LongTailLib's port records them): lambda 4, T 1.5, tau 1.5, gamma 0.1, warmup 50
rounds; local SGD without momentum (``momentum`` None: none, the official optimiser; a number sets one).
Differences from the official code (read through LongTailLib's port):
- The official round has two exchanges: the dispersion statistics under the current model are gathered, the
  prior formed and sent, then local training starts. One exchange per round here: the prior a client uses is one
  round old (round 1 starts from the uniform prior).
- Augmentation: the official weak view is torchvision's crop (padding 4 on 32x32) + flip + rotation (15 deg), the
  strong view crop + flip + AutoAugment (CIFAR-10 policy) + Cutout (16 px). torchvision is not available here:
  both views are built from tensor operations on the normalised batch -- weak: shifted crop (padding H/8) + flip
  + rotation up to 15 deg; strong: the same geometry with rotation up to 30 deg and shear up to 0.3, random
  brightness and contrast, and a Cutout of H/2 -- a stand-in for AutoAugment, not a reproduction of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, load_weights, make_optimizer, train_local, weighted_average, weights_of
from ..core.privacy import sent
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


# ------------------------------------------------------------------------------------------------ augmentation
def _affine(x: torch.Tensor, gen: torch.Generator, max_rot: float, max_shear: float, pad_frac: float) -> torch.Tensor:
    """Per-sample random rotation, shear, shift (up to ``pad_frac`` of the side) and horizontal flip."""
    B, dev = x.shape[0], x.device

    def u(lo, hi):
        return (lo + (hi - lo) * torch.rand(B, generator=gen, device="cpu")).to(dev)

    a = u(-max_rot, max_rot) * math.pi / 180
    sh = u(-max_shear, max_shear)
    flip = torch.where(u(0, 1) < 0.5, -1.0, 1.0)
    tx, ty = u(-2 * pad_frac, 2 * pad_frac), u(-2 * pad_frac, 2 * pad_frac)
    cos, sin = torch.cos(a), torch.sin(a)
    theta = torch.stack([torch.stack([cos * flip, -sin + sh, tx], 1), torch.stack([sin * flip, cos, ty], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, align_corners=False, padding_mode="zeros")


def weak_view(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return _affine(x, gen, 15.0, 0.0, 1 / 8)


def strong_view(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    x = _affine(x, gen, 30.0, 0.3, 1 / 8)
    B, _, H, W = x.shape
    dev = x.device
    bright = (torch.rand(B, 1, 1, 1, generator=gen, device="cpu") - 0.5).to(dev)
    contrast = (0.5 + torch.rand(B, 1, 1, 1, generator=gen, device="cpu")).to(dev)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    x = (x - mean) * contrast + mean + bright
    cy = torch.randint(0, H, (B, 1, 1), generator=gen, device="cpu").to(dev)
    cx = torch.randint(0, W, (B, 1, 1), generator=gen, device="cpu").to(dev)
    rows = torch.arange(H, device=dev).view(1, H, 1)
    cols = torch.arange(W, device=dev).view(1, 1, W)
    hole = ((rows - cy).abs() <= H // 4) & ((cols - cx).abs() <= W // 4)
    return x * (~hole).unsqueeze(1).to(x.dtype)


# ------------------------------------------------------------------------------------------------ the two parts
def dispersion(feats: torch.Tensor, labels: torch.Tensor, C: int, batch_size: int, gen: torch.Generator,
               eps: float = 1e-6) -> torch.Tensor:
    """eff [C]: over shuffled batches, sum of 1 / (mean pairwise cosine similarity of the class's centred
    features in the batch); mean_{i,j} r_ij = ||sum_i normalize(h~_i)||^2 / n^2 (zero vectors count 0); a class
    with one sample in the batch counts 1."""
    onehot = F.one_hot(labels, C).to(feats.dtype)
    mu = onehot.T @ feats / onehot.sum(0).clamp_min(1)[:, None]
    centred = F.normalize(feats - mu[labels], dim=1)
    order = torch.randperm(len(labels), generator=gen, device="cpu").to(feats.device)
    eff = torch.zeros(C, dtype=feats.dtype, device=feats.device)
    for s in range(0, len(labels), batch_size):
        idx = order[s:s + batch_size]
        oh = onehot[idx]
        n = oh.sum(0)
        mean_r = (oh.T @ centred[idx]).pow(2).sum(1) / n.clamp_min(1) ** 2
        # a class's lone sample in a batch counts 1, as in the official code: its centred feature is zero when
        # it is the client's only sample of the class, and 1 / eps = 1e6 would then swamp the prior
        eff = eff + torch.where(n == 1, torch.ones_like(n),
                                torch.where(n > 0, 1.0 / mean_r.clamp_min(eps), torch.zeros_like(n)))
    return eff


def asd_loss(z_w: torch.Tensor, z_s: torch.Tensor, y: torch.Tensor, T: float) -> torch.Tensor:
    """KL(softmax(z_w/T) || softmax(z_s/T)), batch mean over the samples the weak view predicts correctly
    (0 when there are none); the teacher is detached."""
    ok = (z_w.detach().argmax(1) == y).to(z_w.dtype)
    t = F.softmax(z_w.detach() / T, dim=1)
    kl = (t * (t.clamp_min(1e-12).log() - F.log_softmax(z_s / T, dim=1))).sum(1)
    return (kl * ok).sum() / ok.sum().clamp_min(1)


@METHODS.register("fedyoyo")
class FedYoYo(FedAvg):
    finetune_needs = {"images": "weak and strong augmentations of each image"}

    @dataclass
    class Params:
        lam: float = setting(4.0, "weight of the self-distillation (official lamda)", low=0)
        T: float = setting(1.5, "distillation temperature", low=0, low_open=True)
        tau: float = setting(1.5, "logit-adjustment exponent", low=0)
        gamma: float = setting(0.1, "per-batch blend of the prior towards the local distribution", low=0, high=1)
        warmup: int = setting(50, "rounds over which the distillation weight ramps up", low=1, limit=10**6)
        momentum: float | None = setting(None, "local SGD momentum", low=0, high=1, high_open=True, old_none="< 0",
                                         none_means="none (the official optimiser)")

    @dataclass
    class State(FedAvg.State):
        prior: torch.Tensor | None = None  # pi [C], the class prior sent to the clients (uniform at first)
        eff: torch.Tensor | None = None  # E [C], the (smoothed) dispersion estimate pi is formed from
        estimates: int = 0  # how many estimates E has been formed from so far

    sends = FedAvg.sends + (
        sent("yoyo.eff", "class-counts", "per-class effective counts from the dispersion of its features under the "
             "received model, [C] (zero for the classes it lacks): the global prior's estimate"),
    )

    # ------------------------------------------------------------------ server
    def init_server(self) -> "FedYoYo.State":
        state = super().init_server()
        C, dev = self.spec.num_classes, self.spec.device
        state.prior, state.eff, state.estimates = torch.full((C,), 1.0 / C, device=dev), torch.ones(C, device=dev), 0
        return state

    def configure(self, state: "FedYoYo.State", rnd, cid):
        return Message({**state.weights, "yoyo.prior": state.prior.clone()},
                       {"round": rnd})

    def eval_payload(self, state: "FedYoYo.State", cid):
        return Message(dict(state.weights))

    def aggregate(self, state: "FedYoYo.State", rnd, replies):
        keys = list(state.weights)
        state.weights = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies], keys)
        cur = 1 + sum(r.arrays["yoyo.eff"] for _, r in replies)
        if state.estimates >= 2:
            prev = state.eff
            cur = 0.9 * prev + 0.1 * cur
            cur = torch.where((cur - prev).abs() / (prev + 1e-8) > 100, prev, cur)
        else:
            bad = cur > 1e4
            cur = torch.where(bad, cur[~bad].mean() if bool((~bad).any()) else cur, cur)
        state.eff, state.estimates = cur, state.estimates + 1
        state.prior = cur / cur.sum()
        return state

    # ------------------------------------------------------------------ client
    def local_train(self, payload, cstate, data, gen):
        net, p, s, C = self.net, self.p, self.spec, self.spec.num_classes
        load_weights(net, {k: v for k, v in payload.arrays.items() if not k.startswith("yoyo.")})
        net.eval()
        with torch.no_grad():
            parts = [(net.backbone(x), y) for x, y in data.batches(1024, None, shuffle=False, train=False)]
        eff = dispersion(torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts]), C, s.batch_size, gen)
        q = torch.as_tensor(data.counts, dtype=torch.float32, device=s.device)
        q = q / q.sum()
        prior = payload.arrays["yoyo.prior"].to(s.device).float()
        ramp = min(payload.meta["round"] / p.warmup, 1.0)
        opt = make_optimizer(net.parameters(), s, lr=payload.lr, momentum=0.0 if p.momentum is None else p.momentum)
        ce_sum = torch.zeros((), device=s.device)

        def loss_fn(model, x, y):
            nonlocal prior, ce_sum
            prior = (1 - p.gamma) * prior + p.gamma * q  # DLA: carried across the client's batches
            z = model(torch.cat([weak_view(x, gen), strong_view(x, gen)])) + torch.log(prior.pow(p.tau) + 1e-9)
            ce = F.cross_entropy(z, torch.cat([y, y]))
            ce_sum = ce_sum + ce.detach()
            return ce + p.lam * ramp * asd_loss(z[: len(y)], z[len(y):], y, p.T)  # ASD: weak teaches strong

        stats = train_local(net, data, s, gen, loss_fn, optimizer=opt)
        meta = {"num_examples": len(data), **stats, "loss_ce": float(ce_sum) / max(stats["steps"], 1)}
        return Message({**weights_of(net), "yoyo.eff": eff}, meta), cstate
