"""fedlt values <-> Flower records.

A fedlt :class:`~fedlt.core.method.Message` becomes three records of one ``RecordDict``:

==================  ==================  ===============================================================
record              type                holds
==================  ==================  ===============================================================
``arrays``          ``ArrayRecord``     ``Message.arrays`` (names unchanged: state-dict keys, extras)
``meta``            ``ConfigRecord``    ``Message.meta`` as a JSON skeleton (``json``); tensors or numpy
                                        arrays inside meta go to ``meta-arrays`` (an ``ArrayRecord``)
``metrics``         ``MetricRecord``    the numeric scalars of meta, ``num_examples`` also as Flower's
                                        ``num-examples`` (read by Flower tooling, never by fedlt)
``config``          ``ConfigRecord``    ``Message.config``, the round's values the driver sets (``lr``),
                                        where there are any: Flower's per-round config
==================  ==================  ===============================================================

plus a ``fedlt`` ``ConfigRecord`` with the engine's own fields (round, phase, client id, the run settings).
A client state lives in ``context.state`` the same way (``fedlt.cstate`` + ``fedlt.cstate.arrays``) and
can be mirrored to a file (safetensors, :mod:`fedlt.safefile`) so it survives a SuperNode restart.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..codec import pack, unpack
from ..core.method import Message
from ..engine.clientstate import ClientStates

CONTROL = "fedlt"
CSTATE, CSTATE_ARRAYS = "fedlt.cstate", "fedlt.cstate.arrays"


def to_records(msg: Message, control: dict[str, Any] | None = None, what: str = "message") -> RecordDict:
    """The RecordDict that carries ``msg`` (and the engine's ``control`` fields)."""
    skeleton, meta_arrays = pack(msg.meta, f"{what} meta")
    rd = RecordDict({"arrays": ArrayRecord({k: v.detach().cpu() for k, v in msg.arrays.items()}),
                     "meta": ConfigRecord({"json": skeleton})})
    if meta_arrays:
        rd["meta-arrays"] = ArrayRecord(meta_arrays)
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
_STORES: dict[Path, ClientStates] = {}  # a process's --state-dir stores, one per (folder, run)


def node_store(state_dir: str | os.PathLike, run_id: int) -> ClientStates:
    """The client-state store (:mod:`fedlt.engine.clientstate`) of a SuperNode's ``--state-dir`` for one run
    (``run-<id>/``): every state written through and flushed when stored (``context.state`` is the memory),
    each version tagged with its round; after a restart, each client's newest version is its state."""
    d = Path(state_dir) / f"run-{run_id}"
    store = _STORES.get(d)
    if store is None:
        store = ClientStates(budget=0, directory=d, hint=f"delete {d} to start its clients afresh")
        store.reopen()
        _STORES[d] = store
    return store


def state_file(state_dir: str | os.PathLike, run_id: int, cid: int) -> Path:
    """The file holding client ``cid``'s current state in a ``--state-dir``."""
    return node_store(state_dir, run_id).path_of(cid)


def save_client_state(state: RecordDict, cstate: dict, cid: int, state_dir=None, run_id: int = 0,
                      tag: int = 0) -> None:
    """Store a client state in ``context.state`` (and in ``state_dir`` when given, flushed to disk), tagged with
    the round it reflects."""
    cfg, arr = value_records(cstate, f"client {cid} state")
    cfg["client-id"], cfg["round"] = int(cid), int(tag)
    state[CSTATE], state[CSTATE_ARRAYS] = cfg, arr
    if state_dir:
        store = node_store(state_dir, run_id)
        store.tag = int(tag)
        store[int(cid)] = cstate
        store.commit()


def state_tag(state: RecordDict, cid: int) -> int | None:
    """The round of the client state kept in ``context.state`` (None: none is kept there)."""
    if CSTATE in state and int(state[CSTATE]["client-id"]) == int(cid):
        return int(state[CSTATE].get("round", 0))
    return None


def load_client_state(state: RecordDict, cid: int, state_dir=None, run_id: int = 0) -> dict | None:
    """The client state kept in ``context.state``, else the one in ``state_dir`` (after a SuperNode restart),
    else None (the client has none yet)."""
    if CSTATE in state and int(state[CSTATE]["client-id"]) == int(cid):
        return records_value(state[CSTATE], state[CSTATE_ARRAYS])
    if state_dir:
        store = node_store(state_dir, run_id)
        if int(cid) in store:
            return store[int(cid)]
    return None
