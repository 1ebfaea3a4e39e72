"""``fedlt reproduce TABLE``: a seed paper's published table as a sweep, and a report of ours beside theirs.

A table (:mod:`fedlt.papers`) names its settings (each a paper preset plus the values the table varies: alpha,
IF, participation ...), its methods (fedlt names, with the parameters the paper states; methods fedlt lacks
stay in the table, marked, and are never run) and the published numbers. :func:`plan_reproduction` turns the
selected part of it into a :class:`~fedlt.experiments.sweep.Sweep` (settings = the table's columns, methods
= its rows, the seeds given), so it runs through :func:`fedlt.api.run_sweep` -> ``run_plan`` like any sweep:
finished runs are skipped, killed ones resume from their checkpoint, ``jobs`` run at a time.

``rounds`` shortens every run for a first look: an integer R runs R rounds, a fraction f < 1 the paper's
rounds times f (at least 1); evaluations and step-schedule milestones shrink with it. The report says so
in its heading, as it lists any ``overrides`` (run settings replaced for every run, e.g. a small model for a
smoke test): such a run is not the paper's protocol.

The report (``<out>/report/reproduction.md`` and ``reproduction.csv``, beside the usual ``fedlt report``
tables): per setting, for each metric of the table, our mean +- std over the seeds, the paper's number (+- its
std where published) and the difference in points; then, per column, the ranking of the methods on each side
(among the methods with both numbers) and whether the paper's winner wins here.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, DataError
from ..papers import Table, tables
from ..runner.preempt import DEFAULT_CHECKPOINT_EVERY
from ..engine.driver import clients_per_round
from .report import METRIC_TEXT
from .sweep import DATA_FIELDS, LABEL, Sweep

# training-set sizes for the size estimate of `--list` (no data is read): classes and n_max of the long-tail
# profile for the balanced sets, else the published training-set size
_SIZES = {"cifar10": (10, 5000), "cifar100": (100, 500), "mnist": (10, 5421), "fashion-mnist": (10, 6000),
          "speech-commands": (35, 3000)}
_TOTALS = {"imagenet-lt": 115_846, "inat-user": 120_300, "imu": 6_137}


def table(name: str) -> Table:
    found = tables()
    if name not in found:
        raise ConfigError(f"unknown table {name!r}; choose one of: {', '.join(found)} (`fedlt reproduce --list`)")
    return found[name]


def _pick(asked: list[str] | None, known: list[str], what: str, tname: str) -> list[str]:
    if not asked:
        return list(known)
    unknown = [a for a in asked if a not in known]
    if unknown:
        raise ConfigError(f"{tname} has no {what} {', '.join(map(repr, unknown))}; choose from: {', '.join(known)}")
    if len(set(asked)) != len(asked):
        raise ConfigError(f"--{what}s repeats a name: {','.join(asked)}")
    return [k for k in known if k in asked]  # the table's order


@dataclass
class Reproduction:
    """The selected part of a table, as a sweep."""

    table: Table
    methods: list[str]  # labels run (the table's order)
    missing: list[str]  # labels selected that fedlt lacks (reported, never run)
    settings: list[str]
    seeds: list[int]
    sweep: Sweep
    rounds: dict[str, tuple[int, int]]  # setting -> (paper's rounds, rounds run)
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def shortened(self) -> bool:
        return any(a != b for a, b in self.rounds.values())

    @property
    def out(self) -> Path:
        return Path(self.sweep.out)


def parse_rounds(value: Any) -> float | int | None:
    """``--rounds``: an integer >= 1 (rounds per run) or a fraction in (0, 1) of the paper's rounds."""
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--rounds expects a number of rounds (e.g. 20) or a fraction of the paper's (e.g. 0.1), "
                          f"got {value!r}") from None
    if not math.isfinite(v) or v <= 0 or (v >= 1 and not v.is_integer()):
        raise ConfigError(f"--rounds expects a whole number >= 1 or a fraction in (0, 1), got {value!r}")
    return int(v) if v >= 1 else v


def _short(rounds: int, want: float | int | None) -> int:
    if want is None:
        return rounds
    return int(want) if isinstance(want, int) else max(1, round(rounds * want))


def _shrink_milestones(milestones: str, old: int, new: int) -> str:
    if new == old or not milestones:
        return milestones
    from ..config import parse_milestones

    out = sorted({max(1, round(m * new / old)) for m in parse_milestones(milestones)})
    return ",".join(str(m) for m in out if m < new) if new > 1 else ""


def plan_reproduction(name: str, *, methods: list[str] | None = None, settings: list[str] | None = None,
                      seeds: list[int] | None = None, rounds: float | int | None = None, out: str | None = None,
                      device: str | None = None, data_dir: str | None = None, tracker=None,
                      overrides: dict[str, Any] | None = None,
                      checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY) -> Reproduction:
    """The sweep of table ``name`` (its methods and settings, or the selected ones); every run's settings are
    checked here, so bad input fails before anything is written."""
    from ..config import FIELDS, load_config

    t = table(name)
    labels = _pick(methods, list(t.methods), "method", name)
    cols = _pick(settings, list(t.settings), "setting", name)
    seeds = [0, 1, 2] if seeds is None else list(seeds)
    if not seeds or any((not isinstance(s, int)) or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds expects distinct integers >= 0 (e.g. 0,1,2), got {seeds!r}")
    rounds = parse_rounds(rounds)
    overrides = dict(overrides or {})
    for k in overrides:
        if k not in FIELDS or k in ("out", "name", "seed", "method", "params", "preset"):
            raise ConfigError(f"--override {k}: not a run setting a reproduction may replace (see `fedlt run --help`; "
                              f"methods, seeds and the output folder have options of their own)")
    run = [m for m in labels if t.methods[m].missing is None]
    if not run:
        raise ConfigError(f"{name}: every selected method is missing from fedlt "
                          f"({', '.join(f'{m}: {t.methods[m].missing}' for m in labels)})")
    base = {k: v for k, v in (("device", device), ("data_dir", data_dir), ("tracker", tracker)) if v is not None}
    base.update(overrides)
    sw_settings, done_rounds = {}, {}
    for s in cols:
        over = dict(t.settings[s])
        try:
            cfg = load_config(None, {**over, **base})
        except ConfigError as e:
            raise ConfigError(f"{name} setting {s}: {e}") from None
        r = _short(cfg.rounds, rounds)
        done_rounds[s] = (int(load_config(None, over).rounds), r)
        if r != cfg.rounds:
            over.update(rounds=r, eval_every=min(cfg.eval_every, r),
                        lr_milestones=_shrink_milestones(cfg.lr_milestones, cfg.rounds, r))
        sw_settings[s] = over
    sw_methods = {m: {"method": t.methods[m].method, "params": dict(t.methods[m].params)} for m in run}
    if out is None:
        tag = "" if rounds is None else f"-rounds{rounds:g}"
        out = str(Path("runs") / f"reproduce-{name}{tag}")
    for label in list(sw_settings) + run:
        if not LABEL.match(label):  # the data files are checked by the tests; this keeps a bad edit loud
            raise ConfigError(f"{name}: label {label!r} cannot name a run directory")
    sw = Sweep(out=str(out), seeds=seeds, base=base, settings=sw_settings, methods=sw_methods,
               checkpoint_every=checkpoint_every)
    return Reproduction(t, run, [m for m in labels if m not in run], cols, seeds, sw, done_rounds, overrides)


# ------------------------------------------------------------------------------------------------ data
def check_data(runs) -> None:
    """Every dataset the planned runs read is there and readable (loaded once, which also warms this process's
    cache); else a one-line DataError naming the dataset and the command that fetches it, or where its files
    go. A file that is there but corrupt gets its loader's own one-line error."""
    from ..data.datasets import load_dataset
    from ..data.federated import check_clients
    from ..data.fetch import BY_HAND, SOURCES, presence
    from ..data.partition import partition_settings
    from ..data.split import split_training_set

    seen = set()
    for r in runs:
        cfg = r.cfg
        key = (cfg.dataset, cfg.data_dir, tuple(sorted(cfg.dataset_kw().items())))
        if key in seen:
            continue
        seen.add(key)
        found = {p.name: p.where for p in presence(cfg.data_dir)}
        if cfg.dataset in found and found[cfg.dataset] is None:
            looked = "--data-dir, " if cfg.data_dir else ""
            if cfg.dataset in SOURCES:
                how = (f"fetch it with `fedlt data fetch {cfg.dataset}" +
                       (f" --data-dir {cfg.data_dir}" if cfg.data_dir else "") +
                       "` (or pass --data-dir to where it is)")
            else:
                how = (f"it cannot be fetched: put {BY_HAND.get(cfg.dataset, 'its files')} in a folder and pass "
                       f"--data-dir to it")
            raise DataError(f"{r.setting} needs {cfg.dataset}, not found ({looked}$FEDLT_DATA, the default data "
                            f"folder; `fedlt data list` shows where fedlt looks); {how}")
        load_dataset(cfg.dataset, cfg.data_dir, **cfg.dataset_kw())
    splits = set()
    for r in runs:  # the partitions too (cheap next to training): an impossible one fails before anything is written
        cfg = r.cfg
        key = tuple(getattr(cfg, f) for f in DATA_FIELDS if f not in ("device", "data_placement"))
        if key in splits:
            continue
        splits.add(key)
        ds = load_dataset(cfg.dataset, cfg.data_dir, **cfg.dataset_kw())
        sp = split_training_set(ds, cfg.lt_profile, cfg.imbalance_ratio, cfg.n_max, cfg.tail_classes, cfg.partition,
                                cfg.clients, cfg.seed, partition_settings(cfg.partition, cfg), cfg.partition_file)
        try:
            check_clients(sp.parts, cfg.clients, cfg.partition)
        except ConfigError as e:
            raise ConfigError(f"{r.setting} seed {r.seed}: {e} (--override)") from None


def size_of(t: Table, settings: list[str] | None = None) -> dict[str, dict]:
    """Per setting: rounds, clients per round, local epochs, the (long-tailed) training-set size and the
    samples one run processes (rounds x participating share x epochs x samples), without reading data."""
    from ..config import load_config
    from ..data.longtail import exp_profile

    out = {}
    for s in settings or list(t.settings):
        cfg = load_config(None, dict(t.settings[s]))
        if cfg.dataset in _SIZES and cfg.lt_profile != "none":
            n = int(exp_profile(*_SIZES[cfg.dataset][:1], cfg.n_max or _SIZES[cfg.dataset][1],
                                cfg.imbalance_ratio).sum())
        elif cfg.dataset in _SIZES:
            n = _SIZES[cfg.dataset][0] * _SIZES[cfg.dataset][1]
        else:
            n = _TOTALS.get(cfg.dataset, 0)
        per_round = clients_per_round(cfg.clients, cfg.participation)
        share = per_round / cfg.clients
        out[s] = {"dataset": cfg.dataset, "model": cfg.model, "rounds": cfg.rounds, "clients": cfg.clients,
                  "per_round": per_round, "epochs": cfg.local_epochs, "samples": n,
                  "sample_steps": cfg.rounds * share * cfg.local_epochs * n}
    return out


def list_tables(echo: Callable[[str], None] = print) -> None:
    """``fedlt reproduce --list``: each table, its size and the presets behind it."""
    for name, t in tables().items():
        run = [m for m in t.methods.values() if m.missing is None]
        miss = [m.label for m in t.methods.values() if m.missing is not None]
        sizes = size_of(t)
        steps = sum(v["sample_steps"] for v in sizes.values()) * len(run)
        presets = list(dict.fromkeys(v.get("preset") for v in t.settings.values()))
        echo(f"{name:<16} {t.source}: {t.title}")
        echo(f"{'':<16} {len(run)} methods x {len(t.settings)} settings = {len(run) * len(t.settings)} runs per seed"
             + (f" (+ {len(miss)} missing from fedlt: {', '.join(miss)})" if miss else "")
             + f"; metrics {'/'.join(t.metrics)}; presets {', '.join(presets)}")
        groups: dict[str, list[int]] = {}
        for v in sizes.values():
            key = (f"{v['dataset']} {v['rounds']} rounds x {v['per_round']:g} of {v['clients']} clients x "
                   f"{v['epochs']} epochs")
            groups.setdefault(key, []).append(v["samples"])
        shapes = [f"{k} x ~{min(n):,}" + (f"-{max(n):,}" if max(n) != min(n) else "") + " samples"
                  for k, n in groups.items()]
        echo(f"{'':<16} {'; '.join(shapes)}: ~{steps:.2g} sample-steps per seed")


# ------------------------------------------------------------------------------------------------ report
@dataclass
class Row:
    method: str
    setting: str
    metric: str
    ours: float | None
    ours_std: float | None
    n: int
    diverged: int
    paper: float | None
    paper_std: float | None
    status: str  # ok | not run | missing in fedlt | failed in the paper | no number in the paper | diverged
    source: str

    @property
    def diff(self) -> float | None:
        return None if self.ours is None or self.paper is None else self.ours - self.paper


def compare_rows(rep: Reproduction, which: str | None = None) -> list[Row]:
    """Ours (from the runs on disk) beside the paper's number, for every selected cell of the table."""
    from .report import aggregate, collect

    cells = {}
    if rep.out.is_dir() and any(rep.out.rglob("config.json")):
        runs, _, _ = collect(rep.out)
        runs = [r for r in runs if r.method in rep.methods and r.setting in rep.settings and r.seed in rep.seeds]
        cells = aggregate(runs, which or rep.table.metric)
    rows = []
    for s in rep.settings:
        for m in rep.methods + rep.missing:
            for (cs, metric) in rep.table.columns:
                if cs != s:
                    continue
                pc = rep.table.cell(m, s, metric)
                c = cells.get((m, s), {}).get(metric)
                ours = c.mean if c is not None and not c.diverged else None
                std = c.std if c is not None and not c.diverged else None
                status = ("missing in fedlt" if m in rep.missing else "diverged" if c is not None and c.diverged
                          else "not run" if ours is None else "ok")
                if pc is not None and pc.failed:
                    status += "; failed in the paper"
                elif pc is None or pc.value is None:
                    status += "; no number in the paper"
                rows.append(Row(m, s, metric, ours, std, 0 if c is None else c.n, 0 if c is None else c.diverged,
                                None if pc is None else pc.value, None if pc is None else pc.std, status,
                                "" if pc is None else pc.source))
    return rows


def _pct(v: float | None, std: float | None = None) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")


def rankings(rows: list[Row]) -> list[dict]:
    """Per (setting, metric): the methods with both numbers, ranked on each side (best first), and the rank
    here of the paper's winner (methods tied with it at the printed precision, 0.01 points, share its rank)."""
    out = []
    for key in dict.fromkeys((r.setting, r.metric) for r in rows):
        both = [r for r in rows if (r.setting, r.metric) == key and r.ours is not None and r.paper is not None]
        if not both:
            continue
        paper = [r.method for r in sorted(both, key=lambda r: -r.paper)]
        ours = [r.method for r in sorted(both, key=lambda r: -r.ours)]
        by = {r.method: r.paper for r in both}
        shown = {r.method: round(100 * r.ours, 2) for r in both}  # ties at the printed precision share a rank
        rank = 1 + sum(v > shown[paper[0]] for v in shown.values())
        out.append({"setting": key[0], "metric": key[1], "paper": paper, "ours": ours,
                    "ours_shown": [shown[m] for m in ours], "paper_shown": [round(100 * by[m], 2) for m in paper],
                    "winner_agrees": rank == 1, "paper_winner_rank_here": rank})
    return out


def _order(names: list[str], values: list[float]) -> str:
    """``a > b = c``: best first, ``=`` between methods tied at the printed precision."""
    out = names[0]
    for i in range(1, len(names)):
        out += (" = " if values[i] == values[i - 1] else " > ") + names[i]
    return out


def heading(rep: Reproduction, which: str) -> list[str]:
    t = rep.table
    lines = [f"# Reproduction of {t.source}", "", f"{t.title}. Paper: {t.paper}.", ""]
    if rep.shortened:
        short = sorted({f"{b} of {a}" for a, b in rep.rounds.values()})
        lines += [f"**Shortened: every run at {', '.join(short)} rounds** (`--rounds`): a first look, not the "
                  f"paper's protocol.", ""]
    if rep.overrides:
        lines += ["**Settings replaced for every run** (`--override`, not the paper's protocol): " +
                  ", ".join(f"{k}={v}" for k, v in rep.overrides.items()) + ".", ""]
    metric = METRIC_TEXT[which]
    lines += [f"Ours: {metric}, mean ± std over seeds {rep.seeds} (in %; std only with 2 or more finished seeds). "
              f"Paper: the published number (± its std where given). Diff: ours − paper, in points.", ""]
    if t.note:
        lines += [f"Note: {t.note}", ""]
    if rep.missing:
        lines += ["Missing from fedlt (paper's numbers only): " +
                  "; ".join(f"{m} ({t.methods[m].missing})" for m in rep.missing) + ".", ""]
    return lines


def markdown(rep: Reproduction, rows: list[Row], which: str) -> str:
    lines = heading(rep, which)
    for s in rep.settings:
        mets = [m for cs, m in rep.table.columns if cs == s]
        lines += [f"## {s}", "", "| method | " + " | ".join(f"{m} ours | {m} paper | {m} diff" for m in mets) + " |",
                  "|---|" + "---|---|---|" * len(mets)]
        for meth in rep.methods + rep.missing:
            cells = []
            for m in mets:
                r = next(x for x in rows if (x.method, x.setting, x.metric) == (meth, s, m))
                ours = ("diverged" if r.diverged and r.ours is None else "n/a (missing)" if meth in rep.missing
                        else _pct(r.ours, r.ours_std))
                paper = "failed" if "failed in the paper" in r.status else _pct(r.paper, r.paper_std)
                diff = "-" if r.diff is None else f"{100 * r.diff:+.2f}"
                cells += [ours, paper, diff]
            lines.append(f"| {meth} | " + " | ".join(cells) + " |")
        lines.append("")
    ranks = rankings(rows)
    if ranks:
        lines += ["## Rankings (methods with both numbers, best first)", "",
                  "| setting | metric | paper | ours | paper's winner wins here |", "|---|---|---|---|---|"]
        for k in ranks:
            tied = k["ours_shown"].count(k["ours_shown"][0]) > 1
            verdict = (("yes (tied)" if tied else "yes") if k["winner_agrees"]
                       else f"no (rank {k['paper_winner_rank_here']} here)")
            lines.append(f"| {k['setting']} | {k['metric']} | {_order(k['paper'], k['paper_shown'])} | "
                         f"{_order(k['ours'], k['ours_shown'])} | {verdict} |")
        agree = sum(k["winner_agrees"] for k in ranks)
        lines += ["", f"The paper's winner wins here in {agree} of {len(ranks)} columns."]
    return "\n".join(lines) + "\n"


def csv_rows(rows: list[Row]) -> str:
    """Long format, fractions: one line per (method, setting, metric)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["method", "setting", "metric", "ours_mean", "ours_std", "ours_n", "paper", "paper_std", "diff",
                "status", "source"])
    f = lambda v: "" if v is None else f"{v:.6f}"  # noqa: E731
    for r in rows:
        w.writerow([r.method, r.setting, r.metric, f(r.ours), f(r.ours_std), r.n, f(r.paper), f(r.paper_std), f(r.diff),
                    r.status, r.source])
    return buf.getvalue()


def write(rep: Reproduction, rows: list[dict], which: str | None = None, echo: Callable[[str], None] = print) -> Path:
    """``<out>/report/reproduction.md`` and ``.csv`` of ``rows`` (:func:`compare_rows` for ``which``); prints the
    Markdown. Returns the .md path."""
    which = which or rep.table.metric
    d = rep.out / "report"
    d.mkdir(parents=True, exist_ok=True)
    md = markdown(rep, rows, which)
    (d / "reproduction.md").write_text(md)
    (d / "reproduction.csv").write_text(csv_rows(rows))
    echo(md)
    echo(f"reproduction report: {d / 'reproduction.md'} (and reproduction.csv)")
    return d / "reproduction.md"


def dry_run_lines(rep: Reproduction, runs) -> list[str]:
    """What ``--dry-run`` prints: the grid, where each dataset is (or how to get it), and every run."""
    from ..data.fetch import presence
    from .sweep import setting_label

    t = rep.table
    lines = [f"{t.name} ({t.source}): {len(runs)} runs = {len(rep.methods)} methods x {len(rep.settings)} settings x "
             f"{len(rep.seeds)} seeds -> {rep.out}"]
    if rep.missing:
        lines.append(f"not run (missing from fedlt): {', '.join(rep.missing)}")
    if rep.shortened:
        lines.append("shortened: " + ", ".join(f"{s} {b} of {a} rounds" for s, (a, b) in rep.rounds.items()))
    if rep.overrides:
        lines.append("overrides: " + ", ".join(f"{k}={v}" for k, v in rep.overrides.items()))
    where = {p.name: p for p in presence(runs[0].cfg.data_dir if runs else None)}
    for ds in dict.fromkeys(r.cfg.dataset for r in runs):
        p = where.get(ds)
        lines.append(f"data {ds}: " + (f"found in {p.where}" if p and p.where else
                                        f"NOT FOUND; {p.how if p else 'see `fedlt data list`'}"))
    for r in runs:
        c = r.cfg
        lines.append(f"{r.status():8s} {r.dir}  ({c.method}{' ' + str(c.params) if c.params else ''}; "
                     f"{setting_label(c)} x {c.participation:g}, {c.model}, {c.rounds} rounds x {c.local_epochs} "
                     f"epochs, lr {c.lr:g})")
    return lines
