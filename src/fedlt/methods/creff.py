"""CReFF (Shang et al., IJCAI 2022): the classifier re-trained on the server on federated (synthetic) features.

"Federated Learning on Heterogeneous and Long-Tailed Data via Classifier Re-training with Federated Features".

FedAvg learns the representation; after every round the server re-trains a fresh linear classifier on
*federated features*: synthetic features whose classifier gradients are made to match the real-data classifier
gradients the clients upload (gradient matching, as in dataset condensation). The re-trained head is the one
used for inference; training itself continues from the FedAvg model with its own head.

Client, round t, receiving the FedAvg weights w and the re-trained head H_{t-1} (a seeded random linear layer
in round 1):
1. Real-feature gradients: encoder of w in eval mode, head H_{t-1}. For every class c the client holds,
   ``real_repeats`` times: a batch of ``batch_real`` samples of c (fewer if it holds fewer), and the gradient
   of CE(H(f(x)), c) w.r.t. (W, b) (closed form, core.classgrad); the mean over the repeats is uploaded.
2. Local training: plain CE on the whole model from w, with the run's local optimiser.
Server:
1. FedAvg (n_k-weighted) -> the next broadcast model (its head stays the FedAvg head).
2. Federated features F (``ipc`` per class, N(0, 1) once, kept across rounds): ``match_epochs`` SGD steps
   (lr ``lr_feature``) on ``sum_c D(grad_{W,b} CE(H_{t-1}(F_c), c), g_c)``, where g_c is the unweighted
   mean of the uploaded gradients of class c over this round's clients (classes nobody uploaded are skipped)
   and D is the "ours" distance of gradient matching: sum over the rows of W of (1 - cos) plus (1 - cos) of
   the bias gradients. Second-order gradients flow through the closed-form head gradient.
3. Re-training: a freshly initialised Linear(d, C), SGD lr ``lr_net``, ``crt_epochs`` epochs, batch
   ``crt_batch_size``, on (F, labels). It becomes H_t: broadcast next round, and the inference head.
Inference: FedAvg encoder + H_t (mode "retrained", the headline GM); mode "fedavg_head" reports the plain
FedAvg head on the same features. No personalized model.

Communication beyond FedAvg: up, |C_k| x (C d + C) floats plus |C_k| class ids; down, C d + C floats (H).

Paper/official code (official repository shangxinyi/CReFF-FL, ``main.py`` and ``Dataset/param_aug.py`` read at
fbec98f) vs. here:
- Real batches. Paper (default, ``dsa=false``): the real-feature gradients of the clients' data; the batches get
  the dataset's own training augmentation (none for Fashion-MNIST, crop+flip for CIFAR). Official ``main.py``
  (``--method DSA``, its default; ``dsa=true``): each per-class batch is taken without the training transform and
  passed through Differentiable Siamese Augmentation (``fedlt.core.dsa``: one of color / crop / cutout / flip /
  scale / rotate per batch, one draw shared by the batch) before its gradient. The paper's text could not be read
  here; DSA is the official code's, so it is the option.
- Local training uses the run's optimiser (the protocol's SGD lr 0.05, momentum 0.9, 2 epochs); the
  official code uses SGD lr 0.1 without momentum, 10 epochs, batch 32 (set them with --lr 0.1 --momentum 0
  --local-epochs 10).
- The official code hard-codes Linear(256, 10) for the features and heads; here d and C come from the model.
- The RedGrape repo's port differs (cosine distance on the concatenated (W, b), analytic gradients over all
  local samples, re-training lr 0.1, only the re-trained weight matrix swapped in at test time); the
  official behaviour is followed.
Defaults (official options.py): ipc 100, match_epochs 100, crt_epochs 300, lr_feature 0.1, lr_net 0.01,
batch_real 32, 10 repeats.

Under ``--finetune head`` / ``lora`` (docs/finetune.md): the clients train the head (head) or the LoRA adapters and
the head (lora) with CE; the federated features are matched to the gradients of that head on the pre-trained
(head) or adapted (lora) features, and the server re-trains its classifier (``crt``) on them, as in full.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core import (Message, Method, Predictor, ce_loss, derive_seed, load_weights, train_local, weighted_average,
                    weights_of)
from ..core.classgrad import head_ce_grads, mean_class_grads, pack_class_grads
from ..core.dsa import siamese_augment
from ..core.privacy import CLASS_MEAN, sent
from ..core.retrain import retrain_head
from ..decl import setting
from ..registry import METHODS

HEAD_INIT, FEAT_INIT, CRT_INIT, CRT_SHUFFLE = 111, 112, 113, 114  # seed purposes


def match_distance(gw_syn, gb_syn, gw_real, gb_real, eps: float = 1e-6) -> torch.Tensor:
    """Gradient-matching distance "ours": sum over rows of W of (1 - cos), plus (1 - cos) for the bias
    vector; leading dimensions (one per class) are summed over."""
    cos_w = (gw_syn * gw_real).sum(-1) / (gw_syn.norm(dim=-1) * gw_real.norm(dim=-1) + eps)
    cos_b = (gb_syn * gb_real).sum(-1) / (gb_syn.norm(dim=-1) * gb_real.norm(dim=-1) + eps)
    return (1 - cos_w).sum() + (1 - cos_b).sum()


def match_features(feats: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   targets: dict[int, tuple[torch.Tensor, torch.Tensor]], steps: int, lr: float,
                   extra=None) -> torch.Tensor:
    """``steps`` SGD steps on the synthetic features so that their per-class head gradients match ``targets``
    (plus ``extra(features)``, a loss term of the features, when given: CLIP2FL's text contrast)."""
    if not targets:
        return feats
    f = feats.detach().clone().requires_grad_(True)
    opt = torch.optim.SGD([f], lr=lr)
    classes = sorted(targets)
    rw = torch.stack([targets[c][0] for c in classes])
    rb = torch.stack([targets[c][1] for c in classes])
    weight, bias = weight.detach(), bias.detach()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        gw, gb = head_ce_grads(f, labels, weight, bias, classes)
        loss = match_distance(gw, gb, rw, rb)
        (loss if extra is None else loss + extra(f)).backward()
        opt.step()
    return f.detach()


@METHODS.register("creff")
class CReFF(Method):
    @dataclass
    class Params:
        ipc: int = setting(100, "federated features per class (official num_of_feature)", low=1, limit=10**5)
        match_epochs: int = setting(100, "gradient-matching steps on the features per round", low=0, limit=10**5)
        crt_epochs: int = setting(300, "classifier re-training epochs per round", low=0, limit=10**5)
        lr_feature: float = setting(0.1, "learning rate of the federated features", low=0, low_open=True)
        lr_net: float = setting(0.01, "re-training learning rate", low=0, low_open=True)
        crt_batch_size: int = setting(32, "re-training batch size", low=1, high=2**31 - 1)
        batch_real: int = setting(32, "real samples per class per repeat for the uploaded gradients", low=1,
                                  high=2**31 - 1)
        real_repeats: int = setting(10, "repeats of the real-gradient computation", low=1, limit=10**4)
        dsa: bool = setting(False, "official main.py: Differentiable Siamese Augmentation of every real per-class "
                                   "batch")

    @dataclass
    class State(Method.State):
        crt: dict[str, torch.Tensor] | None = None  # the re-trained classifier's entries ("crt.weight", "crt.bias")
        feats: torch.Tensor | None = None  # the federated (synthetic) features, C * ipc x d
        labels: torch.Tensor | None = None  # their class labels

    sends = Method.sends + (
        sent("grad.classes", "class-counts", "the classes the client holds, [|C_k|] class ids", dp=CLASS_MEAN),
        sent("grad.[wb]", "class-gradients", "per held class, the gradient of the re-trained head's CE on its real "
             "features w.r.t. (W, b): [|C_k|, C, d] and [|C_k|, C]", dp=CLASS_MEAN),
    )

    def new_head(self, purpose: int, rnd: int = 0) -> nn.Linear:
        d, C = self.net.feature_dim, self.spec.num_classes
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(derive_seed(self.spec.seed, purpose, rnd))
            return nn.Linear(d, C).to(self.spec.device)

    # ------------------------------------------------------------------ server
    def init_server(self) -> "CReFF.State":
        C, d = self.spec.num_classes, self.net.feature_dim
        g = torch.Generator().manual_seed(derive_seed(self.spec.seed, FEAT_INIT))
        feats = torch.randn(C * self.p.ipc, d, generator=g, device="cpu").to(self.spec.device)
        labels = torch.arange(C, device=self.spec.device).repeat_interleave(self.p.ipc)
        crt = {f"crt.{k}": v for k, v in weights_of(self.new_head(HEAD_INIT)).items()}
        return self.State(weights=weights_of(self.new_model()), crt=crt, feats=feats, labels=labels)

    def configure(self, state, rnd, cid):
        return Message({**state.weights, **state.crt})

    def aggregate(self, state, rnd, replies):
        p = self.p
        keys = list(state.weights)
        state.weights = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies], keys)
        targets = mean_class_grads([r for _, r in replies], "grad")
        W, b = state.crt["crt.weight"], state.crt["crt.bias"]
        with torch.enable_grad():
            state.feats = match_features(state.feats, state.labels, W, b, targets, p.match_epochs,
                                         p.lr_feature, self.feature_loss())
            gen = torch.Generator().manual_seed(derive_seed(self.spec.seed, CRT_SHUFFLE, rnd))
            head = retrain_head(state.feats, state.labels, self.new_head(CRT_INIT, rnd), p.crt_epochs,
                                p.lr_net, p.crt_batch_size, gen)
        state.crt = {f"crt.{k}": v for k, v in weights_of(head).items()}
        return state

    # ------------------------------------------------------------------ client
    def local_train(self, payload, cstate, data, gen):
        net, p = self.net, self.p
        load_weights(net, payload.arrays)
        W, b = payload.arrays["crt.weight"], payload.arrays["crt.bias"]
        # every class: real_repeats batches of min(batch_real, n_c) samples; with equal batch sizes the mean of
        # the per-batch gradients is the gradient over their union, so one pass serves all repeats
        held = data.classes.tolist()
        idx = []
        for c in held:
            pool = torch.from_numpy((data.y.numpy() == c).nonzero()[0])
            idx += [pool[torch.randperm(len(pool), generator=gen, device="cpu")[:p.batch_real]] for _ in range(p.real_repeats)]
        if p.dsa:  # official: each batch of one class without the training transform, then one DSA draw for it
            batches = [data.sample_batch(i, gen, train=False) for i in idx]
            x = torch.cat([siamese_augment(xb, gen) for xb, _ in batches])
            y = torch.cat([yb for _, yb in batches])
        else:
            x, y = data.sample_batch(torch.cat(idx), gen, train=True)
        net.eval()
        with torch.no_grad():
            h = torch.cat([net.backbone(x[s:s + 1000]) for s in range(0, len(y), 1000)])
            gws, gbs = head_ce_grads(h, y, W, b, held)
        stats = train_local(net, data, self.spec, gen, self.local_loss(), lr=payload.lr)
        arrays = {**weights_of(net), **pack_class_grads("grad", held, gws, gbs)}
        return Message(arrays, {"num_examples": len(data), **stats}), cstate

    def local_loss(self):
        """The local training loss (cross-entropy; CLIP2FL adds its distillation)."""
        return ce_loss

    def feature_loss(self):
        """An extra loss term of the federated features during matching (None; CLIP2FL's text contrast)."""
        return None

    # ------------------------------------------------------------------ inference
    def global_model(self, state):
        m = self.eval_model(state.weights)
        if getattr(self, "_crt_eval", None) is None:
            self._crt_eval = self.new_head(HEAD_INIT)
        load_weights(self._crt_eval, {k[4:]: v for k, v in state.crt.items()})
        self._crt_eval.eval()
        return {"retrained": Predictor(m.backbone, self._crt_eval, shared_backbone=True),
                "fedavg_head": Predictor(m.backbone, m.head, shared_backbone=True)}
