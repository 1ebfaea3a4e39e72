"""Run configuration: defaults (the fmnist-lt protocol of docs/protocol.md), presets, TOML files and
command-line overrides, validated before anything is loaded or written."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .core.dp import (STATS_CLIP, class_means, default_delta, delta_problem, epsilon, noise_for, refusal,
                      update_noise, verdict)
from .core.dpsgd import COUNTS_NOISE, reads_counts
from .core import secagg
from .core.finetune import finetune_refusal
from .core.spec import LR_SCHEDULES, RunSpec, milestones_text, parse_milestones, scheduled_lr
from .pretrained import is_clip, is_pretrained
from .decl import (DATA, FLOAT32_MAX, GIVEN, INT32, OUTPUT, TRAIN, Relation, applies_when, byte_size, check,
                   check_relations, check_values, coerce, declared_in, excludes, only_with_relations, requires, rows,
                   settings_of, setting, show, words)
from .errors import ConfigError
from .papers import presets as paper_presets
from .registry import DATASETS, METHODS, MODELS, PARTITIONS
from .seeds import Purpose

DEFAULT_BUDGET = 2_000_000_000  # bytes of client states in memory: --client-state-memory 2GB (engine.clientstate)


def _ratio_hint(rho: float) -> str:
    return f"did you mean {1 / rho:g} (the FedLoGe code writes n_min/n_max)?" if 0 < rho < 1 else ""


def _zero_noise_hint(z: float) -> str:
    """--dp-noise 0 (refused on the command line and in fedlt.run alike): what to give instead."""
    return ("noise 0 would be clipping without any guarantee (an infinite epsilon); for clipping alone give a tiny "
            "noise such as 1e-6, whose epsilon says what it protects") if z == 0 else ""


PRIVACY = "privacy"
# the settings that apply only with --dp, --dp client or --secagg (Decl.only_with: decl generates their relations);
# a client-level one's second bad example runs --dp sample
DP_ON, SECAGG_ON = ("dp", ("client", "sample")), ("secagg", (True,))
DP_CLIENT = ("dp", ("client",), {"dp": "sample", "dp_clip": 1.0, "dp_noise": 1.0})
# experiment trackers (fedlt.runner.trackers): the package each needs, and how to install it
TRACKERS = {"mlflow": ("mlflow", "pip install 'fedlt[mlflow]'"), "wandb": ("wandb", "pip install 'fedlt[wandb]'"),
            "tensorboard": ("tensorboard", "pip install 'fedlt[tensorboard]'")}


@dataclass
class RunConfig:
    """The settings of one run, each declared once (:func:`fedlt.decl.setting`): its default, range or
    choices and help, from which the command line, validation, TOML loading, ``fedlt list`` and the
    documentation's settings table are made. Defaults: the fmnist-lt protocol of docs/protocol.md."""

    method: str = setting("fedavg", "federated method", registry=METHODS, group=TRAIN)
    params: dict[str, Any] = setting(factory=dict, help="method hyper-parameters ([params] in TOML, --set "
                                                        "KEY=VALUE; `fedlt list METHOD` shows them)", cli=False,
                                     group=TRAIN)
    method_file: str | None = setting(None, "a Python file that registers a method of your own (its code runs; see "
                                            "docs/writing-a-method.md); --method defaults to the method it "
                                            "defines; stored absolute", metavar="FILE.py", group=TRAIN, path="file")
    # data
    dataset: str = setting("fashion-mnist", "dataset", registry=DATASETS, group=DATA)
    data_dir: str | None = setting(None, "folder with the dataset files (that folder only: a file missing there "
                                         "is an error)", group=DATA, result=False, path="folder",
                                   none_means="$FEDLT_DATA, then the system location")
    image_size: int | None = setting(None, "input resolution of the datasets that resize their images (64 or 112 "
                                           "for small runs)",
                                     low=16, high=INT32, group=DATA, none_means="224")
    imbalance_ratio: float = setting(100.0, "long tail: n_max/n_min", low=1, hint=_ratio_hint, flags=("--rho",),
                                     group=DATA)
    lt_profile: str | None = setting(None, "long-tail profile: exponential, step (--tail-classes), or none (every "
                                           "sample)", choices=("exp", "step", "none"), group=DATA,
                                     none_means="the dataset's: none for datasets long-tailed as published, "
                                                "local-longtail and partition files, else exp "
                                                "(config.json's lt_profile_used says which)")
    tail_classes: int = setting(3, "number of tail classes of the step profile", low=0, limit=10**6, group=DATA)
    n_max: int | None = setting(None, "samples of the head class", low=1, high=INT32, group=DATA,
                                none_means="all it has")
    partition: str = setting("dirichlet", "how the samples are split over the clients (natural: the dataset's own "
                                          "users)", registry=PARTITIONS, group=DATA)
    partition_file: str | None = setting(None, "the clients' training indices (a run's partition.json, or client "
                                               "-> indices); replaces the long-tail subset and the partition, sets "
                                               "--partition file", metavar="FILE.json", group=DATA,
                                         path="file")
    alpha: float = setting(0.5, "Dirichlet concentration", low=0, low_open=True, label="Dirichlet alpha",
                           group=DATA)
    shards_per_client: int = setting(2, "shards per client", low=1, limit=10**6, group=DATA)
    classes_per_client: int = setting(2, "classes per client", low=1, high=INT32, group=DATA)
    balance: bool = setting(False, "LongTailLib's balanced client sizes (dirichlet: shares capped at N/K; "
                                   "pathological: equal)", group=DATA)
    tau: float = setting(2.0, "BalanceFL tau-sampling: n_tau = tau * n_min", low=0, low_open=True, group=DATA)
    min_client_size: int = setting(0, "redraw until every client has this many samples", low=0, high=INT32,
                                   group=DATA)
    clients: int = declared_in(RunSpec, "num_clients")
    client_test_fraction: float = setting(0.0, "each client's test set: this fraction of its own samples (LEAF's "
                                               "per-user split), for natural users or populations too large for "
                                               "shares of the balanced test set (0: a share of the balanced test "
                                               "set mirroring the client's training classes)",
                                          low=0, high=1, high_open=True, metavar="F", group=DATA)
    synthetic_per_class: int | None = setting(None, "training samples per class of the synthetic dataset",
                                              low=1, limit=10**6,
                                              group=DATA, none_means="600")
    # Hugging Face datasets (--dataset hf:NAME) and Flower Datasets partitioners (--partition flwr:CLASS): data/hf.py
    image_column: str | None = setting(None, "hf: datasets: the column of images (PIL or arrays) or feature vectors",
                                       metavar="COLUMN", group=DATA,
                                       none_means="the first Image column, else image or img")
    label_column: str | None = setting(None, "hf: datasets: the column of class labels", metavar="COLUMN",
                                       group=DATA, none_means="the first ClassLabel column, else label")
    partition_args: dict[str, Any] = setting(factory=dict, help="flwr: partitions: the Flower Datasets "
                                                                "partitioner's arguments ([partition_args] in "
                                                                "TOML, --set partition.KEY=VALUE)",
                                             cli=False, group=DATA)
    # model and local training
    model: str | None = setting(None, "model", registry=MODELS, group=TRAIN, none_means="the dataset's default")
    finetune: str = declared_in(RunSpec, "finetune")  # how much of it trains (core.finetune), LoRA's settings
    lora_rank: int = declared_in(RunSpec, "lora_rank")
    lora_alpha: float = declared_in(RunSpec, "lora_alpha")
    lora_dropout: float = declared_in(RunSpec, "lora_dropout")
    lora_targets: str | None = declared_in(RunSpec, "lora_targets")
    lora_agg: str = declared_in(RunSpec, "lora_agg")
    bn_stats: str = declared_in(RunSpec, "bn_stats")
    pretrained_size: int | None = declared_in(RunSpec, "pretrained_size")  # pre-trained models (fedlt.pretrained)
    head: str = declared_in(RunSpec, "head")
    head_fixed: bool = declared_in(RunSpec, "head_fixed")
    rounds: int = declared_in(RunSpec, "rounds", reads=("engine",))
    participation: float = setting(0.5, "clients per round: a fraction (<= 1) or a count (> 1)", low=0,
                                   low_open=True, group=TRAIN, reads=("engine",))
    local_epochs: int = declared_in(RunSpec, "local_epochs")
    batch_size: int = declared_in(RunSpec, "batch_size")
    lr: float = declared_in(RunSpec, "lr")
    lr_schedule: str = declared_in(RunSpec, "lr_schedule")
    lr_milestones: str = declared_in(RunSpec, "lr_milestones")
    lr_gamma: float = declared_in(RunSpec, "lr_gamma")
    momentum: float = declared_in(RunSpec, "momentum")
    weight_decay: float = declared_in(RunSpec, "weight_decay")
    seed: int = declared_in(RunSpec, "seed", reads=("engine",))
    device: str = declared_in(RunSpec, "device")
    threads: int | None = setting(None, "torch CPU threads (with --workers: of each worker)", low=1, high=4096,
                                  group=TRAIN, result=False, none_means="torch's default; 1 per worker",
                                  reads=("engine",))
    workers: str = setting("off", "train a round's clients in parallel worker processes, one torch thread each: "
                                  "off, auto (the cores this process may use, on a CPU, when a round has at least "
                                  "two clients) or N; results are those of --threads 1 without workers, bit for bit",
                           choices=("off", "auto"), numbers=int, low=1, high=4096, unit="processes", group=TRAIN,
                           result=False)
    precision: str = declared_in(RunSpec, "precision")
    channels_last: str = declared_in(RunSpec, "channels_last")
    client_parallel: str = setting("auto", "train a round's clients together (methods that describe their local "
                                           "steps): auto (all at once on CUDA, one after another on a CPU), off, "
                                           "or N per chunk", choices=("auto", "off"), numbers=int, low=1,
                                   unit="clients", group=TRAIN, reads=("engine",))
    cuda_graphs: bool = setting(False, "replay each batched step as one CUDA graph (fewer launches; "
                                       "--client-parallel on CUDA)", group=TRAIN, reads=("engine",))
    deterministic: bool = setting(False, "deterministic algorithms and cuDNN settings (slower on a GPU)",
                                  group=TRAIN)
    data_placement: str = setting("auto", "where the samples live: auto (on the GPU when they take at most a "
                                          "quarter of its free memory, else in host memory with pinned per-batch "
                                          "copies), device, host", choices=("auto", "device", "host"), group=TRAIN,
                                  result=False)
    # divergence: a non-finite training loss or global weights stop the run (exit status 3) unless "continue"
    on_diverge: str = setting("stop", "a non-finite training loss or global weights: stop the run with exit "
                                      "status 3, or train on", choices=("stop", "continue"), group=TRAIN,
                              result=False)
    diverge_factor: float = setting(0.0, "also stop when the training loss exceeds F times the first round's (0: "
                                         "off; 100 suits cross-entropy)", low=0, metavar="F", group=TRAIN,
                                    result=False)
    client_state_memory: int = setting(DEFAULT_BUDGET, "client states held in memory, the least recently used beyond "
                                                      "it spilled to the run directory (a resumed run may change "
                                                      "it)", parse=byte_size, unit="bytes", metavar="SIZE",
                                       group=TRAIN, result=False, reads=("engine",))
    # clients that are away, drop out or straggle (fedlt.engine.faults, docs/dropout.md); all off by default
    availability: str = setting("always", "each round a client is online with this probability: a number, always, or "
                                          "a profile with mean --availability-mean: size (proportional to its "
                                          "samples) or tail (lower for clients whose data leans to the tail "
                                          "classes); only online clients are sampled",
                                choices=("always", "size", "tail"), numbers=float, low=0, low_open=True, high=1,
                                metavar="P|size|tail", group=TRAIN)
    availability_mean: float = setting(0.5, "mean probability of being online under --availability size or tail",
                                       low=0, low_open=True, high=1, group=TRAIN)
    availability_skew: float = setting(5.0, "--availability tail: a client's weight is exp(-skew x its tail score "
                                            "in [0, 1]); 0: every client alike", low=0, high=50, group=TRAIN)
    drop_rate: float = setting(0.0, "probability that a sampled client trains but its reply never arrives", low=0,
                               high=1, high_open=True, metavar="P", group=TRAIN,
                               hint=lambda p: "at 1 no reply ever arrives and nothing trains" if p == 1 else "")
    speed_sigma: float = setting(0.0, "stragglers: each client's speed log-normal with median 1 and this sigma (a "
                                      "speed-1 client trains 1,000 samples per simulated second)", low=0, high=10,
                                 group=TRAIN)
    speed_file: str | None = setting(None, "stragglers: the clients' speeds from a JSON file (a list, one per "
                                           "client, or {client id: speed})", metavar="FILE.json", group=TRAIN,
                                     path="file")
    round_deadline: float | None = setting(None, "replies later than this many simulated seconds are lost",
                                           low=0, low_open=True, unit="seconds", metavar="SECONDS", group=TRAIN,
                                           none_means="no deadline")
    over_select: float = setting(1.0, "sample F times the clients a round wants and aggregate the first of them "
                                      "to arrive within the deadline", low=1, limit=100, metavar="F", group=TRAIN)
    allow_large: bool = declared_in(RunSpec, "allow_large")
    # differential privacy (fedlt.core.dp, fedlt.core.dpsgd, docs/differential-privacy.md)
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
                                           none_means="the expected clients a round / 20 (Andrew et al.)",
                                           only_with=("dp_clip_quantile", GIVEN))
    dp_stats_clip: float = setting(STATS_CLIP, "--dp client: the L2 norm each client's class statistics are clipped "
                                               "to, for a method that declares them privatised as noised per-class "
                                               "means (CReFF's, RedGrape's per-class gradients)", low=0,
                                   low_open=True, metavar="C", group=PRIVACY, reads=("engine",), only_with=DP_CLIENT)
    dp_accountant: str = setting("rdp", "--dp client: the accountant (Google's dp-accounting): rdp (Renyi DP, the "
                                        "one Flower's DP uses) or pld (privacy loss distributions: a tighter epsilon, "
                                        "so less noise for the same --dp-epsilon; a tenth of a second a round)",
                                 choices=("rdp", "pld"), group=PRIVACY, reads=("engine",))
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
    # secure aggregation (fedlt.core.secagg, docs/secure-aggregation.md): Flower's SecAgg+ and its parameters
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
    # evaluation and output
    eval_every: int = setting(5, "evaluate every N rounds", low=1, high=INT32, group=OUTPUT,
                              reads=("engine",))
    eval_clients: float = setting(1.0, "PM over every client (1), or over a fixed, seeded sample of them: a "
                                       "fraction (< 1) or a count (> 1); the summary says 'PM over 500 of 100,000 "
                                       "clients'", low=0, low_open=True, metavar="N|F", group=OUTPUT,
                                  reads=("engine",))
    split: str = setting("fedloge", "many/medium/few split", choices=("fedloge", "fixed"), group=OUTPUT,
                         reads=("engine",))
    out: str = setting("runs", "folder for run directories", group=OUTPUT, result=False, path="folder")
    name: str | None = setting(None, "run directory name: one folder name inside --out", group=OUTPUT, result=False,
                               path="name",
                               none_means="method-dataset-rhoR-partition-sS-timestamp")
    preset: str | None = setting(None, "named settings: the fmnist-lt protocol, its official code's variant, a quick "
                                       "smoke test or a paper's protocol (`fedlt list` shows their values)",
                                 choices=lambda: tuple(PRESETS), result=False)
    # experiment trackers (issue 34 item 1). result=False: where a run's numbers are also sent changes none of
    # them, so a run may be resumed, and a finished sweep run reused, with other trackers
    tracker: tuple[str, ...] = setting((), "experiment trackers that also receive the settings, every round's "
                                           "metrics and the run's files (repeatable or comma-separated; none: "
                                           "none)", choices=(*TRACKERS, "none"), group=OUTPUT, result=False,
                                       none_means="tensorboard when installed")

    def dataset_kw(self) -> dict:
        """Settings passed to the dataset's loader."""
        return {**({"image_size": self.image_size} if self.image_size else {}),
                **({"n_per_class": self.synthetic_per_class} if self.synthetic_per_class else {}),
                **{k: v for k in ("image_column", "label_column") if (v := getattr(self, k)) is not None}}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lr_at(cfg: RunConfig, rnd: int) -> float:
    """The local learning rate of round ``rnd`` (1-based) under the settings' schedule
    (:func:`fedlt.core.spec.scheduled_lr`, the formula and its cases)."""
    return scheduled_lr(cfg.lr, cfg.lr_schedule, parse_milestones(cfg.lr_milestones), cfg.lr_gamma, cfg.rounds, rnd)


PRESETS: dict[str, dict[str, Any]] = {
    "fmnist-lt": {},  # the defaults are this protocol
    "fmnist-lt-official": {"lr": 0.03, "momentum": 0.5, "batch_size": 8, "local_epochs": 5},
    "smoke": {"dataset": "digits", "imbalance_ratio": 10.0, "clients": 10, "rounds": 20, "eval_every": 5},
}
# the seed papers' protocols, <paper>-<dataset> (fedlt.papers: each value with its source; `fedlt list` shows them)
PRESETS.update({name: dict(p.settings) for name, p in paper_presets().items()})

FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}
SETTINGS = settings_of(RunConfig)  # name -> its declaration (fedlt.decl.Setting)


def read_toml(path: str | Path, what: str = "config") -> dict[str, Any]:
    """A TOML file as a dict, or a one-line ConfigError if it is missing or not valid TOML."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} file {path} not found")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} file {path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{what} file {path} is not valid TOML: it is nested too deeply") from None


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None, typed: Any = ()) -> RunConfig:
    """Defaults <- preset <- TOML file <- overrides (command line). Unknown keys are errors. The TOML file's
    values, and the overrides named in ``typed`` (read from a typed file: a sweep's), are typed: a number or a
    bool written as text there is refused (``drop_rate = "0.3"``), as the command line's text is read."""
    values: dict[str, Any] = read_toml(path) if path else {}
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    for where in (values, overrides):
        if not isinstance(where.get("params", {}), dict):
            raise ConfigError(f"params must be a table of method parameters ([params] in TOML), got "
                              f"{show(where['params'])}")
    params = {**values.pop("params", {}), **overrides.pop("params", {})}
    params, given_args = partition_args_of(params)
    if given_args:
        overrides["partition_args"] = {**values.get("partition_args", {}), **given_args,
                                       **overrides.get("partition_args", {})}
    preset = overrides.get("preset", values.get("preset"))
    merged: dict[str, Any] = {}
    if preset is not None:
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ConfigError(f"unknown preset {show(preset)}; choose one of: {', '.join(PRESETS)}")
        merged.update(PRESETS[preset])
    merged.update(values)
    merged.update(overrides)
    for k in merged:
        if k not in FIELDS or k == "params":
            raise ConfigError(f"unknown setting {show(k)}; see `fedlt run --help`")
    typed = (set(values) - set(overrides)) | (set(typed) & set(overrides))
    merged = {k: coerce(SETTINGS[k], v, typed=k in typed) for k, v in merged.items()}  # types first: a path is text, ...
    for k in ("method_file", "partition_file"):  # ... and one the files below may be read from
        if merged.get(k):
            check(SETTINGS[k], merged[k])
    if merged.get("method_file"):
        from .plugins import only_method, resolve_method_file

        merged["method_file"] = resolve_method_file(merged["method_file"])
        merged.setdefault("method", only_method(merged["method_file"]))
    if merged.get("partition_file"):  # the file decides the clients; --clients may only repeat their number
        if merged.get("partition", "file") != "file":
            raise ConfigError("--partition and --partition-file exclude each other: the file is the partition")
        merged["partition"] = "file"
        merged.setdefault("clients", count_file_clients(merged["partition_file"]))
    cfg = RunConfig(**merged, params=params)
    validate(cfg, PRESETS.get(preset))
    return cfg


def name_part(value: str) -> str:
    """A dataset or partition name as part of a directory name: ``hf:/data/my set`` -> ``hf-my-set``,
    ``hf:uoft-cs/cifar10`` -> ``hf-cifar10``, ``flwr:IidPartitioner`` -> ``flwr-IidPartitioner``."""
    import re

    head, sep, rest = value.partition(":")
    if sep:
        value = f"{head}-{Path(rest.rstrip('/')).name or rest}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", value)


def partition_args_of(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Method parameters and the partitioner's arguments, apart: ``--set partition.KEY=VALUE`` (and a TOML
    ``[params.partition]`` table) are arguments of a ``flwr:`` partition, the rest the method's."""
    rest, args = {}, {}
    for k, v in params.items():
        if k == "partition" and isinstance(v, dict):
            args.update(v)
        elif k.startswith("partition."):
            args[k[len("partition."):]] = v
        else:
            rest[k] = v
    return rest, args


def read_json_file(path: str, what: str) -> Any:
    """The JSON content of a file a setting names, or a one-line ConfigError ("``what`` file PATH not found", not
    readable JSON, nested too deeply)."""
    from .jsonutil import read_json

    return read_json(path, f"{what} file {path}")


def count_file_clients(path: str) -> int:
    """How many clients a partition file holds (its content is checked when the federation is built)."""
    doc = read_json_file(path, "partition")
    clients = doc.get("clients", doc) if isinstance(doc, dict) else doc
    if not isinstance(clients, (dict, list)) or not clients:
        raise ConfigError(f"partition file {path}: expected a clients mapping or a list of index lists")
    return len(clients)


SPEED_RANGE = (1e-6, 1e6)  # a speed file's speeds: a client a million times slower or faster than speed 1 at most


def read_speeds(path: str, num_clients: int) -> np.ndarray:
    """A speed file: a JSON list of one positive speed per client, or {client id: speed} for every client."""
    doc = read_json_file(path, "speed")
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
            raise ConfigError(f"speed file {path}: client {k}'s speed is {json.dumps(v)[:40]}; every speed must be a number "
                              f"(written without quotes)")
    s = np.asarray([float(v) for v in doc])
    bad = np.flatnonzero(~(np.isfinite(s) & (s >= SPEED_RANGE[0]) & (s <= SPEED_RANGE[1])))
    if len(bad):  # a round's time is samples / speed: it must stay a finite number (metrics.jsonl is JSON)
        raise ConfigError(f"speed file {path}: client {bad[0]}'s speed is {doc[bad[0]]!r}; every speed must be a positive finite "
                          f"number, in [{SPEED_RANGE[0]:g}, {SPEED_RANGE[1]:g}] (relative to 1)")
    return s


def validate(cfg: RunConfig, base: dict | None = None) -> None:
    """Every setting against its declaration (type, range, choices, names), then the relations between settings
    (:data:`RELATIONS`) and the checks that need the method, the dataset's files or torch. Raises ConfigError
    with a one-line message. ``base``: the preset's settings (a value a preset gives is not the user's: a
    paper's protocol that states a setting its partition ignores stays as the paper wrote it)."""
    from .data.split import check_lt_settings, default_lt_profile
    from .plugins import load_method_file, method_class

    if cfg.method_file:  # the methods it registers are names like the built-in ones
        load_method_file(cfg.method_file)
    cfg.allow_large = coerce(SETTINGS["allow_large"], cfg.allow_large)
    if cfg.partition_file:
        cfg.partition = "file"
    check_values(cfg, allow_large=cfg.allow_large)
    if cfg.data_dir and not Path(cfg.data_dir).is_dir():  # that folder or an error, whatever the dataset
        raise ConfigError(data_dir_problem(cfg.dataset, cfg.data_dir))
    params = method_class(cfg).make_params(cfg.params, cfg.allow_large)
    check_lt_settings(cfg.dataset, cfg.lt_profile or default_lt_profile(cfg.dataset, cfg.partition, cfg.partition_file),
                      cfg.partition, cfg.partition_file)
    check_relations(cfg, RELATIONS, base)
    if cfg.dp == "sample" and (why := method_class(cfg).dp_sample_refusal(params)):
        raise ConfigError(f"--dp sample: {why}")
    part = PARTITIONS.get(cfg.partition)
    if hasattr(part, "check_args"):  # the partitioner made once with its arguments: a bad one fails here
        part.check_args(cfg.clients, cfg.seed, cfg.partition_args)
    if cfg.speed_file is not None:
        read_speeds(cfg.speed_file, cfg.clients)
    check_relations(cfg, TIMING, base)  # the deadline against the speeds (a speed file's, read above)
    check_device(cfg.device)
    check_trackers(cfg.tracker)


def data_dir_problem(dataset: str, data_dir: str) -> str:
    """--data-dir names a file, or a folder that is not there: what to do (fetch the dataset into it, or give the
    folder that holds it)."""
    if Path(data_dir).exists():
        return f"--data-dir {show(data_dir)} is a file; give the folder that holds the {dataset} files"
    from .data.fetch import SOURCES

    fetch = f"fetch it there with `fedlt data fetch {dataset} --data-dir {data_dir}`, or " if dataset in SOURCES else ""
    return f"--data-dir {show(data_dir)} is not there; {fetch}give the folder that holds the {dataset} files"


# ------------------------------------------------------------------------------------------------ relations
def _loader(cfg):
    return DATASETS.get(cfg.dataset)


def has_capability(loader, what: str) -> bool:
    """Whether a dataset loader declares the capability ``what`` (:func:`fedlt.data.base.capable`); a name that is
    no capability is an attribute of the loader's own (hf:'s ``columns``)."""
    from .data.base import CAPABILITIES, capabilities_of

    return bool(getattr(capabilities_of(loader), what)) if what in CAPABILITIES else bool(getattr(loader, what, False))


def _reads(setting: str, label: str | None = None, bad: Any = None) -> Relation:
    """``setting`` applies to the partitions that declare they read it (fedlt.data.partition.reads)."""
    from .data.partition import partitions_reading

    flag = label or "--" + setting.replace("_", "-")

    def message(c):
        takers = partitions_reading(setting)
        return (f"{flag} applies to the {words(takers, 'and')} partition{'s' if len(takers) > 1 else ''}, not "
                f"{c.partition}; drop it" + (f" or use --partition {takers[0]}" if takers else ""))

    return applies_when(setting, lambda c: c.partition in partitions_reading(setting), message, others=("partition",),
                        bad=({"partition": "iid", setting: bad},))


def share_problem(name: str, value: float, clients: int, what: str = "") -> str | None:
    """A share of the clients: a fraction (<= 1) or a whole number of them (> 1), at most all of them; what is
    wrong with ``value`` and how to fix it, or None."""
    if value > 1 and not float(value).is_integer():
        return (f"{name} {value:g} is neither a fraction of the clients (<= 1) nor a whole number of "
                f"them (> 1); use e.g. {min(value / clients, 1):.2g} or {round(value)}")
    if value > clients:
        return (f"{name} {value:g} clients{what} exceeds the {clients} clients; use at most {clients}, or a fraction "
                f"of them (<= 1; 1: all)")
    if value * clients < 0.5:  # a fraction that rounds to no client (it used to become one client silently)
        return (f"{name} {value:g} of {clients} clients is less than one client; use at least "
                f"{1 / clients:.3g} (one client), or a count: 1, 2, ...")
    return None


def clients_per_round(num_clients: int, participation: float, what: str = "participation") -> int:
    """participation <= 1 is a fraction of the clients, > 1 a count (the engine's sampling, and the relations
    below)."""
    if participation <= 0:
        raise ConfigError(f"{what} must be > 0, got {participation:g}")
    n = int(round(participation)) if participation > 1 else max(1, int(round(participation * num_clients)))
    if n > num_clients:
        raise ConfigError(f"{what} {participation:g} asks for {n} clients but there are "
                          f"{num_clients}; use at most {num_clients} or a fraction <= 1")
    return n


def count_noise(cfg: RunConfig) -> float:
    """The std of the noise on adaptive clipping's count of unclipped updates (--dp-count-noise, or Andrew et al.'s
    expected clients a round / 20)."""
    return cfg.dp_count_noise if cfg.dp_count_noise is not None else \
        clients_per_round(cfg.clients, cfg.participation) / 20


def dp_delta_of(cfg: RunConfig) -> float:
    """--dp client's delta: --dp-delta, or the default for the run's clients (:func:`fedlt.core.dp.default_delta`)."""
    return cfg.dp_delta if cfg.dp_delta is not None else default_delta(cfg.clients)


def dp_noise_of(cfg: RunConfig) -> float:
    """--dp client's noise multiplier: --dp-noise, or the one solved for --dp-epsilon over the run's rounds."""
    if cfg.dp_noise is not None:
        return cfg.dp_noise
    return noise_for(cfg.dp_epsilon, clients_per_round(cfg.clients, cfg.participation) / cfg.clients, cfg.rounds,
                     dp_delta_of(cfg), cfg.dp_accountant)


def dp_mean_noise(cfg: RunConfig) -> float:
    """--dp client: the std of the noise on the averaged update in units of the clip, ``z_u / (q K)`` (``z_u``: the
    update's own noise multiplier, :func:`fedlt.core.dp.update_noise`, larger than the run's under adaptive clipping
    or with class statistics; ``q K``: the expected clients a round, the fixed denominator). Above 1 the noise on the
    model exceeds the largest update any client can make: nothing trains."""
    releases = 1 + 2 * len(class_means(getattr(_method_class(cfg), "sends", ())))
    z = update_noise(dp_noise_of(cfg), count_noise(cfg) if cfg.dp_clip_quantile is not None else None, releases)
    return z / clients_per_round(cfg.clients, cfg.participation)


def noise_source(cfg: RunConfig) -> str:
    """Where --dp client's noise multiplier comes from, in words."""
    return "--dp-noise" if cfg.dp_noise is not None else f"solved for --dp-epsilon {cfg.dp_epsilon:g}"


def first_epsilon(cfg: RunConfig) -> float:
    """--dp client: the epsilon of the first round alone (what --dp-budget must allow for any round to run)."""
    return epsilon(dp_noise_of(cfg), clients_per_round(cfg.clients, cfg.participation) / cfg.clients, 1,
                   dp_delta_of(cfg), cfg.dp_accountant)


def _method_class(cfg):
    from .plugins import method_class

    return method_class(cfg)


UNDECLARED = ("Method.dp_sample: its local training is a loop of its own, or its loss reads statistics of its data "
              "other than the class counts")  # --dp sample's refusal where the method gives no reason of its own


def dp_refusal(cfg) -> tuple[str, list[str]]:
    """Why --dp (client or sample) does not run method ``cfg.method`` (:func:`fedlt.core.dp.refusal`): ("", [])
    where it does."""
    return refusal(_method_class(cfg), cfg.dp) or ("", [])


def secagg_methods() -> list[str]:
    """The built-in methods that run under --secagg (:func:`fedlt.core.secagg.runs_under`), FedAvg-family first."""
    names = [n for n, cls in METHODS.items() if secagg.runs_under(cls)]
    first = [n for n in ("fedavg", "fedprox", "fedavgm", "fedadam") if n in names]
    return first + [n for n in names if n not in first]


def secagg_clients(c) -> int:
    """The fewest clients a round needs under --secagg: 3 (SecAgg+ splits a secret into 3 or more shares), more
    than --secagg-threshold, and --secagg-shares."""
    return max(secagg.MIN_CLIENTS, (c.secagg_threshold or 0) + 1, c.secagg_shares or 0)


def dp_sample_methods() -> list[str]:
    """The built-in methods that run under --dp sample (:func:`fedlt.core.dp.declared`), FedAvg-family first."""
    names = [n for n, cls in METHODS.items() if verdict(cls, "sample").startswith("yes")]
    first = [n for n in ("fedavg", "fedprox", "ditto", "fedper", "fedloge") if n in names]
    return first + [n for n in names if n not in first]


def counts_methods() -> list[str]:
    """The built-in methods whose loss reads the client's class counts under --dp sample (``dp_sample = "counts"``,
    :func:`fedlt.core.dp.reads_counts`): --dp-counts-noise noises them."""
    return [n for n, cls in METHODS.items() if reads_counts(cls)]


def available_cores() -> int:
    """The CPU cores this process may use (its affinity where the system says, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def gpu_visible() -> bool:
    """Whether torch sees a CUDA GPU. There a process forked after the first backward pass cannot run autograd
    (torch starts a thread per device then; seen on an H200 machine), so the forked workers of --workers are
    refused (and auto chooses none) until they start another way."""
    import torch

    return torch.cuda.is_available()


def worker_count(cfg) -> int:
    """The worker processes of a run (``--workers``; 0: none, the clients trained in this process). ``auto``: on a
    CPU, with at least two cores and two clients a round, as many as both allow (divided by ``--threads``)."""
    w = str(cfg.workers)
    if w == "off":
        return 0
    if w != "auto":
        return int(w)
    per_round, cores = clients_per_round(cfg.clients, cfg.participation), available_cores() // (cfg.threads or 1)
    if not str(cfg.device).startswith("cpu") or cores < 2 or per_round < 2 or gpu_visible():
        return 0
    return min(cores, per_round)


def _decays(cfg) -> int:
    """How many times a step schedule decays the lr within the run (its milestones before the last round)."""
    return len([m for m in parse_milestones(cfg.lr_milestones) if m < cfg.rounds])


def _peak_lr(cfg) -> float:
    try:
        return max(cfg.lr * cfg.lr_gamma ** k for k in range(_decays(cfg) + 1))
    except OverflowError:
        return math.inf


def _fp16_method(cfg) -> bool:
    from .plugins import method_class

    return getattr(method_class(cfg), "fp16", True)


def _online(cfg) -> float:
    """The expected number of clients online over the whole run (availability a number, or the profiles' mean)."""
    p = cfg.availability_mean if cfg.availability in ("size", "tail") else float(cfg.availability)
    return p * cfg.clients * cfg.rounds


RATE = 1000.0  # samples trained per simulated second by a client of speed 1


def client_speeds(speed_sigma: float, speed_file: str | None, num_clients: int, seed: int) -> np.ndarray:
    """The clients' speeds (engine.faults' time model): from ``speed_file``, else log-normal with median 1 and
    ``speed_sigma``, drawn from the run's seed."""
    if speed_file is not None:
        return read_speeds(speed_file, num_clients)
    return np.exp(speed_sigma * np.random.default_rng([seed, Purpose.SPEED]).standard_normal(num_clients))


def _fastest(cfg) -> float:
    """Simulated seconds of the fastest client's round at best: one sample (every client holds one) at the
    highest speed any client has (engine.faults: n x E / (RATE x speed))."""
    speeds = client_speeds(float(cfg.speed_sigma), cfg.speed_file, cfg.clients, cfg.seed)
    return max(cfg.local_epochs, 1) / (RATE * float(speeds.max()))


FAST_RUN = {"dataset": "digits", "clients": 4, "rounds": 1}  # the settings the relations' examples add to theirs
RELATIONS: list[Relation] = [
    requires("partition", lambda c: bool(c.partition_file), "partition file needs --partition-file FILE.json",
             when=lambda c: c.partition == "file", others=("partition_file",), bad=({"partition": "file"},)),
    requires("partition", lambda c: has_capability(_loader(c), "natural_groups"),
             lambda c: f"partition natural needs a dataset with its own users ({having(DATASETS, 'natural_groups')}); "
                       f"{c.dataset} has none", when=lambda c: c.partition == "natural", others=("dataset",),
             bad=({"partition": "natural"},)),
    _reads("balance", bad=True),
    _reads("alpha", "--alpha", bad=0.1),
    _reads("tau", bad=3.0),
    _reads("shards_per_client", bad=3),
    _reads("classes_per_client", bad=3),
    _reads("min_client_size", bad=2),
    applies_when("tail_classes", lambda c: c.lt_profile == "step",
                 lambda c: f"--tail-classes applies to --lt-profile step, not {c.lt_profile or 'the dataset default'}; "
                           f"drop it or add --lt-profile step",
                 others=("lt_profile",), bad=({"tail_classes": 5},)),
    *[applies_when(col, lambda c: getattr(_loader(c), "columns", False),
                   f"--{col.replace('_', '-')} applies to Hugging Face datasets (--dataset hf:NAME), not {{dataset}}; "
                   f"drop it", others=("dataset",), bad=({col: "x"},)) for col in ("image_column", "label_column")],
    applies_when("partition_args", lambda c: hasattr(PARTITIONS.get(c.partition), "check_args"),
                 "partition arguments (--set partition.KEY=VALUE, [partition_args]) apply to Flower Datasets "
                 "partitions (--partition flwr:CLASS), not {partition}; drop them", others=("partition",),
                 bad=({"params": {"partition.alpha": "0.5"}},)),
    applies_when("image_size", lambda c: has_capability(_loader(c), "image_size"),
                 lambda c: f"--image-size applies to {having(DATASETS, 'image_size', ' and ')}, not {c.dataset}; "
                           f"drop it", others=("dataset",), bad=({"image_size": 64},)),
    applies_when("synthetic_per_class", lambda c: has_capability(_loader(c), "per_class"),
                 lambda c: f"--synthetic-per-class applies to {having(DATASETS, 'per_class', ' and ')}, not "
                           f"{c.dataset}; drop it", others=("dataset",), bad=({"synthetic_per_class": 10},)),
    requires("participation", lambda c: share_problem("participation", c.participation, c.clients) is None,
             lambda c: share_problem("participation", c.participation, c.clients, " per round"),
             when=lambda c: True, others=("clients",), bad=({"participation": 5},)),
    requires("eval_clients", lambda c: share_problem("eval-clients", c.eval_clients, c.clients) is None,
             lambda c: share_problem("eval-clients", c.eval_clients, c.clients), when=lambda c: True,
             others=("clients",), bad=({"eval_clients": 50},)),
    requires("cuda_graphs", lambda c: c.device.startswith("cuda"),
             "--cuda-graphs needs --device cuda (graphs are captured on a GPU); drop it on a CPU", others=("device",),
             bad=({"cuda_graphs": True},)),
    requires("cuda_graphs", lambda c: c.client_parallel != "off" and c.precision != "fp16",
             lambda c: "--cuda-graphs replays batched clients' steps, and " +
                       ("--client-parallel off" if c.client_parallel == "off" else "fp16 (its gradient scaler)") +
                       " trains one client after another; use --client-parallel auto or N, and fp32 or bf16",
             others=("client_parallel", "precision")),
    requires("precision", lambda c: c.device.startswith("cuda"),
             "precision fp16 needs a CUDA device (a CPU has no fast fp16 training); use --precision bf16 or fp32 on "
             "a CPU", when=lambda c: c.precision == "fp16", others=("device",), bad=({"precision": "fp16"},)),
    requires("precision", _fp16_method, "method {method} trains in a loop of its own, without fp16's gradient "
             "scaler; use --precision bf16", when=lambda c: c.precision == "fp16", others=("method",)),
    applies_when("lr_milestones", lambda c: c.lr_schedule == "step",
                 "lr-milestones apply to --lr-schedule step, not {lr_schedule}; drop them or add --lr-schedule step",
                 others=("lr_schedule",), bad=({"lr_milestones": "1"},)),
    requires("lr_schedule", lambda c: bool(c.lr_milestones), "--lr-schedule step needs --lr-milestones (e.g. 160,240)",
             when=lambda c: c.lr_schedule == "step", others=("lr_milestones",), bad=({"lr_schedule": "step"},)),
    requires("lr_gamma", lambda c: _peak_lr(c) <= FLOAT32_MAX,
             lambda c: f"lr-gamma {c.lr_gamma:g} takes the lr past a float32 ({c.lr:g} x {c.lr_gamma:g}^"
                       f"{_decays(c)}); a decay factor is below 1 (e.g. 0.1)", when=lambda c: c.lr_schedule == "step",
             others=("lr", "lr_milestones", "rounds"),
             bad=({"lr_schedule": "step", "lr_milestones": "1", "rounds": 2, "lr_gamma": 1e39},)),
    excludes("speed_file", "speed_sigma", "--speed-file and --speed-sigma exclude each other: the file gives the "
                                          "speeds; drop one"),
    applies_when("availability_mean", lambda c: c.availability in ("size", "tail"),
                 "--availability-mean applies to --availability size or tail, not {availability}; drop it (a "
                 "number P is every client's probability itself)", others=("availability",),
                 bad=({"availability": "0.5", "availability_mean": 0.3}, {"availability_mean": 0.3})),
    applies_when("availability_skew", lambda c: c.availability == "tail",
                 "--availability-skew applies to --availability tail, not {availability}; drop it",
                 others=("availability",), bad=({"availability": "size", "availability_skew": 1},)),
    requires("availability", lambda c: _online(c) >= 1,
             lambda c: f"availability {c.availability_mean if c.availability in ('size', 'tail') else c.availability}"
                       f" puts {_online(c):.3g} clients online in the whole run ({c.rounds} rounds of {c.clients} "
                       f"clients): nothing would train; use at least {1 / (c.clients * c.rounds):.3g}",
             when=lambda c: c.availability != "always", others=("availability_mean", "clients", "rounds"),
             bad=({"availability": "1e-300"}, {"availability": "size", "availability_mean": 1e-30})),
    # (participation is valid here: its relation comes first)
    applies_when("over_select", lambda c: clients_per_round(c.clients, c.participation) < c.clients,
                 lambda c: f"--over-select {c.over_select:g} applies when a round samples fewer than all clients; "
                           f"participation {c.participation:g} takes all {c.clients} already; drop it or lower "
                           f"--participation", others=("participation", "clients"),
                 bad=({"over_select": 2, "participation": 1.0},)),
    # (participation is valid here too)
    requires("workers", lambda c: worker_count(c) <= clients_per_round(c.clients, c.participation),
             lambda c: f"--workers {c.workers} is more than the {clients_per_round(c.clients, c.participation)} "
                       f"clients a round trains; give at most {clients_per_round(c.clients, c.participation)}, or "
                       f"auto", others=("participation", "clients"), bad=({"workers": "50"},)),
    requires("workers", lambda c: str(c.device).startswith("cpu"),
             "--workers trains clients in CPU processes; on {device} the batched executor trains a round's clients "
             "together (--client-parallel): drop --workers", when=lambda c: worker_count(c) > 0, others=("device",),
             bad=({"workers": "2", "device": "cuda"},)),
    requires("workers", lambda c: not gpu_visible(),
             "--workers forks CPU processes, which cannot run autograd where a GPU is visible (torch's device "
             "threads); hide it for a CPU run (CUDA_VISIBLE_DEVICES= fedlt run ...) or train a round's clients "
             "together on it (--device cuda --client-parallel auto)", when=lambda c: worker_count(c) > 0,
             others=("device",)),
    requires("workers", lambda c: str(c.client_parallel) == "auto",
             "--workers and --client-parallel {client_parallel} both decide how a round's clients train; drop one",
             when=lambda c: worker_count(c) > 0, others=("client_parallel",),
             bad=({"workers": "2", "client_parallel": "2"}, {"workers": "2", "client_parallel": "off"})),
    requires("workers", lambda c: worker_count(c) * (c.threads or 1) <= available_cores(),
             lambda c: f"--workers {worker_count(c)} x --threads {c.threads or 1} asks for "
                       f"{worker_count(c) * (c.threads or 1)} threads, past the {available_cores()} cores this process "
                       f"may use; lower --workers or --threads (or use --workers auto)",
             when=lambda c: worker_count(c) > 0, others=("threads",), bad=({"workers": "2", "threads": 4096},)),
    *only_with_relations(RunConfig),  # the "applies only with" relations the settings declare (only_with=)
    applies_when("dp_accountant", lambda c: c.dp == "client" or c.dp_accountant == "rdp",
                 "--dp-accountant pld applies to --dp client (--dp sample accounts each client's DP-SGD steps with "
                 "dp-accounting's RDP accountant); add --dp client or drop it", others=("dp",),
                 bad=({"dp_accountant": "pld"}, {"dp": "sample", "dp_clip": 1.0, "dp_noise": 1.0,
                                                  "dp_accountant": "pld"})),
    applies_when("dp_counts_noise", lambda c: c.dp == "sample" and reads_counts(_method_class(c)),
                 lambda c: f"--dp-counts-noise noises the class counts that a method's loss reads under --dp sample "
                           f"({', '.join(counts_methods())})"
                           + ("; add --dp sample or drop it" if c.dp != "sample" else
                              f", and method {c.method} reads none; drop it"), others=("dp", "method"),
                 bad=({"dp_counts_noise": 3.0}, {"dp": "sample", "dp_clip": 1.0, "dp_noise": 1.0,
                                                 "dp_counts_noise": 3.0})),
    applies_when("dp_stats_clip",
                 lambda c: c.dp != "client" or bool(class_means(getattr(_method_class(c), "sends", ()))),
                 lambda c: f"--dp-stats-clip clips the class statistics of a method that sends them as noised "
                           f"per-class means ({', '.join(n for n, cls in METHODS.items() if class_means(cls.sends))}), "
                           f"and method {c.method} sends none; drop it", others=("method",),
                 bad=({"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0, "dp_stats_clip": 2.0},)),
    requires("dp_clip_quantile", lambda c: dp_noise_of(c) < 2 * count_noise(c),
             lambda c: f"adaptive clipping splits the noise multiplier {dp_noise_of(c):g} between the update and the "
                       f"count of unclipped updates, whose noise {count_noise(c):g} must exceed half of it; raise "
                       f"--dp-count-noise above {dp_noise_of(c) / 2:g}, or lower the noise (--dp-noise, or a larger "
                       f"--dp-epsilon)",
             when=lambda c: c.dp == "client" and c.dp_clip_quantile is not None
             and (c.dp_noise is None) != (c.dp_epsilon is None),
             others=("dp_noise", "dp_epsilon", "dp_delta", "dp_count_noise", "participation", "clients", "rounds"),
             bad=({"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0, "dp_clip_quantile": 0.5,
                   "dp_count_noise": 0.4},)),
    # --finetune head/lora (core.finetune): a method refused where it declares a need the mode cannot meet
    requires("finetune", lambda c: not finetune_refusal(_method_class(c), c.finetune),
             lambda c: f"--finetune {c.finetune}: method {c.method} {finetune_refusal(_method_class(c), c.finetune)}; "
                       f"choose --finetune {'lora or full' if c.finetune == 'head' else 'full'} or another method",
             when=lambda c: c.finetune != "full", others=("method",),
             bad=({"finetune": "head", "method": "fedbabu"}, {"finetune": "lora", "method": "fedgpa"})),
    *[applies_when(name, lambda c: c.finetune == "lora", f"--{name.replace('_', '-')} applies to --finetune lora, "
                   f"not {{finetune}}; add --finetune lora or drop it", others=("finetune",), bad=({name: value},))
      for name, value in (("lora_rank", 4), ("lora_alpha", 16.0), ("lora_dropout", 0.1), ("lora_targets", "fc"),
                          ("lora_agg", "ffa"))],
    applies_when("bn_stats", lambda c: c.finetune == "lora", "--bn-stats local applies to --finetune lora (under full "
                 "BatchNorm trains as the model does, under head the features are computed once, with the pre-trained "
                 "statistics); add --finetune lora or drop it", others=("finetune",),
                 bad=({"bn_stats": "local"}, {"bn_stats": "local", "finetune": "head"})),
    # pre-trained models (fedlt.pretrained)
    applies_when("pretrained_size", lambda c: is_pretrained(c.model),
                 lambda c: f"--pretrained-size applies to pre-trained models (--model efficientnet-lite0 or "
                           f"hf:<hub id or directory>), not {c.model or 'the dataset default'}; drop it",
                 others=("model",), bad=({"pretrained_size": 64},)),
    requires("head_fixed", lambda c: c.finetune != "head" or c.local_epochs == 0,
             "--head-fixed with --finetune head leaves nothing to train (zero-shot CLIP): add --local-epochs 0 to "
             "evaluate it, or drop --head-fixed", when=lambda c: c.head_fixed, others=("finetune", "local_epochs"),
             bad=({"head": "clip-text", "head_fixed": True, "finetune": "head"},)),
    requires("head", lambda c: is_clip(c.model),
             lambda c: f"--head clip-text needs a CLIP model: --model hf:<a CLIP model's hub id or directory> (e.g. "
                       f"hf:openai/clip-vit-base-patch32), not {c.model or 'the dataset default'}; or --head linear",
             when=lambda c: c.head == "clip-text", others=("model",), bad=({"head": "clip-text"},)),
    applies_when("head_fixed", lambda c: c.head == "clip-text", "--head-fixed applies to --head clip-text; add it "
                 "or drop --head-fixed", others=("head",), bad=({"head_fixed": True},)),
    requires("dp", lambda c: c.dp_clip is not None,
             lambda c: "--dp client needs --dp-clip C, the norm each client's update is clipped to (e.g. 1.0; McMahan "
                       "et al. tune it to the median update norm)" if c.dp == "client" else
                       "--dp sample needs --dp-clip C, the norm each sample's gradient is clipped to (e.g. 1.0; tune it "
                       "to the median per-sample gradient norm, dp_grad_norm in metrics.jsonl)",
             when=lambda c: c.dp != "off", others=("dp_clip",),
             bad=({"dp": "client", "dp_noise": 1.0}, {"dp": "sample", "dp_noise": 1.0})),
    requires("dp", lambda c: (c.dp_noise is None) != (c.dp_epsilon is None),
             "--dp {dp} needs exactly one of --dp-noise Z and --dp-epsilon E (the noise solved for it)",
             when=lambda c: c.dp != "off", others=("dp_noise", "dp_epsilon"),
             bad=({"dp": "client", "dp_clip": 1.0}, {"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0,
                                                      "dp_epsilon": 8.0}, {"dp": "sample", "dp_clip": 1.0})),
    requires("dp", lambda c: dp_refusal(c)[0] != "pool",
             lambda c: f"--dp {c.dp} protects each client's data in what it sends; method {c.method} trains on every "
                       f"client's data pooled in one place, which no {c.dp}-level guarantee covers: choose a "
                       f"federated method", when=lambda c: c.dp != "off", others=("method",),
             bad=({"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0, "method": "centralized"},
                  {"dp": "sample", "dp_clip": 1.0, "dp_noise": 1.0, "method": "centralized"})),
    requires("dp", lambda c: dp_refusal(c)[0] != "unprotected",
             lambda c: f"--dp {c.dp} protects the model {'update' if c.dp == 'client' else 'DP-SGD trains'} only, and "
                       f"method {c.method}'s clients also send {', '.join(dp_refusal(c)[1])}, which would leave "
                       f"unprotected; choose a method whose clients send only the model (fedavg, fedprox, fedavgm, "
                       f"fedadam)" + (f", or one whose class statistics it privatises "
                                      f"({', '.join(n for n, k in METHODS.items() if class_means(k.sends))})"
                                      if c.dp == "client" else ""),
             when=lambda c: c.dp != "off", others=("method",),
             bad=({"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0, "method": "ccvr"},
                  {"dp": "sample", "dp_clip": 1.0, "dp_noise": 1.0, "method": "ccvr"})),
    requires("dp", lambda c: dp_refusal(c)[0] != "server",
             lambda c: f"--dp client noises only the mean of the clipped updates, and in method {c.method} "
                       f"{dp_refusal(c)[1][0]}; choose a method whose server takes their mean (fedavg, fedprox, "
                       f"fedavgm, fedadam), or --dp sample",
             when=lambda c: c.dp == "client", others=("method",),
             bad=({"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0, "method": "gbme"},)),
    requires("dp", lambda c: dp_refusal(c)[0] != "undeclared",
             lambda c: f"--dp sample runs DP-SGD in a method's described local steps whose loss of one sample reads no "
                       f"other sample, and method {c.method} does not declare that ("
                       f"{''.join(dp_refusal(c)[1][:1]) or UNDECLARED}); choose {words(dp_sample_methods(), 'or')}",
             when=lambda c: c.dp == "sample", others=("method",),
             bad=({"dp": "sample", "dp_clip": 1.0, "dp_noise": 1.0, "method": "fedgrab"},)),
    requires("dp", lambda c: worker_count(c) == 0 and str(c.client_parallel) in ("auto", "off")
             and c.precision != "fp16",
             "--dp sample trains a round's clients one after another in this process, in fp32 or bf16 (each keeps its "
             "accountant here; DP-SGD vectorises over a client's samples instead): drop --workers, --client-parallel "
             "N and --precision fp16", when=lambda c: c.dp == "sample",
             others=("workers", "client_parallel", "precision"),
             bad=({"dp": "sample", "dp_clip": 1.0, "dp_noise": 1.0, "client_parallel": "2"},)),
    requires("dp", lambda c: c.availability == "always" and c.drop_rate == 0 and c.round_deadline is None
             and c.over_select == 1,
             "--dp client samples every client with probability participation / clients each round, as its "
             "accountant assumes: drop --availability, --drop-rate, --round-deadline and --over-select",
             when=lambda c: c.dp == "client", others=("availability", "drop_rate", "round_deadline", "over_select"),
             bad=({"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0, "drop_rate": 0.5},)),
    requires("dp_delta", lambda c: delta_problem(c.dp_delta, c.clients, "client", "the run's clients") is None,
             lambda c: delta_problem(c.dp_delta, c.clients, "client", "the run's clients"),
             when=lambda c: c.dp == "client" and c.dp_delta is not None, others=("clients",),
             bad=({"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0, "dp_delta": 0.25},
                  {"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0, "clients": 10, "dp_delta": 0.1})),
    # noise larger than the clip on the averaged update, or a budget the first round passes: refused before the run
    requires("dp", lambda c: dp_mean_noise(c) <= 1,
             lambda c: f"--dp client: the noise multiplier {dp_noise_of(c):.3g} ({noise_source(c)}) puts noise of std "
                       f"{dp_mean_noise(c):.3g} x --dp-clip on the averaged update of the "
                       f"{clients_per_round(c.clients, c.participation)} clients a round, more than any clipped "
                       f"update moves it, so nothing can train; train more clients a round (--participation, "
                       f"--clients), or "
                       + ("use a smaller --dp-noise" if c.dp_noise is not None else
                          "fewer --rounds, or allow a larger --dp-epsilon"),
             when=lambda c: c.dp == "client" and (c.dp_noise is None) != (c.dp_epsilon is None),
             others=("dp_noise", "dp_epsilon", "participation", "clients", "rounds"),
             bad=({"dp": "client", "dp_clip": 1.0, "dp_epsilon": 1e-6, "dp_delta": 1e-5},
                  {"dp": "client", "dp_clip": 1.0, "dp_noise": 4.0})),
    requires("dp_budget", lambda c: first_epsilon(c) <= c.dp_budget,
             lambda c: f"--dp-budget {c.dp_budget:g} is below the first round's epsilon {first_epsilon(c):.3g} (noise "
                       f"multiplier {dp_noise_of(c):.3g}, sampling rate "
                       f"{clients_per_round(c.clients, c.participation) / c.clients:.3g}, delta {dp_delta_of(c):.3g}), "
                       f"so no round could run; raise --dp-budget, or spend less a round: more noise (--dp-noise, or "
                       f"a smaller --dp-epsilon) or fewer clients a round (--participation)",
             when=lambda c: c.dp == "client" and c.dp_budget is not None and (c.dp_noise is None) != (c.dp_epsilon
                                                                                                      is None),
             others=("dp_noise", "dp_epsilon", "dp_delta", "participation", "clients"),
             bad=({"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0, "dp_budget": 0.001},)),
    requires("secagg", lambda c: secagg.runs_under(_method_class(c)),
             lambda c: f"--secagg hands the server only the weighted mean of the clients' updates, and method "
                       f"{c.method} needs more: {secagg.why_not(_method_class(c))}; drop --secagg or choose a method "
                       f"that averages ({', '.join(secagg_methods()[:6])}, ...)",
             when=lambda c: c.secagg, others=("method",),
             bad=({"secagg": True, "participation": 1.0, "method": "ccvr"},
                  {"secagg": True, "participation": 1.0, "method": "fedexp"})),
    requires("secagg", lambda c: clients_per_round(c.clients, c.participation) >= secagg_clients(c),
             lambda c: f"--secagg needs at least {secagg_clients(c)} clients a round (SecAgg+ splits each client's "
                       f"secrets into shares: at least 3, more than --secagg-threshold, --secagg-shares where given), "
                       f"and this run has {clients_per_round(c.clients, c.participation)}: raise --participation or "
                       f"--clients, or lower the threshold",
             when=lambda c: c.secagg, others=("participation", "clients", "secagg_threshold", "secagg_shares"),
             bad=({"secagg": True}, {"secagg": True, "participation": 1.0, "secagg_threshold": 4})),
    requires("secagg_threshold", lambda c: c.secagg_threshold < c.secagg_shares,
             "--secagg-threshold {secagg_threshold} must be below --secagg-shares {secagg_shares} (a client's "
             "share-holders include itself); lower the threshold or raise the shares",
             when=lambda c: c.secagg and c.secagg_shares is not None and c.secagg_threshold is not None,
             others=("secagg_shares",),
             bad=({"secagg": True, "participation": 1.0, "secagg_shares": 3, "secagg_threshold": 3},)),
    requires("secagg_levels", lambda c: secagg.fits(clients_per_round(c.clients, c.participation), c.secagg_levels),
             lambda c: f"--secagg-levels {c.secagg_levels} x {clients_per_round(c.clients, c.participation)} clients "
                       f"a round passes SecAgg+'s modulus 2^32: the masked sum would wrap round; use at most "
                       f"{(secagg.MODULUS - 1) // clients_per_round(c.clients, c.participation)} levels",
             when=lambda c: c.secagg, others=("participation", "clients"),
             bad=({"secagg": True, "participation": 1.0, "secagg_levels": 2 ** 30},)),
    requires("secagg", lambda c: c.drop_rate == 0 and c.round_deadline is None and c.over_select == 1,
             "--secagg sums the replies before the server sees any, and --drop-rate, --round-deadline and "
             "--over-select drop replies after they arrive: drop them (a client that really drops out of a round is "
             "SecAgg+'s to handle)", when=lambda c: c.secagg, others=("drop_rate", "round_deadline", "over_select"),
             bad=({"secagg": True, "participation": 1.0, "drop_rate": 0.5},)),
    requires("secagg_clip_range", lambda c: c.secagg_clip_range >= c.dp_clip,
             "--secagg-clip-range {secagg_clip_range:g} is below --dp-clip {dp_clip:g}: SecAgg+ would clip entries "
             "of updates DP has already clipped; use a range of at least the DP clip",
             when=lambda c: c.secagg and c.dp == "client" and c.dp_clip is not None, others=("dp_clip",),
             bad=({"secagg": True, "participation": 1.0, "dp": "client", "dp_clip": 10.0, "dp_noise": 1.0},)),
    requires("tracker", lambda c: "none" not in c.tracker or len(set(c.tracker)) == 1,
             lambda c: f"--tracker none means no tracker and cannot go with {words(sorted(set(c.tracker) - {'none'}), 'and')}"
                       f"; drop none or the others", bad=({"tracker": "none,tensorboard"},)),
]
# the deadline against the clients' speeds (a speed file is read first: its own errors come before this one)
TIMING: list[Relation] = [
    requires("round_deadline", lambda c: c.round_deadline >= _fastest(c),
             lambda c: f"round-deadline {c.round_deadline:g} s is shorter than any client's round (at best "
                       f"{_fastest(c):.3g} s: one sample at the fastest client's speed); every reply would be lost: "
                       f"use at least {_fastest(c):.3g}", when=lambda c: c.round_deadline is not None,
             others=("speed_sigma", "speed_file", "local_epochs"), bad=({"round_deadline": 1e-30},)),
]


def check_trackers(names) -> None:
    """A tracker named but not installed: one line with the command that installs it, before anything runs."""
    import importlib.util

    for name in names:
        module, install = TRACKERS.get(name, (None, ""))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"--tracker {name} needs the {module} package, which is not installed: {install}")


def having(registry, attr: str, last: str = ", ") -> str:
    """The names of a registry's entries that have ``attr`` set ("femnist, inat-user, imu")."""
    names = [n for n, obj in registry.items() if has_capability(obj, attr)]
    return last.join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else "".join(names)


def setting_rows() -> list[dict[str, str]]:
    """Every run setting described for a table (``fedlt list settings``, the site's settings page): its
    declaration, and which partitions read it (each partition declares the settings it reads)."""
    from .data.partition import partitions_reading

    out = rows(RunConfig, groups=("data", "training"))
    for r in out:
        users = partitions_reading(r["name"])
        if users:
            r["help"] += f" (read by the {words(users, 'and')} partition{'s' if len(users) > 1 else ''})"
    return out


def check_device(device: str) -> None:
    """cpu, cuda or cuda:N, and the GPU must be there."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda requested but no CUDA device is available; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device} does not exist: {torch.cuda.device_count()} GPU(s) are visible")
