"""fedlt list: what can be named on the command line."""
from __future__ import annotations

NAME = "list"
HELP = "list the methods (built-in, plugins), datasets, models, partitions and presets"
ORDER = 90


def add_arguments(p) -> None:
    p.add_argument("--method-file", metavar="FILE.py", help="also list the methods this file registers")


def _first_line(obj) -> str:
    doc = (obj.__doc__ or "").strip().splitlines()
    return doc[0] if doc else ""


def main(args) -> int:
    from ..api import list_methods
    from ..config import PRESETS
    from ..registry import DATASETS, METHODS, MODELS, PARTITIONS

    print("methods ([generic] and/or [personal] models; 'batched': a round's clients can train together, "
          "--client-parallel):")
    for m in list_methods(args.method_file):
        params = ", ".join(f"{k}={v!r}" for k, v in m.params.items())
        kind = "+".join(k for k, has in (("generic", m.generic), ("personal", m.personalized)) if has)
        batches = ", batched" if m.batched else ""
        where = "" if m.origin == "built-in" else f" ({m.origin})"
        print(f"  {m.name:<14} [{kind}{batches}] {m.summary}{where}" +
              (f"\n  {'':<14} params: {params}" if params else ""))
    for title, reg in (("datasets", DATASETS), ("models", MODELS), ("partitions", PARTITIONS)):
        print(f"{title}:")
        for name, obj in reg.items():
            print(f"  {name:<14} {_first_line(obj)}")
    from ..papers import presets as paper_presets

    papers = paper_presets()
    print("presets (a paper's protocol: each value with its source; `fedlt reproduce --list` shows the tables):")
    for name, over in PRESETS.items():
        if name not in papers:
            print(f"  {name:<20} {over or '(the defaults: fmnist-lt of docs/protocol.md)'}")
            continue
        p = papers[name]
        print(f"  {name:<20} {p.description}\n  {'':<20} source: {p.paper}")
        for k, v in p.settings.items():
            print(f"  {'':<22} {k} = {v!r}" + (f"  [{p.sources[k]}]" if k in p.sources else ""))
    METHODS.warn_problems()  # the plugins left out, and why
    return 0
