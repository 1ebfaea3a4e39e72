"""One declaration per setting: a dataclass field made with :func:`setting` carries its type (the annotation),
default, help, range or choices, unit and command-line spelling, and everything else is derived from it:

- :func:`coerce` turns a TOML, JSON, Python or command-line value into the field's type, and :func:`check`
  refuses what the declaration does not allow, each with a one-line :class:`~fedlt.errors.ConfigError`;
- :func:`add_arguments` writes the argparse options (help texts name the registries' entries when shown);
- :func:`rows` describes every setting for the documentation's tables and ``fedlt list``.

``RunConfig`` (``fedlt.config``), every method's ``Params`` and the partitions' settings are declared this
way, so a new setting is one line::

    @dataclass
    class Params:
        mu: float = setting(0.01, "proximal coefficient", low=0)
        beta: float | None = setting(None, "sparsity", low=0, high=1, high_open=True,
                                     none_means="the kind's default (0.6 for sse-c, 0 for the others)")

The declaration is plain data (:class:`Decl`), so tools can read it: the generated pages, and property-based
tests that draw values inside and outside every declared range. Numbers are always checked to be finite
and, for floats, to fit a float32 (the tensors they end up in); an int without an upper bound fits an int64.

A *limit* (``limit=``) is an upper bound that no ordinary experiment reaches, so that a typo (an extra zero)
is an error instead of an hour of allocation; a run may pass it on purpose with ``allow_large``
(``--allow-large``). A *bound* (``high=``) cannot be passed.

Fields declared without :func:`setting` (a plugin's plain ``@dataclass class Params`` with comments) keep
working: their values are converted to the default's type, as before, and only checked to be finite.

This module is the bottom layer: it imports nothing of fedlt but its errors.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import operator
import os
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .errors import ConfigError

FLOAT32_MAX = 3.4028234663852886e38
INT64 = (-(2**63), 2**63 - 1)
INT32 = 2**31 - 1  # the largest value an int setting that reaches an int32 (a size, a count) may take
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
ALLOW_LARGE = "--allow-large"  # the command-line switch that lifts the limits (RunConfig.allow_large)


@dataclass(frozen=True)
class Decl:
    """What :func:`setting` records beside the default (``field.metadata["decl"]``)."""

    help: str | Callable[[], str] = ""  # a callable: written when asked (a list of registered names)
    choices: tuple | Callable[[], Iterable] | None = None  # allowed values (a callable: computed when asked)
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low < value (else low <= value)
    high_open: bool = False
    limit: float | None = None  # soft upper bound: passed only with allow_large
    numbers: type | None = None  # a str setting whose value is one of ``choices`` or a number of this type
    unit: str | None = None  # of the value ("s", "bytes", "clients"): shown in help and tables
    flags: tuple[str, ...] = ()  # extra command-line spellings (``--rho``)
    metavar: str | None = None
    group: str | None = None  # argument group and table section
    registry: Any = None  # a fedlt.registry.Registry: the value must be one of its names ("did you mean")
    none_means: str | None = None  # what None stands for ("the dataset's default")
    old_none: str | None = None  # what earlier versions wrote for None ("< 0", "== 0"): still read as None
    parse: Callable[[Any], Any] | None = None  # a notation of its own (byte sizes, round lists): value -> value
    hint: Callable[[Any], str] | None = None  # advice added to an out-of-range error ("did you mean 100?")
    label: str | None = None  # the setting's name in messages (default: its command-line spelling)
    cli: bool = True  # has a command-line option
    path: str | None = None  # a str that names a "file", a "folder" or a run directory's "name" (one component)
    result: bool = True  # False: changes where or how a run executes, never its numbers (a resume may change it)
    # the parts of a run that read the setting ("spec": the method's RunSpec, "engine": the driver's EngineConfig;
    # "spec:num_clients": read there under another name): those dataclasses are derived from the declarations
    reads: tuple[str, ...] = ()
    # (other setting, the values of it that take this one[, configurations whose other value does not][, why, in
    # words]): elsewhere the run would ignore this setting, so a value other than its default is refused
    # (:func:`only_with_relations`); the values: a tuple, or GIVEN (the other set to anything but its default)
    only_with: tuple | None = None

    def allowed(self) -> tuple | None:
        c = self.choices
        return tuple(c()) if callable(c) else c

    def text(self) -> str:
        """The help, written out (a callable help is called now)."""
        return self.help() if callable(self.help) else self.help


def setting(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
            **decl: Any) -> Any:
    """A dataclass field that declares a setting or a method's hyper-parameter once::

        mu: float = setting(0.01, "proximal coefficient", low=0)
        beta: float | None = setting(None, "sparsity", low=0, high=1, high_open=True, none_means="the kind's")
        loss: str = setting("ce", "ce | paper", choices=("ce", "paper"))

    The type is the field's annotation (bool, int, float, str, ``X | None``, ``tuple[str, ...]`` for a list).
    Keywords (:class:`Decl`): ``choices``; ``low`` / ``high`` with ``low_open`` / ``high_open`` (a bound is
    included unless open); ``limit``, a soft upper bound that ``--allow-large`` lifts; ``none_means``, what
    None stands for; ``old_none``, an earlier version's sentinel for None (``"< 0"``, ``"== 0"``), still read
    as None; ``unit``, ``metavar``, ``flags`` (extra command-line spellings), ``group``; ``registry`` (the value
    must name one of its entries); ``parse`` (a notation of its own, e.g. :func:`byte_size`); ``hint`` (advice
    added to an out-of-range error); ``label`` (the name in messages); ``cli`` (False: no command-line
    option); ``result`` (False: changes how a run executes, not its numbers). ``factory`` instead of
    ``default`` for a mutable default."""
    meta = {"decl": Decl(help=help, **decl)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


DATA, TRAIN, OUTPUT = "data", "training", "evaluation and output"  # the settings' groups (help, tables)


def declared_in(cls: type, name: str, **changes: Any) -> Any:
    """The field ``name`` of the dataclass ``cls`` declared again for another dataclass, with its default and
    declaration (not a copy of them: the same objects), ``changes`` applied to the declaration (``reads`` is
    added to). A setting that a lower layer reads is declared there, and the run configuration includes it
    this way (``lr: float = declared_in(RunSpec, "lr", reads=("engine",))``)."""
    f = {g.name: g for g in dataclasses.fields(cls)}[name]
    decl = f.metadata["decl"]
    reads = tuple(dict.fromkeys(decl.reads + tuple(changes.pop("reads", ()))))
    return _field_like(f, {"decl": dataclasses.replace(decl, reads=reads, **changes)})


def _field_like(f: dataclasses.Field, metadata) -> Any:
    """A new field with ``f``'s default (or default factory) and ``metadata``."""
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=metadata)
    return dataclasses.field(default=f.default, metadata=metadata)


def read_by(cls: type, part: str) -> dict[str, str]:
    """``{name in part: setting name}`` of the settings of ``cls`` whose declaration says ``part`` reads them."""
    out = {}
    for name, s in settings_of(cls).items():
        for r in s.decl.reads:
            where, _, alias = r.partition(":")
            if where == part:
                out[alias or name] = name
    return out


def reads_settings(source: type, part: str):
    """Class decorator: ``cls`` as a dataclass whose fields are first every setting of ``source`` that ``part``
    reads (:func:`read_by`; their defaults and declarations as declared there, never restated), then
    ``cls``'s own annotated fields. :func:`settings_values` takes those settings' values from a ``source``
    instance."""

    def wrap(cls: type) -> type:
        own = dataclass(cls)
        src = {f.name: f for f in dataclasses.fields(source)}
        hints = typing.get_type_hints(source)
        fields = []
        for alias, name in read_by(source, part).items():
            fields.append((alias, hints[name], _field_like(src[name], src[name].metadata)))
        fields += [(f.name, f.type, f) for f in dataclasses.fields(own)]
        ns = {k: v for k, v in cls.__dict__.items()
              if k not in ("__dict__", "__weakref__", "__dataclass_fields__", "__dataclass_params__", "__init__",
                           "__repr__", "__eq__", "__annotations__", "__match_args__", "__hash__")
              and k not in {f[0] for f in fields}}
        ns["__module__"], ns["__qualname__"] = cls.__module__, cls.__qualname__
        return dataclasses.make_dataclass(cls.__name__, fields, namespace=ns)

    return wrap


def settings_values(obj: Any, part: str) -> dict[str, Any]:
    """The values of ``obj``'s settings that ``part`` reads, under their names there, each converted to its
    declared type (:func:`coerce`: a byte size as its number, a list as a tuple)."""
    decls = settings_of(type(obj))
    return {alias: coerce(decls[name], getattr(obj, name)) for alias, name in read_by(type(obj), part).items()}


# ------------------------------------------------------------------------------------------------ the settings
@dataclass(frozen=True)
class Setting:
    """One field of a declared dataclass, resolved: its type and declaration."""

    name: str
    kind: type | None  # bool, int, float, str, tuple (of ``item``), or None: anything (an unresolved annotation)
    item: type | None
    nullable: bool
    default: Any
    decl: Decl
    declared: bool  # made with setting(); False: a plain field (converted like its default, as before)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def label(self, prefix: str | None = None) -> str:
        if prefix:
            return f"{prefix}.{self.name}"
        return self.decl.label or self.name.replace("_", "-")


_CACHE: dict[type, dict[str, Setting]] = {}


def settings_of(cls: type) -> dict[str, Setting]:
    """``{name: Setting}`` of a dataclass, in field order."""
    if cls not in _CACHE:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 -- an annotation that does not evaluate: the defaults' types then
            hints = {}
        out = {}
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = dataclasses.MISSING
            kind, item, nullable = _kind(hints.get(f.name), default)
            decl = f.metadata.get("decl") or _inherited(cls, f.name)
            out[f.name] = Setting(f.name, kind, item, nullable, default, decl or Decl(), decl is not None)
        _CACHE[cls] = out
    return _CACHE[cls]


def _inherited(cls: type, name: str) -> Decl | None:
    """The declaration of ``name`` in a base dataclass: a subclass that only changes a default
    (``class Params(Base.Params): beta: float = 1.0``) keeps the base's help, range and choices."""
    for base in cls.__mro__[1:]:
        if dataclasses.is_dataclass(base):
            f = {g.name: g for g in dataclasses.fields(base)}.get(name)
            if f is not None and "decl" in f.metadata:
                return f.metadata["decl"]
    return None


def _kind(hint, default) -> tuple[type | None, type | None, bool]:
    """(kind, item kind, nullable) of an annotation; an unknown one falls back on the default's type."""
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    nullable = type(None) in args
    if nullable:
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else None
        args, origin = typing.get_args(hint), typing.get_origin(hint)
    if hint in (bool, int, float, str):
        return hint, None, nullable
    if hint is dict or origin is dict:
        return dict, None, nullable
    if origin in (tuple, list) and args and args[0] in (bool, int, float, str):
        return tuple, args[0], nullable
    if default is not None and default is not dataclasses.MISSING and type(default) in (bool, int, float, str):
        return type(default), None, nullable or hint is None
    return None, None, True


# ------------------------------------------------------------------------------------------------ values
def show(value: Any, width: int = 60) -> str:
    """``repr(value)`` for a one-line message, shortened to about ``width`` characters (a value of a megabyte
    is not echoed whole)."""
    r = repr(value)
    if len(r) <= width:
        return r
    size = f" ({len(value):,} characters)" if isinstance(value, str) else \
        f" ({len(value):,} items)" if isinstance(value, (list, tuple, dict, bytes)) else ""
    return r[: width - 3] + "..." + size


def _kind_name(kind) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", tuple: "list", dict: "table"}.get(kind, "value")


def _num(x) -> str:
    if isinstance(x, int) and not isinstance(x, bool):
        return f"2^{(x + 1).bit_length() - 1}-1" if x >= 2**16 and (x + 1) & x == 0 else str(x)
    return f"{x:g}"


def words(items, last: str = "or") -> str:
    """``a, b or c`` (``last="and"``: ``a, b and c``)."""
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def coerce(s: Setting, value: Any, prefix: str | None = None, typed: bool = False) -> Any:
    """``value`` (from TOML, JSON, Python or the command line) as the setting's type, or a one-line
    ConfigError. Checks nothing else (see :func:`check`). ``typed``: the value comes from a typed file (TOML,
    JSON), where a number or a bool written as text (``drop_rate = "0.3"``) is a mistake, not a notation."""
    label = s.label(prefix)
    if not s.declared:
        return _legacy(value, s.default, label)
    d = s.decl
    if value is None:
        if s.nullable:
            return None
        raise ConfigError(f"{label} expects a {_kind_name(s.kind)}, got None")
    if d.parse is not None:
        try:
            return d.parse(value)
        except (TypeError, ValueError):
            how = getattr(d.parse, "notation", None)  # what the notation reads, in words
            raise ConfigError(f"{label}: cannot read {show(value)}" + (f"; write {how}" if how else
                                                                          f" ({d.metavar})" if d.metavar else "")) from None
    if s.nullable and s.kind in (int, float) and isinstance(value, str) and value.strip().lower() == "none":
        return None
    if s.kind is tuple:
        items = [x.strip(" ()[]") for x in value.split(",") if x.strip(" ()[]")] if isinstance(value, str) else value
        if isinstance(value, str) and not items and d.allowed() is not None:  # --tracker '': not the default
            raise ConfigError(f"{label} {show(value)} names nothing; give {words(d.allowed())}, or leave it out "
                              f"for its default")
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{label} expects a list (a TOML list, or comma-separated), got {show(value)}")
        return tuple(_scalar(s.item, x, label) for x in items)
    if s.kind is None:
        return value
    if d.path is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{label} expects a {d.path if d.path != 'name' else 'run name'} (text), got {show(value)}")
    if s.kind is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{label} expects a table (a dict), got {show(value)}")
        return value
    if typed and isinstance(value, str) and s.kind in (bool, int, float):
        what = "true or false" if s.kind is bool else f"a number ({_kind_name(s.kind)})"
        raise ConfigError(f"{label} expects {what}, got the text {show(value)}; write it without quotes")
    return _scalar(s.kind, value, label)


def _scalar(kind, v, label):
    if kind is bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in TRUE + FALSE:
            return v.strip().lower() in TRUE
        raise ConfigError(f"{label} expects true or false, got {show(v)}")
    if kind is str:
        if isinstance(v, str):
            return v
        if isinstance(v, os.PathLike):  # a folder or file given as a pathlib.Path
            return os.fspath(v)
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            return str(v)
        raise ConfigError(f"{label} expects a str, got {show(v)}")
    bad = ConfigError(f"{label} expects a {_kind_name(kind)}, got {show(v)}")
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        raise bad
    if isinstance(v, str):
        if not v.isascii():  # int() reads other scripts' digits ("\u0663" is 3): numbers are written in ASCII
            raise bad
        try:
            x = kind(v.strip())
        except ValueError:
            raise bad from None
        if kind is float and math.isinf(x) and v.strip().lstrip("+-").lower() not in ("inf", "infinity"):
            raise ConfigError(f"{label} {show(v)} is out of range (a float32 holds at most {FLOAT32_MAX:.4g})")
        return x
    if isinstance(v, numbers.Integral):  # numpy's integers too
        return kind(int(v))
    if isinstance(v, numbers.Real):
        v = float(v)
        if kind is int and not v.is_integer():
            raise bad
        return kind(v)
    raise bad


def _legacy(v: Any, default: Any, label: str) -> Any:
    """A plain (undeclared) field: converted to its default's type, as fedlt did before declarations."""
    if default is None or default is dataclasses.MISSING:
        return v
    if not isinstance(v, str) or isinstance(default, str):  # a TOML value: its type must fit the default's
        if isinstance(default, bool) or isinstance(v, bool):
            if type(v) is not type(default):
                raise ConfigError(f"{label} expects a {type(default).__name__}, got {show(v)}")
            return v
        if isinstance(default, (int, float)) and isinstance(v, (int, float)):
            if isinstance(default, int) and not float(v).is_integer():
                raise ConfigError(f"{label} expects an int, got {show(v)}")
            return type(default)(v)
        if isinstance(default, (tuple, list)) and isinstance(v, (tuple, list)):
            return type(default)(v)
        if type(v) is not type(default):
            raise ConfigError(f"{label} expects a {type(default).__name__}, got {show(v)}")
        return v
    try:
        if isinstance(default, bool):
            if v.lower() in TRUE:
                return True
            if v.lower() in FALSE:
                return False
            raise ValueError
        if isinstance(default, int):
            return int(v)
        if isinstance(default, float):
            return float(v)
        if isinstance(default, (tuple, list)):
            return type(default)(type(default[0])(x) for x in v.split(",")) if default else tuple(v.split(","))
    except ValueError:
        raise ConfigError(f"{label} expects a {type(default).__name__}, got {show(v)}") from None
    return v


_OPS = {"<": operator.lt, "<=": operator.le, "==": operator.eq}


def was_none(s: Setting, value: Any) -> bool:
    """Whether ``value`` is what an earlier version wrote for None (``old_none``, e.g. ``"< 0"``)."""
    rule = s.decl.old_none
    if rule is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    op, num = rule.split()
    return _OPS[op](value, float(num))


def range_text(d: Decl) -> str:
    """``in [0, 1)``, ``>= 1``, ``> 0``, ``<= 5`` or "" (no bound declared)."""
    if d.low is not None and d.high is not None:
        return f"in {'(' if d.low_open else '['}{_num(d.low)}, {_num(d.high)}{')' if d.high_open else ']'}"
    if d.low is not None:
        return f"{'>' if d.low_open else '>='} {_num(d.low)}"
    if d.high is not None:
        return f"{'<' if d.high_open else '<='} {_num(d.high)}"
    return ""


def _in_range(d: Decl, v) -> bool:
    if d.low is not None and not (v > d.low if d.low_open else v >= d.low):
        return False
    return d.high is None or (v < d.high if d.high_open else v <= d.high)


def check(s: Setting, v: Any, prefix: str | None = None, allow_large: bool = False) -> None:
    """Refuse a (coerced) value that the declaration does not allow: one line saying what is allowed."""
    label, d = s.label(prefix), s.decl
    if v is None:
        if not s.nullable:
            raise ConfigError(f"{label} expects a {_kind_name(s.kind)}, got None")
        return
    for x in (v if isinstance(v, tuple) and s.kind is tuple else (v,)):
        _check_one(s, x, label, allow_large)


def _check_one(s: Setting, v: Any, label: str, allow_large: bool) -> None:
    d = s.decl
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"{label} must be a finite number, got {v}")
        if abs(v) > FLOAT32_MAX:
            raise ConfigError(f"{label} {v:g} is out of range (a float32 holds at most {FLOAT32_MAX:.4g})")
    if not s.declared:
        return
    if d.path is not None and isinstance(v, str):
        _check_path(d.path, v, label)
    allowed = d.allowed()
    if d.numbers is not None and isinstance(v, str):  # a word of ``choices``, or a number in range
        if v in (allowed or ()):
            return
        try:
            n = d.numbers(v) if v.isascii() else None
        except ValueError:
            n = None
        if n is None or not _in_range(d, n):
            what = f"a number{' of ' + d.unit if d.unit else ''} {range_text(d)}".rstrip()
            raise ConfigError(f"{label} must be {words([*(allowed or ()), what])}, got {show(v)}")
        return
    if allowed is not None and v not in allowed:
        raise ConfigError(f"unknown {label} {show(v)}; choose {words(allowed)}")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if not _in_range(d, v):
            hint = d.hint(v) if d.hint else ""
            raise ConfigError(f"{label} must be {range_text(d)}, got {_num(v)}" + (f"; {hint}" if hint else ""))
        if d.limit is not None and v > d.limit and not allow_large:
            raise ConfigError(f"{label} {_num(v)} is out of range (at most {d.limit:,}; {ALLOW_LARGE} "
                              f"allows more on purpose)")
        if isinstance(v, int) and d.high is None and not INT64[0] <= v <= INT64[1]:
            raise ConfigError(f"{label} {v} is out of range (at most {INT64[1]:,})")
    if d.registry is not None and isinstance(v, str):
        d.registry.get(v)  # an unknown name: its one-line error, with "did you mean"


NAME_MAX = 200  # bytes of a run name: one path component, with room for what is written beside it (.NAME.lock)
PATH_MAX = 4096


def _check_path(kind: str, v: str, label: str) -> None:
    """A path setting's value: no NUL byte nor control character, not too long; a run ``name`` is one path
    component (no separator, not ``.`` or ``..``), so that the run stays inside its ``--out``."""
    if any(ord(c) < 32 or ord(c) == 127 for c in v):
        raise ConfigError(f"{label} {show(v)} contains a control character (a NUL byte, a newline, ...); "
                          f"remove it")
    size = len(v.encode("utf-8", "surrogatepass"))
    if kind != "name":
        if size > PATH_MAX:
            raise ConfigError(f"{label} is {size:,} bytes long; a path holds at most {PATH_MAX:,}")
        return
    if v in ("", ".", ".."):
        raise ConfigError(f"{label} {show(v)} names no run directory of its own; choose a name such as my-run")
    if "/" in v or "\\" in v:
        raise ConfigError(f"{label} {show(v)} is a path; a run name is one folder name, without / or \\ (put the "
                          f"folder it goes in into --out)")
    if size > NAME_MAX:
        raise ConfigError(f"{label} is {size:,} bytes long; a run name holds at most {NAME_MAX}")


def check_values(obj: Any, prefix: str | None = None, allow_large: bool = False, names=None) -> None:
    """Coerce (in place) and check every field of the dataclass instance ``obj``; what an earlier version wrote
    for None (``old_none``) becomes None."""
    for name, s in settings_of(type(obj)).items():
        if names is not None and name not in names:
            continue
        v = getattr(obj, name)
        v = None if s.declared and was_none(s, v) else coerce(s, v, prefix)
        check(s, v, prefix, allow_large)
        object.__setattr__(obj, name, v)


def from_values(cls: type, values: dict[str, Any], prefix: str | None = None, owner: str = "the run",
                what: str = "setting", allow_large: bool = False):
    """An instance of the declared dataclass ``cls`` from ``values`` (coerced, then every field checked);
    ``old_none`` values read as None. An unknown key (``-`` read as ``_``) is a one-line error that lists the
    known ones: "``owner`` has no ``what`` 'KEY'; its ``what``s: ..."."""
    sets = settings_of(cls)
    kw = {}
    for k, v in values.items():
        key = k.replace("-", "_")
        if key not in sets:
            known = ", ".join(sets) or "none"
            raise ConfigError(f"{owner} has no {what} {show(k)}; its {what}s: {known}")
        s = sets[key]
        kw[key] = None if (s.declared and was_none(s, v)) else coerce(s, v, prefix)
    obj = cls(**kw)
    check_values(obj, prefix, allow_large)
    return obj


def read_old(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with what earlier versions wrote for None replaced by None (saved configs, checkpoints)."""
    sets = settings_of(cls)
    return {k: (None if k in sets and was_none(sets[k], v) else v) for k, v in values.items()}


# ------------------------------------------------------------------------------------------------ notations
_SIZES = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def byte_size(value: Any) -> int:
    """``"2GB"``, ``"512MiB"``, ``"1.5g"``, ``10**9`` -> bytes (an int); ValueError for anything else.
    A declaration's ``parse`` for a memory size: ``setting(None, "...", parse=byte_size, unit="bytes")``."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, (int, float)):
        n = float(value)
    else:
        text = str(value).strip().lower().replace(" ", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(num):]
        if unit not in _SIZES or not num:
            raise ValueError(value)
        n = float(num) * _SIZES[unit]
    if not math.isfinite(n) or n < 0 or n > INT64[1]:
        raise ValueError(value)
    return int(n)


byte_size.notation = ("a number of bytes with a unit: B, kB, MB, GB, TB (powers of 1000; k, m, g, t alike) or KiB, "
                      "MiB, GiB, TiB (powers of 1024), e.g. 2GB or 512MiB")


# ------------------------------------------------------------------------------------------------ descriptions
def type_text(s: Setting) -> str:
    if s.kind is tuple:
        t = f"list of {_kind_name(s.item)}"
    elif s.decl.numbers is not None:
        t = f"{_kind_name(s.kind)} or {_kind_name(s.decl.numbers)}"
    else:
        t = _kind_name(s.kind)
    return t + (" or None" if s.nullable else "")


def size_text(n: int) -> str:
    """A byte count the way :func:`byte_size` reads it, in the largest unit that divides it (2GB, 512MiB)."""
    for unit in ("tb", "tib", "gb", "gib", "mb", "mib", "kb", "kib"):
        if n and n % _SIZES[unit] == 0:
            return f"{n // _SIZES[unit]}{unit.upper().replace('I', 'i')}"
    return str(n)


def default_text(s: Setting) -> str:
    v = s.default
    if v is dataclasses.MISSING:
        return "(required)"
    if s.decl.parse is byte_size and isinstance(v, int):
        return size_text(v)
    if v is None:
        return "None" + (f": {s.decl.none_means}" if s.decl.none_means else "")
    if isinstance(v, tuple):
        return ",".join(map(str, v)) or (s.decl.none_means or "(none)")
    if isinstance(v, str):
        return v or '""'
    return str(v).lower() if isinstance(v, bool) else _num(v) if isinstance(v, float) else str(v)


def allowed_text(s: Setting) -> str:
    """Choices, registry, range, limit and unit, in words ("" when anything of the type goes)."""
    d = s.decl
    parts = []
    allowed = d.allowed()
    if d.registry is not None:
        parts.append(f"a {d.registry.kind} name: {', '.join(d.registry.names())}")
    if allowed is not None:
        parts.append(", ".join(map(str, allowed)))
    r = range_text(d)
    if r:
        parts.append(f"a number {r}" if d.numbers is not None else r)
    if d.limit is not None:
        parts.append(f"at most {d.limit:,} unless {ALLOW_LARGE}")
    if d.unit:
        parts.append(d.unit)
    if d.old_none:
        parts.append(f"{d.old_none} also means None (earlier versions)")
    return "; ".join(parts)


def rows(cls: type, comments: dict[str, str] | None = None, groups: Iterable[str] = ()) -> list[dict[str, str]]:
    """One dict per field (name, flag, type, default, allowed, help, group) for tables: the documentation's
    and ``fedlt list``'s, in field order within ``groups`` (in that order; the others after them, ungrouped
    last). A plain field's help is the comment written beside it (``comments``, else read from the source of
    ``cls`` and its bases)."""
    if comments is None and not all(s.declared for s in settings_of(cls).values()):
        comments = field_comments(cls)
    out = []
    for s in settings_of(cls).values():
        out.append({"name": s.name, "flag": ", ".join([s.flag, *s.decl.flags]) if s.decl.cli else "",
                    "type": type_text(s), "default": default_text(s), "allowed": allowed_text(s),
                    "help": s.decl.text() or (comments or {}).get(s.name, ""), "group": s.decl.group or ""})
    order = list(groups) + [r["group"] for r in out if r["group"]] + [""]
    return sorted(out, key=lambda r: order.index(r["group"]))


def field_comments(cls: type) -> dict[str, str]:
    """``{field: the comment on its line}`` for the annotated fields of ``cls`` and its bases (the style of a
    plain ``@dataclass class Params`` with a comment beside each field)."""
    import ast
    import inspect
    import io
    import tokenize

    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            source = inspect.cleandoc("\n" + inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        line_comment = {t.start[0]: t.string.lstrip("#").strip()
                        for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                text = " ".join(line_comment[n] for n in range(node.lineno, node.end_lineno + 1) if n in line_comment)
                if text:
                    out[node.target.id] = text
    return out


# ------------------------------------------------------------------------------------------------ command line
class _Help(str):
    """A help text rendered when help is shown (the registries' names are looked up only then)."""

    setting: Setting


def help_text(s: Setting) -> str:
    """The option's help: the declaration's help, then the default and what is allowed."""
    d = s.decl
    extra = []
    if d.registry is not None:
        extra.append(f"{', '.join(d.registry.names())}")
    elif callable(d.choices):
        extra.append(", ".join(map(str, d.allowed())))
    if s.kind is not bool:
        extra.append(f"default: {d.none_means}" if s.default in (None, ()) and d.none_means else
                     f"default {default_text(s)}")
    r = range_text(d)
    if r and d.numbers is None:
        extra.append(r + (f" {d.unit}" if d.unit else ""))
    elif d.unit:
        extra.append(d.unit)
    if d.limit is not None:
        extra.append(f"at most {d.limit:,} without {ALLOW_LARGE}")
    return f"{d.text()} ({'; '.join(extra)})" if extra else d.text()


class HelpFormatter(argparse.HelpFormatter):
    """Renders the declared options' help when it is shown (``fedlt run --help``)."""

    def _get_help_string(self, action):
        h = action.help
        return help_text(h.setting).replace("%", "%%") if isinstance(h, _Help) else h


def metavar_of(s: Setting) -> str | None:
    d = s.decl
    if d.metavar:
        return d.metavar
    allowed = d.allowed() if not callable(d.choices) else None
    if allowed is not None:
        return "|".join([*map(str, allowed), "N"]) if d.numbers is not None else "{" + ",".join(map(str, allowed)) + "}"
    return {int: "N", float: "X"}.get(s.kind)


def add_arguments(parser: argparse.ArgumentParser, cls: type, names: Iterable[str] | None = None, *,
                  groups: dict[str, Any] | None = None, typed: bool = False) -> dict[str, Any] | None:
    """One option per declared field of ``cls`` that has ``cli`` (or only ``names``). With ``groups`` (a dict,
    which may hold groups made already), each goes into the argument group named by its ``group``, created on
    first use; without, into ``parser``. Values stay text (``dest`` = the field's name, None when not given)
    for :func:`coerce`, unless ``typed``: then argparse coerces and checks them itself (for a command's
    options that are not a run's settings). Returns the groups."""
    parser.formatter_class = HelpFormatter
    wanted = None if names is None else list(names)
    for s in settings_of(cls).values():
        if not s.decl.cli or (wanted is not None and s.name not in wanted):
            continue
        g = parser
        if s.decl.group and groups is not None:
            if s.decl.group not in groups:
                groups[s.decl.group] = parser.add_argument_group(s.decl.group)
            g = groups[s.decl.group]
        h = _Help(s.name)  # written when shown (help_text)
        h.setting = s
        flags = [s.flag, *s.decl.flags]
        if s.kind is bool and not s.nullable:
            if s.default is True:
                flags = ["--no-" + s.flag[2:]]
            g.add_argument(*flags, dest=s.name, action="store_const", const=not s.default, default=None, help=h)
            continue
        kw: dict[str, Any] = {"dest": s.name, "help": h, "metavar": metavar_of(s)}
        if typed:
            kw["type"] = _argparse_type(s)
        elif s.kind is tuple:  # a list: the option repeated, or comma-separated (given() joins them)
            kw["action"] = "append"
        g.add_argument(*flags, **kw)
    return groups


def _argparse_type(s: Setting):
    def parse(text: str):
        try:
            v = coerce(s, text)
            check(s, v)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return v

    parse.__name__ = _kind_name(s.kind)
    return parse


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The declared options of ``cls`` that the command line gave (not None)."""
    return {k: ",".join(v) if isinstance(v, list) and s.kind is tuple else v
            for k, s in settings_of(cls).items() if (v := getattr(args, k, None)) is not None}


# ------------------------------------------------------------------------------------------------ relations
@dataclass(frozen=True)
class Relation:
    """A relation between settings, declared beside them (where they are declared: ``fedlt.config.RELATIONS``, and
    the lists it includes from ``core.spec``, ``core.finetune``, ``core.privacy_settings``, ``fedlt.pretrained``;
    ``engine.faults.RELATIONS`` for the time model's, checked when a run is prepared) and checked like them
    (:func:`check_relations`): one line, exit status 2, before anything is loaded or written.

    ``kind`` says which: ``applies only when`` (a setting that the configuration would ignore: given a value
    other than its default where ``holds`` is false), ``requires`` (where ``when`` holds -- by default, where the
    setting is given -- ``holds`` must too) or ``excludes`` (the setting and ``others[0]`` are not both given).
    ``message``: the one-line error, what is wrong and how to fix it (a ``str.format`` template of the settings,
    or a function of them). ``bad``: configurations that break the relation (overrides, as ``fedlt run``'s
    settings), drawn by the tests and shown by the documentation."""

    kind: str
    setting: str
    others: tuple[str, ...]
    holds: Callable[[Any], bool]
    message: str | Callable[[Any], str]
    when: Callable[[Any], bool] | None = None
    bad: tuple[dict, ...] = ()

    def active(self, obj: Any, base: dict | None = None) -> bool:
        if self.when is not None:
            return bool(self.when(obj))
        if not is_set(obj, self.setting, base):
            return False
        return self.kind != "excludes" or all(is_set(obj, o, base) for o in self.others)

    def error(self, obj: Any) -> str:
        if callable(self.message):
            return self.message(obj)
        return self.message.format(**{k: getattr(obj, k) for k in settings_of(type(obj))})

    def text(self) -> str:
        """The relation in words, for tables: ``availability-mean applies only when availability``."""
        flag = lambda n: n.replace("_", "-")  # noqa: E731
        others = words([flag(o) for o in self.others], "and") if self.others else "its own values"
        return f"{flag(self.setting)} {self.kind} {others}"


def is_set(obj: Any, name: str, base: dict | None = None) -> bool:
    """Whether the setting ``name`` of ``obj`` holds something other than its declared default (or than the value
    of ``base``, the named settings it started from: a preset): what the user gave. A default restated (a Flower
    run config, ``RunConfig.to_dict()`` and sweep bases write every setting) changes nothing, so it counts as
    not given."""
    s = settings_of(type(obj))[name]
    v = getattr(obj, name)
    if base and name in base and v == base[name]:
        return False
    if s.default is dataclasses.MISSING:
        return True
    return v != s.default and not (v in ((), {}, None) and s.default in ((), {}, None))


GIVEN = "given"  # Decl.only_with's values: the other setting given (anything but its default)


def example_of(s: Setting) -> Any:
    """A value other than its default that setting ``s`` takes (a relation's bad example): a choice, the other
    truth value, a number within its bounds."""
    if s.kind is bool:
        return not s.default
    if (allowed := s.decl.allowed()) is not None:
        return next(c for c in allowed if c != s.default)
    if s.kind is str:
        return "1"  # text, which a notation of its own (rounds: lr-milestones) reads too
    low, high = s.decl.low or 0, s.decl.high
    value = (low + high) / 2 if high is not None and high - low <= 2 else low + 1
    if value == s.default:
        value = (value + high) / 2 if high is not None and high - low <= 2 else value + 1
    return int(value) if s.kind is int else float(value)


def only_with_relations(cls: type) -> list[Relation]:
    """The "applies only when" relations that the settings of ``cls`` declare with ``only_with`` (:class:`Decl`):
    each one's test, its one-line message (what takes it, the declaration's why, and "add that or drop it") and its
    bad examples (the setting at :func:`example_of`, the other at its default, and in the configurations the
    declaration gives)."""
    table = settings_of(cls)
    out = []
    for name, s in table.items():
        if s.decl.only_with is None:
            continue
        other, values, *rest = s.decl.only_with
        elsewhere = [e for e in rest if isinstance(e, dict)]
        why = "".join(f" ({e})" for e in rest if isinstance(e, str))
        o = table[other]
        if values == GIVEN:
            holds = (lambda n: lambda c: is_set(c, n))(other)
            takes = add = f"{o.flag} {o.decl.metavar or 'X'}"
        elif o.kind is bool:
            holds = (lambda n: lambda c: bool(getattr(c, n)))(other)
            takes = add = o.flag
        else:
            holds = (lambda n, vs: lambda c: getattr(c, n) in vs)(other, tuple(values))
            takes = words([f"{o.flag} {v}" for v in values], "and")
            add = "one" if len(values) > 1 else takes
        bad = ({name: example_of(s)}, *({**e, name: example_of(s)} for e in elsewhere))
        out.append(applies_when(name, holds, f"{s.flag} applies to {takes}{why}; add {add} or drop it", others=(other,),
                                bad=bad))
    return out


def applies_when(setting: str, holds: Callable[[Any], bool], message, *, others: Iterable[str] = (),
                 bad: Iterable[dict] = ()) -> Relation:
    """``setting``, given a value other than its default, applies only where ``holds(settings)``; elsewhere the
    configuration would ignore it, so it is refused (``message``: which configurations take it, and "drop it")."""
    return Relation("applies only when", setting, tuple(others), holds, message, None, tuple(bad))


def requires(setting: str, holds: Callable[[Any], bool], message, *, when: Callable[[Any], bool] | None = None,
             others: Iterable[str] = (), bad: Iterable[dict] = ()) -> Relation:
    """``setting`` -- where ``when(settings)``, by default where it is given -- requires ``holds(settings)``."""
    return Relation("requires", setting, tuple(others), holds, message, when, tuple(bad))


def excludes(setting: str, other: str, message, *, bad: Iterable[dict] = ()) -> Relation:
    """``setting`` and ``other`` cannot both be given."""
    return Relation("excludes", setting, (other,), lambda _: False, message, None, tuple(bad))


def check_relations(obj: Any, relations: Iterable[Relation], base: dict | None = None) -> None:
    """The first relation that ``obj`` breaks: its one-line ConfigError (``base``: see :func:`is_set`)."""
    for r in relations:
        if r.active(obj, base) and not r.holds(obj):
            raise ConfigError(r.error(obj))
