"""Per-class gradients of a linear head's cross-entropy, in closed form, and how they travel and are averaged.

For logits ``z = W h + b`` and ``p = softmax(z)``, the gradient of ``CE(z, y)`` is ``(p - e_y) h^T`` for ``W``
and ``p - e_y`` for ``b``: no backward pass is needed, and the expression stays differentiable in ``h`` (CReFF
optimises synthetic features through it).

Used by RedGrape (gradient prototypes, Eq. 11, and the local balanced gradients, Eq. 9) and CReFF (the
real-feature gradients clients upload, and the synthetic-feature gradients the server matches to them).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from .method import Message


def head_ce_grads(feats: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  classes: Iterable[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For each class ``c`` in ``classes``: the gradient of ``mean_{i: y_i = c} CE(W h_i + b, c)`` with respect
    to ``W`` and ``b``. Returns ``[k, C, d]`` and ``[k, C]`` (k = number of classes asked for; a class with no
    sample gets zeros)."""
    classes = torch.as_tensor(list(classes), dtype=torch.long, device=feats.device)
    logits = feats @ weight.T
    if bias is not None:
        logits = logits + bias
    r = F.softmax(logits, 1) - F.one_hot(labels, weight.shape[0]).to(feats.dtype)  # [N, C]
    member = (labels[None, :] == classes[:, None]).to(feats.dtype)  # [k, N]
    member = member / member.sum(1, keepdim=True).clamp_min(1)
    gb = member @ r  # [k, C]
    gw = (member[:, :, None] * r[None]).transpose(1, 2) @ feats  # [k, C, N] @ [N, d]
    return gw, gb


def pack_class_grads(prefix: str, classes, gw: torch.Tensor, gb: torch.Tensor) -> dict[str, torch.Tensor]:
    """Message arrays for per-class head gradients: ``{prefix}.classes`` (int64), ``{prefix}.w``, ``{prefix}.b``.
    Everything is an array, so the bytes it costs are counted like the model's."""
    return {f"{prefix}.classes": torch.as_tensor(list(classes), dtype=torch.long, device="cpu"),
            f"{prefix}.w": gw.detach().clone(), f"{prefix}.b": gb.detach().clone()}


def unpack_class_grads(arrays: dict[str, torch.Tensor], prefix: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The inverse of :func:`pack_class_grads` (an empty dict when the arrays carry none)."""
    if f"{prefix}.classes" not in arrays:
        return {}
    cls, gw, gb = arrays[f"{prefix}.classes"], arrays[f"{prefix}.w"], arrays[f"{prefix}.b"]
    return {int(c): (gw[i], gb[i]) for i, c in enumerate(cls.tolist())}


def mean_class_grads(messages: Iterable[Message], prefix: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per class, the unweighted mean of the gradients over the messages that carry that class (RedGrape
    Eq. 15 first case, CReFF's server)."""
    sums: dict[int, list] = {}
    for m in messages:
        for c, (w, b) in unpack_class_grads(m.arrays, prefix).items():
            s = sums.setdefault(c, [torch.zeros_like(w), torch.zeros_like(b), 0])
            s[0] += w
            s[1] += b
            s[2] += 1
    return {c: (w / n, b / n) for c, (w, b, n) in sorted(sums.items())}
