"""fedlt sweep: a grid of methods x settings x seeds from one TOML file, resumable."""
from __future__ import annotations

import argparse

NAME = "sweep"
HELP = "run a grid of methods x settings x seeds from a TOML file (finished runs are skipped, killed ones resume)"
ORDER = 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..config import RunConfig
    from ..decl import add_arguments

    p.add_argument("file", metavar="FILE.toml", help="the sweep file (see fedlt.experiments.sweep for its format)")
    p.add_argument("--out", help="the sweep directory (default: the file's `out`, else runs/<file name>)")
    add_sweep_arguments(p)
    add_arguments(p, RunConfig, ["threads"], typed=True)
    g = p.add_argument_group("settings of every run (they win over the file's; a finished run is still reused)")
    add_arguments(g, RunConfig, ["device", "data_dir"], typed=True)
    p.add_argument("--dry-run", action="store_true", help="list the runs and their status; run nothing")


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared with `fedlt compare`."""
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="write a checkpoint every N rounds (0: none; default: the sweep file's, else 1)")
    p.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                   help="runs at a time, each in its own process (default 1: one after the other in this one); "
                        "CPU cores are split between them unless --threads is given, CUDA runs spread over the "
                        "visible GPUs")
    add_backend_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--metric", choices=["last3", "final"], default="last3",
                   help="the number each run contributes to the tables (default last3: mean of the last 3 evaluations)")


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    """--backend and the Ray options (`fedlt sweep`, `compare`, `reproduce`; docs/cluster.md)."""
    g = p.add_argument_group("Ray (pip install 'fedlt[ray]')")
    g.add_argument("--backend", choices=["local", "ray"],
                   help="local (default: this machine, --jobs processes) or ray (each run a Ray task on a cluster; "
                        "every node must see --out at the same path)")
    g.add_argument("--ray-address", metavar="ADDR",
                   help="the Ray cluster: auto (the one this machine is in), HOST:PORT, ray://HOST:10001 "
                        "(default: a local one started for the sweep)")
    g.add_argument("--cpus-per-run", type=float, metavar="N", help="CPUs each run asks Ray for (default 1; also "
                                                                   "its torch threads unless --threads)")
    g.add_argument("--gpus-per-run", type=float, metavar="F", help="GPUs each run asks Ray for (default 0; 0.5: two "
                                                                   "runs share a GPU)")


def backend_from_args(args: argparse.Namespace):
    from ..experiments.ray_backend import backend_of

    return backend_of(args.backend, args.ray_address, args.cpus_per_run, args.gpus_per_run)


def execute(sweep, args: argparse.Namespace) -> int:
    from ..api import run_sweep

    return run_sweep(sweep, checkpoint_every=args.checkpoint_every, jobs=getattr(args, "jobs", None),
                     threads=args.threads, progress=not args.no_progress, report=not args.no_report,
                     metric=args.metric, dry_run=getattr(args, "dry_run", False), echo=print,
                     backend=backend_from_args(args)).exit_status


def main(args: argparse.Namespace) -> int:
    from ..experiments.sweep import load_sweep

    sweep = load_sweep(args.file, args.out)
    sweep.over.update({k: getattr(args, k) for k in ("device", "data_dir") if getattr(args, k) is not None})
    return execute(sweep, args)
