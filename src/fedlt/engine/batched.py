"""The batched engine: a round's clients trained together, one vectorised step for all of them (the transport
:class:`Batched`, a sibling of ``engine.inprocess`` and ``engine.workers``, at the end of this module).

For methods that describe their local training (``Method.local_steps``, see ``fedlt.core.steps``), the clients
of a chunk are trained as one program: their trained tensors (model parameters, trained extras), BatchNorm
buffers and SGD momentum are stacked along a client axis, and each step runs
``vmap(grad(loss ∘ functional_call))`` over the clients, then the SGD update on the stacked tensors.

Each client does exactly the steps, with exactly the batches, that it does alone: every client draws its own
batches from its own generator (``ClientData.batches``, the same call as the sequential loop). Clients'
batches differ in size only at the end of an epoch (the last partial batch, or a batch of ``B + 1`` where a
lone last sample is folded in) and clients with fewer samples run out of steps first; so at each step the
clients that still have a batch are grouped by batch size and each group is one vectorised call (usually all
of them: one group). No sample is padded, no loss is masked: a method's loss stays the plain mean over its
batch, and BatchNorm normalises each client's batch by that batch's own statistics and updates that client's
own running statistics, as it does alone. A client without a batch at a step takes no step (no momentum or
weight-decay update either). Per-client statistics (the loss and its parts) are summed on the device and read
once per chunk.

The SGD update reproduces ``torch.optim.SGD`` (no dampening, no Nesterov) operation for operation:
``d = g + wd * p``; ``buf = d`` on a client's first step, else ``buf * momentum + d``; ``p = p - lr * buf``. The
gradients come from vectorised kernels (batched matrix products, grouped convolutions), whose sums run in
another order than one client's: results agree with sequential training to float rounding (tests: 2 rounds,
weights within 1e-4, GM/PM within 1e-4).

Memory: ``chunk`` clients at a time; with ``chunk`` None (``auto``), all of the round's clients, halved and
retried (with fresh generators, so the batches are the same) whenever CUDA runs out of memory; the size that
fitted is kept for the later rounds.
Not batched (run one client after another by the simulation): fp16 (its gradient scaler), methods with a loop of
their own, ``--dp sample`` (``core.dpsgd``: each client's DP-SGD vectorises over its batch's samples instead).

A chunk is trained by one of two runners, which share the stacks, the step and its schedule (:class:`_Runner`):
the :class:`DynamicRunner` (the default), whose stacks hold only the clients still training, and the
:class:`StaticRunner` (``--cuda-graphs``, ``engine.graphs``), whose stacks keep their size and storage for the
whole chunk, so that each step can be replayed as one CUDA graph. A client out of batches then stays in the
stacks and steps on a stand-in batch, but its result was taken out when it finished and nothing of its row is
read again; the loss sums are masked to the clients that really stepped, and the learning rates are device
tensors. On a CPU the static runner runs the same arithmetic without capture.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.func import grad_and_value, vmap

from ..core.method import Message, Method
from ..core.steps import LocalSteps, StepModel, Trained, by_setting, frozen_net, groups_of, split_loss, stats_of
from ..core.training import autocast
from ..data.transforms import to_device
from .clientstate import ClientStates
from ..seeds import Purpose
from .driver import TRAINING, client_generator
from .graphs import StepGraphs
from .inprocess import InProcess


@dataclass
class Job:
    """One client's part of a round: its description, data, a factory of its training generator, and the
    round's lr its message carried (``Message.lr``; None: the run's ``spec.lr``)."""

    steps: LocalSteps
    data: object
    make_gen: Callable[[], torch.Generator]
    lr: float | None = None


def _oom_errors() -> tuple[type, ...]:
    errs = [getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)]
    return tuple(e for e in errs if e is not None)


def train_batched(method: Method, jobs: list[Job], chunk: int | None = None,
                  fit: int | None = None, graphs: StepGraphs | None = None) -> tuple[list[Trained], int]:
    """Train every job's client, ``chunk`` clients at a time; ``chunk`` None: as many as fit, starting from
    ``fit`` (the size that fitted last time) and halving on a CUDA out-of-memory error. ``graphs``: static mode,
    steps replayed as CUDA graphs where it captures (``engine.graphs``). Returns the results, in the jobs' order,
    and the chunk size that fitted."""
    out: list[Trained] = []
    size = chunk or min(fit or len(jobs), len(jobs))
    i = 0
    while i < len(jobs):
        part = jobs[i:i + size]
        try:
            out += _train_chunk(method, part, graphs)
        except _oom_errors():
            if chunk is not None or size == 1:
                raise
            if graphs is not None:
                graphs.reset()
            size = max(1, size // 2)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        i += len(part)
    return out, size


def _to(values: list[int], dev: torch.device) -> torch.Tensor:
    """A small index tensor on ``dev`` without a stream synchronisation (from pinned memory)."""
    return to_device(torch.tensor(values, device="cpu"), dev)


def _same(values: list[torch.Tensor]) -> bool:
    return all(v is values[0] for v in values)


def _check(jobs: list[Job]) -> None:
    ref = jobs[0].steps
    for j in jobs[1:]:
        s = j.steps
        if s.loss != ref.loss or s.train != ref.train or s.epochs != ref.epochs or j.lr != jobs[0].lr or \
                list(s.weights) != list(ref.weights) or list(s.extra) != list(ref.extra):
            raise ValueError("batched clients must share one loss function, training groups, epochs, lr and "
                             "tensor names (per-client values go through LocalSteps.extra)")


def _shared_store(jobs: list[Job]) -> bool:
    """Whether the clients' samples are rows of one store with one preparation (a federation's clients): then
    a step's batches of all of them are gathered, moved and augmented with one call each."""
    d0 = jobs[0].data
    return all(getattr(j.data, "rows", None) is not None and getattr(j.data, "_x", None) is d0._x
               and j.data.prep is d0.prep for j in jobs)


def _loader(jobs: list[Job], batch_size: int, epochs: int):
    """Per client, an iterator of its batches in its own order from its own generator -- ``(rows, draws)`` plans
    (one store) or ready ``(x, y)`` batches -- and ``load(items)`` stacking a group's batches as [G, b, ...]."""
    if _shared_store(jobs):
        d0 = jobs[0].data
        iters = [j.data.plan(batch_size, j.make_gen(), epochs=epochs) for j in jobs]

        def load(items):
            rows = torch.cat([r for r, _ in items]) if len(items) > 1 else items[0][0]
            draws = None if items[0][1] is None else tuple(torch.cat(parts) for parts in zip(*(d for _, d in items)))
            x, y = d0.load(rows, draws)
            G = len(items)
            return x.view(G, -1, *x.shape[1:]), y.view(G, -1)
        return iters, load, lambda item: len(item[0])
    iters = [j.data.batches(batch_size, j.make_gen(), epochs=epochs) for j in jobs]
    load = lambda items: (torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))  # noqa: E731
    return iters, load, lambda item: (tuple(item[0].shape), tuple(item[1].shape))


class _Float32Norms:
    """BatchNorm in float32 under autocast while batched: vmap's batch-norm rule cannot mix a bf16/fp16 input
    with float32 parameters (sequential cuDNN/CPU kernels compute in float32 internally and return the input's
    dtype; this does the same explicitly). Installed on the template network for one chunk."""

    def __init__(self, net: torch.nn.Module, on: bool):
        self.mods = [m for m in net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)] if on else []
        self.handles = []
        self.dtypes: dict[torch.nn.Module, torch.dtype] = {}  # each module's input dtype, for its output

    def _in(self, mod, args):
        self.dtypes[mod] = args[0].dtype
        return (args[0].float(), *args[1:])

    def _out(self, mod, args, out):
        return out.to(self.dtypes[mod])

    def __enter__(self):
        for m in self.mods:
            self.handles += [m.register_forward_pre_hook(self._in), m.register_forward_hook(self._out)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _sgd(P, grads, M, settings, lrs=None) -> None:
    """``torch.optim.SGD``'s update (no dampening, no Nesterov) on stacked tensors, in place, one foreach call
    per operation and settings group: ``d = g + wd * p``; ``buf = buf * momentum + d`` (buffers of clients
    without one start at zero, so their first step gives ``buf = d`` exactly, as SGD's); ``p -= lr * buf``.
    ``lrs``: each group's lr as a device tensor (static mode: a graph outlives a round's lr)."""
    for i, ((lr, mom, wd), names) in enumerate(settings.items()):
        ps, gs = [P[n] for n in names], [grads[n] for n in names]
        if wd != 0:
            torch._foreach_add_(gs, ps, alpha=wd)
        if mom != 0:
            ms = [M[n] for n in names]
            torch._foreach_mul_(ms, mom)
            torch._foreach_add_(ms, gs)
            gs = ms
        if lrs is None:
            torch._foreach_add_(ps, gs, alpha=-lr)
        else:
            torch._foreach_add_(ps, torch._foreach_mul(gs, -lrs[i]))


class ClientStacks:
    """A chunk's clients as stacked tensors, client axis first: the trained tensors ``P`` (model parameters and
    trained extras), buffers ``B``, SGD momentum ``M``, and the fixed tensors ``F`` (model) and ``C`` (extras),
    each unbatched (one tensor, dim None) when every client shares the object, else stacked (dim 0). Copies:
    the jobs' tensors stay as they were. Rows leave the stacks as clients finish (:meth:`keep`), except in
    static mode, where the stacks keep their size and storage (:meth:`bind`)."""

    def __init__(self, method: Method, jobs: list[Job]):
        net, ref = method.net, jobs[0].steps
        self.jobs, self.ref, self.order = jobs, ref, list(net.state_dict())
        param_names = [n for n, _ in net.named_parameters()]
        buffer_names = [n for n in self.order if n not in set(param_names)]
        groups = groups_of(ref, param_names, ref.extra)
        self.train_model = [n for n in param_names if n in groups]
        self.train_extra = [n for n in ref.extra if n in groups]
        self.P = self._stacked(self.train_model + self.train_extra)
        self.B = self._stacked(buffer_names)
        self.F, self.f_dims = self._shared_or_stacked([n for n in param_names if n not in groups])
        self.C, self.c_dims = self._shared_or_stacked([n for n in ref.extra if n not in groups])
        self.settings = by_setting(groups, method.spec, jobs[0].lr)
        self.M = {n: torch.zeros_like(self.P[n]) for (_, mom, _), names in self.settings.items() if mom != 0
                  for n in names}
        self.had = {n: [n in j.steps.momentum for j in jobs] for n in self.M}  # momentum carried in, per client
        for n in self.M:
            for k, j in enumerate(jobs):
                if self.had[n][k]:
                    self.M[n][k] = j.steps.momentum[n].detach()

    def _source(self, name: str, j: Job) -> torch.Tensor:
        return j.steps.extra[name] if name in self.ref.extra else j.steps.weights[name]

    def _stacked(self, names):
        return {n: torch.stack([self._source(n, j).detach() for j in self.jobs]) for n in names}

    def _shared_or_stacked(self, names):
        vals, dims = {}, {}
        for n in names:
            per = [self._source(n, j) for j in self.jobs]
            vals[n], dims[n] = (per[0].detach(), None) if _same(per) else (torch.stack([v.detach() for v in per]), 0)
        return vals, dims

    def bind(self, graphs: StepGraphs, method: Method):
        """Static mode: the chunk's tensors move into the storage that the graphs of earlier chunks of this shape
        read and write (``StepGraphs.bind``); returns the binding, whose ``tensors`` the step reads."""
        spec, ref = method.spec, self.ref
        lrs = to_device(torch.tensor([lr for lr, _, _ in self.settings], dtype=torch.float32),
                        torch.device(spec.device))  # no sync
        # unbatched tensors are the jobs' own (the received model, a fixed classifier): keep copies, since later
        # chunks are copied into what is kept
        T = {"P": self.P, "B": self.B, "M": self.M,
             "F": {n: t if self.f_dims[n] == 0 else t.clone() for n, t in self.F.items()},
             "C": {n: t if self.c_dims[n] == 0 else t.clone() for n, t in self.C.items()}, "S": {"lrs": lrs}}
        shape = (len(self.jobs), ref.loss, spec.precision,
                 tuple((tuple(ns), mom, wd) for (_, mom, wd), ns in self.settings.items()),
                 tuple(self.f_dims.items()), tuple(self.c_dims.items()),
                 tuple((part, n, tuple(t.shape), t.dtype) for part, ts in T.items() for n, t in ts.items()))
        bound = graphs.bind(shape, T)
        T = bound.tensors
        self.P, self.B, self.M, self.F, self.C = T["P"], T["B"], T["M"], T["F"], T["C"]
        if "sums" in T:
            T["sums"]["sums"].zero_()
        return bound

    def per_client(self) -> list[dict[str, torch.Tensor]]:
        """The stacks with a client axis: P, B, M and the stacked ones of F and C."""
        return [self.P, self.B, self.M, {n: t for n, t in self.F.items() if self.f_dims[n] == 0},
                {n: t for n, t in self.C.items() if self.c_dims[n] == 0}]

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows stay in the stacks (once per client that finishes, not a gather per step)."""
        for store in (self.P, self.B, self.M):
            for n in store:
                store[n] = store[n].index_select(0, rows)
        for store, dims in ((self.F, self.f_dims), (self.C, self.c_dims)):
            for n in store:
                if dims[n] == 0:
                    store[n] = store[n].index_select(0, rows)

    def rows(self, idx: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Copies of the rows ``idx`` of :meth:`per_client`'s stacks."""
        return [{n: t[idx] for n, t in store.items()} for store in self.per_client()]

    def put(self, idx: torch.Tensor, tp: dict, bufs: dict, mom: dict) -> None:
        """Write the rows ``idx`` of P, B and M back."""
        for store, part in zip((self.P, self.B, self.M), (tp, bufs, mom)):
            for n, t in part.items():
                store[n][idx] = t

    def take(self, k: int, pos: int, stepped: bool) -> Trained:
        """Client ``k``'s final state, out of row ``pos``."""
        P, B, F = self.P, self.B, self.F
        weights = {}
        for n in self.order:
            if n in P:
                weights[n] = P[n][pos].clone()
            elif n in B:
                weights[n] = B[n][pos].clone()
            else:
                weights[n] = F[n].clone() if self.f_dims[n] is None else F[n][pos].clone()
        extra = {n: (P[n][pos].clone() if n in P else self.jobs[k].steps.extra[n]) for n in self.ref.extra}
        momentum = {n: self.M[n][pos].clone() for n in self.M if self.had[n][k] or stepped}
        return Trained(weights, extra, momentum, {})


def local_step(method: Method, stacks: ClientStacks, part_names: list[str]):
    """The pure step: ``step(P, B, F, C, X, Y) -> (grads of P, (loss, [loss, *parts] per client))``,
    ``vmap(grad(loss o functional_call))`` over the client axis. Reads nothing but its arguments (and the
    template network's structure); the names of the loss parts go into ``part_names``."""
    net, spec, ref = method.net, method.spec, stacks.ref
    frozen = frozen_net(method)
    train_model, train_extra = stacks.train_model, stacks.train_extra

    def loss_of(tp, bufs, fp, cp, x, y):
        tensors = {**fp, **{n: tp[n] for n in train_model}, **bufs}
        view = StepModel(net, {n: tp[n] for n in train_model}, frozen, tensors)
        extra = {**cp, **{n: tp[n] for n in train_extra}}
        with autocast(spec):
            total, parts = split_loss(ref.loss(view, x, y, extra))
        part_names[:] = list(parts)
        return total, torch.stack([total, *parts.values()]).detach()

    return vmap(grad_and_value(loss_of, has_aux=True), in_dims=(0, 0, stacks.f_dims, stacks.c_dims, 0, 0))


def size_groups(batches: dict[int, object], slot: dict[int, int], size_of) -> tuple[list[int], list[list[int]]]:
    """The scheduler of a step: the stack rows of the clients with a batch, grouped by batch size; the largest
    group (``main``) steps over the whole stack, each other one (an epoch's last, partial batch) on its own."""
    by_size: dict[tuple, list[int]] = {}
    for k, b in batches.items():
        by_size.setdefault(size_of(b), []).append(slot[k])
    main, *odd = sorted(by_size.values(), key=len, reverse=True)
    return main, odd


def _train_chunk(method: Method, jobs: list[Job], graphs: StepGraphs | None = None) -> list[Trained]:
    """Train one chunk of clients together: by the :class:`StaticRunner` with ``graphs`` (static mode, see
    ``engine.graphs``), else by the :class:`DynamicRunner`."""
    return (DynamicRunner(method, jobs) if graphs is None else StaticRunner(method, jobs, graphs)).run()


class _Runner:
    """One chunk of clients trained together -- what both modes share: the chunk's :class:`ClientStacks`, the
    pure :func:`local_step`, every client's batches, and the schedule of each step (the clients that run out of
    batches finish, :func:`size_groups` picks the main group, and each odd-sized group steps on its own,
    eagerly, on copies of its rows). A mode says how the stacks follow the clients that finish
    (:meth:`leave`) and how the main step runs (:meth:`main_step`)."""

    def __init__(self, method: Method, jobs: list[Job]):
        _check(jobs)
        spec, ref = method.spec, jobs[0].steps
        self.method, self.K, self.dev = method, len(jobs), torch.device(spec.device)
        method.net.train()
        self.S = ClientStacks(method, jobs)
        self.part_names: list[str] = []
        self.step = local_step(method, self.S, self.part_names)
        epochs = spec.local_epochs if ref.epochs is None else ref.epochs
        self.iters, self.load, self.size_of = _loader(jobs, spec.batch_size, epochs)
        self.sums: torch.Tensor | None = None  # [rows, 1 + parts] loss sums, on the device
        self.index: dict[tuple, torch.Tensor] = {}  # row positions on the device, made once per set of rows
        self.masks: dict[tuple, torch.Tensor] = {}  # per set of rows that step, a [rows, 1] mask of them

    def on_device(self, positions: list[int]) -> torch.Tensor:
        key = tuple(positions)
        if key not in self.index:
            self.index[key] = _to(positions, self.dev)
        return self.index[key]

    def mask_of(self, rows: list[int], n: int) -> torch.Tensor:
        """[n, 1] float64: 1 on ``rows``, else 0."""
        key = (n, *sorted(rows))
        if key not in self.masks:
            self.masks[key] = torch.zeros(n, 1, dtype=torch.float64, device=self.dev).index_fill_(
                0, self.on_device(list(key[1:])), 1)
        return self.masks[key]

    def leave(self, active: list[int], slot: dict[int, int]) -> dict[int, int]:
        """Some clients finished; ``active`` still train. Returns each active client's row in the stacks."""
        raise NotImplementedError

    def rows(self, active: list[int]) -> int:
        """How many rows the main step runs over."""
        raise NotImplementedError

    def main_step(self, X: torch.Tensor, Y: torch.Tensor, main: list[int], odd: bool) -> None:
        """The step of the main group's rows (on the whole stack), its loss sums added to ``self.sums``."""
        raise NotImplementedError

    def loss_parts(self) -> list[str]:
        """The names of the loss's parts (set while a step's Python ran)."""
        return self.part_names

    def run(self) -> list[Trained]:
        S, K = self.S, self.K
        A = list(range(K))  # the clients still training
        slot = {k: k for k in A}  # each one's row in the stacks
        final_sums: dict[int, torch.Tensor] = {}
        steps = [0] * K
        results: list[Trained | None] = [None] * K
        with _Float32Norms(self.method.net, self.method.spec.precision != "fp32"):
            while A:
                batches = {k: b for k in A if (b := next(self.iters[k], None)) is not None}
                if len(batches) < len(A):  # clients out of batches are done
                    for k in A:
                        if k not in batches:
                            results[k] = S.take(k, slot[k], steps[k] > 0)
                            if self.sums is not None:
                                final_sums[k] = self.sums[slot[k]].clone()
                    A = [k for k in A if k in batches]
                    if not A:
                        break
                    slot = self.leave(A, slot)
                main, odd = size_groups(batches, slot, self.size_of)
                # Clients whose batch has another size (an epoch's last, partial batch): their state is copied out
                # before the main step, which then runs over the whole stack with a main client's batch standing
                # in for theirs; their own step runs on the copies, which are written back over the stand-in's
                # result.
                copies = [(members, (idx := self.on_device(members)), S.rows(idx)) for members in odd]
                of_row = {slot[k]: batches[k] for k in A}
                items = [of_row[main[0]]] * self.rows(A)
                for pos in main:
                    items[pos] = of_row[pos]
                X, Y = self.load(items)
                self.main_step(X, Y, main, bool(odd))
                for members, idx, (tp, bufs, mom, fp, cp) in copies:
                    X, Y = self.load([of_row[pos] for pos in members])
                    grads, (_, vec) = self.step(tp, bufs, {**S.F, **fp}, {**S.C, **cp}, X, Y)
                    with torch.no_grad():
                        _sgd(tp, grads, mom, S.settings)
                        S.put(idx, tp, bufs, mom)
                        self.sums.index_add_(0, idx, vec.double())
                for k in A:
                    steps[k] += 1
        part_names = self.loss_parts()
        names = sorted(final_sums)
        means = {}
        if names:
            counts = to_device(torch.tensor([steps[k] for k in names], dtype=torch.float64, device="cpu"), self.dev)
            rows = (torch.stack([final_sums[k] for k in names]) / counts.clamp_min(1)[:, None]).tolist()
            means = dict(zip(names, rows))
        for k, r in enumerate(results):
            r.stats = stats_of(part_names, means.get(k, [0.0]), steps[k])
        return results


class DynamicRunner(_Runner):
    """The dynamic mode: the stacks hold only the clients still training (a client that finishes leaves them),
    each step runs eagerly, and the SGD update takes the learning rates as Python numbers."""

    def leave(self, active, slot):
        kept = _to([slot[k] for k in active], self.dev)
        self.S.keep(kept)
        self.sums = None if self.sums is None else self.sums.index_select(0, kept)
        self.index.clear()
        self.masks.clear()
        return {k: i for i, k in enumerate(active)}

    def rows(self, active):
        return len(active)

    def main_step(self, X, Y, main, odd):
        S = self.S
        grads, (_, vec) = self.step(S.P, S.B, S.F, S.C, X, Y)
        with torch.no_grad():
            _sgd(S.P, grads, S.M, S.settings)
            vec = vec.double()
            if odd:
                vec = vec * self.mask_of(main, len(vec))
            self.sums = vec if self.sums is None else self.sums + vec


class StaticRunner(_Runner):
    """The static mode (``--cuda-graphs``, ``engine.graphs``): the stacks keep their size and storage for the
    whole chunk -- bound to the storage that earlier chunks of this shape used -- so that each main step can be
    replayed as one CUDA graph. A client out of batches stays in the stacks and steps on a stand-in batch (its
    result was taken out when it finished and nothing of its row is read again); the loss sums are masked to the
    clients that really stepped, and the learning rates are device tensors (a graph outlives a round's lr)."""

    def __init__(self, method: Method, jobs: list[Job], graphs: StepGraphs):
        super().__init__(method, jobs)
        self.graphs = graphs
        self.bound = self.S.bind(graphs, method)
        self.T = self.bound.tensors  # the only tensors a (captured) step touches

    def leave(self, active, slot):
        return slot  # rows stay where they are

    def rows(self, active):
        return self.K

    def _step(self, X, Y, keep) -> None:
        """One step of every row of the stacks; the loss sums only of the rows where ``keep`` is 1. (A row
        without its own batch -- a finished client, whose result was taken out when it finished, or one with an
        odd-sized batch, whose state is written back after its own step -- may train on the stand-in: nothing of
        it is read.) Writes only into ``T``'s tensors."""
        T = self.T
        grads, (_, vec) = self.step(T["P"], T["B"], T["F"], T["C"], X, Y)
        with torch.no_grad():
            _sgd(T["P"], grads, T["M"], self.S.settings, T["S"]["lrs"])
            vec = vec.double() * keep
            if "sums" not in T:
                T["sums"] = {"sums": torch.zeros_like(vec)}
            T["sums"]["sums"].add_(vec)

    def main_step(self, X, Y, main, odd):
        self.graphs.run(self.bound, (tuple(X.shape), X.dtype, tuple(Y.shape), Y.dtype), self._step, X, Y,
                        self.mask_of(main, self.K))
        self.sums = self.T["sums"]["sums"]

    def loss_parts(self):
        if self.part_names:  # a replay runs no Python: the names are kept from the steps that ran it
            self.bound.parts = list(self.part_names)
        return self.bound.parts


# ------------------------------------------------------------------------------------------- the transport
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
                    lambda c=c: client_generator(seed, Purpose.TRAIN, index, c), payloads[c].lr) for c in cids]
        trained, fitted = train_batched(m, jobs, chunk, self.fitted, self.graphs)
        if chunk is None:
            self.fitted = fitted
        replies = []
        for c, out in zip(cids, trained):
            reply, cstate = m.local_reply(payloads[c], states[c], data[c], out)
            self.keep(c, cstate)
            replies.append((c, reply))
        return replies, {}


def client_parallel_chunk(setting, method: Method) -> int | None:
    """``--client-parallel``: "off" (0: one client after another), "auto" (all of a round's clients together,
    chunks halved if the GPU runs out of memory, on CUDA; one after another on a CPU, where vectorising gains
    nothing) or N (chunks of N clients, on any device). Methods with a loop of their own, fp16 (its gradient
    scaler) and ``--dp sample`` (DP-SGD, ``core.dpsgd``, vectorises each client's per-sample gradients instead)
    always train one client after another."""
    if not method.describes_steps() or method.spec.precision == "fp16" or method.step_runner.per_sample:
        return 0
    setting = str(setting)
    if setting == "off":
        return 0
    if setting == "auto":
        return None if torch.device(method.spec.device).type == "cuda" else 0
    return int(setting)
