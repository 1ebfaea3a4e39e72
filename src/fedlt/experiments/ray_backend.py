"""Sweeps on Ray (``pip install "fedlt[ray]"``): ``fedlt sweep|compare|reproduce ... --backend ray
[--ray-address ADDR] [--cpus-per-run N] [--gpus-per-run F]``.

Each unfinished run of the plan is one Ray task on the cluster ``address`` names (``auto``: the one this machine
belongs to; none: a local one started for the sweep), asking for ``cpus_per_run`` CPUs (its torch threads, unless
``--threads`` says otherwise) and ``gpus_per_run`` GPUs (a fraction shares one; Ray sets the task's
CUDA_VISIBLE_DEVICES). The task runs the run exactly as a local sweep's worker does
(:func:`fedlt.experiments.sweep._execute`: under the run's lock, resuming from its checkpoint), writing into the
sweep's ``--out``, which every node must see at the same path (a shared file system). So every promise of a local
sweep holds: finished runs are skipped, checkpointed ones resume, the table is the sequential sweep's.

A task whose node dies (its raylet or the machine gone) is run again by Ray elsewhere (``max_retries``), and it
resumes from the run's last checkpoint; a run whose lock is still held (a worker process not yet gone) is left
for the end and waited for, as in a local sweep.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

INSTALL = "pip install 'fedlt[ray]'"
RETRIES = 3  # Ray re-runs a task whose node or worker died this many times (each resumes from its checkpoint)


@dataclass(frozen=True)
class RayBackend:
    """Where and how a sweep's runs go on Ray. ``address``: a Ray cluster (``auto``, ``HOST:PORT``,
    ``ray://HOST:10001``) or None for a local one; ``cpus_per_run`` (default 1) and ``gpus_per_run``
    (default 0) are each task's resource request."""

    address: str | None = None
    cpus_per_run: float | None = None
    gpus_per_run: float | None = None

    def __post_init__(self):
        for name in ("cpus_per_run", "gpus_per_run"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v >= 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a number >= 0, got {v!r}")
        if self.cpus_per_run == 0 and not self.gpus_per_run:
            raise ConfigError("--cpus-per-run 0 with no --gpus-per-run asks Ray for nothing; give at least one")

    # What a sweep calls (it knows a backend only by these two methods, so it never imports this module, which
    # builds on it: no import circle).
    def check(self, jobs: int | None = None) -> None:
        """A one-line ConfigError now, before anything is written, if Ray is not installed or --jobs is given."""
        if jobs not in (None, 1):
            raise ConfigError("--jobs does not apply with --backend ray (the cluster runs as many runs at once as "
                              "its resources allow: see --cpus-per-run, --gpus-per-run)")
        require_ray()

    def run(self, todo, n: int, checkpoint_every: int, threads: int | None, progress: bool, echo,
            counts: dict) -> list:
        """:func:`run_on_ray` with this backend."""
        return run_on_ray(self, todo, n, checkpoint_every, threads, progress, echo, counts)


def backend_of(name: str | None, address: str | None = None, cpus_per_run: float | None = None,
               gpus_per_run: float | None = None) -> RayBackend | None:
    """The backend the command line asks for: None (runs on this machine) or a :class:`RayBackend`; Ray options
    without ``--backend ray`` are an error rather than silently unused."""
    if name in (None, "local"):
        given = [o for o, v in (("--ray-address", address), ("--cpus-per-run", cpus_per_run),
                                ("--gpus-per-run", gpus_per_run)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} with --backend ray")
        return None
    if name != "ray":
        raise ConfigError(f"unknown backend {name!r}; choose local or ray")
    return RayBackend(address, cpus_per_run, gpus_per_run)


def require_ray():
    """The ``ray`` module, or a one-line ConfigError saying what to install."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"--backend ray needs Ray, which is not installed; install it with: {INSTALL}") from None
    return ray


def _task(r, checkpoint_every: int, threads: int | None) -> dict:
    """One run, in a Ray worker: what a local sweep's worker process does (``sweep._execute``)."""
    from ..errors import FedltError
    from .sweep import _execute

    try:
        return {"ok": _execute(r, checkpoint_every, threads, progress=False)}
    except FedltError as e:  # bad input found on the node (a data file missing there): one line, as locally
        return {"error": (type(e), str(e))}


def run_on_ray(backend: RayBackend, todo, n: int, checkpoint_every: int, threads: int | None, progress: bool,
               echo, counts: dict) -> list:
    """Run ``todo`` (index, PlannedRun) as Ray tasks; an overall bar and one line per finished run, as
    ``sweep._run_parallel``. Returns the runs another process held (the caller waits for them)."""
    from ..runner.preempt import as_preempted
    from ..runner.raystart import start_ray
    from .sweep import _runs_bar, _settle, _where

    ray = require_ray()
    cpus = 1 if backend.cpus_per_run is None else backend.cpus_per_run
    gpus = backend.gpus_per_run or 0
    each = threads or max(1, int(cpus))
    started_here = not ray.is_initialized()
    if started_here:
        try:
            start_ray(ray, address=backend.address, include_dashboard=False, log_to_driver=False,
                      configure_logging=False)
        except ConnectionError as e:
            raise ConfigError(f"cannot reach the Ray cluster at {backend.address}: {e}; start it (`ray start "
                              f"--head`) or give its address with --ray-address") from None
    try:
        total = ray.cluster_resources()
        echo(f"running {len(todo)} runs as Ray tasks on {int(total.get('CPU', 0))} CPUs"
             f"{', ' + format(total.get('GPU', 0), 'g') + ' GPUs' if total.get('GPU') else ''} "
             f"({len(ray.nodes())} node{'s' * (len(ray.nodes()) != 1)}), {cpus:g} CPU{'s' * (cpus != 1)}"
             f"{f' and {gpus:g} GPU' if gpus else ''} and {each} thread{'s' * (each != 1)} per run")
        remote = ray.remote(_task).options(num_cpus=cpus, num_gpus=gpus, max_retries=RETRIES,
                                           retry_exceptions=False)
        pending = {remote.remote(r, checkpoint_every, each): (i, r) for i, r in todo}
        bar, say = _runs_bar(n, todo, progress, echo)
        busy = []
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=2.0)
                for ref in ready:
                    i, r = pending.pop(ref)
                    try:
                        res = ray.get(ref)
                    except ray.exceptions.RayError as e:  # retries spent, or a bug in the run: stop the sweep
                        raise RuntimeError(f"Ray task of {_where(i, n, r)} failed: {e}") from None
                    if "error" in res:
                        cls, message = res["error"]
                        raise cls(message)
                    _settle(i, n, r, res["ok"], counts, busy, bar, say)
        except KeyboardInterrupt as e:
            raise as_preempted(e) from None
        finally:
            for ref in pending:  # stopped (a signal, an error): the tasks end; their runs keep their checkpoints
                ray.cancel(ref, force=True)
            if bar is not None:
                bar.close()
        return busy
    finally:
        if started_here:
            ray.shutdown()
