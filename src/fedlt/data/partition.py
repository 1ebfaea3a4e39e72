"""Partitions of a (long-tailed) training set over clients: pure functions of (labels, settings, seed).

Each returns a list of index arrays, one per client, into ``labels`` (``local-longtail`` leaves samples out;
the others use every sample once). Every partition is called with ``groups`` (the sample's natural owner --
writer, user -- or None) and ignores what it does not use.

LongTailLib's generators (``dataset/utils/dataset_utils.py``, PFLlib's with a long-tail layer) are followed
for ``pathological``, ``exdir``, ``local-longtail`` and ``dirichlet --balance``; their random draws come from
our seeded generators instead of the global numpy state. Its ``least_samples`` (a minimum client size that
leaves one test batch after its 75/25 train/test split: min(10 / 0.25, N / 2K)) is :func:`least_samples`.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..registry import DATASETS, PARTITIONS
from ..seeds import Purpose
from .base import capabilities_of


def reads(*names: str, **renamed: str):
    """Declare the run settings (``fedlt.config.RunConfig`` fields, TOML keys, command-line options) that a
    partition reads: ``reads("alpha", min_size="min_client_size")`` passes ``alpha`` as ``alpha=`` and
    ``min_client_size`` as ``min_size=``. The declaration is what :func:`partition_settings` passes, what the
    settings reference says uses each setting, and what decides that ``--balance`` applies to a partition."""
    def deco(fn):
        fn.settings = {**{n: n for n in names}, **renamed}  # keyword -> run setting
        return fn

    return deco


def partition_settings(name: str, run) -> dict:
    """The keyword arguments of partition ``name`` from a run's settings (``run``: a RunConfig, or anything with
    the settings as attributes)."""
    return {kw: getattr(run, setting) for kw, setting in PARTITIONS.get(name).settings.items()}


def partitions_reading(setting: str) -> list[str]:
    """The partitions that read a run setting (``"balance"`` -> ``["dirichlet", "pathological"]``)."""
    return [n for n, fn in PARTITIONS.items() if setting in getattr(fn, "settings", {}).values()]


def least_samples(n: int, num_clients: int) -> int:
    """LongTailLib's minimum client size: int(min(batch_size / (1 - train_ratio), N / K / 2)) with its batch
    size 10 and train ratio 0.75."""
    return int(min(10 / (1 - 0.75), n / num_clients / 2))


def _capped_draw(labels, num_clients: int, num_classes: int, alpha: float, rng, allowed=None) -> list[list[int]]:
    """PFLlib's Dirichlet draw: each class, shuffled, is cut into consecutive shares by p_c ~ Dir(alpha), where
    a client already holding N/K samples, or not ``allowed`` the class ([K, C] mask), gets a zero share; the
    rounding leftovers go to the last client with a share (PFLlib's remainder fix)."""
    n, parts = len(labels), [[] for _ in range(num_clients)]
    for c in range(num_classes):
        idx = rng.permutation(np.flatnonzero(labels == c))
        sizes = np.array([len(q) for q in parts])
        mask = np.ones(num_clients) if allowed is None else allowed[:, c]
        p = rng.dirichlet(np.full(num_clients, alpha)) * mask
        p = p * (sizes < n / num_clients)
        if p.sum() <= 0:  # every eligible client is full: share among the eligible ones
            p = mask.astype(float)
        p = p / p.sum()
        cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
        cuts[np.flatnonzero(p)[-1]:] = len(idx)
        for k, piece in enumerate(np.split(idx, cuts)):
            parts[k] += piece.tolist()
    return parts


def _redraw(draw, tries: int, need: int, what: str) -> list[np.ndarray]:
    for _ in range(max(1, tries)):
        parts = draw()
        if min(len(p) for p in parts) >= need:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ConfigError(f"no {what} partition with every client >= {need} samples in {tries} tries; use fewer "
                      f"clients or a larger --alpha")


@PARTITIONS.register("dirichlet")
@reads("alpha", "balance", min_size="min_client_size")
def dirichlet(labels, num_clients: int, num_classes: int, seed: int, alpha: float = 0.5,
              min_size: int = 0, max_tries: int = 100, balance: bool = False, **_) -> list[np.ndarray]:
    """FedLoGe's Dirichlet partition: per class p_c ~ Dir(alpha), each sample to a client drawn from p_c.

    For each class c, p_c ~ Dir(alpha * 1_K), then every sample of class c goes to a client drawn
    independently from p_c. Clients may get no sample of many classes.

    ``min_size`` > 0 redraws the whole partition until every client holds at least that many samples, at most
    ``max_tries`` times (then a one-line error says to lower it or raise alpha); the official code has no such
    loop (min_size 0).

    ``balance`` (``--balance``): LongTailLib's Dirichlet with balanced client sizes instead (PFLlib's, after
    Yurochkin et al.): each class is cut into consecutive shares by p_c, where a client that already holds N/K
    samples gets a zero share; the whole draw is repeated until every client has ``least_samples`` (or
    ``min_size``, if larger).
    """
    if not alpha > 0:
        raise ConfigError(f"Dirichlet alpha must be > 0, got {alpha:g}")
    labels = np.asarray(labels)
    if min_size * num_clients > len(labels):
        raise ConfigError(f"min-client-size {min_size} x {num_clients} clients exceeds the {len(labels)} samples")
    rng = np.random.default_rng([seed, Purpose.DIRICHLET])
    if balance:
        n = len(labels)
        draw = lambda: _capped_draw(labels, num_clients, num_classes, alpha, rng)  # noqa: E731
        return _redraw(draw, max_tries, max(min_size, least_samples(n, num_clients)), "balanced Dirichlet")
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
@reads("shards_per_client")
def shards(labels, num_clients: int, num_classes: int, seed: int, shards_per_client: int = 2, **_):
    """Sort by label, cut into num_clients * s equal shards, give each client s random shards (McMahan et al.;
    FedDr+'s 'sharding'). A client then holds at most s classes."""
    labels = np.asarray(labels)
    n_shards = num_clients * shards_per_client
    if shards_per_client < 1 or n_shards > len(labels):
        raise ConfigError(f"{num_clients} clients x {shards_per_client} shards needs at least that many samples "
                          f"({len(labels)} available); lower --shards-per-client or --clients")
    rng = np.random.default_rng([seed, Purpose.SHARDS])
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, n_shards)
    perm = rng.permutation(n_shards)
    return [np.sort(np.concatenate([pieces[j] for j in perm[k::num_clients]])) for k in range(num_clients)]


@PARTITIONS.register("iid")
@reads()
def iid(labels, num_clients: int, num_classes: int, seed: int, **_):
    """A uniformly random split into equal-size clients (a reference, no label skew)."""
    rng = np.random.default_rng([seed, Purpose.IID])
    return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), num_clients)]


@PARTITIONS.register("tau")
@reads("tau")
def tau_sampling(labels, num_clients: int, num_classes: int, seed: int, tau: float = 2.0, **_):
    """BalanceFL's tau-sampling (section 6.1.1): n_tau = tau * n_min. Round after round, every client in turn
    draws n_tau samples without replacement from the class with the fewest samples left; if that class has
    fewer than n_tau left it takes them all and the rest from the class with the next fewest, and so on,
    until no sample is left. Tail classes end up on few clients, head classes on all."""
    labels = np.asarray(labels)
    if not tau > 0:
        raise ConfigError(f"tau must be > 0, got {tau:g}")
    rng = np.random.default_rng([seed, Purpose.TAU_SAMPLING])
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


@PARTITIONS.register("pathological")
@reads("classes_per_client", "balance")
def pathological(labels, num_clients: int, num_classes: int, seed: int, classes_per_client: int = 2,
                 balance: bool = False, **_):
    """Pathological non-IID (LongTailLib's pat): each client holds at most --classes-per-client classes.

    Classes are dealt in order: class c goes to the first ceil(K / C * c_k) clients that still have room
    for a class, and its samples are cut, in index order, into one share per such client: equal shares
    (``--balance``) or random ones (each of all but the last drawn uniformly from [max(n/10, least/C), n), n
    = the class's samples / its clients; the last takes the rest). A class left when every client is full is
    not used."""
    labels = np.asarray(labels)
    if not 1 <= classes_per_client <= num_classes:
        raise ConfigError(f"classes-per-client must be between 1 and {num_classes}, got {classes_per_client}")
    rng = np.random.default_rng([seed, Purpose.PATHOLOGICAL])
    least = least_samples(len(labels), num_clients)
    room = np.full(num_clients, classes_per_client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    per_class = int(np.ceil(num_clients / num_classes * classes_per_client))
    for c in range(num_classes):
        chosen = np.flatnonzero(room > 0)[:per_class]
        if len(chosen) == 0:
            break
        idx = np.flatnonzero(labels == c)
        share = len(idx) / len(chosen)
        if balance:
            sizes = [int(share)] * (len(chosen) - 1)
        else:
            low = min(max(share / 10, least / num_classes), max(share - 1, 0))
            sizes = rng.integers(int(low), max(int(share), int(low) + 1), len(chosen) - 1).tolist()
        sizes.append(len(idx) - sum(sizes))
        for k, piece in zip(chosen, np.split(idx, np.cumsum(sizes)[:-1])):
            parts[k].append(piece)
            room[k] -= 1
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


@PARTITIONS.register("exdir")
@reads("alpha", "classes_per_client", min_size="min_client_size")
def extended_dirichlet(labels, num_clients: int, num_classes: int, seed: int, alpha: float = 0.5,
                       classes_per_client: int = 2, min_size: int = 0, max_tries: int = 100, **_):
    """Extended Dirichlet (LongTailLib's exdir; Li et al. 2023, as PFLlib): C classes per client, Dir(alpha).

    Level 1: every client draws ``--classes-per-client`` C distinct classes at random, again until every class
    has at least max(C * K // num_classes // 2, 1) clients. Level 2: each class is cut into consecutive shares
    by p_c ~ Dir(alpha), zero for clients without the class or already holding N/K samples; the draw is
    repeated until every client holds at least 10 samples (or ``min_size``)."""
    labels = np.asarray(labels)
    if not alpha > 0:
        raise ConfigError(f"Dirichlet alpha must be > 0, got {alpha:g}")
    if not 1 <= classes_per_client <= num_classes:
        raise ConfigError(f"classes-per-client must be between 1 and {num_classes}, got {classes_per_client}")
    rng = np.random.default_rng([seed, Purpose.EXTENDED_DIRICHLET])
    need = max(classes_per_client * num_clients // num_classes // 2, 1)
    for _ in range(max(1, max_tries)):
        has = np.zeros((num_clients, num_classes), dtype=bool)
        for k in range(num_clients):
            has[k, rng.choice(num_classes, classes_per_client, replace=False)] = True
        if has.sum(0).min() >= need:
            break
    else:
        raise ConfigError(f"exdir: could not give every class {need} clients in {max_tries} tries; use more clients "
                          f"or more --classes-per-client")
    n = len(labels)
    draw = lambda: _capped_draw(labels, num_clients, num_classes, alpha, rng, has)  # noqa: E731
    return _redraw(draw, max_tries, max(min_size, min(10, n // num_clients)), "exdir")


@PARTITIONS.register("local-longtail")
@reads("alpha", rho="imbalance_ratio")
def local_longtail(labels, num_clients: int, num_classes: int, seed: int, alpha: float = 0.5, rho: float = 100.0,
                   **_):
    """A per-client long tail (LongTailLib's local_longtail): each client long-tailed with --rho.

    Each class is first cut over the clients by Dir(10 alpha) shares (nearly even); then every client with
    more than one class ranks its classes in a random order and keeps, of the i-th, min(held, max(1,
    round(n_k w_i))) random samples, w_i proportional to rho^(-i / (C_k - 1)): its own long tail with
    imbalance ratio rho (``--rho``) over the C_k classes it holds. The others' samples are dropped."""
    from .longtail import check_ratio

    labels = np.asarray(labels)
    check_ratio(rho)
    if not alpha > 0:
        raise ConfigError(f"Dirichlet alpha must be > 0, got {alpha:g}")
    rng = np.random.default_rng([seed, Purpose.LOCAL_LONGTAIL])
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        idx = rng.permutation(np.flatnonzero(labels == c))
        p = rng.dirichlet(np.full(num_clients, alpha * 10))
        for k, piece in enumerate(np.split(idx, (np.cumsum(p) * len(idx)).astype(int)[:-1])):
            parts[k] += piece.tolist()
    out = []
    for own in parts:
        own = np.asarray(own, dtype=np.int64)
        classes = np.unique(labels[own])
        if len(classes) <= 1:
            out.append(np.sort(own))
            continue
        order = rng.permutation(classes)
        w = rho ** (-np.arange(len(order)) / (len(order) - 1))
        target = {c: max(1, int(round(len(own) * wi))) for c, wi in zip(order, w / w.sum())}
        keep = [rng.choice(own[labels[own] == c], size=min(int((labels[own] == c).sum()), target[c]), replace=False)
                for c in classes]
        out.append(np.sort(np.concatenate(keep)))
    return out


@PARTITIONS.register("natural")
@reads()
def natural(labels, num_clients: int, num_classes: int, seed: int, groups=None, **_):
    """The dataset's own clients (FEMNIST's writers, iNaturalist-User's users): K of them at random.

    ``--clients K`` picks K of the dataset's users uniformly at random without replacement (seeded; LEAF's
    sampling picks users at random too); clients keep the users' order in the dataset files and hold all
    of their user's samples."""
    if groups is None:
        owned = ", ".join(n for n, d in DATASETS.items() if capabilities_of(d).natural_groups)
        raise ConfigError(f"partition natural needs a dataset whose samples have owners ({owned}); this one has none")
    groups = np.asarray(groups)
    users = np.unique(groups)
    if num_clients > len(users):
        raise ConfigError(f"--clients {num_clients} but the dataset has {len(users)} users; use at most {len(users)}")
    chosen = np.sort(np.random.default_rng([seed, Purpose.NATURAL]).choice(users, size=num_clients, replace=False))
    order = np.argsort(groups, kind="stable")
    starts = np.searchsorted(groups[order], chosen)
    ends = np.searchsorted(groups[order], chosen, side="right")
    return [np.sort(order[a:b]) for a, b in zip(starts, ends)]


@PARTITIONS.register("file")
@reads()
def from_file(labels, num_clients: int, num_classes: int, seed: int, **_):
    """The clients of a partition file, set by ``--partition-file FILE.json``.

    The file's index lists replace the long-tail subset and the partition (:mod:`fedlt.data.split`)."""
    raise ConfigError("partition file needs --partition-file FILE.json")


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
