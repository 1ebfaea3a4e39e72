"""Aggregation helpers shared by the methods."""
from __future__ import annotations

import torch


def weighted_average(items: list[tuple[dict[str, torch.Tensor], float]], keys=None) -> dict[str, torch.Tensor]:
    """Sample-weighted mean of each named array (FedAvg). Integer buffers (BN's num_batches_tracked) are
    averaged and rounded back to their dtype."""
    if not items:
        return {}
    total = float(sum(w for _, w in items))
    if total <= 0:
        raise ValueError("weighted_average needs a positive total weight")
    names = keys if keys is not None else list(items[0][0].keys())
    out = {}
    for k in names:
        ref = items[0][0][k]
        acc = torch.zeros_like(ref, dtype=torch.float64)
        for arrays, w in items:
            acc.add_(arrays[k].to(torch.float64), alpha=float(w) / total)
        out[k] = acc.round().to(ref.dtype) if not ref.is_floating_point() else acc.to(ref.dtype)
    return out


def delta(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """new - old for the floating-point entries present in both."""
    return {k: new[k] - old[k] for k in new if k in old and new[k].is_floating_point()}
