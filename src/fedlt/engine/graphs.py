"""CUDA graphs of batched steps (``--cuda-graphs``): a step's kernels launched as one graph.

A batched step of a small model is bound by launches, not arithmetic: vmap's rules, the backward and the SGD
update launch about a hundred small kernels, each one issued by Python. A CUDA graph records them once and
replays them with one call. What a graph replays must always read and write the same memory, so the executor's
*static* mode (``engine.batched``) keeps a chunk's stacks at a fixed size and address for the whole chunk: a
client that has run out of batches stays in the stacks with another client's batch standing in (its result was
taken out when it finished; nothing of its row is read again), instead of leaving the stacks, and only the loss
sums are masked.

:class:`StepGraphs` holds, per run, the stacks of the last chunk shapes it saw (adopted from the first chunk of
that shape, later chunks copied in) and, per step shape, a graph: the first ``warmup`` steps of a shape run
eagerly on a side stream (they are real steps), the next one is captured and every later one replayed, its
inputs copied into the graph's own input tensors first. Without ``capture`` (a CPU) every step runs eagerly: the
same static-mode arithmetic. The CPU tests emulate the capture and its replays instead
(``fedlt.devcheck.ReplayedGraphs``, through the ``_warm``/``_record`` hooks). If a capture fails, the run goes
on eagerly and says so once.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class _Entry:
    warm: int = 0
    graph: object = None
    inputs: list = field(default_factory=list)


@dataclass
class Bound:
    """A chunk shape's persistent tensors (name -> dict of stacked tensors) and its step graphs."""

    tensors: dict[str, dict[str, torch.Tensor]]
    entries: dict[tuple, _Entry] = field(default_factory=dict)
    parts: list[str] = field(default_factory=list)  # the loss's part names (set in Python, which a replay skips)


class StepGraphs:
    """Graphs of a run's batched steps, kept across rounds (see the module doc)."""

    def __init__(self, capture: bool, warmup: int = 2, keep: int = 2):
        self.capture, self.warmup, self.keep = capture, warmup, keep
        self.bound: dict[tuple, Bound] = {}  # chunk shape -> its tensors and graphs, least recently used first
        self.pool = None
        self.failed: str | None = None
        self.captured = 0  # graphs captured so far
        self.replays = 0

    def reset(self) -> None:
        """Drop every graph and persistent tensor (the executor, after running out of memory)."""
        self.bound.clear()
        self.pool = None

    def bind(self, key: tuple, tensors: dict[str, dict[str, torch.Tensor]]) -> Bound:
        """The persistent tensors for a chunk of shape ``key``: ``tensors`` themselves the first time (adopted),
        else the earlier ones with ``tensors``' values copied in."""
        b = self.bound.pop(key, None)
        if b is None:
            b = Bound(tensors)
            while len(self.bound) >= self.keep:  # the oldest shape's graphs and memory go
                self.bound.pop(next(iter(self.bound)))
        else:
            with torch.no_grad():
                for part, ts in tensors.items():
                    for n, t in ts.items():
                        b.tensors[part][n].copy_(t)
        self.bound[key] = b
        return b

    def run(self, b: Bound, key: tuple, fn: Callable[..., None], *inputs: torch.Tensor) -> None:
        """``fn(*inputs)``: a step that writes only into ``b``'s tensors; eagerly, or by a graph of ``key``."""
        if not self.capture or self.failed is not None:
            fn(*inputs)
            return
        e = b.entries.setdefault(key, _Entry())
        if e.graph is None and e.warm < self.warmup:
            self._warm(fn, inputs)
            e.warm += 1
            return
        if e.graph is None:
            e.inputs = [t.clone() for t in inputs]
            try:
                e.graph = self._record(fn, e.inputs)
            except Exception as err:  # nothing ran while capturing: the step runs eagerly instead
                if isinstance(err, torch.OutOfMemoryError):
                    raise  # the executor halves the chunk
                self.failed = f"{type(err).__name__}: {err}".splitlines()[0]
                warnings.warn(f"CUDA graph capture failed, batched steps run without graphs: {self.failed}")
                fn(*inputs)
                return
            self.captured += 1
        for dst, src in zip(e.inputs, inputs):
            dst.copy_(src)
        e.graph.replay()
        self.replays += 1

    def _warm(self, fn: Callable[..., None], inputs) -> None:
        """A warm-up step: eagerly, on a side stream (as capture wants its first allocations made)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)

    def _record(self, fn: Callable[..., None], inputs: list[torch.Tensor]):
        """``fn(*inputs)`` captured (not run) as a graph whose ``replay()`` runs it; memory from one shared pool."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            fn(*inputs)
        self.pool = g.pool()
        return g
