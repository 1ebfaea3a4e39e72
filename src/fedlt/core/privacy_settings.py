"""The privacy settings of a run -- client- and sample-level differential privacy (``--dp``: :mod:`fedlt.core.dp`,
:mod:`fedlt.core.dpsgd`) and secure aggregation (``--secagg``: :mod:`fedlt.core.secagg`) -- declared once, here in
the layer of the mechanisms that read them, with their relations.

``fedlt.config.RunConfig`` includes each setting (``decl.declared_in``), as it includes
:class:`~fedlt.core.spec.RunSpec`'s, and checks :func:`relations` with the others. A relation needs the method of
a configuration (what its clients send, whether DP-SGD runs it) and how many worker processes it runs: both are the
settings layer's to resolve (a method file, the cores), so :func:`relations` takes them as functions of the
configuration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..decl import FLOAT32_MAX, GIVEN, INT32, Relation, applies_when, requires, setting, words
from ..registry import METHODS
from . import secagg
from .dp import (COUNT_SHARE, POOLED, STATS_CLIP, UNDECLARED, class_means, count_noise_of, default_delta,
                 delta_problem, epsilon, privatised, reads_counts, refusal, release_count, solved_noise, split_problem,
                 update_noise)
from .dpsgd import COUNTS_NOISE
from .spec import clients_per_round

PRIVACY = "privacy"  # the settings' group (help, tables)
# the settings that apply only with --dp, --dp client or --secagg (Decl.only_with: decl generates their relations);
# a client-level one's second bad example runs --dp sample (ON_*: the smallest runs at each level, for bad examples)
ON_CLIENT, ON_SAMPLE = ({"dp": level, "dp_clip": 1.0, "dp_noise": 1.0} for level in ("client", "sample"))
DP_ON, SECAGG_ON = ("dp", ("client", "sample")), ("secagg", (True,))
DP_CLIENT = ("dp", ("client",), ON_SAMPLE)


def _zero_noise_hint(z: float) -> str:
    """--dp-noise 0 (refused on the command line and in fedlt.run alike): what to give instead."""
    return ("noise 0 would be clipping without any guarantee (an infinite epsilon); for clipping alone give a tiny "
            "noise such as 1e-6, whose epsilon says what it protects") if z == 0 else ""


@dataclass
class PrivacySettings:
    """The settings of ``--dp`` and ``--secagg``, each declared once (:func:`fedlt.decl.setting`); the engine reads
    them (``reads=("engine",)``: ``fedlt.engine.driver.EngineConfig``)."""

    # differential privacy (core.dp, core.dpsgd, docs/differential-privacy.md)
    dp: str = setting("off", "differential privacy: client (DP-FedAvg: each client's update clipped, Gaussian "
                             "noise on their sum, Poisson sampling, an RDP accountant), sample (DP-SGD on each "
                             "client with opacus: per-sample gradients clipped and noised, an RDP accountant per "
                             "client) or off", choices=("off", "client", "sample"), group=PRIVACY, reads=("engine",))
    dp_clip: float | None = setting(None, "--dp client: the L2 norm each client's update is clipped to; --dp "
                                          "sample: each sample's gradient", low=0, low_open=True, metavar="C",
                                    group=PRIVACY, reads=("engine",), none_means="required with --dp", only_with=DP_ON)
    dp_noise: float | None = setting(None, "the noise multiplier z (--dp client: noise std z x clip on the sum of "
                                           "the updates; --dp sample: on each step's sum of per-sample gradients)",
                                     low=0, low_open=True, metavar="Z", group=PRIVACY, reads=("engine",),
                                     hint=_zero_noise_hint, none_means="solved from --dp-epsilon", only_with=DP_ON)
    dp_epsilon: float | None = setting(None, "the epsilon the whole run may spend; the noise is solved for it (--dp "
                                             "client: for the rounds and the sampling rate; --dp sample: for each "
                                             "client, its sampling rate and its steps in the run)", low=0,
                                       low_open=True, metavar="E", group=PRIVACY, reads=("engine",),
                                       none_means="from --dp-noise", only_with=DP_ON)
    dp_delta: float | None = setting(None, "delta of (epsilon, delta)-DP", low=0, low_open=True,
                                     high=1, high_open=True, metavar="D", group=PRIVACY, reads=("engine",),
                                     none_means="min(1e-5, 1 / (10 K)), K: --dp client the clients, --dp sample "
                                                "the largest client's samples; a given one must be below 1 / K",
                                     only_with=DP_ON)
    dp_clip_quantile: float | None = setting(None, "--dp client: adaptive clipping (Andrew et al. 2021): the share "
                                                   "of updates the clip should leave unclipped; --dp-clip is then "
                                                   "the first round's clip", low=0, low_open=True, high=1,
                                             high_open=True, metavar="Q", group=PRIVACY, reads=("engine",),
                                             none_means="a fixed clip", only_with=DP_CLIENT)
    dp_clip_lr: float = setting(0.2, "--dp-clip-quantile: the clip's geometric learning rate (C *= exp(-lr (unclipped "
                                     "share - Q)))", low=0, low_open=True, limit=10, metavar="LR", group=PRIVACY,
                                reads=("engine",), only_with=("dp_clip_quantile", GIVEN))
    dp_count_noise: float | None = setting(None, "--dp-clip-quantile: the std of the Gaussian noise on the count of "
                                                 "unclipped updates", low=0, low_open=True, metavar="S",
                                           group=PRIVACY, reads=("engine",),
                                           none_means=f"the expected clients a round / {COUNT_SHARE} (Andrew et al.)",
                                           only_with=("dp_clip_quantile", GIVEN))
    dp_stats_clip: float = setting(STATS_CLIP, lambda: "--dp client: the L2 norm each client's class statistics are "
                                   "clipped to, for a method that declares them privatised as noised per-class means "
                                   f"({words(class_mean_methods(), 'and')})", low=0,
                                   low_open=True, metavar="C", group=PRIVACY, reads=("engine",), only_with=DP_CLIENT)
    dp_accountant: str = setting("rdp", "--dp client: the accountant (Google's dp-accounting): rdp (Renyi DP, the "
                                        "one Flower's DP uses) or pld (privacy loss distributions: a tighter epsilon, "
                                        "so less noise for the same --dp-epsilon; a tenth of a second a round)",
                                 choices=("rdp", "pld"), group=PRIVACY, reads=("engine",),
                                 only_with=(*DP_CLIENT, "--dp sample accounts each client's DP-SGD steps with "
                                                        "dp-accounting's RDP accountant"))
    dp_budget: float | None = setting(None, "stop (cleanly, exit 0) before a round whose epsilon (--dp sample: "
                                            "its worst client's) would pass this", low=0, low_open=True,
                                      metavar="E", group=PRIVACY,
                                      reads=("engine",), none_means="no budget", only_with=DP_ON)
    dp_counts_noise: float = setting(COUNTS_NOISE, lambda: "--dp sample: the std, in samples, of the Gaussian noise on "
                                     "each class count of a client whose method's loss reads its counts ("
                                     f"{words(counts_methods(), 'and')}): drawn once, counted in the client's "
                                     "accountant", low=0, low_open=True, metavar="S", group=PRIVACY,
                                     reads=("engine",))
    dp_noise_seed: str | None = setting(None, "where the DP noise comes from: run (from --seed and the round: "
                                              "reproducible, but whoever knows the seed -- config.json records it, "
                                              "and on a deployment the server chose it -- can draw the same noise and "
                                              "subtract it; for experiments) or secret (from a 256-bit key the "
                                              "operating system draws when the run starts, kept only in its "
                                              "checkpoints; on Flower each SuperNode's DP-SGD noise from a key of its "
                                              "own that never leaves it)", choices=("run", "secret"), group=PRIVACY,
                                        reads=("engine",),
                                        none_means="the engine's: run where fedlt runs every client (fedlt run, "
                                                   "fedlt flower inprocess and simulate), secret on a deployment "
                                                   "(fedlt flower run with SuperNodes)", only_with=DP_ON)
    # secure aggregation (core.secagg, docs/secure-aggregation.md): Flower's SecAgg+ and its parameters
    secagg: bool = setting(False, "secure aggregation: Flower's SecAgg+ masks each client's update, the server "
                                  "learns only their weighted mean (on Flower the protocol itself, in `fedlt run` its "
                                  "arithmetic)", group=PRIVACY, reads=("engine",))
    secagg_shares: int | None = setting(None, "--secagg: SecAgg+'s num_shares, how many of a round's clients (itself "
                                              "included) hold shares of each client's secrets", low=3, high=INT32,
                                        metavar="N", group=PRIVACY, reads=("engine",), only_with=SECAGG_ON,
                                        none_means="every client of the round")
    secagg_threshold: int | None = setting(None, "--secagg: SecAgg+'s reconstruction_threshold, how many shares "
                                                 "rebuild a secret: every client needs this many of its share-holders "
                                                 "to stay, else the round is not aggregated", low=2, high=INT32,
                                           metavar="T", group=PRIVACY, reads=("engine",), only_with=SECAGG_ON,
                                           none_means="a majority of the shares")
    secagg_clip_range: float = setting(8.0, "--secagg: SecAgg+'s clipping_range, each weighted update entry is "
                                            "clipped to [-R, R] before it is quantised", low=0, low_open=True,
                                       high=FLOAT32_MAX, metavar="R", group=PRIVACY, reads=("engine",),
                                       only_with=SECAGG_ON)
    secagg_levels: int = setting(2 ** 22, "--secagg: SecAgg+'s quantization_range, the integer levels [-R, R] is "
                                          "quantised to (one level: 2R / levels)", low=2, high=INT32, metavar="L",
                                 group=PRIVACY, reads=("engine",), only_with=SECAGG_ON)
    secagg_max_weight: float | None = setting(None, "--secagg: SecAgg+'s max_weight, the weight (num_examples) "
                                                    "that scales an update by 1 (smaller ones are scaled down before "
                                                    "quantisation)", low=0, low_open=True, high=FLOAT32_MAX,
                                              metavar="W", group=PRIVACY, reads=("engine",), only_with=SECAGG_ON,
                                              none_means="the largest training set of the round's clients (1 under "
                                                         "--dp client)")


# ------------------------------------------------------------------------------------------------ relations
FIRST = ("fedavg", "fedprox", "fedavgm", "fedadam")  # named first where a message suggests methods


def methods_where(test: Callable[[type], bool], first: tuple[str, ...] = FIRST) -> list[str]:
    """The built-in methods whose class passes ``test``, those of ``first`` first (the registry's order after)."""
    names = [n for n, cls in METHODS.items() if test(cls)]
    return [n for n in first if n in names] + [n for n in names if n not in first]


def secagg_methods() -> list[str]:
    """The built-in methods that run under --secagg (:func:`fedlt.core.secagg.runs_under`), FedAvg-family first."""
    return methods_where(secagg.runs_under)


def dp_sample_methods() -> list[str]:
    """The built-in methods that run under --dp sample (:func:`fedlt.core.dp.refusal`), FedAvg-family first."""
    return methods_where(lambda cls: refusal(cls, "sample") is None, ("fedavg", "fedprox", "ditto", "fedper",
                                                                      "fedloge"))


def counts_methods() -> list[str]:
    """The built-in methods whose loss reads the client's class counts under --dp sample (``dp_sample = "counts"``,
    :func:`fedlt.core.dp.reads_counts`): --dp-counts-noise noises them."""
    return methods_where(reads_counts, ())


def class_mean_methods() -> list[str]:
    """The built-in methods whose clients send class statistics that --dp client privatises as noised per-class means
    (``Sent.dp`` ``class-mean``, :func:`fedlt.core.dp.class_means`)."""
    return methods_where(lambda cls: class_means(getattr(cls, "sends", ())), ())


def only_the_model(level: str) -> list[str]:
    """The built-in methods that run under ``--dp level`` whose clients send only the model (nothing privatised
    beside it: :func:`fedlt.core.dp.privatised`), FedAvg-family first."""
    return methods_where(lambda cls: refusal(cls, level) is None and not privatised(getattr(cls, "sends", ())))


def secagg_clients(c) -> int:
    """The fewest clients a round needs under --secagg: 3 (SecAgg+ splits a secret into 3 or more shares), more
    than --secagg-threshold, and --secagg-shares."""
    return max(secagg.MIN_CLIENTS, (c.secagg_threshold or 0) + 1, c.secagg_shares or 0)


class ClientLevel:
    """What --dp client's validation derives from a configuration ``c`` (the mechanism's own functions,
    :class:`fedlt.core.dp.ClientDP`'s): the round's clients, the sampling rate, delta, the noise multiplier (given or
    solved), adaptive clipping's count noise and the noise on the averaged update."""

    def __init__(self, c, method: type):
        self.per_round = clients_per_round(c.clients, c.participation)
        self.rate = self.per_round / c.clients
        self.delta = c.dp_delta if c.dp_delta is not None else default_delta(c.clients)
        self.noise = solved_noise(c.dp_noise, c.dp_epsilon, self.rate, c.rounds, self.delta, c.dp_accountant)
        self.count_noise = None if c.dp_clip_quantile is None else count_noise_of(c.dp_count_noise, self.per_round)
        self.releases = release_count(class_means(getattr(method, "sends", ())))
        self.source = "--dp-noise" if c.dp_noise is not None else f"solved for --dp-epsilon {c.dp_epsilon:g}"
        self.accountant = c.dp_accountant

    def mean_noise(self) -> float:
        """The std of the noise on the averaged update in units of the clip, ``z_u / (q K)`` (``z_u``: the update's
        own multiplier, :func:`fedlt.core.dp.update_noise`, larger than the run's under adaptive clipping or with
        class statistics; ``q K``: the expected clients a round, the fixed denominator). Above 1 the noise on the
        model exceeds the largest update any client can make: nothing trains."""
        return update_noise(self.noise, self.count_noise, self.releases) / self.per_round

    def first_epsilon(self) -> float:
        """The epsilon of the first round alone (what --dp-budget must allow for any round to run)."""
        return epsilon(self.noise, self.rate, 1, self.delta, self.accountant)


def relations(method_of: Callable[[Any], type], workers_of: Callable[[Any], int]) -> list[Relation]:
    """The relations of the privacy settings that their declarations (``only_with``) do not make: with the method of
    a configuration (``method_of(c)``, its class), its worker processes (``workers_of(c)``) and the clients'
    faults settings (``fedlt.engine.faults``)."""
    level = lambda c: ClientLevel(c, method_of(c))  # noqa: E731
    why = lambda c: refusal(method_of(c), c.dp) or ("", [])  # noqa: E731
    solved = lambda c: (c.dp_noise is None) != (c.dp_epsilon is None)  # noqa: E731
    return [
        applies_when("dp_counts_noise", lambda c: c.dp == "sample" and reads_counts(method_of(c)),
                     lambda c: f"--dp-counts-noise noises the class counts that a method's loss reads under --dp "
                               f"sample ({', '.join(counts_methods())})"
                               + ("; add --dp sample or drop it" if c.dp != "sample" else
                                  f", and method {c.method} reads none; drop it"), others=("dp", "method"),
                     bad=({"dp_counts_noise": 3.0}, {**ON_SAMPLE, "dp_counts_noise": 3.0})),
        applies_when("dp_stats_clip",
                     lambda c: c.dp != "client" or bool(class_means(getattr(method_of(c), "sends", ()))),
                     lambda c: f"--dp-stats-clip clips the class statistics of a method that sends them as noised "
                               f"per-class means ({', '.join(class_mean_methods())}), and "
                               f"method {c.method} sends none; drop it", others=("method",),
                     bad=({**ON_CLIENT, "dp_stats_clip": 2.0},)),
        requires("dp_clip_quantile", lambda c: split_problem(level(c).noise, level(c).count_noise) is None,
                 lambda c: split_problem(level(c).noise, level(c).count_noise),
                 when=lambda c: c.dp == "client" and c.dp_clip_quantile is not None and solved(c),
                 others=("dp_noise", "dp_epsilon", "dp_delta", "dp_count_noise", "participation", "clients", "rounds"),
                 bad=({**ON_CLIENT, "dp_clip_quantile": 0.5,
                       "dp_count_noise": 0.4},)),
        requires("dp", lambda c: c.dp_clip is not None,
                 lambda c: "--dp client needs --dp-clip C, the norm each client's update is clipped to (e.g. 1.0; "
                           "McMahan et al. tune it to the median update norm)" if c.dp == "client" else
                           "--dp sample needs --dp-clip C, the norm each sample's gradient is clipped to (e.g. 1.0; "
                           "tune it to the median per-sample gradient norm, dp_grad_norm in metrics.jsonl)",
                 when=lambda c: c.dp != "off", others=("dp_clip",),
                 bad=({"dp": "client", "dp_noise": 1.0}, {"dp": "sample", "dp_noise": 1.0})),
        requires("dp", solved,
                 "--dp {dp} needs exactly one of --dp-noise Z and --dp-epsilon E (the noise solved for it)",
                 when=lambda c: c.dp != "off", others=("dp_noise", "dp_epsilon"),
                 bad=({"dp": "client", "dp_clip": 1.0}, {**ON_CLIENT, "dp_epsilon": 8.0},
                      {"dp": "sample", "dp_clip": 1.0})),
        requires("dp", lambda c: why(c)[0] != "pool",
                 lambda c: f"--dp {c.dp} protects each client's data in what it sends; method {c.method} {POOLED}, "
                           f"which no {c.dp}-level guarantee covers: choose a federated method",
                 when=lambda c: c.dp != "off", others=("method",),
                 bad=({**ON_CLIENT, "method": "centralized"},
                      {**ON_SAMPLE, "method": "centralized"})),
        requires("dp", lambda c: why(c)[0] != "unprotected",
                 lambda c: f"--dp {c.dp} protects the model {'update' if c.dp == 'client' else 'DP-SGD trains'} only, "
                           f"and method {c.method}'s clients also send {', '.join(why(c)[1])}, which would leave "
                           f"unprotected; choose a method whose clients send only the model "
                           f"({', '.join(only_the_model(c.dp)[:4])}, ...)"
                           + (f", or one whose class statistics it privatises "
                              f"({', '.join(class_mean_methods())})"
                              if c.dp == "client" else ""),
                 when=lambda c: c.dp != "off", others=("method",),
                 bad=({**ON_CLIENT, "method": "ccvr"},
                      {**ON_SAMPLE, "method": "ccvr"})),
        requires("dp", lambda c: why(c)[0] != "server",
                 lambda c: f"--dp client noises only the mean of the clipped updates, and in method {c.method} "
                           f"{why(c)[1][0]}; choose a method whose server takes their mean "
                           f"({', '.join(methods_where(lambda k: refusal(k, 'client') is None)[:4])}, ...), or "
                           f"--dp sample",
                 when=lambda c: c.dp == "client", others=("method",),
                 bad=({**ON_CLIENT, "method": "gbme"},)),
        requires("dp", lambda c: why(c)[0] != "undeclared",
                 lambda c: f"--dp sample runs DP-SGD in a method's described local steps whose loss of one sample "
                           f"reads no other sample, and method {c.method} does not declare that ("
                           f"{''.join(why(c)[1][:1]) or 'Method.dp_sample: ' + UNDECLARED}); choose "
                           f"{words(dp_sample_methods(), 'or')}",
                 when=lambda c: c.dp == "sample", others=("method",),
                 bad=({**ON_SAMPLE, "method": "fedgrab"},)),
        requires("dp", lambda c: workers_of(c) == 0 and str(c.client_parallel) in ("auto", "off")
                 and c.precision != "fp16",
                 "--dp sample trains a round's clients one after another in this process, in fp32 or bf16 (each keeps "
                 "its accountant here; DP-SGD vectorises over a client's samples instead): drop --workers, "
                 "--client-parallel N and --precision fp16", when=lambda c: c.dp == "sample",
                 others=("workers", "client_parallel", "precision"),
                 bad=({**ON_SAMPLE, "client_parallel": "2"},)),
        requires("dp", lambda c: c.availability == "always" and c.drop_rate == 0 and c.round_deadline is None
                 and c.over_select == 1,
                 "--dp client samples every client with probability participation / clients each round, as its "
                 "accountant assumes: drop --availability, --drop-rate, --round-deadline and --over-select",
                 when=lambda c: c.dp == "client", others=("availability", "drop_rate", "round_deadline", "over_select"),
                 bad=({**ON_CLIENT, "drop_rate": 0.5},)),
        requires("dp_delta", lambda c: delta_problem(c.dp_delta, c.clients, "client", "the run's clients") is None,
                 lambda c: delta_problem(c.dp_delta, c.clients, "client", "the run's clients"),
                 when=lambda c: c.dp == "client" and c.dp_delta is not None, others=("clients",),
                 bad=({**ON_CLIENT, "dp_delta": 0.25},
                      {**ON_CLIENT, "clients": 10, "dp_delta": 0.1})),
        # noise larger than the clip on the averaged update, or a budget the first round passes: refused before the run
        requires("dp", lambda c: level(c).mean_noise() <= 1,
                 lambda c: f"--dp client: the noise multiplier {level(c).noise:.3g} ({level(c).source}) puts noise of "
                           f"std {level(c).mean_noise():.3g} x --dp-clip on the averaged update of the "
                           f"{level(c).per_round} clients a round, more than any clipped update moves it, so nothing "
                           f"can train; train more clients a round (--participation, --clients), or "
                           + ("use a smaller --dp-noise" if c.dp_noise is not None else
                              "fewer --rounds, or allow a larger --dp-epsilon"),
                 when=lambda c: c.dp == "client" and solved(c),
                 others=("dp_noise", "dp_epsilon", "participation", "clients", "rounds"),
                 bad=({"dp": "client", "dp_clip": 1.0, "dp_epsilon": 1e-6, "dp_delta": 1e-5},
                      {"dp": "client", "dp_clip": 1.0, "dp_noise": 4.0})),
        requires("dp_budget", lambda c: level(c).first_epsilon() <= c.dp_budget,
                 lambda c: f"--dp-budget {c.dp_budget:g} is below the first round's epsilon "
                           f"{level(c).first_epsilon():.3g} (noise multiplier {level(c).noise:.3g}, sampling rate "
                           f"{level(c).rate:.3g}, delta {level(c).delta:.3g}), so no round could run; raise "
                           f"--dp-budget, or spend less a round: more noise (--dp-noise, or a smaller --dp-epsilon) or "
                           f"fewer clients a round (--participation)",
                 when=lambda c: c.dp == "client" and c.dp_budget is not None and solved(c),
                 others=("dp_noise", "dp_epsilon", "dp_delta", "participation", "clients"),
                 bad=({**ON_CLIENT, "dp_budget": 0.001},)),
        requires("secagg", lambda c: secagg.runs_under(method_of(c)),
                 lambda c: f"--secagg hands the server only the weighted mean of the clients' updates, and method "
                           f"{c.method} needs more: {secagg.why_not(method_of(c))}; drop --secagg or choose a method "
                           f"that averages ({', '.join(secagg_methods()[:6])}, ...)",
                 when=lambda c: c.secagg, others=("method",),
                 bad=({"secagg": True, "participation": 1.0, "method": "ccvr"},
                      {"secagg": True, "participation": 1.0, "method": "fedexp"})),
        requires("secagg", lambda c: clients_per_round(c.clients, c.participation) >= secagg_clients(c),
                 lambda c: f"--secagg needs at least {secagg_clients(c)} clients a round (SecAgg+ splits each client's "
                           f"secrets into shares: at least 3, more than --secagg-threshold, --secagg-shares where "
                           f"given), and this run has {clients_per_round(c.clients, c.participation)}: raise "
                           f"--participation or --clients, or lower the threshold",
                 when=lambda c: c.secagg, others=("participation", "clients", "secagg_threshold", "secagg_shares"),
                 bad=({"secagg": True}, {"secagg": True, "participation": 1.0, "secagg_threshold": 4})),
        requires("secagg_threshold", lambda c: c.secagg_threshold < c.secagg_shares,
                 "--secagg-threshold {secagg_threshold} must be below --secagg-shares {secagg_shares} (a client's "
                 "share-holders include itself); lower the threshold or raise the shares",
                 when=lambda c: c.secagg and c.secagg_shares is not None and c.secagg_threshold is not None,
                 others=("secagg_shares",),
                 bad=({"secagg": True, "participation": 1.0, "secagg_shares": 3, "secagg_threshold": 3},)),
        requires("secagg_levels",
                 lambda c: secagg.fits(clients_per_round(c.clients, c.participation), c.secagg_levels),
                 lambda c: f"--secagg-levels {c.secagg_levels} x {clients_per_round(c.clients, c.participation)} "
                           f"clients a round passes SecAgg+'s modulus 2^32: the masked sum would wrap round; use at "
                           f"most {(secagg.MODULUS - 1) // clients_per_round(c.clients, c.participation)} levels",
                 when=lambda c: c.secagg, others=("participation", "clients"),
                 bad=({"secagg": True, "participation": 1.0, "secagg_levels": 2 ** 30},)),
        requires("secagg", lambda c: c.drop_rate == 0 and c.round_deadline is None and c.over_select == 1,
                 "--secagg sums the replies before the server sees any, and --drop-rate, --round-deadline and "
                 "--over-select drop replies after they arrive: drop them (a client that really drops out of a round "
                 "is SecAgg+'s to handle)", when=lambda c: c.secagg,
                 others=("drop_rate", "round_deadline", "over_select"),
                 bad=({"secagg": True, "participation": 1.0, "drop_rate": 0.5},)),
        requires("secagg_clip_range", lambda c: c.secagg_clip_range >= c.dp_clip,
                 "--secagg-clip-range {secagg_clip_range:g} is below --dp-clip {dp_clip:g}: SecAgg+ would clip "
                 "entries of updates DP has already clipped; use a range of at least the DP clip",
                 when=lambda c: c.secagg and c.dp == "client" and c.dp_clip is not None, others=("dp_clip",),
                 bad=({"secagg": True, "participation": 1.0, "dp": "client", "dp_clip": 10.0, "dp_noise": 1.0},)),
    ]
