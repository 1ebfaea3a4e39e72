"""Differentiable Siamese Augmentation (DSA; Zhao & Bilen, "Dataset Condensation with Differentiable Siamese
Augmentation", ICML 2021), as CReFF's official code applies it to the real batches whose classifier gradients the
clients upload (``Dataset/param_aug.py`` of shangxinyi/CReFF-FL, strategy ``color_crop_cutout_flip_scale_rotate``,
mode "S").

Mode "S": one transformation group of the strategy is drawn uniformly per call, and its random parameters are
drawn once per call and shared by every image of the batch (the "Siamese" part: in dataset condensation the same
draw is applied to the real and the synthetic batch). Every operation is a differentiable tensor operation:

- color: brightness x + (b - 1/2) * 1.0, then saturation (x - channel mean) * 2 s + channel mean, then contrast
  (x - image mean) * (c + 0.5) + image mean (b, s, c ~ U[0, 1));
- crop: a translation by up to 12.5 % of the size in each direction (integers), zeros shifted in;
- cutout: a square of half the size (clipped at the border) set to 0;
- flip: left-right with probability 0.5;
- scale: x and y scaled by factors in [1/1.2, 1.2] (bilinear, zeros outside);
- rotate: by an angle in [-15, 15] degrees (bilinear, zeros outside).

All draws come from the caller's CPU generator (the official code re-seeds the global RNG from the clock).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

STRATEGY = ("color", "crop", "cutout", "flip", "scale", "rotate")


def _u(gen: torch.Generator) -> float:
    return float(torch.rand((), generator=gen, device="cpu"))


def _affine(x: torch.Tensor, a: float, b: float, c: float, d: float) -> torch.Tensor:
    theta = torch.tensor([[a, b, 0.0], [c, d, 0.0]], dtype=x.dtype, device=x.device).expand(x.shape[0], 2, 3)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, align_corners=False)


def _color(x, gen):
    x = x + (_u(gen) - 0.5) * 1.0
    m = x.mean(dim=1, keepdim=True)
    x = (x - m) * (_u(gen) * 2.0) + m
    m = x.mean(dim=(1, 2, 3), keepdim=True)
    return (x - m) * (_u(gen) + 0.5) + m


def _crop(x, gen):
    H, W = x.shape[-2:]
    sh, sw = int(H * 0.125 + 0.5), int(W * 0.125 + 0.5)
    tx = int(torch.randint(-sh, sh + 1, (), generator=gen, device="cpu"))
    ty = int(torch.randint(-sw, sw + 1, (), generator=gen, device="cpu"))
    out = torch.zeros_like(x)  # out[i, j] = x[i + tx, j + ty] where that exists
    rs, re = max(0, -tx), min(H, H - tx)
    cs, ce = max(0, -ty), min(W, W - ty)
    if rs < re and cs < ce:
        out[..., rs:re, cs:ce] = x[..., rs + tx:re + tx, cs + ty:ce + ty]
    return out


def _cutout(x, gen):
    H, W = x.shape[-2:]
    sh, sw = int(H * 0.5 + 0.5), int(W * 0.5 + 0.5)
    ox = int(torch.randint(0, H + (1 - sh % 2), (), generator=gen, device="cpu"))
    oy = int(torch.randint(0, W + (1 - sw % 2), (), generator=gen, device="cpu"))
    r0, c0 = ox - sh // 2, oy - sw // 2
    mask = torch.ones(H, W, dtype=x.dtype, device=x.device)
    mask[max(r0, 0):min(r0 + sh, H), max(c0, 0):min(c0 + sw, W)] = 0
    return x * mask


def _flip(x, gen):
    return x.flip(3) if _u(gen) < 0.5 else x


def _scale(x, gen):
    sx = _u(gen) * (1.2 - 1 / 1.2) + 1 / 1.2
    sy = _u(gen) * (1.2 - 1 / 1.2) + 1 / 1.2
    return _affine(x, sx, 0.0, 0.0, sy)


def _rotate(x, gen):
    t = (_u(gen) - 0.5) * 2 * 15.0 / 180 * math.pi
    return _affine(x, math.cos(t), -math.sin(t), math.sin(t), math.cos(t))


OPS = {"color": _color, "crop": _crop, "cutout": _cutout, "flip": _flip, "scale": _scale, "rotate": _rotate}


def siamese_augment(x: torch.Tensor, gen: torch.Generator, strategy=STRATEGY) -> torch.Tensor:
    """One DSA call in mode "S": a group of ``strategy`` drawn uniformly, applied with one draw of its parameters
    to the whole batch ``x`` [B, C, H, W]."""
    op = strategy[int(torch.randint(len(strategy), (), generator=gen, device="cpu"))]
    return OPS[op](x, gen).contiguous()
