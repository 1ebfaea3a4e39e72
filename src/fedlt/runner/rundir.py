"""One run and its directory: from a RunConfig to a finished run. Build data, model spec and method
(:func:`prepare`), drive the engine, and write the run directory -- the same for every engine
(:func:`run_recorded`: resolved config, partition counts, metrics as JSON lines and the experiment trackers
fed from them, what left the clients (``sent.jsonl``), checkpoints and resume, summary, final weights). Beside it: :mod:`fedlt.runner.runstate` (the files), :mod:`fedlt.runner.divergence` (the check that
stops a diverged run), :mod:`fedlt.runner.preempt` (a scheduler's signal). Many runs are :mod:`fedlt.experiments`.

Everything that can fail on bad input (names, settings, missing or corrupt data) fails in :func:`prepare`,
before the run directory exists, so nothing is half-written.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import RunConfig, name_part
from ..core.dpsgd import unamplified_words
from ..core.finetune import GapMeter, adapter_rows, feature_federation
from ..core.method import Method, RunSpec
from ..core.privacy import SentLog
from ..core.state import tree_of
from ..data import Federation
from ..data.split import partition_document
from ..engine import EngineConfig, Simulation
from ..engine.driver import TRAINING
from ..engine.faults import check_settings
from ..engine.federation import federation_for, lt_profile_of, make_spec  # noqa: F401 (their names here too)
from ..errors import ConfigError, Diverged
from ..jsonutil import dumps
from ..metrics import GROUPS
from ..plugins import method_class


CLIENT_STATES = "client-states"  # the run directory's client-state store (fedlt.engine.clientstate)
PLOTTED_CLIENTS = 20  # clients whose heads final_state.safetensors keeps for the report


@dataclass
class Prepared:
    cfg: RunConfig
    fed: Federation
    method: Method
    spec: RunSpec


def input_note(spec: RunSpec, in_shape) -> str:
    """The line a run prints about a pre-trained model's input (how the dataset's images are made its own); ""
    for other models."""
    from ..pretrained import is_pretrained, load_for

    return load_for(spec).describe(in_shape) if is_pretrained(spec.model) else ""


def set_determinism(on: bool) -> None:
    """``--deterministic``: deterministic algorithms (PyTorch warns once for any op that has none) and cuDNN
    settings, and the cuBLAS workspace setting they need (it must be in place before CUDA starts)."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=True)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False


def prepare(cfg: RunConfig, fed: Federation | None = None) -> Prepared:
    check_settings(cfg)  # the settings that need the engine's time model, before anything is loaded or written
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    set_determinism(cfg.deterministic)
    fed = fed or federation_for(cfg)
    spec = make_spec(cfg, fed)
    if cfg.finetune == "head":  # the samples as the frozen backbone's features, each client's encoded once
        fed = feature_federation(fed, spec)
    cls = method_class(cfg)
    method = cls(spec, cls.make_params(cfg.params, cfg.allow_large))
    if cfg.dp == "sample":  # DP-SGD cannot bound a sample's influence through BatchNorm: one line (core.dpsgd)
        from ..config import clients_per_round
        from ..core.dpsgd import check_before_run, check_model
        from ..engine.driver import sampling_schedule

        check_model(method.new_model(), spec.model)
        check_before_run(cfg, cls, [len(c) for c in fed.clients], sampling_schedule(
            cfg.clients, clients_per_round(cfg.clients, cfg.participation), cfg.rounds, cfg.seed),
            method.dp_round_epochs())
        if why := cls.dp_sample_refusal(method.p):  # as the command line's validation (a RunConfig built in Python)
            raise ConfigError(f"--dp sample: {why}")
    if getattr(method, "needs_pool", False):  # the centralized reference trains on all clients' data pooled
        method.pool = fed.pooled()
    return Prepared(cfg, fed, method, spec)


def run_dir_for(cfg: RunConfig) -> Path:
    name = cfg.name or (f"{cfg.method}-{name_part(cfg.dataset)}-rho{cfg.imbalance_ratio:g}-"
                        f"{name_part(cfg.partition)}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}")
    return Path(cfg.out) / name


def mean_last(history: list[dict], n: int = 3) -> dict[str, float | None]:
    """Mean of the last n evaluations (docs/protocol.md: report the mean of the last 3 evaluated rounds), for
    every global and personal inference mode."""
    evals = [h["eval"] for h in history if "eval" in h][-n:]
    out: dict[str, float | None] = {}
    if not evals:
        return out
    for side, prefix in (("global", "GM"), ("personal", "PM")):
        for mode in evals[-1][side]:
            for key in ("acc",) + GROUPS:
                vals = [e[side][mode][key] for e in evals if mode in e[side] and e[side][mode][key] is not None]
                out[f"{prefix}[{mode}].{key}"] = float(np.mean(vals)) if vals else None
    return out


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(dumps(obj))
    os.replace(tmp, path)


def write_partition(out: Path, fed: Federation, test_sizes: list[int]) -> None:
    """partition.json: the long-tailed class counts, the client-by-class matrix and the clients' test sizes,
    and (where the clients' data is known here) every client's training indices, which make the file a
    partition file (``--partition-file``, :mod:`fedlt.data.split`) that re-creates the run's clients."""
    doc = {"train_counts": fed.train_counts, "client_class_counts": fed.counts, "client_test_sizes": test_sizes}
    if fed.clients:
        doc.update(partition_document(fed.dataset.name, len(fed.dataset.y_train), fed.train_indices()))
    write_json(out / "partition.json", doc)


def run_summary(out: Path, method: str, wall_time: float, history: list[dict], final: dict | None,
                **extra) -> dict:
    """summary.json's content, the same for both engines: status (``finished`` or ``diverged``), final and
    last-3 metrics, traffic, wall time."""
    traffic = {k: float(np.mean([h[f"bytes_{k}_per_client"] for h in history])) if history else 0.0
               for k in ("up", "down")}
    rounds = [h for h in history if "arrived" in h]
    clients = {k: float(np.mean([h[k] for h in rounds])) for k in ("sampled", "trained", "arrived")} if rounds else {}
    sim = [h["sim_time"] for h in history if "sim_time" in h]
    timed = {"sim_time": float(np.sum(sim))} if sim else {}
    return {"run_dir": str(out), "method": method, "status": "finished", "wall_time": wall_time,
            "last3": mean_last(history), "final": final, "bytes_per_round_per_client": traffic,
            **({"clients_per_round": clients} if clients else {}), **timed, **extra}


def diverged_summary(out: Path, method: str, wall_time: float, history: list[dict], err, **extra) -> dict:
    """summary.json of a run stopped by divergence: no result numbers (``final`` None, ``last3`` empty), the
    round and the reason, and the last evaluation made while everything was finite."""
    last = next(({"round": h["round"], **h["eval"]} for h in reversed(history) if "eval" in h), None)
    return {**run_summary(out, method, wall_time, history, None, **extra), "status": "diverged", "last3": {},
            "diverged": {"round": err.round, "reason": err.reason, "train_loss": _finite(err.record.get("train_loss"))},
            "last_finite_eval": last}


def diverged_error(out: Path, method: str, wall_time: float, history: list[dict], err, advice: str, kept: str = "",
                   **extra):
    """Both engines' end of a diverged run: writes summary.json (:func:`diverged_summary`) and returns the
    one-line :class:`~fedlt.errors.Diverged` to raise, with what to try and where the summary is."""
    write_json(out / "summary.json", diverged_summary(out, method, wall_time, history, err, **extra))
    new = Diverged(f"{err} -- {advice}; {out / 'summary.json'} says diverged{kept}")
    new.round, new.reason = err.round, err.reason
    return new


def _finite(x):
    """``x``, or None for NaN and infinities (which strict JSON readers refuse; the reason names them)."""
    return x if x is None or np.isfinite(x) else None


def run(cfg: RunConfig, progress: bool = True, echo=print, prepared: Prepared | None = None, *,
        checkpoint_every: int = 0, resume: bool = False, labels: dict | None = None) -> dict:
    """Run one experiment end to end and return its summary.

    ``checkpoint_every`` N > 0 writes a checkpoint in the run directory every N rounds and after the last
    (see :mod:`fedlt.runner.runstate`); with ``resume`` a run whose directory holds one continues from it
    (the settings must be the same) and ends with the metrics it would have reached uninterrupted. ``labels``
    (method, setting, seed) are stored in config.json for ``fedlt report``. ``summary.json`` is written last:
    its presence marks a finished run (the checkpoints are then deleted). A run directory is used by one
    process at a time (a lock beside it); a second process is refused with a one-line error.

    A run that diverges (:mod:`fedlt.runner.divergence`) with ``cfg.on_diverge == "stop"`` writes a
    summary with ``status: diverged``, keeps its last good checkpoint and raises
    :class:`~fedlt.errors.Diverged` (exit status 3 on the command line)."""
    from .runstate import owned_run_dir

    pr = prepared or prepare(cfg)
    out = run_dir_for(cfg)
    with owned_run_dir(out):
        return _run_locked(cfg, pr, out, progress, echo, checkpoint_every, resume, labels)


def _run_locked(cfg, pr: Prepared, out: Path, progress, echo, checkpoint_every, resume, labels) -> dict:
    fed, method = pr.fed, pr.method
    config = {**cfg.to_dict(), "model": pr.spec.model, "lt_profile_used": lt_profile_of(cfg, fed),
              "method_params": vars(method.p), "engine": "simulation"}
    sim = Simulation(method, fed, EngineConfig.of(cfg, progress))
    try:
        return run_recorded(sim, cfg, out, config, fed, fed.test_sizes(), echo,
                            checkpoint_every=checkpoint_every, resume=resume, labels=labels,
                            intro="\n".join(filter(None, (input_note(pr.spec, fed.dataset.in_shape), fed.summary()))))
    finally:
        sim.close()  # worker processes (--workers) end with the run


def run_recorded(driver, cfg: RunConfig, out: Path, config: dict, fed: Federation, test_sizes: list[int], echo,
                 *, checkpoint_every: int = 0, resume: bool = False, labels: dict | None = None, intro: str = "",
                 **extra) -> dict:
    """Run ``driver`` (:class:`fedlt.engine.driver.Driver`, over any transport) and keep its run directory
    ``out``, the same for every engine: ``config.json`` (``config``, with ``labels``), ``partition.json``,
    ``metrics.jsonl``, ``sent.jsonl`` (what left the clients: :class:`fedlt.core.privacy.SentLog`), a checkpoint
    every ``checkpoint_every`` rounds and after the last, the resumption from one (``resume``), the divergence
    check, ``final_state.safetensors`` and ``summary.json`` (with ``extra``), written last. The caller holds the
    run directory's lock."""
    from .divergence import DivergenceCheck
    from .preempt import Preempted, deferred, run_stopped
    from .runstate import (MetricsLog, head_like, load_checkpoint, remove_checkpoints,
                                       save_checkpoint, save_final_state)
    from .trackers import Trackers, active

    check_settings(cfg)  # as prepare does (a Flower run's first check of them)
    for stale in out.glob("*.tmp"):  # left by a process killed mid-write (we hold the run's lock: none is ours)
        stale.unlink(missing_ok=True)
    if labels:
        config["labels"] = labels
    config["data_source"] = fed.dataset.source  # the folder the samples were read from (printed below)
    notes: list[str] = []
    ck = load_checkpoint(out, config, notes) if resume else None
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "config.json", config)
    except OSError as e:
        raise ConfigError(f"cannot write the run directory {out}: {e.strerror or e}; choose another --out") from None
    write_partition(out, fed, test_sizes)
    keep_states = getattr(driver.transport, "keep_states_in", None)
    if keep_states is not None:  # spills and incremental checkpoints of the client states go here
        keep_states(out / CLIENT_STATES, fresh=ck is None)
    echo(f"data: {fed.dataset.name} from {fed.dataset.source or 'its loader'}")
    if intro:
        echo(intro)
    elapsed = 0.0
    if ck is not None:
        driver.load_state_dict(ck["sim"])
        elapsed = ck["elapsed"]
        echo(f"resuming {out} after round {driver.round} of {cfg.rounds}")
    for note in notes:
        echo(f"note: {note}")
    driver.echo = echo
    # a sweep's run (labels) lives in <sweep>/<setting>/<method>/seed<S>: tracked as setting/method/seed<S> in the
    # sweep's store and group; another run as its name in its --out
    name, root = (f"{labels['setting']}/{labels['method']}/seed{labels['seed']}", out.parents[2]) if labels else \
        (cfg.name or out.name, Path(cfg.out))
    tracked = Trackers.start(active(cfg.tracker), out, name, root, config, driver.history, resumed=ck is not None)
    driver.log = log = MetricsLog(out, driver.history, tracked)
    # sent.jsonl: what left the clients, per exchange and declared item (core.privacy); a resumed run appends
    sent = SentLog(out, driver.method, echo, resumed_after=ck["sim"]["round"] if ck is not None else None)
    driver.on_replies.append(sent)
    if driver.method.spec.finetune == "lora":  # LoRA's aggregation gap, each round (core.finetune)
        gap = GapMeter(driver.method.spec)
        driver.on_replies.append(lambda kind, index, replies: gap.replies(replies) if kind == TRAINING else None)
        driver.on_replies.append(lambda kind, index, replies: sent.write(adapter_rows(index, replies))
                                 if kind == TRAINING else None)  # the adapters' part of what was sent
        driver.after_train.append(gap.record)
    if (record_to := getattr(driver.transport, "record_to", None)) is not None:  # an engine's own items (Flower's)
        record_to(sent)
    C = fed.num_classes
    heads: dict = {}
    saved = {"round": ck["sim"]["round"] if ck is not None else None}
    t0 = time.perf_counter()

    def snapshot_heads(d):  # the server's classifiers at the end of training, before any post-training phase
        if d.round == cfg.rounds:
            heads["server_before_phases"] = head_like(tree_of(d.state), C)

    def checkpoint(d):
        if checkpoint_every > 0 and (d.round % checkpoint_every == 0 or d.round == cfg.rounds):
            with deferred():  # a signal meanwhile stops the run once both are done
                save_checkpoint(out, d.state_dict(), config, elapsed + time.perf_counter() - t0)
                saved["round"] = d.round

    check = DivergenceCheck(cfg.method, cfg.lr, cfg.on_diverge, cfg.diverge_factor, echo)
    driver.after_train.append(check)
    driver.after_round += [snapshot_heads, checkpoint]
    driver.round_end = deferred  # a signal after a round's record waits for its checkpoint
    snapshot_heads(driver)
    extra = {**extra, "missing": driver.missing}  # clients that did not answer, by round (none in process)
    try:
        final = driver.run()
    except Diverged as e:
        log({**e.record, "diverged": e.reason})
        kept = (f"; its last good checkpoint (round {saved['round']}) is kept" if saved["round"] is not None
                else "")
        err = diverged_error(out, cfg.method, elapsed + time.perf_counter() - t0, driver.history, e, check.advice(),
                             kept, **extra)
        tracked.finish("FAILED")
        raise err from None
    except Preempted as e:  # a scheduler's signal: the last completed round's checkpoint is on disk
        tracked.finish("KILLED", files=())
        raise e.stopped(run_stopped(out, cfg.name, len(driver.history) + 1, cfg.rounds, saved["round"]))
    finally:
        log.close()
        sent.close()
    summary = run_summary(out, cfg.method, elapsed + time.perf_counter() - t0, driver.history, final, **extra)
    if ck is not None:
        summary["resumed_after_round"] = ck["sim"]["round"]
    if check.first is not None:
        summary["diverged_continued"] = check.first  # --on-diverge continue: round and reason
    if driver.dp is not None:  # --dp client: the privacy loss and the accountant's inputs
        summary["dp"] = driver.dp.table(driver.round)
    if driver.stopped:
        summary["stopped"] = driver.stopped  # --dp-budget: training ended before its last round
    final_tree = tree_of(driver.state)
    save_final_state(out, final_tree, {"server": head_like(final_tree, C), **heads,
                                       "clients": client_heads(driver.transport, fed, C)})
    write_json(out / "summary.json", summary)
    remove_checkpoints(out)
    shutil.rmtree(out / CLIENT_STATES, ignore_errors=True)  # a finished run keeps no client state (nor checkpoint)
    tracked.finish("FINISHED")
    echo(format_summary(summary))
    return summary


def client_heads(transport, fed: Federation, num_classes: int, n: int = PLOTTED_CLIENTS) -> dict:
    """The classifier-like tensors of the ``n`` largest clients that have a state (the report plots the
    largest one's): read from those clients only, whatever the population."""
    from .runstate import head_like

    states = getattr(transport, "client_states", None) or {}
    sizes = np.asarray(fed.counts).sum(1) if len(fed.counts) else None
    cids = sorted(states, key=lambda c: (-int(sizes[c]) if sizes is not None and c < len(sizes) else 0, c))[:n]
    return {cid: h for cid in sorted(cids) if (h := head_like(states[cid], num_classes))}


def pm_population(ev: dict) -> str:
    """"PM over 500 of 100,000 clients": how many clients PM is the mean over, of how many (an evaluation's
    clients with a test set, of the population)."""
    n = len(next(iter(ev["personal"].values()))["per_client"])
    of = ev.get("eval_clients", {}).get("of", n)
    sampled = ev.get("eval_clients", {}).get("sampled", of)
    how = "" if sampled == of else " (a seeded sample; --eval-clients)" if sampled == n else \
        f" (of a seeded sample of {sampled:,}; --eval-clients)"
    return f"PM over {n:,} of {of:,} clients{how}"


def fmt(v) -> str:
    return "   -  " if v is None else f"{100 * v:6.2f}"


def format_summary(summary: dict) -> str:
    """A small table: every global mode (GM, many/medium/few) and every personal mode (PM)."""
    final = summary["final"]
    lines = [f"== {summary['method']}: final evaluation (after any post-training phase); "
             f"split={final['split']}  run dir: {summary['run_dir']}",
             f"{'model':<28} {'acc':>6} {'many':>6} {'medium':>6} {'few':>6}"]
    for mode, r in final["global"].items():
        lines.append(f"{'GM ' + mode:<28} {fmt(r['acc'])} {fmt(r['many'])} {fmt(r['medium'])} {fmt(r['few'])}")
    for mode, r in final["personal"].items():
        label = f"PM {mode}" + (" (global model)" if r["source"] == "global" else "")
        lines.append(f"{label:<28} {fmt(r['acc'])} {fmt(r['many'])} {fmt(r['medium'])} {fmt(r['few'])}"
                     f"   clients: std {100 * r['std']:.2f}, min {100 * r['min']:.2f}, max {100 * r['max']:.2f}")
    if final["personal"]:
        lines.append(pm_population(final))
    elif final.get("pm_note"):
        lines.append(final["pm_note"])
    last3 = {k: v for k, v in summary["last3"].items() if k.endswith(".acc")}
    if last3:
        lines.append("mean of the last 3 evaluated rounds: " +
                     ", ".join(f"{k[:-4]} {fmt(v).strip()}" for k, v in last3.items()))
    b = summary["bytes_per_round_per_client"]
    lines.append(f"communication per client per round: up {b['up'] / 1e6:.3f} MB, down {b['down'] / 1e6:.3f} MB; "
                 f"wall time {summary['wall_time']:.1f} s")
    if "dp" in summary and summary["dp"].get("level") == "sample":
        d = summary["dp"]
        lines.append(f"privacy: sample-level ({d['epsilon']:.3g}, {d['delta']:.3g})-DP for the worst client (client "
                     f"{d['worst_client']}) after {d['rounds']} rounds (DP-SGD, clip {d['clip']:g}, noise multiplier "
                     + (f"{d['noise_multiplier']:.3g}" if d['noise_multiplier'] is not None else "solved per client")
                     + "".join(f"; {x}" for x in (unamplified_words(d), d.get("noise_source")) if x)
                     + "; summary.json's dp table has every client's accountant inputs)")
    elif "dp" in summary:
        d = summary["dp"]
        lines.append(f"privacy: client-level ({d['epsilon']:.3g}, {d['delta']:.3g})-DP after {d['rounds']} rounds "
                     f"(noise multiplier {d['noise_multiplier']:.3g}, clip {d['clip']:g}, sampling rate "
                     f"{d['sample_rate']:.3g}"
                     + (f"; with the class statistics {', '.join(d['class_means'])}.* as noised per-class means, clip "
                        f"{d['stats_clip']:g}, each release at noise multiplier {d['release_noise']:.3g}"
                        if d.get("class_means") else "")
                     + (f"; {d['noise_source']}" if d.get("noise_source") else "")
                     + "; summary.json's dp table has the accountant's inputs)")
    return "\n".join(lines)
