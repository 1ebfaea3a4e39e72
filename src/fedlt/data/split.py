"""Which training samples each client holds: a long-tailed subset split by a partition, or a partition file.

The index space is the dataset's training split in the order fedlt loads it (documented per dataset in
``fedlt list`` / docs/datasets.md: CIFAR's batches in order, the idx files' order, the lines of ImageNet-LT's
``ImageNet_LT_train.txt``, FEMNIST's users in file order then their samples, ...). A run writes the indices
it used into ``partition.json``, which is itself a partition file: ``--partition-file runs/X/partition.json``
re-creates the same clients anywhere. The format::

    {"format": "fedlt-partition/1", "dataset": "cifar10", "index_space": "train", "num_train": 50000,
     "clients": {"0": [12, 7, ...], "1": [...], ...}}

Files from other frameworks may be just the ``clients`` value: ``{"0": [...], ...}`` (client ids as keys,
ordered as numbers when they all are) or a list of index lists. Within a client, samples keep the file's order.
Every index must be in ``0 .. num_train - 1`` and appear once in the whole file.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..decl import show
from ..errors import ConfigError, DataError
from .base import capabilities_of
from .longtail import longtail_indices
from .partition import partition

FORMAT = "fedlt-partition/1"
NATIVE_LT_HINT = "it is long-tailed already: keep every sample with --lt-profile none (its default)"


@dataclass
class Split:
    keep: np.ndarray  # sorted training indices in use
    parts: list[np.ndarray]  # per client: positions into ``keep``, in the client's sample order
    test_index: list[np.ndarray] | None = None  # per client: its own test samples (a natural partition's users)


def leaf_sample_split(n: int, rng: np.random.Generator, frac: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """LEAF's per-user sample split (``split_data.py -t sample``): max(1, int(frac n)) training samples (1 of
    2), the rest for testing; users with fewer than 2 samples are dropped (both lists empty)."""
    if n < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    k = 1 if n == 2 else max(1, int(frac * n))
    train = np.sort(rng.choice(n, size=k, replace=False))
    test = np.ones(n, bool)
    test[train] = False
    return train, np.flatnonzero(test)


def default_lt_profile(dataset: str, partition_name: str, partition_file: str | None) -> str:
    """``exp`` for balanced datasets; ``none`` for datasets that are long-tailed as published (ImageNet-LT,
    iNaturalist, FEMNIST, the IMU set), for ``local-longtail`` (which makes each client long-tailed itself) and
    for partition files (the file says which samples are used)."""
    from ..registry import DATASETS

    native = capabilities_of(DATASETS.get(dataset)).native_lt
    return "none" if native or partition_name == "local-longtail" or partition_file else "exp"


def check_lt_settings(dataset: str, profile: str, partition_name: str, partition_file: str | None) -> None:
    """Reject long-tail settings that make no sense with the dataset, the partition or a partition file."""
    from ..registry import DATASETS

    if profile == "none":
        return
    if capabilities_of(DATASETS.get(dataset)).native_lt and profile in ("exp", "step"):
        raise ConfigError(f"--lt-profile {profile} on {dataset}: {NATIVE_LT_HINT}")
    if partition_file:
        raise ConfigError(f"--lt-profile {profile} with --partition-file: the file decides which samples are used; "
                          f"use --lt-profile none")
    if partition_name == "local-longtail":
        raise ConfigError(f"--lt-profile {profile} with --partition local-longtail: the partition makes each client "
                          f"long-tailed with --rho itself; use --lt-profile none")


def read_partition_file(path: str, num_train: int, dataset: str | None = None) -> list[np.ndarray]:
    """The clients' index arrays of a partition file, checked against the training split's size."""
    from ..jsonutil import read_json

    doc = read_json(path, f"partition file {path}", error=DataError)
    if isinstance(doc, dict) and "clients" in doc:
        if doc.get("dataset") not in (None, dataset):
            raise DataError(f"partition file {path} is for dataset {doc['dataset']!r}, not {dataset!r}")
        if doc.get("num_train") not in (None, num_train):
            raise DataError(f"partition file {path} indexes a training split of {doc['num_train']} samples; "
                            f"{dataset} has {num_train} here (another version or subset of the dataset?)")
        doc = doc["clients"]
    if isinstance(doc, dict):
        keys = list(doc)
        if all(str(k).lstrip("-").isdigit() for k in keys):
            keys.sort(key=int)
        lists = [doc[k] for k in keys]
    elif isinstance(doc, list):
        keys, lists = list(range(len(doc))), doc
    else:
        raise DataError(f"partition file {path}: expected a clients mapping or a list of index lists")
    if not lists:
        raise DataError(f"partition file {path} has no clients")
    out, owner = [], np.full(num_train, -1, dtype=np.int64)
    for k, (key, idx) in enumerate(zip(keys, lists)):
        if not isinstance(idx, list) or not idx or not all(isinstance(i, int) and not isinstance(i, bool) for i in idx):
            raise DataError(f"partition file {path}: client {key} must be a non-empty list of integer indices")
        big = next((i for i in idx if not 0 <= i < num_train), None)
        if big is not None:  # checked before numpy sees it: an int past int64 would not even convert
            raise DataError(f"partition file {path}: client {key} has index {show(big)} outside the training split "
                            f"0..{num_train - 1}")
        a = np.asarray(idx, dtype=np.int64)
        bad = a[(a < 0) | (a >= num_train)]
        if len(bad):
            raise DataError(f"partition file {path}: client {key} has index {bad[0]} outside the training split "
                            f"0..{num_train - 1}")
        uniq, counts = np.unique(a, return_counts=True)
        if (counts > 1).any():
            raise DataError(f"partition file {path}: index {uniq[counts > 1][0]} appears twice in client {key}")
        seen = owner[a] >= 0
        if seen.any():
            i = a[seen][0]
            raise DataError(f"partition file {path}: index {i} is in client {keys[owner[i]]} and client {key}")
        owner[a] = k
        out.append(a)
    return out


def partition_document(dataset: str, num_train: int, train_index: list[np.ndarray]) -> dict:
    """The partition-file fields of ``partition.json``: every client's training indices."""
    return {"format": FORMAT, "dataset": dataset, "index_space": "train", "num_train": int(num_train),
            "clients": {str(k): np.asarray(t).tolist() for k, t in enumerate(train_index)}}


def split_training_set(ds, lt_profile: str | None, imbalance_ratio: float, n_max: int | None, tail_classes: int,
                       partition_name: str, clients: int, seed: int, partition_kw: dict | None = None,
                       partition_file: str | None = None) -> Split:
    """The long-tailed subset and its partition over clients (or the clients of a partition file)."""
    y = ds.y_train.numpy()
    if partition_file:
        lists = read_partition_file(partition_file, len(y), ds.name)
        if len(lists) != clients:
            raise ConfigError(f"partition file {partition_file} has {len(lists)} clients but the run asks for "
                              f"{clients}; leave --clients out or set it to {len(lists)}")
        keep = np.sort(np.concatenate(lists))
        return Split(keep, [np.searchsorted(keep, a) for a in lists])
    profile = lt_profile or default_lt_profile(ds.name, partition_name, None)
    check_lt_settings(ds.name, profile, partition_name, None)
    keep = longtail_indices(y, ds.num_classes, imbalance_ratio, seed, profile,
                            ds.lt_n_max if n_max is None else n_max, tail_classes)
    groups = None if ds.train_groups is None else ds.train_groups[keep]
    parts = partition(partition_name, y[keep], clients, ds.num_classes, seed, groups=groups, **(partition_kw or {}))
    used = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    if len(used) < len(keep):  # a partition that leaves samples out (local-longtail): keep only the used ones
        parts = [np.searchsorted(used, p) for p in parts]
        keep = keep[used]
    test_index = None
    if partition_name == "natural" and ds.test_groups is not None:  # each user's own test samples
        tg = ds.test_groups
        test_index = [np.flatnonzero(tg == ds.train_groups[keep[p[0]]]) if len(p) else np.zeros(0, np.int64)
                      for p in parts]
    return Split(keep, parts, test_index)
