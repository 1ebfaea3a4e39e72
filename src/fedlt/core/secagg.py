"""Secure aggregation (``--secagg``): Flower's SecAgg+ (Bell, Bonawitz, Gascon, Lepoint and Raykova, CCS 2020;
flwr's ``SecAggPlusWorkflow`` and ``secaggplus_mod``), and the same arithmetic for the in-process engines.

What a client sends in a training round: its *update* ``Delta = w_client - w_received`` over every floating-point
entry of its reply (integer entries, BatchNorm's step counters, go back as received, as under ``--dp client``),
weighted by ``dq = round(n / W * T) / T`` (``n``: its ``num_examples``, ``W``: ``--secagg-max-weight``),
clipped to ``[-R, R]`` (``--secagg-clip-range``), stochastically rounded to ``T`` levels (``--secagg-levels``) and
masked: pairwise masks that cancel in the sum, and a private mask whose seed the other clients hold in shares
(``--secagg-shares``, any ``--secagg-threshold`` of which rebuild it). The server learns the sum modulo ``2^32``
of the quantised vectors, so the weighted mean ``sum dq_i Delta_i / sum dq_i`` within the quantisation error,
and nothing of any one update; a client that drops out after sending its keys has its masks rebuilt from the
others' shares, so the round aggregates whoever is left, as long as every client keeps ``threshold`` live
neighbours. What still crosses in the clear: each reply's ``num_examples`` (the weight; 1 under ``--dp
client``), its meta values (the method's training statistics: loss, steps) and the names of its entries.

The server hands the method's ``aggregate`` one reply per client that answered, each carrying
``received + mean update`` (:func:`replies_with_mean`) and its own meta, so the method's (weighted) mean of
their arrays is that mean: only methods whose aggregate needs nothing else run under ``--secagg``
(``Method.secagg``). ``--dp client`` composes: each client clips its update before it is masked, and the
server's noise goes on the securely aggregated sum.

On the Flower engine the protocol runs for real (``fedlt.engine.flower.secagg``). The in-process engines
simulate its effect with Flower's own functions (:func:`secure_mean`): the same weighting, clipping, stochastic
rounding (from the run seed, as on the SuperNodes) and modular sum, less the masks, which cancel exactly in that
sum; so for the same settings both engines give the same numbers, and the same refusals.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..errors import ConfigError

MODULUS = 2 ** 32  # Flower's modulus_range, its default and largest: the masked sums are taken modulo this
MIN_CLIENTS = 3  # SecAgg+ splits each client's secrets into at least 3 shares (flwr: num_shares > 2)


def import_secagg_arithmetic() -> Any:
    """Flower's SecAgg+ arithmetic (``flwr.common.secure_aggregation``), or a one-line error that says how to
    install it."""
    try:
        from flwr.common.secure_aggregation import ndarrays_arithmetic, quantization
    except ImportError:
        raise ConfigError("--secagg runs Flower's SecAgg+ (its arithmetic also in the simulator): pip install "
                          "'fedlt[flower]'") from None
    return quantization, ndarrays_arithmetic


@dataclass(frozen=True)
class RoundParams:
    """SecAgg+'s parameters for one round, as ``SecAggPlusWorkflow`` takes them."""

    shares: int  # num_shares: each client's secrets go to this many neighbours (itself included)
    threshold: int  # reconstruction_threshold: shares that rebuild a secret
    max_weight: float  # max_weight: the weight that maps to the full quantisation range
    clip_range: float  # clipping_range
    levels: int  # quantization_range


HOOKS = ("aggregate", "sends")  # what ``Method.secagg`` vouches for: a class that changes one declares it again


def runs_under(cls) -> bool:
    """Whether method class ``cls`` runs under ``--secagg``: its ``secagg`` (:func:`fedlt.core.method.declares`)."""
    from .method import declares

    return declares(cls, "secagg", HOOKS)


def why_not(cls) -> str:
    """Why method class ``cls``'s server needs more than the mean of the replies, in words: its own
    ``secagg_refusal`` where it gives one."""
    if why := getattr(cls, "secagg_refusal", ""):
        return why
    extra = [f"{s.name} ({s.category}{', phase ' + s.when if s.when != 'rounds' else ''})"
             for s in getattr(cls, "sends", ()) if s.category not in ("model", "size", "scalars")]
    return f"its clients also send {', '.join(extra)}" if extra else "its server reads each client's reply"


def default_threshold(shares: int) -> int:
    """``--secagg-threshold`` unset: a strict majority of the shares (2 of 3), so that no minority of a client's
    neighbours can rebuild its secrets, and up to ``shares - threshold`` of them may drop out."""
    return shares // 2 + 1


def fits(clients: int, levels: int) -> bool:
    """Whether the modular sum of ``clients`` quantised vectors (each entry at most ``levels``) and their weights
    stays below Flower's modulus (else it wraps round and the mean is garbage)."""
    return clients * levels < MODULUS


class SecAgg:
    """The run's ``--secagg`` settings; per round, the protocol's parameters (:meth:`round_params`) and, for the
    in-process engines, what SecAgg+ would hand the server (:meth:`simulate`)."""

    def __init__(self, shares: int | None, threshold: int | None, clip_range: float, levels: int,
                 max_weight: float | None, uniform: bool):
        import_secagg_arithmetic()
        self.shares, self.threshold = shares, threshold
        self.clip_range, self.levels, self.max_weight = float(clip_range), int(levels), max_weight
        self.uniform = uniform  # --dp client: every client sends num_examples 1

    @classmethod
    def of(cls, cfg) -> "SecAgg":
        """The run's ``--secagg`` from its settings (``cfg``: the engine's, every ``secagg_*`` setting by its
        declared name; under ``--dp client`` every client weighs 1)."""
        return cls(cfg.secagg_shares, cfg.secagg_threshold, cfg.secagg_clip_range, cfg.secagg_levels,
                   cfg.secagg_max_weight, uniform=cfg.dp == "client")

    def round_params(self, clients: int, largest: int) -> RoundParams | str:
        """The round's parameters for ``clients`` clients, the largest of which has ``largest`` training samples
        (the default max weight; 1 under ``--dp client``); or why SecAgg+ cannot run the round (a Poisson-sampled
        round of too few clients), which then aggregates nothing, as Flower's workflow halts."""
        shares = min(self.shares or clients, clients)
        threshold = self.threshold or default_threshold(shares)
        if clients < MIN_CLIENTS or not threshold < shares:
            return (f"SecAgg+ needs at least {max(MIN_CLIENTS, threshold + 1)} clients in a round, this one has "
                    f"{clients}: not aggregated")
        if not fits(clients, self.levels):
            return (f"SecAgg+'s sum of {clients} clients at {self.levels} levels would pass the modulus 2^32: not "
                    f"aggregated")
        weight = self.max_weight if self.max_weight is not None else (1.0 if self.uniform else float(largest))
        return RoundParams(shares, threshold, float(weight), self.clip_range, self.levels)

    def simulate(self, payloads: dict, replies: list, largest: int,
                 seed_of: Callable[[int], int]) -> tuple[list, dict[int, str]]:
        """The replies of a training round as the server sees them under SecAgg+ (:func:`replies_with_mean`), and
        the clients whose replies it could not aggregate (all of them in a round it halts); ``seed_of(cid)``: the
        seed of that client's stochastic rounding, as its SuperNode would draw it."""
        if not replies:
            return replies, {}
        p = self.round_params(len(replies), largest)
        if isinstance(p, str):
            return [], {c: p for c, _ in replies}
        keys = masked_keys(replies[0][1].arrays)
        updates, kept, why = [], [], {}
        for cid, r in replies:
            if masked_keys(r.arrays) != keys:
                raise ConfigError(f"--secagg: client {cid} sends other entries than client {replies[0][0]}; SecAgg+ "
                                  f"sums vectors of one shape, so this method cannot run under --secagg")
            update = update_of(payloads[cid].arrays, r.arrays, f"client {cid}")
            if (wrong := not_finite(update, f"client {cid}")) is not None:  # its SuperNode refuses to mask it
                why[cid] = wrong
                continue
            updates.append(vector(update, keys))
            kept.append((cid, r))
        if len(kept) < p.threshold:  # SecAgg+ goes on without clients that failed while enough shares are left
            halted = (f"SecAgg+ halted: {len(kept)} of the round's clients sent a vector, fewer than the threshold "
                      f"{p.threshold}; the round is not aggregated")
            return [], {**{c: halted for c, _ in kept}, **why}
        mean = secure_mean(updates, [r.meta["num_examples"] for _, r in kept], p, [seed_of(c) for c, _ in kept])
        return replies_with_mean({c: payloads[c].arrays for c, _ in kept}, kept, dict(zip(keys, mean))), why


def masked_keys(arrays: dict[str, torch.Tensor]) -> list[str]:
    """The entries a reply sends masked, in its order: the floating-point ones (the others go back as received)."""
    return [k for k, v in arrays.items() if v.is_floating_point()]


def update_of(received: dict[str, torch.Tensor], arrays: dict[str, torch.Tensor],
              who: str) -> dict[str, torch.Tensor]:
    """A reply's update, ``sent - received`` in float64, for each floating-point entry it sends. An entry it sends
    that it did not receive is a one-line error (its update has no reference the server knows)."""
    from .dp import delta_of, unreceived

    if (extra := unreceived(received, arrays)) is not None:
        raise ConfigError(f"--secagg: {who} sends {extra}, which it did not receive: SecAgg+ sums updates to what the "
                          f"server sent; this method cannot run under --secagg")
    return delta_of(received, arrays)  # the masked entries (masked_keys), in their order


def not_finite(update: dict[str, torch.Tensor], who: str) -> str | None:
    """Why an update cannot be masked (an entry that is not finite: its training diverged; quantised, it would
    turn into a wrong finite number in the sum), or None."""
    bad = next((k for k, v in update.items() if not bool(torch.isfinite(v).all())), None)
    return None if bad is None else f"--secagg: {who}'s update is not finite ({bad}): its training diverged, and " \
                                    f"SecAgg+ would sum it as a wrong finite number"


def vector(update: dict[str, torch.Tensor], keys: list[str]) -> list[np.ndarray]:
    """An update as the list of numpy arrays SecAgg+ masks (Flower's legacy ``Parameters``), in ``keys`` order; a
    0-d entry as an array of one (Flower's unmasking adds its offsets in place, which a numpy scalar would skip;
    :func:`replies_with_mean` gives it its shape back)."""
    return [np.atleast_1d(update[k].detach().cpu().numpy()) for k in keys]


@contextmanager
def numpy_seeded(seed: int | None):
    """numpy's global generator seeded with ``seed`` (None: left as it is), and put back as it was afterwards.
    Flower's stochastic rounding draws from it; SecAgg+'s keys, secrets and shares do not (``cryptography``,
    ``os.urandom``, PyCryptodome), nor its masks (a generator of their own)."""
    saved = np.random.get_state()
    if seed is not None:
        np.random.seed(int(seed) % 2 ** 32)
    try:
        yield
    finally:
        np.random.set_state(saved)


def client_vector(update: list[np.ndarray], weight: float, p: RoundParams) -> tuple[int, list[np.ndarray]]:
    """(the quantised weight, the quantised weighted update): what ``secaggplus_mod`` computes before it adds the
    masks (flwr 1.42 ``_collect_masked_vectors``), with Flower's functions. The stochastic rounding draws from
    numpy's global generator (seed it first: :func:`numpy_seeded`)."""
    quantization, arith = import_secagg_arithmetic()
    q_ratio = round(weight / p.max_weight * p.levels)
    weighted = arith.parameters_multiply(update, q_ratio / p.levels)
    return q_ratio, quantization.quantize(weighted, p.clip_range, p.levels)


def secure_mean(updates: list[list[np.ndarray]], weights: list[float], p: RoundParams,
                seeds: list[int]) -> list[np.ndarray]:
    """What SecAgg+ hands the server for ``updates`` (each a list of arrays) weighted by ``weights``: each
    client's vector as :func:`client_vector` makes it (its rounding seeded with its ``seeds`` entry), their sum
    modulo 2^32 -- the masks, which cancel in that sum, left out -- and the server's unmasking arithmetic (flwr 1.42
    ``SecAggPlusWorkflow.unmask_stage``): dequantise, remove the clients' offsets, divide by the summed weights."""
    quantization, arith = import_secagg_arithmetic()
    total = None
    for update, weight, seed in zip(updates, weights, seeds):
        with numpy_seeded(seed):
            q_ratio, q = client_vector(update, weight, p)
        vec = [a.astype(np.int64) for a in arith.factor_combine(q_ratio, q)]
        total = vec if total is None else arith.parameters_addition(total, vec)
    total = arith.parameters_mod(total, MODULUS)
    q_total, recon = arith.factor_extract(total)
    out = quantization.dequantize(recon, p.clip_range, p.levels)
    offset = -(len(updates) - 1) * p.clip_range
    for v in out:
        v += offset
        v *= p.levels / q_total
    return out


def error_bound(updates: list[list[np.ndarray]], weights: list[float], p: RoundParams) -> float:
    """A bound on how far :func:`secure_mean` lies from the exact ``weights``-weighted mean, per entry, where no
    weighted entry is clipped: each client's stochastic rounding moves its weighted entry by less than one level
    ``2 R / T``, and rounding its weight to ``dq`` (within ``1 / 2T`` of ``n / W``) moves the mean by at most
    ``(m / T) max |Delta|``; both over the summed weights ``sum dq``."""
    m = len(updates)
    dq = sum(round(w / p.max_weight * p.levels) for w in weights) / p.levels
    biggest = max(float(np.max(np.abs(a))) if a.size else 0.0 for u in updates for a in u)
    return (m * 2 * p.clip_range / p.levels + m * biggest / p.levels) / dq


def replies_with_mean(received: dict[int, dict[str, torch.Tensor]], replies: list,
                      mean: dict[str, torch.Tensor | np.ndarray]) -> list:
    """The round's replies as the server sees them under SecAgg+: each client's ``received + mean update`` on the
    masked entries (integer entries as received, dtypes as received), with the meta it sent in
    the clear. Any (weighted) mean of them is the securely aggregated mean."""
    from .method import Message

    out = []
    for cid, r in replies:
        base = received[cid]
        arrays = {}
        for k in r.arrays:
            if k not in mean:
                arrays[k] = base[k]
                continue
            m = torch.as_tensor(np.asarray(mean[k]), dtype=torch.float64, device=base[k].device)
            arrays[k] = (base[k].to(torch.float64) + m.reshape(base[k].shape)).to(base[k].dtype)
        out.append((cid, Message(arrays, dict(r.meta))))
    return out


def largest_client(sizes, cids) -> int:
    """The largest training set among clients ``cids`` (``sizes``: every client's), at least 1."""
    return max([int(sizes[c]) for c in cids] + [1])
