"""Shared set-up for the benchmark scripts: build a simulation of the fmnist-lt protocol (docs/protocol.md A)."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fedlt.config import RunConfig  # noqa: E402
from fedlt.engine import EngineConfig, Simulation  # noqa: E402
from fedlt.runner.rundir import federation_for, prepare  # noqa: E402


def simulation(method="fedavg", fed=None, **over) -> Simulation:
    cfg = RunConfig(method=method, **over)
    pr = prepare(cfg, fed)
    return Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))


def plain_round(sim: Simulation):
    """``plain(r)``: round r's clients trained by a plain PyTorch loop -- the same model, samples (ready-made:
    normalised, on the run's device), batch size and epochs as the engine's FedAvg round, nothing in between."""
    import torch
    import torch.nn.functional as F

    fed, spec = sim.fed, sim.method.spec
    model = sim.method.new_model()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ready = {c.client_id: (fed.prep(c.x.to(spec.device)), c.y.to(spec.device)) for c in fed.clients}
    gen = torch.Generator().manual_seed(0)

    def plain(rnd: int):
        for cid in sim.schedule[rnd % len(sim.schedule)]:
            model.load_state_dict(init)
            opt = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
            x, y = ready[cid]
            model.train()
            for _ in range(spec.local_epochs):
                perm = torch.randperm(len(y), generator=gen).to(spec.device)
                for s in range(0, len(y), spec.batch_size):
                    i = perm[s:s + spec.batch_size]
                    opt.zero_grad()
                    F.cross_entropy(model(x[i]), y[i]).backward()
                    opt.step()

    return plain


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def client_steps(sim: Simulation, rnd: int = 0) -> list[int]:
    """Local steps of each client of round ``rnd + 1``. A batched round takes as many steps as its largest client,
    so with the cost of a step unchanged it is at most sum / max of these times faster than one client after
    another (the step ceiling)."""
    from fedlt.data.federated import batch_bounds

    spec = sim.method.spec
    return [spec.local_epochs * len(batch_bounds(len(sim.fed.clients[c]), spec.batch_size)) for c in sim.schedule[rnd]]


def interleaved(a, b, reps: int) -> tuple[float, float]:
    """Median times of a() and b(), run alternately (A B A B ...) so machine noise hits both alike."""
    ta, tb = [], []
    for _ in range(reps):
        ta.append(timed(a))
        tb.append(timed(b))
    return statistics.median(ta), statistics.median(tb)


__all__ = ["simulation", "federation_for", "RunConfig", "timed", "interleaved", "plain_round", "client_steps"]
