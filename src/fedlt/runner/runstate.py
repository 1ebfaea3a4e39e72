"""What a run directory holds besides its config: metrics as JSON lines (also sent to the run's experiment
trackers, :mod:`fedlt.runner.trackers`), checkpoints, the final state with the head-like tensors that the
report plots, and the lock that keeps two processes out of one run directory.

Checkpoints and final states are safetensors files (:mod:`fedlt.safefile`): loading one runs no code, whoever
made it. A checkpoint holds :meth:`fedlt.engine.driver.Driver.state_dict` (round, server state, the client
states the engine's transport can see, the method instance's state, history, missing clients, RNG states,
CUDA's too when CUDA was in use), the resolved config (a resume with
other settings is refused) and the wall time so far. The newest two are kept: ``checkpoint.safetensors`` and
``checkpoint.prev.safetensors``. A new one is written completely (beside them, flushed to disk) before the
older ones are renamed, so a process killed at any moment, or a newest file found truncated, still leaves a
checkpoint to resume from. On resume, ``metrics.jsonl`` is rewritten from the checkpoint's history, so a round
logged after the last checkpoint is not written twice.

Run directories of fedlt 0.1 hold ``checkpoint.pt`` / ``final_state.pt`` (pickles); they are never unpickled:
resuming from one is a one-line error that says how to re-create the run, and the report draws no head-norm
figure for it.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import SETTINGS
from ..decl import read_old
from ..errors import ConfigError
from ..jsonutil import jsonable
from ..registry import METHODS
from ..safefile import load_tree, save_tree

CHECKPOINT = "checkpoint.safetensors"
PREVIOUS = "checkpoint.prev.safetensors"
NEXT = "checkpoint.next.safetensors"  # a complete checkpoint not yet renamed into place
FINAL_STATE = "final_state.safetensors"
LEGACY = ("checkpoint.pt", "final_state.pt")  # fedlt 0.1: pickles, never loaded


class OtherSettings(ConfigError):
    """A checkpoint written with other settings than the run that would resume from it: its line says what
    ``fedlt run`` can do about it; a sweep, whose runs take no --resume or --name, says its own (``differences``)."""

    def __init__(self, path: Path, run_dir: Path, differences: list[str]):
        self.differences = differences
        super().__init__(f"checkpoint {path} was written with other settings ({'; '.join(differences[:3])}); resume "
                         f"with the settings it was written with, or leave --resume out and give another --name to "
                         f"start a new run (or delete {run_dir})")
METRICS = "metrics.jsonl"
# what may differ between a run and its resumption (where and how it runs, not what it computes): the run
# settings declared with result=False (fedlt.config.RunConfig), and the engine's own records
NOT_COMPARED = frozenset({name for name, s in SETTINGS.items() if not s.decl.result} |
                         {"labels", "engine", "flower", "data_source"})


def config_differences(saved: dict, current: dict) -> list[str]:
    """``key: saved -> current`` for every setting of ``current`` (less NOT_COMPARED) that differs. A run
    setting or a method parameter that ``saved`` lacks (a run directory made before it existed) had its default;
    a method parameter saved as an earlier version's sentinel for None (``old_none``) reads as None."""
    keys = set(current) - NOT_COMPARED
    old = {k: SETTINGS[k].default for k in keys if k not in saved and k in SETTINGS}
    saved = {**old, **saved}
    if isinstance(saved.get("method_params"), dict) and current.get("method") in METHODS:  # -1.0 then, None now
        params, now = METHODS.get(current["method"]).Params, current.get("method_params") or {}
        added = {k: v for k, v in vars(params()).items() if k in now and k not in saved["method_params"]}
        saved["method_params"] = {**read_old(params, saved["method_params"]), **added}
    return [f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in sorted(keys)
            if _plain(saved.get(k)) != _plain(current.get(k))]


def _plain(v):
    return json.loads(json.dumps(v, default=str))  # tuples vs lists, numpy scalars: compare as JSON


# ------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(run_dir: Path, sim_state: dict, config: dict, elapsed: float) -> None:
    """Write the new checkpoint in full, then rotate: newest -> previous, new -> newest. The caller
    (:func:`fedlt.runner.rundir.run_recorded`) writes it under :func:`fedlt.runner.preempt.deferred`, so a
    scheduler's signal arriving meanwhile takes effect once the checkpoint is in place."""
    run_dir = Path(run_dir)
    save_tree(run_dir / NEXT, {"sim": sim_state, "config": config, "elapsed": elapsed}, "checkpoint")
    if (run_dir / CHECKPOINT).exists():
        os.replace(run_dir / CHECKPOINT, run_dir / PREVIOUS)
    os.replace(run_dir / NEXT, run_dir / CHECKPOINT)


def has_checkpoint(run_dir: Path) -> bool:
    return any((Path(run_dir) / n).is_file() for n in (NEXT, CHECKPOINT, PREVIOUS))


def checkpointed_round(run_dir: Path) -> int | None:
    """The round of the newest readable checkpoint in ``run_dir`` (None: none), read from the files' headers
    only (a checkpoint may be large)."""
    from safetensors import safe_open

    for n in (NEXT, CHECKPOINT, PREVIOUS):
        path = Path(run_dir) / n
        if path.is_file():
            try:
                with safe_open(str(path), "pt") as f:
                    return int(json.loads(f.metadata()["tree"])["sim"]["round"])
            except Exception:  # noqa: BLE001 -- any unreadable file: the next one
                continue
    return None


def check_resumable(run_dir: Path) -> None:
    """``--resume`` needs a run to resume: a one-line ConfigError for a run directory that does not exist (a
    mistyped ``--name`` would silently start a new run) or whose run has finished. A directory without a
    checkpoint (stopped before its first) is resumable: the run starts again from round 0."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"--resume: there is no run {run_dir} to resume (check --name and --out); leave --resume "
                          f"out to start it")
    if (run_dir / "summary.json").is_file():
        raise ConfigError(f"--resume: run {run_dir} has finished (its summary.json is there); nothing to resume: "
                          f"delete it to run it again, or choose another --name")


def remove_checkpoints(run_dir: Path) -> None:
    for n in (NEXT, CHECKPOINT, PREVIOUS):
        (Path(run_dir) / n).unlink(missing_ok=True)


def load_checkpoint(run_dir: Path, config: dict, notes: list[str] | None = None) -> dict | None:
    """The newest readable checkpoint in ``run_dir`` (None if there is none). A newest file that cannot be
    read (truncated, overwritten) falls back to the previous one, with a note; one written with other
    settings, or a fedlt 0.1 pickle, is a one-line ConfigError."""
    run_dir = Path(run_dir)
    notes = [] if notes is None else notes
    found = [run_dir / n for n in (NEXT, CHECKPOINT, PREVIOUS) if (run_dir / n).is_file()]
    if not found:
        legacy = run_dir / LEGACY[0]
        if legacy.is_file():
            raise ConfigError(f"{legacy} was written by fedlt 0.1 as a pickle, which fedlt no longer loads "
                              f"(unpickling can run code); delete it to restart this run from round 0, or "
                              f"delete {run_dir} to re-create the run")
        return None
    hint = f"delete {run_dir} to restart that run"
    ck, errors = None, []
    for path in found:
        try:
            ck = load_tree(path, "checkpoint", hint, notes)
            lacks = sections_missing(ck)
            if lacks:
                ck = None
                raise ConfigError(f"checkpoint {path} lacks {', '.join(lacks)} (written by another program?)")
            break
        except ConfigError as e:
            errors.append(str(e))
    if ck is None:
        first = errors[0].replace(f"; {hint}", "")
        raise ConfigError(f"{first}; {hint}" if len(errors) == 1 else
                          f"no checkpoint in {run_dir} can be read ({first}); {hint}")
    if errors:
        notes.append(f"{errors[0]}; resuming from {path.name} (round {ck['sim']['round']}) instead")
    diff = config_differences(ck.get("config", {}), config)
    if diff:
        raise OtherSettings(path, run_dir, diff)
    _fit_cuda_rng(ck["sim"]["rng"], notes)
    return ck


SECTIONS = {"": ("sim", "elapsed"), "sim": ("round", "state", "client_states", "history", "rng")}


def sections_missing(ck) -> list[str]:
    """The sections a resume reads (Driver.load_state_dict, the run's elapsed time) that the checkpoint lacks."""
    if not isinstance(ck, dict):
        return ["everything (it holds no table)"]
    lacks = [k for k in SECTIONS[""] if k not in ck]
    sim = ck.get("sim")
    if isinstance(sim, dict):
        lacks += [f"sim.{k}" for k in SECTIONS["sim"] if k not in sim]
        if "round" in sim and (isinstance(sim["round"], bool) or not isinstance(sim["round"], int)):
            lacks.append("sim.round as a round number")
    elif "sim" in ck:
        lacks.append("sim as a table")
    return lacks


def _fit_cuda_rng(rng: dict, notes: list[str]) -> None:
    """A checkpoint of a GPU run read where there is no CUDA (or fewer GPUs): use what exists, say so."""
    if "cuda" not in rng:
        return
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        del rng["cuda"]
        notes.append("the checkpoint holds CUDA random states; CUDA is not available here, so they are ignored "
                     "(the run continues on this device's random streams)")
    elif len(rng["cuda"]) > have:
        notes.append(f"the checkpoint holds random states of {len(rng['cuda'])} GPUs; {have} are visible, "
                     f"the first {have} are restored")
        rng["cuda"] = rng["cuda"][:have]


# ------------------------------------------------------------------------------------------- final state
def save_final_state(run_dir: Path, state: dict, heads: dict | None = None) -> None:
    """``final_state.safetensors``: the final server state and the classifier-like tensors the report plots,
    on the CPU whatever device trained them."""
    save_tree(Path(run_dir) / FINAL_STATE, {"state": state, "heads": heads or {}}, "final-state")


def load_final_state(run_dir: Path) -> dict:
    """The final state of a run ({} if it has none); a one-line ConfigError for an unreadable file or a
    fedlt 0.1 ``final_state.pt``."""
    run_dir = Path(run_dir)
    path = run_dir / FINAL_STATE
    if not path.is_file():
        if (run_dir / LEGACY[1]).is_file():
            raise ConfigError(f"{run_dir / LEGACY[1]} was written by fedlt 0.1 as a pickle, which fedlt no longer "
                              f"loads (unpickling can run code); re-run {run_dir.name} to re-create it")
        return {}
    return load_tree(path, "final-state", f"re-run {run_dir.name} to re-create it")


# ------------------------------------------------------------------------------------------- locks
_HELD: dict[str, list] = {}  # run directories this process holds: path -> [fd, depth]


def lock_path(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    return run_dir.parent / f".{run_dir.name}.lock"


@contextlib.contextmanager
def run_lock(run_dir: Path, wait: bool = False) -> Iterator[bool]:
    """Hold the run directory's lock (``.<name>.lock`` beside it; an advisory ``flock`` that the kernel drops
    when its process ends, however it ends). Yields False without waiting when another process holds it,
    unless ``wait``. Re-entrant within a process."""
    import fcntl

    key = str(Path(run_dir).resolve())
    if key in _HELD:
        _HELD[key][1] += 1
        try:
            yield True
        finally:
            _HELD[key][1] -= 1
        return
    path = lock_path(run_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"cannot write to {path.parent}: {e.strerror or e}; choose another --out") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        _HELD[key] = [fd, 1]
        try:
            yield True
        finally:
            del _HELD[key]
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def owned_run_dir(run_dir: Path) -> Iterator[None]:
    """Hold a run directory's lock for a run of any engine, or stop with the one-line error that another
    process is running it."""
    with run_lock(run_dir) as mine:
        if not mine:
            raise ConfigError(f"run directory {run_dir} is in use by another fedlt process (pid "
                              f"{lock_holder(run_dir)}); wait for it to finish or choose another --name")
        yield


def lock_holder(run_dir: Path) -> str:
    """The process id written in a run's lock file ('?' if unknown)."""
    try:
        return lock_path(run_dir).read_text().strip() or "?"
    except OSError:
        return "?"


class MetricsLog:
    """Per-round records as JSON lines, each also handed to the run's experiment trackers
    (:class:`fedlt.runner.trackers.Trackers`: MLflow, W&B, TensorBoard). ``history``: the records a resumed run
    continues from; the file is rewritten to hold exactly those before new ones are appended."""

    def __init__(self, run_dir: Path, history: list[dict] | None = None, trackers=None):
        self._default = jsonable
        path = Path(run_dir) / METRICS
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, default=jsonable) + "\n" for r in history or []))
        os.replace(tmp, path)
        self.file = open(path, "a", buffering=1)
        self.trackers = trackers

    def __call__(self, rec: dict) -> None:
        self.file.write(json.dumps(rec, default=self._default) + "\n")
        if self.trackers is not None:
            self.trackers(rec)

    def close(self) -> None:
        self.file.close()


def head_like(tree: Any, num_classes: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every 2-D floating tensor in a nested dict/list whose first dimension is ``num_classes`` (class vectors
    as rows: a classifier weight), keyed by its path ``a/b/key``; copied to the CPU."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        if tree.dim() == 2 and tree.is_floating_point() and tree.shape[0] == num_classes:
            out[prefix] = tree.detach().to("cpu", copy=True)
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(head_like(v, num_classes, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(head_like(v, num_classes, f"{prefix}/{i}" if prefix else str(i)))
    return out
