"""fedlt list: what can be named on the command line."""
from __future__ import annotations

NAME = "list"
HELP = "list the methods (built-in, plugins), datasets, models, partitions and presets"
ORDER = 90


def add_arguments(p) -> None:
    p.add_argument("what", nargs="?", metavar="settings|METHOD",
                   help="the run settings (each with its command line, default and range), or one method's "
                        "parameters; default: everything by name")
    p.add_argument("--method-file", metavar="FILE.py", help="also list the methods this file registers")


def _first_line(obj) -> str:
    doc = (obj.__doc__ or "").strip().splitlines()
    return doc[0] if doc else ""


def print_rows(rows: list[dict], flags: bool = True) -> None:
    """A declared dataclass's settings (fedlt.decl.rows), one block each: name, type and default (and the
    command-line spelling), then the help and what is allowed, indented."""
    group = None
    for r in rows:
        if r["group"] != group and r["group"]:
            group = r["group"]
            print(f"{group}:")
        head = f"  {r['name']:<20} {r['type']} = {r['default']}"
        print(head + (f"   [{r['flag']}]" if r["flag"] and flags else ""))
        for line in (r["help"], r["allowed"]):
            if line:
                print(f"  {'':<20} {line}")


def _table(rows: list[dict], cols: tuple[str, ...]) -> None:
    """Rows as a table of ``cols``, then each row's ``what``, indented."""
    w = {k: max(len(k), *(len(r[k]) for r in rows)) for k in cols}
    print("  " + "  ".join(f"{k:<{w[k]}}" for k in w).rstrip())
    for r in rows:
        print("  " + "  ".join(f"{r[k]:<{w[k]}}" for k in w).rstrip())
        print(f"  {'':<{w[cols[0]]}}  {r['what']}")


def print_sends(cls) -> None:
    """What a method's clients send (its ``sends``, fedlt.core.privacy) as a table: when, name, kind, category,
    then what it is, indented; what the Flower engine adds (its own declaration, fedlt.engine.flower.sends), by
    message, --dp mode and SuperNode; and what each category they name reveals."""
    from ..core.privacy import CATEGORIES, engine_rows_of, rows_of
    from ..engine.flower import sends as flower

    rows = rows_of(cls)
    print(f"what leaves the client ({cls.__name__}.sends; docs/privacy.md; a run records it in sent.jsonl):")
    _table(rows, ("when", "name", "kind", "category")) if rows else print("  nothing")
    engine = engine_rows_of(flower.SENDS)
    print(f"{flower.TITLE}: what it sends besides the method's replies ({flower.WHERE}; sent.jsonl rows with "
          f"\"engine\": \"{flower.ENGINE}\"; --dp: the modes it is sent under; nodes: 'own data' = only a "
          f"SuperNode with its own data, not one serving a partition-id):")
    _table(engine, ("message", "name", "dp", "nodes", "category"))
    print("categories:")
    for c in dict.fromkeys(r["category"] for r in rows + engine):
        print(f"  {c:<15}  {CATEGORIES[c]}")


def main(args) -> int:
    from ..registry import METHODS

    if args.what == "settings":
        from ..config import setting_rows

        print("run settings (TOML key, type = default, [command line]; then its meaning and what it allows):")
        print_rows(setting_rows())
        return 0
    if args.what is not None:
        from ..decl import rows
        from ..plugins import load_method_file

        if args.method_file:
            load_method_file(args.method_file)
        cls = METHODS.get(args.what)
        print(f"{args.what}: parameters (--set NAME=VALUE, [params] in TOML; type = default, then meaning and "
              f"what it allows):")
        params = rows(cls.Params)
        print_rows(params, flags=False) if params else print("  none")
        print_sends(cls)
        from ..core.secagg import runs_under, why_not

        print("secure aggregation (--secagg): " + ("yes, its server needs only the weighted mean of the replies"
                                                   if runs_under(cls) else f"no, {why_not(cls)}"))
        from ..core.dp import verdict

        print("client-level DP (--dp client): " + verdict(cls, "client"))
        print("sample-level DP (--dp sample): " + verdict(cls, "sample"))
        from ..core.finetune import finetune_refusal

        for mode in ("head", "lora"):  # what a frozen pre-trained backbone leaves it (core.finetune)
            why = finetune_refusal(cls, mode)
            print(f"--finetune {mode}: " + (f"no, it {why}" if why else "yes"))
        return 0
    from ..api import list_methods
    from ..config import PRESETS
    from ..registry import DATASETS, MODELS, PARTITIONS

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
            reads = ", ".join(f"--{v.replace('_', '-')}" for v in getattr(obj, "settings", {}).values())
            print(f"  {name:<14} {_first_line(obj)}" + (f" [{reads}]" if reads else ""))
        for prefix, what in reg.prefixes().items():  # hf:NAME, flwr:CLASS (docs/flower-datasets.md)
            print(f"  {prefix + ':NAME':<14} {what}")
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
