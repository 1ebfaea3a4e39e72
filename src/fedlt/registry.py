"""Name -> object registries, so the command line and the engines never grow an if/elif chain.

Methods, datasets, models and partitions register themselves with a decorator::

    @METHODS.register("fedavg")
    class FedAvg(Method): ...
"""
from __future__ import annotations

import difflib
from typing import Any, Callable

from .errors import ConfigError


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, Any] = {}
        self._loaders: list[Callable[[], None]] = []

    def register(self, name: str, obj: Any = None):
        def deco(o):
            if name in self._items and self._items[name] is not o:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = o
            return o

        return deco(obj) if obj is not None else deco

    def add_loader(self, fn: Callable[[], None]) -> None:
        """A function that imports the modules holding the registrations (run once, lazily)."""
        self._loaders.append(fn)

    def _load(self) -> None:
        while self._loaders:
            self._loaders.pop(0)()

    def get(self, name: str) -> Any:
        self._load()
        if name not in self._items:
            close = difflib.get_close_matches(name, list(self._items), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown {self.kind} {name!r}{hint}; choose one of: {', '.join(sorted(self._items))} "
                f"(`fedlt list` shows them all)"
            )
        return self._items[name]

    def names(self) -> list[str]:
        self._load()
        return sorted(self._items)

    def items(self):
        self._load()
        return sorted(self._items.items())

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._items


METHODS = Registry("method")
DATASETS = Registry("dataset")
MODELS = Registry("model")
PARTITIONS = Registry("partition")
