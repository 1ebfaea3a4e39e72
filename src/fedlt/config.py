"""Run configuration: defaults (the fmnist-lt protocol of docs/protocol.md), presets, TOML files and
command-line overrides, validated before anything is loaded or written."""
from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core.spec import LR_SCHEDULES, scheduled_lr
from .errors import ConfigError
from .papers import presets as paper_presets


@dataclass
class RunConfig:
    method: str = "fedavg"
    params: dict[str, Any] = field(default_factory=dict)  # method hyper-parameters ([params] in TOML, --set)
    method_file: str | None = None  # a .py file that registers methods (fedlt.plugins); stored absolute
    # data
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    image_size: int | None = None  # ImageNet-LT / iNaturalist input resolution (None: 224)
    imbalance_ratio: float = 100.0
    lt_profile: str | None = None  # exp | step | none; None: the dataset's default (data.split.default_lt_profile;
    #                                config.json's lt_profile_used is the profile used)
    tail_classes: int = 3  # step profile only
    n_max: int | None = None
    partition: str = "dirichlet"
    partition_file: str | None = None  # clients' training indices (data.split); sets partition "file"
    alpha: float = 0.5
    shards_per_client: int = 2
    classes_per_client: int = 2  # pathological, exdir
    balance: bool = False  # LongTailLib's balanced client sizes (dirichlet, pathological)
    tau: float = 2.0
    min_client_size: int = 0
    clients: int = 20
    # model and local training
    model: str | None = None  # None: the dataset's default
    local_epochs: int = 2
    batch_size: int = 32
    lr: float = 0.05
    lr_schedule: str = "constant"  # constant | step | cosine (lr_at: the lr of each round)
    lr_milestones: str = ""  # step: rounds after which the lr is multiplied by lr_gamma ("160,240")
    lr_gamma: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    # federation
    participation: float = 0.5  # <= 1: fraction of clients per round; > 1: a count
    rounds: int = 50
    eval_every: int = 5
    split: str = "fedloge"  # many/medium/few split: fedloge | fixed
    seed: int = 0
    device: str = "cpu"
    data_placement: str = "auto"  # auto | device | host (data.federated.placement)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; fp16 with a gradient scaler, CUDA only)
    channels_last: str = "auto"  # auto | on | off: convolutional models in channels_last memory format
    client_parallel: str = "auto"  # auto | off | N: clients trained together (engine.batched)
    cuda_graphs: bool = False  # batched clients' steps replayed as CUDA graphs (engine.graphs)
    deterministic: bool = False  # deterministic algorithms and cuDNN settings
    threads: int | None = None
    # divergence: a non-finite training loss or global weights stop the run (exit status 3) unless "continue";
    # diverge_factor F > 0 also stops it when the training loss exceeds F times the first round's
    on_diverge: str = "stop"
    diverge_factor: float = 0.0
    # output
    out: str = "runs"
    name: str | None = None
    preset: str | None = None

    def partition_kw(self) -> dict:
        return {"dirichlet": {"alpha": self.alpha, "min_size": self.min_client_size, "balance": self.balance},
                "shards": {"shards_per_client": self.shards_per_client},
                "tau": {"tau": self.tau},
                "pathological": {"classes_per_client": self.classes_per_client, "balance": self.balance},
                "exdir": {"alpha": self.alpha, "classes_per_client": self.classes_per_client,
                          "min_size": self.min_client_size},
                "local-longtail": {"alpha": self.alpha, "rho": self.imbalance_ratio}}.get(self.partition, {})

    def dataset_kw(self) -> dict:
        """Settings passed to the dataset's loader."""
        return {"image_size": self.image_size} if self.image_size else {}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_milestones(value: Any) -> tuple[int, ...]:
    """``"160,240"``, ``[160, 240]`` or ``()`` -> ``(160, 240)``; a one-line ConfigError for anything else."""
    items = value.replace("[", "").replace("]", "").split(",") if isinstance(value, str) else list(value or ())
    try:
        out = tuple(int(str(v).strip()) for v in items if str(v).strip())
    except ValueError:
        raise ConfigError(f"lr-milestones expects comma-separated round numbers (e.g. 160,240), "
                          f"got {value!r}") from None
    if any(m < 1 for m in out) or list(out) != sorted(set(out)):
        raise ConfigError(f"lr-milestones must be increasing round numbers >= 1, got {value!r}")
    return out


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


def _convert(name: str, value: Any) -> Any:
    """Coerce a TOML or command-line value to the field's type (annotations are strings here)."""
    kind = {"float": float, "int": int, "str": str, "bool": bool}.get(str(FIELDS[name].type).split("|")[0].strip())
    if value is None or kind is None or (type(value) is kind):
        return value
    if kind is bool:
        raise ConfigError(f"{name.replace('_', '-')} expects true or false, got {value!r}")
    if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"{name.replace('_', '-')} expects a {kind.__name__}, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name.replace('_', '-')} expects a {kind.__name__}, got {value!r}") from None


def read_toml(path: str | Path, what: str = "config") -> dict[str, Any]:
    """A TOML file as a dict, or a one-line ConfigError if it is missing or not valid TOML."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} file {path} not found")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} file {path} is not valid TOML: {e}") from None


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Defaults <- preset <- TOML file <- overrides (command line). Unknown keys are errors."""
    values: dict[str, Any] = read_toml(path) if path else {}
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    for where in (values, overrides):
        if not isinstance(where.get("params", {}), dict):
            raise ConfigError(f"params must be a table of method parameters ([params] in TOML), got "
                              f"{where['params']!r}")
    params = {**values.pop("params", {}), **overrides.pop("params", {})}
    preset = overrides.get("preset", values.get("preset"))
    merged: dict[str, Any] = {}
    if preset is not None:
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
        merged.update(PRESETS[preset])
    merged.update(values)
    merged.update(overrides)
    for k in merged:
        if k not in FIELDS or k == "params":
            raise ConfigError(f"unknown setting {k!r}; see `fedlt run --help`")
    if merged.get("method_file"):
        from .plugins import only_method, resolve_method_file

        merged["method_file"] = resolve_method_file(merged["method_file"])
        merged.setdefault("method", only_method(merged["method_file"]))
    if merged.get("partition_file"):  # the file decides the clients; --clients may only repeat their number
        if merged.get("partition", "file") != "file":
            raise ConfigError("--partition and --partition-file exclude each other: the file is the partition")
        merged["partition"] = "file"
        merged.setdefault("clients", count_file_clients(merged["partition_file"]))
    cfg = RunConfig(**{k: _convert(k, v) for k, v in merged.items()}, params=params)
    validate(cfg)
    return cfg


def count_file_clients(path: str) -> int:
    """How many clients a partition file holds (its content is checked when the federation is built)."""
    import json

    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"partition file {path} not found") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"partition file {path} is not readable JSON: {e}") from None
    clients = doc.get("clients", doc) if isinstance(doc, dict) else doc
    if not isinstance(clients, (dict, list)) or not clients:
        raise ConfigError(f"partition file {path}: expected a clients mapping or a list of index lists")
    return len(clients)


# upper bounds that no experiment reaches, so that a typo (an extra zero or ten) is an error, not an hour of
# allocation: the client-sampling schedule of every round is drawn up front
LIMITS = {"rounds": 10**6, "clients": 10**6, "local_epochs": 10**4, "batch_size": 2**31 - 1,
          "eval_every": 2**31 - 1, "tail_classes": 10**6, "shards_per_client": 10**6, "min_client_size": 2**31 - 1,
          "n_max": 2**31 - 1, "threads": 4096, "seed": 2**63 - 1}


def validate(cfg: RunConfig) -> None:
    """Checks that need no data: ranges and names. Raises ConfigError with a one-line message."""
    import math

    from .data.longtail import check_ratio
    from .data.split import check_lt_settings, default_lt_profile
    from .plugins import method_class
    from .registry import DATASETS, MODELS, PARTITIONS

    for name, f in FIELDS.items():
        v = getattr(cfg, name)
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{name.replace('_', '-')} must be a finite number, got {v}")
        if isinstance(v, int) and name in LIMITS and not -(2**31) < v <= LIMITS[name]:
            raise ConfigError(f"{name.replace('_', '-')} {v} is out of range (at most {LIMITS[name]:,})")
    if cfg.seed < 0:
        raise ConfigError(f"seed must be >= 0, got {cfg.seed}")
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"threads must be >= 1, got {cfg.threads}")
    check_ratio(cfg.imbalance_ratio)
    method_class(cfg).make_params(cfg.params)
    loader = DATASETS.get(cfg.dataset)
    if cfg.partition_file:
        cfg.partition = "file"
    elif cfg.partition == "file":
        raise ConfigError("partition file needs --partition-file FILE.json")
    else:
        PARTITIONS.get(cfg.partition)
    if cfg.lt_profile not in (None, "exp", "step", "none"):
        raise ConfigError(f"unknown lt-profile {cfg.lt_profile!r}; choose exp, step or none")
    check_lt_settings(cfg.dataset, cfg.lt_profile or default_lt_profile(cfg.dataset, cfg.partition, cfg.partition_file),
                      cfg.partition, cfg.partition_file)
    if cfg.partition == "natural" and not getattr(loader, "natural_groups", False):
        raise ConfigError(f"partition natural needs a dataset with its own users (femnist, inat-user, imu); "
                          f"{cfg.dataset} has none")
    if cfg.balance and cfg.partition not in ("dirichlet", "pathological"):
        raise ConfigError(f"--balance applies to the dirichlet and pathological partitions, not {cfg.partition}")
    if cfg.image_size is not None and not getattr(loader, "image_size", False):
        raise ConfigError(f"--image-size applies to imagenet-lt and inat-user, not {cfg.dataset}")
    if cfg.image_size is not None and cfg.image_size < 16:
        raise ConfigError(f"image-size must be >= 16, got {cfg.image_size}")
    if cfg.model is not None:
        MODELS.get(cfg.model)
    if cfg.partition == "dirichlet" and not cfg.alpha > 0:
        raise ConfigError(f"Dirichlet alpha must be > 0, got {cfg.alpha:g}")
    checks = [("clients", cfg.clients >= 1, ">= 1"), ("rounds", cfg.rounds >= 1, ">= 1"),
              ("eval_every", cfg.eval_every >= 1, ">= 1"), ("local_epochs", cfg.local_epochs >= 0, ">= 0"),
              ("batch_size", cfg.batch_size >= 1, ">= 1"), ("lr", cfg.lr > 0, "> 0"),
              ("classes_per_client", cfg.classes_per_client >= 1, ">= 1"),
              ("participation", cfg.participation > 0, "> 0 (a fraction <= 1 or a count)"),
              ("momentum", 0 <= cfg.momentum < 1, "in [0, 1)"), ("weight_decay", cfg.weight_decay >= 0, ">= 0")]
    for name, ok, what in checks:
        if not ok:
            raise ConfigError(f"{name.replace('_', '-')} must be {what}, got {getattr(cfg, name)}")
    if cfg.participation > 1 and not float(cfg.participation).is_integer():
        raise ConfigError(f"participation {cfg.participation:g} is neither a fraction of the clients (<= 1) nor a "
                          f"whole number of them (> 1); use e.g. {min(cfg.participation / cfg.clients, 1):.2g} or "
                          f"{round(cfg.participation)}")
    if cfg.participation > 1 and cfg.participation > cfg.clients:
        raise ConfigError(f"participation {cfg.participation:g} clients per round exceeds the {cfg.clients} clients")
    if cfg.data_placement not in ("auto", "device", "host"):
        raise ConfigError(f"unknown data-placement {cfg.data_placement!r}; choose auto, device or host")
    if cfg.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"unknown precision {cfg.precision!r}; choose fp32, bf16 or fp16")
    if cfg.channels_last not in ("auto", "on", "off"):
        raise ConfigError(f"unknown channels-last {cfg.channels_last!r}; choose auto, on or off")
    cp = str(cfg.client_parallel)
    if cp not in ("auto", "off") and not (cp.isdigit() and int(cp) >= 1):
        raise ConfigError(f"client-parallel must be auto, off or a number of clients >= 1, got {cp!r}")
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
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"unknown lr-schedule {cfg.lr_schedule!r}; choose {', '.join(LR_SCHEDULES)}")
    cfg.lr_milestones = ",".join(map(str, parse_milestones(cfg.lr_milestones)))  # canonical; a TOML list too
    if cfg.lr_milestones and cfg.lr_schedule != "step":
        raise ConfigError(f"lr-milestones apply to --lr-schedule step, not {cfg.lr_schedule}")
    if cfg.lr_schedule == "step" and not cfg.lr_milestones:
        raise ConfigError("--lr-schedule step needs --lr-milestones (e.g. 160,240)")
    if not cfg.lr_gamma > 0:
        raise ConfigError(f"lr-gamma must be > 0, got {cfg.lr_gamma:g}")
    if cfg.split not in ("fedloge", "fixed"):
        raise ConfigError(f"unknown split {cfg.split!r}; choose fedloge or fixed")
    if cfg.on_diverge not in ("stop", "continue"):
        raise ConfigError(f"unknown on-diverge {cfg.on_diverge!r}; choose stop or continue")
    if cfg.diverge_factor < 0:
        raise ConfigError(f"diverge-factor must be >= 0 (0: off), got {cfg.diverge_factor:g}")
    import torch

    try:
        dev = torch.device(cfg.device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {cfg.device!r}; use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda requested but no CUDA device is available; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {cfg.device} does not exist: {torch.cuda.device_count()} GPU(s) are visible")
