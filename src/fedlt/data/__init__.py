"""Datasets, long-tail construction, partitions and federations.

The dataset registry's loader is installed here: the loaders that live in modules of their own (images, LEAF,
speech, IMU) are imported at the registry's first lookup. Each of them, like :mod:`~fedlt.data.datasets`, takes
what it shares from :mod:`~fedlt.data.base` and registers itself; none imports another loader.
"""
from ..registry import DATASETS
from .base import Dataset
from .datasets import load_dataset
from .federated import ClientData, Federation, build_federation
from .longtail import exp_profile, longtail_indices, step_profile
from .partition import count_matrix, partition

__all__ = ["Dataset", "load_dataset", "ClientData", "Federation", "build_federation", "exp_profile",
           "step_profile", "longtail_indices", "partition", "count_matrix"]


def _register_more() -> None:
    from . import images, imu, leaf, speech  # noqa: F401


DATASETS.add_loader(_register_more)
