"""JSON for what runs write (config.json, summary.json, metrics.jsonl): numpy numbers and arrays as plain ones,
and a layout that stays fast and readable at 100,000 clients (:func:`dumps`).

A module of its own, under both :mod:`fedlt.rundir` and :mod:`fedlt.runstate` (and the Flower
strategy), so none of them reaches back into another for it.
"""
from __future__ import annotations

import json

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


def dumps(obj, indent: int = 1, _depth: int = 0) -> str:
    """``obj`` as indented JSON in which a list of plain values is one line (a client's counts, a mode's
    per-client accuracies) and a list of such lists one line per item: json's indenting writes every number on
    a line of its own, in Python, 20 s for a 100,000-client partition.json; this takes its C encoder per line."""
    if isinstance(obj, np.ndarray):
        obj = obj.tolist()
    pad, inner = " " * (indent * _depth), " " * (indent * (_depth + 1))
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {dumps(v, indent, _depth + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple, np.ndarray)) for v in obj):
        if all(isinstance(v, (list, tuple)) for v in obj):  # rows: one C-encoded text, cut between the rows
            text = json.dumps(obj, default=jsonable)
            body = text[1:-1]
            if '"' not in body and "[[" not in body and "]]" not in body:  # flat rows of numbers
                return "[\n" + inner + body.replace("], [", f"],\n{inner}[") + f"\n{pad}]"
        return "[\n" + ",\n".join(inner + dumps(v, indent, _depth + 1) for v in obj) + f"\n{pad}]"
    return json.dumps(obj, default=jsonable)
