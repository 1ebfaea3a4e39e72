"""The server's labelled auxiliary set: a seeded, class-balanced draw from the dataset's training set, preferring
the samples the long-tailed subset left out (so no client holds them). Ratio Loss estimates its class weights on
it, FedIC calibrates its ensemble on it; the data settings reach it through ``RunSpec.data``."""
from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError
from ..seeds import Purpose, derive_seed


def auxiliary_set(spec, per_class: int, who: str = "ratioloss"):
    """The server's balanced auxiliary set as ``ClientData`` (client id -1, no test set), and how many of its
    samples are also in the long-tailed training subset the clients share. ``who``: the method, for errors."""
    from ..data.datasets import load_dataset
    from ..data.federated import ClientData, Prep
    from ..data.longtail import longtail_indices

    d = spec.data
    if not d.get("dataset"):
        raise ConfigError(f"{who} needs the run's data settings (RunSpec.data) to draw its server-side "
                          "auxiliary set; build the spec with fedlt.runner.rundir.make_spec")
    ds = load_dataset(d["dataset"], d.get("data_dir"), **d.get("dataset_kw", {}))
    y = ds.y_train.numpy()
    keep = longtail_indices(y, ds.num_classes, d["imbalance_ratio"], d.get("seed", spec.seed),
                            d.get("lt_profile", "exp"), d.get("n_max"), d.get("tail_classes", 3))
    in_lt = np.zeros(len(y), dtype=bool)
    in_lt[keep] = True
    rng = np.random.default_rng(derive_seed(spec.seed, Purpose.AUX_DRAW))
    idx, overlap = [], 0
    for c in range(ds.num_classes):
        spare = rng.permutation(np.flatnonzero((y == c) & ~in_lt))[:per_class]
        kept = rng.permutation(np.flatnonzero((y == c) & in_lt))[:per_class - len(spare)]
        idx += [spare, kept]
        overlap += len(kept)
    idx = torch.from_numpy(np.concatenate(idx))
    prep = Prep(ds.mean, ds.std, ds.augment, spec.device)
    aux = ClientData(-1, ds.x_train[idx], ds.y_train[idx], ds.num_classes, prep, ds.x_test[:0], ds.y_test[:0])
    return aux, overlap
