"""Partitions of a (long-tailed) training set over clients: pure functions of (labels, settings, seed).

Each returns a list of index arrays, one per client, into ``labels``.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..registry import PARTITIONS


@PARTITIONS.register("dirichlet")
def dirichlet(labels, num_clients: int, num_classes: int, seed: int, alpha: float = 0.5,
              min_size: int = 0, max_tries: int = 100, **_) -> list[np.ndarray]:
    """FedLoGe's Dirichlet partition: for each class c, p_c ~ Dir(alpha * 1_K), then every sample of class c
    goes to a client drawn independently from p_c. Clients may get no sample of many classes.

    ``min_size`` > 0 redraws the whole partition until every client holds at least that many samples, at most
    ``max_tries`` times (then a one-line error says to lower it or raise alpha); the official code has no such
    loop (min_size 0).
    """
    if not alpha > 0:
        raise ConfigError(f"Dirichlet alpha must be > 0, got {alpha:g}")
    labels = np.asarray(labels)
    if min_size * num_clients > len(labels):
        raise ConfigError(f"min-client-size {min_size} x {num_clients} clients exceeds the {len(labels)} samples")
    rng = np.random.default_rng([seed, 2])
    for _ in range(max(1, max_tries)):
        owner = np.empty(len(labels), dtype=np.int64)
        for c in range(num_classes):
            idx = np.flatnonzero(labels == c)
            p = rng.dirichlet(np.full(num_clients, alpha))
            owner[idx] = rng.choice(num_clients, size=len(idx), p=p)
        parts = [np.flatnonzero(owner == k) for k in range(num_clients)]
        if min(len(p) for p in parts) >= min_size:
            return parts
    raise ConfigError(f"no Dirichlet partition with every client >= {min_size} samples in {max_tries} tries; "
                      f"lower --min-client-size or raise --alpha")


@PARTITIONS.register("shards")
def shards(labels, num_clients: int, num_classes: int, seed: int, shards_per_client: int = 2, **_):
    """Sort by label, cut into num_clients * s equal shards, give each client s random shards (McMahan et al.;
    FedDr+'s 'sharding'). A client then holds at most s classes."""
    labels = np.asarray(labels)
    n_shards = num_clients * shards_per_client
    if shards_per_client < 1 or n_shards > len(labels):
        raise ConfigError(f"{num_clients} clients x {shards_per_client} shards needs at least that many samples "
                          f"({len(labels)} available); lower --shards-per-client or --clients")
    rng = np.random.default_rng([seed, 3])
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, n_shards)
    perm = rng.permutation(n_shards)
    return [np.sort(np.concatenate([pieces[j] for j in perm[k::num_clients]])) for k in range(num_clients)]


@PARTITIONS.register("iid")
def iid(labels, num_clients: int, num_classes: int, seed: int, **_):
    """A uniformly random split into equal-size clients (a reference, no label skew)."""
    rng = np.random.default_rng([seed, 4])
    return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), num_clients)]


@PARTITIONS.register("tau")
def tau_sampling(labels, num_clients: int, num_classes: int, seed: int, tau: float = 2.0, **_):
    """BalanceFL's tau-sampling (section 6.1.1): n_tau = tau * n_min. Round after round, every client in turn
    draws n_tau samples without replacement from the class with the fewest samples left; if that class has
    fewer than n_tau left it takes them all and the rest from the class with the next fewest, and so on,
    until no sample is left. Tail classes end up on few clients, head classes on all."""
    labels = np.asarray(labels)
    if not tau > 0:
        raise ConfigError(f"tau must be > 0, got {tau:g}")
    rng = np.random.default_rng([seed, 5])
    pools = {c: list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)}
    pools = {c: p for c, p in pools.items() if p}
    n_min = min(len(p) for p in pools.values())
    n_tau = max(1, int(round(tau * n_min)))
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    while pools:
        for k in range(num_clients):
            need = n_tau
            while need > 0 and pools:
                c = min(pools, key=lambda c: (len(pools[c]), c))
                take, pools[c] = pools[c][:need], pools[c][need:]
                parts[k] += take
                need -= len(take)
                if not pools[c]:
                    del pools[c]
            if not pools:
                break
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def partition(name: str, labels, num_clients: int, num_classes: int, seed: int, **kw) -> list[np.ndarray]:
    if num_clients < 1:
        raise ConfigError(f"clients must be >= 1, got {num_clients}")
    if num_clients > len(labels):
        raise ConfigError(f"{num_clients} clients but only {len(labels)} training samples; use fewer clients")
    return PARTITIONS.get(name)(labels, num_clients=num_clients, num_classes=num_classes, seed=seed, **kw)


def count_matrix(labels, parts, num_classes: int) -> np.ndarray:
    """Client-by-class count matrix [K, C]."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts]) if parts else np.zeros((0, num_classes), int)
