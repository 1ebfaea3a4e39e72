"""A federation: the long-tailed training set split over clients, plus the test sets for GM and PM."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from ..errors import ConfigError
from ..seeds import Purpose
from .base import Dataset
from .datasets import load_dataset
from .split import default_lt_profile, leaf_sample_split, split_training_set
from .transforms import apply_augment, draw_augment, to_device, to_float


def placement(nbytes: int, device: str, mode: str = "auto", free_bytes: int | None = None,
              budget: float = 0.25) -> str:
    """Where a federation's sample tensors live: "device" (moved once, batches are gathered there) or "host"
    (kept in host memory, or memory-mapped; each batch is gathered on the host, pinned and copied to the
    device without blocking). ``mode``: "device" or "host" forces it; "auto" puts them on the device when they
    take at most ``budget`` (a quarter) of its free memory, leaving the rest to models and activations. On a
    CPU, "auto" says "host": the dataset's tensors (perhaps memory-mapped) are used in place, nothing copied."""
    if mode not in ("auto", "device", "host"):
        raise ConfigError(f"unknown data placement {mode!r}; choose auto, device or host")
    if mode != "auto":
        return mode
    if not str(device).startswith("cuda"):
        return "host"
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(torch.device(device))[0]
    return "device" if nbytes <= budget * free_bytes else "host"


class Ragged:
    """A list of integer arrays kept as one array and offsets (what K clients' index lists cost: their indices,
    not K arrays)."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    @classmethod
    def of(cls, arrays: list[np.ndarray]) -> "Ragged":
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([len(a) for a in arrays], out=offsets[1:])
        flat = np.concatenate(arrays).astype(np.int64, copy=False) if arrays else np.zeros(0, np.int64)
        return cls(flat, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, k: int) -> np.ndarray:
        return self.flat[self.offsets[k]:self.offsets[k + 1]]

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def of_sizes(cls, flat: np.ndarray, sizes: np.ndarray) -> "Ragged":
        offsets = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return cls(flat, offsets)

    def count_matrix(self, labels: np.ndarray, num_classes: int) -> np.ndarray:
        """[K, C]: how many of each array's indices have each label (one bincount, not K)."""
        owner = np.repeat(np.arange(len(self), dtype=np.int64), self.sizes())
        flat = np.bincount(owner * num_classes + np.asarray(labels)[self.flat], minlength=len(self) * num_classes)
        return flat.reshape(len(self), num_classes)


class Clients(Sequence):
    """A federation's clients as :class:`ClientData` views made when a client is needed (and the most recently
    used ``cache`` of them kept), so a population of 100,000 costs its index arrays, not 100,000 objects."""

    def __init__(self, make: Callable[[int], "ClientData"], n: int, cache: int = 1024):
        self._make, self._n, self._cache = make, n, cache
        self._views: OrderedDict[int, ClientData] = OrderedDict()

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._n))]
        k = int(k)
        if k < 0:
            k += self._n
        if not 0 <= k < self._n:
            raise IndexError(f"client {k} of {self._n}")
        view = self._views.get(k)
        if view is None:
            view = self._views[k] = self._make(k)
            if len(self._views) > self._cache:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(k)
        return view


class Prep:
    """Turns stored samples into model input on the compute device: move, augment training batches where the
    dataset does (on the device, with the caller's CPU generator), normalise."""

    def __init__(self, mean, std, augment: str = "none", device: str = "cpu"):
        self.mean, self.std, self.augment, self.device = mean, std, augment, device
        self._norm: tuple[torch.Tensor, torch.Tensor] | None = None  # mean/std on the device, made once
        self._device = torch.device(device)

    def __call__(self, x: torch.Tensor, draws: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """``x`` ready for the model: moved, augmented with ``draws`` (:meth:`draw`; None: the evaluation
        transform, none or a centre crop), normalised."""
        if x.device != self._device:
            x = to_device(x, self._device)
        x = apply_augment(x, self.augment, draws)
        if self._norm is None:
            self._norm = tuple(torch.tensor(v, dtype=torch.float32, device=self.device) for v in (self.mean, self.std))
        return to_float(x, *self._norm)

    def draw(self, b: int, gen: torch.Generator, hw: tuple[int, int]) -> tuple[torch.Tensor, ...] | None:
        """The augmentation's random draws for ``b`` training samples of size ``hw`` (None: no augmentation)."""
        return draw_augment(self.augment, b, gen, hw)


class ClientData:
    """One client's training data and its own test set.

    ``x``/``y`` (and ``test_x``/``test_y``) are either the client's own samples, or -- with ``rows`` (and
    ``test_rows``) -- a store shared by every client of a federation and the rows of this client's samples in
    it (a long tensor on the store's device). A federation builds the second kind: the samples exist once,
    on the device when they fit (see :func:`placement`), and batches are gathered from the store. Labels of
    the client's own samples are kept on the CPU as ``y``/``test_y`` (samplers and counts read them);
    ``counts`` is the client's training label histogram, which stays on the client unless a method sends it.
    ``train_index``/``test_index``: the global indices of the client's samples in the dataset's training and
    test splits (for partition files and reports).
    """

    def __init__(self, client_id: int, x: torch.Tensor, y: torch.Tensor, num_classes: int, prep: Prep,
                 test_x: torch.Tensor, test_y: torch.Tensor, test_index: np.ndarray | None = None, *,
                 rows: torch.Tensor | None = None, test_rows: torch.Tensor | None = None,
                 train_index: np.ndarray | None = None, tests_on_test_set: bool = True):
        self.client_id, self.num_classes, self.prep = client_id, num_classes, prep
        self.tests_on_test_set = tests_on_test_set  # test_index: rows of the dataset's test split (else: own data)
        self._x, self._y, self.rows = x, y, rows
        self._tx, self._ty, self.test_rows = test_x, test_y, test_rows
        self.y = (y if rows is None else y[rows]).to("cpu")
        self.test_y = (test_y if test_rows is None else test_y[test_rows]).to("cpu")
        self.test_index = np.arange(len(self.test_y)) if test_index is None else np.asarray(test_index)
        self.train_index = np.arange(len(self.y)) if train_index is None else np.asarray(train_index)
        self.counts = np.bincount(self.y.numpy(), minlength=self.num_classes)

    def __len__(self) -> int:
        return len(self.y)

    @property
    def x(self) -> torch.Tensor:
        """The client's own samples (gathered from the store; for tests and tools, not for training loops)."""
        return self._x if self.rows is None else self._x[self.rows]

    @property
    def test_x(self) -> torch.Tensor:
        return self._tx if self.test_rows is None else self._tx[self.test_rows]

    @property
    def classes(self) -> np.ndarray:
        """Classes present in the client's training data."""
        return np.flatnonzero(self.counts > 0)

    def _store_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Rows of the store for local sample indices (a CPU long tensor), on the store's device."""
        local = to_device(local, self._x.device)
        return local if self.rows is None else self.rows[local]

    def batches(self, batch_size: int, gen: torch.Generator, epochs: int = 1, shuffle: bool = True,
                train: bool = True, drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Mini-batches (x, y) over ``epochs`` passes, shuffled by ``gen``, gathered and augmented as tensors.

        A pass that would end with a batch of a single sample folds it into the batch before (one batch of
        ``batch_size + 1``): BatchNorm cannot train on one sample, and no sample is left out of the epoch.
        The order of an epoch is drawn on the CPU (from ``gen``) and moved to the store once per epoch."""
        for rows, draws in self.plan(batch_size, gen, epochs, shuffle, train, drop_last):
            yield self.load(rows, draws)

    def plan(self, batch_size: int, gen: torch.Generator | None, epochs: int = 1, shuffle: bool = True,
             train: bool = True, drop_last: bool = False):
        """What :meth:`batches` yields, before anything is gathered: per batch, the rows of the store (on the
        store's device) and the augmentation draws (CPU; None without augmentation), drawn from ``gen`` in the
        order :meth:`batches` draws them. :meth:`load` gathers one batch; the batched executor concatenates the
        plans of many clients that share a store and loads them with one gather."""
        bounds = batch_bounds(len(self.y), batch_size, drop_last)
        n = len(self.y)
        for _ in range(epochs):
            order = torch.randperm(n, generator=gen, device="cpu") if shuffle else torch.arange(n, device="cpu")
            order = self._store_rows(order)
            for s, e in bounds:
                yield order[s:e], self._draws(e - s, gen, train)

    def _draws(self, b: int, gen: torch.Generator | None, train: bool):
        """A training batch's augmentation draws from ``gen`` (None when not training or without a generator)."""
        return self.prep.draw(b, gen, tuple(self._x.shape[-2:])) if train and gen is not None else None

    def load(self, rows: torch.Tensor, draws: tuple[torch.Tensor, ...] | None = None):
        """The batch (x, y) of store rows, augmented with ``draws`` (None: not augmented)."""
        return self.prep(self._x[rows], draws=draws), self._y[rows].to(self.prep.device, non_blocking=True)

    def sample_batch(self, idx: torch.Tensor, gen: torch.Generator | None = None, train: bool = True):
        """A batch of the given local indices (for samplers of a method's own: class-balanced, per class, ...)."""
        rows = self._store_rows(idx)
        return self.load(rows, self._draws(len(rows), gen, train))

    def test_batches(self, batch_size: int = 1000):
        n = len(self.test_y)
        rows = torch.arange(n, device="cpu") if self.test_rows is None else self.test_rows
        for s in range(0, n, batch_size):
            r = rows[s: s + batch_size].to(self._tx.device, non_blocking=True)
            yield self.prep(self._tx[r]), self._ty[r].to(self.prep.device, non_blocking=True)


def batch_bounds(n: int, batch_size: int, drop_last: bool = False) -> list[tuple[int, int]]:
    """(start, end) of the batches of one pass over n samples (see :meth:`ClientData.batches`)."""
    stop = n - n % batch_size if drop_last and n >= batch_size else n
    starts = list(range(0, stop, batch_size))
    if len(starts) > 1 and stop - starts[-1] == 1:
        starts.pop()
    return list(zip(starts, starts[1:] + [stop]))


@dataclass
class Federation:
    dataset: Dataset
    clients: list[ClientData]
    train_counts: np.ndarray  # [C] long-tailed global training counts
    counts: np.ndarray  # [K, C] client-by-class training counts
    prep: Prep
    settings: dict
    test_x: torch.Tensor | None = None  # the balanced test set, on the store's device (None: the dataset's)
    test_y: torch.Tensor | None = None
    where: str = "device"  # placement of the sample store: "device" or "host"
    layout: tuple | None = None  # (kept training indices, clients' positions in them, test indices): Ragged

    def train_indices(self) -> list[np.ndarray]:
        """Every client's training samples, as indices of the dataset's training split."""
        if self.layout is not None:
            keep, train, _ = self.layout
            return [keep[train[k]] for k in range(len(train))]
        return [c.train_index for c in self.clients]

    def test_sizes(self) -> list[int]:
        """How many test samples each client has."""
        if self.layout is not None:
            return self.layout[2].sizes().tolist()
        return [len(c.test_y) for c in self.clients]

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def in_shape(self):
        return self.dataset.in_shape

    def test_batches(self, batch_size: int = 1000):
        x = self.dataset.x_test if self.test_x is None else self.test_x
        y = self.dataset.y_test if self.test_y is None else self.test_y
        for s in range(0, len(y), batch_size):
            yield self.prep(x[s : s + batch_size]), y[s : s + batch_size].to(self.prep.device, non_blocking=True)

    def pooled(self) -> ClientData:
        """All clients' training data as one client (for the centralized reference)."""
        c0 = self.clients[0]
        rows = torch.cat([c.rows for c in self.clients])
        return ClientData(-1, c0._x, c0._y, self.num_classes, self.prep, c0._tx, c0._ty,
                          np.arange(len(c0._ty)), rows=rows,
                          train_index=np.concatenate([c.train_index for c in self.clients]))

    def summary(self, width: int = 8) -> str:
        """A compact view of the client-by-class count matrix."""
        K, C = self.counts.shape
        tc = self.train_counts.tolist()
        per_class = str(tc) if C <= 40 else f"[{', '.join(map(str, tc[:8]))}, ..., {', '.join(map(str, tc[-4:]))}]"
        lines = [f"long-tailed train set: {int(self.train_counts.sum())} samples, per class "
                 f"{per_class} (rho {self.train_counts.max() / max(self.train_counts.min(), 1):.0f})"]
        sizes = self.counts.sum(1)
        present = (self.counts > 0).sum(1)
        lines.append(f"{K} clients: size min {sizes.min()} / median {int(np.median(sizes))} / max {sizes.max()}, "
                     f"classes present min {present.min()} / mean {present.mean():.1f} / max {present.max()}")
        show = list(range(min(K, width)))
        if C <= 20:
            lines.append("client " + " ".join(f"{c:>5d}" for c in range(C)))
            for k in show:
                lines.append(f"{k:>6d} " + " ".join(f"{v:>5d}" for v in self.counts[k]))
        else:  # many classes: each shown client's largest classes, class:count
            lines.append("client  class:count, largest first")
            for k in show:
                nz = np.flatnonzero(self.counts[k])
                top = nz[np.argsort(-self.counts[k][nz], kind="stable")]
                lines.append(f"{k:>6d}  " + ", ".join(f"{c}:{self.counts[k][c]}" for c in top[:12]) +
                             (f", ... ({len(top) - 12} more classes)" if len(top) > 12 else ""))
        if K > width:
            lines.append(f"   ... ({K - width} more clients in partition.json)")
        return "\n".join(lines)


def _normalise_once(ds: Dataset, n: int, device: str, mode: str) -> bool:
    """Whether a device store keeps its samples normalised (float32) rather than as stored (uint8): for datasets
    without augmentation (which works on the stored pixels), when the float copy still fits the placement budget
    (forced ``device`` on a CPU: always). Each batch is then a plain gather, with no conversion per step."""
    if ds.augment != "none" or ds.x_train.dtype != torch.uint8 or not len(ds.x_train):
        return False
    nbytes = n * ds.x_train[0].numel() * 4
    return placement(nbytes, device, "auto" if str(device).startswith("cuda") else mode) == "device"


def rows_to(t: torch.Tensor, rows: torch.Tensor | None, device, chunk_bytes: int = 1 << 26,
            prep: Prep | None = None) -> torch.Tensor:
    """``t[rows]`` (all rows for None) on ``device``, gathered and copied a chunk of about 64 MB at a time: a
    memory-mapped dataset is never copied whole into host memory on its way to the GPU. With ``prep``: the rows
    normalised to float32 as ``prep`` would normalise each batch (:func:`to_float`), chunk by chunk."""
    n = len(t) if rows is None else len(rows)
    out = torch.empty((n, *t.shape[1:]), dtype=t.dtype if prep is None else torch.float32, device=device)
    step = max(1, chunk_bytes // max(t[0].numel() * t.element_size(), 1)) if len(t) else 1
    for s in range(0, n, step):
        part = (t[s:s + step] if rows is None else t[rows[s:s + step]]).to(device)
        out[s:s + len(part)] = part if prep is None else to_float(part, prep.mean, prep.std)
    return out


def client_test_index(counts: np.ndarray, test_y: np.ndarray, seed: int, client_id: int,
                      pools: list[np.ndarray] | None = None, n_total: int | None = None) -> np.ndarray:
    """FedLoGe's local test set: t_c = floor(n_{k,c} / N * n_test) test images of class c, drawn without
    replacement from the balanced test set (capped at what the test set holds), independently per client.
    ``counts`` is the [K, C] matrix; N its total (``n_total``, summed once for all clients). ``pools``: each
    class's test indices (:func:`class_pools`), found once for all clients."""
    n_total = counts.sum() if n_total is None else n_total
    out = []
    rng = None
    for c, n in enumerate(counts[client_id]):
        t = int(np.floor(n / n_total * len(test_y)))
        if t > 0:
            rng = rng or np.random.default_rng([seed, Purpose.LOCAL_TEST, client_id])
            pool = pools[c] if pools is not None else np.flatnonzero(test_y == c)
            out.append(rng.choice(pool, size=min(t, len(pool)), replace=False))
    return np.sort(np.concatenate(out)) if out else np.zeros(0, np.int64)


def class_pools(y: np.ndarray, num_classes: int) -> list[np.ndarray]:
    """The indices of each class's samples in ``y``."""
    order = np.argsort(y, kind="stable")
    return np.split(order, np.cumsum(np.bincount(y, minlength=num_classes))[:-1])


def own_test_split(part: np.ndarray, fraction: float, seed: int, client_id: int) -> tuple[np.ndarray, np.ndarray]:
    """LEAF's per-user split of one client's samples (:func:`~fedlt.data.split.leaf_sample_split`, seeded per
    client): a client with at least 2 samples keeps ``max(1, floor((1 - fraction) n))`` of them for training
    and tests on the rest; a client with fewer keeps its sample for training and has no test set (LEAF drops
    such users; fedlt keeps every client). Returns (train, test), each in the client's sample order."""
    if fraction <= 0 or len(part) < 2:
        return part, part[:0]
    rng = np.random.default_rng([seed, Purpose.OWN_TEST_SPLIT, client_id])
    train, test = leaf_sample_split(len(part), rng, 1 - fraction)
    return part[train], part[test]


def own_test_splits(parts: Ragged, fraction: float, seed: int) -> tuple[Ragged, Ragged]:
    """:func:`own_test_split` of every client, as (train, test) ragged arrays: a mask over the flat indices,
    no array per client kept (at 100,000 clients, 200,000 of them were)."""
    sizes, offsets = parts.sizes(), parts.offsets
    test = np.zeros(len(parts.flat), bool)
    for k in np.flatnonzero(sizes >= 2):
        rng = np.random.default_rng([seed, Purpose.OWN_TEST_SPLIT, int(k)])
        _, t = leaf_sample_split(int(sizes[k]), rng, 1 - fraction)
        test[offsets[k] + t] = True
    before = np.concatenate([[0], np.cumsum(test)])
    n_test = before[offsets[1:]] - before[offsets[:-1]]
    return Ragged.of_sizes(parts.flat[~test], sizes - n_test), Ragged.of_sizes(parts.flat[test], n_test)


def check_clients(parts, clients: int, partition: str | None = None) -> None:
    """Every client holds at least one training sample (else a one-line ConfigError saying what to change: fewer
    clients, or the settings that ``partition`` reads, as it declares them)."""
    empty = int((parts.sizes() == 0).sum()) if isinstance(parts, Ragged) else sum(len(p) == 0 for p in parts)
    if empty:
        from ..registry import PARTITIONS

        read = sorted(set(getattr(PARTITIONS.get(partition), "settings", {}).values())) if partition else []
        how = {"alpha": "a larger --alpha", "min_client_size": "--min-client-size 1",
               "partition_args": "other partition arguments (--set partition.KEY=VALUE)"}
        advice = [how.get(s, "--" + s.replace("_", "-") + " (another value)") for s in read if s != "balance"]
        raise ConfigError(f"{empty} of {clients} clients got no training sample"
                          + (f" from the {partition} partition" if partition else "") + "; use fewer clients"
                          + "".join(f", or {a}" for a in advice))


class ClientViews:
    """Client ``k``'s :class:`ClientData` from the federation's store: its rows (``parts[k]``) and test rows
    (``tests[k]``: of its own samples where ``own``, else of the test set). ``device`` set: the store is the
    long-tailed subset on that device, and rows are positions in it; None: rows of the dataset's own tensors. A
    plain object (not a closure), so a federation can be pickled: the worker processes that start by ``spawn``
    (``fedlt.engine.workers``) receive it once."""

    def __init__(self, parts, tests, own: bool, src, test, num_classes: int, prep, keep, device):
        self.parts, self.tests, self.own, self.src, self.test = parts, tests, own, src, test
        self.num_classes, self.prep, self.keep, self.device = num_classes, prep, keep, device

    def rows_of(self, p) -> torch.Tensor:
        if self.device is not None:  # positions in the subset
            return torch.from_numpy(p).to(self.device)
        return torch.from_numpy(self.keep[p])  # rows of the dataset

    def __call__(self, k: int) -> ClientData:
        p, t = self.parts[k], self.tests[k]
        if self.own:  # test samples from the client's own data, in the training store
            return ClientData(k, *self.src, self.num_classes, self.prep, *self.src, self.keep[t],
                              rows=self.rows_of(p), test_rows=self.rows_of(t), train_index=self.keep[p],
                              tests_on_test_set=False)
        return ClientData(k, *self.src, self.num_classes, self.prep, *self.test, t, rows=self.rows_of(p),
                          test_rows=torch.from_numpy(t).to(self.test[0].device), train_index=self.keep[p])


def build_federation(dataset: str = "fashion-mnist", data_dir: str | None = None, imbalance_ratio: float = 100.0,
                     lt_profile: str | None = "exp", tail_classes: int = 3, n_max: int | None = None,
                     partition_name: str = "dirichlet", clients: int = 20, seed: int = 0, device: str = "cpu",
                     partition_kw: dict | None = None, dataset_kw: dict | None = None,
                     placement_mode: str = "auto", partition_file: str | None = None,
                     client_test_fraction: float = 0.0) -> Federation:
    """Load a dataset, make it long-tailed, split it over clients (or take the clients of a partition file,
    see :mod:`fedlt.data.split`) and draw each client's test set. The samples are stored once (see
    :func:`placement`); clients hold rows into that store. ``lt_profile`` None: the dataset's default.

    ``client_test_fraction`` F > 0: each client's test set is a fraction F of its own samples
    (:func:`own_test_split`, LEAF's per-user split), taken out of its training data, instead of its share of
    the balanced test set (or, for a natural partition, its own test samples); the balanced test set stays
    GM's."""
    if not 0 <= client_test_fraction < 1:
        raise ConfigError(f"client-test-fraction must be in [0, 1), got {client_test_fraction:g}")
    ds = load_dataset(dataset, data_dir, **(dataset_kw or {}))
    y = ds.y_train.numpy()
    sp = split_training_set(ds, lt_profile, imbalance_ratio, n_max, tail_classes, partition_name, clients, seed,
                            partition_kw, partition_file)
    keep, parts = sp.keep, Ragged.of(sp.parts)
    sp.parts = None
    own_tests = None
    if client_test_fraction > 0:
        parts, own_tests = own_test_splits(parts, client_test_fraction, seed)
    lt_profile = lt_profile or default_lt_profile(dataset, partition_name, partition_file)
    ylt = y[keep]
    counts = parts.count_matrix(ylt, ds.num_classes)
    check_clients(parts, clients, partition_name)
    prep = Prep(ds.mean, ds.std, ds.augment, device)
    test_y = ds.y_test.numpy()
    row_bytes = lambda t: t[0].numel() * t.element_size() + 8 if len(t) else 0  # noqa: E731  (sample + label)
    where = placement(len(keep) * row_bytes(ds.x_train) + len(test_y) * row_bytes(ds.x_test), device, placement_mode)
    if where == "device":  # the long-tailed subset and the test set, moved once; clients hold rows into them
        k = torch.from_numpy(keep)
        norm = prep if _normalise_once(ds, len(keep) + len(test_y), device, placement_mode) else None
        src = (rows_to(ds.x_train, k, device, prep=norm), rows_to(ds.y_train, k, device))
        test = (rows_to(ds.x_test, None, device, prep=norm), rows_to(ds.y_test, None, device))
    else:  # host: the dataset's own tensors (possibly memory-mapped), never copied per client
        src, test = (ds.x_train, ds.y_train), (ds.x_test, ds.y_test)
    if own_tests is None:  # each client's share of the balanced test set (or a natural partition's own tests)
        pools = class_pools(test_y, ds.num_classes) if sp.test_index is None else None
        n_total = int(counts.sum())
        tests = Ragged.of(sp.test_index or [client_test_index(counts, test_y, seed, k, pools, n_total)
                                            for k in range(len(parts))])
    else:
        tests = own_tests
    view = ClientViews(parts, tests, own_tests is not None, src, test, ds.num_classes, prep, keep,
                       device if where == "device" else None)
    del parts, tests, own_tests, sp

    clients_data = Clients(view, len(view.parts))
    settings = dict(dataset=dataset, imbalance_ratio=imbalance_ratio, lt_profile=lt_profile,
                    partition=partition_name, clients=clients, seed=seed, partition_file=partition_file,
                    **(partition_kw or {}), **({"client_test_fraction": client_test_fraction}
                                               if client_test_fraction else {}))
    return Federation(ds, clients_data, counts.sum(0), counts, prep, settings,
                      *test, where=where, layout=(keep, view.parts, view.tests))
