"""The one generic fedlt ServerApp: reads the run settings from the Flower run config and drives
:class:`~fedlt.flower.strategy.FedltStrategy` over the grid it is given (the SuperLink's, or the in-process one).
The run directory goes to the run's ``out`` folder on the machine that runs the ServerApp (the SuperLink's)."""
from __future__ import annotations

from logging import INFO

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ..errors import Diverged
from .settings import from_run_config
from .strategy import FedltStrategy

app = ServerApp()


def _log(line: str) -> None:
    from flwr.common.logger import log

    for part in str(line).splitlines():
        log(INFO, "%s", part)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp of a deployment (``flwr run`` of the app ``fedlt flower run`` writes): its clients are
    SuperNodes, whose DP noise comes from their own keys unless the run asks for ``--dp-noise-seed run``."""
    serve(grid, context, deployed=True)


def serve(grid: Grid, context: Context, deployed: bool) -> None:
    """The run of ``context``'s run config over ``grid`` (``deployed``: SuperNodes, not Flower's simulation)."""
    cfg, opts = from_run_config(dict(context.run_config))
    strategy = FedltStrategy(cfg, opts["round-timeout"], opts["wait-timeout"], opts["poll-interval"], echo=_log,
                             deployed=deployed)
    try:
        strategy.run(grid, checkpoint_every=int(opts["checkpoint-every"]), resume=bool(opts["resume"]))
    except Diverged as e:  # the run directory's summary.json already says diverged; one line in the log
        _log(f"fedlt: {e}")
