"""RedGrape (Yang et al., "Decentralized Decoupled Training for Federated Long-Tailed Learning", TMLR 2024).

Each client re-balances the classifier W during local training, on a small local balanced set mixed with
global per-class *gradient prototypes* that stand in for the classes it lacks. A supplementary classifier
W^ (``sup``), trained jointly and averaged like the rest of the model, absorbs the imbalance of the data so
that W can follow the balanced objective; W^ is dropped at inference.

Client (Algorithm 1), round t, starting from the received (P, W, b, W^, b^) and global prototypes G:
1. Local prototypes (Eq. 11), on the received model before any training: for every class c the client
   holds, the mean over its samples of the CE gradient of the main head, ``(p - e_c) h^T`` and ``p - e_c``
   (closed form, core.classgrad). Uploaded with the weights.
2. Local balanced set D_bal: T random samples of every class holding at least T (drawn once per round);
   L_bal = those classes.
3. Every step on a batch B: ``z = (W h + b) + (W^ h + b^)``, ``L = CE(z, y)``; backward reaches P, W, b,
   W^, b^ (Eq. 7, 8). If G is not empty (from round 2 on), the re-balancing gradient for P in {W, b}
   (Eq. 9, 10, 12) is ``g_bal = (sum_{c in L_bal} grad CE(W sg(h_bal) + b) on D_bal,c  +  sum_{c not in
   L_bal, c in G} G[c]) / C`` (encoder output detached, main head only), and W is updated with
   ``g_local + lambda * g_bal * ||g_local|| / ||g_bal||`` (Eq. 13, norms per tensor).
Server: sample-weighted FedAvg of (P, W, b, W^, b^) (Eq. 14); for each class, the unweighted mean of the
uploaded prototypes over this round's clients holding it replaces G[c]; classes no client of the round
holds keep their stale prototype (Eq. 15). G (only the classes it has) is broadcast with the weights.
Inference: ``argmax W f(x) + b`` (Eq. 16); W^ is discarded. No personalized model (PM uses the global one).

Communication beyond FedAvg: up, (|L_k| + 1) x (C d + C) floats (prototypes of the held classes, plus W^);
down, (|G| + 1) x (C d + C) floats plus |G| class ids. Counted in the logged bytes.

Paper vs. official code (keven980716/Federated_Learning_Experiments, --decoupled_training, read at
commit 1f0c493):
- Re-balancing step. Paper Eq. 13: the scaled g_bal is added to W's gradient and goes through the local
  optimiser (``rebalance_step="joint"``, default). Code: the optimiser steps on the main gradient alone,
  then W <- W - lr * lambda * scaled g_bal as an extra plain-SGD step (``rebalance_step="separate"``).
- FedProx is silently on in the code (mu = 0.1 on every method). Off here; ``prox_mu=0.1`` reproduces it.
- The code clips the global gradient norm to 1.0 before each step; off here (the paper does not mention it),
  ``clip_grad_norm=1.0`` reproduces it.
- The code clears gradients only once per round outside the re-balancing branch, so in round 1 gradients
  accumulate over all local steps, and later the "balanced" gradient contains the previous step's clipped
  main gradient. Not reproduced (a bug, not an option): gradients are cleared every step.
- The code builds a 100-way head for every dataset, so C = 100 in the g_bal denominator even on CIFAR-10.
  Not reproduced: C is the true number of classes.
- Code: missing-class contribution = (C - k_L) x the mean of the prototypes the server holds for the
  missing classes; paper (used here): the sum of those prototypes. They differ only when some missing class
  has no prototype yet.
- The code uses augmented samples for the balanced set and the prototypes, with the model in train mode;
  here prototypes use un-augmented data and the balanced set the dataset's training augmentation.
- Whether W^ is averaged: the run script passes --aggregate_ba (averaged), as the paper's Eq. 14; done here.
Defaults: lambda = 0.1 and T = 8 (paper Sec. 4.1 for MNIST-LT and CIFAR-10-LT; T = 2 for CIFAR-100-LT).

Under ``--finetune head`` / ``lora`` (docs/finetune.md): the head and the supplementary head (``sup``) train on the
pre-trained features (head), with the LoRA adapters (lora); the gradient prototypes are of those heads as in full.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..core import Meter, Message, Method, derive_seed, load_weights, make_optimizer, weighted_average, weights_of
from ..core.classgrad import head_ce_grads, mean_class_grads, pack_class_grads, unpack_class_grads
from ..core.privacy import CLASS_MEAN, UPDATE, sent
from ..core.proximal import proximal_term
from ..core.retrain import local_features
from ..core.sampling import per_class_subset
from ..decl import setting
from ..registry import METHODS

SUP_INIT = 101  # seed purpose: the supplementary classifier's initialisation


@METHODS.register("redgrape")
class RedGrape(Method):
    fp16 = False  # a training loop of its own, without fp16's gradient scaler (bf16 and fp32 only)

    @dataclass
    class Params:
        lam: float = setting(0.1, "re-balancing strength lambda (paper: 0.1 in all experiments)", low=0)
        T: int = setting(8, "samples per class in the local balanced set, and the threshold to count as held", low=1,
                         limit=10**6)
        rebalance_step: str = setting("joint", "joint: Eq. 13 through the optimiser (paper); separate: official code",
                                      choices=("joint", "separate"))
        prox_mu: float = setting(0.0, "FedProx term; the official code silently uses 0.1", low=0)
        clip_grad_norm: float | None = setting(None, "gradient-norm clipping (the official code clips to 1.0)", low=0,
                                               low_open=True, none_means="off", old_none="== 0")

    @dataclass
    class State(Method.State):
        # the latest averaged prototype (class-gradient pair) of every class any client has sent (Eq. 15)
        protos: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    sends = Method.sends + (
        sent("sup.*", "model-part", "the trained supplementary classifier W^, b^", dp=UPDATE),
        sent("proto.classes", "class-counts", "the classes the client holds, [|C_k|] class ids", dp=CLASS_MEAN),
        sent("proto.[wb]", "class-gradients", "local gradient prototypes: per held class, the mean CE gradient of "
             "the received head on its samples w.r.t. (W, b), [|C_k|, C, d] and [|C_k|, C]", dp=CLASS_MEAN),
    )

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        self._sup: nn.Linear | None = None

    # ------------------------------------------------------------------ the supplementary classifier
    def new_sup(self) -> nn.Linear:
        d, C = self.net.feature_dim, self.spec.num_classes
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(derive_seed(self.spec.seed, SUP_INIT))
            return nn.Linear(d, C).to(self.spec.device)

    @property
    def sup(self) -> nn.Linear:
        if self._sup is None:
            self._sup = self.new_sup()
        return self._sup

    # ------------------------------------------------------------------ server
    def init_server(self) -> "RedGrape.State":
        sup = {f"sup.{k}": v for k, v in weights_of(self.new_sup()).items()}
        return self.State(weights={**weights_of(self.new_model()), **sup})

    def configure(self, state, rnd, cid):
        arrays = dict(state.weights)
        G = state.protos
        if G:
            cls = sorted(G)
            arrays.update(pack_class_grads("gproto", cls, torch.stack([G[c][0] for c in cls]),
                                           torch.stack([G[c][1] for c in cls])))
        return Message(arrays)

    def aggregate(self, state, rnd, replies):
        keys = list(state.weights)
        state.weights = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies], keys)
        state.protos.update(mean_class_grads([r for _, r in replies], "proto"))  # Eq. 15: others stay stale
        return state

    # ------------------------------------------------------------------ client
    def local_train(self, payload, cstate, data, gen):
        net, sup, p, C = self.net, self.sup, self.p, self.spec.num_classes
        load_weights(net, payload.arrays)
        load_weights(sup, {k[4:]: v for k, v in payload.arrays.items() if k.startswith("sup.")})
        W, b = net.head.weight, net.head.bias

        # 1. local gradient prototypes on the received model (Eq. 11)
        held = data.classes.tolist()
        with torch.no_grad():
            h_all, y_all = local_features(net.backbone, data)
            pw, pb = head_ce_grads(h_all, y_all, W, b, held)
        del h_all

        # 2. the local balanced set and the missing-class prototypes (Eq. 9, 10, 12)
        G = unpack_class_grads(payload.arrays, "gproto")
        rebalance = bool(G) and p.lam > 0
        if rebalance:
            bal_idx = per_class_subset(data.y, p.T, gen)
            x_bal, y_bal = data.sample_batch(bal_idx, gen, train=True)
            bal_classes = sorted(set(y_bal.tolist()))
            missing = [c for c in G if c not in bal_classes]
            miss_w = sum((G[c][0] for c in missing), torch.zeros_like(W))
            miss_b = sum((G[c][1] for c in missing), torch.zeros_like(b))

        params = list(net.parameters()) + list(sup.parameters())
        anchors = [(m, {n: q.detach().clone() for n, q in m.named_parameters()}) for m in (net, sup)]
        opt = make_optimizer(params, self.spec, lr=payload.lr)
        lr = opt.param_groups[0]["lr"]
        net.train()
        meter = Meter()
        for x, y in data.batches(self.spec.batch_size, gen, epochs=self.spec.local_epochs):
            opt.zero_grad(set_to_none=True)
            h = net.backbone(x)
            loss = F.cross_entropy(net.head(h) + sup(h), y)
            if p.prox_mu > 0:
                loss = loss + 0.5 * p.prox_mu * sum(proximal_term(m, a) for m, a in anchors)
            loss.backward()
            corrections = []
            if rebalance:
                with torch.no_grad():
                    gw, gb = head_ce_grads(net.backbone(x_bal), y_bal, W, b, bal_classes)
                    for P, g in ((W, (gw.sum(0) + miss_w) / C), (b, (gb.sum(0) + miss_b) / C)):
                        scale = P.grad.norm() / g.norm().clamp_min(1e-12)
                        corrections.append((P, p.lam * scale * g))
                if p.rebalance_step == "joint":
                    for P, g in corrections:
                        P.grad.add_(g)
            if p.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, p.clip_grad_norm)
            opt.step()
            if p.rebalance_step == "separate":
                with torch.no_grad():
                    for P, g in corrections:
                        P.sub_(lr * g)
            meter.add(loss)

        arrays = {**weights_of(net), **{f"sup.{k}": v for k, v in weights_of(sup).items()},
                  **pack_class_grads("proto", held, pw, pb)}
        return Message(arrays, {"num_examples": len(data), "loss": meter.mean(), "steps": meter.steps}), cstate
