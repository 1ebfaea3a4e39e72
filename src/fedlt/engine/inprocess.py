"""The in-process engine: the clients of a federation held in this process, their hooks called one client after
another (:class:`InProcess`). The batched engine (``engine.batched``) and the worker processes
(``engine.workers``) extend it; nothing here knows a method by name.
"""
from __future__ import annotations

from ..core.method import Message, Method
from ..core.training import autocast
from ..metrics import evaluate
from .clientstate import ClientStates
from ..seeds import Purpose
from .driver import TRAINING, client_generator


def client_hook(method: Method, seed: int, kind: str, index: int, cid: int, payload: Message, cstate: dict,
                data) -> tuple[Message, dict]:
    """One client's hook of an exchange (a round's ``local_train``, or a phase's ``phase_client``) with its
    (purpose, index, client) generator, under the run's autocast: (reply, new client state). The in-process
    engines and the worker processes (``engine.workers``) call it alike."""
    if kind == TRAINING:
        purpose, call = Purpose.TRAIN, method.local_train
    else:
        purpose, call = Purpose.PHASE, (lambda p, s, d, g: method.phase_client(kind, p, s, d, g))
    gen = client_generator(seed, purpose, index, cid)
    with autocast(method.spec):
        return call(payload, cstate, data, gen)


class InProcess:
    """The transport of clients in this process, one after another: the method's client hooks called
    directly on each client's data and state. The states of the clients that have trained stay here, in
    ``client_states`` (a :class:`~fedlt.engine.clientstate.ClientStates` store: in memory up to its budget,
    spilled to disk beyond it, checkpointed incrementally)."""

    privatises = False  # the clients' replies leave as the hooks return them (engine.privacy applies the DP)
    secagg = False  # a --secagg round is simulated (engine.privacy)

    def __init__(self, method: Method, fed, seed: int, states: ClientStates | None = None):
        self.method, self.fed, self.seed = method, fed, seed
        self.client_states = states if states is not None else ClientStates()
        self.round = 0  # the last training round carried: a post-training phase's states are tagged after it

    def client_state(self, cid: int) -> dict:
        """``cid``'s stored state, or a fresh one (``init_client``) for a client that has not trained: a state
        is stored when a client hook returns it, so a client that never trains costs nothing."""
        if cid in self.client_states:
            return self.client_states[cid]
        return self.method.init_client(cid, self.fed.clients[cid])

    def keep(self, cid: int, cstate: dict) -> None:
        """Store what a client hook returned (an empty state of a client that has none is not stored: a
        stateless method's clients cost nothing, even in a phase that reaches every client)."""
        if cstate or cid in self.client_states:
            self.client_states[cid] = cstate

    def keep_states_in(self, directory, fresh: bool = False) -> None:
        self.client_states.attach(directory, fresh)

    def reachable(self, cids) -> dict[int, str]:
        return {}

    def _tag(self, kind: str, index: int) -> None:
        """The round the states written by this exchange reflect: the training round, or (a phase) after the
        last one."""
        if kind == TRAINING:
            self.round = index
        self.client_states.tag = index if kind == TRAINING else self.round + 1 + index

    def send_and_receive(self, kind: str, index: int, payloads: dict[int, Message]):
        self._tag(kind, index)
        replies = []
        for cid, payload in payloads.items():
            reply, cstate = client_hook(self.method, self.seed, kind, index, cid, payload, self.client_state(cid),
                                        self.fed.clients[cid])
            self.keep(cid, cstate)
            replies.append((cid, reply))
        return replies, {}

    def evaluate(self, method: Method, state: dict, split: str, clients: list[int] | None = None):
        """GM, and PM over ``clients`` (None: all): a client that has not trained is evaluated with a fresh
        state that is not stored."""
        return evaluate(method, state, self.client_state, self.fed, split, clients=clients), {}

    def state_dict(self) -> dict:
        """For a checkpoint: with the store kept in a run directory, its index (the states changed since the
        last checkpoint are written there now); else every state."""
        s = self.client_states
        if s.kept:
            return {"round": self.round, **s.commit()}
        return {cid: s[cid] for cid in s}

    def load_state_dict(self, d: dict) -> None:
        """From :meth:`state_dict`, or a checkpoint of an earlier fedlt that held every client's state."""
        d = dict(d)
        if "versions" in d:
            self.client_states.restore(d)
            self.round = int(d.get("round", self.client_states.tag))
        else:
            self.client_states.clear()
            self.client_states.load(d)
