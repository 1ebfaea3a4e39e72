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


def etf_features(h: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 training: bool = True) -> torch.Tensor:
    """The official ETF baseline's projector: BatchNorm (affine ``weight``, ``bias``) over the batch in training (a
    batch of one passes through), else with the server's projector's statistics, its initial ones (mean 0,
    variance 1); then L2 normalisation (norms floored at 1e-8)."""
    if len(h) > 1:
        stats = (None, None) if training else (h.new_zeros(h.shape[1]), h.new_ones(h.shape[1]))
        h = F.batch_norm(h, *stats, weight, bias, training=training, eps=1e-5)
    return h / h.norm(dim=1, keepdim=True).clamp_min(1e-8)


def etf_dot_regression(h: torch.Tensor, y: torch.Tensor, M: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor) -> torch.Tensor:
    """The official ``reg_dot_loss`` on ``produce_Ew``'s per-batch class scaling (fedlt.methods.fedloge's
    ``backbone_loss=etf-dr``): ``M`` [C, d] the fixed ETF's class vectors."""
    hn = etf_features(h, weight, bias)
    counts = (y[:, None] == torch.arange(M.shape[0], device=y.device)).sum(0).to(h.dtype)  # vmap-able, as batched
    # clients run (torch.unique and F.one_hot read values)
    present = counts > 0
    gamma = len(y) / present.sum().to(h.dtype)  # B / the classes in the batch
    scale = torch.where(present, torch.sqrt(gamma / counts.clamp_min(1)), torch.ones_like(counts))
    target = M[y] * scale[y, None]
    dot = (hn * target).sum(1)
    with torch.no_grad():
        m_len, h_len = target.norm(dim=1), hn.norm(dim=1).clamp_min(1e-8)
    return 0.5 * ((dot - m_len * h_len) ** 2 / h_len).mean()
