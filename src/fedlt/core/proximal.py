"""Proximal terms: the squared distance of a model's parameters to an anchor (the model received this round, a
global model), which FedProx adds to the local loss and Ditto and RedGrape use the same way."""
from __future__ import annotations

import torch


def proximity(params: dict[str, torch.Tensor], anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over the named tensors of ||w - w_anchor||^2."""
    return sum(((p - anchor[n]) ** 2).sum() for n, p in params.items())


def proximal_term(model: torch.nn.Module, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over the trainable parameters of ||w - w_anchor||^2 (buffers excluded)."""
    return proximity({n: p for n, p in model.named_parameters() if p.requires_grad}, anchor)
