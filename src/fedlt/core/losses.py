"""Losses shared by several methods (each method file names the paper it takes them from)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def log_prior(counts, eps: float = 1e-12, device=None) -> torch.Tensor:
    """log of the class prior n_c / sum n (classes with no sample get log(eps), i.e. effectively masked)."""
    c = torch.as_tensor(counts, dtype=torch.float32, device=device)
    return torch.log(c / c.sum().clamp_min(1) + eps)


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, counts) -> torch.Tensor:
    """Balanced Softmax (Ren et al., NeurIPS 2020): CE on logits + log n_c, with the (local) class counts."""
    return F.cross_entropy(logits + log_prior(counts, device=logits.device), y)


def focal_loss(logits: torch.Tensor, y: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """Focal loss (Lin et al., 2017): mean of -(1 - p_y)^gamma log p_y."""
    logp = F.log_softmax(logits, 1).gather(1, y[:, None]).squeeze(1)
    return (-(1 - logp.exp()).pow(gamma) * logp).mean()


def masked_logits(logits: torch.Tensor, present, value: float = -1e10) -> torch.Tensor:
    """Set the logits of classes not in ``present`` (a boolean mask or class indices) to ``value``."""
    mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    mask[torch.as_tensor(present, device=logits.device)] = True
    return logits.masked_fill(~mask, value)


def linear_heads_ce(heads, y: torch.Tensor) -> torch.Tensor:
    """Per head, ``F.cross_entropy(F.linear(h, W, b), y)`` for linear heads ``[(h [B, d], W [C, d], b [C]), ...]``
    sharing the labels ``y``: the heads' losses [H]. Computed as one batched matrix product and one
    cross-entropy over the stacked logits -- the same values (up to float rounding), with about half the kernel
    launches of one call per head, which is what a small model's step costs on a GPU."""
    H = len(heads)
    X = torch.stack([h for h, _, _ in heads])  # [H, B, d]
    W = torch.stack([w for _, w, _ in heads])  # [H, C, d]
    b = torch.stack([c for _, _, c in heads])  # [H, C]
    logits = torch.baddbmm(b.unsqueeze(1), X, W.transpose(1, 2))  # [H, B, C]
    return F.cross_entropy(logits.flatten(0, 1), y.repeat(H), reduction="none").view(H, -1).mean(1)
