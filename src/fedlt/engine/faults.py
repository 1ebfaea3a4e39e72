"""Clients that are away, drop out or straggle: who of a round's clients is online, trains and is heard back.

Every engine's rounds go through :class:`fedlt.engine.driver.Driver`, which asks the :class:`Faults` of a run for
each round's :class:`RoundPlan` and keeps out of the aggregation the replies that never arrive; the driver's
``missing`` records are where they are counted, as for a real client that fails (a Flower deployment's). All of
it is off by default (a run's clients and numbers are then those of a run without this module).

The model (docs/dropout.md):

- **availability** ``p_k``, the probability that client ``k`` is online in a round, drawn anew each round:
  a constant ``P``, or a profile scaled so that the mean over the clients is ``--availability-mean`` ``m``
  (:func:`availability`): ``size``, proportional to the client's number of training samples; ``tail``,
  proportional to ``exp(-kappa * t_k)`` (``kappa`` = ``--availability-skew``, 5 by default: a client holding
  only the rarest class is online 1/148 as often as one holding only the most frequent), where the tail score ``t_k`` (:func:`tail_scores`) is the mean
  over the client's samples of ``log(f_max / f_c) / log(f_max / f_min)`` for the global class frequencies
  ``f``: 0 for a client holding only the most frequent class, 1 for one holding only the rarest. Only online
  clients can be sampled; when fewer are online than the round wants, all of them train (none: an empty round).
- **drop-rate** ``P``: each sampled client trains, and its reply is lost with probability ``P``.
- **stragglers**: client ``k`` has a speed ``s_k`` (log-normal with median 1 and ``--speed-sigma``, or read from
  ``--speed-file``); its simulated time in a round is ``n_k * E / (RATE * s_k)`` seconds for ``n_k`` training
  samples, ``E`` local epochs and ``RATE`` = 1,000 samples per second at speed 1 (no transfer term: every
  client of a round sends and receives the same bytes, so it would shift every time alike). With
  ``--round-deadline D`` a reply later than ``D`` simulated seconds is lost; ``--over-select F`` samples
  ``ceil(F * n)`` clients for a round that wants ``n`` and aggregates the first ``n`` replies to arrive within
  the deadline (the round closes at the ``n``-th reply, or at the deadline). The round's simulated time is that
  of its last aggregated reply, or the deadline where fewer than ``n`` arrived.

Every draw comes from generators of their own, keyed by the run's seed, a purpose (fedlt.seeds.Purpose) and the
round: the existing sampling stream is untouched, and a resumed run draws what the uninterrupted one drew (nothing to
checkpoint).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from ..decl import Relation, check_relations, requires, show
from ..errors import ConfigError
from ..jsonutil import read_json
from ..seeds import Purpose

PROFILES = ("always", "size", "tail")
RATE = 1000.0  # samples trained per simulated second by a client of speed 1


def client_speeds(speed_sigma: float, speed_file: str | None, num_clients: int, seed: int) -> np.ndarray:
    """The clients' speeds (the time model above): from ``speed_file``, else log-normal with median 1 and
    ``speed_sigma``, drawn from the run's seed."""
    if speed_file is not None:
        return read_speeds(speed_file, num_clients)
    return np.exp(speed_sigma * np.random.default_rng([seed, Purpose.SPEED]).standard_normal(num_clients))


def fastest_round(cfg) -> float:
    """Simulated seconds of the fastest client's round at best: one sample (every client holds one) at the
    highest speed any client has (:meth:`Faults.times`: n x E / (RATE x speed))."""
    speeds = client_speeds(float(cfg.speed_sigma), cfg.speed_file, cfg.clients, cfg.seed)
    return max(cfg.local_epochs, 1) / (RATE * float(speeds.max()))


SPEED_RANGE = (1e-6, 1e6)  # a speed file's speeds: a client a million times slower or faster than speed 1 at most


def read_speeds(path: str, num_clients: int) -> np.ndarray:
    """A speed file: a JSON list of one positive speed per client, or {client id: speed} for every client."""
    if not str(path).strip():
        raise ConfigError(f"--speed-file {show(path)} names no file: give the JSON file of the clients' speeds (a "
                          f"list, one per client, or {{client id: speed}}), or leave --speed-file out")
    doc = read_json(path, f"speed file {path}")
    if isinstance(doc, dict):
        try:
            doc = {int(k): v for k, v in doc.items()}
        except ValueError:
            raise ConfigError(f"speed file {path}: keys must be client ids 0..{num_clients - 1}") from None
        if sorted(doc) != list(range(num_clients)):
            raise ConfigError(f"speed file {path} must give a speed for each of the {num_clients} clients "
                              f"0..{num_clients - 1}")
        doc = [doc[k] for k in range(num_clients)]
    if not isinstance(doc, list) or len(doc) != num_clients:
        raise ConfigError(f"speed file {path} must hold a list of {num_clients} speeds (one per client) or "
                          f"{{client id: speed}}")
    for k, v in enumerate(doc):  # a JSON number: true is no speed of 1, nor "2" a speed of 2
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"speed file {path}: client {k}'s speed is {json.dumps(v)[:40]}; every speed must be a "
                              f"number (written without quotes)")
    s = np.asarray([float(v) for v in doc])
    bad = np.flatnonzero(~(np.isfinite(s) & (s >= SPEED_RANGE[0]) & (s <= SPEED_RANGE[1])))
    if len(bad):  # a round's time is samples / speed: it must stay a finite number (metrics.jsonl is JSON)
        raise ConfigError(f"speed file {path}: client {bad[0]}'s speed is {doc[bad[0]]!r}; every speed must be a "
                          f"positive finite number, in [{SPEED_RANGE[0]:g}, {SPEED_RANGE[1]:g}] (relative to 1)")
    return s


# the settings that need the time model, checked one layer up from the settings' own (fedlt.runner.rundir, before
# anything is loaded or written): the speed file's content, then the deadline against the speeds
RELATIONS: list[Relation] = [
    requires("round_deadline", lambda c: c.round_deadline >= fastest_round(c),
             lambda c: f"round-deadline {c.round_deadline:g} s is shorter than any client's round (at best "
                       f"{fastest_round(c):.3g} s: one sample at the fastest client's speed); every reply would be "
                       f"lost: use at least {fastest_round(c):.3g}", when=lambda c: c.round_deadline is not None,
             others=("speed_sigma", "speed_file", "local_epochs"), bad=({"round_deadline": 1e-30},)),
]


def check_settings(cfg) -> None:
    """The run settings ``cfg`` against the time model: the speed file is read (its own one-line errors first), then
    :data:`RELATIONS`."""
    if cfg.speed_file is not None:
        read_speeds(cfg.speed_file, cfg.clients)
    check_relations(cfg, RELATIONS)


@dataclass
class RoundPlan:
    """Who a round reaches: ``sampled`` (the clients sent the round's payload), how many were ``online``
    (None: availability off), ``wanted`` (the replies the round aggregates at most), each sampled client's
    simulated ``time`` (empty without a time model) and the clients whose reply is ``lost`` with why."""
    sampled: list[int]
    wanted: int
    online: int | None = None
    dropped: set[int] = field(default_factory=set)
    time: dict[int, float] = field(default_factory=dict)


@dataclass
class Faults:
    """The settings of the model above (``fedlt.config.RunConfig``'s block of them) and the federation's
    counts, from which every round's plan is drawn."""
    availability: str = "always"
    availability_mean: float = 0.5
    availability_skew: float = 5.0
    drop_rate: float = 0.0
    speed_sigma: float = 0.0
    speed_file: str | None = None
    round_deadline: float | None = None
    over_select: float = 1.0
    local_epochs: int = 1
    _times: np.ndarray | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, cfg) -> "Faults":
        return cls(str(cfg.availability), float(cfg.availability_mean), float(cfg.availability_skew),
                   float(cfg.drop_rate),
                   float(cfg.speed_sigma), cfg.speed_file, None if cfg.round_deadline is None
                   else float(cfg.round_deadline), float(cfg.over_select), int(cfg.local_epochs))

    @property
    def active(self) -> bool:
        return self.selects or self.drop_rate > 0 or self.timed

    @property
    def selects(self) -> bool:
        """Whether the round's clients are drawn here (availability or over-selection) instead of by the
        driver's sampling schedule."""
        return self.availability != "always" or self.over_select > 1

    @property
    def timed(self) -> bool:
        return self.speed_sigma > 0 or self.speed_file is not None or self.round_deadline is not None \
            or self.over_select > 1

    # ------------------------------------------------------------------ per-client quantities
    def availability_of(self, counts: np.ndarray) -> np.ndarray:
        return availability(self.availability, self.availability_mean, counts, self.availability_skew)

    def speeds(self, num_clients: int, seed: int) -> np.ndarray:
        return client_speeds(self.speed_sigma, self.speed_file, num_clients, seed)

    def times(self, counts: np.ndarray, seed: int) -> np.ndarray:
        """Each client's simulated seconds for a round's local training."""
        work = np.asarray(counts).sum(1).astype(np.float64) * max(self.local_epochs, 1)
        return work / (RATE * self.speeds(len(work), seed))

    # ------------------------------------------------------------------ a round
    def plan(self, rnd: int, base: list[int], per_round: int, seed: int, counts_of) -> RoundPlan:
        """Round ``rnd``'s plan; ``base`` is the driver's sampling of the round (used unless availability or
        over-selection choose the clients), ``counts_of()`` the federation's [K, C] training counts."""
        counts = None
        online = None
        sampled, wanted = list(base), len(base)
        if self.selects:
            counts = np.asarray(counts_of())
            K = len(counts)
            rng = np.random.default_rng([seed, Purpose.SELECT, rnd])
            pool = np.arange(K)
            if self.availability != "always":
                p = self.availability_of(counts)
                up = np.random.default_rng([seed, Purpose.ONLINE, rnd]).random(K) < p
                pool = np.flatnonzero(up)
                online = int(len(pool))
            want = min(K, math.ceil(self.over_select * per_round - 1e-9))
            take = min(want, len(pool))
            sampled = sorted(rng.choice(pool, size=take, replace=False).tolist()) if take else []
            wanted = per_round
        plan = RoundPlan(sampled, wanted, online)
        if self.drop_rate > 0 and sampled:
            lost = np.random.default_rng([seed, Purpose.DROP, rnd]).random(len(sampled)) < self.drop_rate
            plan.dropped = {c for c, x in zip(sampled, lost) if x}
        if self.timed:
            if counts is None:
                counts = np.asarray(counts_of())
            if self._times is None:
                self._times = self.times(counts, seed)  # per client, fixed for the run
            plan.time = {c: float(self._times[c]) for c in sampled}
        return plan

    def arrivals(self, plan: RoundPlan, answered: list[int]) -> tuple[list[int], dict[int, str], float | None]:
        """Of the clients that ``answered`` (their reply came back from the transport), those the round
        aggregates; the others with why they are lost; the round's simulated time (None: no time model)."""
        why: dict[int, str] = {}
        on_time = []
        for c in answered:
            if c in plan.dropped:
                why[c] = "dropped out (--drop-rate)"
            elif self.round_deadline is not None and plan.time[c] > self.round_deadline:
                why[c] = f"missed the deadline ({plan.time[c]:.3g} s > {self.round_deadline:g} s)"
            else:
                on_time.append(c)
        if self.timed:
            on_time.sort(key=lambda c: (plan.time[c], c))
        for c in on_time[plan.wanted:]:
            why[c] = f"late: the round closed at its {plan.wanted} replies (--over-select)"
        kept = sorted(on_time[:plan.wanted])
        if not self.timed:
            return kept, why, None
        if len(kept) < plan.wanted and self.round_deadline is not None:
            t = self.round_deadline  # the server waits until the deadline for the replies it lacks
        else:
            t = max((plan.time[c] for c in kept), default=0.0)
        return kept, why, t


def tail_scores(counts: np.ndarray) -> np.ndarray:
    """Each client's tail score in [0, 1]: the mean over its samples of ``log(f_max / f_c) / log(f_max /
    f_min)``, with ``f`` the global class frequencies (classes without samples left out); 0 where every class
    is equally frequent."""
    counts = np.asarray(counts, dtype=np.float64)
    f = counts.sum(0)
    present = f > 0
    rarity = np.zeros_like(f)
    span = math.log(f[present].max() / f[present].min()) if present.any() else 0.0
    if span > 0:
        rarity[present] = np.log(f[present].max() / f[present]) / span
    n = counts.sum(1)
    return np.where(n > 0, counts @ rarity / np.maximum(n, 1), 0.0)


def availability(profile: str, mean: float, counts: np.ndarray, skew: float = 5.0) -> np.ndarray:
    """Each client's probability of being online in a round: ``profile`` a number (the same for every client),
    ``always`` (1), or ``size`` / ``tail``: ``min(1, c * w_k)`` for the weights ``w`` (training samples, or
    ``exp(-skew * tail score)``), with ``c`` chosen so that the mean over the clients is ``mean`` (the weights
    capped at 1 raise the others)."""
    K = len(counts)
    if profile == "always":
        return np.ones(K)
    if profile not in PROFILES:
        return np.full(K, float(profile))
    counts = np.asarray(counts, dtype=np.float64)
    w = counts.sum(1) if profile == "size" else np.exp(-skew * tail_scores(counts))
    return scaled_to_mean(w, mean)


def scaled_to_mean(w: np.ndarray, mean: float) -> np.ndarray:
    """``min(1, c * w)`` with the ``c`` that makes its mean ``mean`` (bisection; all ones if the weights cannot
    reach it, e.g. ``mean`` 1)."""
    w = np.maximum(np.asarray(w, dtype=np.float64), 0.0)
    if w.sum() == 0 or np.mean(w > 0) <= mean:
        return np.where(w > 0, 1.0, 0.0) if w.sum() else np.full(len(w), mean)
    lo, hi = 0.0, 1.0 / w[w > 0].min()
    for _ in range(100):
        c = (lo + hi) / 2
        if np.minimum(1.0, c * w).mean() < mean:
            lo = c
        else:
            hi = c
    return np.minimum(1.0, hi * w)
