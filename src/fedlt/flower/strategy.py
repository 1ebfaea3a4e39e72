"""``FedltStrategy``: any registered method's server hooks as a Flower strategy, and the run's entry on Flower.

The engine's server side (:class:`fedlt.engine.flower.transport.GridServer`) holds the run's method, its driver
and its exchanges with the SuperNodes; :meth:`FedltStrategy.run` runs them as a fedlt run: it waits for the
run's SuperNodes, writes ``config.json`` and ``partition.json``, and records the run directory, checkpoints and
resume as every engine does (``fedlt.runner.rundir.run_recorded``), plus the missing clients of every round in
``summary.json``.
"""
from __future__ import annotations

from pathlib import Path

from flwr.serverapp import Grid

from ..engine.flower.transport import GridServer, GridTransport  # noqa: F401 (GridTransport: its old path, fedlt.engine.flower.strategy)
from ..metrics import headline
from ..runner.rundir import run_dir_for, run_recorded
from ..runner.runstate import check_resumable, owned_run_dir


class FedltStrategy(GridServer):
    """A fedlt run on Flower: :class:`GridServer`'s exchanges, run and recorded as every engine's run is."""

    def run(self, grid: Grid, out: Path | None = None, *, checkpoint_every: int = 0, resume: bool = False) -> dict:
        """The whole run by the run driver over ``grid``; writes the run directory (``cfg.out``/``cfg.name``)
        as every engine does (``fedlt.runner.rundir.run_recorded``: checkpoints every ``checkpoint_every``
        rounds, ``resume`` from one) and returns the summary."""
        cfg = self.cfg
        out = Path(out) if out is not None else run_dir_for(cfg)
        if resume:
            check_resumable(out)
        self.transport.grid = grid
        self.echo(f"fedlt: waiting for {cfg.clients} SuperNodes (at most {self.wait_timeout:g} s)")
        self.connect(grid)
        self._counts()
        config = {**cfg.to_dict(), "model": self.spec.model, "lt_profile_used": self.spec.data.get("lt_profile"),
                  "method_params": vars(self.method.p), "engine": "flower", "flower": {
                      "round_timeout": self.round_timeout, "wait_timeout": self.wait_timeout,
                      "nodes": {str(c): n for c, n in sorted(self.nodes.items())}}}

        def say(d):  # each round as it is recorded (one whose PM rides in the next round's messages: then)
            for rec in d.recorded:
                ev = rec.get("eval")
                said = (", ".join(f"{k} {v:.4f}" for k, v in headline(ev).items() if v is not None) if ev
                        else f"train loss {rec['train_loss']}")
                self.echo(f"round {rec['round']}: {said}")

        self.driver.after_round.append(say)
        with owned_run_dir(out):
            return run_recorded(self.driver, cfg, out, config, self.fed,
                                [self.info[c]["test_size"] for c in sorted(self.info) if "test_size" in self.info[c]],
                                self.echo,
                                checkpoint_every=checkpoint_every, resume=resume, engine="flower")
