"""A federation: the long-tailed training set split over clients, plus the test sets for GM and PM."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from ..errors import ConfigError
from .datasets import Dataset, load_dataset
from .longtail import longtail_indices
from .partition import count_matrix, partition
from .transforms import random_crop_flip, to_float


class Prep:
    """Turns stored samples into model input: normalise, and augment training batches where the dataset does."""

    def __init__(self, mean, std, augment: str = "none", device: str = "cpu"):
        self.mean, self.std, self.augment, self.device = mean, std, augment, device

    def __call__(self, x: torch.Tensor, gen: torch.Generator | None = None, train: bool = False) -> torch.Tensor:
        if train and self.augment == "crop-flip" and gen is not None:
            x = random_crop_flip(x, gen)
        return to_float(x, self.mean, self.std).to(self.device, non_blocking=True)


@dataclass
class ClientData:
    """One client's training data (a copy of its samples) and its own test set (indices into the test set).

    ``counts`` is the client's training label histogram; it stays on the client unless a method sends it.
    """

    client_id: int
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    prep: Prep
    test_x: torch.Tensor
    test_y: torch.Tensor
    test_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __post_init__(self):
        self.counts = np.bincount(self.y.numpy(), minlength=self.num_classes)

    def __len__(self) -> int:
        return len(self.y)

    @property
    def classes(self) -> np.ndarray:
        """Classes present in the client's training data."""
        return np.flatnonzero(self.counts > 0)

    def batches(self, batch_size: int, gen: torch.Generator, epochs: int = 1, shuffle: bool = True,
                train: bool = True, drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Mini-batches (x, y) over ``epochs`` passes, shuffled by ``gen``, gathered and augmented as tensors.

        A pass that would end with a batch of a single sample folds it into the batch before (one batch of
        ``batch_size + 1``): BatchNorm cannot train on one sample, and no sample is left out of the epoch."""
        n = len(self.y)
        stop = n - n % batch_size if drop_last and n >= batch_size else n
        starts = list(range(0, stop, batch_size))
        if len(starts) > 1 and stop - starts[-1] == 1:
            starts.pop()
        ends = starts[1:] + [stop]
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen) if shuffle else torch.arange(n)
            for s, e in zip(starts, ends):
                idx = order[s:e]
                yield self.prep(self.x[idx], gen, train=train), self.y[idx].to(self.prep.device)

    def sample_batch(self, idx: torch.Tensor, gen: torch.Generator | None = None, train: bool = True):
        """A batch of the given local indices (for samplers of a method's own: class-balanced, per class, ...)."""
        return self.prep(self.x[idx], gen, train=train), self.y[idx].to(self.prep.device)

    def test_batches(self, batch_size: int = 1000):
        for s in range(0, len(self.test_y), batch_size):
            yield self.prep(self.test_x[s : s + batch_size]), self.test_y[s : s + batch_size].to(self.prep.device)


@dataclass
class Federation:
    dataset: Dataset
    clients: list[ClientData]
    train_counts: np.ndarray  # [C] long-tailed global training counts
    counts: np.ndarray  # [K, C] client-by-class training counts
    prep: Prep
    settings: dict

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def in_shape(self):
        return self.dataset.in_shape

    def test_batches(self, batch_size: int = 1000):
        x, y = self.dataset.x_test, self.dataset.y_test
        for s in range(0, len(y), batch_size):
            yield self.prep(x[s : s + batch_size]), y[s : s + batch_size].to(self.prep.device)

    def pooled(self) -> ClientData:
        """All clients' training data as one client (for the centralized reference)."""
        x = torch.cat([c.x for c in self.clients])
        y = torch.cat([c.y for c in self.clients])
        return ClientData(-1, x, y, self.num_classes, self.prep, self.dataset.x_test, self.dataset.y_test,
                          np.arange(len(self.dataset.y_test)))

    def summary(self, width: int = 8) -> str:
        """A compact view of the client-by-class count matrix."""
        K, C = self.counts.shape
        lines = [f"long-tailed train set: {int(self.train_counts.sum())} samples, per class "
                 f"{self.train_counts.tolist()} (rho {self.train_counts.max() / max(self.train_counts.min(), 1):.0f})"]
        sizes = self.counts.sum(1)
        present = (self.counts > 0).sum(1)
        lines.append(f"{K} clients: size min {sizes.min()} / median {int(np.median(sizes))} / max {sizes.max()}, "
                     f"classes present min {present.min()} / mean {present.mean():.1f} / max {present.max()}")
        show = list(range(min(K, width)))
        if C <= 20:
            lines.append("client " + " ".join(f"{c:>5d}" for c in range(C)))
            for k in show:
                lines.append(f"{k:>6d} " + " ".join(f"{v:>5d}" for v in self.counts[k]))
            if K > width:
                lines.append(f"   ... ({K - width} more clients in partition.json)")
        return "\n".join(lines)


def client_test_index(counts: np.ndarray, test_y: np.ndarray, seed: int, client_id: int) -> np.ndarray:
    """FedLoGe's local test set: t_c = floor(n_{k,c} / N * n_test) test images of class c, drawn without
    replacement from the balanced test set (capped at what the test set holds), independently per client.
    ``counts`` is the [K, C] matrix; N its total."""
    n_total = counts.sum()
    rng = np.random.default_rng([seed, 6, client_id])
    out = []
    for c, n in enumerate(counts[client_id]):
        t = int(np.floor(n / n_total * len(test_y)))
        if t > 0:
            pool = np.flatnonzero(test_y == c)
            out.append(rng.choice(pool, size=min(t, len(pool)), replace=False))
    return np.sort(np.concatenate(out)) if out else np.zeros(0, np.int64)


def build_federation(dataset: str = "fashion-mnist", data_dir: str | None = None, imbalance_ratio: float = 100.0,
                     lt_profile: str = "exp", tail_classes: int = 3, n_max: int | None = None,
                     partition_name: str = "dirichlet", clients: int = 20, seed: int = 0, device: str = "cpu",
                     partition_kw: dict | None = None, dataset_kw: dict | None = None) -> Federation:
    """Load a dataset, make it long-tailed, split it over clients and draw each client's test set."""
    ds = load_dataset(dataset, data_dir, **(dataset_kw or {}))
    y = ds.y_train.numpy()
    keep = longtail_indices(y, ds.num_classes, imbalance_ratio, seed, lt_profile, n_max, tail_classes)
    ylt = y[keep]
    parts = partition(partition_name, ylt, clients, ds.num_classes, seed, **(partition_kw or {}))
    counts = count_matrix(ylt, parts, ds.num_classes)
    if (counts.sum(1) == 0).any():
        empty = int((counts.sum(1) == 0).sum())
        raise ConfigError(f"{empty} of {clients} clients got no training sample; use fewer clients, a larger "
                          f"--alpha, or --min-client-size 1")
    prep = Prep(ds.mean, ds.std, ds.augment, device)
    test_y = ds.y_test.numpy()
    clients_data = []
    for k, p in enumerate(parts):
        gidx = torch.from_numpy(keep[p])
        tidx = client_test_index(counts, test_y, seed, k)
        t = torch.from_numpy(tidx)
        clients_data.append(ClientData(k, ds.x_train[gidx], ds.y_train[gidx], ds.num_classes, prep,
                                       ds.x_test[t], ds.y_test[t], tidx))
    settings = dict(dataset=dataset, imbalance_ratio=imbalance_ratio, lt_profile=lt_profile,
                    partition=partition_name, clients=clients, seed=seed, **(partition_kw or {}))
    return Federation(ds, clients_data, np.bincount(ylt, minlength=ds.num_classes), counts, prep, settings)
