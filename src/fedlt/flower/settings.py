"""A fedlt RunConfig <-> Flower's flat run config (``[tool.flwr.app.config]``, ``flwr run --run-config``).

Every RunConfig field is a key with ``-`` for ``_`` (``local-epochs = 2``); an unset optional field is ``""``;
method parameters are ``params.<name>``; the Flower engine's own settings are ``flower.<name>``:

- ``flower.round-timeout`` (s, default 600): how long a round (or a phase, or an evaluation) waits for replies;
  a client that has not answered by then is recorded as missing and the round goes on without it.
- ``flower.wait-timeout`` (s, default 300): how long the run waits at the start for all its SuperNodes.
- ``flower.poll-interval`` (s, default 0.5): how often the server asks the SuperLink for replies.
- ``flower.checkpoint-every`` (default 1, as ``fedlt run``; 0: none): a checkpoint every N rounds and after the last.
- ``flower.resume`` (0 or 1): continue the run in the run directory from its last checkpoint.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..config import FIELDS, RunConfig, load_config
from ..engine.flower import TIMING
from ..errors import ConfigError
from ..runner.preempt import DEFAULT_CHECKPOINT_EVERY

FLOWER_DEFAULTS = {**TIMING, "checkpoint-every": float(DEFAULT_CHECKPOINT_EVERY), "resume": 0.0}


def flower_value(name: str, v: Any) -> float:
    """A Flower engine setting as a float: seconds > 0 (timeouts, poll interval), a count >= 0
    (checkpoint-every) or 0/1 (resume); a one-line ConfigError for anything else (nan, -1, text)."""
    import math

    try:
        x = float(v)
    except (TypeError, ValueError):
        x = math.nan
    if name == "resume":
        ok, what = x in (0.0, 1.0), "0 or 1"
    elif name == "checkpoint-every":
        ok, what = math.isfinite(x) and x >= 0 and x.is_integer(), "a whole number >= 0"
    else:
        ok, what = math.isfinite(x) and x > 0, "a number of seconds > 0"
    if not ok:
        raise ConfigError(f"flower.{name} must be {what}, got {v!r}")
    return x


def to_run_config(cfg: RunConfig, **flower: Any) -> dict[str, Any]:
    """The nested dict for ``[tool.flwr.app.config]`` (Flower flattens ``params`` / ``flower`` with dots)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(RunConfig):
        if f.name in ("params", "partition_args"):
            continue
        v = getattr(cfg, f.name)
        if isinstance(v, (tuple, list)):  # a list setting (tracker) as its comma-separated text; empty: unset
            v = ",".join(map(str, v)) or None
        out[f.name.replace("_", "-")] = "" if v is None else v
    scalar = lambda v: v if isinstance(v, (bool, int, float, str)) else str(v)  # noqa: E731  (lists as text)
    out["params"] = {k: scalar(v) for k, v in cfg.params.items()}
    if cfg.partition_args:  # a flwr: partition's arguments, read back as --set partition.KEY=VALUE
        out["partition-args"] = {k: scalar(v) for k, v in cfg.partition_args.items()}
    given = {k.replace("_", "-"): v for k, v in flower.items() if v is not None}
    unknown = set(given) - set(FLOWER_DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown Flower setting(s) {sorted(unknown)}; known: {sorted(FLOWER_DEFAULTS)}")
    opts = {**FLOWER_DEFAULTS, **{k: flower_value(k, v) for k, v in given.items()}}
    out["flower"] = opts
    return out


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def from_run_config(run_config: dict[str, Any]) -> tuple[RunConfig, dict[str, float]]:
    """(RunConfig, Flower settings) from a context's run config (flat, dotted keys), validated."""
    over: dict[str, Any] = {}
    params: dict[str, Any] = {}
    flower = dict(FLOWER_DEFAULTS)
    for key, v in run_config.items():
        if key.startswith("params."):
            params[key[len("params."):]] = v
        elif key.startswith("partition-args."):
            params["partition." + key[len("partition-args."):]] = v
        elif key.startswith("flower."):
            name = key[len("flower."):]
            if name not in FLOWER_DEFAULTS:
                raise ConfigError(f"unknown Flower setting {key!r}; known: "
                                  f"{', '.join('flower.' + k for k in FLOWER_DEFAULTS)}")
            flower[name] = flower_value(name, v)
        else:
            name = key.replace("-", "_")
            if name not in FIELDS or name == "params":
                raise ConfigError(f"unknown run setting {key!r} in the Flower run config; see `fedlt run --help`")
            over[name] = None if v in ("", "()", "[]") else v  # "()": an empty list as earlier versions wrote it
    over["params"] = params
    return load_config(None, over), flower
