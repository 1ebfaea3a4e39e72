"""fedlt compare: several methods on one setting, on the very same clients and client-sampling stream."""
from __future__ import annotations

import argparse

from .run import add_config_arguments
from .sweep import add_sweep_arguments, backend_from_args

NAME = "compare"
HELP = "run several methods on one setting (same partition, same sampled clients) and tabulate GM / PM"
ORDER = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--methods", required=True, help="comma-separated method names, e.g. fedavg,fedprox")
    p.add_argument("--seeds", help="comma-separated seeds (default: --seed, else 0); cells are mean ± std over them")
    add_config_arguments(p)
    add_sweep_arguments(p)
    p.epilog = ("--set KEY=VALUE applies to every method; --set METHOD.KEY=VALUE to one (e.g. --set fedprox.mu=0.1). "
                "Runs go to OUT/compare-<setting>/<setting>/<method>/seed<seed> unless --name gives the folder.")


def _ints(text: str, what: str) -> list[int]:
    from ..errors import ConfigError

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} expects comma-separated integers (e.g. 0,1,2), got {text!r}") from None


def main(args: argparse.Namespace) -> int:
    from ..api import compare
    from .run import config_from_args, parse_set

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    shared, per_method = {}, {}
    for k, v in parse_set(args.set).items():
        if "." in k and not k.startswith("partition."):  # partition.KEY: a flwr: partition's argument
            m, key = k.split(".", 1)
            per_method.setdefault(m, {})[key] = v
        else:
            shared[k] = v
    args.set = [f"{k}={v}" for k, v in shared.items()]
    base = config_from_args(args, method=methods[0] if methods else None)
    seeds = _ints(args.seeds, "--seeds") if args.seeds else None
    every = 1 if args.checkpoint_every is None else args.checkpoint_every
    res = compare(methods, base, seeds=seeds, method_params=per_method, checkpoint_every=every,
                  jobs=getattr(args, "jobs", None), progress=not args.no_progress, report=not args.no_report,
                  metric=args.metric, echo=print, backend=backend_from_args(args))
    return res.exit_status
