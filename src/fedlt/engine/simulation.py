"""The in-process engine: the run driver (``engine.driver``) over the clients of a federation held in this
process, either one client after another (:class:`InProcess`) or a round's clients trained together by the
batched executor (:class:`Batched`, ``engine.batched``). Nothing here knows a method by name.
"""
from __future__ import annotations

import torch

from ..core.api import Message, Method
from ..core.training import autocast
from ..metrics import evaluate
from .batched import Job, train_batched
from .driver import (PHASE, TRAIN, TRAINING, Driver, EngineConfig, client_generator,  # noqa: F401
                     clients_per_round, rng_state, sampling_schedule)
from .graphs import StepGraphs


class InProcess:
    """The transport of clients in this process, one after another: the method's client hooks called
    directly on each client's data and state (the states stay here, in ``client_states``)."""

    def __init__(self, method: Method, fed, seed: int):
        self.method, self.fed, self.seed = method, fed, seed
        self.client_states: dict[int, dict] = {}

    def client_state(self, cid: int) -> dict:
        if cid not in self.client_states:
            self.client_states[cid] = self.method.init_client(cid, self.fed.clients[cid])
        return self.client_states[cid]

    def reachable(self, cids) -> dict[int, str]:
        return {}

    def send_and_receive(self, kind: str, index: int, payloads: dict[int, Message]):
        m = self.method
        if kind == TRAINING:
            purpose, call = TRAIN, m.local_train
        else:
            purpose, call = PHASE, (lambda p, s, d, g: m.phase_client(kind, p, s, d, g))
        replies = []
        for cid, payload in payloads.items():
            gen = client_generator(self.seed, purpose, index, cid)
            with autocast(m.spec):
                reply, self.client_states[cid] = call(payload, self.client_state(cid), self.fed.clients[cid], gen)
            replies.append((cid, reply))
        return replies, {}

    def evaluate(self, method: Method, state: dict, split: str):
        for c in range(len(self.fed.clients)):
            self.client_state(c)
        return evaluate(method, state, self.client_states, self.fed, split), {}

    def state_dict(self) -> dict:
        return self.client_states

    def load_state_dict(self, d: dict) -> None:
        self.client_states = dict(d)


class Batched(InProcess):
    """In process, a round's clients trained together (``engine.batched``) where the method describes its
    local steps (:func:`client_parallel_chunk`); the same payloads, generators and replies as
    :class:`InProcess`, which it falls back to otherwise."""

    def __init__(self, method: Method, fed, seed: int, setting: str = "auto", graphs: StepGraphs | None = None):
        super().__init__(method, fed, seed)
        self.setting, self.graphs = setting, graphs
        self.fitted: int | None = None  # auto: the chunk size that fitted on the GPU

    def parallel_chunk(self) -> int | None:
        """How many clients train together: 0 one after another; None all of a round's that fit."""
        return client_parallel_chunk(self.setting, self.method)

    def send_and_receive(self, kind: str, index: int, payloads: dict[int, Message]):
        chunk = self.parallel_chunk() if kind == TRAINING else 0
        if chunk == 0:
            return super().send_and_receive(kind, index, payloads)
        m, seed, cids, data = self.method, self.seed, list(payloads), self.fed.clients
        jobs = [Job(m.local_steps(payloads[c], self.client_state(c), data[c]), data[c],
                    lambda c=c: client_generator(seed, TRAIN, index, c)) for c in cids]
        trained, fitted = train_batched(m, jobs, chunk, self.fitted, self.graphs)
        if chunk is None:
            self.fitted = fitted
        replies = []
        for c, out in zip(cids, trained):
            reply, self.client_states[c] = m.local_reply(payloads[c], self.client_state(c), data[c], out)
            replies.append((c, reply))
        return replies, {}


class Simulation(Driver):
    """The driver over the federation ``fed`` in this process (:class:`Batched`, which trains one client after
    another unless ``--client-parallel`` says otherwise)."""

    def __init__(self, method: Method, fed, cfg: EngineConfig, log=None):
        self.fed = fed
        graphs = StepGraphs(capture=torch.device(method.spec.device).type == "cuda") if cfg.cuda_graphs \
            else None  # on a CPU: the static mode's arithmetic without capture
        super().__init__(method, cfg, Batched(method, fed, cfg.seed, cfg.client_parallel, graphs),
                         len(fed.clients), log)

    @property
    def graphs(self) -> StepGraphs | None:
        return self.transport.graphs

    @graphs.setter
    def graphs(self, g: StepGraphs | None) -> None:
        self.transport.graphs = g

    @property
    def client_states(self) -> dict[int, dict]:
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
