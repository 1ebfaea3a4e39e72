"""A hundred thousand clients on one machine (issue 31): peak RSS, seconds per round and checkpoint bytes per round
as the population K grows while the clients that train stay the same (20 per round, 3 rounds, one thread).

Fashion-MNIST (every sample, split IID) for K up to 50,000; the synthetic Gaussian mixture, with
``--synthetic-per-class`` training samples per class (default 20,000: 2 per client at K = 100,000), for K =
100,000, and at K = 1,000 on the same data for the ratios. Every (method, K) runs in a process of its own (peak RSS
is per process), through ``fedlt.experiment.run`` with a checkpoint after every round, PM over 500 sampled
clients, per-client test data from each client's own samples (``--client-test-fraction``) and the client-state
store's budget ``--client-state-memory``. Checkpoint bytes per round: the checkpoint file plus the client-state
files its commit wrote.

Goals, every method: peak RSS at K = 100,000 within 1.5x of K = 1,000, s/round within 1.2x, checkpoint bytes per
round independent of K.

    python benchmarks/many_clients.py [--methods fedavg,ditto,moon,scaffold,fedloge] [--fmnist 1000,10000]
                                      [--synthetic 1000,100000] [--synthetic-per-class 20000] [--budget 2GB]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def child(method: str, dataset: str, K: int, per_class: int, budget: str, rounds: int) -> None:
    import torch

    from fedlt import experiment
    from fedlt.config import RunConfig
    from fedlt.engine import clientstate
    from fedlt.experiments import runstate

    torch.set_num_threads(1)
    ckpt: list[int] = []
    real = runstate.save_checkpoint

    def measured(run_dir, sim_state, config, elapsed):
        real(run_dir, sim_state, config, elapsed)
        ckpt.append((Path(run_dir) / runstate.CHECKPOINT).stat().st_size)

    runstate.save_checkpoint = measured
    kw = dict(method=method, dataset=dataset, clients=K, participation=20, rounds=rounds, eval_every=rounds,
              partition="iid", lt_profile="none", model="smallcnn", threads=1)
    with tempfile.TemporaryDirectory() as out:
        cfg = RunConfig(**kw, out=out, name="run")
        cfg.client_state_memory, cfg.eval_clients, cfg.client_test_fraction = budget, 500, 0.2
        t0 = time.perf_counter()
        fed = experiment.build_federation(dataset, None, 1.0, "none", 3, None, "iid", K, 0, "cpu", {},
                                          {"n_per_class": per_class} if dataset == "synthetic" else {},
                                          client_test_fraction=0.2)
        build = time.perf_counter() - t0
        pr = experiment.prepare(cfg, fed)
        written: list[int] = []
        real_commit = clientstate.ClientStates.commit

        def commit(self):
            before = self.written_bytes
            out_ = real_commit(self)
            written.append(self.written_bytes - before)
            return out_

        clientstate.ClientStates.commit = commit
        lines: list[str] = []
        summary = experiment.run(cfg, progress=False, echo=lines.append, prepared=pr, checkpoint_every=1)
        rows = [json.loads(x) for x in (Path(out) / "run" / runstate.METRICS).read_text().splitlines()]
    rounds_s = [r["round_time"] for r in rows if "round" in r]
    phases_s = sum(r["time"] for r in rows if "phase" in r)
    final = summary["final"]
    pm = next(iter(final["personal"].values()), None)
    print(json.dumps({
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "round_s": statistics.median(rounds_s), "phases_s": phases_s,
        "ckpt_bytes": [c + w for c, w in zip(ckpt, written)], "build_s": build,
        "wall_s": summary["wall_time"], "PM": pm["acc"] if pm else None,
        "notes": [x for x in lines if x.startswith("note:")]}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="fedavg,ditto,moon,scaffold,fedloge")
    ap.add_argument("--fmnist", default="1000,10000", help="Fashion-MNIST populations (at most 50,000)")
    ap.add_argument("--synthetic", default="1000,100000", help="populations on the synthetic set")
    ap.add_argument("--synthetic-per-class", type=int, default=20_000)
    ap.add_argument("--synthetic-per-client", type=int, default=0,
                    help="instead: K x this many synthetic samples at each K (the same data per client at every K)")
    ap.add_argument("--budget", default="2GB", help="--client-state-memory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        method, dataset, K = a.child
        return child(method, dataset, int(K), a.synthetic_per_class, a.budget, a.rounds)
    runs = [("fashion-mnist", int(k)) for k in a.fmnist.split(",") if k] + \
           [("synthetic", int(k)) for k in a.synthetic.split(",") if k]
    print(f"20 clients per round, {a.rounds} rounds, smallcnn, 1 thread, --client-state-memory {a.budget}, "
          f"PM over 500 sampled clients; synthetic: {a.synthetic_per_class:,} samples per class")
    print("| method | dataset | K | peak RSS | s/round | checkpoint bytes/round | phases s | PM |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    res: dict = {}
    for method in a.methods.split(","):
        for dataset, K in runs:
            per_class = max(1, K * a.synthetic_per_client // 10) if a.synthetic_per_client else a.synthetic_per_class
            p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", method, dataset, str(K),
                                "--synthetic-per-class", str(per_class), "--budget", a.budget,
                                "--rounds", str(a.rounds)], capture_output=True, text=True)
            if p.returncode:
                print(f"| {method} | {dataset} | {K:,} | failed: {p.stderr.strip().splitlines()[-1:]} |")
                continue
            r = res[method, dataset, K] = json.loads(p.stdout.strip().splitlines()[-1])
            ck = statistics.median(r["ckpt_bytes"][1:] or r["ckpt_bytes"])
            pm = "-" if r["PM"] is None else f"{100 * r['PM']:.2f}"
            print(f"| {method} | {dataset} | {K:,} | {r['peak_rss_mb'] / 1024:.2f} GB | {r['round_s']:.3f} | "
                  f"{ck / 1e6:.3f} MB | {r['phases_s']:.1f} | {pm} |", flush=True)
    ks = sorted(k for d, k in runs if d == "synthetic")
    if len(ks) >= 2:
        lo, hi = ks[0], ks[-1]
        print(f"\nratios K = {hi:,} / K = {lo:,} (synthetic; goals: RSS <= 1.5, s/round <= 1.2, checkpoint ~ 1)")
        for method in a.methods.split(","):
            if (method, "synthetic", lo) in res and (method, "synthetic", hi) in res:
                x, y = res[method, "synthetic", lo], res[method, "synthetic", hi]
                ck = lambda r: statistics.median(r["ckpt_bytes"][1:] or r["ckpt_bytes"])  # noqa: E731
                print(f"{method:<10} RSS {y['peak_rss_mb'] / x['peak_rss_mb']:.2f}   s/round "
                      f"{y['round_s'] / x['round_s']:.2f}   checkpoint bytes {ck(y) / ck(x):.2f}")


if __name__ == "__main__":
    main()
