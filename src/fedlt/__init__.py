"""fedlt: federated learning on long-tailed, non-IID data.

The public, stable API is what ``__all__`` lists: running and comparing methods from Python (:mod:`fedlt.api`:
``run``, ``compare``, ``sweep``, ``report``, ``load``, ``reproduce`` (a paper's table) and their results), and
what a method of your own needs
(``Method``, ``Message``, ``Predictor``, ``RunSpec``, the local-step description ``LocalSteps``/``Train``/
``Trained``/``StepModel``/``ce``/``strip``, ``train_local``, ``weights_of``, ``load_weights``, ``setting`` (a
declared hyper-parameter), ``sent`` (a declared thing its clients send), ``METHODS.register``; see docs/writing-a-method.md and docs/batched-clients.md). Everything else may change between versions.
"""
__version__ = "0.1.0"

from .moved import keep_old_paths  # noqa: E402

# Modules that moved keep their old paths (fedlt.moved): app directories that `fedlt flower app` wrote name
# fedlt.engine.flower.server_app:app / client_app:app, and docs named fedlt.engine.flower.datasets.
keep_old_paths({f"fedlt.engine.flower.{m}": f"fedlt.flower.{m}" for m in (
    "server_app", "client_app", "strategy", "simulation", "deploy", "datasets", "settings", "inprocess")})

from .errors import ConfigError, DataError, FedltError  # noqa: E402
from .registry import DATASETS, METHODS, MODELS, PARTITIONS  # noqa: E402

from . import models as _models  # noqa: E402,F401  (registers the models)
from . import methods as _methods  # noqa: E402,F401  (installs the method loader)
from .data import datasets as _datasets, partition as _partition  # noqa: E402,F401

from .api import (Comparison, MethodInfo, Metrics, Reproduced, RunResult, compare, list_methods, load,  # noqa: E402
                  make_config, report, reproduce, run, sweep)
from .config import RunConfig  # noqa: E402
from .decl import setting  # noqa: E402
from .core import (LocalSteps, Message, Method, Predictor, RunSpec, Sent, StepModel, Train, Trained, ce,  # noqa: E402
                   load_weights, sent, strip, train_local, weights_of)

__all__ = [
    # running and reading experiments (fedlt.api)
    "run", "compare", "sweep", "report", "load", "make_config", "list_methods", "reproduce",
    "RunResult", "Comparison", "Metrics", "MethodInfo", "RunConfig", "Reproduced",
    # writing a method (fedlt.core.method, fedlt.core.training)
    "Method", "Message", "Predictor", "RunSpec", "train_local", "weights_of", "load_weights",
    "LocalSteps", "Train", "Trained", "StepModel", "ce", "strip", "setting", "sent", "Sent",
    # registries (METHODS.register) and errors
    "METHODS", "DATASETS", "MODELS", "PARTITIONS", "FedltError", "ConfigError", "DataError",
]
