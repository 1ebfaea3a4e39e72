"""Run configuration: defaults (the fmnist-lt protocol of docs/protocol.md), presets, TOML files and
command-line overrides, validated before anything is loaded or written."""
from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core.privacy_settings import (PrivacySettings, counts_methods, dp_sample_methods,  # noqa: F401 (read here)
                                    relations as privacy_relations, secagg_methods)
from .core.finetune import relations as finetune_relations
from .core.spec import (RunSpec, check_device, clients_per_round, parse_milestones, relations as spec_relations,
                        scheduled_lr)
from .pretrained import RELATIONS as pretrained_relations
from .decl import (DATA, INT32, OUTPUT, TRAIN, Relation, applies_when, byte_size, check,
                   check_relations, check_values, coerce, declared_in, excludes, only_with_relations, requires, rows,
                   settings_of, setting, show, words)
from .errors import ConfigError
from .papers import presets as paper_presets
from .registry import DATASETS, METHODS, MODELS, PARTITIONS

DEFAULT_BUDGET = 2_000_000_000  # bytes of client states in memory: --client-state-memory 2GB (engine.clientstate)


def _ratio_hint(rho: float) -> str:
    return f"did you mean {1 / rho:g} (the FedLoGe code writes n_min/n_max)?" if 0 < rho < 1 else ""


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
    tail_classes: int = setting(3, "number of tail classes of the step profile", low=0, limit=10**6, group=DATA,
                                only_with=("lt_profile", ("step",)))
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
                                       low=0, low_open=True, high=1, group=TRAIN,
                                       only_with=("availability", ("size", "tail"), {"availability": "0.5"},
                                                  "a number P is every client's probability itself"))
    availability_skew: float = setting(5.0, "--availability tail: a client's weight is exp(-skew x its tail score "
                                            "in [0, 1]); 0: every client alike", low=0, high=50, group=TRAIN,
                                      only_with=("availability", ("tail",), {"availability": "size"}))
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
    # differential privacy and secure aggregation (core.privacy_settings: their declarations and relations)
    dp: str = declared_in(PrivacySettings, "dp")
    dp_clip: float | None = declared_in(PrivacySettings, "dp_clip")
    dp_noise: float | None = declared_in(PrivacySettings, "dp_noise")
    dp_epsilon: float | None = declared_in(PrivacySettings, "dp_epsilon")
    dp_delta: float | None = declared_in(PrivacySettings, "dp_delta")
    dp_clip_quantile: float | None = declared_in(PrivacySettings, "dp_clip_quantile")
    dp_clip_lr: float = declared_in(PrivacySettings, "dp_clip_lr")
    dp_count_noise: float | None = declared_in(PrivacySettings, "dp_count_noise")
    dp_stats_clip: float = declared_in(PrivacySettings, "dp_stats_clip")
    dp_accountant: str = declared_in(PrivacySettings, "dp_accountant")
    dp_budget: float | None = declared_in(PrivacySettings, "dp_budget")
    dp_counts_noise: float = declared_in(PrivacySettings, "dp_counts_noise")
    dp_noise_seed: str | None = declared_in(PrivacySettings, "dp_noise_seed")
    secagg: bool = declared_in(PrivacySettings, "secagg")
    secagg_shares: int | None = declared_in(PrivacySettings, "secagg_shares")
    secagg_threshold: int | None = declared_in(PrivacySettings, "secagg_threshold")
    secagg_clip_range: float = declared_in(PrivacySettings, "secagg_clip_range")
    secagg_levels: int = declared_in(PrivacySettings, "secagg_levels")
    secagg_max_weight: float | None = declared_in(PrivacySettings, "secagg_max_weight")
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
        if isinstance(merged.get(k), str) and not merged[k].strip():  # an unset shell variable, say: not "no file"
            flag = "--" + k.replace("_", "-")
            raise ConfigError(f"{flag} is empty: give the path of the file, or leave {flag} out")
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


def count_file_clients(path: str) -> int:
    """How many clients a partition file holds (its content is checked when the federation is built)."""
    from .jsonutil import read_json

    doc = read_json(path, f"partition file {path}")
    clients = doc.get("clients", doc) if isinstance(doc, dict) else doc
    if not isinstance(clients, (dict, list)) or not clients:
        raise ConfigError(f"partition file {path}: expected a clients mapping or a list of index lists")
    return len(clients)


def validate(cfg: RunConfig, base: dict | None = None) -> None:
    """Every setting against its declaration (type, range, choices, names), then the relations between settings
    (:data:`RELATIONS`) and the checks that need the method, the dataset's files or torch. Raises ConfigError
    with a one-line message. ``base``: the preset's settings (a value a preset gives is not the user's: a
    paper's protocol that states a setting its partition ignores stays as the paper wrote it). The settings that
    need the engine's time model (a speed file, the round deadline) are checked one layer up, when a run is
    prepared (:func:`fedlt.engine.faults.check_settings`)."""
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


def _method_class(cfg):
    from .plugins import method_class

    return method_class(cfg)


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


def _online(cfg) -> float:
    """The expected number of clients online over the whole run (availability a number, or the profiles' mean)."""
    p = cfg.availability_mean if cfg.availability in ("size", "tail") else float(cfg.availability)
    return p * cfg.clients * cfg.rounds


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
    *spec_relations(_method_class),  # core.spec: precision and the lr schedule
    excludes("speed_file", "speed_sigma", "--speed-file and --speed-sigma exclude each other: the file gives the "
                                          "speeds; drop one"),
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
    *finetune_relations(_method_class), *pretrained_relations,  # core.finetune, fedlt.pretrained
    *privacy_relations(_method_class, worker_count),  # core.privacy_settings
    requires("tracker", lambda c: "none" not in c.tracker or len(set(c.tracker)) == 1,
             lambda c: f"--tracker none means no tracker and cannot go with {words(sorted(set(c.tracker) - {'none'}), 'and')}"
                       f"; drop none or the others", bad=({"tracker": "none,tensorboard"},)),
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
