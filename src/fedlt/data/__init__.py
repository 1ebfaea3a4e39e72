"""Datasets, long-tail construction, partitions and federations."""
from .datasets import Dataset, load_dataset
from .federated import ClientData, Federation, build_federation
from .longtail import exp_profile, longtail_indices, step_profile
from .partition import count_matrix, partition

__all__ = ["Dataset", "load_dataset", "ClientData", "Federation", "build_federation", "exp_profile",
           "step_profile", "longtail_indices", "partition", "count_matrix"]
