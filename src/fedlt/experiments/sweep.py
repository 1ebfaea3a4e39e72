"""Sweeps and comparisons: a grid of methods x settings x seeds, run one after the other or N at a time in
worker processes (``--jobs N``), resumable.

A sweep file (TOML)::

    out = "runs/digits-sweep"          # the sweep directory (default: runs/<file name without .toml>)
    seeds = [0, 1]                     # default: [base.seed] or [0]
    checkpoint_every = 1               # rounds between checkpoints (0: none); `--checkpoint-every` overrides

    [base]                             # settings shared by every run: any `fedlt run` setting, `preset`,
    dataset = "digits"                 # and a [base.params] table of method parameters
    rounds = 10

    [settings]                         # the columns of the tables: label -> the settings that differ
    rho10 = { imbalance_ratio = 10 }
    rho50 = { imbalance_ratio = 50 }

    [methods]                          # the rows: label -> {method = NAME (default: the label),
    fedavg = {}                        #   params = {...}, any other setting}
    fedprox = { params = { mu = 0.01 } }
    # or simply: methods = ["fedavg", "fedprox"]

Each run writes to ``<out>/<setting>/<method>/seed<seed>`` (deterministic, so a second start finds it). A run
whose directory holds ``summary.json`` is finished (or diverged) and skipped; one with a checkpoint continues
from it; any other is started afresh. A finished or checkpointed run made with other settings is an error,
never silently mixed in. Each run is done under a lock file beside its directory (``.seed0.lock``), which the
kernel releases when its process ends however it ends: two sweeps on one folder, or the workers of one, work
on disjoint runs, and a sweep killed with ``kill -9`` and started again takes up where it was.

Same data for every method: the long-tailed subset, the partition, the clients' test sets and the
client-sampling schedule are pure functions of the data settings and the seed (see ``fedlt.data`` and
``engine.sampling_schedule``). The runner builds each federation once per process and hands the very same
object to every method of that (setting, seed) that the process runs; worker processes rebuild it, equal.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config import RunConfig, available_cores, load_config, name_part, read_toml, worker_count
from ..decl import settings_of, show
from ..errors import ConfigError, Diverged
from ..runner.preempt import DEFAULT_CHECKPOINT_EVERY, Preempted, installed

LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")
SWEEP_KEYS = ("out", "seeds", "checkpoint_every", "base", "settings", "methods")
MANIFEST = "sweep.json"
# the settings the federation depends on (cfg fields); runs agreeing on them share one Federation object
DATA_FIELDS = ("dataset", "data_dir", "imbalance_ratio", "lt_profile", "tail_classes", "n_max", "partition",
               "alpha", "shards_per_client", "tau", "min_client_size", "clients", "seed", "device",
               "data_placement", "image_size", "partition_file", "classes_per_client", "balance",
               "client_test_fraction", "synthetic_per_class")


@dataclass
class Sweep:
    out: str
    seeds: list[int]
    base: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, dict[str, Any]] = field(default_factory=lambda: {"default": {}})
    methods: dict[str, dict[str, Any]] = field(default_factory=lambda: {"fedavg": {}})
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
    over: dict[str, Any] = field(default_factory=dict)  # the command line's settings for every run (they win)
    typed: bool = False  # base, settings and methods come from a TOML file: a number there is no text


@dataclass
class PlannedRun:
    method: str  # row label
    setting: str  # column label
    seed: int
    cfg: RunConfig
    root: str = ""  # the sweep's folder (the run's is root/setting/method/seed<S>: cfg.out / cfg.name)

    @property
    def dir(self) -> Path:
        return Path(self.cfg.out) / str(self.cfg.name)

    @property
    def labels(self) -> dict:
        return {"method": self.method, "setting": self.setting, "seed": self.seed}

    def status(self) -> str:
        """done (summary.json: finished or diverged), partial (a checkpoint, or a fedlt 0.1 one, which
        resuming refuses with a one-line error), or new."""
        from ..runner.runstate import LEGACY, has_checkpoint

        if (self.dir / "summary.json").is_file():
            return "done"
        return "partial" if has_checkpoint(self.dir) or (self.dir / LEGACY[0]).is_file() else "new"


# ------------------------------------------------------------------------------------------------ parsing
def load_sweep(path: str | Path, out: str | None = None) -> Sweep:
    d = read_toml(path, "sweep")
    return parse_sweep(d, out or d.get("out") or str(Path("runs") / Path(path).stem), str(path))


def parse_sweep(d: dict, out: str, where: str = "sweep") -> Sweep:
    unknown = set(d) - set(SWEEP_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; a sweep file has "
                          f"{', '.join(SWEEP_KEYS)} (run settings go in [base], [settings.X], [methods.X])")
    base = _table(d.get("base", {}), f"{where}: [base]")
    seeds = d.get("seeds", [base.get("seed", 0)])
    if isinstance(seeds, int):
        seeds = [seeds]
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and s >= 0 for s in seeds)):
        raise ConfigError(f"{where}: seeds must be a non-empty list of non-negative integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{where}: seeds repeat: {seeds}")
    settings = _table(d.get("settings", {"default": {}}), f"{where}: [settings]") or {"default": {}}
    for label, s in settings.items():
        _check_label(label, where, "setting")
        _table(s, f"{where}: settings.{label}")
    methods = _methods(d.get("methods", ["fedavg"]), where)
    ce = d.get("checkpoint_every", DEFAULT_CHECKPOINT_EVERY)
    if not isinstance(ce, int) or ce < 0:
        raise ConfigError(f"{where}: checkpoint_every must be an integer >= 0 (0: no checkpoints), got {ce!r}")
    return Sweep(out=str(out), seeds=list(seeds), base=base, settings=settings, methods=methods,
                 checkpoint_every=ce, typed=True)


def _table(v, what: str) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(f"{what} must be a table, got {v!r}")
    return v


def _check_label(label: str, where: str, kind: str) -> None:
    if not LABEL.match(str(label)):
        raise ConfigError(f"{where}: {kind} label {label!r} must be letters, digits and _ . + = - "
                          f"(it names a directory)")


def _methods(v, where: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    if isinstance(v, str):
        v = [v]
    if isinstance(v, list):
        for item in v:
            if isinstance(item, str):
                label, spec = item, {}
            elif isinstance(item, dict):
                spec = dict(item)
                label = spec.pop("label", None) or spec.get("method")
                if not label:
                    raise ConfigError(f"{where}: a method table in the list needs method = NAME")
            else:
                raise ConfigError(f"{where}: methods entries are names or tables, got {item!r}")
            if label in out:
                raise ConfigError(f"{where}: method label {label!r} appears twice; give variants labels")
            out[label] = spec
    elif isinstance(v, dict):
        out = {k: dict(_table(s, f"{where}: methods.{k}")) for k, s in v.items()}
    else:
        raise ConfigError(f"{where}: methods must be a list of names or a table, got {v!r}")
    if not out:
        raise ConfigError(f"{where}: no methods given")
    for label in out:
        _check_label(label, where, "method")
    return out


# ------------------------------------------------------------------------------------------------ planning
def plan(sweep: Sweep) -> list[PlannedRun]:
    """Every run of the grid as a validated RunConfig (bad settings fail here, before anything runs), ordered
    setting by setting, seed by seed, so runs sharing a federation follow each other."""
    runs = []
    for what, labels in (("setting", sweep.settings), ("method", sweep.methods)):
        for lab in labels:  # each label is a folder of the sweep: <out>/<setting>/<method>/seed<S>
            if not isinstance(lab, str) or lab in ("", ".", "..") or "/" in lab or "\\" in lab or \
                    any(ord(c) < 32 for c in lab) or len(lab.encode("utf-8", "surrogatepass")) > 200:
                raise ConfigError(f"sweep: {what} label {show(lab)} names a folder of the sweep; use a name without "
                                  f"/ or \\ or control characters, not . or .., of at most 200 bytes")
    for setting, s_over in sweep.settings.items():
        for seed in sweep.seeds:
            for label, m_over in sweep.methods.items():
                merged: dict[str, Any] = {}
                params: dict[str, Any] = {}
                for part in (sweep.base, s_over, m_over, sweep.over):
                    part = dict(part)
                    params.update(_table(part.pop("params", {}), "params"))
                    merged.update(part)
                for k in ("out", "name", "seed"):
                    if k in merged:
                        raise ConfigError(f"sweep: {k!r} is set by the sweep itself (out, seeds, the labels); "
                                          f"remove it from [base]/[settings]/[methods]")
                merged.setdefault("method", label)
                # a run's name is one folder name: the setting and method labels are folders of its --out
                merged.update(seed=seed, out=str(Path(sweep.out) / setting / label), name=f"seed{seed}",
                              params=params)
                try:
                    cfg = load_config(None, merged, typed=set(merged) - set(sweep.over) if sweep.typed else ())
                except ConfigError as e:
                    raise ConfigError(f"sweep run {setting}/{label}/seed{seed}: {in_file_words(str(e))}") from None
                runs.append(PlannedRun(label, setting, seed, cfg, sweep.out))
    return runs


RUN_FLAG = re.compile(r"(?<![\w.-])--([a-z][a-z0-9-]*)(?: ([\w.:-]+))?")


def in_file_words(message: str) -> str:
    """A run's error told of a sweep file: a run setting's command-line option, which ``fedlt sweep`` does not take,
    named as the file's key (``--allow-large`` -> ``allow_large = true``, ``--dp client`` -> ``dp = "client"``,
    ``--partition-file FILE.json`` -> ``partition_file = FILE.json``); other text as it is."""
    table = settings_of(RunConfig)

    def key(m: re.Match) -> str:
        s, word = table.get(m.group(1).replace("-", "_")), m.group(2)
        if s is None or not s.decl.cli:
            return m.group(0)
        if s.kind is bool and not s.nullable:
            return f"{s.name} = true" + (f" {word}" if word else "")
        if word and word in (s.decl.allowed() or ()):
            return f'{s.name} = "{word}"'
        if word and (word.split(".")[0].isupper() or re.fullmatch(r"-?[\d.]+(e-?\d+)?", word)):  # FILE.json, 1
            return f"{s.name} = {word}"
        return s.name + (f" {word}" if word else "")

    return RUN_FLAG.sub(key, message)


def compare_sweep(base: RunConfig, methods: list[str], seeds: list[int], out: str | None = None,
                  method_params: dict[str, dict] | None = None, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY) -> Sweep:
    """``fedlt compare``: several methods on the one setting of ``base``."""
    if not methods:
        raise ConfigError("compare needs at least one method (--methods fedavg,fedprox)")
    if len(set(methods)) != len(methods):
        raise ConfigError(f"--methods repeats a method: {','.join(methods)}")
    setting = setting_label(base)
    skip = {"method", "params", "out", "name", "seed", "preset"}
    shared = {k: v for k, v in base.to_dict().items() if k not in skip}
    shared["params"] = dict(base.params)
    meth = {m: {"params": dict((method_params or {}).get(m, {}))} for m in methods}
    unknown = set(method_params or {}) - set(methods)
    if unknown:
        raise ConfigError(f"--set names method(s) {', '.join(sorted(unknown))} not in --methods")
    return Sweep(out=out or str(Path(base.out) / f"compare-{setting}"), seeds=list(seeds), base=shared,
                 settings={setting: {}}, methods=meth, checkpoint_every=checkpoint_every)


def setting_label(cfg: RunConfig) -> str:
    part = name_part(cfg.partition) + (f"{cfg.alpha:g}" if cfg.partition == "dirichlet" else "")
    return f"{name_part(cfg.dataset)}-rho{cfg.imbalance_ratio:g}-{part}-K{cfg.clients}"


# ------------------------------------------------------------------------------------------------ running
def federation_key(cfg: RunConfig) -> tuple:
    return tuple(getattr(cfg, f) for f in DATA_FIELDS)


def check_finished(run: PlannedRun) -> None:
    """A finished run is reused only if it was made with the same settings."""
    from ..runner.runstate import config_differences

    from ..jsonutil import read_json

    saved = read_json(run.dir / "config.json", f"finished run {run.dir}'s config.json", "delete the run to run it again")
    current = run.cfg.to_dict()
    if current.get("model") is None:  # the saved config holds the resolved default model
        saved.pop("model", None)
        current.pop("model", None)
    diff = config_differences(saved, current)
    if diff:
        raise ConfigError(f"finished run {run.dir} was made with other settings ({'; '.join(diff[:3])}); "
                          f"delete it or use another sweep directory")


def run_plan(runs: list[PlannedRun], checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, progress: bool = True,
             echo: Callable[[str], None] = print, threads: int | None = None, jobs: int = 1,
             backend=None) -> dict[str, int]:
    """Run every planned run not finished yet: one after the other in this process (``jobs`` 1), or ``jobs``
    at a time, each in a worker process of its own. Returns how many runs were skipped (finished before),
    resumed from a checkpoint, started afresh, finished by another process meanwhile, and how many of those
    run here diverged.

    Every run is done under its lock (:func:`fedlt.runner.runstate.run_lock`), so two sweeps on one
    folder (or the workers of one) never work on the same run: a run locked by another process is left
    for the end, then waited for, and run here only if that process stopped before finishing it. A run that
    diverges is recorded (its summary says so) and the sweep carries on. ``backend``: a
    :class:`fedlt.experiments.ray_backend.RayBackend` runs each run as a Ray task instead."""
    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    if backend is not None:
        backend.check(jobs)  # before anything is written
    else:
        check_cores(runs, jobs, threads)
    write_manifest(runs)
    counts = {"skipped": 0, "resumed": 0, "started": 0, "elsewhere": 0, "diverged": 0}
    todo = []
    for i, r in enumerate(runs, 1):
        if r.status() == "done":
            check_finished(r)
            counts["skipped"] += 1
            echo(f"{_where(i, len(runs), r)}: finished before, skipped")
        else:
            todo.append((i, r))
    try:
        return _run_todo(runs, todo, jobs, checkpoint_every, progress, echo, threads, counts, backend)
    except Preempted as e:  # a scheduler's signal: workers stopped, every unfinished run keeps its checkpoint
        left = sum(r.status() != "done" for r in runs)
        raise e.stopped(f"sweep {runs[0].root} stopped with {left} of {len(runs)} runs unfinished; run the same "
                        f"command again to skip the finished ones and resume the others from their checkpoints")


def _run_todo(runs, todo, jobs, checkpoint_every, progress, echo, threads, counts, backend) -> dict[str, int]:
    if backend is not None:
        busy = backend.run(todo, len(runs), checkpoint_every, threads, progress, echo, counts) if todo else []
    else:
        if jobs > 1 and len(todo) < jobs:
            echo(f"--jobs {jobs} is more than the {len(todo)} run{'s' * (len(todo) != 1)} to do: running "
                 f"{max(len(todo), 1)} at a time")
            jobs = max(len(todo), 1)
        busy = (_run_parallel(todo, len(runs), jobs, checkpoint_every, threads, progress, echo, counts) if jobs > 1
                else _run_here(todo, len(runs), checkpoint_every, threads, progress, echo, counts, wait=False))
    if busy:
        echo(f"waiting for {len(busy)} run{'s' * (len(busy) != 1)} held by another fedlt process")
        _run_here(busy, len(runs), checkpoint_every, threads, progress, echo, counts, wait=True)
    return counts


def _where(i: int, n: int, r: PlannedRun) -> str:
    return f"[{i}/{n}] {r.setting} / {r.method} / seed {r.seed}"


_FED: dict = {}  # this process's last federation: runs of one (setting, seed) share it


def _execute(r: PlannedRun, checkpoint_every: int, threads: int | None, progress: bool,
             announce: Callable[[str], None] | None = None) -> dict:
    """Run ``r`` in this process under its lock. Returns what happened: ``kind`` (started, resumed,
    elsewhere: finished by another process before the lock was ours, busy: locked by another process),
    ``line`` (its result for the progress output) and ``diverged``. ``announce(kind)`` is called once the
    run is ours, before it runs."""
    from ..runner.rundir import federation_for, prepare, run
    from ..runner.runstate import OtherSettings, lock_holder, run_lock

    with run_lock(r.dir) as mine:
        if not mine:
            return {"kind": "busy", "line": f"being run by process {lock_holder(r.dir)}; left for the end",
                    "diverged": False}
        status = r.status()  # again, under the lock: another process may have finished it meanwhile
        if status == "done":
            check_finished(r)
            return {"kind": "elsewhere", "line": "finished by another process", "diverged": False}
        cfg = r.cfg if threads is None else RunConfig(**{**r.cfg.to_dict(), **share_of_cores(r.cfg, threads)})
        if _FED.get("key") != federation_key(cfg):
            _FED.clear()
            _FED.update(key=federation_key(cfg), fed=federation_for(cfg))
        kind = "resumed" if status == "partial" else "started"
        if announce is not None:
            announce(kind)
        try:
            s = run(cfg, progress=progress, echo=lambda *_: None, prepared=prepare(cfg, _FED["fed"]),
                    checkpoint_every=checkpoint_every, resume=True, labels=r.labels)
        except Diverged as e:
            return {"kind": kind, "line": f"diverged in round {e.round}: {e.reason}", "diverged": True}
        except OtherSettings as e:  # as a finished run's (check_finished): the sweep's own fixes
            raise ConfigError(f"checkpointed run {r.dir} was made with other settings "
                              f"({'; '.join(e.differences[:3])}); delete it or use another sweep directory") from None
        return {"kind": kind, "line": f"done in {s['wall_time']:.1f} s, " + _headline(s), "diverged": False}


def _headline(summary: dict) -> str:
    parts = [f"{k.split('.')[0]} {100 * v:.2f}" for k, v in summary.get("last3", {}).items()
             if k.endswith(".acc") and v is not None]
    return "mean of the last 3 evaluations: " + ", ".join(parts)


def _count(counts: dict, res: dict) -> None:
    counts[res["kind"]] += 1
    counts["diverged"] += int(res["diverged"])


def _run_here(todo, n, checkpoint_every, threads, progress, echo, counts, wait: bool) -> list:
    """Run ``todo`` one after the other in this process; returns those another process holds (unless
    ``wait``: then wait for each lock, and run what that process left unfinished)."""
    from ..runner.runstate import run_lock

    busy = []
    for i, r in todo:
        where = _where(i, n, r)
        def announce(kind, where=where, r=r):
            echo(f"{where}: {'resuming' if kind == 'resumed' else 'running'} -> {r.dir}")

        if wait:
            with run_lock(r.dir, wait=True):
                res = _execute(r, checkpoint_every, threads, progress, announce)
        else:
            res = _execute(r, checkpoint_every, threads, progress, announce)
        _settle(i, n, r, res, counts, busy, None, echo)
    return busy


# ------------------------------------------------------------------------------------------------ parallel
def visible_gpus(cfgs: list[RunConfig]) -> list[str]:
    """The GPUs to spread runs over: none unless every CUDA run asks for plain ``cuda`` (a run pinned to
    ``cuda:N`` keeps its device); else $CUDA_VISIBLE_DEVICES's entries, or every device torch sees."""
    cuda = [c.device for c in cfgs if c.device.startswith("cuda")]
    if not cuda or any(d != "cuda" for d in cuda):
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def worker_devices(jobs: int, gpus: list[str]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each worker: the GPUs in turn, so ``jobs`` workers share them evenly (several
    runs per GPU when there are more workers than GPUs); None: leave the variable alone."""
    return [gpus[k % len(gpus)] if gpus else None for k in range(jobs)]


def threads_per_worker(jobs: int, threads: int | None) -> int:
    """--threads if given, else this process's CPU cores split between the workers (at least 1 each)."""
    if threads:
        return threads
    return max(1, available_cores() // jobs)


def share_of_cores(cfg: RunConfig, threads: int) -> dict:
    """The settings that give a sweep's run ``threads`` cores: its torch threads, or with --workers its worker
    processes' (one thread each; auto: as many workers as those cores, none below two)."""
    w = str(cfg.workers)
    if w == "off":
        return {"threads": threads}
    if w == "auto":
        return {"workers": str(threads) if threads >= 2 else "off", "threads": 1}
    return {"threads": cfg.threads or 1}


def check_cores(runs: list[PlannedRun], jobs: int, threads: int | None) -> None:
    """--jobs J with runs that train their clients in N worker processes (--workers) of T threads: J x N x T
    must fit the cores this process may use, or the machine is oversubscribed (one line, before anything is
    written). ``auto`` shares the cores out: each run's workers are the cores / J."""
    if jobs < 2:
        return
    cores = available_cores()
    for r in runs:
        if str(r.cfg.workers) in ("off", "auto"):  # auto: cores / jobs workers each (share_of_cores), so it fits
            continue
        t, n = threads or r.cfg.threads or 1, worker_count(r.cfg)
        if jobs * n * t > cores:
            raise ConfigError(f"--jobs {jobs} x --workers {n} x {t} thread{'s' * (t != 1)} asks for {jobs * n * t} "
                              f"threads, past the {cores} cores this process may use; lower --jobs or --workers (jobs "
                              f"x workers <= cores), or use --workers auto")


def _runs_bar(n: int, todo: list, progress: bool, echo):
    """The overall bar of a sweep whose runs finish elsewhere (worker processes, Ray tasks), and how to print a
    line without breaking it: ``(bar, say)``; no bar without ``progress``."""
    from tqdm.auto import tqdm

    bar = tqdm(total=n, initial=n - len(todo), desc="runs", unit="run", dynamic_ncols=True) if progress else None
    return bar, (bar.write if bar is not None else echo)


def _settle(i: int, n: int, r: PlannedRun, res: dict, counts: dict, busy: list, bar, say) -> None:
    """One run's result from a worker (a process or a Ray task): a run another process held goes to ``busy``
    (run here once the others are done); any other is counted and ticks the bar; either way one line."""
    if res["kind"] == "busy":
        busy.append((i, r))
    else:
        _count(counts, res)
        if bar is not None:
            bar.update(1)
    say(f"{_where(i, n, r)}: {res['line']}")


def _run_parallel(todo, n, jobs, checkpoint_every, threads, progress, echo, counts) -> list:
    """``jobs`` worker processes (spawned: nothing inherited, CUDA initialised in each) take runs from a queue;
    this process shows an overall bar and one line per finished run. Returns the runs another process held."""
    import multiprocessing as mp
    import queue
    import sys

    ctx = mp.get_context("spawn")
    gpus = visible_gpus([r.cfg for _, r in todo])
    devices = worker_devices(jobs, gpus)
    each = threads_per_worker(jobs, threads)
    echo(f"running {len(todo)} runs, {jobs} at a time in worker processes ({each} CPU thread{'s' * (each > 1)} "
         f"each{'; GPUs ' + ', '.join(str(d) for d in devices) if gpus else ''})")
    tasks, results = ctx.Queue(), ctx.Queue()
    for item in todo:
        tasks.put(item)
    for _ in range(jobs):
        tasks.put(None)
    procs = [ctx.Process(target=_worker_main, args=(devices[k], tasks, results, checkpoint_every, each), daemon=True)
             for k in range(jobs)]
    bar, say = _runs_bar(n, todo, progress, echo)
    busy, left = [], len(todo)
    try:
        for p in procs:
            p.start()
        while left:
            try:
                msg = results.get(timeout=2.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    raise RuntimeError("every sweep worker stopped before the runs were done") from None
                continue
            kind, i, r, res = msg
            if kind == "error":
                err = res["cls"](res["message"])
                raise err
            if kind == "crash":
                sys.stderr.write(res["traceback"])
                raise RuntimeError(f"sweep worker failed on {_where(i, n, r)} (traceback above)")
            left -= 1
            _settle(i, n, r, res, counts, busy, bar, say)
    finally:
        for p in procs:
            if p.is_alive() and left:
                p.terminate()
            p.join()
        if bar is not None:
            bar.close()
    return busy


def _worker_main(device, tasks, results, checkpoint_every: int, threads: int) -> None:
    """One worker process: runs from ``tasks`` until a None (or until its parent is gone). SIGTERM (from the
    parent, or a scheduler) stops it at once, the run's checkpoints intact (:mod:`fedlt.runner.preempt`)."""
    import traceback

    from ..errors import FedltError

    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    parent = os.getppid()
    try:
        with installed():
            while os.getppid() == parent:
                item = tasks.get()
                if item is None:
                    return
                i, r = item
                try:
                    results.put(("ok", i, r, _execute(r, checkpoint_every, threads, progress=False)))
                except FedltError as e:
                    results.put(("error", i, r, {"cls": type(e), "message": str(e)}))
                    return
                except Exception:  # noqa: BLE001 -- a bug: the parent prints it and stops the sweep
                    results.put(("crash", i, r, {"traceback": traceback.format_exc()}))
                    return
    except KeyboardInterrupt:
        return


def write_manifest(runs: list[PlannedRun]) -> None:
    """<out>/sweep.json: the grid (row and column order for the report) and where each run lives."""
    if not runs:
        return
    out = Path(runs[0].root)
    out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r.method for r in runs))
    settings = list(dict.fromkeys(r.setting for r in runs))
    seeds = list(dict.fromkeys(r.seed for r in runs))
    body = {"methods": methods, "settings": settings, "seeds": seeds,
            "runs": [{**r.labels, "dir": str(r.dir.relative_to(out))} for r in runs]}
    tmp = out / f"{MANIFEST}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(out / MANIFEST)
