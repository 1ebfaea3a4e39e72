"""One fedlt run on Flower's simulation runtime (``pip install "fedlt[simulation]"``): the fedlt ServerApp and
ClientApp, unchanged, with the clients as virtual SuperNodes run by a pool of Ray actors, so one run's clients
spread over every CPU and GPU of a machine or of a Ray cluster (``fedlt flower simulate``).

Node ``partition-id`` K serves client K of the run's federation, as in ``fedlt flower inprocess``; the messages
carry every setting, and each client's generator is the simulation engine's, so for the same settings the
metrics are those of ``fedlt flower inprocess`` (and of ``fedlt run``).

Resources: each virtual client asks Ray for ``cpus_per_client`` CPUs and ``gpus_per_client`` GPUs (a fraction
lets several clients share one GPU), which bounds how many train at once; ``ray_address`` joins an existing Ray
cluster (``auto``) instead of starting one; ``backend_config`` is Flower's own dictionary (``init_args``: the
arguments of ``ray.init``, ``client_resources``, ``actor``) for anything else, merged over these.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..config import RunConfig
from ..errors import ConfigError
from ..runner.rundir import run_dir_for
from ..runner.preempt import Preempted, again, retake, stopped_without_checkpoint
from ..runner.raystart import start_ray
from ..runner.runstate import has_checkpoint

INSTALL = "pip install 'fedlt[simulation]'"
POLL = 0.01  # s between the server's looks for replies: in one process these are cheap (a SuperLink's default: 0.5)


def backend_config_of(cpus_per_client: float = 1.0, gpus_per_client: float = 0.0, ray_address: str | None = None,
                      extra: str | dict | None = None) -> dict:
    """Flower's backend config: client resources, Ray's init arguments, then ``extra`` (JSON text or a dict)
    merged over them table by table."""
    if cpus_per_client is None or cpus_per_client <= 0:
        raise ConfigError(f"--cpus-per-client must be > 0, got {cpus_per_client}")
    if gpus_per_client is None or gpus_per_client < 0:
        raise ConfigError(f"--gpus-per-client must be >= 0, got {gpus_per_client}")
    cfg = {"client_resources": {"num_cpus": cpus_per_client, "num_gpus": gpus_per_client},
           "init_args": {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}}
    if ray_address:
        cfg["init_args"]["address"] = ray_address
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError as e:
            raise ConfigError(f"--backend-config is not JSON ({e}); e.g. "
                              f"'{{\"init_args\": {{\"num_cpus\": 8}}}}'") from None
    if extra is not None and not (isinstance(extra, dict) and all(isinstance(v, dict) for v in extra.values())):
        raise ConfigError("--backend-config must be a JSON object of tables (init_args, client_resources, actor)")
    for k, v in (extra or {}).items():
        cfg[k.replace("-", "_")] = {**cfg.get(k.replace("-", "_"), {}), **v}
    return cfg


def run_simulation(cfg: RunConfig, backend_config: dict | None = None, **flower) -> dict:
    """Run ``cfg`` on Flower's simulation runtime (one virtual SuperNode per client) and return its summary.
    ``flower``: the Flower engine's settings (``round_timeout``, ``checkpoint_every``, ``resume``, ...)."""
    try:
        import ray  # noqa: F401 -- Flower's simulation runtime is Ray
        from flwr.serverapp import ServerApp
        from flwr.simulation import run_simulation as flwr_run_simulation
    except ImportError:
        raise ConfigError(f"fedlt flower simulate needs Flower's simulation runtime (Ray); install it with: "
                          f"{INSTALL}") from None
    from .client_app import app as client_app
    from .server_app import serve
    from .settings import flatten, to_run_config

    name = cfg.name  # as given: a run named below is resumed with its name (preempt.again)
    if name is None:  # the run directory is named here, so that its summary can be read back afterwards
        cfg = RunConfig(**{**cfg.to_dict(), "name": run_dir_for(cfg).name})
    flower = {"poll_interval": POLL, **flower}
    run_config = flatten(to_run_config(cfg, **flower))
    app = ServerApp()

    @app.main()
    def main(grid, context) -> None:  # the run's settings, as `flwr run` would put them in the context
        context.run_config.update(run_config)
        serve(grid, context, deployed=False)  # Flower's simulation: the simulator's noise seed by default

    backend_config = backend_config or backend_config_of()
    out = run_dir_for(cfg)
    _init_ray(backend_config.get("init_args", {}))
    try:
        flwr_run_simulation(server_app=app, client_app=client_app, num_supernodes=cfg.clients,
                            backend_config=backend_config)
    except Preempted as e:  # the checkpoint of the last completed round, if any, is in the run directory
        if not has_checkpoint(out):
            raise e.stopped(stopped_without_checkpoint(out, "mid-run"))
        raise e.stopped(f"run {out} stopped; its last completed round is checkpointed there: to finish it, run "
                        f"{again(out, name)}")
    try:
        return json.loads((Path(out) / "summary.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(f"the simulation ended without a summary in {out}; see Flower's log above") from None


def _init_ray(init_args: dict) -> None:
    """Start (or join) Ray as Flower's runtime would (its ``init_ray`` then finds it running), with the workers
    (the clients) at normal priority and the scheduler's signals back (:mod:`fedlt.runner.raystart`): ray.init's
    own SIGTERM handler aborts the process, ours stops the run with one line and its checkpoint kept."""
    import os
    import sys

    import ray

    if not ray.is_initialized():
        path = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
        os.environ["PYTHONPATH"] = path  # the actors import fedlt as this process does
        start_ray(ray, runtime_env={"env_vars": {"PYTHONPATH": path}}, **{"include_dashboard": False, **init_args})
    else:
        retake()
