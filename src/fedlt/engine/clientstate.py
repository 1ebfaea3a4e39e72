"""The client-state store: what a population of clients costs is what the clients that trained cost.

A client's state (a personal head, a personal model, control variates) exists once the client has trained:
a transport asks the method for a fresh one (``init_client``) when a client first takes part and stores what
its training returns. :class:`ClientStates` keeps the states in memory up to a byte budget
(``--client-state-memory``, 2 GB by default), the most recently used ones; beyond it, the least recently used
are *spilled*: written to a safetensors file (:mod:`fedlt.safefile`: no pickle) and dropped from memory, to be
read back when their client is needed again. A state read back is bit for bit the one written, on the device
it was on, so a run that spills gives the very numbers of a run that does not.

Files, one per stored version of a client's state (measured against one memory-mapped file of every state by
``benchmarks/client_state_files.py``: the single file was faster to write, but it keeps every old version until
it is compacted, and compacting it rewrites every client -- what a checkpoint must never do)::

    <directory>/c<client>.r<round>.safetensors

Every stored state carries the round it reflects (its *tag*: the training round that wrote it; a post-training
phase's states are tagged after the last round). A store may keep several versions of one client: the ones a
checkpoint refers to stay until two newer checkpoints are written, so a run can always be resumed from either
of the checkpoints a run directory keeps (``fedlt.runner.runstate``).

Checkpoints are incremental (:meth:`ClientStates.commit`): the states changed since the last one are written and
flushed to disk, the others are already there, and the checkpoint itself holds only the index ``{client:
tag}`` -- its size grows with the clients that trained, not with the population. :meth:`ClientStates.restore`
goes back to such an index; the states are read when their clients are next needed. A state file that is
missing, truncated or corrupt is a one-line :class:`~fedlt.errors.ConfigError` naming the client, never a
silent fresh state.

The run directory's ``client-states/`` holds a run's store; a SuperNode's ``--state-dir`` holds one per fedlt
run (``run-<id>/``). A store without a directory spills, if it must, into a temporary folder removed when the
store goes away.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..config import DEFAULT_BUDGET
from ..errors import ConfigError
from ..safefile import fsync, fsync_dir, load_tree, save_tree
KIND = "client-state"
OVERHEAD = 64  # bytes counted for a state beyond its arrays (a state of plain values costs memory too)
KEEP_COMMITS = 3  # the newest checkpoint, the previous one, and the one before while the newest is written
_FILE = re.compile(r"^c(\d+)\.r(\d+)\.safetensors$")


def tree_bytes(tree: Any) -> int:
    """The bytes of the tensors and arrays in a state (a nested dict / list of them and plain values)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, np.ndarray):
        return tree.nbytes
    if isinstance(tree, dict):
        return sum(tree_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tree_bytes(v) for v in tree)
    return 0


def state_name(cid: int, tag: int) -> str:
    return f"c{int(cid)}.r{int(tag)}.safetensors"


def _remove_state_files(folder: Path) -> None:
    """Remove the state files in ``folder`` (and half-written ones), nothing else."""
    for entry in os.scandir(folder):
        if _FILE.match(entry.name) or entry.name.endswith(".tmp"):
            os.unlink(entry.path)


class _Held:
    __slots__ = ("state", "nbytes", "dirty")

    def __init__(self, state: dict, nbytes: int, dirty: bool):
        self.state, self.nbytes, self.dirty = state, nbytes, dirty


class ClientStates(MutableMapping):
    """The states of the clients that have trained, by client id: in memory up to ``budget`` bytes (least
    recently used spilled to ``directory``), tagged with the round they reflect (``tag``, set by the
    transport before each exchange). A mapping: ``states[cid]`` reads a spilled state back, ``states[cid] =
    s`` stores a new version tagged ``self.tag``; iteration is in client order."""

    def __init__(self, budget: int = DEFAULT_BUDGET, directory: str | os.PathLike | None = None,
                 hint: str = "delete the run directory to start the run afresh"):
        self.budget, self.hint = int(budget), hint
        self.tag = 0  # the round the states written now reflect
        self._held: OrderedDict[int, _Held] = OrderedDict()  # in memory, least recently used first
        self._used = 0
        self._tags: dict[int, int] = {}  # client -> tag of its current state (held, on disk, or both)
        self._files: dict[int, dict[int, bool]] = {}  # client -> {tag: flushed to disk} of its files
        self._commits: list[dict[int, int]] = []  # the indices of the last KEEP_COMMITS commits
        self._dir: Path | None = None
        self._cleanup = None
        self.spilled = self.written_bytes = 0  # counters (benchmarks): states written out, and their bytes
        if directory is not None:
            self.attach(directory)

    # ------------------------------------------------------------------ the mapping
    def __contains__(self, cid: object) -> bool:
        return cid in self._tags

    def __len__(self) -> int:
        return len(self._tags)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._tags))

    def __getitem__(self, cid: int) -> dict:
        held = self._held.get(cid)
        if held is not None:
            self._held.move_to_end(cid)
            return held.state
        if cid not in self._tags:
            raise KeyError(cid)
        state = self._read(cid, self._tags[cid])
        self._hold(cid, state, dirty=False)
        return state

    def __setitem__(self, cid: int, state: dict) -> None:
        cid = int(cid)
        old = self._held.pop(cid, None)
        if old is not None:
            self._used -= old.nbytes
        self._tags[cid] = self.tag
        self._hold(cid, state, dirty=True)
        self._prune(cid)

    def __delitem__(self, cid: int) -> None:
        if cid not in self._tags:
            raise KeyError(cid)
        old = self._held.pop(cid, None)
        if old is not None:
            self._used -= old.nbytes
        del self._tags[cid]
        self._prune(cid)

    def tag_of(self, cid: int) -> int:
        """The round client ``cid``'s state reflects."""
        return self._tags[cid]

    @property
    def memory(self) -> int:
        """Bytes of the states held in memory now."""
        return self._used

    @property
    def directory(self) -> Path | None:
        """Where the states are kept (None: nowhere yet; a temporary folder once one spilled)."""
        return self._dir

    @property
    def kept(self) -> bool:
        """Whether the files outlive the store (a directory was given), so a checkpoint may refer to them."""
        return self._dir is not None and self._cleanup is None

    # ------------------------------------------------------------------ memory and spills
    def _hold(self, cid: int, state: dict, dirty: bool) -> None:
        n = tree_bytes(state) + OVERHEAD
        self._held[cid] = _Held(state, n, dirty)
        self._used += n
        while self._used > self.budget and self._held:
            self._evict(next(iter(self._held)))

    def _evict(self, cid: int) -> None:
        held = self._held.pop(cid)
        self._used -= held.nbytes
        if held.dirty:
            self._write(cid, held.state, durable=False)
            self.spilled += 1

    def _write(self, cid: int, state: dict, durable: bool) -> None:
        tag = self._tags[cid]
        self.written_bytes += save_tree(self._folder() / state_name(cid, tag), state, KIND, durable=durable)
        self._files.setdefault(cid, {})[tag] = durable
        self._prune(cid)

    def _read(self, cid: int, tag: int) -> dict:
        path = self._folder() / state_name(cid, tag)
        if tag not in self._files.get(cid, {}) or not path.is_file():
            raise ConfigError(f"client {cid}'s state (round {tag}) is missing: {path} not found; the run cannot "
                              f"go on without it ({self.hint})")
        try:
            state = load_tree(path, KIND)
        except ConfigError as e:
            raise ConfigError(f"client {cid}'s state cannot be read: {e}; the run cannot go on without it "
                              f"({self.hint})") from None
        if not isinstance(state, dict):
            raise ConfigError(f"client {cid}'s state in {path} is not a client state (it holds a "
                              f"{type(state).__name__}); {self.hint}")
        return state

    def path_of(self, cid: int) -> Path:
        """The file of client ``cid``'s current state (once written)."""
        return self._folder() / state_name(cid, self._tags[cid])

    def _pinned(self, cid: int) -> set[int]:
        return {c[cid] for c in self._commits if cid in c}

    def _prune(self, cid: int) -> None:
        """Remove the files of ``cid`` that neither its current state nor a kept checkpoint refers to."""
        files = self._files.get(cid)
        if not files:
            return
        keep = self._pinned(cid)
        if cid in self._tags:
            keep.add(self._tags[cid])
        for tag in [t for t in files if t not in keep]:
            (self._folder() / state_name(cid, tag)).unlink(missing_ok=True)
            del files[tag]
        if not files:
            del self._files[cid]

    def _folder(self) -> Path:
        if self._dir is None:  # spilling before any directory was given: a temporary one
            d = Path(tempfile.mkdtemp(prefix="fedlt-client-states-"))
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(d), True)
            self._dir = d
        return self._dir

    # ------------------------------------------------------------------ directory, checkpoints
    def attach(self, directory: str | os.PathLike, fresh: bool = False) -> None:
        """Keep the files in ``directory`` from now on (a run directory's ``client-states/``); files spilled
        into a temporary folder before are moved there. ``fresh``: state files already in ``directory`` (an
        earlier run's) are removed first."""
        new = Path(directory)
        try:
            if fresh and new.is_dir():
                _remove_state_files(new)
            new.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot write client states to {new}: {e.strerror or e}; choose another --out") from None
        if self._dir is not None and self._dir.resolve() != new.resolve():
            for cid, files in self._files.items():
                for tag in files:
                    os.replace(self._dir / state_name(cid, tag), new / state_name(cid, tag))
            if self._cleanup is not None:
                self._cleanup()
                self._cleanup = None
        self._dir = new

    def commit(self) -> dict:
        """Make every current state durable -- write the ones changed since the last commit, flush the ones
        spilled since -- and return the index a checkpoint keeps: ``{"versions": {client: tag}}``. Files no
        kept commit refers to any more are removed."""
        flushed = False
        for cid, held in self._held.items():
            if held.dirty:
                self._write(cid, held.state, durable=True)
                held.dirty = False
                flushed = True
        for cid, tag in self._tags.items():
            files = self._files.get(cid, {})
            if files.get(tag) is False:
                fsync(self._folder() / state_name(cid, tag))
                files[tag] = flushed = True
        if flushed:
            fsync_dir(self._folder())
        index = dict(self._tags)
        self._commits = (self._commits + [index])[-KEEP_COMMITS:]
        for cid in list(self._files):
            self._prune(cid)
        return {"versions": index}

    def restore(self, index: dict) -> None:
        """Back to a committed ``index`` (:meth:`commit`): nothing held in memory; each state is read from its
        file when its client is next needed. The files in the directory are taken stock of (those of a later,
        interrupted run are removed by the next commit)."""
        versions = {int(c): int(t) for c, t in dict(index.get("versions", {})).items()}
        self._held.clear()
        self._used = 0
        self._tags = dict(versions)
        self._files = {}
        folder = self._folder()
        for entry in os.scandir(folder):
            m = _FILE.match(entry.name)
            if m:
                self._files.setdefault(int(m.group(1)), {})[int(m.group(2))] = True
            elif entry.name.endswith(".tmp"):  # a write a killed process left half done
                os.unlink(entry.path)
        self._commits = [versions]
        self.tag = max(versions.values(), default=0)

    def reopen(self) -> None:
        """Take the newest version of every client's state in the directory as its current one (a SuperNode's
        ``--state-dir`` after a restart: no checkpoint index says which)."""
        found: dict[int, int] = {}
        for entry in os.scandir(self._folder()):
            m = _FILE.match(entry.name)
            if m:
                cid, tag = int(m.group(1)), int(m.group(2))
                found[cid] = max(found.get(cid, tag), tag)
        self.restore({"versions": found})

    # ------------------------------------------------------------------ versions (a SuperNode's --state-dir)
    def versions(self, cid: int) -> list[int]:
        """The rounds of the versions of client ``cid``'s state that are stored (in memory or on disk)."""
        tags = set(self._files.get(cid, {}))
        if cid in self._tags:
            tags.add(self._tags[cid])
        return sorted(tags)

    def go_back(self, cid: int, bound: int) -> int | None:
        """Make client ``cid``'s current state its newest version of round ``bound`` or earlier -- the one a
        server at round ``bound`` (resumed from its checkpoint of that round, perhaps) expects the client to
        train from -- and remove the newer ones, which a resumed run re-makes. Returns that version's round
        (None: the client has no state that old)."""
        cid = int(cid)
        tags = self.versions(cid)
        ok = [t for t in tags if t <= bound]
        if tags and tags[-1] > bound:
            held = self._held.pop(cid, None)
            if held is not None:
                self._used -= held.nbytes
            for t in (t for t in tags if t > bound):
                (self._folder() / state_name(cid, t)).unlink(missing_ok=True)
                self._files.get(cid, {}).pop(t, None)
            if ok:
                self._tags[cid] = ok[-1]
            else:
                self._tags.pop(cid, None)
        return ok[-1] if ok else None

    def retain(self, rounds) -> None:
        """Keep, beside every client's current state, its newest version of each of ``rounds`` or earlier (the
        rounds a server may resume from: those of the checkpoints it keeps), and remove the other versions."""
        index = lambda r: {c: max(t for t in self.versions(c) if t <= r)  # noqa: E731
                           for c in set(self._files) | set(self._tags) if any(t <= r for t in self.versions(c))}
        self._commits = [index(int(r)) for r in rounds]
        for cid in list(self._files):
            self._prune(cid)

    def clear(self) -> None:
        """Forget every state and remove its files (before an older checkpoint's states are loaded). The
        directory stays: the states loaded next are written there by the next commit."""
        self._held.clear()
        self._used = 0
        self._tags, self._files, self._commits = {}, {}, []
        if self._dir is not None and self._dir.is_dir():
            _remove_state_files(self._dir)

    def load(self, states: dict) -> None:
        """Every state of a plain ``{client: state}`` dict (an older checkpoint's), as stored now."""
        for cid, state in states.items():
            self[int(cid)] = state
