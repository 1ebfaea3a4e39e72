"""fedlt's long-tailed clients for Flower Datasets users: :class:`LongTailPartitioner`
(``pip install 'fedlt[flwr-datasets]'``; docs/flower-datasets.md)::

    from flwr_datasets import FederatedDataset
    from fedlt.flower.datasets import LongTailPartitioner

    fds = FederatedDataset(dataset="uoft-cs/cifar10",
                           partitioners={"train": LongTailPartitioner(20, imbalance_ratio=100, alpha=0.5)})
    client_3 = fds.load_partition(3)

The partitioner makes fedlt's long-tailed subset of the split and splits it over the clients with any partition
of fedlt's registry (``dirichlet``, ``shards``, ``iid``, ``tau``, ``pathological``, ``exdir``,
``local-longtail``, or a ``flwr:CLASS`` partition), with the run settings that partition declares it reads
(``alpha``, ``balance``, ``min_client_size``, ``shards_per_client``, ``classes_per_client``, ``tau``,
``partition_args``), checked like ``fedlt run`` checks them. Same labels in the same order, same settings and
seed: the same clients, row for row, as the ``partition.json`` of a ``fedlt run``. Rows that the long-tail
construction drops belong to no partition. Where the dataset was shuffled (``FederatedDataset`` shuffles by
default), the labels are read in the split's stored order -- fedlt's index space -- and each partition holds
the same rows as before the shuffle.
"""
from __future__ import annotations

from typing import Any

import numpy as np

try:
    from flwr_datasets.partitioner import Partitioner
except ImportError:  # pragma: no cover - the extra is missing
    raise ImportError("fedlt.flower.datasets needs Flower Datasets; install it with: "
                      "pip install 'fedlt[flwr-datasets]'") from None

from ..config import load_config
from ..data.federated import check_clients
from ..data.hf import column
from ..data.partition import partition_settings
from ..data.split import split_training_set
from ..registry import PARTITIONS

LONG_TAIL = ("lt_profile", "n_max", "tail_classes")  # the long-tail construction's settings besides the ratio


def partition_setting_names() -> set[str]:
    """The run settings that some partition of the registry reads, and the long-tail construction's."""
    return ({s for _, fn in PARTITIONS.items() for s in getattr(fn, "settings", {}).values()} | set(LONG_TAIL)
            | {"partition_args"})  # what flwr: partitions read


class LongTailPartitioner(Partitioner):
    """fedlt's long-tailed federation as a Flower Datasets partitioner.

    ``num_partitions``: the clients K (``--clients``); ``imbalance_ratio``: n_max / n_min (``--rho``);
    ``partition``: a partition of fedlt's registry (``fedlt list`` shows them); ``alpha``, ``seed``: as in
    ``fedlt run``; ``partition_by``: the label column. Further keywords: the other run settings that
    partitions read (``balance``, ``min_client_size``, ``shards_per_client``, ``classes_per_client``, ``tau``,
    ``partition_args``) and the long-tail construction's (``lt_profile``, ``n_max``, ``tail_classes``), with
    ``fedlt run``'s defaults. ``num_classes``: the number of classes (default: the label column's
    ``ClassLabel``, else the largest label + 1). Bad values raise fedlt's one-line ``ConfigError``.
    """

    def __init__(self, num_partitions: int, imbalance_ratio: float = 100.0, partition: str = "dirichlet",
                 alpha: float = 0.5, seed: int = 0, partition_by: str = "label", num_classes: int | None = None,
                 **settings: Any) -> None:
        super().__init__()
        known = partition_setting_names()
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"LongTailPartitioner got unknown setting(s) {', '.join(unknown)}; it takes "
                            f"{', '.join(sorted(known - {'imbalance_ratio', 'alpha'}))}")
        if partition in ("natural", "file"):
            raise ValueError(f"partition {partition!r} needs a dataset's own users or a partition file; use Flower "
                             f"Datasets' NaturalIdPartitioner, or the file's index lists")
        self.config = load_config(None, {"clients": num_partitions, "imbalance_ratio": imbalance_ratio,
                                         "partition": partition, "alpha": alpha, "seed": seed, **settings})
        self.partition_by = partition_by
        self.num_classes = num_classes
        self._rows: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        return self.config.clients

    def indices(self, partition_id: int) -> np.ndarray:
        """The rows of the dataset that partition ``partition_id`` holds (``load_partition`` selects them)."""
        if not 0 <= partition_id < self.num_partitions:
            raise KeyError(f"partition_id {partition_id} is not in 0..{self.num_partitions - 1}")
        if self._rows is None:
            self._rows = self._split()
        return self._rows[partition_id]

    def load_partition(self, partition_id: int):
        return self.dataset.select(self.indices(partition_id))

    def _split(self) -> list[np.ndarray]:
        import torch

        ds, cfg = self.dataset, self.config
        if self.partition_by not in ds.column_names:
            raise KeyError(f"the dataset has no column {self.partition_by!r} (its columns: "
                           f"{', '.join(ds.column_names)}); set partition_by")
        labels = np.asarray(column(ds, self.partition_by), dtype=np.int64)
        stored = ds._indices  # an index mapping (shuffle, select): the rows' positions in the stored split
        where = np.asarray(stored.column(0).to_numpy(), np.int64) if stored is not None else np.arange(len(labels))
        order = np.argsort(where, kind="stable")  # stored order, fedlt's index space
        feature = ds.features[self.partition_by]
        c = self.num_classes or getattr(feature, "num_classes", None) or (int(labels.max()) + 1 if len(labels) else 1)

        class Labels:  # what split_training_set reads of a dataset
            name, num_classes, lt_n_max, train_groups = cfg.dataset, c, None, None
            y_train = torch.from_numpy(labels[order])

        sp = split_training_set(Labels, cfg.lt_profile, cfg.imbalance_ratio, cfg.n_max, cfg.tail_classes,
                                cfg.partition, cfg.clients, cfg.seed, partition_settings(cfg.partition, cfg))
        check_clients(sp.parts, cfg.clients)  # as fedlt run: every client holds a sample
        return [order[sp.keep[p]] for p in sp.parts]


__all__ = ["LongTailPartitioner"]
