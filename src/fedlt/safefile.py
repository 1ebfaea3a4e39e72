"""Files that cannot carry code: every tree of state fedlt writes (checkpoints, final states, Flower client
states, the fixed-classifier cache) is one safetensors file.

A tree of dicts, lists and tuples whose leaves are tensors, numpy arrays, numbers, strings, booleans and None
(the state rule of :mod:`fedlt.core.method`) is split by :func:`fedlt.codec.pack` into a JSON skeleton
and a flat ``{path: tensor}`` dict. The tensors are the safetensors payload (raw bytes plus dtype and shape);
the skeleton, the kind of file, the format version and the device each tensor lived on go into the file's
string metadata. Reading it back parses JSON and copies bytes into tensors: no pickle, nothing that names a
function, so a file from anyone can be loaded without running anything. Tensors, ints, floats (NaN and inf
included), tuples, int dict keys and numpy arrays come back bit for bit with their types.

Tensors are written from the CPU whatever device they were on (a GPU run's files read on any machine); the
device is recorded, and :func:`load_tree` puts a tensor back on it where that device exists, else on the CPU
(``notes`` collects one line saying so). Writes are atomic (temporary file, ``fsync``, ``os.replace``).

Files written by fedlt 0.1 (``checkpoint.pt``, ``final_state.pt``: pickles), or any other pickle put in the
place of one of these files, are refused with a one-line error; fedlt never unpickles them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .codec import pack, unpack
from .errors import ConfigError

VERSION = "1"
_ZIP, _PICKLE = b"PK\x03\x04", b"\x80"


def _payload(obj: Any, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    skeleton, arrays = pack(obj, kind, keep_device=True)
    devices, tensors, seen = {}, {}, set()
    for k, t in arrays.items():
        if t.device.type != "cpu":
            devices[k] = str(t.device)
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:  # safetensors refuses two tensors on one storage: give this one its own
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[k] = t
    meta = {"fedlt": kind, "version": VERSION, "tree": skeleton, "devices": json.dumps(devices)}
    return tensors, meta


def save_tree(path: str | os.PathLike, obj: Any, kind: str, durable: bool = True) -> int:
    """Write ``obj`` to ``path`` atomically (a temporary file beside it, flushed to disk, then renamed); returns
    the bytes written. ``durable`` False skips the flushes (a file that only has to survive this process, such
    as a spilled client state; :func:`fsync` makes it durable later)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors, meta = _payload(obj, kind)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        size = tmp.stat().st_size
        if durable:
            fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:  # the rename itself survives a power cut only once the folder is flushed too
        fsync_dir(path.parent)
    return size


def fsync(path: str | os.PathLike) -> None:
    """Flush a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (renames into it) to disk, where the file system allows it."""
    try:
        fsync(path)
    except OSError:
        pass


def dumps(obj: Any, kind: str) -> bytes:
    """The bytes :func:`save_tree` would write (for tests and in-memory copies)."""
    from safetensors.torch import save

    tensors, meta = _payload(obj, kind)
    return save(tensors, metadata=meta)


def load_tree(path: str | os.PathLike, kind: str, hint: str = "", notes: list[str] | None = None) -> Any:
    """The tree :func:`save_tree` wrote to ``path`` as ``kind``; a one-line :class:`ConfigError` (ending with
    ``hint``) for anything else: a pickle, a truncated or foreign file, another kind of fedlt file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({e.strerror or e}){_tail(hint)}") from None
    return _decode(data, kind, str(path), hint, notes)


def loads(data: bytes, kind: str, notes: list[str] | None = None) -> Any:
    return _decode(data, kind, "data", "", notes)


def _decode(data: bytes, kind: str, where: str, hint: str, notes: list[str] | None) -> Any:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        try:
            tensors = load(data)
        except SafetensorError:
            if data.startswith(_ZIP) or data.startswith(_PICKLE):  # checked second: a header length can start so
                raise ConfigError(f"{where} is a pickle (written by fedlt 0.1 or by something else), which fedlt "
                                  f"does not load because unpickling can run code{_tail(hint)}") from None
            raise
        meta = _metadata(data)
        if meta.get("fedlt") != kind:
            raise ValueError(f"it holds {meta.get('fedlt') or 'no fedlt data'!r}, not a {kind}")
        if meta.get("version") != VERSION:
            raise ValueError(f"format version {meta.get('version')!r}; this fedlt reads version {VERSION}")
        devices = json.loads(meta.get("devices", "{}"))
        tensors = {k: _to(t, devices.get(k), notes, where) for k, t in tensors.items()}
        return unpack(meta["tree"], tensors)
    except (SafetensorError, ValueError, KeyError, TypeError, RecursionError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{where} is not a readable fedlt {kind} file ({reason}){_tail(hint)}") from None


def _metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("metadata is not a table")
    return meta


def _to(t: torch.Tensor, device: str | None, notes: list[str] | None, where: str) -> torch.Tensor:
    if device is None:
        return t
    try:
        return t.to(device)
    except (RuntimeError, AssertionError, AttributeError, ValueError):
        note = f"{where}: tensors saved on {device} are loaded on the CPU ({device} is not available here)"
        if notes is not None and note not in notes:
            notes.append(note)
        return t


def _tail(hint: str) -> str:
    return f"; {hint}" if hint else ""
