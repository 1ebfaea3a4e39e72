"""The Flower engine: the run driver's messages as Flower messages (``pip install 'fedlt[flower]'``). It imports no
runner: the Flower apps that run it -- the ServerApp, the ClientApp, the strategy's run, the simulation, deployment
and Flower Datasets -- are :mod:`fedlt.flower`, above the runner.

- :mod:`fedlt.engine.flower.transport` -- ``GridTransport``, the driver's transport over a Flower ``Grid``, and
  ``GridServer``, the server side of a run on it (describe, exchanges, evaluation, the Flower ``Strategy`` hooks)
- :mod:`fedlt.engine.flower.client` -- the ClientApp's handlers: any method's client hooks on a SuperNode's data
- :mod:`fedlt.engine.flower.records` -- a fedlt ``Message`` as Flower records; client state in ``context.state``
- :mod:`fedlt.engine.flower.secagg` -- the SecAgg+ workflow of ``--secagg`` rounds, both sides
- :mod:`fedlt.engine.flower.sends` -- what the engine itself sends (declared, checked, recorded)

Nothing here names a method: everything a method exchanges is a fedlt ``Message``, carried as Flower records,
and client state lives in the SuperNode's ``context.state``.
"""
from __future__ import annotations

from ...errors import ConfigError

# how long a round (a phase, an evaluation) waits for replies, the run's start for its SuperNodes, and the time
# between asks for replies, in s: GridServer's defaults (the Flower apps' flower.* settings: fedlt.flower.settings)
TIMING = {"round-timeout": 600.0, "wait-timeout": 300.0, "poll-interval": 0.5}


def require_flwr() -> None:
    """ConfigError with the install command when Flower is not installed."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise ConfigError("Flower is not installed; install it with: pip install 'fedlt[flower]'") from None
