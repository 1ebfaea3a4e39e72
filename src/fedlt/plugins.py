"""Methods defined outside the package: installed plugins (entry points) and method files.

**Plugins.** A distribution declares its methods in its ``pyproject.toml``::

    [project.entry-points."fedlt.methods"]
    fedavg-la = "fedavg_la:FedAvgLA"       # method name = "module:Class" (a subclass of fedlt.Method)

Once it is installed, ``fedavg-la`` works wherever a built-in method does (``fedlt run``, ``fedlt list``,
sweeps, reports, resume, the Flower engine, :func:`fedlt.run`). The registry (:mod:`fedlt.registry`) imports a
plugin only when its method is asked for or every method is listed; a broken one (import error, a name that
clashes with a built-in method, an object that is not a ``Method``) is a one-line error naming the plugin when
it is asked for, is listed by ``fedlt list``, and never stops the built-in methods.

**Method files.** ``--method-file my_method.py`` (the ``method_file`` setting) runs a method without
packaging it: the file registers its method(s) with ``@fedlt.METHODS.register("name")``, exactly as the files
in ``fedlt/methods/`` do. The setting holds the file's absolute path once resolved, and that is what
``config.json`` records and what every other process of the run uses to find the same file: the ClientApps
of the Flower engine (the path travels in the run config, so on a real deployment the file must exist at that
path on every SuperNode machine -- or make it a plugin and install it there), a resumed run and every run of
a sweep or comparison (their settings name the file). A relative path is taken from the working directory,
like ``--data-dir`` and ``--config``. With ``method_file`` and no ``method``, the file's method is run (if it
defines exactly one).

Loading a plugin or a method file runs its code, by design: it is the user's own method. Only load code you
trust (fedlt never runs code found in the files it *reads*: run directories, checkpoints, configs).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from .errors import ConfigError
from .registry import METHODS, one_line

GROUP = "fedlt.methods"
# absolute path -> (module name, (mtime_ns, size) of the file when it was loaded, the method names it registered)
_LOADED: dict[str, tuple[str, tuple[int, int], list[str]]] = {}


def resolve_method_file(path: str | os.PathLike) -> str:
    """The absolute path of a method file; ConfigError if it is not a readable ``.py`` file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"method file {path} not found")
    if p.suffix != ".py":
        raise ConfigError(f"method file {path} is not a Python file (.py)")
    return str(p.resolve())


def load_method_file(path: str | os.PathLike) -> list[str]:
    """Import a method file (once per process, again if it changed since) and return the names of the methods
    it registers. Errors in the file are one-line ConfigErrors naming it; what it registered is undone."""
    path = resolve_method_file(path)
    st = os.stat(path)
    stamp = (st.st_mtime_ns, st.st_size)
    if path in _LOADED and _LOADED[path][1] == stamp:
        return list(_LOADED[path][2])
    METHODS._load()  # the built-ins and the plugins' names first, so that a clash is seen as one
    if path in _LOADED:  # edited since: its methods are registered again from the new code
        METHODS.forget(_LOADED[path][2])
    same = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) and
            os.path.realpath(m.__file__) == os.path.realpath(path)]
    before = dict(METHODS._items)
    if same and path not in _LOADED:
        # already imported as a module (a test next to it did `import my_method`): that import registered it
        name = same[0].__name__
        names = [n for n, obj in METHODS._items.items() if getattr(obj, "__module__", None) == name]
    else:
        name = f"_fedlt_method_file_{Path(path).stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickle look the module up by name while it runs
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 -- the user's code: any error is one line naming the file
            sys.modules.pop(name, None)
            _undo(before)
            raise ConfigError(f"method file {path}: {one_line(e)}") from None
        names = [n for n, obj in METHODS._items.items() if before.get(n) is not obj]
    if not names:
        _undo(before)
        raise ConfigError(f"method file {path} registers no method; decorate its class with "
                          f"@fedlt.METHODS.register(\"my-method\")")
    base = METHODS.base
    for n in names:
        obj = METHODS._items[n]
        if not (isinstance(obj, type) and issubclass(obj, base)):
            _undo(before)
            raise ConfigError(f"method file {path}: {n!r} is {obj!r}, not a subclass of fedlt.Method")
        METHODS.set_origin(n, f"file {path}")
    _LOADED[path] = (name, stamp, sorted(names))
    return sorted(names)


def _undo(before: dict) -> None:
    METHODS.forget([n for n in METHODS._items if n not in before])
    METHODS._items.update(before)


def method_class(cfg) -> type:
    """The method class a run config names, loading its method file first if it has one."""
    if getattr(cfg, "method_file", None):
        load_method_file(cfg.method_file)
    return METHODS.get(cfg.method)


def only_method(path: str) -> str:
    """The one method a method file defines (the method of a run that names the file but no method)."""
    names = load_method_file(path)
    if len(names) > 1:
        raise ConfigError(f"method file {path} defines several methods ({', '.join(names)}); choose one with "
                          f"--method")
    return names[0]
