"""Every client's sample-level accountant under ``--dp sample`` (:mod:`fedlt.core.dpsgd`), the registry the
DP-SGD trainer composes its steps into (:class:`fedlt.core.dpsgd.DPSGD`) and the server its SuperNodes' entries
(:class:`fedlt.core.dpsgd_wire.SampleWire`): each history of Poisson-sampled Gaussian steps ``[(z, q, steps)]``,
converted to epsilon by dp-accounting's RdpAccountant (the library of ``--dp client`` too, :mod:`fedlt.core.dp`);
each client's noise multiplier, solved by dp-accounting's ``calibrate_dp_mechanism`` for ``--dp-epsilon``; the
run's delta; ``--dp-budget``'s foresight; what a checkpoint keeps.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError
from .dp import calibrated, default_delta, delta_problem, fresh_accountant, gaussian_steps


def sample_delta(sizes) -> float:
    """delta when --dp-delta is not given: :func:`fedlt.core.dp.default_delta` of ``n_max`` (the largest client's
    samples: under --dp sample the unit is a sample, and each client's guarantee is over its own ``n_i``), so
    ``min(1e-5, 1 / (10 n_max))``, below ``1 / (10 n_i)`` for every client."""
    return default_delta(int(max(sizes)))


def delta_refusal(delta: float, sizes) -> str | None:
    """Why a given --dp-delta is too weak for some client: not below ``1 / n_i`` for the client with the most
    samples (the unit is a sample; :func:`fedlt.core.dp.delta_problem`), or None."""
    sizes = np.asarray(sizes)
    if not len(sizes):
        return None
    big = int(np.argmax(sizes))
    return delta_problem(float(delta), int(sizes[big]), "sample", f"the samples of client {big}, the largest; --dp "
                         f"sample protects each sample")


def batches_per_epoch(n: int, batch_size: int) -> int:
    """L: the batches of one of fedlt's epochs over ``n`` samples (``len(data_loader)`` for opacus)."""
    from ..data.federated import batch_bounds

    return max(1, len(batch_bounds(n, batch_size)))


def composed(history: list, entries) -> list:
    """A client's ledger ``history`` (``[(noise multiplier, sample rate, steps)]``, what its accountant composes:
    :func:`fedlt.core.dp.gaussian_steps`) with ``entries`` composed after it, an entry with the last one's noise
    multiplier and sample rate adding its steps to it (the ledger stays a few entries long: the optimiser's step
    hook composes every step, :meth:`fedlt.core.dpsgd.DPSGD.run_steps`)."""
    out = [tuple(h) for h in history]
    for z, q, n in entries:
        if out and out[-1][:2] == (z, q):
            out[-1] = (z, q, out[-1][2] + n)
        else:
            out.append((z, q, n))
    return out


@functools.lru_cache(maxsize=4096)
def epsilon_of(history: tuple, delta: float) -> float:
    """The epsilon at ``delta`` of a history of ``(noise_multiplier, sample_rate, steps)``: dp-accounting's
    RdpAccountant, as ``--dp client``'s (:func:`fedlt.core.dp.fresh_accountant`)."""
    return float(fresh_accountant("rdp").compose(gaussian_steps(history)).get_epsilon(delta))


@functools.lru_cache(maxsize=4096)
def sample_noise_multiplier(target: float, rate: float, steps: int, delta: float, prefix: tuple = ()) -> float:
    """The smallest noise multiplier whose epsilon after ``steps`` steps at ``rate`` is at most ``target``
    (dp-accounting's ``calibrate_dp_mechanism``, :func:`fedlt.core.dp.calibrated`), after ``prefix``: accountant
    entries before the steps (the class counts' release, :meth:`SampleAccounts.prefix`); a budget it cannot meet
    is one line."""
    prefix = tuple(map(tuple, prefix))
    if prefix and (alone := epsilon_of(prefix, delta)) >= target:
        raise ConfigError(f"--dp-epsilon {target:g}: the class counts' release alone spends {alone:.3g} "
                          f"(--dp-counts-noise {prefix[0][0]:g}); raise --dp-epsilon or --dp-counts-noise")
    z = calibrated(target, delta, lambda z: [*prefix, (z, rate, steps)])
    if z is None:
        raise ConfigError(f"--dp-epsilon {target:g} cannot be met in {steps} DP-SGD steps at sampling rate "
                          f"{rate:.3g}: raise it, or train fewer rounds or local epochs")
    return z


class SampleAccounts:
    """Every client's sample-level accountant (``--dp sample``'s registry of them): its history of Poisson-sampled
    Gaussian steps ``[(z, q, steps)]`` (:func:`epsilon_of`), its noise multiplier (``--dp-noise``, or solved for
    ``--dp-epsilon`` over its steps in the run), its sampling rate and steps a round; the run's delta, and
    ``--dp-budget``'s foresight. The trainer (:class:`fedlt.core.dpsgd.DPSGD`) composes into it, and so does the server
    from a SuperNode's entries (:class:`fedlt.core.dpsgd_wire.SampleWire`)."""

    def __init__(self, noise: float | None, target: float | None, delta: float | None, schedule: list[list[int]],
                 sizes: Callable[[], Any], budget: float | None = None, batch_size: int = 32, local_epochs: int = 1,
                 counts_noise: float | None = None):
        self.noise, self.target, self._delta = noise, target, delta
        self._delta_checked = False  # a given delta against the clients' sizes (:attr:`delta`)
        # a method whose loss reads the client's class counts (reads_counts): their noise's std (--dp-counts-noise)
        self.counts_noise = None if counts_noise is None else float(counts_noise)
        self.counted: set[int] = set()  # a SuperNode's client whose counts' release the server has counted
        # --dp-budget: the round whose clients' epsilons it would pass is not run (:meth:`over_budget`)
        self.budget, self.schedule, self.batch_size, self.local_epochs = budget, schedule, batch_size, local_epochs
        self.steps_of: dict[int, int] = {}  # each client's steps in a round it trains (known once it has)
        self.rounds_of: dict[int, int] = {}  # each client's rounds in the sampling schedule (--dp-epsilon)
        for cids in schedule:
            for c in cids:
                self.rounds_of[c] = self.rounds_of.get(c, 0) + 1
        self.sizes = sizes  # () -> every client's number of samples (read when first needed)
        self.histories: dict[int, list] = {}  # each client's accountant history [(z, q, steps)]
        self.noises: dict[int, float] = {}
        self.rates: dict[int, float] = {}

    @property
    def delta(self) -> float:
        """--dp-delta, or the default for the clients' sizes; a given one not below ``1 / n`` of the largest client is
        one line (:func:`delta_refusal`: fedlt run says it before the run, Flower's server once its clients have
        said their sizes)."""
        if self._delta is None:
            self._delta = sample_delta(np.asarray(self.sizes()))
        elif not self._delta_checked:
            if why := delta_refusal(self._delta, self.sizes()):
                raise ConfigError(why)
            self._delta_checked = True
        return float(self._delta)

    def prefix(self) -> tuple:
        """The accountant entry of a client's class counts' release, which begins its history (a method whose loss reads
        them, :func:`fedlt.core.dp.reads_counts`): the Gaussian mechanism of std ``counts_noise`` on a histogram that
        one sample changes by 1 in one class (L2 sensitivity 1), i.e. noise multiplier ``counts_noise``, sampling rate
        1, one step; else nothing."""
        return () if self.counts_noise is None else ((self.counts_noise, 1.0, 1),)

    def history_of(self, cid: int) -> list:
        """Client ``cid``'s accountant history before its next steps: what it has, else the counts' release
        (:meth:`prefix`) unless counted already (a SuperNode's, ``dp-counted``)."""
        if cid in self.histories:
            return list(self.histories[cid])
        return [] if cid in self.counted else list(self.prefix())

    def noise_of(self, cid: int, rate: float, per_round: int, keep: bool = True) -> float:
        """Client ``cid``'s noise multiplier: --dp-noise, or solved for --dp-epsilon over its steps in the run (kept
        once it trains; ``keep`` False: only asked, --dp-budget's foresight)."""
        if cid in self.noises:
            return self.noises[cid]
        z = float(self.noise) if self.noise is not None else \
            sample_noise_multiplier(float(self.target), rate, per_round * max(1, self.rounds_of.get(cid, 1)),
                                    self.delta, self.prefix())
        if keep:
            self.noises[cid] = z
        return z

    def trained(self, cid: int, ledger: list, rate: float) -> None:
        """Client ``cid``'s history after it trained here (:meth:`fedlt.core.dpsgd.DPSGD.run_steps`) at sampling rate
        ``rate``."""
        self.histories[cid], self.rates[cid] = ledger, rate

    def received(self, cid: int, entries: list) -> None:
        """Client ``cid``'s accountant entries of one message, sent by its SuperNode
        (:meth:`fedlt.core.dpsgd_wire.SampleWire.arrived`), composed into its history."""
        self.histories[cid] = composed(self.histories.get(cid, []), entries)
        self.noises[cid], self.rates[cid] = entries[-1][0], entries[-1][1]
        self.steps_of[cid] = sum(n for _, _, n in entries)

    def client_epsilon(self, cid: int) -> float:
        h = self.histories.get(cid)
        return epsilon_of(tuple(map(tuple, h)), self.delta) if h else 0.0

    def worst(self) -> tuple[int | None, float]:
        """The client with the largest epsilon so far, and its epsilon (None, 0 before any step)."""
        eps = {c: self.client_epsilon(c) for c in self.histories}
        if not eps:
            return None, 0.0
        c = max(eps, key=lambda k: (eps[k], -k))
        return c, eps[c]

    def round_epsilon(self, rnd: int) -> tuple[int | None, float]:
        """The client of round ``rnd`` whose epsilon would be the largest after it, and that epsilon (None, 0 for a
        round past the schedule). A client's steps in a round are fixed (``L`` Poisson batches an epoch): the epochs its
        method's steps ran before, else the run's local epochs; its noise as :meth:`fedlt.core.dpsgd.DPSGD.run_steps`
        would take it."""
        if rnd > len(self.schedule):
            return None, 0.0
        sizes = np.asarray(self.sizes())
        worst, eps = None, 0.0
        for c in self.schedule[rnd - 1]:
            L = batches_per_epoch(int(sizes[c]), self.batch_size)
            steps = self.steps_of.get(c, self.local_epochs * L)
            z = self.noise_of(c, 1.0 / L, steps, keep=False)
            e = epsilon_of(tuple(map(tuple, self.history_of(c))) + ((z, 1.0 / L, steps),), self.delta)
            if e > eps:
                worst, eps = c, e
        return worst, eps

    def over_budget(self, rnd: int) -> str | None:
        """Why round ``rnd`` may not run (a client it samples would end it with an epsilon past --dp-budget), or
        None (:meth:`round_epsilon`)."""
        if self.budget is None:
            return None
        worst, eps = self.round_epsilon(rnd)
        if eps <= self.budget:
            return None
        return (f"stopped before round {rnd}: client {worst}'s epsilon would reach {eps:.3g} in it, past --dp-budget "
                f"{self.budget:g} (the worst client's after round {rnd - 1}: {self.worst()[1]:.3g})")

    def clients(self) -> dict:
        """summary.json's row of every client with a history: its accountant's inputs and epsilon."""
        sizes = np.asarray(self.sizes())
        return {c: {"samples": int(sizes[c]), "sample_rate": self.rates[c],
                    "noise_multiplier": self.noises[c],  # DP-SGD's steps (not the counts' release)
                    "steps": int(sum(h[2] for h in self.histories[c])) - len(self.prefix()),
                    "history": [list(h) for h in self.histories[c]], "epsilon": self.client_epsilon(c)}
                for c in sorted(self.histories)}

    def state_dict(self) -> dict:
        """Every client's accountant history, noise multiplier, sampling rate and steps a round (--dp-budget's
        foresight)."""
        return {"histories": {c: [list(h) for h in v] for c, v in self.histories.items()},
                "noises": dict(self.noises), "rates": dict(self.rates), "steps": dict(self.steps_of)}

    def load_state_dict(self, d: dict) -> None:
        self.histories = {int(c): [tuple(h) for h in v] for c, v in d.get("histories", {}).items()}
        self.noises = {int(c): float(v) for c, v in d.get("noises", {}).items()}
        self.rates = {int(c): float(v) for c, v in d.get("rates", {}).items()}
        self.steps_of = {int(c): int(v) for c, v in d.get("steps", {}).items()}
