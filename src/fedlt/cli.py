"""The `fedlt` command. Sub-commands live in fedlt/commands/, one module each, found automatically: a module
defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``main(args) -> int``.

Bad input (an unknown name, an impossible setting, a missing or corrupt data file) ends with one line on
stderr and exit status 2, no traceback; a run that diverged, with one line and exit status 3; a run or sweep
stopped by SIGTERM, SIGINT or SIGUSR1 (:mod:`fedlt.runner.preempt`), with one line saying how to resume
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


_PARSER: list = []  # built once per process (in-process callers, tests, run many commands)


def fresh_line() -> None:
    """Close the progress bars still open (a run stopped mid-way leaves its bar), which clears their line, so
    that what is printed next starts at the beginning of a line of its own."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    for bar in list(getattr(tqdm, "_instances", ()) or ()):
        try:
            bar.leave = False
            bar.close()
        except Exception:  # noqa: BLE001 -- a bar that cannot close must not hide the error line
            pass
    sys.stderr.flush()


def build_parser() -> argparse.ArgumentParser:
    if _PARSER:
        return _PARSER[0]
    p = _Parser(prog="fedlt", description="Federated learning on long-tailed, non-IID data.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for mod in _commands():
        sp = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(sp)
        sp.set_defaults(_main=mod.main)
    _PARSER.append(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from .runner.preempt import Preempted, installed

    args = build_parser().parse_args(argv)
    try:
        with installed():
            return int(args._main(args) or 0)
    except FedltError as e:
        fresh_line()
        sys.stderr.write(f"fedlt: error: {e}\n")
        return e.exit_status
    except Preempted as e:
        fresh_line()
        sys.stderr.write(e.line() + "\n")
        return e.exit_status
    except KeyboardInterrupt:
        fresh_line()
        sys.stderr.write("fedlt: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
