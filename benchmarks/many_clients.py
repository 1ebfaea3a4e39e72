"""A hundred thousand clients on one machine (issue 31): peak RSS, seconds per round and checkpoint bytes per round
as the population K grows while the clients that train stay the same (20 per round, 3 rounds, smallcnn, one
thread, a checkpoint after every round).

Every (method, K) is one ``fedlt run`` command (the real command line, in a process of its own: peak RSS is per
process):

- the scaling rows: the synthetic set with the same data per client at every K (``--per-client`` samples a client,
  4 by default: ``--synthetic-per-class`` = K x 4 / 10, split IID), each client testing on a quarter of its own
  samples (``--client-test-fraction 0.25``), PM over 500 sampled clients (``--eval-clients 500``);
- the issue's rows (``--fmnist``): Fashion-MNIST as the issue measured it before (long-tailed rho 100, split IID
  over K, every client evaluated), for the before/after table; ``--fmnist-sampled``: the same with PM over 500
  sampled clients testing on their own samples.

wall s is the process's (interpreter start, data, 3 rounds, evaluation, phases), as the issue's table gives it.

Seconds per round are the median over the rounds of the driver's round time (wall) and of the process's CPU time
in the round (``cpu s/round``: what a shared machine's load does not change); checkpoint bytes per round the
median over the checkpoints after the first of the checkpoint file plus the client-state files its commit wrote.

Goals, every method: peak RSS at K = 100,000 within 1.5x of K = 1,000, s/round within 1.2x, checkpoint bytes
per round independent of K.

    python benchmarks/many_clients.py [--methods fedavg,ditto,moon,scaffold,fedloge] [--ks 1000,10000,100000]
                                      [--per-client 4] [--fmnist 1000,10000] [--budget 2GB]
    python benchmarks/many_clients.py --interleave 20   # s/round at the smallest and largest K, in one process
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

COMMON = ["--participation", "20", "--eval-every", "3", "--partition", "iid", "--model", "smallcnn",
          "--threads", "1", "--no-progress"]


def command(method: str, dataset: str, K: int, per_client: int, budget: str, rounds: int) -> list[str]:
    argv = ["run", "--method", method, "--clients", str(K), "--rounds", str(rounds), *COMMON,
            "--client-state-memory", budget]
    sampled = ["--client-test-fraction", "0.25", "--eval-clients", "500"]
    if dataset == "synthetic":
        return argv + ["--dataset", "synthetic", "--synthetic-per-class", str(K * per_client // 10),
                       "--lt-profile", "none", *sampled]
    if dataset == "fashion-mnist+sample":  # the same, as the field evaluates a large population
        return argv + ["--dataset", "fashion-mnist", *sampled]
    return argv + ["--dataset", "fashion-mnist"]  # the before: rho 100, every client evaluated


def child(argv: list[str]) -> None:
    import torch

    from fedlt import cli
    from fedlt.engine import clientstate, driver
    from fedlt.runner import runstate

    torch.set_num_threads(1)
    ckpt: list[int] = []
    written: list[int] = []
    cpu: list[float] = []
    real_save, real_commit, real_round = runstate.save_checkpoint, clientstate.ClientStates.commit, \
        driver.Driver.train_round

    def save(run_dir, sim_state, config, elapsed):
        real_save(run_dir, sim_state, config, elapsed)
        ckpt.append((Path(run_dir) / runstate.CHECKPOINT).stat().st_size)

    def commit(self):
        before = self.written_bytes
        out = real_commit(self)
        written.append(self.written_bytes - before)
        return out

    def train_round(self):
        t0 = time.process_time()
        rec = real_round(self)
        cpu.append(time.process_time() - t0)
        return rec

    runstate.save_checkpoint, clientstate.ClientStates.commit, driver.Driver.train_round = save, commit, train_round
    with tempfile.TemporaryDirectory() as out:
        rc = cli.main(argv + ["--out", out, "--name", "run"])
        if rc:
            raise SystemExit(rc)
        rows = [json.loads(x) for x in (Path(out) / "run" / runstate.METRICS).read_text().splitlines()]
        summary = json.loads((Path(out) / "run" / "summary.json").read_text())
    final = summary["final"]
    pm = next(iter(final["personal"].values()), None)
    print(json.dumps({
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "round_s": statistics.median(r["round_time"] for r in rows if "round" in r),
        "cpu_round_s": statistics.median(cpu),
        "phases_s": sum(r["time"] for r in rows if "phase" in r),
        "phase_clients": [r.get("phase_clients") for r in rows if "phase" in r],
        "eval_s": final.get("eval_time"),
        "ckpt_bytes": [c + w for c, w in zip(ckpt, written)],
        "PM": pm["acc"] if pm else None, "pm_note": final.get("pm_note")}))


def interleaved(methods: list[str], ks: list[int], per_client: int, rounds: int) -> None:
    """Seconds per round at each K measured in one process, the populations' rounds taken in turn, so the load
    of a shared machine falls on every K alike (the table's runs are minutes apart): median wall and CPU
    seconds of the driver's train_round over ``rounds`` rounds."""
    import torch

    from fedlt.config import load_config
    from fedlt.engine import EngineConfig, Simulation
    from fedlt.runner.rundir import prepare

    torch.set_num_threads(1)
    print(f"\ns/round measured in one process, rounds taken in turn ({rounds} each; median wall / median CPU)")
    for method in methods:
        sims = {}
        for K in ks:
            cfg = load_config(overrides=dict(method=method, dataset="synthetic", synthetic_per_class=K * per_client // 10,
                                             lt_profile="none", partition="iid", clients=K, participation=20,
                                             rounds=rounds, eval_every=rounds + 1, model="smallcnn", threads=1,
                                             eval_clients=500, client_test_fraction=0.25))
            pr = prepare(cfg)
            sims[K] = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
        times: dict = {K: ([], []) for K in ks}
        for _ in range(rounds):
            for K, sim in sims.items():
                w, c = time.perf_counter(), time.process_time()
                sim.train_round()
                times[K][0].append(time.perf_counter() - w)
                times[K][1].append(time.process_time() - c)
        med = {K: (statistics.median(w), statistics.median(c)) for K, (w, c) in times.items()}
        lo, hi = ks[0], ks[-1]
        print(f"{method:<10} " + "   ".join(f"K = {K:,}: {w:.3f} / {c:.3f} s" for K, (w, c) in med.items()) +
              f"   ratio {hi:,}/{lo:,}: wall {med[hi][0] / med[lo][0]:.2f}, CPU {med[hi][1] / med[lo][1]:.2f}",
              flush=True)
        del sims


def ckpt_per_round(r: dict) -> float:
    return statistics.median(r["ckpt_bytes"][1:] or r["ckpt_bytes"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="fedavg,ditto,moon,scaffold,fedloge")
    ap.add_argument("--ks", default="1000,10000,100000", help="populations on the synthetic set")
    ap.add_argument("--per-client", type=int, default=4, help="synthetic samples a client (the same at every K)")
    ap.add_argument("--fmnist", default="", help="populations on Fashion-MNIST as the issue ran it (e.g. 1000,10000)")
    ap.add_argument("--fmnist-sampled", default="", help="populations on Fashion-MNIST as the issue ran it, with "
                                                         "--eval-clients 500 --client-test-fraction 0.25")
    ap.add_argument("--budget", default="2GB", help="--client-state-memory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="only s/round: the smallest and largest --ks in one process, ROUNDS rounds each in turn")
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child)
    if a.interleave:
        ks = sorted(int(k) for k in a.ks.split(",") if k)
        return interleaved(a.methods.split(","), [ks[0], ks[-1]], a.per_client, a.interleave)
    runs = [("synthetic", int(k)) for k in a.ks.split(",") if k] + \
           [("fashion-mnist", int(k)) for k in a.fmnist.split(",") if k] + \
           [("fashion-mnist+sample", int(k)) for k in a.fmnist_sampled.split(",") if k]
    print(f"20 clients per round, {a.rounds} rounds, smallcnn, 1 thread, --client-state-memory {a.budget}, a "
          f"checkpoint every round; synthetic: {a.per_client} samples a client, a quarter of them its test set, PM "
          f"over 500 sampled clients; fashion-mnist: the issue's command (rho 100, every client evaluated)")
    print("| method | dataset | K | peak RSS | s/round | cpu s/round | checkpoint bytes/round | phases s "
          "(clients) | eval s | wall s | PM |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    res: dict = {}
    for method in a.methods.split(","):
        for dataset, K in runs:
            argv = command(method, dataset, K, a.per_client, a.budget, a.rounds)
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *argv],
                               capture_output=True, text=True)
            wall = time.perf_counter() - t0  # the process's, as /usr/bin/time gives it (the "wall")
            if p.returncode:
                print(f"| {method} | {dataset} | {K:,} | failed: {p.stderr.strip().splitlines()[-1:]} |")
                continue
            r = res[method, dataset, K] = {**json.loads(p.stdout.strip().splitlines()[-1]), "wall_s": wall}
            pm = "-" if r["PM"] is None else f"{100 * r['PM']:.2f}"
            phases = f"{r['phases_s']:.1f} ({', '.join(map(str, r['phase_clients']))})" if r["phase_clients"] else "-"
            print(f"| {method} | {dataset} | {K:,} | {r['peak_rss_mb'] / 1024:.2f} GB | {r['round_s']:.3f} | "
                  f"{r['cpu_round_s']:.3f} | {ckpt_per_round(r) / 1e6:.3f} MB | {phases} | {r['eval_s']:.1f} | "
                  f"{r['wall_s']:.1f} | {pm} |", flush=True)
    ks = sorted(k for d, k in runs if d == "synthetic")
    if len(ks) >= 2:
        lo, hi = ks[0], ks[-1]
        print(f"\nratios K = {hi:,} / K = {lo:,} (synthetic; goals: RSS <= 1.5, s/round <= 1.2, checkpoint bytes ~ 1)")
        for method in a.methods.split(","):
            if (method, "synthetic", lo) in res and (method, "synthetic", hi) in res:
                x, y = res[method, "synthetic", lo], res[method, "synthetic", hi]
                print(f"{method:<10} RSS {y['peak_rss_mb'] / x['peak_rss_mb']:.2f}   s/round "
                      f"{y['round_s'] / x['round_s']:.2f}   cpu s/round {y['cpu_round_s'] / x['cpu_round_s']:.2f}   "
                      f"checkpoint bytes {ckpt_per_round(y) / ckpt_per_round(x):.2f}")


if __name__ == "__main__":
    main()
