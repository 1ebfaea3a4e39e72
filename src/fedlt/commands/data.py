"""fedlt data: fetch datasets from their public sources (checked against published checksums), and list
what is present where."""
from __future__ import annotations

import argparse

NAME = "data"
HELP = "fetch datasets (verified against published checksums) and list what is present where"
ORDER = 70


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", required=True)
    f = sub.add_parser("fetch", help="download and verify datasets: cifar10, cifar100, mnist, fashion-mnist, femnist "
                                     "(NIST SD19 + LEAF's preprocessing), speech-commands")
    f.add_argument("names", nargs="+", metavar="NAME", help="dataset(s) to fetch")
    f.add_argument("--data-dir", help="where to put them (default: $FEDLT_DATA, else ~/.local/share/fedlt, where "
                                      "`fedlt run` also looks)")
    f.add_argument("--no-progress", action="store_true", help="no progress bars")
    ls = sub.add_parser("list", help="every dataset: where its files are found, its decoded caches, how to get it")
    ls.add_argument("--data-dir", help="also look here (as `fedlt run --data-dir`)")


def main(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from ..data import fetch as F
    from ..data.base import default_data_home
    from ..registry import DATASETS

    if args.data_command == "fetch":
        for name in args.names:
            DATASETS.get(name)  # an unknown name: the registry's one-line error with a suggestion
        base = Path(args.data_dir or os.environ.get("FEDLT_DATA") or default_data_home())
        for name in args.names:
            F.fetch(name, base, progress=not args.no_progress)
        return 0
    rows = F.presence(args.data_dir)
    print(f"{'dataset':<16} {'status':<8} {'where':<44} how to get it")
    for r in rows:
        status = "present" if r.where else "missing"
        print(f"{r.name:<16} {status:<8} {r.where or '-':<44} {r.how}")
        for c in r.caches:
            print(f"{'':<16} {'cache':<8} {c}")
    from ..data.store import cache_root

    print(f"decoded caches live in {cache_root()} (FEDLT_CACHE); delete an entry to rebuild it")
    return 0
