"""Cost of one checkpoint (the default policy writes one after every round, fedlt.runner.preempt): the size
and the time of ``runstate.save_checkpoint`` (safetensors, fsync, rotation) for a ResNet-50 with a 1,000-class
head (ImageNet-LT, FedLoGe's model) after some rounds, for FedAvg and FedLoGe, on this machine's CPU and disk.

    python benchmarks/checkpoint_cost.py [--reps 5] [--rounds 100] [--methods fedavg,fedloge] [--dir DIR]

Only the server side: methods that keep a model per client (pFL) add their client states, K times a model's
worth at most, which the same script measures with ``--client-models K``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fedlt.core.method import RunSpec  # noqa: E402
from fedlt.engine.simulation import rng_state  # noqa: E402
from fedlt.runner.runstate import CHECKPOINT, save_checkpoint  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402


def sim_state(method: str, rounds: int, client_models: int) -> dict:
    spec = RunSpec(model="resnet50", in_shape=(3, 224, 224), num_classes=1000, rounds=rounds, num_clients=100)
    cls = METHODS.get(method)
    m = cls(spec, cls.make_params({}))
    state = m.init_server()
    weights = state.get("weights", {})
    clients = {c: {"weights": {k: v.clone() for k, v in weights.items()}} for c in range(client_models)}
    history = [{"round": r, "clients": list(range(10)), "train_loss": 1.0, "lr": 0.05, "round_time": 1.0,
                "bytes_down_per_client": 1e8, "bytes_up_per_client": 1e8} for r in range(1, rounds + 1)]
    return {"round": rounds, "state": state, "client_states": clients, "history": history,
            "method": m.state_dict(), "rng": rng_state()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=100, help="rounds of history in the checkpoint")
    ap.add_argument("--methods", default="fedavg,fedloge")
    ap.add_argument("--client-models", type=int, default=0, help="client states holding a full model each")
    ap.add_argument("--dir", help="folder to write in (default: a temporary one; use the run's file system)")
    a = ap.parse_args()
    print(f"{'method':<10} {'MB':>8} {'median s':>9} {'min s':>7} {'MB/s':>7}")
    for method in a.methods.split(","):
        st = sim_state(method, a.rounds, a.client_models)
        with tempfile.TemporaryDirectory(dir=a.dir) as d:
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                save_checkpoint(Path(d), st, {"method": method}, 0.0)
                times.append(time.perf_counter() - t0)
            mb = (Path(d) / CHECKPOINT).stat().st_size / 1e6
        med = statistics.median(times)
        print(f"{method:<10} {mb:8.1f} {med:9.3f} {min(times):7.3f} {mb / med:7.0f}")


if __name__ == "__main__":
    main()
