"""Real deployment on 127.0.0.1 only: a Flower SuperLink and two SuperNodes started with `fedlt flower ...`, a run
submitted with `fedlt flower run` (Flower's `flwr run`). Every process runs in its own process group and is
killed in ``finally``; a marker in the environment proves afterwards that none is left. Slow: Flower starts a
fresh ClientApp process (python + torch) for every message."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from conftest import run_small  # noqa: E402
from fedlt.runstate import load_final_state  # noqa: E402

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 900  # s: generous, the machines are shared; a healthy run takes one to a few minutes
SMALL = ["--dataset", "digits", "--imbalance-ratio", "10", "--alpha", "1.0", "--clients", "2", "--participation",
         "1.0", "--rounds", "2", "--eval-every", "2", "--local-epochs", "2", "--batch-size", "16", "--model",
         "smallcnn", "--seed", "0", "--threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """Processes of one test, each in its own session (so its children can be killed with it)."""

    def __init__(self, tmp: Path):
        self.tmp, self.tag = tmp, uuid.uuid4().hex
        self.env = {**os.environ, "FLWR_HOME": str(tmp / "flwr-home"), "FEDLT_CACHE": str(tmp / "cache"),
                    "FEDLT_TEST_PROCESS_TAG": self.tag, "PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = free_port()

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "fedlt", "flower", *args], stdout=log, stderr=subprocess.STDOUT,
                             env=self.env, cwd=self.tmp, start_new_session=True)
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def up(self, n_nodes: int = 2) -> None:
        self.start("superlink", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(self.port))
        end = time.monotonic() + 120
        while True:  # the SuperLink accepts connections
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert self.procs["superlink"].poll() is None, self.log("superlink")
                assert time.monotonic() < end, "SuperLink did not start"
                time.sleep(0.5)
        for k in range(n_nodes):
            self.start(f"supernode{k}", "supernode", "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                       "--partition-id", str(k), "--host", "127.0.0.1", "--port", str(free_port()))

    def submit(self, *args: str) -> subprocess.Popen:
        return self.start("run", "run", "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                          "--app-dir", str(self.tmp / "app"), "--out", str(self.tmp / "runs"), "--name", "dep",
                          *SMALL, *args)

    def kill(self, name: str) -> None:
        p = self.procs[name]
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(30)

    def stop_all(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 15
        for p in self.procs.values():
            try:
                p.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(30)
        # Flower's SuperLink starts its SuperExec in a process group of its own; it watches its parent and
        # exits with it. Give such processes a moment, then kill whatever still carries this test's tag.
        end = time.monotonic() + 20
        while self.tagged() and time.monotonic() < end:
            time.sleep(0.5)
        for pid in self.tagged():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(1)
        left = self.tagged()
        assert not left, f"processes left running: {left}"

    def tagged(self) -> list[int]:
        found = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid():
                try:
                    if f"FEDLT_TEST_PROCESS_TAG={self.tag}".encode() in (d / "environ").read_bytes():
                        found.append(int(d.name))
                except OSError:
                    pass
        return found

    def listening(self) -> list[str]:
        """Local addresses of the listening TCP sockets of our processes' ports (from /proc/net/tcp{,6})."""
        ports = {self.port} | {int(a[a.index("--port") + 1]) for a in (p.args for p in self.procs.values())
                               if "--port" in a}
        out = []
        for f in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(f).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, port = local.split(":")
                if state == "0A" and int(port, 16) in ports:
                    out.append(addr)
        return out


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_superlink_two_supernodes_fedloge(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.up()
        t0 = time.monotonic()
        run = c.submit("--method", "fedloge", "--set", "sse_steps=200", "--round-timeout", "300")
        rc = run.wait(RUN_TIMEOUT)
        wall = time.monotonic() - t0
        assert rc == 0, c.log("run")[-3000:]
        addrs = c.listening()
        assert addrs and set(addrs) == {"0100007F"}, addrs  # 127.0.0.1 only
    finally:
        c.stop_all()
    out = tmp_path / "runs" / "dep"
    summary = json.loads((out / "summary.json").read_text())
    recs = _records(out)
    rounds = [r for r in recs if "round" in r]
    assert [r["round"] for r in rounds] == [1, 2] and all(r["missing"] == [] for r in rounds)
    assert [r["phase"] for r in recs if "phase" in r] == ["ga-fr", "la-fr"]
    assert summary["missing"] == {} and summary["engine"] == "flower"
    print(f"\ntwo-SuperNode FedLoGe run: {wall:.1f} s wall (flwr run), ServerApp {summary['wall_time']:.1f} s")
    # the deployed run is the simulation: same seed, full participation
    sim, final = run_small("fedloge", {"sse_steps": 200}, clients=2, rounds=2, eval_every=2, participation=1.0)
    state = load_final_state(out)["state"]
    assert max(float((state["weights"][k] - sim.state["weights"][k]).abs().max()) for k in state["weights"]) < 1e-5
    got = summary["final"]
    assert set(got["global"]) == set(final["global"]) and "generic" in got["global"]
    assert set(got["personal"]) == set(final["personal"]) and "personalized" in got["personal"]
    n_test = len(sim.fed.dataset.y_test)
    for mode in final["global"]:
        assert abs(got["global"][mode]["acc"] - final["global"][mode]["acc"]) <= 1.0 / n_test + 1e-9
    for mode in final["personal"]:
        for a, b, cl in zip(got["personal"][mode]["per_client"], final["personal"][mode]["per_client"], sim.fed.clients):
            assert abs(a - b) <= 1.0 / len(cl.test_y) + 1e-4
        print(f"PM {mode}: flower {got['personal'][mode]['acc']:.4f} simulation {final['personal'][mode]['acc']:.4f}")
    for mode in final["global"]:
        print(f"GM {mode}: flower {got['global'][mode]['acc']:.4f} simulation {final['global'][mode]['acc']:.4f}")


def test_killed_supernode_is_recorded_missing(tmp_path):
    c = Cluster(tmp_path)
    try:
        c.up()
        t0 = time.monotonic()
        run = c.submit("--method", "fedavg", "--round-timeout", "150")
        end = time.monotonic() + RUN_TIMEOUT
        while c.log("supernode1").count("Receiving: train message") < 2:  # it has round 2's message...
            assert run.poll() is None, c.log("run")[-3000:]
            assert time.monotonic() < end, "round 2 never reached SuperNode 1"
            time.sleep(0.2)
        c.kill("supernode1")  # ...and dies while training it
        rc = run.wait(max(end - time.monotonic(), 1))
        wall = time.monotonic() - t0
        assert rc == 0, c.log("run")[-3000:]
    finally:
        c.stop_all()
    out = tmp_path / "runs" / "dep"
    summary = json.loads((out / "summary.json").read_text())
    rounds = {r["round"]: r for r in _records(out) if "round" in r}
    assert rounds[1]["missing"] == [] and rounds[2]["missing"] == [1]
    assert summary["missing"] == {"round 2": [1], "eval 2": [1]}  # the last evaluation is the final one
    assert summary["final"]["global"]["global"]["acc"] > 0.2  # the run went on with client 0
    assert len(summary["final"]["personal"]["global"]["per_client"]) == 1
    print(f"\nrun with a killed SuperNode: {wall:.1f} s wall; record:",
          json.dumps({"round 2": rounds[2]["missing_why"], "missing": summary["missing"]}))
