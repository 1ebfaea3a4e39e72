"""The papers' experiments as data: their protocols (presets) and their published tables.

One JSON file per paper, shipped with the package: the seed papers (``fedloge.json``, ``redgrape.json``,
``feddr.json``, ``balancefl.json``) with presets and tables, and issue 32's (``fedrs``, ``fedlf``, ``gbme``,
``dflfs``, ``fedgpa``) with presets only, from their official code (their texts, and so their tables' numbers,
could not be read; each file's ``note`` says so)::

    {"paper": "full title (authors, venue)",
     "presets": {NAME: {"description": "...", "settings": {run setting: value},
                        "sources": {run setting: "where the value comes from"}}},
     "tables": {NAME: {"title", "source" ("<paper>, Table N"), "unit" ("fraction" | "percent", as printed),
                       "metric" (which number of a run is compared: "final" | "last3"), "note",
                       "settings": {label: {"preset": NAME, setting overrides}},   # the table's columns
                       "columns": [[setting label, metric], ...],                # in the printed order
                       "methods": {label: {"row": the paper's row name, "method": fedlt name (default: the label),
                                           "params": {...}, "missing": "why fedlt lacks it" (then never run)}},
                       "cells": {method label: [value or null, one per column]},  # numbers as printed
                       "std":   {method label: [std or null, ...]}  (where given),
                       "failed": {method label: [setting labels the paper reports as failed]}}}}

Presets are merged into :data:`fedlt.config.PRESETS`; tables are read by :mod:`fedlt.experiments.reproduce`.
This module reads JSON only (no fedlt imports), so the configuration can load it at import time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

PAPERS = ("fedloge", "redgrape", "feddr", "balancefl", "fedrs", "fedlf", "gbme", "dflfs", "fedgpa", "fedwmsam",
          "fednpc", "fedvls", "fedrela", "ggeur")
UNITS = {"fraction": 1.0, "percent": 0.01}


@dataclass(frozen=True)
class Preset:
    name: str
    paper: str
    description: str
    settings: dict
    sources: dict


@dataclass(frozen=True)
class PaperCell:
    """One published number, as a fraction in [0, 1] (``std`` too; None where not given)."""

    method: str  # the table's method label
    setting: str  # the table's setting label
    metric: str  # GM, many, medium, few, PM
    value: float | None  # None: "-" in the paper (or "failed")
    std: float | None
    source: str  # "<paper>, Table N, row R, column SETTING METRIC"
    failed: bool = False


@dataclass(frozen=True)
class TableMethod:
    label: str
    method: str  # fedlt's method name
    row: str  # the paper's row name
    params: dict = field(default_factory=dict)
    missing: str | None = None  # why fedlt cannot run it; None: it can


@dataclass(frozen=True)
class Table:
    name: str
    paper: str
    title: str
    source: str
    unit: str
    metric: str  # final | last3
    note: str
    settings: dict  # label -> {"preset": ..., overrides}
    columns: tuple  # ((setting, metric), ...)
    methods: dict  # label -> TableMethod
    cells: tuple  # PaperCell, row by row, column by column

    def cell(self, method: str, setting: str, metric: str) -> PaperCell | None:
        return next((c for c in self.cells if (c.method, c.setting, c.metric) == (method, setting, metric)), None)

    @property
    def metrics(self) -> list[str]:
        return list(dict.fromkeys(m for _, m in self.columns))


def read(key: str) -> dict:
    """A paper's JSON document."""
    return json.loads(resources.files(__name__).joinpath(f"{key}.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def presets() -> dict[str, Preset]:
    out = {}
    for key in PAPERS:
        doc = read(key)
        for name, p in doc["presets"].items():
            out[name] = Preset(name, doc["paper"], p["description"], dict(p["settings"]), dict(p.get("sources", {})))
    return out


@lru_cache(maxsize=None)
def tables() -> dict[str, Table]:
    out = {}
    for key in PAPERS:
        doc = read(key)
        for name, t in doc.get("tables", {}).items():
            out[name] = _table(name, doc["paper"], t)
    return out


def _table(name: str, paper: str, t: dict) -> Table:
    scale = UNITS[t["unit"]]
    columns = tuple((s, m) for s, m in t["columns"])
    methods = {label: TableMethod(label, m.get("method", label), m.get("row", label), dict(m.get("params", {})),
                                  m.get("missing"))
               for label, m in t["methods"].items()}
    cells = []
    for label, values in t["cells"].items():
        stds = t.get("std", {}).get(label, [None] * len(values))
        failed = set(t.get("failed", {}).get(label, []))
        for (setting, metric), v, s in zip(columns, values, stds):
            cells.append(PaperCell(label, setting, metric, None if v is None else v * scale,
                                   None if s is None else s * scale,
                                   f"{t['source']}, row {methods[label].row}, column {setting} {metric}",
                                   setting in failed))
    return Table(name, paper, t["title"], t["source"], t["unit"], t["metric"], t.get("note", ""),
                 dict(t["settings"]), columns, methods, tuple(cells))
