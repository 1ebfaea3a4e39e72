"""The in-process engine: the run driver (``engine.driver``) over the clients of a federation held in this
process, either one client after another (:class:`InProcess`) or a round's clients trained together by the
batched executor (:class:`Batched`, ``engine.batched``). Nothing here knows a method by name.
"""
from __future__ import annotations

import torch

from ..core.method import Message, Method
from ..core.training import autocast
from ..metrics import evaluate
from .batched import Job, train_batched
from .clientstate import ClientStates
from .driver import (PHASE, TRAIN, TRAINING, Driver, EngineConfig, client_generator,  # noqa: F401
                     clients_per_round, rng_state, sampling_schedule)
from .graphs import StepGraphs


class InProcess:
    """The transport of clients in this process, one after another: the method's client hooks called
    directly on each client's data and state. The states of the clients that have trained stay here, in
    ``client_states`` (a :class:`~fedlt.engine.clientstate.ClientStates` store: in memory up to its budget,
    spilled to disk beyond it, checkpointed incrementally)."""

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
        m = self.method
        self._tag(kind, index)
        if kind == TRAINING:
            purpose, call = TRAIN, m.local_train
        else:
            purpose, call = PHASE, (lambda p, s, d, g: m.phase_client(kind, p, s, d, g))
        replies = []
        for cid, payload in payloads.items():
            gen = client_generator(self.seed, purpose, index, cid)
            with autocast(m.spec):
                reply, cstate = call(payload, self.client_state(cid), self.fed.clients[cid], gen)
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


class Batched(InProcess):
    """In process, a round's clients trained together (``engine.batched``) where the method describes its
    local steps (:func:`client_parallel_chunk`); the same payloads, generators and replies as
    :class:`InProcess`, which it falls back to otherwise."""

    def __init__(self, method: Method, fed, seed: int, setting: str = "auto", graphs: StepGraphs | None = None,
                 states: ClientStates | None = None):
        super().__init__(method, fed, seed, states)
        self.setting, self.graphs = setting, graphs
        self.fitted: int | None = None  # auto: the chunk size that fitted on the GPU

    def parallel_chunk(self) -> int | None:
        """How many clients train together: 0 one after another; None all of a round's that fit."""
        return client_parallel_chunk(self.setting, self.method)

    def send_and_receive(self, kind: str, index: int, payloads: dict[int, Message]):
        chunk = self.parallel_chunk() if kind == TRAINING else 0
        if chunk == 0:
            return super().send_and_receive(kind, index, payloads)
        self._tag(kind, index)
        m, seed, cids, data = self.method, self.seed, list(payloads), self.fed.clients
        states = {c: self.client_state(c) for c in cids}
        jobs = [Job(m.local_steps(payloads[c], states[c], data[c]), data[c],
                    lambda c=c: client_generator(seed, TRAIN, index, c), payloads[c].lr) for c in cids]
        trained, fitted = train_batched(m, jobs, chunk, self.fitted, self.graphs)
        if chunk is None:
            self.fitted = fitted
        replies = []
        for c, out in zip(cids, trained):
            reply, cstate = m.local_reply(payloads[c], states[c], data[c], out)
            self.keep(c, cstate)
            replies.append((c, reply))
        return replies, {}


class Simulation(Driver):
    """The driver over the federation ``fed`` in this process (:class:`Batched`, which trains one client after
    another unless ``--client-parallel`` says otherwise)."""

    def __init__(self, method: Method, fed, cfg: EngineConfig, log=None):
        self.fed = fed
        graphs = StepGraphs(capture=torch.device(method.spec.device).type == "cuda") if cfg.cuda_graphs \
            else None  # on a CPU: the static mode's arithmetic without capture
        states = ClientStates(cfg.client_state_memory)
        super().__init__(method, cfg, Batched(method, fed, cfg.seed, cfg.client_parallel, graphs, states),
                         len(fed.clients), log)
        self.client_counts = lambda: fed.counts

    @property
    def graphs(self) -> StepGraphs | None:
        return self.transport.graphs

    @graphs.setter
    def graphs(self, g: StepGraphs | None) -> None:
        self.transport.graphs = g

    @property
    def client_states(self) -> ClientStates:
        return self.transport.client_states

    def client_state(self, cid: int) -> dict:
        return self.transport.client_state(cid)

    def parallel_chunk(self) -> int | None:
        return self.transport.parallel_chunk()


def client_parallel_chunk(setting, method: Method) -> int | None:
    """``--client-parallel``: "off" (0: one client after another), "auto" (all of a round's clients together,
    chunks halved if the GPU runs out of memory, on CUDA; one after another on a CPU, where vectorising gains
    nothing) or N (chunks of N clients, on any device). Methods with a loop of their own, and fp16 (its gradient
    scaler), always train one client after another."""
    if not method.describes_steps() or method.spec.precision == "fp16":
        return 0
    setting = str(setting)
    if setting == "off":
        return 0
    if setting == "auto":
        return None if torch.device(method.spec.device).type == "cuda" else 0
    return int(setting)
