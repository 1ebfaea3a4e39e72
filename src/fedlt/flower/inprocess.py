"""The Flower apps in one process: no SuperLink, no Ray, no network.

:class:`InProcessGrid` is a ``flwr.serverapp.Grid`` whose nodes are ``Context`` objects in this process. It
delivers a deep copy of every message to the (unmodified) fedlt ClientApp, as the wire would, and turns an
exception into an error reply, as a SuperNode does. ``fault`` lets a test make a node fail or stay silent.
:func:`run_inprocess` runs a whole fedlt run this way: the CI path that checks the Flower apps against the
simulation engine, and a quick way to try a deployment configuration on one machine.
"""
from __future__ import annotations

import traceback
from collections.abc import Iterable
from contextlib import contextmanager
from copy import deepcopy
from pathlib import Path
from typing import Callable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from ..config import RunConfig
from .client_app import app as client_app
from .settings import FLOWER_DEFAULTS
from .strategy import FedltStrategy

SERVER_NODE_ID = 1  # what Flower uses for the SuperLink / ServerApp side
CLIENT_APP_RAISED = 2  # flwr ErrorCode.CLIENT_APP_RAISED_EXCEPTION

# fault(message, node_id) -> None (deliver), "fail" (the ClientApp raises) or "silent" (no reply ever comes)
Fault = Callable[[Message, int], "str | None"]


class InProcessGrid(Grid):
    """``remote``: the server does not see the nodes' contexts (as over a SuperLink), so the client states stay
    on the nodes (and their ``state-dir``) and no checkpoint holds them: a deployment's resume, in one process."""

    def __init__(self, node_configs: list[dict], run_config: dict | None = None, run_id: int = 1,
                 app=client_app, fault: Fault | None = None, remote: bool = False):
        self._run = Run.create_empty(run_id)
        self.app, self.fault, self.remote = app, fault, remote
        self.contexts = {100 + i: Context(run_id, 100 + i, dict(nc), RecordDict(), dict(run_config or {}))
                         for i, nc in enumerate(node_configs)}
        self.replies: dict[str, Message] = {}
        self.delivered: list[Message] = []  # every instruction as the nodes received it (for tests)
        self.replied: list[Message] = []  # every reply as the server received it (for tests)
        self._next_id = 100 + len(node_configs)

    def restart(self, node_id: int) -> int:
        """A SuperNode restart: the node's in-memory context is lost and it comes back under a new node id
        with the same ``--node-config``. Returns the new id."""
        old = self.contexts.pop(node_id)
        new = self._next_id
        self._next_id += 1
        self.contexts[new] = Context(old.run_id, new, dict(old.node_config), RecordDict(), dict(old.run_config))
        return new

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            mid = uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            ids.append(mid)
            node = msg.metadata.dst_node_id
            what = self.fault(msg, node) if self.fault else None
            if what == "silent" or node not in self.contexts:
                continue
            received = deepcopy(msg)  # the wire: neither side can touch the other's records
            self.delivered.append(received)
            try:
                if what == "fail":
                    raise RuntimeError(f"injected failure on node {node}")
                reply = self.app(received, self.contexts[node])
            except Exception as e:  # noqa: BLE001 -- a ClientApp exception becomes an error reply, as on a SuperNode
                reply = Message(Error(CLIENT_APP_RAISED, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"),
                                reply_to=received)
            self.replies[mid] = deepcopy(reply)
            self.replied.append(self.replies[mid])
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self.replies.pop(m) for m in list(message_ids) if m in self.replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


@contextmanager
def server_identity(run_id: int = 1):
    """Flower's ``Message(...)`` reads the sender's identity from a process-wide slot that a real
    ``flwr-serverapp`` process fills in; set it for the duration of an in-process run."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SERVER_NODE_ID, 0
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def run_inprocess(cfg: RunConfig, out: str | Path | None = None, fault: Fault | None = None,
                  node_configs: list[dict] | None = None, echo=print, deployed: bool = False,
                  **flower) -> tuple[FedltStrategy, InProcessGrid, dict]:
    """A whole fedlt run through the Flower ServerApp logic and ClientApp in this process. Nodes default to one
    per client of the partition (``partition-id`` = 0..clients-1). ``checkpoint_every`` / ``resume``: as for
    ``fedlt run`` (the nodes' client states are part of the checkpoint). ``deployed``: the server acts as a
    deployment's (``--dp-noise-seed`` defaults to the SuperNodes' own keys). Returns (strategy, grid, summary)."""
    opts = {**FLOWER_DEFAULTS, **{k.replace("_", "-"): v for k, v in flower.items()}}
    nodes = node_configs if node_configs is not None else [{"partition-id": i} for i in range(cfg.clients)]
    grid = InProcessGrid(nodes, fault=fault)
    strategy = FedltStrategy(cfg, opts["round-timeout"], opts["wait-timeout"], opts["poll-interval"], echo=echo,
                             deployed=deployed)
    with server_identity():
        summary = strategy.run(grid, Path(out) if out is not None else None,
                               checkpoint_every=int(opts["checkpoint-every"]), resume=bool(opts["resume"]))
    return strategy, grid, summary
