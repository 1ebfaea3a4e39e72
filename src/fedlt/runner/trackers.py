"""Experiment trackers (``--tracker mlflow,wandb,tensorboard``): a run's records, also where researchers look.

One interface, fed from the records that write ``metrics.jsonl`` (:class:`fedlt.runner.runstate.MetricsLog` hands each
record to :class:`Trackers` after writing it), so a tracker holds nothing the run directory does not:

- the run's settings (``config.json``) as parameters, the run directory's name (``--name``; in a sweep
  ``setting/method/seedN``) as the run's name;
- every record's numbers as one step (:func:`metrics_of`): a round's at its round (``train_loss``, ``lr``,
  ``bytes_*``, ``round_time``, ``clients`` and ``missing`` counted, ``eval/GM/<mode>/acc|many|medium|few``,
  ``eval/PM/...``, and whatever number a record gains later), a post-training phase's as ``phase/<name>/...``
  and the final evaluation as ``final/...`` at the last round;
- ``partition.json`` (the client-by-class map) and ``config.json`` when the run starts, ``summary.json`` and
  ``metrics.jsonl`` when it ends, as artifacts; a sweep's report (tables, figures) on its group's run.

Where they write, with nothing to start: MLflow into ``<out>/mlflow.db`` (SQLite; artifacts in
``<out>/mlartifacts``; ``mlflow ui --backend-store-uri sqlite:///<out>/mlflow.db`` opens it) unless
``MLFLOW_TRACKING_URI`` names a server; W&B offline into the run directory's ``wandb/`` unless you are logged in
or set ``WANDB_MODE`` (``wandb sync <run dir>/wandb/offline-run-*`` uploads later); TensorBoard into the run
directory's ``tensorboard/``.

Resuming (``--resume``, a sweep restarted) continues the same tracked run: ``trackers.json`` in the run
directory keeps each tracker's run id and how many records it has; records a killed run had already logged
are not logged again, and none it lost is missing: MLflow's count is a tag written in the same call as the
step's metrics; an offline W&B run's rounds are read back from its .wandb files (a kill -9 takes the rows W&B
had not written yet with it); TensorBoard drops the events past the checkpoint itself, with ``purge_step``.
W&B gets the rounds as steps and the post-training phases and the final evaluation as the run's summary.

Sweeps, ``compare`` and ``reproduce`` group their runs (:func:`start_group`): an MLflow parent run named after
the sweep folder with the runs nested under it, and a W&B group of that name (``<out>/tracker-group.json``).

A tracker never stops or loses a run: whatever fails in one (a server out of reach, a store that cannot be
written) prints one line, that tracker is dropped, and the run goes on writing its own files. A tracker named
but not installed is refused before anything runs (:func:`fedlt.config.validate`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

from ..config import TRACKERS
from ..jsonutil import jsonable

STATE = "trackers.json"  # in a run directory: {tracker: {"id": its run id, "records": records it holds}}
GROUP = "tracker-group.json"  # in a sweep folder: {"name": the group, "mlflow": the parent run's id}
COUNTED = ("clients", "missing")  # lists of client ids: their length is the number
SIDES = {"global": "GM", "personal": "PM"}  # an evaluation's two sides, as the tables name them
START_FILES = ("config.json", "partition.json")
END_FILES = ("summary.json", "metrics.jsonl")


def active(names: tuple[str, ...] | list[str]) -> list[str]:
    """The trackers a run uses: those named (``none``: none), or, when none is named, TensorBoard if the
    tensorboard package is installed and ``FEDLT_TENSORBOARD`` is not 0 (what fedlt always did)."""
    names = [n for n in dict.fromkeys(names or ())]
    if "none" in names:
        return []
    if names:
        return names
    if os.environ.get("FEDLT_TENSORBOARD", "1") == "0":
        return []
    import importlib.util

    return ["tensorboard"] if importlib.util.find_spec("tensorboard") is not None else []


def metrics_of(rec: dict) -> dict[str, float]:
    """Every number of one metrics.jsonl record, by a flat name (lists: only the client lists, counted).
    A round's numbers keep their names (``eval/GM/global/acc``), a phase's go under ``phase/<name>/``, the
    final evaluation under ``final/``."""
    out: dict[str, float] = {}
    if "phase" in rec:
        _flat({k: v for k, v in rec.items() if k != "phase"}, f"phase/{rec['phase']}/", out)
    else:
        _flat(rec, "", out)
    return {re.sub(r"[^\w\-./ ]", "_", k): v for k, v in out.items()}


def _flat(d: dict, prefix: str, out: dict, sides: bool = False) -> None:
    for k, v in d.items():
        key = prefix + (SIDES.get(k, k) if sides else str(k))
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, (int, float)):
            out[key] = float(v)
        elif isinstance(v, dict):
            _flat(v, key + "/", out, sides=k in ("eval", "final"))
        elif isinstance(v, (list, tuple)) and k in COUNTED:
            out[key] = float(len(v))
        elif hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # a numpy or torch scalar
            out[key] = float(v.item())


def params_of(config: dict, prefix: str = "") -> dict[str, str]:
    """A run's settings as flat text parameters (``method_params.mu``; lists as JSON)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(params_of(v, f"{prefix}{k}."))
        else:
            out[re.sub(r"[^\w\-./ ]", "_", f"{prefix}{k}")] = (json.dumps(v, default=jsonable) if isinstance(v, (list, tuple))
                                                               else str(v))[:6000]
    return out


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def say(line: str) -> None:
    """A tracker's one line: on stderr, so that it shows whatever the run's own output does (a sweep's runs
    print nothing)."""
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet():
    """The trackers' libraries talk (deprecations, 'creating tables', progress): not on the run's output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------------------------------------ trackers
class Tracker:
    """One tracker. ``open`` starts (``run_id`` None) or continues its run and returns the id to keep;
    ``logged`` says how many records a continued run already holds (None: what trackers.json says)."""

    name = ""

    def open(self, run: "RunInfo", run_id: str | None) -> str | None:
        raise NotImplementedError

    def logged(self, history: list[dict]) -> int | None:
        return None

    def params(self, config: dict) -> None:
        pass

    def step(self, step: int, metrics: dict[str, float], index: int) -> None:
        raise NotImplementedError

    def artifacts(self, paths: list[Path], where: str = "") -> None:
        pass

    def close(self, status: str) -> None:
        pass


class RunInfo:
    """What a tracker needs to know of the run: its directory and name, the folder of its store (``--out``),
    the group it belongs to (a sweep's), and how far a resumed run had got."""

    def __init__(self, run_dir: Path, name: str, out: Path, group: dict | None, last_round: int):
        self.dir, self.name, self.out, self.group, self.last_round = run_dir, name, out, group or {}, last_round


def mlflow_uri(out: Path) -> str:
    """MLflow's store: ``MLFLOW_TRACKING_URI`` if set, else a SQLite file in the output folder."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(Path(out) / 'mlflow.db').resolve()}"


def mlflow_client(out: Path):
    """A client of the run's store, and the id of the experiment (``MLFLOW_EXPERIMENT_NAME``, else fedlt) that
    fedlt's runs go to; a local store keeps the artifacts beside it (``<out>/mlartifacts``)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")  # a server out of reach: one line soon, not
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")  # minutes of retries
    with _quiet():
        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # after the import, which sets mlflow's own level
            logging.getLogger(name).setLevel(logging.ERROR)
        uri = mlflow_uri(out)
        if uri.startswith("sqlite:///"):
            _writable_sqlite(Path(uri[len("sqlite:///"):]))
        client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "fedlt")
        exp = client.get_experiment_by_name(name)
        if exp is None:
            local = None if "MLFLOW_TRACKING_URI" in os.environ else (Path(out) / "mlartifacts").resolve().as_uri()
            try:
                return client, client.create_experiment(name, artifact_location=local)
            except Exception:  # noqa: BLE001 -- another process of a sweep made it meanwhile
                exp = client.get_experiment_by_name(name)
                if exp is None:
                    raise
        return client, exp.experiment_id


def _writable_sqlite(path: Path) -> None:
    """Fail at once on a SQLite store that cannot be opened or written (MLflow retries for 100 seconds)."""
    import sqlite3

    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as db:
        db.execute("BEGIN IMMEDIATE")  # takes the write lock: refused on a read-only file or folder
        db.rollback()


class MLflow(Tracker):
    name = "mlflow"
    records_tag = "fedlt.records"

    def open(self, run: RunInfo, run_id: str | None) -> str:
        self.client, exp = mlflow_client(run.out)
        with _quiet():
            if run_id is not None:
                self.id = run_id
                self.client.update_run(run_id, "RUNNING")
            else:
                tags = {"mlflow.parentRunId": run.group["mlflow"]} if run.group.get("mlflow") else {}
                self.id = self.client.create_run(exp, run_name=run.name, tags=tags).info.run_id
        return self.id

    def logged(self, history: list[dict]) -> int:
        return int(self.client.get_run(self.id).data.tags.get(self.records_tag, 0))

    def params(self, config: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params_of(config).items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per call
            self.client.log_batch(self.id, params=items[i:i + 100])

    def step(self, step: int, metrics: dict[str, float], index: int) -> None:
        import time

        from mlflow.entities import Metric, RunTag

        ms = int(time.time() * 1000)
        items = [Metric(k, v, ms, step) for k, v in metrics.items()]
        chunks = [items[i:i + 900] for i in range(0, len(items), 900)] or [[]]
        for i, chunk in enumerate(chunks):  # the count goes with the last chunk: a step is counted once logged
            last = i == len(chunks) - 1
            self.client.log_batch(self.id, metrics=chunk, tags=[RunTag(self.records_tag, str(index))] if last else [])

    def artifacts(self, paths: list[Path], where: str = "") -> None:
        for p in paths:
            if p.is_dir():
                self.client.log_artifacts(self.id, str(p), where or p.name)
            elif p.is_file():
                self.client.log_artifact(self.id, str(p), where or None)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.id, status)


def wandb_mode() -> str:
    """``WANDB_MODE`` if set; else online when an API key is at hand (``WANDB_API_KEY``, or ``wandb login``'s
    entry in ~/.netrc), offline otherwise (``wandb sync`` uploads later)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return "online" if netrc.netrc().authenticators(host) else "offline"
    except (OSError, netrc.NetrcParseError):
        return "offline"


class WandB(Tracker):
    name = "wandb"

    def open(self, run: RunInfo, run_id: str | None) -> str:
        with _quiet():
            import wandb

            self.run_dir = run.dir
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "fedlt"), name=run.name, id=run_id,
                group=run.group.get("name"), dir=str(run.dir), mode=wandb_mode(), reinit="create_new",
                resume="allow" if run_id else None,
                settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        return self.run.id

    def logged(self, history: list[dict]) -> int | None:
        """Offline: the rounds the run's .wandb files hold -- a process killed with -9 takes the rows W&B had
        not written yet with it, so the records to log again are read from the files, not trusted to
        trackers.json. Online: None (trackers.json's count)."""
        if self.run.settings.mode != "offline":
            return None
        steps = wandb_steps(self.run_dir, self.run.id)
        held = 0
        for rec in history:
            if rec["round"] not in steps:
                break
            held += 1
        return held

    def params(self, config: dict) -> None:
        self.run.config.update(json.loads(json.dumps(config, default=jsonable)), allow_val_change=True)

    def step(self, step: int, metrics: dict[str, float], index: int) -> None:
        if any(k.startswith(("final/", "phase/")) for k in metrics):  # after the last round: the run's summary
            self.run.summary.update(metrics)
        else:
            self.run.log(metrics, step=step, commit=True)

    def artifacts(self, paths: list[Path], where: str = "") -> None:
        for p in paths:
            for f in (sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p] if p.is_file() else []):
                self.run.save(str(f), base_path=str(p.parent), policy="now")

    def close(self, status: str) -> None:
        with _quiet():
            self.run.finish(exit_code=0 if status == "FINISHED" else 1)


def wandb_steps(run_dir: Path, run_id: str) -> set[int]:
    """The history steps that the offline .wandb files of run ``run_id`` in ``run_dir`` hold."""
    return {r.history.step.num for path in sorted(Path(run_dir).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
            for r in wandb_records(path) if r.WhichOneof("record_type") == "history"}


def wandb_records(path: Path) -> list:
    """The records of a .wandb file (what ``wandb sync`` uploads), read with wandb's protobuf classes. The file
    is a LevelDB-style log: a 7-byte header (':W&B', magic, version), then 32 KiB blocks of chunks, each with a
    7-byte header (CRC, length, type: 1 full, 2 first, 3 middle, 4 last); a file cut short ends early."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        return []
    out, pos, buf, block = [], 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            try:
                rec.ParseFromString(buf)
            except Exception:  # noqa: BLE001 -- a torn last record
                break
            out.append(rec)
    return out


class TensorBoard(Tracker):
    name = "tensorboard"

    def open(self, run: RunInfo, run_id: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events a killed run logged after its checkpoint are dropped when read
        self.tb = SummaryWriter(str(run.dir / "tensorboard"),
                                purge_step=run.last_round + 1 if run.last_round else None)
        return None

    def params(self, config: dict) -> None:
        self.tb.add_text("settings", "\n".join(f"    {k} = {v}" for k, v in params_of(config).items()))

    def step(self, step: int, metrics: dict[str, float], index: int) -> None:
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)

    def close(self, status: str) -> None:
        self.tb.close()


KINDS: dict[str, Callable[[], Tracker]] = {"mlflow": MLflow, "wandb": WandB, "tensorboard": TensorBoard}
assert set(KINDS) == set(TRACKERS), "every tracker declared in fedlt.config.TRACKERS has a class here"


# ------------------------------------------------------------------------------------------------ one run
class Trackers:
    """The run's trackers, fed one record at a time (``index``: the record's 1-based position in
    metrics.jsonl). A tracker that fails is dropped with one line; the others and the run go on."""

    def __init__(self, run_dir: Path, trackers: list[Tracker], done: dict[str, int], ids: dict[str, str | None],
                 index: int, last_round: int):
        self.dir, self.live, self.done, self.ids = run_dir, trackers, done, ids
        self.index, self.last_round = index, last_round

    @classmethod
    def start(cls, names: list[str], run_dir: Path, run_name: str, out: Path, config: dict, history: list[dict],
              resumed: bool) -> "Trackers":
        """Open the run's trackers (a resumed run: the same tracked runs as before), log the settings and the
        partition of a new one. ``history``: the records metrics.jsonl starts from (a resumed run's)."""
        state = _read(run_dir / STATE) if resumed else {}
        group = _read(Path(out) / GROUP)
        last_round = history[-1]["round"] if history else 0
        info = RunInfo(run_dir, run_name, Path(out), group, last_round)
        self = cls(run_dir, [], {}, {}, len(history), last_round)
        for name in names:
            t = KINDS[name]()
            before = state.get(name, {})
            continued = before.get("id") if name != "tensorboard" else None
            ok, rid = self._guard(t, "start", lambda: t.open(info, continued))
            if not ok:
                continue
            self.ids[name] = rid
            if name == "tensorboard" and resumed:
                held = len(history)  # purge_step drops what came after
            elif continued:
                ok, held = self._guard(t, "start", lambda: t.logged(history))
                if not ok:
                    continue
                held = int(before.get("records", 0)) if held is None else held
            else:
                held = 0
                if not (self._guard(t, "settings", lambda: t.params(config))[0] and
                        self._guard(t, "files", lambda: t.artifacts([run_dir / f for f in START_FILES]))[0]):
                    continue
            self.done[name] = held
            self.live.append(t)
        for i, rec in enumerate(history, 1):  # what a tracker lacks of the records the run continues from
            self._feed(rec, i)
        self._save()
        return self

    def _guard(self, t: Tracker, what: str, fn) -> tuple[bool, Any]:
        """(True, ``fn()``), or (False, None) after dropping ``t`` with one line if it raised."""
        try:
            with _quiet():
                return True, fn()
        except Exception as e:  # noqa: BLE001 -- whatever a tracker's library raises, the run goes on
            if t in self.live:
                self.live.remove(t)
            say(f"tracker {t.name} failed ({what}: {_reason(e)}); the run goes on without it "
                f"(its run directory {self.dir} has every record)")
            return False, None

    def __call__(self, rec: dict) -> None:
        self.index += 1
        self._feed(rec, self.index)
        self._save()

    def _feed(self, rec: dict, index: int) -> None:
        """Log record number ``index`` to every tracker that does not hold it yet."""
        if "round" in rec:
            self.last_round = rec["round"]
        metrics = None
        for t in list(self.live):
            if index > self.done.get(t.name, 0):
                metrics = metrics_of(rec) if metrics is None else metrics
                if self._guard(t, f"round {self.last_round}", lambda: t.step(self.last_round, metrics, index))[0]:
                    self.done[t.name] = index

    def finish(self, status: str = "FINISHED", files: tuple[str, ...] = END_FILES) -> None:
        """Log the end files and close every tracker (``status``: FINISHED, FAILED or KILLED)."""
        for t in list(self.live):
            if files:
                self._guard(t, "files", lambda: t.artifacts([self.dir / f for f in files]))
            self._guard(t, "close", lambda: t.close(status))
        self.live = []

    def _save(self) -> None:
        if not self.ids:
            return
        doc = {n: {"id": i, "records": self.done.get(n, 0)} for n, i in self.ids.items() if i is not None}
        if doc:
            _write(self.dir / STATE, doc)


def _read(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ groups
def start_group(out: str | Path, names: list[str]) -> None:
    """A sweep's group: ``<out>/tracker-group.json`` names it after the sweep folder, and holds the MLflow
    parent run (made once; a restarted sweep continues it) that the runs nest under."""
    out = Path(out)
    doc = _read(out / GROUP)
    doc["name"] = doc.get("name") or out.resolve().name
    if "mlflow" in names and not doc.get("mlflow"):
        try:
            with _quiet():
                client, exp = mlflow_client(out)
                doc["mlflow"] = client.create_run(exp, run_name=doc["name"], tags={"fedlt.sweep": str(out)}).info.run_id
        except Exception as e:  # noqa: BLE001
            say(f"tracker mlflow failed (sweep group: {_reason(e)}); its runs are tracked ungrouped")
    out.mkdir(parents=True, exist_ok=True)
    _write(out / GROUP, doc)


def end_group(out: str | Path, report: Path | None, status: str = "FINISHED",
              metrics: Callable[[], dict[str, float]] | None = None) -> None:
    """Close a sweep's MLflow parent run, with the sweep's report (tables, figures) as its artifacts and what
    ``metrics()`` returns (fedlt.experiments.report.group_metrics: the comparison's final GM / PM per method,
    read only where there is a parent run) on its charts."""
    doc = _read(Path(out) / GROUP)
    if not doc.get("mlflow"):
        return
    try:
        with _quiet():
            client, _ = mlflow_client(Path(out))
            for key, value in (metrics() if metrics else {}).items():  # the chart view of the parent run
                client.log_metric(doc["mlflow"], key, value)
            if report is not None and Path(report).is_dir():
                client.log_artifacts(doc["mlflow"], str(report), "report")
            client.set_terminated(doc["mlflow"], status)
    except Exception as e:  # noqa: BLE001
        say(f"tracker mlflow failed (sweep report: {_reason(e)}); the report is in {report}")
