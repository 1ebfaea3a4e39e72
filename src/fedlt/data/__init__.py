"""Datasets, long-tail construction, partitions and federations.

Datasets are found like methods: every module of this package is imported when the dataset registry is first
used, so a new dataset needs no change anywhere else -- drop a module that registers its loader with
``@DATASETS.register`` (the small built-in sets are in :mod:`~fedlt.data.datasets`; images, LEAF, speech and
IMU have modules of their own). Each loader takes what it shares from :mod:`~fedlt.data.base`; none imports
another loader.
"""
from ..registry import DATASETS
from .base import Dataset
from .datasets import load_dataset
from .federated import ClientData, Federation, build_federation
from .longtail import exp_profile, longtail_indices, step_profile
from .partition import count_matrix, partition

__all__ = ["Dataset", "load_dataset", "ClientData", "Federation", "build_federation", "exp_profile",
           "step_profile", "longtail_indices", "partition", "count_matrix"]

DATASETS.add_package(__name__, __path__)
