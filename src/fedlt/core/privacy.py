"""What leaves the client: every array and meta value a method's clients send, declared beside the method and
checked against what they actually send.

A method declares ``sends`` (:class:`Sent` entries, one per thing its clients send, in the training rounds and in
each post-training phase), each with a category from :data:`CATEGORIES` that says what it reveals about the
client's data (a subclass builds its own from its base class's by name: :func:`sends_with`). :func:`classify`
matches a client's reply to the declaration, item by item; the run driver hands
every exchange's replies to :func:`sends_check` (``FEDLT_CHECK_SENDS=1``: an undeclared item stops the run with
one line; the test suite sets it) and the run directory records what left the clients in ``sent.jsonl``
(:class:`SentLog`). ``fedlt list METHOD`` and the generated page ``docs/privacy.md`` show the declarations. What the
engine adds where the clients apply the DP themselves (:data:`ENGINE_SENDS`) is matched and recorded the same way.
An engine whose own protocol has the clients send more (Flower's describe and evaluation replies, the fields around
a training reply) declares it too, as :class:`EngineSent` items by message, ``--dp`` mode and kind of client
(``fedlt.engine.flower.sends``); :func:`engine_record` matches and records them (``sent.jsonl`` rows with
``"engine"``), strictly with ``FEDLT_CHECK_SENDS=1``.
"""
from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from fnmatch import fnmatchcase
from numbers import Number
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from ..errors import ConfigError

# name -> what it reveals about the client's data; keep short, one line each
CATEGORIES: dict[str, str] = {
    "model": "a model or an update of one (weights, buffers, deltas, control variates): what training on the "
             "client's data made of it -- open to membership inference and gradient inversion",
    "model-part": "a part of the model trained apart (a head, a classifier): the same, for that part; a "
                  "classifier's rows are shaped by the client's classes",
    "size": "the number of training samples the client holds",
    "scalars": "training statistics: losses and their parts, step counts, norms -- a number or a few each",
    "class-counts": "per-class counts, or which classes the client holds: its label distribution",
    "class-means": "per-class means or sums of features (prototypes, centres): a summary of the client's samples "
                   "of each class, and which classes it holds",
    "class-moments": "covariances, variances or second moments of the client's features (per class, or over all "
                     "its samples): their spread, on top of the means",
    "class-gradients": "per-class gradients of a loss on the client's samples of each class: what gradient "
                       "inversion works on, class by class",
    "features": "features of the client's samples or a statistic of them (a mean feature), or synthetic samples",
    "echo": "a value the server sent, returned (a mode, which experts trained): nothing about the client's data",
    "protocol": "an engine's bookkeeping (which client answers, whether it keeps a state, which model it evaluated "
                "with): nothing about the client's data but what its entry says",
}

MODEL = "<model>"  # stands for any entry of the method's model state dict (``method.net.state_dict()`` keys)
ROUNDS = "rounds"  # a Sent's ``when``: the training rounds (else a phase's name, or "*": every exchange)
ANY = "*"
ENV = "FEDLT_CHECK_SENDS"  # "1": an undeclared item stops the run (tests, development)
UNDECLARED = "undeclared"
# what privatises a declared item under --dp client (fedlt.core.dp), besides the model's entries:
UPDATE = "update"  # an entry the client received and sends back, which the server averages: clipped and noised
#                    with the model's update (RedGrape's supplementary classifier)
CLASS_MEAN = "class-mean"  # per-class arrays PREFIX.* keyed by the class ids PREFIX.classes, of which the server
#                    needs, per class, the mean over the clients that hold it (core.classgrad.mean_class_grads):
#                    clipped on the client, the per-class sums and counts noised on the server
# what covers a declared item under --dp sample (fedlt.core.dpsgd), besides the model's entries:
DERIVED = "derived"  # computed on the client from the model DP-SGD trained, what it received and its own earlier such
#                    arrays (SCAFFOLD's control-variate change): post-processing of DP-SGD's output
DP_MECHANISMS = {UPDATE: "clipped and noised with the model update",
                 CLASS_MEAN: "noised per-class means: clipped on the client, their per-class sums and the count of "
                             "clients holding each class noised on the server",
                 DERIVED: "--dp sample: computed from the model DP-SGD trained and what the client received "
                          "(post-processing)"}
CLIENT_MECHANISMS = (UPDATE, CLASS_MEAN)  # --dp client's; DERIVED is --dp sample's
DOC = "docs/privacy.md"


@dataclass(frozen=True)
class Sent:
    """One thing a method's clients send: ``name``, an fnmatch pattern of an array name (or :data:`MODEL`: any
    entry of the model's state dict) or of a meta key (``meta``); its ``category`` (:data:`CATEGORIES`) and in
    words ``what`` it is; ``when``: ``"rounds"`` (the training rounds), a post-training phase's name, or ``"*"``;
    ``numbers_only``: a meta pattern that matches only numbers (int, float, bool: losses and their parts); ``dp``:
    the mechanism that privatises it under ``--dp client``, or (``derived``) covers it under ``--dp sample``, where
    its category alone would be refused (:data:`DP_MECHANISMS`; the training rounds' arrays only)."""

    name: str
    category: str
    what: str
    meta: bool = False
    when: str = ROUNDS
    numbers_only: bool = False
    dp: str = ""

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"Sent {self.name!r}: category {self.category!r} is none of "
                             f"{', '.join(CATEGORIES)} (fedlt.core.privacy.CATEGORIES)")
        if self.numbers_only and not self.meta:
            raise ValueError(f"Sent {self.name!r}: numbers_only applies to meta values (meta=True)")
        if self.name == MODEL and self.meta:
            raise ValueError(f"Sent {MODEL}: the model's entries are arrays, not meta values")
        if self.dp and (self.dp not in DP_MECHANISMS or self.meta or self.when != ROUNDS
                        or (self.dp == CLASS_MEAN and "." not in self.name)):
            raise ValueError(f"Sent {self.name!r}: dp={self.dp!r} must be one of {', '.join(DP_MECHANISMS)}, on an "
                             f"array of the training rounds ({CLASS_MEAN}: named PREFIX.NAME)")

    def applies(self, exchange: str) -> bool:
        return self.when in (ANY, exchange)

    @property
    def kind(self) -> str:
        return "meta" if self.meta else "array"


def sent(name: str, category: str, what: str, *, meta: bool = False, when: str = ROUNDS,
         numbers_only: bool = False, dp: str = "") -> Sent:
    """A :class:`Sent` (its category checked against :data:`CATEGORIES`)."""
    return Sent(name, category, what, meta, when, numbers_only, dp)


def sends_with(base: tuple[Sent, ...], *items: Sent, without: tuple[str, ...] = ()) -> tuple[Sent, ...]:
    """A method's ``sends`` built from its base class's by name, not by position: each of ``items`` takes the place
    of the base's item of the same name and ``when`` (``sent(MODEL, ...)``: what of the model travels), or else joins
    them, before the first of the base's items that would match it first (the matching takes the first that applies,
    so a meta number goes before the training statistics' ``"*"``), at the end where none would; ``without``: the
    names of the base's items its clients do not send (``(MODEL,)``: no model)."""
    out = [s for s in base if s.name not in without]
    for item in items:
        same = next((i for i, s in enumerate(out) if (s.name, s.when) == (item.name, item.when)), None)
        if same is not None:
            out[same] = item
            continue
        first = next((i for i, s in enumerate(out) if s.meta == item.meta and s.name != MODEL
                      and (s.when == item.when or ANY in (s.when, item.when)) and fnmatchcase(item.name, s.name)), len(out))
        out.insert(first, item)
    return tuple(out)


# What the engine's own protocol adds to a method's replies where the clients apply the DP themselves (Flower's
# ClientApp): matched before the method's declaration (whose patterns may be wider), recorded like it; listed with the
# Flower engine's other items (fedlt.engine.flower.sends).
ENGINE_SENDS: tuple[Sent, ...] = (
    sent("dp_unclipped", "scalars", "--dp client on Flower: whether its update was within the clip (1) or not (0), "
         "which adaptive clipping counts", meta=True, numbers_only=True),
    sent("dp_history", "scalars", "--dp sample on Flower: its accountant's entries of the message, [(noise "
         "multiplier, sampling rate, steps)], which follow from its size and the run's settings", meta=True, when=ANY),
)


# ------------------------------------------------------------------------------------------------ an engine's own
DP_MODES = ("off", "client", "sample")  # the --dp modes (RunConfig.dp's choices) an EngineSent is sent under
DATA_DIR = "data-dir"  # an EngineSent's ``nodes``: only clients that hold their own data (not the run's partition)


@dataclass(frozen=True)
class EngineSent:
    """One thing an engine's own protocol has a client send, besides the method's replies (Flower's describe and
    evaluation replies, the fields around a training reply): ``name``, an fnmatch pattern of the field; the
    ``messages`` whose replies carry it; its ``category`` (:data:`CATEGORIES`) and in words ``what`` it is; ``dp``,
    the ``--dp`` modes under which it is sent (the shrunken forms of a DP run are the items that lack a mode);
    ``nodes``: "" (every client) or :data:`DATA_DIR` (only a client that holds its own data: where the run's settings
    give the server its data's facts, it sends none). An engine declares a tuple of them, as a method its ``sends``
    (``fedlt.engine.flower.sends``)."""

    messages: tuple[str, ...]
    name: str
    category: str
    what: str
    dp: tuple[str, ...] = DP_MODES
    nodes: str = ""

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"EngineSent {self.name!r}: category {self.category!r} is none of {', '.join(CATEGORIES)}")
        if not set(self.dp) <= set(DP_MODES) or self.nodes not in ("", DATA_DIR):
            raise ValueError(f"EngineSent {self.name!r}: dp must be among {', '.join(DP_MODES)}, nodes '' or {DATA_DIR}")

    def applies(self, message: str, dp: str, own_data: bool) -> bool:
        return message in self.messages and dp in self.dp and (own_data or self.nodes != DATA_DIR)


def engine_match(items: tuple[EngineSent, ...], message: str, name: str, dp: str, own_data: bool) -> EngineSent | None:
    """The first of an engine's declared ``items`` that covers field ``name`` of a ``message`` reply, sent under
    ``--dp dp`` by a client that holds its own data (``own_data``) or serves the run's partition; None: undeclared."""
    return next((e for e in items if e.applies(message, dp, own_data) and fnmatchcase(name, e.name)), None)


def engine_rows_of(items: tuple[EngineSent, ...]) -> list[dict[str, str]]:
    """An engine's declaration as table rows: messages, name, dp (the modes, "any" for all), nodes, category, what."""
    return [{"message": ", ".join(e.messages), "name": e.name,
             "dp": "any" if set(e.dp) == set(DP_MODES) else ", ".join(e.dp),
             "nodes": "own data" if e.nodes == DATA_DIR else "any", "category": e.category, "what": e.what}
            for e in items]


def class_gaussian_sends(prefix: str, when: str, backbone: str) -> tuple[Sent, ...]:
    """What a client sends for a phase that fits the server a Gaussian per class of its features (CCVR's
    calibration, DFL-FS's regeneration; ``fedlt.core.retrain.class_gaussians`` computes them): the classes it
    holds, their counts, means and covariances under ``backbone``, and its size -- under ``prefix.classes`` /
    ``.count`` / ``.mean`` / ``.cov``."""
    return (
        sent(f"{prefix}.classes", "class-counts", "the classes the client holds, [|C_k|] class ids", when=when),
        sent(f"{prefix}.count", "class-counts", "its number of samples of each held class, [|C_k|]", when=when),
        sent(f"{prefix}.mean", "class-means", f"its per-class feature means under {backbone}, [|C_k|, d]", when=when),
        sent(f"{prefix}.cov", "class-moments", "its per-class feature covariances, [|C_k|, d, d]", when=when),
        sent("num_examples", "size", "the number of training samples", meta=True, when=when),
    )


def check_declaration(cls) -> None:
    """A method class's ``sends`` is a tuple of :class:`Sent` (a TypeError naming the class, when the class is
    defined). Whether each ``when`` names one of its phases is the disclosure test's (``tests/test_sends.py``):
    some methods choose their phases from their parameters."""
    sends = getattr(cls, "sends", ())
    if not isinstance(sends, tuple) or not all(isinstance(s, Sent) for s in sends):
        raise TypeError(f"{cls.__qualname__}.sends must be a tuple of fedlt.core.privacy.Sent "
                        f"(fedlt.core.privacy.sent(...))")


# ------------------------------------------------------------------------------------------------ matching
def exchange_of(kind: str) -> str:
    """The driver's exchange ``kind`` ("train", or a phase's name) as a Sent's ``when``."""
    return ROUNDS if kind == "train" else kind


def is_number(v: Any) -> bool:
    return isinstance(v, (Number, np.number, np.bool_)) and not isinstance(v, (complex, np.complexfloating))


def shape_of(v: Any) -> list[int]:
    """An array's shape; a meta value's: a tensor's or array's, a list's length, [] for a scalar."""
    if isinstance(v, (torch.Tensor, np.ndarray)):
        return list(v.shape)
    if isinstance(v, (list, tuple, dict)):
        return [len(v)]
    return []


def bytes_of(v: Any) -> int:
    """An array's size in bytes; a meta value's, as it crosses (a number 8, a bool 1, text its UTF-8 bytes)."""
    if isinstance(v, torch.Tensor):
        return int(v.numel() * v.element_size())
    if isinstance(v, np.ndarray):
        return int(v.nbytes)
    if isinstance(v, (bool, np.bool_)):
        return 1
    if isinstance(v, (Number, np.number)):
        return 8
    if isinstance(v, str):
        return len(v.encode())
    if isinstance(v, (list, tuple)):
        return sum(bytes_of(x) for x in v)
    if isinstance(v, dict):
        return sum(bytes_of(k) + bytes_of(x) for k, x in v.items())
    return 0


class Declared:
    """A method's declaration, ready to match replies: the model's state-dict keys (computed once, when first
    needed) and each (exchange, kind, name, number?) looked up once."""

    def __init__(self, method):
        self.method = method
        self.sends: tuple[Sent, ...] = ENGINE_SENDS + tuple(getattr(type(method), "sends", ()))
        self._model: frozenset[str] | None = None
        self._cache: dict[tuple, Sent | None] = {}

    @property
    def model_keys(self) -> frozenset[str]:
        if self._model is None:
            self._model = frozenset(self.method.net.state_dict().keys())
        return self._model

    def match(self, exchange: str, name: str, meta: bool, value: Any = None) -> Sent | None:
        """The first declared Sent that applies to ``name`` (an array, or a meta key with ``value``) sent in
        ``exchange``; None: undeclared."""
        number = meta and is_number(value)
        key = (exchange, meta, name, number)
        if key not in self._cache:
            self._cache[key] = next((s for s in self.sends if s.meta == meta and s.applies(exchange)
                                     and (number or not s.numbers_only) and self._named(s, name)), None)
        return self._cache[key]

    def _named(self, s: Sent, name: str) -> bool:
        return name in self.model_keys if s.name == MODEL else fnmatchcase(name, s.name)


_DECLARED: "weakref.WeakKeyDictionary[Any, Declared]" = weakref.WeakKeyDictionary()


def declared_sends(method) -> Declared:
    d = _DECLARED.get(method)
    if d is None:
        d = _DECLARED[method] = Declared(method)
    return d


def classify(method, exchange: str, message) -> list[dict]:
    """Every array and meta value of one client's reply ``message`` in ``exchange`` ("rounds" or a phase's name),
    matched to the first declared :class:`Sent` of ``method.sends`` that applies: rows {"name", "kind" (array or
    meta), "shape", "bytes", "category", "declared" (the Sent's name)}; an undeclared item has category
    "undeclared" and declared None."""
    d = declared_sends(method)
    rows = []
    for kind, items in (("array", message.arrays), ("meta", message.meta)):
        for name, v in items.items():
            s = d.match(exchange, name, kind == "meta", v)
            rows.append({"name": name, "kind": kind, "shape": shape_of(v), "bytes": bytes_of(v),
                         "category": s.category if s else UNDECLARED, "declared": s.name if s else None})
    return rows


def where(kind: str, index: int) -> str:
    return f"round {index}" if kind == "train" else f"phase {kind!r}"


def undeclared_error(method, cid: int, kind: str, index: int, row: dict) -> ConfigError:
    what = f"an array {row['shape']}" if row["kind"] == "array" else \
        f"a meta value {row['shape']}" if row["shape"] else "a meta value"
    cls = type(method).__name__
    return ConfigError(f"method {method.name}'s client {cid} sent {row['name']!r} ({what}) in {where(kind, index)}, "
                       f"which {cls}.sends does not declare: add a Sent for it ({DOC})")


def strict() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def sends_check(method) -> Callable[[str, int, list], None]:
    """The run driver's first ``on_replies`` hook: with ``FEDLT_CHECK_SENDS=1`` in the environment (the test
    suite sets it), an item of a reply that ``method.sends`` does not declare stops the run with one line (a
    ConfigError); otherwise nothing (the run directory's :class:`SentLog` records it and says so once)."""
    if not strict():
        return lambda kind, index, replies: None

    def check(kind: str, index: int, replies: list) -> None:
        for cid, msg in replies:
            for row in classify(method, exchange_of(kind), msg):
                if row["category"] == UNDECLARED:
                    raise undeclared_error(method, cid, kind, index, row)

    return check


# ------------------------------------------------------------------------------------------------ the record
SENT = "sent.jsonl"


def summarise(method, kind: str, index: int, replies: list) -> list[dict]:
    """One exchange's replies as rows, one per declared item (an undeclared one: per name): {"round": r} or
    {"phase": name}, "sent" (the Sent's name), "category", "arrays" or "values" (how many one client sent; the
    most, where clients differ), "shape" (of one client's, when it sent one and all agree), "bytes" (summed over
    the clients), "clients" (how many sent it)."""
    ex = exchange_of(kind)
    at = {"round": index} if kind == "train" else {"phase": kind}
    return grouped(at, [classify(method, ex, msg) for _, msg in replies])


def grouped(at: dict, per_client: list[list[dict]]) -> list[dict]:
    """Rows of :func:`classify` (or :func:`engine_classify`), one list per client, as ``sent.jsonl`` rows: ``at``
    (where they were sent) and one row per declared item (an undeclared one: per name)."""
    groups: dict[tuple, dict] = {}
    for client_rows in per_client:
        per: dict[tuple, list] = {}
        for r in client_rows:
            key = (r["declared"] or r["name"], r["kind"], r["category"])
            per.setdefault(key, []).append(r)
        for key, rows in per.items():
            g = groups.setdefault(key, {"n": 0, "bytes": 0, "clients": 0, "shapes": set()})
            g["n"] = max(g["n"], len(rows))
            g["bytes"] += sum(r["bytes"] for r in rows)
            g["clients"] += 1
            g["shapes"].add(tuple(rows[0]["shape"]) if len(rows) == 1 else None)
    out = []
    for (name, k, cat), g in groups.items():
        row = {**at, "sent": name, "category": cat, ("values" if k == "meta" else "arrays"): g["n"]}
        if len(g["shapes"]) == 1 and None not in g["shapes"]:
            row["shape"] = list(next(iter(g["shapes"])))
        out += [{**row, "bytes": g["bytes"], "clients": g["clients"]}]
    return out


def engine_classify(items: tuple[EngineSent, ...], message: str, fields: dict[str, Any], dp: str,
                    own_data: bool) -> list[dict]:
    """Every field of one client's ``message`` reply that an engine's own protocol adds (``fields``: name -> value)
    matched to the engine's declared ``items`` (:func:`engine_match`): rows as :func:`classify` makes them."""
    rows = []
    for name, v in fields.items():
        e = engine_match(items, message, name, dp, own_data)
        rows.append({"name": name, "kind": "meta", "shape": shape_of(v), "bytes": bytes_of(v),
                     "category": e.category if e else UNDECLARED, "declared": e.name if e else None})
    return rows


def engine_record(engine: str, items: tuple[EngineSent, ...], message: str, at: dict, replies: list, dp: str,
                  where: str) -> list[dict]:
    """One exchange's engine fields as ``sent.jsonl`` rows (``at`` and ``{"engine", "message"}`` first), from
    ``replies``: (client id, fields, whether the client holds its own data). With ``FEDLT_CHECK_SENDS=1`` a field
    the engine does not declare stops the run with one line (``where``: the module that declares them)."""
    per_client = []
    for cid, fields, own_data in replies:
        rows = engine_classify(items, message, fields, dp, own_data)
        bad = next((r for r in rows if r["category"] == UNDECLARED), None)
        if bad is not None and strict():
            raise ConfigError(f"the {engine} engine's client {cid} sent {bad['name']!r} in its {message} reply (--dp "
                              f"{dp}, {'its own data' if own_data else 'a client of the run partition'}), which "
                              f"{where} does not declare: declare it there ({DOC})")
        per_client.append(rows)
    return grouped({**at, "engine": engine, "message": message}, per_client)


class SentLog:
    """The run directory's ``sent.jsonl``: what left the clients, one row per declared item per exchange
    (:func:`summarise`), appended as the replies arrive (a driver ``on_replies`` hook). A fresh run starts the
    file empty; a resumed one (``resumed_after`` its checkpoint's round) keeps the rows of the rounds up to it and
    appends after them (the rows of later rounds and of phases, which the resumed run repeats, are dropped).
    An undeclared item is recorded ("undeclared") and ``echo`` says so once."""

    def __init__(self, run_dir: Path, method, echo: Callable[[str], None] = print, resumed_after: int | None = None):
        self.path = Path(run_dir) / SENT
        self.method, self.echo, self.said = method, echo, False
        if resumed_after is None or not self.path.is_file():
            self.path.write_text("")
        else:
            lines = self.path.read_text().splitlines(keepends=True)
            keep = [ln for ln in lines if _kept(ln, resumed_after)]
            if len(keep) != len(lines):
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(keep))
                os.replace(tmp, self.path)
        self.file = open(self.path, "a", buffering=1)

    def __call__(self, kind: str, index: int, replies: list) -> None:
        self.write(summarise(self.method, kind, index, replies),
                   lambda r: f"{self.method.name}'s clients sent {r['sent']!r} in {where(kind, index)}, which "
                             f"{type(self.method).__name__}.sends does not declare: {SENT} records it as undeclared "
                             f"(add a Sent for it, {DOC})")

    def write(self, rows: list[dict], note: Callable[[dict], str] | None = None) -> None:
        """Rows of what left the clients appended as they are (an engine's own items: :func:`engine_record`); the
        first undeclared one of the run is said once (``note``: in words)."""
        bad = next((r for r in rows if r["category"] == UNDECLARED), None)
        if bad is not None and not self.said:
            self.said = True
            self.echo("note: " + (note(bad) if note else
                                  f"the clients sent {bad['sent']!r} in the {bad.get('engine', '')} engine's "
                                  f"{bad.get('message', '')} replies, which the engine does not declare: {SENT} "
                                  f"records it as undeclared ({DOC})"))
        self.file.write("".join(json.dumps(r) + "\n" for r in rows))

    def close(self) -> None:
        self.file.close()


def _kept(line: str, resumed_after: int) -> bool:
    try:
        row = json.loads(line)
    except ValueError:  # a line cut by a kill
        return False
    return isinstance(row.get("round"), int) and row["round"] <= resumed_after


# ------------------------------------------------------------------------------------------------ tables
def rows_of(cls) -> list[dict[str, str]]:
    """A method class's declaration as table rows: when, name (array or meta), category, what."""
    out = []
    for s in getattr(cls, "sends", ()):
        name = "the model's entries" if s.name == MODEL else s.name
        kind = "meta" if s.meta else "arrays" if s.name == MODEL or any(c in s.name for c in "*?[") else "array"
        if s.numbers_only:
            kind += ", numbers"
        out.append({"when": s.when, "name": name, "kind": kind, "category": s.category, "what": s.what})
    return out


def categories_of(cls, when: str | None = None) -> list[str]:
    """The categories a method's clients send (in ``when``: "rounds", "phases" for any phase, or None: all), in
    :data:`CATEGORIES`' order."""
    sends = getattr(cls, "sends", ())
    got = {s.category for s in sends if when is None or (s.when in (ROUNDS, ANY) if when == ROUNDS
                                                         else s.when != ROUNDS)}
    return [c for c in CATEGORIES if c in got]


class PrivacyMechanism(Protocol):
    """What a run's DP mechanism does around the driver's exchanges (``--dp client``: :class:`fedlt.core.dp.ClientDP`;
    ``--dp sample``: :class:`fedlt.core.dpsgd.SampleDP`), and the only way the engine reaches it
    (:class:`fedlt.engine.privacy.Privacy`): where the replies are made, where they arrive, where the server sums,
    the accountant."""

    key: str | None  # --dp-noise-seed secret: the noise key (None: the noise follows from the run's seed)

    def client_side(self, payloads: dict, replies: list) -> list:
        """A training round's replies as their clients send them (the simulated clients: clipped, their meta cut)."""

    def phase_side(self, phase: str, replies: list) -> list:
        """A post-training phase's replies as their clients send them."""

    def arrived(self, payloads: dict, replies: list, phase: str | None = None) -> tuple[list, dict[int, str]]:
        """Replies whose clients applied the mechanism themselves (a deployment's), checked: those used, and why
        the others are not."""

    def server_side(self, replies: list, gen: torch.Generator) -> list:
        """The round's replies as the method's aggregate receives them (the server's noise, drawn from ``gen``)."""

    def epsilon(self, rounds: int) -> float:
        """The privacy loss after ``rounds`` rounds."""

    def over_budget(self, rnd: int) -> str | None:
        """Why round ``rnd`` may not run (--dp-budget), or None."""

    def record(self) -> dict:
        """The round's fields of metrics.jsonl."""

    def table(self, rounds: int) -> dict:
        """summary.json's ``dp``: the privacy loss and every input of its accountant."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps."""

    def load_state_dict(self, d: dict) -> None: ...
