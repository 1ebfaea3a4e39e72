"""JSON for what runs write (config.json, summary.json, metrics.jsonl): numpy numbers and arrays as plain ones,
and a layout that stays fast and readable at 100,000 clients (:func:`dumps`).

A module of its own, under both :mod:`fedlt.runner.rundir` and :mod:`fedlt.runner.runstate` (and the Flower
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


def read_json(path, what: str = "", hint: str = "", error=None):
    """The JSON document in the file ``path``, or a one-line error (``error``, default ConfigError) saying why it
    cannot be read -- missing, not text, not JSON, nested too deeply -- naming ``what`` (default: the path), with
    ``hint`` (how to fix it) after a semicolon."""
    from pathlib import Path

    from .errors import ConfigError

    error = error or ConfigError
    name = what or str(path)
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{name} not found" + (f"; {hint}" if hint else "")) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "it is nested too deeply" if isinstance(e, RecursionError) else \
            (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise error(f"{name} is not readable JSON ({why})" + (f"; {hint}" if hint else "")) from None


def read_json_lines(path, hint: str = "") -> list:
    """The records of a JSON-lines file (``metrics.jsonl``); a last line cut short (a process killed while it
    wrote) is left out, any other unreadable line is a one-line ConfigError naming the file and line."""
    from pathlib import Path

    from .errors import ConfigError

    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror if isinstance(e, OSError) else e})"
                          + (f"; {hint}" if hint else "")) from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            if i == len(lines):
                break
            raise ConfigError(f"{path} line {i} is not a JSON record" + (f"; {hint}" if hint else "")) from None
        if not isinstance(rec, dict):
            raise ConfigError(f"{path} line {i} is not a JSON object" + (f"; {hint}" if hint else ""))
        out.append(rec)
    return out
