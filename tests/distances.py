"""The distances the official-code tests measure, kept for the record: with ``FEDLT_DISTANCES`` naming a file, each
:func:`record` appends one JSON line (method, what was compared, the largest absolute difference) to it, so that
``benchmarks/official_distances.py`` can print them as a table; without it nothing is written. The tests assert
their bounds on the same numbers."""
from __future__ import annotations

import json
import os


def record(method: str, what: str, value: float) -> float:
    path = os.environ.get("FEDLT_DISTANCES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"method": method, "what": what, "max_abs_diff": float(value)}) + "\n")
    return float(value)
