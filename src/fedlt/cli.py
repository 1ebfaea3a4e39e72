"""The `fedlt` command. Sub-commands live in fedlt/commands/, one module each, found automatically: a module
defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``main(args) -> int``.

Bad input (an unknown name, an impossible setting, a missing or corrupt data file) ends with one line on
stderr and exit status 2, no traceback; a run that diverged, with one line and exit status 3; a run or sweep
stopped by SIGTERM, SIGINT or SIGUSR1 (:mod:`fedlt.preempt`), with one line saying how to resume
and exit status 128 + the signal's number (143, 130, 138); a deployed Flower run that lost its SuperLink, with one
line saying which round is checkpointed and how to resume, and exit status 75 (EX_TEMPFAIL).
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from .errors import FedltError


def _commands():
    from . import commands

    mods = [importlib.import_module(f"{commands.__name__}.{m.name}") for m in pkgutil.iter_modules(commands.__path__)
            if not m.name.startswith("_")]
    return sorted(mods, key=lambda m: getattr(m, "ORDER", 50))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fedlt", description="Federated learning on long-tailed, non-IID data.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for mod in _commands():
        sp = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(sp)
        sp.set_defaults(_main=mod.main)
    return p


def main(argv: list[str] | None = None) -> int:
    from .preempt import Preempted, installed

    args = build_parser().parse_args(argv)
    try:
        with installed():
            return int(args._main(args) or 0)
    except FedltError as e:
        sys.stderr.write(f"fedlt: error: {e}\n")
        return e.exit_status
    except Preempted as e:
        sys.stderr.write(e.line() + "\n")
        return e.exit_status
    except KeyboardInterrupt:
        sys.stderr.write("fedlt: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
