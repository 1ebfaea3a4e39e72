"""fedlt reproduce: a seed paper's published table run as a sweep, reported beside the paper's numbers."""
from __future__ import annotations

import argparse

from .compare import _ints
from .sweep import add_backend_arguments, backend_from_args

NAME = "reproduce"
HELP = "run a paper's published table (FedLoGe, RedGrape, FedDr+, BalanceFL) and report ours beside theirs"
ORDER = 35


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..config import RunConfig
    from ..decl import add_arguments

    p.add_argument("table", nargs="?", metavar="TABLE", help="a table, e.g. fedloge-table1 (`--list` shows them)")
    p.add_argument("--list", action="store_true", help="the tables, their size and their presets")
    p.add_argument("--methods", help="comma-separated method labels of the table (default: all it has)")
    p.add_argument("--settings", help="comma-separated setting labels (columns) of the table (default: all)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--rounds", metavar="R",
                   help="shorten every run for a first look: R rounds, or a fraction (e.g. 0.1) of the paper's")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="replace a run setting in every run (e.g. model=resnet8); the report says it is not the "
                        "paper's protocol")
    add_arguments(p, RunConfig, ["device", "data_dir", "tracker"], typed=True)
    p.add_argument("--out", help="the sweep folder (default runs/reproduce-TABLE[-roundsR])")
    add_arguments(p, RunConfig, ["threads"], typed=True)
    p.add_argument("--dry-run", action="store_true", help="print the runs and where the data is; write nothing")
    p.add_argument("--checkpoint-every", type=int, default=1, metavar="N",
                   help="rounds between checkpoints, for resuming after a kill (default 1; 0: none)")
    p.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                   help="runs at a time, each in its own process (as `fedlt sweep --jobs`)")
    add_backend_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-figures", action="store_true", help="tables only in the report")


def main(args: argparse.Namespace) -> int:
    from ..api import reproduce
    from ..errors import ConfigError
    from ..experiments.reproduce import list_tables
    from .run import parse_set

    if args.list:
        list_tables(print)
        return 0
    if not args.table:
        raise ConfigError("reproduce needs a TABLE (e.g. fedloge-table1) or --list")
    res = reproduce(args.table, methods=args.methods, settings=args.settings,
                    seeds=_ints(args.seeds, "--seeds"), rounds=args.rounds, jobs=args.jobs, device=args.device,
                    data_dir=args.data_dir, out=args.out, overrides=parse_set(args.override, "--override"),
                    threads=args.threads, checkpoint_every=args.checkpoint_every, figures=not args.no_figures,
                    progress=not args.no_progress, dry_run=args.dry_run, echo=print, backend=backend_from_args(args),
                    tracker=args.tracker)
    return res.exit_status
