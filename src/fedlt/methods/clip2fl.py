"""CLIP2FL (Shi et al., AAAI 2024): CReFF guided by a frozen CLIP (client distillation, server text contrast).

"CLIP-Guided Federated Learning on Heterogeneous and Long-Tailed Data" (Shi, Zhang, Lu, Wang & Cheung): CReFF's
server-side classifier re-training, guided on both sides by a frozen CLIP.

**This method needs pretrained CLIP files**: ``clip_weights``, a safetensors file with a CLIP ViT image tower in
OpenAI's layout, and ``text_embeddings``, a safetensors file whose tensor ``text`` [C, e] holds one CLIP text
embedding per class (e.g. of "a photo of a {class name}"). How to make them: ``fedlt.core.clip`` and
docs/methods-guide.md. Both are read as plain tensors (no code runs from a file). Or, with the ``pretrained``
extra, ``hf:<a CLIP model's hub id or directory>`` for both (e.g. ``hf:openai/clip-vit-base-patch32``): read
through :mod:`fedlt.pretrained` (the hub's cache, safetensors only), the image tower converted to OpenAI's
layout, the text embeddings those of "a photo of a {class}" for the dataset's class names (``--head
clip-text``'s rows).

Client k (CReFF's client, ``fedlt.methods.creff``, with a different local loss):
1. per-class head gradients of real features under the received model and the re-trained head, uploaded;
2. E local epochs on CE(z, y) + alpha * T^2 * KL(softmax(z_clip / T) || softmax(z / T)), where
   z_clip = 100 * normalize(CLIP_image(x)) . normalize(text)^T are CLIP's zero-shot logits (the CLIP image is x
   back in [0, 1], grey to RGB, resized to the tower's resolution, CLIP-normalised).
Server (CReFF's, with one more term when matching the federated features F):
   sum_c D(grad_{W,b} CE(H(F_c), c), g_c) + contrast_alpha * SupCon(F, text)
   SupCon(F, text): for every federated feature f_i (label c_i), logits f_i . t_{c_j} / ins_temp over the other
   features j (their classes' text embeddings), positives the j with c_j = c_i: mean over positives of -log p.
   It needs the model's feature width to equal the text embedding width (512 for ViT-B/32: resnet18/34 here; the
   official code gives its ResNet-8 a 512-d feature for this); with another width set ``contrast_alpha=0``.
Inference: CReFF's ("retrained": FedAvg backbone + the re-trained head; "fedavg_head"). No personal model.
Communication: CReFF's.

Defaults (official options as LongTailLib's port records them): alpha 1, T 3, contrast_alpha 0.001, ins_temp 0.1,
and CReFF's settings. Differences from the official code: those of CReFF (no DSA on the real batches; the run's
local optimiser -- the official one is SGD lr 0.1 without momentum); the image for CLIP is the normalised batch
undone (the official code does the same with CIFAR's statistics). Tests run a small random image tower of the
same layout: the real one cannot be fetched here, so no accuracy number of this method is reported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.clip import clip_input, load_image_tower, load_text_embeddings
from ..decl import setting
from ..errors import ConfigError
from ..registry import METHODS
from .creff import CReFF


def supcon_text(feats: torch.Tensor, labels: torch.Tensor, text: torch.Tensor, temp: float) -> torch.Tensor:
    """Supervised contrast of features against their classes' text embeddings (the official SupConLoss_text):
    logits_ij = f_i . t_{c_j} / temp over j != i, positives c_j = c_i, mean over positives of -log softmax."""
    n = len(labels)
    logits = feats @ text[labels].T / temp
    logits = logits - logits.max(1, keepdim=True).values.detach()
    not_self = 1 - torch.eye(n, dtype=feats.dtype, device=feats.device)
    pos = (labels[:, None] == labels[None, :]).to(feats.dtype) * not_self
    log_prob = logits - torch.log((torch.exp(logits) * not_self).sum(1, keepdim=True))
    has = (pos.sum(1) > 0).to(feats.dtype)
    per = -(pos * log_prob).sum(1) / pos.sum(1).clamp_min(1)
    return (per * has).sum() / has.sum().clamp_min(1)


def kd_loss(z: torch.Tensor, teacher: torch.Tensor, T: float) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(z / T)), batch mean."""
    return F.kl_div(F.log_softmax(z / T, 1), F.softmax(teacher / T, 1), reduction="batchmean") * T * T


@METHODS.register("clip2fl")
class CLIP2FL(CReFF):
    finetune_needs = {"images": "CLIP's image tower, the teacher, on each image"}

    @dataclass
    class Params(CReFF.Params):
        clip_weights: str = setting("", "safetensors file: a CLIP ViT image tower (OpenAI layout), or hf:<a CLIP "
                                        "model's hub id or directory>; required")
        text_embeddings: str = setting("", 'safetensors file: tensor "text" [C, embed], one row per class, or '
                                           'hf:<a CLIP model> (its text tower on the class names); required')
        alpha: float = setting(1.0, "weight of the CLIP distillation", low=0)
        T: float = setting(3.0, "its temperature", low=0, low_open=True)
        contrast_alpha: float = setting(0.001, "weight of the feature-text contrast on the server", low=0)
        ins_temp: float = setting(0.1, "its temperature", low=0, low_open=True)

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        p = self.p
        if not p.clip_weights or not p.text_embeddings:
            raise ConfigError("clip2fl needs pretrained CLIP files: --set clip_weights=PATH --set "
                              "text_embeddings=PATH (safetensors; docs/methods-guide.md says how to make them), or "
                              "both =hf:openai/clip-vit-base-patch32 (docs/pretrained.md)")
        self.text = load_text_embeddings(p.text_embeddings, spec.num_classes, spec.device,
                                         spec.data.get("class_names") or ())
        if p.contrast_alpha > 0 and self.text.shape[1] != self.net.feature_dim:
            raise ConfigError(f"clip2fl: the feature-text contrast needs the model's feature width "
                              f"({self.net.feature_dim}) to equal the text embeddings' ({self.text.shape[1]}); "
                              f"use a model with that width or --set contrast_alpha=0")
        self._tower = None

    @property
    def tower(self):
        if self._tower is None:
            self._tower = load_image_tower(self.p.clip_weights, self.spec.device)
        return self._tower

    def clip_logits(self, x: torch.Tensor, prep) -> torch.Tensor:
        """CLIP's zero-shot logits 100 * cos(image, text) for a batch prepared by ``prep`` (its mean/std)."""
        with torch.no_grad():
            img = self.tower(clip_input(x, prep.mean, prep.std, self.tower.resolution))
            return 100.0 * F.normalize(img, dim=1) @ self.text.T

    def local_loss(self):
        p = self.p
        prep = self._prep

        def loss_fn(model, x, y):
            z = model(x)
            return F.cross_entropy(z, y) + p.alpha * kd_loss(z, self.clip_logits(x, prep), p.T)

        return loss_fn

    def local_train(self, payload, cstate, data, gen):
        self._prep = data.prep
        return super().local_train(payload, cstate, data, gen)

    def feature_loss(self):
        p = self.p
        if p.contrast_alpha == 0:
            return None
        labels = None

        def contrast(f):
            nonlocal labels
            if labels is None:
                labels = torch.arange(self.spec.num_classes, device=f.device).repeat_interleave(p.ipc)
            return p.contrast_alpha * supcon_text(f, labels, self.text, p.ins_temp)

        return contrast
