"""The simulator: the run driver (``engine.driver``) over a federation held in this process, its clients trained by
one of the in-process engines -- one after another (``engine.inprocess``), together (``engine.batched``:
``--client-parallel``) or in worker processes (``engine.workers``: ``--workers``), as the run's settings say.
"""
from __future__ import annotations

import torch

from ..core.method import Method
from .batched import Batched, client_parallel_chunk  # noqa: F401
from .clientstate import ClientStates
from .driver import Driver, EngineConfig
from .graphs import StepGraphs
from .inprocess import InProcess  # noqa: F401
from .workers import Workers


class Simulation(Driver):
    """The driver over the federation ``fed`` in this process: :class:`~fedlt.engine.workers.Workers` with
    ``--workers``, else :class:`Batched`, which trains one client after another unless ``--client-parallel`` says
    otherwise."""

    def __init__(self, method: Method, fed, cfg: EngineConfig, log=None):
        self.fed = fed
        graphs = StepGraphs(capture=torch.device(method.spec.device).type == "cuda") if cfg.cuda_graphs \
            else None  # on a CPU: the static mode's arithmetic without capture
        states = ClientStates(cfg.client_state_memory)
        transport = Workers(method, fed, cfg.seed, cfg.worker_processes, states, threads=cfg.threads or 1) \
            if cfg.worker_processes > 0 else Batched(method, fed, cfg.seed, cfg.client_parallel, graphs, states)
        super().__init__(method, cfg, transport, len(fed.clients), log)
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
