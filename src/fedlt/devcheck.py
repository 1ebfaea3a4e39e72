"""Checks that catch GPU-only bugs on a CPU-only machine.

Two PyTorch function modes, used by the tests on every registered method (and usable on a plugin's code):

- :class:`ImplicitDevice` records every tensor *factory* call (``torch.zeros``, ``torch.tensor``,
  ``torch.arange``, ``torch.randperm``, ...) made from the watched source files without an explicit
  ``device=``. Such a tensor lands on the CPU whatever device the run uses, and the first operation that mixes
  it with a CUDA tensor fails ("Expected all tensors to be on the same device") -- the bug that kept FedLoGe
  and SphereFed off GPUs. On a CPU every tensor is on the CPU, so the bug itself cannot show; the guard flags
  its cause. ``*_like`` factories (which inherit their input's device) and ``torch.tensor``/``as_tensor`` of
  a tensor are not flagged.
- :class:`HostSyncs` counts reads of a tensor's value into Python made from the watched files (``.item()``,
  ``float(t)``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``, ``.cpu()``): on a GPU each one waits for
  the device to finish its queued work. The tests check that their number per client does not grow with the
  number of local steps.

For ``--cuda-graphs`` (``fedlt.engine.graphs``), two more:

- :class:`CaptureUnsafe`, a dispatch mode (it sees every ATen operation, inside vmap and the backward too),
  records the operations a CUDA graph capture refuses or cannot replay faithfully: reads of a value into Python
  (``_local_scalar_dense``: ``.item()``, ``float(t)``, ``if t:``), operations whose output size depends on
  the data (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing), ``equal``, and tensors made
  from host data (``torch.tensor(...)``: a copy from pageable host memory).
- :class:`ReplayedGraphs` runs the static mode as graphs would, without a GPU: :class:`StepGraphs`' own
  control flow (warm-up steps, one capture per step shape, the step's inputs copied into the graph's input
  tensors, replays), where "capturing" keeps the step function *of the capture step* with the graph's input
  tensors, and a replay runs that function on them (under :class:`CaptureUnsafe`). A step that reaches a
  per-step tensor other than through its inputs (a closure over this step's batch, a tensor re-made each
  chunk) then reads the capture step's one, as a replayed graph would, and the run departs from sequential
  training (as it does with the capture step's Python numbers, such as an lr kept in its closure). It cannot
  show what a graph bakes in that Python recomputes on each call here: a number read from state that changes
  after the capture (an attribute, a CPU scalar tensor's value), or a tensor made inside the step and kept
  after it.

What they cannot catch: a tensor moved to the CPU on purpose (``.cpu()``, ``device="cpu"``, numpy
round-trips) and then mixed with device tensors; code outside the watched files; CUDA-only behaviour
(kernels without a deterministic implementation, generator/device mismatches inside PyTorch, memory).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .engine.graphs import StepGraphs

FEDLT_ROOT = os.path.dirname(os.path.abspath(__file__))

_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn,
              torch.randint, torch.randperm, torch.eye, torch.linspace, torch.logspace, torch.tensor,
              torch.as_tensor, torch.scalar_tensor, torch.empty_strided, torch.tril_indices, torch.triu_indices}
_FROM_DATA = {torch.tensor, torch.as_tensor}
_READS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
          torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__index__}


def _caller(roots: tuple[str, ...], innermost: bool = False) -> str | None:
    """``file:line`` (relative to the root's parent) of the Python frame that called the torch function, if
    it lies under one of ``roots``; ``innermost``: of the innermost frame under them, wherever the call came from
    (torch's own code, say, or the backward)."""
    def root_of(f):
        return next((r for r in roots if f.f_code.co_filename.startswith(r)), None)

    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename == __file__ or (innermost and root_of(f) is None)):
        f = f.f_back  # another of these modes, stacked (or, innermost, any frame outside the roots)
    root = None if f is None else root_of(f)
    return None if root is None else f"{os.path.relpath(f.f_code.co_filename, os.path.dirname(root))}:{f.f_lineno}"


def _roots(roots) -> tuple[str, ...]:
    """The watched source folders, absolute (default: fedlt's own)."""
    return tuple(os.path.abspath(r) for r in (roots or (FEDLT_ROOT,)))


class _Watch(TorchFunctionMode):
    def __init__(self, roots: tuple[str, ...] | list[str] | None = None):
        super().__init__()
        self.roots = _roots(roots)


class ImplicitDevice(_Watch):
    """Records ``file:line: torch.NAME`` for each factory call without ``device=`` from the watched files."""

    def __init__(self, roots=None):
        super().__init__(roots)
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None and \
                not (func in _FROM_DATA and args and isinstance(args[0], torch.Tensor)):
            where = _caller(self.roots)
            if where is not None:
                self.found.append(f"{where}: torch.{func.__name__} without device=")
        return func(*args, **kwargs)


@dataclass
class _Count:
    total: int = 0
    sites: dict[str, int] = field(default_factory=dict)


class HostSyncs(_Watch):
    """Counts reads of tensor values into Python from the watched files (``total`` and per ``file:line``)."""

    def __init__(self, roots=None):
        super().__init__(roots)
        self.count = _Count()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            where = _caller(self.roots)
            if where is not None:
                self.count.total += 1
                self.count.sites[where] = self.count.sites.get(where, 0) + 1
        return func(*args, **(kwargs or {}))


_UNCAPTURABLE = {
    "_local_scalar_dense": "reads a value into Python", "equal": "returns a Python bool",
    "is_nonzero": "reads a value into Python", "nonzero": "output size depends on the data",
    "masked_select": "output size depends on the data", "unique_dim": "output size depends on the data",
    "_unique2": "output size depends on the data", "unique_consecutive": "output size depends on the data",
    "lift_fresh": "a tensor from host data: a copy from host memory",
}
_MASKED = {"index", "index_put", "index_put_", "_index_put_impl_"}


class CaptureUnsafe(TorchDispatchMode):
    """Records ``file:line: aten.NAME (why)`` for each operation a CUDA graph capture cannot hold."""

    def __init__(self, roots=None):
        super().__init__()
        self.roots = _roots(roots)
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0] if str(func).startswith("aten.") else None
        why = _UNCAPTURABLE.get(name)
        if why is None and name in _MASKED and len(args) > 1 and isinstance(args[1], (list, tuple)) and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            why = "boolean-mask indexing: output size depends on the data"
        if why is not None:
            self.found.append(f"{_caller(self.roots, innermost=True) or '?'}: aten.{name} ({why})")
        return func(*args, **(kwargs or {}))


class _Replay:
    def __init__(self, fn, inputs, guard: CaptureUnsafe):
        self.fn, self.inputs, self.guard = fn, inputs, guard

    def replay(self) -> None:
        with self.guard:
            self.fn(*self.inputs)


class ReplayedGraphs(StepGraphs):
    """:class:`StepGraphs` with graphs emulated on any device (see the module doc); ``unsafe.found`` lists the
    operations a real capture would have refused."""

    def __init__(self, warmup: int = 2, keep: int = 2, roots=None):
        super().__init__(capture=True, warmup=warmup, keep=keep)
        self.unsafe = CaptureUnsafe(roots)

    def _warm(self, fn, inputs) -> None:
        with self.unsafe:
            fn(*inputs)

    def _record(self, fn, inputs):
        return _Replay(fn, inputs, self.unsafe)
