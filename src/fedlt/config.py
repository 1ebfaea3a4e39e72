"""Run configuration: defaults (the fmnist-lt protocol of docs/protocol.md), presets, TOML files and
command-line overrides, validated before anything is loaded or written."""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .core.spec import LR_SCHEDULES, scheduled_lr
from .decl import FLOAT32_MAX, byte_size, check, check_values, coerce, rows, settings_of, setting, show, words
from .errors import ConfigError
from .papers import presets as paper_presets
from .registry import DATASETS, METHODS, MODELS, PARTITIONS

DEFAULT_BUDGET = 2_000_000_000  # bytes of client states in memory: --client-state-memory 2GB (engine.clientstate)


def parse_milestones(value: Any) -> tuple[int, ...]:
    """``"160,240"``, ``[160, 240]`` or ``()`` -> ``(160, 240)``; a one-line ConfigError for anything else."""
    bad = ConfigError(f"lr-milestones expects comma-separated round numbers (e.g. 160,240), got {show(value)}")
    if isinstance(value, str):  # "160,240" or "[160, 240]" (a Flower run config's text of a list)
        text = value.strip()
        text = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        if "[" in text or "]" in text:
            raise bad
        items = text.split(",")
    elif isinstance(value, (list, tuple)) or not value:
        items = list(value or ())
    else:
        raise bad
    try:
        out = tuple(int(str(v).strip()) for v in items if str(v).strip() and str(v).strip().isascii())
    except ValueError:
        raise bad from None
    if len(out) != sum(bool(str(v).strip()) for v in items) or isinstance(value, bool):
        raise bad
    if any(m < 1 for m in out) or list(out) != sorted(set(out)):
        raise ConfigError(f"lr-milestones must be increasing round numbers >= 1, got {show(value)}")
    return out


def _milestones_text(value: Any) -> str:
    """The canonical text of lr_milestones ("160,240"), from text or a TOML list."""
    return ",".join(map(str, parse_milestones(value)))


def _ratio_hint(rho: float) -> str:
    return f"did you mean {1 / rho:g} (the FedLoGe code writes n_min/n_max)?" if 0 < rho < 1 else ""


DATA, TRAIN, OUTPUT = "data", "training", "evaluation and output"
# experiment trackers (fedlt.trackers): the package each needs, and how to install it
TRACKERS = {"mlflow": ("mlflow", "pip install 'fedlt[mlflow]'"), "wandb": ("wandb", "pip install 'fedlt[wandb]'"),
            "tensorboard": ("tensorboard", "pip install 'fedlt[tensorboard]'")}
INT32 = 2**31 - 1


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
    clients: int = setting(20, "number of clients K", low=1, limit=10**6, group=DATA)
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
    rounds: int = setting(50, "communication rounds", low=1, limit=10**6, group=TRAIN)
    participation: float = setting(0.5, "clients per round: a fraction (<= 1) or a count (> 1)", low=0,
                                   low_open=True, group=TRAIN)
    local_epochs: int = setting(2, "local epochs", low=0, limit=10**4, group=TRAIN)
    batch_size: int = setting(32, "local batch size", low=1, high=INT32, group=TRAIN)
    lr: float = setting(0.05, "local learning rate", low=0, low_open=True, group=TRAIN)
    lr_schedule: str = setting("constant", "lr per round: constant, step (x lr-gamma after each milestone), cosine "
                                           "(to 0 over the rounds)", choices=LR_SCHEDULES, group=TRAIN)
    lr_milestones: str = setting("", "step schedule: rounds after which the lr decays (FedDr+: 160,240; a TOML "
                                     "list too)", parse=_milestones_text, metavar="R1,R2", group=TRAIN)
    lr_gamma: float = setting(0.1, "step schedule: decay factor", low=0, low_open=True, group=TRAIN)
    momentum: float = setting(0.9, "SGD momentum", low=0, high=1, high_open=True, group=TRAIN)
    weight_decay: float = setting(0.0, "weight decay", low=0, group=TRAIN)
    seed: int = setting(0, "the one seed of the run", low=0, high=2**63 - 1, group=TRAIN)
    device: str = setting("cpu", "torch device: cpu, cuda or cuda:N", group=TRAIN, result=False)
    threads: int | None = setting(None, "torch CPU threads", low=1, high=4096, group=TRAIN, result=False,
                                  none_means="torch's default")
    precision: str = setting("fp32", "training precision: bf16 or fp16 autocast, fp16 with a gradient scaler "
                                     "(CUDA only)", choices=("fp32", "bf16", "fp16"), group=TRAIN)
    channels_last: str = setting("auto", "channels_last memory format for convolutional models (auto: on CUDA "
                                         "under bf16/fp16)", choices=("auto", "on", "off"), group=TRAIN)
    client_parallel: str = setting("auto", "train a round's clients together (methods that describe their local "
                                           "steps): auto (all at once on CUDA, one after another on a CPU), off, "
                                           "or N per chunk", choices=("auto", "off"), numbers=int, low=1,
                                   unit="clients", group=TRAIN)
    cuda_graphs: bool = setting(False, "replay each batched step as one CUDA graph (fewer launches; "
                                       "--client-parallel on CUDA)", group=TRAIN)
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
                                       group=TRAIN, result=False)
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
                               high=1, metavar="P", group=TRAIN)
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
    allow_large: bool = setting(False, "allow values past the limits (rounds, clients, local epochs, ...) that "
                                       "catch typos, on purpose", group=TRAIN, result=False)
    # evaluation and output
    eval_every: int = setting(5, "evaluate every N rounds", low=1, high=INT32, group=OUTPUT)
    eval_clients: float = setting(1.0, "PM over every client (1), or over a fixed, seeded sample of them: a "
                                       "fraction (< 1) or a count (> 1); the summary says 'PM over 500 of 100,000 "
                                       "clients'", low=0, low_open=True, metavar="N|F", group=OUTPUT)
    split: str = setting("fedloge", "many/medium/few split", choices=("fedloge", "fixed"), group=OUTPUT)
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


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Defaults <- preset <- TOML file <- overrides (command line). Unknown keys are errors."""
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
    merged = {k: coerce(SETTINGS[k], v) for k, v in merged.items()}  # types first: a path is text, ...
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
    validate(cfg)
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
    try:
        s = np.asarray([float(v) for v in doc])
    except (TypeError, ValueError):
        raise ConfigError(f"speed file {path}: every speed must be a number") from None
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise ConfigError(f"speed file {path}: every speed must be a positive finite number")
    return s


def validate(cfg: RunConfig) -> None:
    """Every setting against its declaration (type, range, choices, names), then the checks that relate two
    settings or need the method, the dataset or torch. Raises ConfigError with a one-line message."""
    from .data.partition import partitions_reading
    from .data.split import check_lt_settings, default_lt_profile
    from .plugins import load_method_file, method_class

    if cfg.method_file:  # the methods it registers are names like the built-in ones
        load_method_file(cfg.method_file)
    cfg.allow_large = coerce(SETTINGS["allow_large"], cfg.allow_large)
    if cfg.partition_file:
        cfg.partition = "file"
    check_values(cfg, allow_large=cfg.allow_large)
    if cfg.data_dir and not Path(cfg.data_dir).is_dir():  # that folder or an error, whatever the dataset
        raise ConfigError(f"--data-dir {show(cfg.data_dir)} is {'a file' if Path(cfg.data_dir).exists() else 'not there'}"
                          f"; give the folder that holds the {cfg.dataset} files")
    method_class(cfg).make_params(cfg.params, cfg.allow_large)
    loader = DATASETS.get(cfg.dataset)
    if cfg.partition == "file" and not cfg.partition_file:
        raise ConfigError("partition file needs --partition-file FILE.json")
    check_lt_settings(cfg.dataset, cfg.lt_profile or default_lt_profile(cfg.dataset, cfg.partition, cfg.partition_file),
                      cfg.partition, cfg.partition_file)
    if cfg.partition == "natural" and not getattr(loader, "natural_groups", False):
        raise ConfigError(f"partition natural needs a dataset with its own users ({having(DATASETS, 'natural_groups')}"
                          f"); {cfg.dataset} has none")
    takers = partitions_reading("balance")
    if cfg.balance and cfg.partition not in takers:
        raise ConfigError(f"--balance applies to the {words(takers, 'and')} partitions, not {cfg.partition}")
    if (cfg.image_column or cfg.label_column) and not getattr(loader, "columns", False):
        raise ConfigError(f"--image-column and --label-column apply to Hugging Face datasets (--dataset hf:NAME), "
                          f"not {cfg.dataset}")
    part = PARTITIONS.get(cfg.partition)
    if cfg.partition_args and not hasattr(part, "check_args"):
        raise ConfigError(f"partition arguments (--set partition.KEY=VALUE, [partition_args]) apply to Flower "
                          f"Datasets partitions (--partition flwr:CLASS), not {cfg.partition}")
    if hasattr(part, "check_args"):  # the partitioner made once with its arguments: a bad one fails here
        part.check_args(cfg.clients, cfg.seed, cfg.partition_args)
    if cfg.image_size is not None and not getattr(loader, "image_size", False):
        raise ConfigError(f"--image-size applies to {having(DATASETS, 'image_size', ' and ')}, not {cfg.dataset}")
    if cfg.synthetic_per_class is not None and not getattr(loader, "per_class", False):
        raise ConfigError(f"--synthetic-per-class applies to {having(DATASETS, 'per_class', ' and ')}, "
                          f"not {cfg.dataset}")
    fraction_or_count("participation", cfg.participation, cfg.clients, " per round")
    fraction_or_count("eval-clients", cfg.eval_clients, cfg.clients)
    cp = cfg.client_parallel
    if cfg.cuda_graphs and not cfg.device.startswith("cuda"):
        raise ConfigError("--cuda-graphs needs --device cuda (graphs are captured on a GPU); drop it on a CPU")
    if cfg.cuda_graphs and (cp == "off" or cfg.precision == "fp16"):
        raise ConfigError("--cuda-graphs replays batched clients' steps, and " +
                          ("--client-parallel off" if cp == "off" else "fp16 (its gradient scaler)") +
                          " trains one client after another; use --client-parallel auto or N, and fp32 or bf16")
    if cfg.precision == "fp16" and not cfg.device.startswith("cuda"):
        raise ConfigError("precision fp16 needs a CUDA device (a CPU has no fast fp16 training); use --precision "
                          "bf16 or fp32 on a CPU")
    if cfg.precision == "fp16" and not getattr(method_class(cfg), "fp16", True):
        raise ConfigError(f"method {cfg.method} trains in a loop of its own, without fp16's gradient scaler; "
                          f"use --precision bf16")
    if cfg.lr_milestones and cfg.lr_schedule != "step":
        raise ConfigError(f"lr-milestones apply to --lr-schedule step, not {cfg.lr_schedule}")
    if cfg.lr_schedule == "step" and not cfg.lr_milestones:
        raise ConfigError("--lr-schedule step needs --lr-milestones (e.g. 160,240)")
    if cfg.lr_schedule == "step":  # the lr after the last milestone must still be a float32
        ms = [m for m in parse_milestones(cfg.lr_milestones) if m < cfg.rounds]
        try:
            peak = max(cfg.lr * cfg.lr_gamma ** k for k in range(len(ms) + 1))
        except OverflowError:
            peak = math.inf
        if peak > FLOAT32_MAX:
            raise ConfigError(f"lr-gamma {cfg.lr_gamma:g} takes the lr past a float32 ({cfg.lr:g} x "
                              f"{cfg.lr_gamma:g}^{len(ms)}); a decay factor is below 1 (e.g. 0.1)")
    if cfg.speed_file is not None:
        if cfg.speed_sigma > 0:
            raise ConfigError("--speed-file and --speed-sigma exclude each other: the file gives the speeds")
        read_speeds(cfg.speed_file, cfg.clients)
    check_device(cfg.device)
    check_trackers(cfg.tracker)


def check_trackers(names) -> None:
    """A tracker named but not installed: one line with the command that installs it, before anything runs."""
    import importlib.util

    for name in names:
        module, install = TRACKERS.get(name, (None, ""))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"--tracker {name} needs the {module} package, which is not installed: {install}")


def fraction_or_count(name: str, value: float, clients: int, what: str = "") -> None:
    """A share of the clients: a fraction (<= 1) or a whole number of them (> 1), at most all of them."""
    if value > 1 and not float(value).is_integer():
        raise ConfigError(f"{name} {value:g} is neither a fraction of the clients (<= 1) nor a whole number of "
                          f"them (> 1); use e.g. {min(value / clients, 1):.2g} or {round(value)}")
    if value > clients:
        raise ConfigError(f"{name} {value:g} clients{what} exceeds the {clients} clients")
    if value * clients < 0.5:  # a fraction that rounds to no client (it used to become one client silently)
        raise ConfigError(f"{name} {value:g} of {clients} clients is less than one client; use at least "
                          f"{1 / clients:.3g} (one client), or a count: 1, 2, ...")


def having(registry, attr: str, last: str = ", ") -> str:
    """The names of a registry's entries that have ``attr`` set ("femnist, inat-user, imu")."""
    names = [n for n, obj in registry.items() if getattr(obj, attr, False)]
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
