"""Classifier re-training on features: the pieces that methods re-training a head after (or during) federated
training share -- CReFF (on federated features), CCVR (on virtual features drawn from class Gaussians), RUCR (on
mixed-up features), and the methods that read a client's features (RedGrape, BalanceFL).

- :func:`local_features`: a client's training features (eval mode, no augmentation) with their labels;
- :func:`class_statistics`, :func:`pooled_gaussian`, :func:`sample_gaussian`: per-class feature Gaussians, their
  exact pooling over clients (CCVR's Eq. 3-4) and draws from them; :func:`class_gaussians` and
  :func:`draw_class_features`: the same as a client's message and the server's draws from the messages;
- :func:`retrain_head`: mini-batch SGD on a linear head with cross-entropy, the gradient written out;
- :func:`retrained_head_modes`: the inference modes of a model whose head the server re-trained.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..metrics import features
from .method import Predictor


def local_features(backbone: nn.Module, data, batch_size: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (eval mode, no augmentation) of all of a client's training samples, with their labels, computed
    ``batch_size`` samples at a time."""
    return features(backbone, data.batches(batch_size, None, shuffle=False, train=False))


def class_statistics(feats: torch.Tensor, labels: torch.Tensor, classes, biased: bool = False):
    """Per class in ``classes``: count, mean and covariance (1/(n-1), or 1/n with ``biased``) of the features."""
    counts, means, covs = [], [], []
    for c in classes:
        z = feats[labels == c]
        n = z.shape[0]
        mu = z.mean(0)
        zc = z - mu
        denom = n if biased else max(n - 1, 1)
        counts.append(n)
        means.append(mu)
        covs.append(zc.T @ zc / denom)
    dev = feats.device
    return (torch.tensor(counts, dtype=torch.float64, device=dev), torch.stack(means).double(),
            torch.stack(covs).double())


def pooled_gaussian(counts: torch.Tensor, means: torch.Tensor, covs: torch.Tensor):
    """Eq. 3-4: the mean and covariance of the union of K groups from their counts [K], means [K, d] and
    unbiased covariances [K, d, d]."""
    N = counts.sum()
    mu = (counts[:, None] * means).sum(0) / N
    if N <= 1:
        return mu, torch.zeros_like(covs[0])
    cov = ((counts - 1)[:, None, None] * covs).sum(0) / (N - 1)
    cov = cov + torch.einsum("k,ki,kj->ij", counts, means, means) / (N - 1) - N / (N - 1) * torch.outer(mu, mu)
    return mu, cov


def sample_gaussian(mu: torch.Tensor, cov: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` draws from N(mu, cov) through the eigendecomposition of the (symmetrised) covariance."""
    lam, Q = torch.linalg.eigh((cov + cov.T) / 2)
    eps = torch.randn(n, mu.shape[0], generator=gen, dtype=mu.dtype, device="cpu").to(mu.device)
    return mu + (eps * lam.clamp_min(0).sqrt()) @ Q.T


def class_gaussians(backbone: nn.Module, data, prefix: str, biased: bool = False, batch_size: int = 1000
                    ) -> dict[str, torch.Tensor]:
    """A client's message of per-class feature Gaussians (CCVR's upload, DFL-FS's stage 2): for every class it
    holds, the count, mean and covariance of its features under ``backbone`` (:func:`local_features`), as arrays
    ``{prefix}.classes``, ``.count``, ``.mean``, ``.cov`` -- never a sample."""
    with torch.no_grad():
        f, y = local_features(backbone, data, batch_size)
    held = data.classes.tolist()
    n, mu, cov = class_statistics(f, y, held, biased)
    return {f"{prefix}.classes": torch.as_tensor(held, dtype=torch.long, device=f.device),
            f"{prefix}.count": n.float(), f"{prefix}.mean": mu.float(), f"{prefix}.cov": cov.float()}


def draw_class_features(messages, prefix: str, per_class: int, gen: torch.Generator, device,
                        pool=pooled_gaussian) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Virtual features from the clients' :func:`class_gaussians`: per class (in class order) the clients'
    statistics pooled by ``pool`` (default the exact pooling, CCVR's Eq. 3-4) and ``per_class`` draws from the
    Gaussian (:func:`sample_gaussian` with ``gen``). (features [n, d], labels [n]); None when nobody sent any."""
    per: dict[int, list] = {}
    for m in messages:
        a = m.arrays
        for i, c in enumerate(a[f"{prefix}.classes"].tolist()):
            per.setdefault(c, []).append((a[f"{prefix}.count"][i], a[f"{prefix}.mean"][i], a[f"{prefix}.cov"][i]))
    feats, labels = [], []
    for c in sorted(per):
        counts = torch.stack([t[0] for t in per[c]]).double()
        mu, cov = pool(counts, torch.stack([t[1] for t in per[c]]).double(), torch.stack([t[2] for t in per[c]]).double())
        feats.append(sample_gaussian(mu, cov, per_class, gen).float())
        labels.append(torch.full((per_class,), c, dtype=torch.long, device=device))
    return (torch.cat(feats).to(device), torch.cat(labels)) if feats else None


def retrained_head_modes(model, head: dict | None, name: str) -> dict[str, Predictor]:
    """Inference modes of a model whose classifier the server re-trained after training (CCVR, RUCR): ``name``,
    the model's backbone under the re-trained head ``{"head.weight", "head.bias"}`` when there is one, then
    ``fedavg``, the model's own head."""
    modes = {}
    if head is not None:
        modes[name] = Predictor(model.backbone, lambda h: F.linear(h, head["head.weight"], head["head.bias"]),
                                shared_backbone=True)
    modes["fedavg"] = Predictor(model.backbone, model.head, shared_backbone=True)
    return modes


@torch.no_grad()
def retrain_head(feats: torch.Tensor, labels: torch.Tensor, head: nn.Linear, epochs: int, lr: float,
                 batch_size: int, gen: torch.Generator, momentum: float = 0.0, weight_decay: float = 0.0) -> nn.Linear:
    """Train ``head`` with CE on (feats, labels) by mini-batch SGD (torch.optim.SGD's update, with optional
    momentum and weight decay on both W and b), shuffled each epoch. The CE gradient of a linear layer is written
    out (batch mean of (p - e_y) h^T), which is the same update autograd would give at a fraction of the per-step
    overhead. Used by CReFF, CCVR and RUCR."""
    W, b = head.weight, head.bias
    n, C = len(labels), W.shape[0]
    onehot = F.one_hot(labels, C).to(feats.dtype)
    bufs = None
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen, device="cpu").to(feats.device)
        for s in range(0, n, batch_size):
            i = order[s:s + batch_size]
            h = feats[i]
            r = (F.softmax(h @ W.T + b, 1) - onehot[i]) / len(i)
            gw, gb = r.T @ h, r.sum(0)
            if weight_decay:
                gw, gb = gw + weight_decay * W, gb + weight_decay * b
            if momentum:
                bufs = (gw, gb) if bufs is None else (bufs[0].mul_(momentum).add_(gw), bufs[1].mul_(momentum).add_(gb))
                gw, gb = bufs
            W.sub_(lr * gw)
            b.sub_(lr * gb)
    return head
