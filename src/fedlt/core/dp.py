"""Client-level differential privacy: DP-FedAvg (McMahan, Ramage, Talwar and Zhang, ICLR 2018), ``--dp client``.

Every round the server samples each client independently with probability ``q`` (Poisson sampling: the
sampling the accountant assumes; ``q`` = the run's clients per round / its clients, so a round trains ``q K``
clients on average, not exactly). A sampled client trains as its method says, then, before its reply leaves it:

- its update ``Delta = w_client - w_received`` (every floating-point entry of the model it received and sends
  back) is clipped to L2 norm ``C`` (``--dp-clip``): ``Delta * min(1, C / ||Delta||)``;
- its integer entries (BatchNorm's ``num_batches_tracked``: a count of its steps, so of its data) go back as
  received, and its statistics (losses, steps, the number of its samples) are not sent: every client weighs 1.

The server adds Gaussian noise to the sum of the clipped updates, ``N(0, (z C)^2 I)`` (``z``: ``--dp-noise``, or
solved from ``--dp-epsilon``), and divides by the fixed denominator ``q K`` (McMahan et al.'s estimator
``f_f``: the sensitivity of the sum to one client is ``C`` whatever the round's count; uniform weights, as theirs
when every client's weight is bounded by 1). The method's own aggregation then sees replies whose uniform mean
is exactly ``w + (sum Delta_i + noise) / (q K)``, so any method whose server takes a mean of the model's
entries (FedAvg, FedProx, FedAvgM, FedAdam, ...) runs unchanged.

The privacy loss: the RDP accountant of Google's ``dp-accounting`` library (the one Flower's DP uses), composing
one ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` per round, add/remove-one-client adjacency, converted to
``(epsilon, delta)``; or, with ``--dp-accountant pld``, the same library's privacy-loss-distribution accountant on
the same events (a tighter epsilon: 7.04 where RDP says 7.98 at ``z`` 1.217, ``q`` 0.1, 200 rounds, delta 1e-5; so
``--dp-epsilon`` solves a smaller noise). The summary's ``dp`` table holds every input, so anyone can recompute it
with the same library (:func:`epsilon`).

Adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy, NeurIPS 2021; ``--dp-clip-quantile Q``): the clip
follows the ``Q`` quantile of the update norms. Each sampled client also sends one bit, ``b = [||Delta|| <= C]``;
the server adds ``N(0, s^2)`` to their sum (``s``: ``--dp-count-noise``, default the expected clients a round / 20,
the paper's), divides by the fixed denominator and moves the clip geometrically,
``C <- C exp(-lr (b_noised - Q))`` (``lr``: ``--dp-clip-lr``, 0.2). Both releases are Gaussian mechanisms on the
same sampled clients; the bit's sensitivity is 1/2 once centred, so the round is one Gaussian mechanism of
multiplier ``z`` when the update's noise is ``z_u = (z^-2 - (2 s)^-2)^-1/2`` (the paper's Theorem 1): the
accountant composes ``z`` as for a fixed clip and the update gets the (larger) ``z_u``. ``--dp-clip`` is the first
round's clip; the clip is part of the checkpoint. (flwr 1.42's ``DifferentialPrivacy*AdaptiveClipping`` count the
*clipped* updates in the same update rule, which moves the clip the other way from the paper's; fedlt follows the
paper.)

Where the clipping runs: in the simulator's exchange (:meth:`ClientDP.client_side`, as the client would); on the
Flower engine in the ClientApp itself (:func:`client_reply` with the clipping bit, :func:`phase_reply`), so the server
never holds an unclipped update, and the server's :meth:`ClientDP.arrived` checks each reply instead of clipping it
(one that is not within the clip is not used). The noise, the clip's update and the accountant are the server's on
both.

What the guarantee covers: the model update, and what a method declares privatised beside it (``Sent.dp``):

- ``update``: an entry outside the model that the client received and sends back and the server averages
  (RedGrape's supplementary classifier ``sup.*``): clipped and noised as part of the update;
- ``class-mean``: per-class arrays ``PREFIX.*`` keyed by the class ids ``PREFIX.classes``, of which the server needs
  per class the mean over the clients that hold the class (:func:`fedlt.core.classgrad.mean_class_grads`: CReFF's
  and CLIP2FL's real-feature gradients, RedGrape's gradient prototypes). Each client clips its arrays together to
  L2 norm ``C_s`` (``--dp-stats-clip``; its class ids stay as they are). The server sums them per class over all
  ``C`` classes (zero where a client lacks the class) and adds ``N(0, (z_r C_s)^2)`` to each sum, counts the clients
  holding each class and adds ``N(0, (z_r sqrt(C))^2)`` to each count (one client's indicator vector has L2 norm at
  most ``sqrt(C)``), keeps the classes whose noised count is at least 1 and rewrites the replies so that the
  method's own per-class mean is the noised sum over the noised count: the method runs unchanged.

Every release of a round (the update, adaptive clipping's count, each class-mean's sums and counts) is a Gaussian
mechanism on the same sampled clients, so the round is one Gaussian mechanism whose multiplier ``z`` satisfies
``z^-2 = sum_i z_i^-2`` (``z_i``: a release's noise std over its sensitivity). The accountant composes ``z`` as for
the update alone; the ``r`` releases other than the clipping count share what the count leaves equally,
``z_r = sqrt(r) (z^-2 - (2 s)^-2)^-1/2`` (:func:`update_noise`): each is noisier than the update alone would be.
Anything else a method's clients send (class counts, prototypes, features: ``Method.sends``) is refused with one
line naming what would leave unprotected (:func:`unprotected`).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ..errors import ConfigError
from .noise import NOISE_SEEDS
from .privacy import ANY, CLASS_MEAN, CLIENT_MECHANISMS, DERIVED, MODEL, ROUNDS, UPDATE

# Which method classes run under --dp sample (DP-SGD, fedlt.core.dpsgd): declared here, below the DP-SGD trainer, so
# that the refusals of this module read them without importing it.
HOOKS = ("init_client", "local_steps", "local_train", "local_reply")  # a class changing one declares again
COUNTS = "counts"  # dp_sample's value for a loss that also reads the client's class counts


def runs_dp_sgd(cls) -> bool:
    """Whether method class ``cls`` runs under ``--dp sample``: the nearest class of its MRO that sets
    ``dp_sample`` says so, unless a class below it changes a client hook (:data:`HOOKS`) without setting it again."""
    from .method import declares

    return declares(cls, "dp_sample", HOOKS)


def reads_counts(cls) -> bool:
    """Whether method class ``cls`` runs under ``--dp sample`` with a loss that reads the client's class counts
    (``dp_sample = "counts"``): its clients' counts are then noised once
    (:meth:`fedlt.core.dpsgd.DPSGD.client_data`)."""
    from .method import declared_value

    return declared_value(cls, "dp_sample", HOOKS) == COUNTS


# integer RDP orders (fractional ones make dp-accounting's series fail to converge at large sampling rates)
ORDERS = tuple(range(2, 256)) + (256, 512, 1024)
STATS_CLIP = 1.0  # --dp-stats-clip's default: the norm a client's class-mean arrays are clipped to


def import_dp_accounting() -> Any:
    """The dp-accounting package, or a one-line error that says how to install it."""
    try:
        import dp_accounting
        from dp_accounting import rdp  # noqa: F401
    except ImportError:
        raise ConfigError("--dp needs the dp-accounting package (its RDP accountant): pip install "
                          "'fedlt[privacy]'") from None
    return dp_accounting


PLD_INTERVAL = 1e-3  # the PLD accountant's discretisation: its epsilons agree with 1e-4's to 1e-4, ten times faster
ACCOUNTANTS = {"rdp": "rdp.RdpAccountant (orders 2-255, 256, 512, 1024)",
               "pld": f"pld.PLDAccountant (value_discretization_interval {PLD_INTERVAL:g})"}


def fresh_accountant(accountant: str = "rdp"):
    """A new dp-accounting accountant: its RdpAccountant over :data:`ORDERS` (``rdp``), or its privacy-loss-distribution
    accountant (``pld``). The one accountant library of both levels (``--dp client`` and ``--dp sample``)."""
    import_dp_accounting()
    if accountant == "pld":
        from dp_accounting import pld

        return pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
    from dp_accounting import rdp

    return rdp.RdpAccountant(list(ORDERS))


def gaussian_steps(history) -> Any:
    """The dp-accounting event of a history of Poisson-sampled Gaussian mechanisms ``[(noise multiplier, sampling
    rate, times)]`` (a round of ``--dp client``, a DP-SGD step of ``--dp sample``), composed in order."""
    dpa = import_dp_accounting()
    return dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(float(q), dpa.GaussianDpEvent(
        float(z))), int(n)) for z, q, n in history if n > 0])


def calibrated(target: float, delta: float, history_of, accountant: str = "rdp", tol: float = 1e-6) -> float:
    """The smallest noise multiplier ``z`` (within ``tol``) whose history ``history_of(z)`` is (``target``,
    ``delta``)-DP by ``accountant``: dp-accounting's ``calibrate_dp_mechanism``; None where no noise below
    2^30 meets it."""
    import_dp_accounting()
    from dp_accounting import mechanism_calibration as mc

    try:
        return float(mc.calibrate_dp_mechanism(lambda: fresh_accountant(accountant),
                                               lambda z: gaussian_steps(history_of(z)), target, delta, tol=tol))
    except mc.NoBracketIntervalFoundError:
        return None


@functools.lru_cache(maxsize=4096)
def epsilon(noise: float, rate: float, rounds: int, delta: float, accountant: str = "rdp") -> float:
    """The epsilon after ``rounds`` rounds of Poisson-sampled (``rate``) Gaussian noise of multiplier ``noise``,
    for ``delta``: dp-accounting's RdpAccountant over :data:`ORDERS` (``rdp``), or its privacy-loss-distribution
    accountant (``pld``: tighter; a tenth of a second a call). 0 rounds: 0."""
    if rounds <= 0:
        return 0.0
    return float(fresh_accountant(accountant).compose(gaussian_steps([(noise, rate, rounds)])).get_epsilon(delta))


DELTA_CAP = 1e-5  # the default delta's ceiling: the delta of Abadi et al. (CCS 2016) and of most DP-SGD reports
DELTA_SHARE = 10  # and at most 1 / (DELTA_SHARE x the units it protects)


def default_delta(units: int) -> float:
    """delta when --dp-delta is not given, for ``units`` protected units (the clients under --dp client; a client's
    samples under --dp sample, :func:`fedlt.core.dpsgd_accounts.sample_delta`): ``min(1e-5, 1 / (10 units))``.

    Why: a mechanism that publishes each unit's data outright with probability delta is (0, delta)-DP, so delta
    must be far below ``1 / units`` to mean anything -- ``units x delta`` is the expected number of units such a
    failure would expose, here at most 0.1 (``1 / units^1.1``, the default before, was 0.079 at 10 clients: the
    expected exposure 0.79). 1e-5, the delta Abadi et al. report with, caps it where ``1 / (10 units)`` is larger
    (below 10,000 units)."""
    return min(DELTA_CAP, 1.0 / (DELTA_SHARE * units))


def delta_problem(delta: float, units: int, unit: str, what: str) -> str | None:
    """Why a given delta is too weak for ``units`` protected units (a ``unit``: "client" or "sample"; ``what``: who
    they are): not below ``1 / units``, where a mechanism that publishes each unit's data with probability delta
    publishes one of them on average; None where it is below."""
    if delta * units < 1:
        return None
    return (f"--dp-delta {delta:g} is not below 1 / {units} = {1 / units:.3g} ({units}: {what}): at that delta a "
            f"mechanism may publish a {unit}'s data outright; use at most {default_delta(units):.3g} (the default "
            f"when --dp-delta is not given)")


@functools.lru_cache(maxsize=64)
def client_noise_multiplier(target: float, rate: float, rounds: int, delta: float, accountant: str = "rdp") -> float:
    """The smallest noise multiplier whose epsilon after ``rounds`` rounds is at most ``target``, by ``accountant``
    (:func:`calibrated`: dp-accounting's ``calibrate_dp_mechanism``)."""
    z = calibrated(target, delta, lambda z: [(z, rate, rounds)], accountant)
    if z is None:
        raise ConfigError(f"--dp-epsilon {target:g} cannot be met in {rounds} rounds at sampling rate "
                          f"{rate:g}: raise it, or train fewer rounds or fewer clients a round")
    return z


def solved_noise(given: float | None, target: float | None, rate: float, rounds: int, delta: float,
                 accountant: str = "rdp") -> float:
    """--dp client's noise multiplier: ``given`` (--dp-noise), else the one solved for ``target`` (--dp-epsilon) over
    ``rounds`` rounds at sampling rate ``rate`` (:func:`client_noise_multiplier`). The run's (:class:`ClientDP`) and its
    validation's (``fedlt.core.privacy_settings``)."""
    return float(given) if given is not None else client_noise_multiplier(target, rate, rounds, delta, accountant)


COUNT_SHARE = 20  # adaptive clipping's count noise by default: the expected clients a round / 20 (Andrew et al.)


def count_noise_of(given: float | None, per_round: float) -> float:
    """The std of the noise on adaptive clipping's count of unclipped updates: ``given`` (--dp-count-noise), else
    Andrew et al.'s default, the expected clients a round / 20."""
    return float(given) if given is not None else per_round / COUNT_SHARE


def release_count(means: tuple[str, ...]) -> int:
    """The releases of a round besides adaptive clipping's count: the update, and each class-mean's sums and
    counts (``means``: the prefixes, :func:`class_means`)."""
    return 1 + 2 * len(means)


def split_problem(noise: float, count_noise: float | None) -> str | None:
    """Why adaptive clipping's count (noise std ``count_noise``; None: a fixed clip) leaves nothing of the round's
    noise multiplier ``noise`` to the other releases (:func:`update_noise`), or None: its noise must exceed half."""
    if count_noise is None or noise == 0 or 2 * count_noise > noise:
        return None
    return (f"adaptive clipping splits the noise multiplier {noise:g} between the update and the count of unclipped "
            f"updates, whose noise {count_noise:g} must exceed half of it; raise --dp-count-noise above "
            f"{noise / 2:g}, or lower the noise (--dp-noise, or a larger --dp-epsilon)")


def update_noise(noise: float, count_noise: float | None = None, releases: int = 1) -> float:
    """The noise multiplier of each of the round's ``releases`` (the update, and each class-mean's sums and counts)
    when together with adaptive clipping's count (noise std ``count_noise``, sensitivity 1/2; None: a fixed clip)
    they make one Gaussian mechanism of multiplier ``noise`` (Andrew et al., Theorem 1: ``noise^-2`` is the sum of
    the releases' ``z^-2``), shared equally. A count noise at most ``noise / 2`` leaves nothing for the rest: a
    one-line error."""
    if (why := split_problem(noise, count_noise)) is not None:
        raise ConfigError(why)
    if noise == 0:
        return 0.0
    rest = noise if count_noise is None else (noise ** -2 - (2 * count_noise) ** -2) ** -0.5
    return rest * math.sqrt(releases)


def covered(s, level: str = "client") -> bool:
    """Whether DP covers a declared item without a mechanism of its own: in the rounds the model's entries (the
    update, clipped and noised, or trained by DP-SGD) and, under ``--dp sample``, a meta value that returns what the
    server sent (``echo``: it rides beside the model); anywhere its size and its training statistics ("*"), which are
    not sent under DP. A named scalar (FedNova's step weight, CLIMB's loss) or an array of another name (SCAFFOLD's
    control-variate change) is something the server reads, which DP would drop or not clip."""
    return (s.category == "size" or (s.category == "scalars" and s.name == ANY)
            or (s.category == "model" and s.name == MODEL and s.when == ROUNDS)
            or (level == "sample" and s.category == "echo" and s.meta and s.when == ROUNDS))


def unprotected(sends, level: str = "client") -> list[str]:
    """What a method's clients send (its ``sends`` declaration) that the guarantee of ``--dp level`` would not
    cover (:func:`covered`), except what it declares privatised in the rounds (``Sent.dp``): for ``client`` an
    update or class-mean mechanism, for ``sample`` an array derived from the model DP-SGD trained."""
    mechanisms = CLIENT_MECHANISMS if level == "client" else (DERIVED,)
    return [f"{s.name} ({s.category}{', phase ' + s.when if s.when != 'rounds' else ''})" for s in sends
            if not covered(s, level) and not (s.dp in mechanisms and s.when == ROUNDS)]


def privatised(sends) -> list[str]:
    """What a method's clients send beside the model that ``--dp client`` privatises (``Sent.dp``), with how."""
    how = {UPDATE: "clipped and noised with it", CLASS_MEAN: "as noised per-class means"}
    return [f"{s.name} ({s.category}, {how[s.dp]})" for s in sends if s.dp in how and s.when == ROUNDS]


POOLED = "trains on the clients' data pooled in one place"  # the refusals' reasons (refusal), said once
UNDECLARED = ("its local training is a loop of its own, or its loss reads statistics of its data other than the "
              "class counts")  # --dp sample's, where the method gives no reason of its own (dp_sample_why_not)


def refusal(cls, level: str) -> tuple[str, list[str]] | None:
    """Why ``--dp level`` (client or sample) does not run method class ``cls``, or None where it does:
    ``("pool", [])`` (it trains on the clients' data pooled in one place), ``("unprotected", items)`` (what its clients
    send that the guarantee would not cover, :func:`unprotected`), ``("server", [why])`` (``--dp client``: what the
    method's server does with each reply that the noised mean does not cover, ``Method.dp_client_refusal``) or
    ``("undeclared", [why])`` (``--dp sample``: its
    local training is not declared DP-SGD-able, :func:`runs_dp_sgd`; ``why``: the method's own reason,
    ``Method.dp_sample_why_not``, where it gives one). The one source of the run's refusals (``fedlt.config``) and of
    :func:`verdict`."""
    if getattr(cls, "needs_pool", False):
        return "pool", []
    if level == "client" and (why := getattr(cls, "dp_client_refusal", "")):
        return "server", [why]
    if left := unprotected(getattr(cls, "sends", ()), level):
        return "unprotected", left
    if level == "sample" and not runs_dp_sgd(cls):
        return "undeclared", [why] if (why := getattr(cls, "dp_sample_why_not", "")) else []
    return None


def verdict(cls, level: str) -> str:
    """Whether ``--dp level`` (client or sample) runs method class ``cls``, in words: "yes, ..." or "no, ..." and
    why (``fedlt list METHOD`` and the method's page), from :func:`refusal`, as the run's validation."""
    why = refusal(cls, level)
    if why is not None:
        return {"pool": f"no, it {POOLED}",
                "unprotected": f"no, its clients also send {', '.join(why[1])}",
                "server": f"no, {''.join(why[1][:1])}",
                "undeclared": f"no, {(why[1] or [UNDECLARED])[0]}"}[why[0]]
    if level == "client":
        also = privatised(getattr(cls, "sends", ()))
        return f"yes, its clients send the model update (clipped and noised) and {', '.join(also)}" if also else \
            "yes, its clients send only the model update (clipped and noised)"
    needs = f", {cls.dp_sample_needs}" if getattr(cls, "dp_sample_needs", "") else ""
    derived = [f"{s.name} ({s.category})" for s in getattr(cls, "sends", ()) if s.dp == DERIVED and s.when == ROUNDS]
    if derived:
        needs = f", and {', '.join(derived)} is computed from the model they train{needs}"
    if reads_counts(cls):
        return ("yes, its described local steps run as DP-SGD, its loss reading the client's class counts noised once "
                f"(--dp-counts-noise, counted in the client's accountant){needs}")
    return f"yes, its described local steps run as DP-SGD{needs}"


def class_means(sends) -> tuple[str, ...]:
    """The prefixes of the per-class arrays a method declares as ``class-mean`` (``Sent.dp``)."""
    return tuple(sorted({s.name.split(".")[0] for s in sends if s.dp == CLASS_MEAN and s.when == ROUNDS}))


def split_stats(arrays: dict[str, torch.Tensor], prefixes) -> tuple[dict, dict]:
    """A reply's arrays as (its class-mean arrays ``PREFIX.*``, the rest)."""
    stats = {k: v for k, v in arrays.items() if k.split(".")[0] in prefixes and "." in k}
    return stats, {k: v for k, v in arrays.items() if k not in stats}


def clip_stats(stats: dict[str, torch.Tensor], clip: float) -> tuple[dict[str, torch.Tensor], float]:
    """Class-mean arrays with their floating-point entries clipped together to L2 norm ``clip`` (the class ids as
    they are), and their norm before clipping."""
    floats = {k: v.to(torch.float64) for k, v in stats.items() if v.is_floating_point()}
    norm = norm_of(floats)
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: (floats[k] * scale).to(v.dtype) if k in floats else v for k, v in stats.items()}, norm


def unreceived(received: dict[str, torch.Tensor], arrays: dict[str, torch.Tensor]) -> str | None:
    """The entries a reply sends that its client did not receive (the first three, named), or None: such an entry's
    update has no reference."""
    extra = sorted(set(arrays) - set(received))
    return f"{', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}" if extra else None


def delta_of(payload_arrays: dict[str, torch.Tensor], arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reply's update in float64: each floating-point entry minus what its client received."""
    return {k: v.to(torch.float64) - payload_arrays[k].to(torch.float64) for k, v in arrays.items()
            if v.is_floating_point()}


def norm_of(deltas: dict[str, torch.Tensor]) -> float:
    """The L2 norm of an update over all its entries."""
    return math.sqrt(sum(float((d * d).sum()) for d in deltas.values()))


def clip_reply(payload_arrays: dict[str, torch.Tensor], arrays: dict[str, torch.Tensor], clip: float,
               who: str) -> tuple[dict[str, torch.Tensor], float]:
    """A client's reply arrays with its update clipped to L2 norm ``clip`` (over every floating-point entry it
    received and sends back) and its other entries as received; and the update's norm before clipping. An entry
    it sends that it did not receive is a one-line error (its update has no reference)."""
    if (extra := unreceived(payload_arrays, arrays)) is not None:
        raise ConfigError(f"--dp client: {who} sends {extra}, which it did not receive: its update cannot be "
                          f"clipped; this method cannot run under --dp client")
    deltas = delta_of(payload_arrays, arrays)
    norm = norm_of(deltas)
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    out = {k: (payload_arrays[k] if k not in deltas else
               (payload_arrays[k].to(torch.float64) + deltas[k] * scale).to(arrays[k].dtype)) for k in arrays}
    return out, norm


UNCLIPPED = "dp_unclipped"  # the clipping bit a client that clips itself sends beside num_examples (1: within the clip)


def client_reply(payload_arrays: dict[str, torch.Tensor], reply, clip: float, who: str, bit: bool = False,
                 means: tuple[str, ...] = (), stats_clip: float = STATS_CLIP):
    """A client's reply as it leaves the client under ``--dp client``: its update clipped (:func:`clip_reply`),
    integer entries as received, its class-mean arrays (prefixes ``means``) clipped to ``stats_clip``
    (:func:`clip_stats`), only ``num_examples`` 1 in its meta -- and with ``bit`` (a client that clips itself:
    Flower's ClientApp) the clipping bit :data:`UNCLIPPED`, ``[||Delta|| <= clip]``, which the server's adaptive
    clipping counts and its record reports. Returns (that message, the update's norm and the class-mean arrays'
    norm before clipping: they stay with the client)."""
    from .method import Message

    stats, rest = split_stats(reply.arrays, means)
    arrays, norm = clip_reply(payload_arrays, rest, clip, who)
    stats, stats_norm = clip_stats(stats, stats_clip)
    return Message({**arrays, **stats}, {"num_examples": 1, **({UNCLIPPED: int(norm <= clip)} if bit else {})}), \
        norm, stats_norm


def phase_reply(phase: str, who: str, reply):
    """A post-training phase's reply as it leaves the client under ``--dp client``: nothing but ``num_examples`` 1
    (what such a phase may send is its size and statistics, :func:`unprotected`); arrays are a one-line error."""
    from .method import Message

    if reply.arrays:
        raise ConfigError(f"--dp client: {who} sends {', '.join(sorted(reply.arrays)[:3])} in phase {phase}, which "
                          f"the guarantee does not cover; this method cannot run under --dp")
    return Message({}, {"num_examples": 1})


def _slack(arrays: dict[str, torch.Tensor]) -> float:
    """The L2 norm of the rounding of ``arrays``' floating-point entries to their dtype (``eps |w|`` each)."""
    floats = [v for v in arrays.values() if v.is_floating_point()]
    return math.sqrt(sum(float(((torch.finfo(v.dtype).eps * v.to(torch.float64)) ** 2).sum()) for v in floats))


def not_clipped(payload_arrays: dict[str, torch.Tensor], reply, clip: float, means: tuple[str, ...] = (),
                stats_clip: float = STATS_CLIP) -> str | None:
    """Why a reply that its client says it clipped (:func:`client_reply` with the bit) is not as it must be, or
    None: its update's norm above ``clip`` (its class-mean arrays' above ``stats_clip``) by more than the rounding
    of its floating-point entries to their dtype (``eps |w|`` each, ``eps`` the dtype's machine epsilon), an
    integer entry other than received, or meta other than ``num_examples`` 1 and the bit."""
    meta = dict(reply.meta)
    bit = meta.pop(UNCLIPPED, None)
    if meta != {"num_examples": 1} or bit not in (0, 1):
        return f"--dp client: its reply carries {', '.join(sorted(reply.meta)) or 'no meta'}, not num_examples 1 " \
               f"and the clipping bit: its SuperNode does not clip (another fedlt?)"
    stats, rest = split_stats(reply.arrays, means)
    if unreceived(payload_arrays, rest) is not None:
        return "--dp client: it sends entries it did not receive, whose update cannot be clipped"
    norm = norm_of(delta_of(payload_arrays, rest))
    if norm > clip + _slack(rest) or any(not torch.equal(v, payload_arrays[k]) for k, v in rest.items()
                                         if not v.is_floating_point()):
        return f"--dp client: its update's norm {norm:.6g} passes the clip {clip:.6g} (or it changed an integer " \
               f"entry): its SuperNode does not clip (another fedlt?)"
    stats_norm = norm_of({k: v.to(torch.float64) for k, v in stats.items() if v.is_floating_point()})
    if stats_norm > stats_clip + _slack(stats):
        return f"--dp client: its class statistics' norm {stats_norm:.6g} passes --dp-stats-clip {stats_clip:.6g}: " \
               f"its SuperNode does not clip them (another fedlt?)"
    return None


def noised_replies(bases: dict[int, dict[str, torch.Tensor]], clipped: dict[int, dict[str, torch.Tensor]],
                   noise: float, clip: float, denominator: float,
                   gen: torch.Generator) -> dict[int, dict[str, torch.Tensor]]:
    """The replies' arrays rewritten so that their uniform mean is ``w + (sum of the clipped updates + N(0,
    (noise clip)^2 I)) / denominator`` (``w``: what each received, ``bases``; the noise drawn once for the round from
    ``gen``, shared out equally between the replies). Integer entries stay as received."""
    m = len(clipped)
    if m == 0:
        return {}
    first = next(iter(clipped))
    keys = [k for k, v in clipped[first].items() if v.is_floating_point()]
    draw = {k: torch.randn(clipped[first][k].shape, generator=gen, dtype=torch.float64) * (noise * clip)
            for k in keys}
    out = {}
    for cid, arrays in clipped.items():
        base = bases[cid]
        row = dict(arrays)
        for k in keys:
            delta = arrays[k].to(torch.float64) - base[k].to(torch.float64)
            row[k] = (base[k].to(torch.float64) + (m / denominator) * (delta + draw[k].to(delta.device) / m)
                      ).to(arrays[k].dtype)
        out[cid] = row
    return out


def noised_class_means(stats: dict[int, dict[str, torch.Tensor]], prefixes: tuple[str, ...], num_classes: int,
                       noise: float, clip: float, gen: torch.Generator) -> dict[int, dict[str, torch.Tensor]]:
    """The replies' class-mean arrays (prefixes ``prefixes``; each reply's clipped to ``clip``) rewritten so that
    the mean over the replies that carry a class (every reply carries every kept class) is, per class ``c``,
    ``(sum_k g_kc + N(0, (noise clip)^2)) / (n_c + N(0, noise^2 num_classes))``: ``g_kc`` a reply's arrays of class
    ``c`` (zero where it lacks the class), ``n_c`` the replies holding ``c``; a class is kept where its noised count
    is at least 1. The noise is drawn from ``gen``, per prefix: its counts, then its arrays in name order."""
    m = len(stats)
    out: dict[int, dict[str, torch.Tensor]] = {cid: {} for cid in stats}
    if m == 0:
        return out
    for p in prefixes:
        ids = f"{p}.classes"
        held = {cid: [int(c) for c in a[ids].tolist()] if ids in a else [] for cid, a in stats.items()}
        count = torch.zeros(num_classes, dtype=torch.float64)
        for cls in held.values():
            count[cls] += 1
        noised = count + torch.randn(num_classes, generator=gen, dtype=torch.float64) * (noise * math.sqrt(num_classes))
        kept = [c for c in range(num_classes) if noised[c] >= 1]
        names = sorted({k for a in stats.values() for k in a if k.split(".")[0] == p and k != ids})
        for cid in stats:
            out[cid][ids] = torch.as_tensor(kept, dtype=torch.long)
        scale = m / noised[kept]  # per kept class: the replies over its noised count
        for k in names:
            like = next(a[k] for a in stats.values() if k in a)
            dense = {cid: torch.zeros((num_classes, *like.shape[1:]), dtype=torch.float64) for cid in stats}
            for cid, a in stats.items():
                if k in a:
                    dense[cid][held[cid]] = a[k].to(torch.float64).cpu()
            draw = torch.randn((num_classes, *like.shape[1:]), generator=gen, dtype=torch.float64) * (noise * clip)
            per = scale.reshape(-1, *[1] * (like.dim() - 1))
            for cid in stats:
                out[cid][k] = (per * (dense[cid][kept] + draw[kept] / m)).to(like.dtype).to(like.device)
    return out


class ClientDP:
    """The run's client-level DP (``--dp client``): the clipping each client applies to its reply, the noise the
    server adds, the sampling rate, and the accountant's epsilon after each round (a function of the rounds
    done, so a resumed run continues it exactly)."""

    def __init__(self, clip: float, noise: float | None, target: float | None, delta: float | None,
                 budget: float | None, population: int, per_round: int, rounds: int, quantile: float | None = None,
                 clip_lr: float = 0.2, count_noise: float | None = None, means: tuple[str, ...] = (),
                 num_classes: int = 0, stats_clip: float | None = None, accountant: str = "rdp",
                 key: str | None = None, source: str = ""):
        import_dp_accounting()
        self.clip, self.population, self.rounds = float(clip), int(population), int(rounds)
        self.key = key  # --dp-noise-seed secret: the server's noise key (None: the noise follows from the run's seed)
        self.source = source  # where the noise comes from, in words (core.noise.noise_source)
        self.first_clip = self.clip
        self.rate = per_round / population
        self.delta = float(delta) if delta is not None else default_delta(population)
        self.accountant = accountant
        self.noise = solved_noise(noise, target, self.rate, rounds, self.delta, accountant)
        self.target, self.budget = target, budget
        self.denominator = self.rate * population  # McMahan et al.'s fixed denominator qW (uniform weights)
        # adaptive clipping: the target quantile, the clip's learning rate, the count's noise and the update's share
        self.quantile, self.clip_lr = quantile, float(clip_lr)
        self.count_noise = None if quantile is None else count_noise_of(count_noise, per_round)
        # class-mean statistics (core.privacy.CLASS_MEAN): clipped to stats_clip, their sums and counts noised
        self.means, self.num_classes = tuple(means), int(num_classes)
        self.stats_clip = float(stats_clip) if stats_clip is not None else STATS_CLIP
        self.releases = release_count(self.means)
        self.update_noise = update_noise(self.noise, self.count_noise, self.releases)
        self.stats_norms: list[float] = []  # the round's class-mean norms before clipping (the simulator)
        self.bases: dict[int, dict] = {}  # the round's replies' references: what each client received
        self.used = self.clip  # the round's clip (adaptive clipping moves self.clip for the next one)
        self.unclipped: list[bool] = []  # the round's clipping bits: each update within the clip
        self.norms: list[float] = []  # its norms before clipping, where the server sees them (the simulator)
        self._epsilons: dict[int, float] = {}  # by rounds done (the budget check and the round's record ask alike)

    @classmethod
    def of(cls, cfg, method, population: int, per_round: int) -> "ClientDP":
        """The run's client-level DP from its settings (``cfg``: the engine's, ``fedlt.engine.driver.EngineConfig``,
        every ``dp_*`` setting by its declared name) and the method (the class-mean arrays its clients send,
        its classes)."""
        from .noise import noise_key, noise_source

        return cls(cfg.dp_clip, cfg.dp_noise, cfg.dp_epsilon, cfg.dp_delta, cfg.dp_budget, population, per_round,
                   cfg.rounds, quantile=cfg.dp_clip_quantile, clip_lr=cfg.dp_clip_lr, count_noise=cfg.dp_count_noise,
                   means=class_means(method.sends), num_classes=method.spec.num_classes, stats_clip=cfg.dp_stats_clip,
                   accountant=cfg.dp_accountant, key=noise_key(cfg, cfg.deployed),
                   source=noise_source(cfg, "client", cfg.deployed))

    def client_side(self, payloads: dict, replies: list) -> list:
        """Each reply as its client sends it under DP: the update clipped, integer entries as received, only
        ``num_examples`` 1 in its meta (every client weighs 1; its statistics stay with it)."""
        self.bases, self.norms, self.unclipped, self.used, self.stats_norms = {}, [], [], self.clip, []
        out = []
        for cid, reply in replies:
            base = payloads[cid].arrays
            message, norm, stats_norm = client_reply(base, reply, self.clip, f"client {cid}", means=self.means,
                                                     stats_clip=self.stats_clip)
            self.bases[cid] = base
            self.norms.append(norm)
            if self.means:
                self.stats_norms.append(stats_norm)
            self.unclipped.append(norm <= self.clip)
            out.append((cid, message))
        return out

    def arrived(self, payloads: dict, replies: list, phase: str | None = None) -> tuple[list, dict[int, str]]:
        """The replies of clients that clipped their updates themselves (Flower's ClientApp: :func:`client_reply`
        with the bit), checked (:func:`not_clipped`) instead of clipped, their bits kept and taken out of their
        meta, so that the rest of the round sees what :meth:`client_side` gives; and the replies not used, with
        why. The norms before clipping stay on the clients (the record's ``dp_update_norm`` is None). A phase's
        replies: as :meth:`phase_side` gives them."""
        from .method import Message

        if phase is not None:
            return self.phase_side(phase, replies), {}

        self.bases, self.norms, self.unclipped, self.used, self.stats_norms = {}, [], [], self.clip, []
        out, why = [], {}
        for cid, reply in replies:
            base = payloads[cid].arrays
            if (wrong := not_clipped(base, reply, self.clip, self.means, self.stats_clip)) is not None:
                why[cid] = wrong
                continue
            self.bases[cid] = base
            self.unclipped.append(bool(reply.meta[UNCLIPPED]))
            out.append((cid, Message(reply.arrays, {"num_examples": 1})))
        return out, why

    def phase_side(self, phase: str, replies: list) -> list:
        """A post-training phase's replies as their clients send them under DP (:func:`phase_reply`; the server's
        phase step of such a method reads neither its size nor its statistics -- FedLoGe's GA-FR and LA-FR, the
        fine-tuning of FedBABU, FedDr+, DR and FedETF's personalisation)."""
        return [(cid, phase_reply(phase, f"client {cid}", reply)) for cid, reply in replies]

    def server_side(self, replies: list, gen: torch.Generator) -> list:
        """The replies whose uniform mean is the received model plus the noised sum of the clipped updates over
        the fixed denominator, and whose class-mean arrays give the noised per-class means
        (:func:`noised_class_means`)."""
        from .method import Message

        parts = {c: split_stats(r.arrays, self.means) for c, r in replies}
        rows = noised_replies(self.bases, {c: rest for c, (_, rest) in parts.items()}, self.update_noise, self.clip,
                              self.denominator, gen)
        if self.quantile is not None:  # the noised share of unclipped updates moves the next round's clip
            unclipped = sum(self.unclipped)
            noised = (unclipped + float(torch.randn((), generator=gen, dtype=torch.float64)) * self.count_noise) \
                / self.denominator
            self.clip *= math.exp(-self.clip_lr * (noised - self.quantile))
        if self.means:
            stats = noised_class_means({c: s for c, (s, _) in parts.items()}, self.means, self.num_classes,
                                       self.update_noise, self.stats_clip, gen)
            rows = {c: {**row, **stats[c]} for c, row in rows.items()}
        return [(c, Message(rows[c], r.meta)) for c, r in replies]

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the clip (adaptive clipping moves it every round) and the secret noise key, so
        that a resumed run draws the noise the uninterrupted one would (a round run again sends nothing new)."""
        return {"clip": self.clip, **({} if self.key is None else {"key": self.key})}

    def load_state_dict(self, d: dict) -> None:
        self.clip = float(d.get("clip", self.clip))
        if self.key is not None and "key" in d:
            self.key = str(d["key"])

    def epsilon(self, rounds: int) -> float:
        if rounds not in self._epsilons:
            self._epsilons[rounds] = epsilon(self.noise, self.rate, rounds, self.delta, self.accountant)
        return self._epsilons[rounds]

    def over_budget(self, rnd: int) -> str | None:
        """Why round ``rnd`` may not run (its epsilon would pass ``--dp-budget``), or None."""
        if self.budget is None:
            return None
        eps = self.epsilon(rnd)
        if eps <= self.budget:
            return None
        return (f"stopped before round {rnd}: its epsilon {eps:.3g} would pass --dp-budget {self.budget:g} "
                f"(epsilon after round {rnd - 1}: {self.epsilon(rnd - 1):.3g})")

    def record(self) -> dict:
        """The round's DP fields of metrics.jsonl: the share of updates clipped, their median norm before clipping
        (None where the clients clipped them: :meth:`arrived`)."""
        n, m = len(self.unclipped), len(self.norms)
        clipped = sum(x > self.used for x in self.norms) if m else sum(not b for b in self.unclipped)
        s = len(self.stats_norms)
        return {"dp_clipped": clipped / n if n else 0.0,
                "dp_update_norm": float(sorted(self.norms)[m // 2]) if m else None,
                **({} if self.quantile is None else {"dp_clip": self.used}),
                **({} if not self.means else {
                    "dp_stats_clipped": sum(x > self.stats_clip for x in self.stats_norms) / s if s else None,
                    "dp_stats_norm": float(sorted(self.stats_norms)[s // 2]) if s else None})}

    def table(self, rounds: int) -> dict:
        """summary.json's ``dp``: the privacy loss and every input of the accountant, to recompute it."""
        from importlib.metadata import version

        return {"epsilon": self.epsilon(rounds), "delta": self.delta, "noise_multiplier": self.noise,
                "sample_rate": self.rate, "rounds": rounds, "scheme": "poisson", "population": self.population,
                "expected_per_round": self.denominator, "clip": self.first_clip,
                **({} if self.quantile is None else {
                    "clipping": "adaptive (Andrew et al. 2021)", "clip_quantile": self.quantile,
                    "clip_lr": self.clip_lr, "count_noise": self.count_noise, "update_noise": self.update_noise,
                    "last_clip": self.clip}),
                **({} if not self.means else {
                    "class_means": list(self.means), "num_classes": self.num_classes, "stats_clip": self.stats_clip,
                    "releases": self.releases, "release_noise": self.update_noise,
                    "class_mean_noise": "per class: N(0, (release_noise stats_clip)^2) on each sum, N(0, "
                                        "release_noise^2 num_classes) on the count of clients holding it"}),
                "weighting": "uniform (every client 1), fixed denominator sample_rate x population",
                "adjacency": "add or remove one client", "target_epsilon": self.target,
                "noise_seed": NOISE_SEEDS["run" if self.key is None else "secret"],
                **({"noise_source": self.source} if self.source else {}),
                "accountant": f"dp-accounting {version('dp-accounting')} {ACCOUNTANTS[self.accountant]}, "
                              f"PoissonSampledDpEvent(sample_rate, GaussianDpEvent(noise_multiplier)) composed rounds "
                              f"times, get_epsilon(delta)"}
