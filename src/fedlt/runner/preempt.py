"""Preemption: what a scheduler's signal does to a run or a sweep.

SIGTERM (what Slurm, Kubernetes and ``kill`` send on preemption or at a time limit), SIGINT (Ctrl-C) and SIGUSR1
(Slurm's ``--signal=USR1@SECONDS`` warning) end a run at once: the handler raises :class:`Preempted` in the
main thread, so the round in progress is abandoned, not finished. What is on disk is the checkpoint of the last
completed round (the default policy, :data:`DEFAULT_CHECKPOINT_EVERY`, writes one after every round); a
checkpoint being written when the signal comes is completed first (:func:`deferred`). The command then prints
one line (:meth:`Preempted.line`: the signal, the round reached, how to resume) and exits with status
128 + the signal's number: 143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1.

A sweep stopped this way stops its workers the same way and resumes, when started again, as after ``kill -9``:
finished runs are skipped, the others continue from their checkpoints.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

# rounds between checkpoints when the user says nothing: after every round, so that a stopped run loses at
# most the round in progress (a ResNet-50 server state: see benchmarks/checkpoint_cost.py)
DEFAULT_CHECKPOINT_EVERY = 1
SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGINT", "SIGUSR1")) if s is not None)


class Preempted(KeyboardInterrupt):
    """Raised by the signal handler. A KeyboardInterrupt, so that code which already stops cleanly on Ctrl-C
    (worker loops, progress bars) does so on a scheduler's signal too. ``where`` is what the run or sweep it
    stopped says about itself (set on the way out, :meth:`stopped`)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = int(signum)
        self.where: str | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum

    def stopped(self, where: str) -> "Preempted":
        """Say what was stopped (the outermost layer has the last word: a sweep, not its run)."""
        self.where = where
        return self

    def line(self) -> str:
        return f"fedlt: stopped by {self.name}" + (f": {self.where}" if self.where else "")


_state = {"deferring": 0, "pending": None, "installed": 0, "last": None}


def _handler(signum, _frame) -> None:
    _state["last"] = signum
    if _state["deferring"]:
        _state["pending"] = signum
        return
    raise Preempted(signum)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Handle :data:`SIGNALS` while the block runs (in the main thread; elsewhere Python allows no handler, and
    nothing changes). The previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _handler) for s in SIGNALS}
    _state["installed"] += 1
    _state["last"] = None
    try:
        yield
    finally:
        _state["installed"] -= 1
        for s, h in old.items():
            signal.signal(s, h)


def as_preempted(e: KeyboardInterrupt) -> KeyboardInterrupt:
    """``e``, or the :class:`Preempted` it stands for: Ray's wait turns the exception our handler raised into a
    plain KeyboardInterrupt."""
    if isinstance(e, Preempted) or _state["last"] is None:
        return e
    return Preempted(_state["last"])


def retake() -> None:
    """Handle :data:`SIGNALS` again after a library replaced the handlers (``ray.init`` installs handlers that
    abort the process on SIGTERM); nothing outside :func:`installed`."""
    if _state["installed"] and threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal that comes while the block runs (a checkpoint being written) takes effect when it ends."""
    _state["deferring"] += 1
    try:
        yield
    finally:
        _state["deferring"] -= 1
        if not _state["deferring"] and _state["pending"] is not None:
            signum, _state["pending"] = _state["pending"], None
            raise Preempted(signum)


def run_stopped(out, name: str | None, in_round: int, rounds: int, saved_round: int | None) -> str:
    """What a stopped run says: the round it was in, the checkpointed round and how to finish the run."""
    where = f"in round {in_round} of {rounds}" if in_round <= rounds else "after its last round"
    if saved_round is None:
        return stopped_without_checkpoint(out, where)
    return f"run {out} stopped {where}; round {saved_round} is checkpointed there: to finish it, run {again(out, name)}"


def again(out, name: str | None) -> str:
    """How to resume a stopped run: the same command with ``--resume``, and the run directory's name where the
    command gave none (it was named by the time it started)."""
    return "the same command with --resume" if name else f"the same command with --name {out.name} --resume"


def stopped_without_checkpoint(out, where: str) -> str:
    return f"run {out} stopped {where} with no checkpoint (--checkpoint-every 0, or before its first); start it again"
