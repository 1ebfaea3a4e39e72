"""fedlt: federated learning on long-tailed, non-IID data."""
__version__ = "0.1.0"

from .errors import ConfigError, DataError, FedltError  # noqa: E402
from .registry import DATASETS, METHODS, MODELS, PARTITIONS  # noqa: E402

from . import models as _models  # noqa: E402,F401  (registers the models)
from . import methods as _methods  # noqa: E402,F401  (installs the method loader)
from .data import datasets as _datasets, partition as _partition  # noqa: E402,F401

__all__ = ["FedltError", "ConfigError", "DataError", "METHODS", "DATASETS", "MODELS", "PARTITIONS"]
