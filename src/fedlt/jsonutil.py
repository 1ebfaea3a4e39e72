"""JSON for what runs write (config.json, summary.json, metrics.jsonl): numpy numbers and arrays as plain ones.

A module of its own, under both :mod:`fedlt.experiment` and :mod:`fedlt.experiments.runstate` (and the Flower
strategy), so none of them reaches back into another for it.
"""
from __future__ import annotations

import numpy as np


def jsonable(o):
    """``json.dumps(..., default=jsonable)``: numpy integers, floats and arrays as ints, floats and lists."""
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o)}")
