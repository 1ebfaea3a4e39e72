"""Batched tensor transforms: normalisation and CIFAR augmentation (random crop with padding, flip)."""
from __future__ import annotations

import torch


def to_float(x: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 [B, C, H, W] -> normalised float32. Float input (synthetic data) passes through."""
    if x.dtype != torch.uint8:
        return x.float()
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (x.float().div_(255.0) - m) / s


def random_crop_flip(x: torch.Tensor, gen: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Random crop with zero padding and horizontal flip, for a whole batch at once."""
    b, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=gen)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=gen)
    rows = (dy.view(b, 1) + torch.arange(h).view(1, h))  # [b, h]
    cols = (dx.view(b, 1) + torch.arange(w).view(1, w))  # [b, w]
    flip = torch.rand(b, generator=gen) < 0.5
    cols = torch.where(flip.view(b, 1), cols.flip(1), cols)
    bi = torch.arange(b).view(b, 1, 1)
    out = padded.permute(0, 2, 3, 1)[bi, rows.view(b, h, 1), cols.view(b, 1, w)]  # [b, h, w, c]
    return out.permute(0, 3, 1, 2).contiguous()
