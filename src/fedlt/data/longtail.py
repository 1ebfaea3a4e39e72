"""Long-tailed training sets: pure functions of (labels, settings, seed).

The imbalance ratio is rho = n_max / n_min >= 1 (the FedLoGe code writes its inverse, IF = 0.01 for rho = 100).
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..seeds import Purpose


def check_ratio(rho: float) -> None:
    if not rho >= 1:
        hint = f"; did you mean {1 / rho:g} (the FedLoGe code writes n_min/n_max)?" if 0 < rho < 1 else ""
        raise ConfigError(f"imbalance ratio must be n_max/n_min >= 1, got {rho:g}{hint}")


def exp_profile(num_classes: int, n_max: int, rho: float) -> np.ndarray:
    """n_c = floor(n_max * rho^(-c/(C-1))), class 0 the head."""
    check_ratio(rho)
    c = np.arange(num_classes)
    return np.floor(n_max * rho ** (-c / max(num_classes - 1, 1)) + 1e-9).astype(np.int64)


def step_profile(num_classes: int, n_max: int, rho: float, num_tail: int, seed: int) -> np.ndarray:
    """Binary ('step') imbalance (RedGrape section 4.3, after CLIMB): num_tail randomly chosen classes keep
    floor(n_max / rho) samples, the others keep n_max."""
    check_ratio(rho)
    if not 0 <= num_tail <= num_classes:
        raise ConfigError(f"tail-classes must be between 0 and {num_classes}, got {num_tail}")
    counts = np.full(num_classes, n_max, dtype=np.int64)
    tail = np.random.default_rng([seed, Purpose.TAIL_CLASSES]).choice(num_classes, size=num_tail, replace=False)
    counts[tail] = int(np.floor(n_max / rho))
    return counts


def longtail_indices(labels: np.ndarray, num_classes: int, rho: float, seed: int, profile: str = "exp",
                     n_max: int | None = None, num_tail: int = 3) -> np.ndarray:
    """Indices of a long-tailed subset of a (balanced) training set.

    Each class c keeps a seeded random subset of n_c of its samples. rho = 1 keeps n_max per class. ``n_max``
    (default: the smallest class's size) may exceed a class's size as long as every class holds its n_c.
    ``profile="none"`` keeps every sample (ImageNet-LT, iNaturalist: long-tailed as published).
    """
    labels = np.asarray(labels)
    if profile == "none":  # a dataset that is long-tailed as published: every sample
        return np.arange(len(labels))
    avail = np.bincount(labels, minlength=num_classes)
    top = int(avail.min()) if n_max is None else int(n_max)
    if profile == "exp":
        counts = exp_profile(num_classes, top, rho)
    elif profile == "step":
        counts = step_profile(num_classes, top, rho, num_tail, seed)
    else:
        raise ConfigError(f"unknown long-tail profile {profile!r}; choose exp, step or none")
    if counts.min() < 1:
        raise ConfigError(f"imbalance ratio {rho:g} leaves a class with no samples (n_max {top}); lower it")
    short = np.flatnonzero(counts > avail)
    if len(short):  # n_max above a class's size is fine as long as every class has its n_c (BalanceFL: 3000)
        c = int(short[0])
        raise ConfigError(f"n_max {top}: class {c} should keep {counts[c]} samples but has {avail[c]}; lower --n-max")
    rng = np.random.default_rng([seed, Purpose.LONGTAIL_KEEP])
    keep = [rng.permutation(np.flatnonzero(labels == c))[: counts[c]] for c in range(num_classes)]
    return np.sort(np.concatenate(keep))
