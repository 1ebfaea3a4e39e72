"""Worker processes: a round's clients trained in parallel, one client per worker process at a time, each
worker with one torch thread (``--workers N|auto``).

A sibling of the in-process transports (:mod:`fedlt.engine.inprocess`): the driver, the server state, the
client-state store and the evaluation stay in this process; only the client hooks of an exchange (a round's
``local_train``, a phase's ``phase_client``) run in the workers. The pool starts once per run, at its first
exchange, and holds the method and the federation from then on:

- where the ``fork`` start method exists (Linux), the workers are forked from this process: the federation's
  arrays are shared copy-on-write, never pickled;
- elsewhere (macOS, Windows: ``spawn``), each worker receives the method and the federation once, pickled, when
  it starts -- never per round.

A task is (exchange, round or phase index, client, payload, client state); the worker answers with the reply,
the client's new state and its global RNG state after the hook. Each client trains with the same
(purpose, round, client) generator as in process, and the same global seed (``client_generator``), so with one
thread per worker every reply is bit for bit the reply of ``--threads 1`` one client after another; the driver
then sets its global RNG to the last client's, as if it had trained them all itself, and aggregates as always.

A worker that dies (killed, out of memory) fails the exchange with one line naming the round's clients that had not
answered (the pool cannot tell which of them the dead worker held); the run's last checkpoint is intact, and
``--resume`` goes on from there with a fresh pool.
"""
from __future__ import annotations

import multiprocessing
import pickle
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import torch

from ..core.method import Message, Method
from ..errors import FedltError
from .clientstate import ClientStates
from .driver import TRAINING
from .inprocess import InProcess, client_hook

_HELD: tuple | None = None  # (method, federation, seed) in a worker: set before forking, or by _start (spawn)


class WorkerDied(FedltError):
    """A worker process ended while it held clients of an exchange (killed, out of memory)."""

    exit_status = 1


def start_method() -> str:
    """``fork`` where the system has it (the federation shared, not copied), else ``spawn``."""
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def _start(held: tuple | None, threads: int) -> None:
    """A worker's start: its torch threads (one by default); the method and federation it was given (spawn), or
    inherited (fork); and, on Linux, its death with the run's process (a killed run leaves no worker behind)."""
    global _HELD
    # the run's own handlers (fedlt.runner.preempt: stop at a checkpoint) are the driver's; a worker ends on
    # SIGTERM at once (the pool's shutdown after a worker's death), and leaves Ctrl-C to the run
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    if held is not None:
        _HELD = held
    _die_with_parent()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG); elsewhere nothing (the pool's
    pipes close with the parent, and the workers end at their next read)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _client(task: bytes) -> bytes:
    """One client's hook in a worker: the pickled (exchange, index, client, payload, state) in, the pickled
    (reply, new client state, the global RNG state after it) out. Plain pickles, copied through the pool's pipe:
    torch's own multiprocessing pickler would move every tensor into shared memory, one file descriptor each."""
    kind, index, cid, payload, cstate = pickle.loads(task)
    method, fed, seed = _HELD
    reply, cstate = client_hook(method, seed, kind, index, cid, payload, cstate, fed.clients[cid])
    return pickle.dumps((reply, cstate, torch.get_rng_state()), protocol=pickle.HIGHEST_PROTOCOL)


class Workers(InProcess):
    """The transport of clients trained in ``workers`` processes (see the module docstring)."""

    graphs = None  # (no CUDA graphs: the simulator's accessors read it)

    def __init__(self, method: Method, fed, seed: int, workers: int, states: ClientStates | None = None,
                 threads: int = 1, start: str | None = None):
        super().__init__(method, fed, seed, states)
        self.workers, self.threads, self.start = int(workers), int(threads), start or start_method()
        self.pool: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        global _HELD
        if self.pool is None:
            held = (self.method, self.fed, self.seed)
            if self.start == "fork":
                _HELD, held = held, None  # inherited by the forked workers, never pickled
            self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context(self.start),
                                            initializer=_start, initargs=(held, self.threads))
        return self.pool

    def send_and_receive(self, kind: str, index: int, payloads: dict[int, Message]):
        if len(payloads) < 2:  # nothing to share out
            return super().send_and_receive(kind, index, payloads)
        self._tag(kind, index)
        pool = self._pool()
        futures = {cid: pool.submit(_client, pickle.dumps((kind, index, cid, payload, self.client_state(cid)),
                                                          protocol=pickle.HIGHEST_PROTOCOL))
                   for cid, payload in payloads.items()}
        replies, rng = [], None
        for cid, fut in futures.items():
            try:
                reply, cstate, rng = pickle.loads(fut.result())
            except BrokenProcessPool:
                lost = [c for c, f in futures.items() if not (f.done() and f.exception() is None)]
                self.close()
                what = f"round {index}" if kind == TRAINING else f"phase {kind}"
                raise WorkerDied(f"a worker process died in {what} (killed, or out of memory) while client"
                                 f"{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
                                 f"{'were' if len(lost) > 1 else 'was'} training or waiting; the run's checkpoints "
                                 f"are intact: --resume continues from the last one") from None
            self.keep(cid, cstate)
            replies.append((cid, reply))
        torch.set_rng_state(rng)  # the global RNG as the last client left it, as in process
        return replies, {}

    def parallel_chunk(self) -> int:
        """Clients trained together in one process: none (0), each worker trains one at a time."""
        return 0

    def close(self) -> None:
        """Stop the workers (the run's end, or a worker's death)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass
