"""Name -> object registries, so the command line and the engines never grow an if/elif chain.

Methods, datasets, models and partitions register themselves with a decorator::

    @METHODS.register("fedavg")
    class FedAvg(Method): ...

Methods can also come from outside the package (see :mod:`fedlt.plugins`): an installed distribution that
declares an entry point in the group ``fedlt.methods`` (name = the method's name, value = ``module:Class``), or
a file given with ``--method-file``. Entry points are discovered by name when the registry is first used and
imported only when the method is asked for (or when every method is listed), so a plugin that fails to
import, clashes with a built-in name or names something that is not a ``Method`` never stops the built-in
methods from working: asking for it is a one-line :class:`ConfigError` naming the plugin, and ``fedlt list``
shows the problem.
"""
from __future__ import annotations

import difflib
import importlib
import pkgutil
import sys
from typing import Any, Callable

from .decl import show
from .errors import ConfigError


def _source(obj: Any) -> str | None:
    """The file an object (a class or a function) was defined in, if any."""
    return getattr(sys.modules.get(getattr(obj, "__module__", "")), "__file__", None)


def one_line(e: BaseException) -> str:
    """``Type: first line of the message`` (what a user's broken code raised, on one line)."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


PLUGIN_PATH = "FEDLT_PLUGIN_PATH"


def plugin_visible(ep) -> bool:
    """Whether an installed entry point counts. ``$FEDLT_PLUGIN_PATH`` set: only those of distributions installed
    under its folders (separated by ``os.pathsep``; empty: none) -- a test suite sees the plugins it plants and
    none that happen to be installed in the environment. Unset: every installed one."""
    import os
    from pathlib import Path

    if PLUGIN_PATH not in os.environ:
        return True
    roots = [Path(p).resolve() for p in os.environ[PLUGIN_PATH].split(os.pathsep) if p]
    dist = getattr(ep, "dist", None)
    try:
        where = Path(str(dist.locate_file(""))).resolve() if dist is not None else None
    except (OSError, TypeError, AttributeError):
        where = None
    return where is not None and any(where == r or r in where.parents for r in roots)


class Registry:
    def __init__(self, kind: str, group: str | None = None, names: bool = False):
        """``group``: the entry-point group of plugins (None: none). ``base``: the class every plugin object
        must subclass, set by the package that defines it (``fedlt.methods`` sets ``Method``), so this module,
        the bottom layer that everything registers with, imports nothing of fedlt but its errors. ``names``: a
        class registered here is given its registered name as its ``name`` attribute (a method's name is written
        once, in its registration)."""
        self.kind, self.group, self.naming = kind, group, names
        self.base: type | None = None
        self._items: dict[str, Any] = {}
        self._origin: dict[str, str] = {}  # name -> where a non-built-in came from ("plugin ...", "file ...")
        self._loaders: list[Callable[[], None]] = []
        self._plugins: dict[str, Any] | None = None  # entry points found but not imported yet; None: not looked
        self._broken: dict[str, str] = {}  # plugin name -> the one-line reason it is not available
        self._warned: set[str] = set()
        self._prefixes: dict[str, tuple[Callable[[str], Any], str]] = {}  # "hf" -> (factory, what NAME means)
        self._made: dict[str, Any] = {}  # "hf:NAME" -> what its prefix's factory made of NAME

    def register(self, name: str, obj: Any = None):
        def deco(o):
            old = self._items.get(name)
            # the same definition again (a module reloaded, a method file imported a second time) replaces it
            same = old is not None and _source(old) is not None and _source(old) == _source(o) and \
                getattr(old, "__qualname__", None) == getattr(o, "__qualname__", None)
            if old is not None and old is not o and not same:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self.origin(name)}: "
                                 f"{old.__module__}.{getattr(old, '__qualname__', old)}); choose another name")
            if self.naming and isinstance(o, type):
                given = o.__dict__.get("name")
                if given is not None and given != name:  # a plugin's class that also names itself otherwise
                    raise ValueError(f"{self.kind} class {o.__qualname__} sets name = {given!r} but is registered "
                                     f"as {name!r}; drop its name attribute (the registration names it)")
                o.name = name
            self._items[name] = o
            if self._plugins is not None:
                self._plugins.pop(name, None)  # an explicit registration wins over an entry point not loaded yet
            return o

        return deco(obj) if obj is not None else deco

    def add_loader(self, fn: Callable[[], None]) -> None:
        """A function that imports the modules holding the registrations (run once, lazily)."""
        self._loaders.append(fn)

    def add_package(self, package: str, path) -> None:
        """At the first lookup, import every module of ``package`` (``path``: its ``__path__``; modules named
        ``_...`` excepted): a module that registers here -- a method file, a dataset loader -- is found without
        being listed anywhere."""
        def load() -> None:
            for m in pkgutil.iter_modules(path):
                if not m.name.startswith("_"):
                    importlib.import_module(f"{package}.{m.name}")

        self.add_loader(load)

    def add_prefix(self, prefix: str, factory: Callable[[str], Any], what: str) -> None:
        """Names ``PREFIX:REST`` stand for ``factory(REST)`` (made once per name, at its first lookup): entries
        that come from outside fedlt's own list -- a Hugging Face dataset (``hf:NAME``), a Flower Datasets
        partitioner (``flwr:CLASS``). ``what`` says what REST is, for the unknown-name error and listings. The
        factory raises ConfigError (one line) for a REST it cannot make."""
        self._prefixes[prefix] = (factory, what)

    def prefixes(self) -> dict[str, str]:
        """``{"hf": "a Hugging Face dataset ..."}``: the prefixes this registry takes, and what follows them."""
        self._load()
        return {p: what for p, (_, what) in self._prefixes.items()}

    def _made_of(self, name: str) -> Any:
        prefix, _, rest = name.partition(":")
        if name not in self._made:
            if not rest:
                raise ConfigError(f"{self.kind} {name!r}: say what follows {prefix}: ({self._prefixes[prefix][1]})")
            self._made[name] = self._prefixes[prefix][0](rest)
        return self._made[name]

    def _load(self) -> None:
        while self._loaders:
            self._loaders.pop(0)()
        if self.group and self._plugins is None:
            self._discover()

    # ---------------------------------------------------------------- plugins (entry points)
    def _discover(self) -> None:
        """Find the entry points of ``group`` (names only, nothing imported). A name that a built-in already
        has, or that two distributions declare, is broken (and said so once on stderr)."""
        from importlib.metadata import entry_points

        self._plugins = {}
        seen: dict[str, list] = {}
        for ep in entry_points(group=self.group):
            if not plugin_visible(ep):
                continue
            if all(e.value != ep.value for e in seen.get(ep.name, [])):  # a path listed twice: one entry point
                seen.setdefault(ep.name, []).append(ep)
        for name, eps in seen.items():
            if name in self._items:
                why = (f"its name clashes with the {self.origin(name)} {self.kind} {name!r}, which is used instead; "
                       f"rename the entry point in the plugin's pyproject.toml")
                self._broken[name] = self._plugin_error(name, eps[0], why)
                self.warn_problems([name])  # else the plugin's author would silently run the built-in
            elif len(eps) > 1:
                self._broken[name] = (f"{self.kind} plugin {name!r} is declared by several distributions "
                                      f"({', '.join(self._dist(e) for e in eps)}); uninstall all but one")
            else:
                self._plugins[name] = eps[0]

    @staticmethod
    def _dist(ep) -> str:
        d = getattr(ep, "dist", None)
        return f"{d.name} {d.version}" if d is not None else "unknown distribution"

    def _plugin_error(self, name: str, ep, why: str) -> str:
        return f"{self.kind} plugin {name!r} ({ep.value} from {self._dist(ep)}): {why}"


    def _load_plugin(self, name: str) -> None:
        """Import the entry point ``name`` and register what it names; a failure marks it broken."""
        ep = self._plugins.pop(name)
        before = set(self._items)
        try:
            obj = ep.load()
        except Exception as e:  # noqa: BLE001 -- whatever the plugin's own code raises: one line, built-ins unharmed
            for n in set(self._items) - before:  # undo what the plugin registered before failing
                del self._items[n]
            self._broken[name] = self._plugin_error(name, ep, f"import failed: {one_line(e)}")
            return
        base = self.base
        if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
            self._broken[name] = self._plugin_error(
                name, ep, f"{obj!r} is not a subclass of {base.__module__.split('.')[0]}.{base.__name__}")
            return
        if self._items.get(name, obj) is not obj:
            self._broken[name] = self._plugin_error(name, ep, f"its module registered another {self.kind} under "
                                                              f"the name {name!r}")
            return
        if base is not None and getattr(obj, "name", None) == getattr(base, "name", None):
            obj.name = name  # a class that did not set its name takes the entry point's
        for n in (set(self._items) - before) | {name}:
            self._items[n] = self._items.get(n, obj)
            self._origin[n] = f"plugin {self._dist(ep)}"

    def _load_plugins(self) -> None:
        self._load()
        for name in list(self._plugins or {}):
            self._load_plugin(name)

    def problems(self) -> list[str]:
        """One line per plugin that is not available (import error, name clash, not a subclass of the base)."""
        self._load_plugins()
        return [self._broken[n] for n in sorted(self._broken)]

    def warn_problems(self, names=None) -> None:
        """Say on stderr, once per process and plugin, why the plugins ``names`` (default: all) are not available."""
        if names is None:
            self._load_plugins()
        for n in sorted(self._broken if names is None else names):
            if n not in self._warned:
                self._warned.add(n)
                sys.stderr.write(f"fedlt: warning: {self._broken[n]}\n")

    def origin(self, name: str) -> str:
        """``built-in``, ``plugin DIST VERSION``, ``file PATH`` or ``module NAME`` (registered by code that
        imported fedlt itself)."""
        if name in self._origin:
            return self._origin[name]
        mod = getattr(self._items.get(name), "__module__", "") or ""
        return "built-in" if mod == "fedlt" or mod.startswith("fedlt.") else f"module {mod}"

    def set_origin(self, name: str, origin: str) -> None:
        self._origin[name] = origin

    def forget(self, names) -> None:
        """Remove registrations (a method file that is loaded again after an edit)."""
        for n in names:
            self._items.pop(n, None)
            self._origin.pop(n, None)

    # ---------------------------------------------------------------- lookup
    def get(self, name: str) -> Any:
        self._load()
        if name not in self._items and name.partition(":")[0] in self._prefixes:
            return self._made_of(name)
        if name not in self._items and self._plugins and name in self._plugins:
            self._load_plugin(name)
        if name not in self._items and name in self._broken:
            raise ConfigError(self._broken[name])
        if name not in self._items:
            known = sorted(set(self._items) | set(self._plugins or {}))
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            more = "".join(f", or {p}:NAME ({what})" for p, (_, what) in self._prefixes.items())
            raise ConfigError(
                f"unknown {self.kind} {show(name)}{hint}; choose one of: {', '.join(known)}{more} "
                f"(`fedlt list` shows them all)"
            )
        return self._items[name]

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._items)

    def items(self):
        self._load_plugins()
        return sorted(self._items.items())

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._items or name in (self._plugins or {}) or name in self._made


METHODS = Registry("method", group="fedlt.methods", names=True)
DATASETS = Registry("dataset")
MODELS = Registry("model")
PARTITIONS = Registry("partition")
