"""Old module paths of modules that moved: a public name that moves keeps its old path.

:func:`keep_old_paths` installs a finder that answers an import of an old path (``fedlt.engine.flower.server_app``,
written into app directories before the Flower apps moved to :mod:`fedlt.flower`) with the module at its new path,
the same module object under both names. Nothing is imported before an old path is asked for; the spec it gives
names the new module's file, so Flower's static check of an app reference (``module:attr``, read with ``ast``
from the spec's origin) finds the attribute there. The table of old -> new paths is the package's
(``fedlt/__init__.py``): this module imports nothing of fedlt.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.spec  # the import system gave it the old path's spec: its own again


class _OldPaths(importlib.abc.MetaPathFinder):
    def __init__(self, moved: dict[str, str]):
        self.moved = dict(moved)

    def find_spec(self, name, path=None, target=None):
        new = self.moved.get(name)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        return importlib.machinery.ModuleSpec(name, _Alias(new), origin=real.origin if real else None)


def keep_old_paths(moved: dict[str, str]) -> None:
    """Answer an import of each old path in ``moved`` (``{old: new}``, full module names) with the new module.
    Installed once per table (after the path finders: a module that is still at an old path is found there)."""
    if not any(isinstance(f, _OldPaths) and f.moved == moved for f in sys.meta_path):
        sys.meta_path.append(_OldPaths(moved))
