"""fedlt run: one federated long-tailed experiment."""
from __future__ import annotations

import argparse

NAME = "run"
HELP = "run one method on one long-tailed federation and print GM, PM and many/medium/few"
ORDER = 10


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """The run settings, shared by every command that runs experiments: one option per setting declared in
    fedlt.config.RunConfig (its help, default and range from the declaration), plus --config and --set."""
    from ..config import RunConfig
    from ..decl import add_arguments

    p.add_argument("--config", help="TOML file with run settings ([params] table for method parameters)")
    groups = {g: p.add_argument_group(g) for g in ("data", "training", "evaluation and output")}
    add_arguments(p, RunConfig, groups=groups)
    groups["training"].add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                                    help="method hyper-parameter, repeatable (e.g. --set mu=0.01; `fedlt list "
                                         "METHOD` shows them); --set partition.KEY=VALUE: an argument of a "
                                         "flwr: partition")


def parse_set(items: list[str], option: str = "--set") -> dict[str, str]:
    from ..errors import ConfigError

    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"{option} expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        k = k.strip()
        if k in out and out[k] != v.strip():  # the last would win without a word
            raise ConfigError(f"{option} {k} is given twice ({out[k]!r} and {v.strip()!r}); give it once")
        out[k] = v.strip()
    return out


def config_from_args(args: argparse.Namespace, **extra):
    from ..config import RunConfig, load_config
    from ..decl import given

    over = given(args, RunConfig)
    over.update(extra)
    over["params"] = parse_set(getattr(args, "set", []))
    return load_config(getattr(args, "config", None), over)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_resume_arguments(p)


def add_resume_arguments(p) -> None:
    """--checkpoint-every and --resume (``fedlt run`` and the Flower runs)."""
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="write an atomic checkpoint every N rounds (default 1: a run stopped by a signal loses at "
                        "most the round in progress; 0: none)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out/--name from its last checkpoint (same settings required)")


def main(args: argparse.Namespace) -> int:
    from ..api import run

    res = run(config_from_args(args), progress=not args.no_progress, echo=print,
              checkpoint_every=args.checkpoint_every, resume=args.resume)
    return 3 if res.status == "diverged" else 0
