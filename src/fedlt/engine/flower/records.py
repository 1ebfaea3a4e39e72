"""fedlt values <-> Flower records.

A fedlt :class:`~fedlt.core.method.Message` becomes three records of one ``RecordDict``:

==================  ==================  ===============================================================
record              type                holds
==================  ==================  ===============================================================
``arrays``          ``ArrayRecord``     ``Message.arrays`` (names unchanged: state-dict keys, extras)
``meta``            ``ConfigRecord``    ``Message.meta`` as a JSON skeleton (``json``); tensors or numpy
                                        arrays inside meta go to ``meta-arrays`` (an ``ArrayRecord``)
``metrics``         ``MetricRecord``    the numeric scalars of meta, ``num_examples`` also as Flower's
                                        ``num-examples`` (read by Flower tooling, never by fedlt): a
                                        server's message only; a client's reply carries no copy of its
                                        meta (``metrics=False``: what it sends is what is declared)
``config``          ``ConfigRecord``    ``Message.config``, the round's values the driver sets (``lr``),
                                        where there are any: Flower's per-round config
==================  ==================  ===============================================================

plus a ``fedlt`` ``ConfigRecord`` with the engine's own fields (round, phase, client id, the run settings).
A client state lives in ``context.state`` the same way (``fedlt.cstate`` + ``fedlt.cstate.arrays``) and
can be mirrored to a SuperNode's ``--state-dir`` (safetensors files, :mod:`fedlt.safefile`), one store per fedlt
run, so that it survives a SuperNode restart and a resumed run (a new Flower run) finds the version of the
round it resumes from.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ...codec import pack, unpack
from ...core.method import Message
from ..clientstate import ClientStates
from ...errors import ConfigError

CONTROL = "fedlt"
CSTATE, CSTATE_ARRAYS = "fedlt.cstate", "fedlt.cstate.arrays"


def to_records(msg: Message, control: dict[str, Any] | None = None, what: str = "message",
               metrics: bool = True) -> RecordDict:
    """The RecordDict that carries ``msg`` (and the engine's ``control`` fields); with ``metrics``, its numeric meta
    again as Flower's ``MetricRecord``."""
    skeleton, meta_arrays = pack(msg.meta, f"{what} meta")
    rd = RecordDict({"arrays": ArrayRecord({k: v.detach().cpu() for k, v in msg.arrays.items()}),
                     "meta": ConfigRecord({"json": skeleton})})
    if meta_arrays:
        rd["meta-arrays"] = ArrayRecord(meta_arrays)
    if metrics:
        scalars = {k: v for k, v in msg.meta.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "num_examples" in scalars:
            scalars["num-examples"] = scalars["num_examples"]
        rd["metrics"] = MetricRecord(scalars)
    if msg.config:
        rd["config"] = ConfigRecord(dict(msg.config))
    if control is not None:
        rd[CONTROL] = ConfigRecord(control)
    return rd


def from_records(rd: RecordDict) -> Message:
    """The fedlt Message inside a RecordDict made by :func:`to_records`."""
    arrays = rd["arrays"].to_torch_state_dict() if "arrays" in rd else {}
    meta_arrays = rd["meta-arrays"].to_torch_state_dict() if "meta-arrays" in rd else {}
    meta = unpack(str(rd["meta"]["json"]), meta_arrays) if "meta" in rd else {}
    return Message(arrays, meta, dict(rd["config"]) if "config" in rd else {})


def control(rd: RecordDict) -> ConfigRecord:
    return rd[CONTROL] if CONTROL in rd else ConfigRecord()


def value_records(obj: Any, what: str) -> tuple[ConfigRecord, ArrayRecord]:
    """Any packable tree (a client or server state) as a ConfigRecord (JSON) plus an ArrayRecord."""
    skeleton, arrays = pack(obj, what)
    return ConfigRecord({"json": skeleton}), ArrayRecord(arrays)


def records_value(cfg: ConfigRecord, arr: ArrayRecord) -> Any:
    return unpack(str(cfg["json"]), arr.to_torch_state_dict())


# ------------------------------------------------------------------------- client state
_STORES: dict[Path, ClientStates] = {}  # a process's --state-dir stores, one per (folder, fedlt run)
SESSION = "session"  # in a run's store folder: the newest start of the fedlt run whose messages it took


def node_store(state_dir: str | os.PathLike, run: str | int) -> ClientStates:
    """The client-state store (:mod:`fedlt.engine.clientstate`) of a SuperNode's ``--state-dir`` for one fedlt
    run (``run-<id>/``, the id the run directory keeps, whatever Flower run carries it): every state written
    through and flushed when stored (``context.state`` is the memory), each version tagged with its round,
    read again from the folder at every message (Flower runs a ClientApp process per message)."""
    d = Path(state_dir) / f"run-{run}"
    store = _STORES.get(d)
    if store is None:
        store = ClientStates(budget=0, directory=d, hint=f"delete {d} to start its clients afresh")
        _STORES[d] = store
    store.reopen()
    return store


def state_file(state_dir: str | os.PathLike, run: str | int, cid: int) -> Path:
    """The file holding client ``cid``'s current state in a ``--state-dir``."""
    return node_store(state_dir, run).path_of(cid)


NOISE_KEY = "fedlt.dp-noise-key"  # context.state's record, and the file in a --state-dir's run folder


def node_noise_key(state: RecordDict, state_dir: str | os.PathLike | None, run: str | int) -> str:
    """This SuperNode's secret DP noise key for fedlt run ``run`` (``--dp-noise-seed secret``): the one its
    ``--state-dir`` keeps for the run (written once, readable by its owner only), else the one ``context.state``
    keeps (the SuperNode's memory), else a new one (:func:`fedlt.core.noise.new_key`) kept in both. It never leaves the
    SuperNode; kept, it makes a round run again after a restart draw the noise it drew before."""
    from ...core.noise import new_key

    f = Path(state_dir) / f"run-{run}" / NOISE_KEY if state_dir else None
    if f is not None and f.is_file():
        key = f.read_text().strip()
    elif NOISE_KEY in state and str(state[NOISE_KEY].get("run")) == str(run):
        key = str(state[NOISE_KEY]["key"])
    else:
        key = new_key()
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ConfigError(f"{f or 'the SuperNode memory'}'s DP noise key is damaged (64 hex digits expected); delete "
                          f"it to draw a new one (this client's noise of the rounds already run is then not redrawn)")
    if f is not None and not f.is_file():
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f"{NOISE_KEY}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(key)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, f)
    state[NOISE_KEY] = ConfigRecord({"run": str(run), "key": key})
    return key


def enter_session(state_dir: str | os.PathLike, run: str | int, session: int) -> None:
    """Refuse a message of an earlier start of the run than one this store has served (a message a SuperLink
    kept from before it was restarted: it would roll the clients back behind the resumed run)."""
    d = Path(state_dir) / f"run-{run}"
    f = d / SESSION
    try:
        seen = int(f.read_text()) if f.is_file() else -1
    except (OSError, ValueError):
        seen = -1
    if session < seen:
        raise ConfigError(f"a message of start {session} of fedlt run {run}, which has been started again since "
                          f"(start {seen}): refused")
    if session > seen:
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{SESSION}.{os.getpid()}.tmp"
        tmp.write_text(str(int(session)))
        os.replace(tmp, f)


def save_client_state(state: RecordDict, cstate: dict, cid: int, state_dir=None, run: str | int = 0,
                      tag: int = 0, keep=()) -> None:
    """Store a client state in ``context.state`` (and in ``state_dir`` when given, flushed to disk), tagged with
    the round it reflects; the store keeps besides only the versions of the rounds in ``keep`` (those a server
    may resume from)."""
    cfg, arr = value_records(cstate, f"client {cid} state")
    cfg["client-id"], cfg["round"], cfg["run"] = int(cid), int(tag), str(run)
    state[CSTATE], state[CSTATE_ARRAYS] = cfg, arr
    if state_dir:
        store = node_store(state_dir, run)
        store.tag = int(tag)
        store[int(cid)] = cstate
        store.commit()
        store.retain(keep)


def state_tag(state: RecordDict, cid: int) -> int | None:
    """The round of the client state kept in ``context.state`` (None: none is kept there)."""
    if CSTATE in state and int(state[CSTATE]["client-id"]) == int(cid):
        return int(state[CSTATE].get("round", 0))
    return None


def load_client_state(state: RecordDict, cid: int, state_dir=None, run: str | int | None = None,
                      bound: int | None = None) -> tuple[dict | None, int | None]:
    """(state, round) of client ``cid`` in fedlt run ``run`` (None: whichever run ``context.state`` holds): its
    newest version of round ``bound`` or earlier (None: the newest), from ``state_dir`` where there is one
    (versions newer than ``bound``, made by a run since resumed from an earlier round, are removed), else from
    ``context.state``; (None, None) when it has none."""
    if state_dir:
        store = node_store(state_dir, run)
        tag = store.go_back(int(cid), bound) if bound is not None else (
            store.tag_of(int(cid)) if int(cid) in store else None)
        return (store[int(cid)], tag) if tag is not None else (None, None)
    tag = state_tag(state, cid)
    if tag is None or (run is not None and str(state[CSTATE].get("run", run)) != str(run)) or \
            (bound is not None and tag > bound):
        return None, None
    return records_value(state[CSTATE], state[CSTATE_ARRAYS]), tag
