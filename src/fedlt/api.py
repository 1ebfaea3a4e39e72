"""fedlt from Python: run, compare and sweep methods, and read the results, with no file parsing of your own.

    import fedlt

    res = fedlt.run(method="fedloge", preset="smoke", rounds=10, threads=1)
    res.final.gm, res.final.pm, res.last3.few, res.final.per_class, res.history     # fractions in [0, 1]
    cmp = fedlt.compare(["fedavg", "fedloge"], preset="smoke", rounds=10, threads=1)
    print(cmp.table())

Settings are those of ``fedlt run`` (``imbalance_ratio`` for ``--imbalance-ratio``, ``params`` a dict of method
parameters, ``method_file`` for ``--method-file``), given as keyword arguments, or as a dict, a TOML file path
or a :class:`~fedlt.config.RunConfig` in the first argument with keyword arguments overriding it. They go
through :func:`fedlt.config.load_config` like the command line's, so bad input raises the same one-line
:class:`~fedlt.errors.ConfigError` and nothing is written. The ``fedlt`` command is a thin layer over these
functions.

Runs print nothing unless given ``echo=print`` (and ``progress=True`` for progress bars). What is public and
kept stable is listed in ``fedlt.__all__``; everything else in the package may change.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterable

from .config import RunConfig, load_config
from .errors import ConfigError
from .jsonutil import read_json, read_json_lines
from .runner.preempt import DEFAULT_CHECKPOINT_EVERY

Echo = Callable[[str], None]
METRICS = ("GM", "many", "medium", "few", "PM")
WHICH = ("last3", "final")


def _quiet(*_args, **_kw) -> None:
    pass


# ------------------------------------------------------------------------------------------------ settings
def make_config(config: RunConfig | Mapping | str | os.PathLike | None = None, /, **settings: Any) -> RunConfig:
    """The validated settings of a run: defaults <- preset <- ``config`` (a dict, a TOML file or a RunConfig)
    <- keyword ``settings``; ``params`` dicts are merged, the keyword ones winning."""
    path, base = None, {}
    if isinstance(config, RunConfig):
        base = config.to_dict()
    elif isinstance(config, Mapping):
        base = dict(config)
    elif isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
    elif config is not None:
        raise ConfigError(f"config must be a dict, a TOML file path or a RunConfig, got {type(config).__name__}")
    params = {}
    for src in (base.pop("params", None), settings.pop("params", None)):
        if src is not None and not isinstance(src, Mapping):
            raise ConfigError(f"params must be a dict of method parameters, got {src!r}")
        params.update(src or {})
    return load_config(path, {**base, **settings, "params": params})


# ------------------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class Metrics:
    """One evaluation's headline numbers, as fractions in [0, 1] (None where undefined: a method without a
    generic model has no GM, a group without classes no value).

    ``gm`` and its ``many``/``medium``/``few`` and ``per_class`` are the method's first global inference mode
    (``gm_mode``), ``pm`` its first personal one (``pm_mode``), as in ``fedlt report``; ``modes`` has every
    mode, keyed ``GM[mode]`` / ``PM[mode]``, each a dict with ``acc``, ``many``, ``medium``, ``few``
    (and ``per_class`` for the global modes, ``std``/``min``/``max`` over clients for the personal ones).
    """

    gm: float | None
    many: float | None
    medium: float | None
    few: float | None
    pm: float | None
    per_class: list[float | None]
    gm_mode: str | None
    pm_mode: str | None
    modes: dict[str, dict] = field(repr=False)

    def as_dict(self) -> dict[str, float | None]:
        return {"GM": self.gm, "many": self.many, "medium": self.medium, "few": self.few, "PM": self.pm}


def _metrics(modes: dict[str, dict]) -> Metrics:
    gm = next((k for k in modes if k.startswith("GM[")), None)
    pm = next((k for k in modes if k.startswith("PM[")), None)
    g, p = modes.get(gm, {}), modes.get(pm, {})
    return Metrics(g.get("acc"), g.get("many"), g.get("medium"), g.get("few"), p.get("acc"),
                   list(g.get("per_class") or []), gm and gm[3:-1], pm and pm[3:-1], modes)


def _eval_modes(ev: dict) -> dict[str, dict]:
    out = {f"GM[{m}]": dict(r) for m, r in ev.get("global", {}).items()}
    out.update({f"PM[{m}]": dict(r) for m, r in ev.get("personal", {}).items()})
    return out


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


class RunResult:
    """One run: its directory, settings, status, final and last-3 metrics and its per-round history.

    ``status``: ``finished``; ``diverged`` (a finished run whose summary says so); ``partial`` (stopped, with a
    checkpoint to resume from) or ``not started``. ``method``, ``setting`` and ``seed`` are the labels of a
    sweep or comparison (for a single run: the method name and its data setting).
    """

    def __init__(self, run_dir: str | Path, method: str | None = None, setting: str | None = None,
                 seed: int | None = None, config: dict | None = None):
        from .experiments.report import _derived_settings

        self.dir = Path(run_dir)
        cfile, sfile = self.dir / "config.json", self.dir / "summary.json"
        hint = "re-run that run or remove its directory"
        self.config: dict = read_json(cfile, hint=hint) if cfile.is_file() else dict(config or {})
        self.summary: dict | None = read_json(sfile, hint=hint) if sfile.is_file() else None
        labels = self.config.get("labels") or {}
        self.method = str(method or labels.get("method") or self.config.get("method"))
        self.setting = str(setting or labels.get("setting") or _derived_settings([self.config])[0])
        self.seed = int(seed if seed is not None else labels.get("seed", self.config.get("seed", 0)))

    @property
    def status(self) -> str:
        if self.summary is not None:
            return str(self.summary.get("status", "finished"))
        from .runner.runstate import LEGACY, has_checkpoint

        return "partial" if has_checkpoint(self.dir) or (self.dir / LEGACY[0]).is_file() else "not started"

    @cached_property
    def history(self) -> list[dict]:
        """The per-round records of ``metrics.jsonl`` (round, clients, train loss, traffic, and ``eval`` every
        ``eval_every`` rounds), then post-training phases; the final evaluation is :attr:`final`."""
        f = self.dir / "metrics.jsonl"
        if not f.is_file():
            return []
        recs = read_json_lines(f, "re-run that run or remove its directory")
        return [r for r in recs if "final" not in r]

    @cached_property
    def final(self) -> Metrics | None:
        """The final evaluation (after any post-training phase: FedLoGe's realignment, fine-tuning)."""
        return _metrics(_eval_modes(self.summary["final"])) if self.summary and self.summary.get("final") else None

    @cached_property
    def last3(self) -> Metrics | None:
        """The mean of the last 3 evaluated rounds (the default number of the tables)."""
        if self.summary is None or self.status == "diverged":  # a diverged run has no result, never a number
            return None
        modes: dict[str, dict] = {}
        for key, v in self.summary.get("last3", {}).items():
            mode, stat = key.rsplit(".", 1)
            modes.setdefault(mode, {})[stat] = v
        evals = [_eval_modes(h["eval"]) for h in self.history if "eval" in h][-3:]
        for mode, d in modes.items():
            rows = [e[mode]["per_class"] for e in evals if "per_class" in e.get(mode, {})]
            if rows:
                d["per_class"] = [_mean(list(col)) for col in zip(*rows)]
        return _metrics(modes)

    def metrics(self, which: str = "last3") -> Metrics | None:
        if which not in WHICH:
            raise ConfigError(f"unknown metric {which!r}; choose last3 or final")
        return self.last3 if which == "last3" else self.final

    def curve(self, metric: str = "GM") -> list[tuple[int, float | None]]:
        """(round, value) at every evaluated round, ``metric`` one of GM, many, medium, few, PM."""
        from .metrics import headline

        if metric not in METRICS:
            raise ConfigError(f"unknown metric {metric!r}; choose one of: {', '.join(METRICS)}")
        return [(h["round"], headline(h["eval"]).get(metric)) for h in self.history if "eval" in h]

    def __repr__(self) -> str:
        m = self.last3
        nums = "" if m is None else ", last 3: " + ", ".join(
            f"{k} {100 * v:.2f}" for k, v in (("GM", m.gm), ("PM", m.pm)) if v is not None)
        return f"RunResult({self.method}, {self.setting}, seed {self.seed}, {self.status}{nums}; {self.dir})"


class Comparison:
    """The runs of a comparison or sweep (or of any folder of runs): methods x settings x seeds.

    ``runs`` in grid order; ``counts``: how many runs were started, resumed and skipped by this call, finished
    by another process meanwhile (``elsewhere``) and diverged (empty
    when read back with :func:`load`); ``report_dir``: the report written at the end, if any.
    """

    def __init__(self, root: str | Path, runs: list[RunResult], methods: list[str], settings: list[str],
                 counts: dict[str, int] | None = None, report_dir: Path | None = None):
        self.dir, self.runs, self.methods, self.settings = Path(root), runs, methods, settings
        self.seeds = list(dict.fromkeys(r.seed for r in runs))
        self.counts, self.report_dir = dict(counts or {}), report_dir

    def __getitem__(self, method: str) -> list[RunResult]:
        """The runs of one method (row label), every setting and seed."""
        found = [r for r in self.runs if r.method == method]
        if not found:
            raise KeyError(f"no runs of {method!r}; methods: {', '.join(self.methods)}")
        return found

    @property
    def diverged(self) -> list[RunResult]:
        return [r for r in self.runs if r.status == "diverged"]

    @property
    def exit_status(self) -> int:
        """What the command line exits with: 0, or 3 when a run diverged."""
        return 3 if self.diverged else 0

    def rows(self, which: str = "last3") -> list[dict]:
        """One dict per run (method, setting, seed, status, GM, many, medium, few, PM as fractions): ready for
        ``pandas.DataFrame(cmp.rows())``."""
        out = []
        for r in self.runs:
            m = r.metrics(which)
            out.append({"method": r.method, "setting": r.setting, "seed": r.seed, "status": r.status,
                        **(m.as_dict() if m else dict.fromkeys(METRICS))})
        return out

    def table(self, which: str = "last3") -> str:
        """A Markdown table: one row per method (and setting), GM / many / medium / few / PM in %, mean +- std
        over the finished seeds (``which``: last3 or final, as ``fedlt report --metric``)."""
        from .experiments import report as R

        if which not in WHICH:
            raise ConfigError(f"unknown metric {which!r}; choose last3 or final")
        cells = R.aggregate([R.Run(r.dir, r.method, r.setting, r.seed, r.config, r.summary) for r in self.runs],
                            which)
        several = len(self.settings) > 1
        head = ["method"] + (["setting"] if several else []) + list(METRICS) + ["seeds"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in self.settings:
            for m in self.methods:
                c = cells.get((m, s))
                if c is None and not any(r.method == m and r.setting == s for r in self.runs):
                    continue
                vals = [R._cell_text(c.get(k) if c else None, "md", False) for k in METRICS]
                n = max((c[k].n for k in METRICS), default=0) if c else 0
                lines.append("| " + " | ".join([m] + ([s] if several else []) + vals + [str(n)]) + " |")
        return "\n".join(lines)

    def __repr__(self) -> str:
        done = sum(r.status in ("finished", "diverged") for r in self.runs)
        return (f"Comparison({len(self.runs)} runs, {done} finished: methods {', '.join(self.methods)}; "
                f"settings {', '.join(self.settings)}; seeds {self.seeds}; {self.dir})")


def load(path: str | Path) -> RunResult | Comparison:
    """Read results back: a run directory gives a :class:`RunResult`, a folder of runs (a sweep, a comparison,
    a ``runs/`` folder) a :class:`Comparison`."""
    from .experiments.report import collect

    p = Path(path)
    if (p / "config.json").is_file():
        return RunResult(p)
    runs, methods, settings = collect(p)
    return Comparison(p, [RunResult(r.dir, r.method, r.setting, r.seed) for r in runs], methods, settings)


# ------------------------------------------------------------------------------------------------ running
def run(config: RunConfig | Mapping | str | os.PathLike | None = None, /, *, progress: bool = False,
        echo: Echo | None = None, checkpoint_every: int | None = None, resume: bool = False,
        **settings: Any) -> RunResult:
    """Run one experiment (the settings of ``fedlt run``) and return its result.

    ``checkpoint_every`` N > 0 writes a checkpoint every N rounds (default: after every round, so a run stopped
    by a scheduler's signal loses at most the round in progress; 0: none) and ``resume`` continues the run
    from its last one, which needs a ``name`` (so that a second call finds the same run directory). A run that diverges
    (``on_diverge="stop"``, the default) raises :class:`~fedlt.errors.Diverged` (exit status 3 on the command
    line) once its summary says so; :func:`load` of its directory then gives a result with status
    ``diverged``."""
    from .runner import rundir

    cfg = make_config(config, **settings)
    if resume and not cfg.name:
        raise ConfigError("resuming needs a run name (--name, name=...), so that a rerun finds the same run "
                          "directory")
    if resume:
        from .runner.runstate import check_resumable

        check_resumable(rundir.run_dir_for(cfg))
    if checkpoint_every is None:
        checkpoint_every = DEFAULT_CHECKPOINT_EVERY
    if checkpoint_every < 0:
        raise ConfigError(f"checkpoint-every must be >= 0, got {checkpoint_every}")
    summary = rundir.run(cfg, progress=progress, echo=echo or _quiet, checkpoint_every=checkpoint_every,
                             resume=resume)
    return RunResult(summary["run_dir"])


def _method_list(methods: str | Iterable[str]) -> list[str]:
    if isinstance(methods, str):
        return [m.strip() for m in methods.split(",") if m.strip()]
    return [str(m) for m in methods]


def compare(methods: str | Iterable[str], config: RunConfig | Mapping | str | os.PathLike | None = None, /, *,
            seeds: Iterable[int] | None = None, method_params: Mapping[str, Mapping] | None = None,
            checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, jobs: int | None = None, progress: bool = False,
            report: bool = True, metric: str = "last3", echo: Echo | None = None, backend=None,
            **settings: Any) -> Comparison:
    """Several methods on one setting, every method on the very same partition and client-sampling stream, for
    each seed (``seeds``, default: the ``seed`` setting). ``params`` (a setting) applies to every method,
    ``method_params={"fedprox": {"mu": 0.1}}`` to one. Runs go to ``<out>/<name>`` (default
    ``<out>/compare-<setting>``); finished runs are skipped and killed ones resumed when it is called again.
    ``jobs``: runs at a time, where the installed sweep runner supports it. ``report``: write the report
    (tables, figures) at the end, with ``metric`` last3 or final."""
    from .experiments.sweep import compare_sweep

    names = _method_list(methods)
    base = make_config(config, **{**settings, "method": names[0] if names else None})
    out = str(Path(base.out) / base.name) if base.name else None
    seeds = [base.seed] if seeds is None else [int(s) for s in seeds]
    sweep_ = compare_sweep(base, names, seeds, out, {k: dict(v) for k, v in (method_params or {}).items()},
                           checkpoint_every)
    return run_sweep(sweep_, jobs=jobs, progress=progress, report=report, metric=metric, echo=echo, backend=backend)


def sweep(file: str | os.PathLike | Mapping, /, *, out: str | None = None, checkpoint_every: int | None = None,
          jobs: int | None = None, threads: int | None = None, progress: bool = False, report: bool = True,
          metric: str = "last3", dry_run: bool = False, echo: Echo | None = None, backend=None) -> Comparison:
    """A grid of methods x settings x seeds: a sweep file (TOML, the format of :mod:`fedlt.experiments.sweep`)
    or the same as a dict. Resumable: finished runs are skipped, killed ones continue from their checkpoint."""
    from .experiments.sweep import load_sweep, parse_sweep

    if isinstance(file, Mapping):
        sw = parse_sweep(dict(file), out or file.get("out") or str(Path("runs") / "sweep"))
    else:
        sw = load_sweep(file, out)
    return run_sweep(sw, checkpoint_every=checkpoint_every, jobs=jobs, threads=threads, progress=progress,
                     report=report, metric=metric, dry_run=dry_run, echo=echo, backend=backend)


def run_sweep(sw, *, checkpoint_every: int | None = None, jobs: int | None = None, threads: int | None = None,
              progress: bool = False, report: bool = True, metric: str = "last3", dry_run: bool = False,
              echo: Echo | None = None, backend=None) -> Comparison:
    """Run a parsed :class:`fedlt.experiments.sweep.Sweep` (what :func:`compare` and :func:`sweep` share).
    ``backend``: None or ``"local"`` (this machine), ``"ray"`` or a
    :class:`fedlt.experiments.ray_backend.RayBackend` (each run a Ray task, docs/cluster.md)."""
    from .experiments.report import write_report
    from .experiments.sweep import plan, run_plan

    echo = echo or _quiet
    runs = plan(sw)
    every = sw.checkpoint_every if checkpoint_every is None else checkpoint_every
    if every < 0:
        raise ConfigError(f"--checkpoint-every must be >= 0, got {every}")
    if metric not in WHICH:
        raise ConfigError(f"unknown metric {metric!r}; choose last3 or final")
    parallel = {}
    be = as_backend(backend)
    if be is not None:
        be.check(jobs)  # a bad backend fails before anything runs or is printed
    if jobs is not None and jobs != 1:
        if not isinstance(jobs, int) or jobs < 1:
            raise ConfigError(f"jobs must be an integer >= 1, got {jobs!r}")
        if "jobs" not in inspect.signature(run_plan).parameters:
            raise ConfigError("parallel runs (jobs > 1) are not available in this version of fedlt; use jobs=1")
        parallel["jobs"] = jobs
    def result(counts=None, rep=None) -> Comparison:
        return Comparison(sw.out, [RunResult(r.dir, r.method, r.setting, r.seed, r.cfg.to_dict()) for r in runs],
                          list(sw.methods), list(sw.settings), counts, rep)

    if dry_run:
        for r in runs:
            echo(f"{r.status():8s} {r.dir}")
        return result()
    echo(f"{len(runs)} runs ({len(sw.methods)} methods x {len(sw.settings)} settings x {len(sw.seeds)} seeds) "
         f"in {sw.out}")
    tracked = group_trackers(sw.out, runs)
    counts = run_plan(runs, checkpoint_every=every, progress=progress, echo=echo, threads=threads,
                      backend=be, **parallel)
    echo(f"{counts['started']} started, {counts['resumed']} resumed from a checkpoint, "
         f"{counts['skipped']} finished before" +
         (f", {counts['elsewhere']} finished by another process" if counts.get("elsewhere") else "") +
         (f"; {counts['diverged']} diverged (recorded; the report shows them as diverged)"
          if counts.get("diverged") else ""))
    rep = None
    if report:
        from .runner.runstate import run_lock

        with run_lock(Path(sw.out) / "report", wait=True):  # two sweeps on one folder: one report writer at a time
            rep = write_report(sw.out, which=metric, echo=echo)
    if tracked and report:  # (reproduce writes its report itself, then ends the group)
        from .experiments.report import group_metrics
        from .runner.trackers import end_group

        end_group(sw.out, Path(rep) if rep is not None else None, metrics=lambda: group_metrics(Path(sw.out)))
    return result(counts, rep)


def group_trackers(out: str, runs) -> bool:
    """A sweep's runs tracked as one group (:func:`fedlt.runner.trackers.start_group`); whether they are tracked."""
    from .runner.trackers import active, start_group

    names = sorted({n for r in runs for n in active(r.cfg.tracker)} - {"tensorboard"})
    if names:
        start_group(out, names)
    return bool(names)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class Reproduced:
    """``fedlt reproduce``: the runs (a :class:`Comparison`, None for a dry run), and per cell of the table our
    number beside the paper's (``rows``: method, setting, metric, ours, ours_std, n, paper, paper_std, diff,
    status, source; fractions), the rankings per column, and the report written (None for a dry run)."""

    def __init__(self, plan, runs: Comparison | None, report_path: Path | None, rows: list[dict] | None = None):
        from .experiments import reproduce as R

        self.plan, self.runs, self.report_path = plan, runs, report_path
        self.table = plan.table
        self.rows = rows or []
        self.rankings = R.rankings(self.rows)

    @property
    def exit_status(self) -> int:
        return 0 if self.runs is None else self.runs.exit_status

    def markdown(self) -> str:
        from .experiments import reproduce as R

        return R.markdown(self.plan, self.rows, self.table.metric)

    def __repr__(self) -> str:
        return (f"Reproduced({self.table.name}: {len(self.rows)} cells, methods {', '.join(self.plan.methods)}; "
                f"settings {', '.join(self.plan.settings)}; seeds {self.plan.seeds}; {self.report_path})")


def reproduce(table: str, /, *, methods: str | Iterable[str] | None = None,
              settings: str | Iterable[str] | None = None, seeds: Iterable[int] | None = None,
              rounds: float | int | None = None, jobs: int | None = None, device: str | None = None,
              data_dir: str | None = None, out: str | None = None, overrides: Mapping[str, Any] | None = None,
              threads: int | None = None, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, figures: bool = True,
              progress: bool = False, dry_run: bool = False, echo: Echo | None = None, backend=None,
              tracker: str | Iterable[str] | None = None) -> Reproduced:
    """Run a seed paper's published table (``fedlt reproduce --list`` names them) as a sweep and write a report
    of our numbers beside the paper's (:mod:`fedlt.experiments.reproduce`). ``methods``/``settings``: a part of
    the table (default all of it); ``seeds`` default 0, 1, 2; ``rounds``: R rounds per run, or a fraction < 1
    of the paper's, for a first look; ``overrides``: run settings replaced for every run (the report says so).
    Resumable and parallel as :func:`sweep`; ``tracker``: experiment trackers of every run, grouped under the
    reproduction (:mod:`fedlt.runner.trackers`). ``dry_run``: list the runs and where the data is; write nothing.
    Missing data raises a one-line :class:`~fedlt.errors.DataError` before anything is written."""
    from .experiments import reproduce as R
    from .runner.runstate import run_lock
    from .experiments.sweep import plan as plan_runs

    echo = echo or _quiet
    elsewhere = dry_run and device is not None and device.startswith("cuda") and not _has_cuda()
    rep = R.plan_reproduction(table, methods=None if methods is None else _method_list(methods),
                              settings=None if settings is None else _method_list(settings),
                              seeds=None if seeds is None else [int(s) for s in seeds], rounds=rounds, out=out,
                              device=None if elsewhere else device, data_dir=data_dir, tracker=tracker,
                              overrides=dict(overrides or {}), checkpoint_every=checkpoint_every)
    runs = plan_runs(rep.sweep)
    if dry_run:
        if elsewhere:  # planning on a laptop what a GPU machine will run
            echo(f"device {device}: no CUDA device here; the runs are listed as planned, on {device} where one is")
        for line in R.dry_run_lines(rep, runs):
            echo(line)
        return Reproduced(rep, None, None)
    R.check_data(runs)
    cmp = run_sweep(rep.sweep, jobs=jobs, threads=threads, progress=progress, report=False,
                    metric=rep.table.metric, echo=echo, backend=backend)
    with run_lock(rep.out / "report", wait=True):  # two reproductions on one folder: one report writer at a time
        report(rep.out, metric=rep.table.metric, figures=figures, echo=_quiet)
        rows = R.compare_rows(rep)
        path = R.write(rep, rows, echo=echo)
    if any(r.cfg.tracker for r in runs):
        from .experiments.report import group_metrics
        from .runner.trackers import end_group

        end_group(rep.out, path.parent, metrics=lambda: group_metrics(Path(rep.out)))
    cmp.report_dir = path.parent
    return Reproduced(rep, cmp, path, rows)


def report(path: str | os.PathLike, /, *, out: str | os.PathLike | None = None, metric: str = "last3",
           figures: bool = True, echo: Echo | None = None) -> Path:
    """``fedlt report``: tables (Markdown, CSV, LaTeX), figures and report.md for a run or a folder of runs;
    returns the report directory (default ``<path>/report``)."""
    from .experiments.report import write_report

    return write_report(path, out, which=metric, figures=figures, echo=echo or _quiet)


# ------------------------------------------------------------------------------------------------ methods
@dataclass(frozen=True)
class MethodInfo:
    """A method as ``fedlt list`` shows it. ``origin``: ``built-in``, ``plugin DIST VERSION`` or
    ``file PATH``; ``params``: the hyper-parameters and their defaults; ``batched``: it describes its local
    steps, so a round's clients can train together (``client_parallel``)."""

    name: str
    summary: str
    generic: bool
    personalized: bool
    params: dict[str, Any]
    origin: str
    batched: bool = False


def list_methods(method_file: str | os.PathLike | None = None) -> list[MethodInfo]:
    """Every method: built-in, installed plugins, and the methods of ``method_file`` if given. Plugins that
    cannot be loaded are left out; ``fedlt.METHODS.problems()`` says why, one line each."""
    from .plugins import load_method_file
    from .registry import METHODS

    if method_file is not None:
        load_method_file(method_file)
    out = []
    for name, cls in METHODS.items():
        doc = (sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip().splitlines()
        params = {f.name: f.default for f in dataclasses.fields(cls.Params) if f.default is not dataclasses.MISSING}
        out.append(MethodInfo(name, doc[0] if doc else "", bool(cls.generic), bool(cls.personalized), params,
                              METHODS.origin(name), bool(cls.describes_steps())))
    return out


def as_backend(backend):
    """None (this machine) or a RayBackend, from what the functions above accept."""
    from .experiments.ray_backend import RayBackend

    if backend in (None, "local"):
        return None
    if backend == "ray":
        return RayBackend()
    if isinstance(backend, RayBackend):
        return backend
    raise ConfigError(f"unknown backend {backend!r}; choose 'local', 'ray' or a RayBackend(address=...)")
