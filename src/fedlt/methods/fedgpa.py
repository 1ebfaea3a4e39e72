"""FedGPA: "Don't Only Fine-Tune Majority: Federated Gradient-Balanced Prompt Learning for Long-Tailed
Heterogeneous Data" -- federated visual prompt tuning of a frozen ViT-B/16 with a Gradient-Adaptive Prompt
Adjuster (GPA) that re-weights each class's positive and negative gradients on the client.

**This method needs pre-trained ViT weights**: ``vit_weights``, a safetensors file with a ViT in timm's layout
(``vit_base_patch16_224``; how to make it: ``fedlt.core.vit``), or ``hf:<hub id or directory>``, a Hugging Face
ViT read through :mod:`fedlt.pretrained` (the hub's cache, safetensors only; e.g. ``hf:google/vit-base-patch16-224``,
with the ``pretrained`` extra) and converted to timm's layout. It is read as plain tensors (no code runs from a
file), frozen, and never sent: only the prompts and the classifier travel.

Model: the frozen ViT with deep visual prompts (P = ``tokens`` learnable tokens appended before every block and
dropped after it, zeros at first), the class token's final representation as the feature, a linear classifier.
The input is the image back in [0, 1], grey to RGB, bicubic to the ViT's resolution, normalised with
``vit_mean``/``vit_std``.
Client k, round t, receiving the prompts and the classifier; its GPA statistics (pos_c, neg_c, r_c: accumulated
positive and negative gradient magnitudes and their ratio, r_c = 100 at first) stay on the client across rounds:
  for each mini-batch (x, y), logits z [B, C], targets t = one-hot(y):
      q_c   = 1 / (1 + exp(-sigma (r_c - mu)))                negative weight (sigma 12, mu 0.8)
      p_c   = varphi (1 - q_c) + 1                            positive weight (varphi 4)
      w_ic  = p_c t_ic + q_c (1 - t_ic)
      L     = sum_ic w_ic BCE(z_ic, t_ic) / B                 one SGD step on the prompts and the classifier
      g_ic  = |dL/dz_ic| = w_ic |sigmoid(z_ic) - t_ic| / B
      pos_c += sum_i g_ic t_ic,   neg_c += sum_i g_ic (1 - t_ic),   r_c = pos_c / (neg_c + 1e-10)
  A class whose positive gradients lag behind its negative ones (a tail class) gets a small r_c: its negative
  gradients are switched off (q_c -> 0) and its positive ones raised (p_c -> varphi + 1).
Server: FedAvg (n_k-weighted) of the prompts and the classifier.
Inference: the global prompts and classifier. No personal model.
Communication: depth x P x width prompt floats plus the classifier, both ways (ViT-B/16, P = 10: 92,160 + 769 C).
Local training is a loop of its own (each step's weights come from the statistics of the steps before it, which a
batched step description cannot carry), so FedGPA's clients train one after another.

Paper vs. official code (miilue/Federated-prompt-tuning-framework-under-long-tailed-datasets, ``fedgpa.py``,
``utils/gpa.py``, ``utils/update.py``, ``models/vpt_structure.py`` at fed00f9)
=======================  ===========================================  ============================================
                         paper (default)                              official code (option)
=======================  ===========================================  ============================================
gradient of the loss     that of L as written: w (sigmoid(z) - t)/B   the statistics' backward hook multiplies
and the statistics       (``double_weight=false``)                    the logits' gradient by w *in place*, so
                                                                      training and statistics see
                                                                      w^2 (sigmoid(z) - t) / B
                                                                      (``double_weight=true``); the loss's value
                                                                      stays sum(w BCE) / B, and so does the
                                                                      logged loss here under either option
round 0's classifier     every client starts from the same seeded     each client trains a head of its own, a
                         head                                         different random nn.Linear, until the
                                                                      first aggregate; not reproduced
clients per round        the run's participation                      every client trains every round; the
                                                                      n_k weights are those of a random
                                                                      permutation of the clients (an index
                                                                      mix-up; not reproduced)
=======================  ===========================================  ============================================
The paper's full text could not be read here (the README's abstract: GPA "adaptively adjusts the gradients for
each class during client-side prompt learning"); sigma 12, mu 0.8, varphi 4, 10 deep prompt tokens and the
normalisation are the official code's (timm's ``vit_base_patch16_224``: mean = std = 0.5). The official local
optimiser is SGD lr 0.001 / momentum 0.9, batch 12, 2 local epochs on 224 x 224 inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core import Message, Method, derive_seed, load_weights, train_local, weights_of
from ..core.privacy import MODEL, sent, sends_with
from ..core.vit import PromptedViT, load_vit
from ..decl import setting
from ..errors import ConfigError
from ..models import Model
from ..registry import METHODS

HEAD_INIT = 0x6A1  # seed purpose: the classifier's initial values


def gpa_weights(ratio: torch.Tensor, varphi: float, sigma: float, mu: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(positive, negative) weight per class from the accumulated gradient ratios ``ratio`` [C]."""
    neg = torch.sigmoid(sigma * (ratio - mu))
    return varphi * (1 - neg) + 1, neg


def gpa_loss(z: torch.Tensor, y: torch.Tensor, stats: dict, varphi: float, sigma: float, mu: float,
             double_weight: bool = False) -> torch.Tensor:
    """The GPA loss of logits ``z`` [B, C]; updates ``stats`` ({pos, neg, ratio}, [C] each) in place with this
    step's gradient magnitudes (``double_weight``: the official hook's squared weights, in the gradient and the
    statistics only: the value returned is still sum(w BCE) / B, as the official loss reports it)."""
    t = F.one_hot(y, z.shape[1]).to(z.dtype)
    pos_w, neg_w = gpa_weights(stats["ratio"], varphi, sigma, mu)
    w1 = pos_w * t + neg_w * (1 - t)
    w = w1 * w1 if double_weight else w1
    B = z.shape[0]
    with torch.no_grad():
        g = (w * (torch.sigmoid(z) - t)).abs() / B
        stats["pos"].add_((g * t).sum(0))
        stats["neg"].add_((g * (1 - t)).sum(0))
        stats["ratio"].copy_(stats["pos"] / (stats["neg"] + 1e-10))
    bce = F.binary_cross_entropy_with_logits(z, t, reduction="none")
    loss = (w * bce).sum() / B
    if double_weight:  # value sum(w BCE) / B (exactly: loss - loss is 0), gradient that of sum(w^2 BCE) / B
        loss = loss - loss.detach() + ((w1 * bce).sum() / B).detach()
    return loss


@METHODS.register("fedgpa")
class FedGPA(Method):
    finetune_needs = {"own-model": "a frozen ViT of its --set vit_weights file with learnable prompts"}

    @dataclass
    class Params:
        vit_weights: str = setting("", "safetensors file: a ViT in timm's layout (vit_base_patch16_224), or "
                                       "hf:<a Hugging Face ViT's hub id or directory>; required")
        tokens: int = setting(10, "P, deep prompt tokens per block", low=1, limit=10**4)
        varphi: float = setting(4.0, "weight coefficient of the positive gradients", low=0)
        sigma: float = setting(12.0, "slope of the negative weight's sigmoid", low=0)
        mu: float = setting(0.8, "its centre")
        vit_mean: tuple[float, ...] = setting((0.5, 0.5, 0.5), "the ViT's input normalisation (timm "
                                                               "vit_base_patch16_224): mean per channel")
        vit_std: tuple[float, ...] = setting((0.5, 0.5, 0.5), "its standard deviation per channel", low=0,
                                             low_open=True)
        double_weight: bool = setting(False, "official: the hook squares the weights of training and statistics")

    # the GPA statistics (per-class positive and negative gradient sums) stay on the client
    sends = sends_with(Method.sends, sent(MODEL, "model", "the trained prompts and classifier"))

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        if not self.p.vit_weights:
            raise ConfigError("fedgpa needs pre-trained ViT weights: --set vit_weights=PATH (a safetensors file in "
                              "timm's layout; docs/methods-guide.md says how to make it) or --set "
                              "vit_weights=hf:google/vit-base-patch16-224 (docs/pretrained.md)")
        self._tower = None

    @property
    def tower(self):
        if self._tower is None:
            self._tower = load_vit(self.p.vit_weights, self.spec.device)
        return self._tower

    def new_model(self) -> Model:
        s, p = self.spec, self.p
        backbone = PromptedViT(self.tower, p.tokens, s.data.get("input_mean", (0.0,)), s.data.get("input_std", (1.0,)),
                               p.vit_mean, p.vit_std)
        g = torch.Generator().manual_seed(derive_seed(s.seed, HEAD_INIT))  # nn.Linear's initial range, seeded
        d, C = backbone.feature_dim, s.num_classes
        head = nn.Linear(d, C, device=s.device)
        with torch.no_grad():
            head.weight.copy_((torch.rand(C, d, generator=g, device="cpu") * 2 - 1) / d ** 0.5)
            head.bias.copy_((torch.rand(C, generator=g, device="cpu") * 2 - 1) / d ** 0.5)
        return Model(backbone, head, d, C)

    # ------------------------------------------------------------------ client
    def init_client(self, cid, data):
        C, dev = self.spec.num_classes, self.spec.device
        return {"gpa.pos": torch.zeros(C, device=dev), "gpa.neg": torch.zeros(C, device=dev),
                "gpa.ratio": torch.full((C,), 100.0, device=dev)}

    def local_train(self, payload, cstate, data, gen):
        p, net = self.p, self.net
        load_weights(net, payload.arrays)
        stats = {k: cstate[f"gpa.{k}"].clone() for k in ("pos", "neg", "ratio")}

        def loss_fn(model, x, y):
            return gpa_loss(model(x), y, stats, p.varphi, p.sigma, p.mu, p.double_weight)

        out = train_local(net, data, self.spec, gen, loss_fn, lr=payload.lr)
        cstate = {**cstate, **{f"gpa.{k}": v for k, v in stats.items()}}
        return Message(weights_of(net), {"num_examples": len(data), **out}), cstate
