"""Slower rounds in child processes, for tests that must signal or kill a run mid-way whatever the machine's load:
a ``sitecustomize`` on the children's PYTHONPATH makes ``Simulation.train_round`` sleep first (the numbers do not
change). The patch is applied when fedlt's simulation module is imported, so processes that never import fedlt
(Ray's daemons) do not pay for it."""
from __future__ import annotations

import os

SITE = '''import builtins, sys, time
_import = builtins.__import__
def _patched(name, *a, **k):
    mod = _import(name, *a, **k)
    S = getattr(sys.modules.get("fedlt.engine.simulation"), "Simulation", None)
    if S is not None:
        builtins.__import__ = _import
        orig = S.train_round
        def slow(self):
            time.sleep(SECONDS)
            return orig(self)
        S.train_round = slow
    return mod
builtins.__import__ = _patched
'''


def slow_env(tmp_path, seconds: float = 0.3) -> dict:
    """The environment of a child process whose rounds take ``seconds`` longer (one torch thread, no
    TensorBoard)."""
    site = tmp_path / "slow-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE.replace("SECONDS", repr(float(seconds))))
    path = os.pathsep.join(x for x in (str(site), os.environ.get("PYTHONPATH")) if x)
    return {**os.environ, "OMP_NUM_THREADS": "1", "FEDLT_TENSORBOARD": "0", "PYTHONPATH": path}


def sweep_grid(seeds: list[int]) -> str:
    """A 4-client digits sweep of FedAvg and FedProx, 5 rounds evaluated each round: small enough to run in
    seconds, long enough (with ``slow_env``) for a signal or a kill to land between two checkpoints."""
    return f"""
seeds = {seeds}
[base]
dataset = "digits"
imbalance_ratio = 10
clients = 4
alpha = 1.0
rounds = 5
eval_every = 1
local_epochs = 1
batch_size = 16
model = "mlp"
[methods]
fedavg = {{}}
fedprox = {{ params = {{ mu = 0.01 }} }}
"""
