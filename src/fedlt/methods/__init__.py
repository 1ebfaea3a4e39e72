"""One file per method. Every module in this package is imported when the method registry is first used,
so a new method needs no change anywhere else: drop a file that registers itself with ``@METHODS.register``."""
import importlib
import pkgutil

from ..core.method import Method
from ..registry import METHODS


def _load_all() -> None:
    for m in pkgutil.iter_modules(__path__):
        if not m.name.startswith("_"):
            importlib.import_module(f"{__name__}.{m.name}")


METHODS.add_loader(_load_all)
METHODS.base = Method  # what a plugin's entry point must name a subclass of
