"""Real deployment on 127.0.0.1 only: a Flower SuperLink and SuperNodes started with `fedlt flower ...`, runs
submitted with `fedlt flower run` (Flower's `flwr run`). Every process runs in its own process group and is
killed in ``finally``; a marker in the environment proves afterwards that none is left.

Slow, and mostly waiting: Flower starts a fresh ClientApp process (python + torch) for every message, its
SuperNodes poll every 3 s, and a dead SuperNode is noticed after two missed 30-s heartbeats. So each test's
deployment is a *scenario* that starts in a background thread of its own as soon as the session has collected
it (:func:`start_background`, conftest's background jobs), beside the other tests; the test waits for its
scenario's result, then checks it (against the in-process simulation, run in the test itself).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from conftest import background, job_result, run_small  # noqa: E402
from flowercluster import Cluster, records  # noqa: E402
from fedlt.runner.runstate import load_final_state  # noqa: E402

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 900  # s: generous, the machines are shared; a healthy run takes one to a few minutes
SMALL = ["--dataset", "digits", "--imbalance-ratio", "10", "--alpha", "1.0", "--clients", "2", "--participation",
         "1.0", "--rounds", "2", "--eval-every", "2", "--local-epochs", "2", "--batch-size", "16", "--model",
         "smallcnn", "--seed", "0", "--threads", "1"]
RESUMED = {"ditto": [], "fedloge": ["--set", "sse_steps=200"]}  # method: its parameters


def scenario_name(item) -> str:
    """The deployment a collected test of this module checks."""
    method = getattr(item, "callspec", None) and item.callspec.params.get("method")
    return f"resume-{method}" if method else "dp-client" if "dp_client" in item.name else "killed-supernode"


def scenario_job(name: str, tmp: Path):
    def job():
        tmp.mkdir(parents=True, exist_ok=True)
        return (resume_scenario(tmp, name[len("resume-"):]) if name.startswith("resume-")
                else dp_scenario(tmp) if name == "dp-client" else killed_supernode_scenario(tmp))
    return job


def start_background(items, base: Path) -> None:
    """conftest's hook: the collected tests' deployments, each in a thread of its own (they mostly wait)."""
    background({f"deploy-{scenario_name(i)}": scenario_job(scenario_name(i), base / scenario_name(i))
                for i in items})


def scenario(name: str, tmp_path: Path) -> dict:
    """The result of deployment ``name``."""
    return job_result(f"deploy-{name}", scenario_job(name, tmp_path), timeout=3 * RUN_TIMEOUT)


def killed_supernode_scenario(tmp: Path) -> dict:
    """Two SuperNodes; SuperNode 1 is killed (SIGKILL) while it trains round 2."""
    c = Cluster(tmp)
    try:
        c.up()
        t0 = time.monotonic()
        run = c.submit(*SMALL, "--method", "fedavg", "--round-timeout", "150")
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
    return {"out": tmp / "runs" / "dep", "wall": wall}


def test_killed_supernode_is_recorded_missing(tmp_path):
    res = scenario("killed-supernode", tmp_path)
    out = res["out"]
    summary = json.loads((out / "summary.json").read_text())
    rounds = {r["round"]: r for r in records(out) if "round" in r}
    assert rounds[1]["missing"] == [] and rounds[2]["missing"] == [1]
    assert summary["missing"] == {"round 2": [1], "eval 2": [1]}  # the last evaluation is the final one
    assert summary["final"]["global"]["global"]["acc"] > 0.2  # the run went on with client 0
    assert len(summary["final"]["personal"]["global"]["per_client"]) == 1
    print(f"\nrun with a killed SuperNode: {res['wall']:.1f} s wall; record:",
          json.dumps({"round 2": rounds[2]["missing_why"], "missing": summary["missing"]}))


# every update of SMALL is longer than 0.05; the noise from --seed, asked for (a deployment's default is a secret key),
# so that the run can be held to the simulator's
DP = ["--dp", "client", "--dp-clip", "0.05", "--dp-noise", "0.5", "--dp-noise-seed", "run"]


def dp_scenario(tmp: Path) -> dict:
    """Two SuperNodes (separate processes) train one round of SMALL under --dp client."""
    c = Cluster(tmp)
    try:
        c.up()
        run = c.submit(*SMALL, "--rounds", "1", "--eval-every", "1", "--method", "fedavg", *DP, "--round-timeout",
                       "300")
        assert run.wait(RUN_TIMEOUT) == 0, c.log("run")[-3000:]
    finally:
        c.stop_all()
    return {"out": tmp / "runs" / "dep"}


def test_deployed_supernodes_clip_under_dp_client(tmp_path):
    """Each SuperNode clipped its update before it left: every reply passed the server's check (a reply longer than
    the clip is recorded missing, with why) though every update was longer than the clip (each client's bit), and
    the run is the simulator's: the same epsilon, GM and model (to float rounding across processes)."""
    out = scenario("dp-client", tmp_path)["out"]
    summary = json.loads((out / "summary.json").read_text())
    rounds = [r for r in records(out) if "round" in r]
    assert summary["missing"] == {} and [(r["sampled"], r["arrived"]) for r in rounds] == [(2, 2)]
    assert rounds[0]["dp_clipped"] == 1.0 and rounds[0]["dp_update_norm"] is None
    sim, final = run_small("fedavg", clients=2, participation=1.0, rounds=1, eval_every=1, local_epochs=2,
                           dp="client", dp_clip=0.05, dp_noise=0.5, threads=1)
    ref = sim.dp.table(1)
    assert {**summary["dp"], "noise_source": None} == {**ref, "noise_source": None}
    assert sim.history[0]["dp_clipped"] == 1.0
    assert summary["dp"]["noise_source"].startswith("noise drawn from --seed, as --dp-noise-seed run asks")
    state = load_final_state(out)["state"]
    assert max(float((state["weights"][k] - sim.state.weights[k]).abs().max()) for k in state["weights"]) < 1e-5
    assert abs(summary["final"]["global"]["global"]["acc"] - final["global"]["global"]["acc"]) \
        <= 1.0 / len(sim.fed.dataset.y_test) + 1e-9


def resume_scenario(tmp: Path, method: str) -> dict:
    """Three SuperNodes with their --state-dir, a SuperLink on its database, every socket on 127.0.0.1 only; two of
    three clients per round, so clients skip rounds. The SuperLink (and every process it started) is killed with
    SIGKILL once round 1 is checkpointed: the interrupted `fedlt flower run` says so in one line and exits 75. The
    SuperLink restarts on its database, the run is submitted again with --resume (a new Flower run); the first
    SuperNode to receive a train message of that run is killed while it trains and restarted with its --state-dir
    (a new node: the round's message is sent to it again). The run ends with the simulation's weights, GM and
    every client's PM (FedLoGe: after its GA-FR and LA-FR phases): each client was rolled back to its state of the
    checkpointed round, and none is recorded missing."""
    from fedlt.runner.runstate import checkpointed_round

    settings = ["--dataset", "digits", "--imbalance-ratio", "10", "--alpha", "1.0", "--clients", "3",
                "--participation", "2", "--rounds", "2", "--eval-every", "2", "--local-epochs", "1", "--batch-size",
                "16", "--model", "smallcnn", "--seed", "0", "--threads", "1", "--method", method, *RESUMED[method],
                "--round-timeout", "300"]
    out = tmp / "runs" / "dep"
    c = Cluster(tmp)
    try:
        c.up(3, database=True, state_dirs=True)
        first = c.submit(*settings, log="first")
        end = time.monotonic() + RUN_TIMEOUT
        while checkpointed_round(out) != 1:
            assert first.poll() is None, c.log("first")[-3000:]
            assert time.monotonic() < end, "round 1 was never checkpointed"
            time.sleep(0.1)
        addrs = c.listening()
        assert addrs and set(addrs) == {"0100007F"}, addrs  # 127.0.0.1 only
        c.kill("superlink", tree=True)  # the server's machine dies
        rc = first.wait(300)
        last = [x for x in c.log("first").splitlines() if x.strip()][-1]
        assert rc == 75 and "Connection to the SuperLink" not in c.log("first"), c.log("first")[-2000:]
        assert last.startswith("fedlt: error: lost the SuperLink") and "round 1 checkpointed" in last, last
        assert "--resume" in last
        c.start_superlink(database=True)
        second = c.submit(*settings, "--resume", log="second")
        node = c.wait_for_training(c.run_id("second"), [0, 1, 2], proc="second")
        c.kill(f"supernode{node}", tree=True)  # dies while it trains a round of the resumed run...
        c.start_supernode(node)  # ...and comes back with its --state-dir
        assert second.wait(RUN_TIMEOUT) == 0, c.log("second")[-3000:]
        assert f"client {node} is back on SuperNode" in c.log("second"), c.log("second")[-3000:]
    finally:
        c.stop_all()
    return {"out": out}


@pytest.mark.parametrize("method", list(RESUMED))
def test_deployed_run_resumes_exactly_after_the_superlink_and_a_supernode_die(tmp_path, method):
    """The deployment of :func:`resume_scenario` ends as the uninterrupted simulation."""
    out = scenario(f"resume-{method}", tmp_path)["out"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_after_round"] == 1 and summary["missing"] == {}, summary["missing"]
    assert summary["engine"] == "flower"
    if method == "fedloge":
        assert [r["phase"] for r in records(out) if "phase" in r] == ["ga-fr", "la-fr"]
    sim, final = run_small(method, {"sse_steps": 200} if RESUMED[method] else {}, clients=3, participation=2,
                           rounds=2, eval_every=2, local_epochs=1)
    state = load_final_state(out)["state"]
    assert max(float((state["weights"][k] - sim.state["weights"][k]).abs().max()) for k in state["weights"]) < 1e-5
    got, n_test = summary["final"], len(sim.fed.dataset.y_test)
    assert set(got["global"]) == set(final["global"]) and set(got["personal"]) == set(final["personal"])
    for mode in final["global"]:
        assert abs(got["global"][mode]["acc"] - final["global"][mode]["acc"]) <= 1.0 / n_test + 1e-9
    for mode in final["personal"]:
        for a, b, cl in zip(got["personal"][mode]["per_client"], final["personal"][mode]["per_client"],
                            sim.fed.clients):
            assert abs(a - b) <= 1.0 / len(cl.test_y) + 1e-4, (mode, a, b)
        print(f"\n{method} PM {mode}: deployed, killed and resumed {got['personal'][mode]['acc']:.4f}, "
              f"simulation {final['personal'][mode]['acc']:.4f}")
