"""fedlt on Flower: the same methods on a SuperLink and SuperNodes (``pip install 'fedlt[flower]'``).

- :mod:`fedlt.engine.flower.client_app` -- ``app``, the one generic ClientApp (runs any method's client hooks)
- :mod:`fedlt.engine.flower.server_app` -- ``app``, the one generic ServerApp (reads the run settings, runs the strategy)
- :mod:`fedlt.engine.flower.strategy` -- ``FedltStrategy``, any method's server hooks as a Flower strategy
- :mod:`fedlt.engine.flower.inprocess` -- the same apps in one process (no SuperLink, no Ray, no network)
- :mod:`fedlt.engine.flower.deploy` -- ``fedlt flower superlink|supernode|app|run``: processes and app directories

Nothing here names a method: everything a method exchanges is a fedlt ``Message``, carried as Flower records
(:mod:`fedlt.engine.flower.records`), and client state lives in the SuperNode's ``context.state``.
"""
from __future__ import annotations

from ...errors import ConfigError


def require_flwr() -> None:
    """ConfigError with the install command when Flower is not installed."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise ConfigError("Flower is not installed; install it with: pip install 'fedlt[flower]'") from None
