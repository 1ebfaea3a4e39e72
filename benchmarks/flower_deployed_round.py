"""A deployed fedlt round against a plain Flower App's on the same set-up: a SuperLink and SuperNodes on 127.0.0.1
(``tests/flowercluster.py``), FedAvg on the smoke preset (digits, rho 10), 3 clients, every client trains and evaluates every round.
The plain App (``benchmarks/flower_plain_app.py``) is Flower's own ``FedAvg`` strategy and a ClientApp that trains
the same model on the same clients by plain SGD.

For each run it prints the messages one SuperNode received, by type (exchanges per round: every message type but
``describe`` over the rounds), the seconds a round takes (from the first SuperNode's receipt of round 1's training
message to that of the last round's, over rounds - 1: what the load of the machine hurts least), the seconds from
the submission to round 1's training message, and the command's wall time; then the means and the ratio fedlt /
plain. The timestamps are taken as the SuperNodes log each message ("Receiving: TYPE message"), polled every 20 ms.

    python benchmarks/flower_deployed_round.py [--rounds 6] [--clients 3] [--runs 3] [--src DIR]

``--src DIR``: a fedlt source tree to run instead of the installed one (e.g. an earlier commit's, from
``git archive COMMIT src | tar -x -C DIR``, as DIR/src), to compare before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from flowercluster import Cluster  # noqa: E402

RECEIVED = re.compile(r"Receiving: (\S+) message")
# the run's own log lines timed on the way to round 1: Flower's run accepted, the ServerApp's first line (fedlt's:
# waiting for the SuperNodes; the plain App's: round 1 starts), fedlt's run directory begun (after describe)
MARKS = {"flwr run started": "Successfully started run", "fedlt ServerApp up": "fedlt: waiting for",
         "fedlt described": "data: ", "plain round 1": "[ROUND 1/"}


class Watch(threading.Thread):
    """The time each SuperNode log line "Receiving: TYPE message" appeared: {node: [(seconds, type)]}."""

    def __init__(self, cluster: Cluster, nodes: int):
        super().__init__(daemon=True)
        self.c, self.nodes, self.seen = cluster, nodes, {k: [] for k in range(nodes)}
        self.marks: dict[str, float] = {}
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            now = time.monotonic()
            for k in range(self.nodes):
                types = RECEIVED.findall(self.c.log(f"supernode{k}"))
                self.seen[k] += [(now, t) for t in types[len(self.seen[k]):]]
            text = self.c.log("run")
            for name, line in MARKS.items():
                if name not in self.marks and line in text:
                    self.marks[name] = now
            time.sleep(0.02)


def plain_app(folder: Path, settings: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "benchmarks" / "flower_plain_app.py", folder / "plainapp.py")
    conf = json.dumps(settings).replace("\\", "\\\\").replace('"', '\\"')
    (folder / "pyproject.toml").write_text("\n".join([
        "[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
        "[project]", 'name = "plain-fedavg"', 'version = "1.0.0"', 'description = "plain Flower FedAvg"',
        'license = "Apache-2.0"', "dependencies = []", "", "", "[tool.flwr.app]", 'publisher = "bench"', "",
        "[tool.flwr.app.components]", 'serverapp = "plainapp:server"', 'clientapp = "plainapp:client"', "",
        "[tool.flwr.app.config]", f'fedlt = "{conf}"', ""]))
    return folder


def one(kind: str, tmp: Path, a, env: dict, settings: list[str], plain_settings: dict) -> dict:
    c = Cluster(tmp, env=env)
    try:
        c.up(a.clients)
        w = Watch(c, a.clients)
        w.start()
        t0 = time.monotonic()
        if kind == "fedlt":
            p = c.submit(*settings, name="fedlt", log="run")
        else:
            from fedlt.flower.deploy import write_connection

            write_connection(Path(c.env["FLWR_HOME"]), c.address, insecure=True)
            p = subprocess.Popen([shutil.which("flwr") or str(Path(sys.executable).with_name("flwr")), "run",
                                  str(plain_app(tmp / "plain-app", plain_settings)), "fedlt", "--stream"],
                                 stdout=open(tmp / "run.log", "w"), stderr=subprocess.STDOUT, env=c.env, cwd=tmp,
                                 start_new_session=True)
            c.procs["run"] = p
        rc = p.wait(1800)
        wall = time.monotonic() - t0
        time.sleep(0.5)
        w.done.set()
        w.join()
        if rc != 0:
            sys.exit(f"{kind} run failed ({rc}):\n{c.log('run')[-3000:]}")
        if kind == "plain" and "ERROR" in c.log("run"):
            sys.exit(f"plain run reported an error:\n{c.log('run')[-3000:]}")
    finally:
        c.stop_all()
    got = w.seen[0]
    by_type: dict[str, int] = {}
    for _, t in got:
        by_type[t] = by_type.get(t, 0) + 1
    trains = [min(s[i][0] for s in ([x for x in w.seen[k] if x[1].startswith("train")] for k in range(a.clients)))
              for i in range(a.rounds)]
    per_round = (trains[-1] - trains[0]) / (a.rounds - 1)
    exchanges = sum(n for t, n in by_type.items() if "describe" not in t) / a.rounds
    return {"kind": kind, "messages": by_type, "exchanges/round": exchanges, "s/round": per_round,
            "launch->round 1": trains[0] - t0, "wall": wall,
            "marks": {name: round(t - t0, 1) for name, t in sorted(w.marks.items(), key=lambda x: x[1])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--which", default="fedlt,plain", help="fedlt, plain or both (comma-separated)")
    ap.add_argument("--src", help="a fedlt source tree (DIR/src) to run instead of the installed one")
    a = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDLT_TENSORBOARD": "0"}
    if a.src:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(Path(a.src).resolve() / "src"), env.get("PYTHONPATH")) if x)
    settings = ["--method", "fedavg", "--preset", "smoke", "--clients", str(a.clients), "--participation", "1",
                "--rounds", str(a.rounds), "--eval-every", "1", "--threads", "1"]
    from fedlt.api import make_config

    cfg = make_config(preset="smoke", method="fedavg", clients=a.clients, participation=1.0, rounds=a.rounds,
                      eval_every=1, threads=1)
    rows = []
    for i in range(a.runs):
        for kind in a.which.split(","):
            with tempfile.TemporaryDirectory(prefix=f"fedlt-round-{kind}-") as tmp:
                r = one(kind, Path(tmp), a, env, settings, cfg.to_dict())
            rows.append(r)
            print(f"run {i + 1} {kind:>5}: {r['exchanges/round']:.2f} exchanges/round {r['messages']}, "
                  f"{r['s/round']:.2f} s/round, launch->round 1 {r['launch->round 1']:.1f} s (on the way, s after launch: "
                  f"{r['marks']}), wall {r['wall']:.1f} s, load {os.getloadavg()[0]:.1f}",
                  flush=True)
    mean = {k: {m: statistics.mean(r[m] for r in rows if r["kind"] == k) for m in
                ("exchanges/round", "s/round", "launch->round 1", "wall")} for k in a.which.split(",")}
    print(f"\nmeans of {a.runs} run(s), {a.rounds} rounds, {a.clients} SuperNodes:")
    for k, m in mean.items():
        print(f"  {k:>5}: " + ", ".join(f"{n} {v:.2f}" for n, v in m.items()))
    if {"fedlt", "plain"} <= set(mean):
        print("  fedlt / plain: " + ", ".join(f"{n} {mean['fedlt'][n] / mean['plain'][n]:.2f}x"
                                              for n in ("exchanges/round", "s/round", "launch->round 1", "wall")))


if __name__ == "__main__":
    main()
