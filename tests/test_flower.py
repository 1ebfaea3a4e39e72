"""The Flower engine in one process (no SuperLink, no Ray, no network): the unmodified fedlt ServerApp logic and
ClientApp over an in-process grid must reproduce the simulation engine, keep client state on the clients,
survive failing and silent clients, and serve a client's own data directory."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from conftest import _FEDS, method_test_params, run_small, small_config  # noqa: E402
from fedlt.core.method import Message  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.runner.rundir import federation_for  # noqa: E402
from fedlt.codec import pack, unpack  # noqa: E402
from fedlt.flower.inprocess import InProcessGrid, run_inprocess, server_identity  # noqa: E402
from fedlt.engine.flower.records import CSTATE_ARRAYS, from_records, to_records  # noqa: E402
from fedlt.flower.settings import flatten, from_run_config, to_run_config  # noqa: E402
from fedlt.flower.strategy import FedltStrategy  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402

QUIET = dict(echo=lambda s: None)
# the same code paths, seconds less: a shorter SSE-C construction, fewer personalisation / re-training steps
FAST = {"fedloge": {"sse_steps": 200}, "fedetf": {"pers_rounds": 2}, "creff": {"match_epochs": 5, "crt_epochs": 10},
        **{m: method_test_params(m) for m in ("ccvr", "fedic", "rucr", "clip2fl", "fedgpa", "fedcrac", "dfl-fs")}}


def _fed(cfg):
    key = (cfg.dataset, cfg.imbalance_ratio, cfg.alpha, cfg.clients, cfg.partition, cfg.seed)
    if key not in _FEDS:
        _FEDS[key] = federation_for(cfg)
    return _FEDS[key]


def _same_evaluation(a: dict, b: dict, fed) -> None:
    """GM identical (same server code, same test batches); PM per client within one test sample (the clients
    compute their own test features in other batch shapes than the simulation's shared features)."""
    assert a["global"].keys() == b["global"].keys()
    for mode in a["global"]:
        assert a["global"][mode]["acc"] == b["global"][mode]["acc"], mode
    assert a["personal"].keys() == b["personal"].keys()
    sizes = [len(c.test_y) for c in fed.clients if len(c.test_y)]
    for mode in a["personal"]:
        pa, pb = a["personal"][mode], b["personal"][mode]
        assert pa["source"] == pb["source"]
        for x, y, n in zip(pa["per_client"], pb["per_client"], sizes):
            assert abs(x - y) <= 1.0 / n + 1e-4, (mode, x, y)


def _max_weight_diff(s1: dict, s2: dict) -> float:
    w1, w2 = s1["weights"], s2["weights"]
    assert w1.keys() == w2.keys()
    return max(float((w1[k].double() - w2[k].double()).abs().max()) for k in w1)


# ------------------------------------------------------------------------------------------- encoding
def test_codec_roundtrip_keeps_types_and_bits():
    tree = {"w": torch.randn(3, 4), "n": torch.tensor(7), "mask": torch.tensor([True, False]),
            "counts": np.arange(5, dtype=np.int64), "t": (1, 2.5, "x"), "by_class": {3: [1.0, None]},
            "nested": {"a": {"b": torch.arange(3, dtype=torch.int32)}}, "nan": float("nan"), "inf": -math.inf,
            "flag": True, "__odd": 1, "np_scalar": np.float32(0.5)}
    skeleton, arrays = pack(tree)
    back = unpack(skeleton, {k: v.clone() for k, v in arrays.items()})
    assert torch.equal(back["w"], tree["w"]) and back["w"].dtype == torch.float32
    assert back["n"].dtype == torch.int64 and int(back["n"]) == 7
    assert back["mask"].dtype == torch.bool and back["mask"].tolist() == [True, False]
    assert isinstance(back["counts"], np.ndarray) and back["counts"].tolist() == list(range(5))
    assert back["t"] == (1, 2.5, "x") and isinstance(back["t"], tuple)
    assert back["by_class"] == {3: [1.0, None]}
    assert back["nested"]["a"]["b"].dtype == torch.int32
    assert math.isnan(back["nan"]) and back["inf"] == -math.inf and back["flag"] is True
    assert back["__odd"] == 1 and back["np_scalar"] == 0.5
    with pytest.raises(ConfigError, match="/model"):
        pack({"model": torch.nn.Linear(2, 2)}, "client state")


def test_message_records_roundtrip():
    msg = Message({"head.weight": torch.randn(10, 4), "counts": torch.arange(10)},
                  {"num_examples": 12, "loss": 0.25, "classes": [1, 3], "proto": torch.ones(2)})
    rd = to_records(msg, {"round": 3})
    back = from_records(rd)
    assert all(torch.equal(back.arrays[k], msg.arrays[k]) for k in msg.arrays)
    assert back.meta["classes"] == [1, 3] and torch.equal(back.meta["proto"], torch.ones(2))
    assert rd["metrics"]["num-examples"] == 12 and rd["fedlt"]["round"] == 3


def test_run_config_roundtrip_and_app_dir(tmp_path):
    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.config_utils import load_and_validate
    from flwr.common.config import flatten_dict

    from fedlt.flower.deploy import write_app

    cfg = small_config(method="fedprox", params={"mu": 0.1}, out=str(tmp_path / "runs"), name="x")
    flat = flatten(to_run_config(cfg, round_timeout=30))
    back, opts = from_run_config(flat)
    assert back == cfg and opts["round-timeout"] == 30.0
    with pytest.raises(ConfigError, match="unknown run setting"):
        from_run_config({**flat, "no-such": 1})
    write_app(tmp_path / "app", cfg, round_timeout=30)
    conf, _ = load_and_validate(tmp_path / "app" / "pyproject.toml", check_module=True)  # Flower's own check
    again, _ = from_run_config(flatten_dict(conf["tool"]["flwr"]["app"]["config"]))
    assert again == cfg
    assert len(build_fab_from_disk(tmp_path / "app")) > 0


def test_process_command_lines():
    from flwr.common.config import parse_config_args

    from fedlt.flower.deploy import superlink_argv, supernode_argv

    with pytest.raises(ConfigError, match="TLS"):
        superlink_argv()
    with pytest.raises(ConfigError, match="needs TLS"):
        superlink_argv(insecure=True, supernode_auth=True)
    sl = superlink_argv(port=1234, insecure=True)
    assert "--disable-runtime-dependency-installation" in sl and sl[sl.index("--host") + 1] == "127.0.0.1"
    with pytest.raises(ConfigError, match="either"):
        supernode_argv("127.0.0.1:1")
    sn = supernode_argv("127.0.0.1:1", partition_id=3, state_dir="/tmp/x y", insecure=True)
    nc = parse_config_args([sn[sn.index("--node-config") + 1]])  # how flower-supernode reads it
    assert nc == {"partition-id": 3, "state-dir": "/tmp/x y"} and sn[sn.index("--port") + 1] == str(9094 + 3)


# ------------------------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("method,participation", [("fedavg", 1.0), ("fedloge", 1.0), ("fedprox", 0.5)])
def test_flower_inprocess_equals_simulation(tmp_path, method, participation):
    import json

    params = FAST.get(method, {})
    over = dict(rounds=2, eval_every=1, participation=participation)
    sim, final = run_small(method, params, **over)
    cfg = small_config(method=method, params=params, out=str(tmp_path), name="fl", **over)
    st, grid, summary = run_inprocess(cfg, **QUIET)
    assert _max_weight_diff(sim.state, st.state) <= 1e-6
    for h_sim, h_fl in zip(sim.history, st.history):
        assert h_sim["clients"] == h_fl["clients"] and h_fl["missing"] == []
        assert h_sim["train_loss"] == pytest.approx(h_fl["train_loss"], rel=1e-6)
        assert h_sim["bytes_down_per_client"] == h_fl["bytes_down_per_client"]
        _same_evaluation(h_sim["eval"], h_fl["eval"], sim.fed)
    _same_evaluation(final, summary["final"], sim.fed)
    run = tmp_path / "fl"
    for f in ("config.json", "partition.json", "metrics.jsonl", "summary.json"):
        assert (run / f).is_file(), f
    part = json.loads((run / "partition.json").read_text())
    assert np.array_equal(part["client_class_counts"], sim.fed.counts)
    assert part["client_test_sizes"] == [len(c.test_y) for c in sim.fed.clients]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in lines if "phase" in r] == list(sim.method.phases)
    assert json.loads((run / "config.json").read_text())["engine"] == "flower"


def test_flower_strategy_start_equals_simulation():
    """Flower's own round loop (Strategy.start) over the fedlt strategy: same weights, same PM every round."""
    from flwr.app import ArrayRecord

    over = dict(method="fedprox", rounds=2, eval_every=1, participation=0.5)
    cfg = small_config(**over)
    st = FedltStrategy(cfg, **QUIET)
    grid = InProcessGrid([{"partition-id": i} for i in range(cfg.clients)])
    with server_identity():
        result = st.start(grid, ArrayRecord(), num_rounds=cfg.rounds)
    sim, _ = run_small(**over)
    assert _max_weight_diff(sim.state, st.state) <= 1e-6
    for rnd, h in enumerate(sim.history, 1):
        assert result.evaluate_metrics_clientapp[rnd]["PM"] == pytest.approx(h["eval"]["personal"]["global"]["acc"],
                                                                             abs=0.02)


@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_runs_on_flower(tmp_path, method):
    """One round of every registered method through the Flower apps equals the simulation."""
    over = dict(rounds=1, eval_every=1, clients=4, participation=0.5, local_epochs=1)
    cfg = small_config(method=method, params=FAST.get(method, {}), out=str(tmp_path), name="fl", **over)
    if getattr(METHODS.get(method), "needs_pool", False):
        with pytest.raises(ConfigError, match="pooled"):
            run_inprocess(cfg, **QUIET)
        return
    sim, final = run_small(method, FAST.get(method, {}), **over)
    st, _, summary = run_inprocess(cfg, **QUIET)
    if "weights" in sim.state:
        assert _max_weight_diff(sim.state, st.state) <= 1e-6
    _same_evaluation(final, summary["final"], sim.fed)


# ------------------------------------------------------------------------------------------- client state
def test_client_state_stays_on_the_client(tmp_path):
    cfg = small_config(method="fedloge", params=FAST["fedloge"], rounds=2, eval_every=2, participation=1.0,
                       out=str(tmp_path), name="fl")
    st, grid, _ = run_inprocess(cfg, **QUIET)
    local = set()
    for ctx in grid.contexts.values():
        local |= set(ctx.state[CSTATE_ARRAYS].keys())
    assert local  # the personal heads (and realigned heads) are there...
    for msg in grid.delivered + grid.replied:  # ...and in no message, either way
        if msg.has_content():
            for name, rec in msg.content.items():
                if hasattr(rec, "to_torch_state_dict"):
                    assert not (set(rec.keys()) & local), (msg.metadata.message_type, name)


def _restart_run(tmp_path, state_dir):
    """FedLoGe over 2 clients; client 0's SuperNode restarts (new node id, empty context) before round 2."""
    cfg = small_config(method="fedloge", params=FAST["fedloge"], clients=2, rounds=3, eval_every=3,
                       participation=1.0, out=str(tmp_path), name=f"fl-{state_dir is not None}")
    nodes = [{"partition-id": i, **({"state-dir": str(state_dir)} if state_dir else {})} for i in range(2)]
    grid = InProcessGrid(nodes)
    st = FedltStrategy(cfg, **QUIET)
    train_round = st.driver.train_round

    def restarting():
        if st.driver.round + 1 == 2:
            grid.restart(st.nodes[0])
        return train_round()

    st.driver.train_round = restarting
    with server_identity():
        st.run(grid)
    return st, grid


def test_state_dir_survives_supernode_restart(tmp_path):
    sim, _ = run_small("fedloge", FAST["fedloge"], clients=2, rounds=3, eval_every=3, participation=1.0)
    st, grid = _restart_run(tmp_path, tmp_path / "state")
    assert st.nodes[0] >= 102  # the restarted SuperNode was found and described again
    ctx = grid.contexts[st.nodes[0]]
    from fedlt.engine.flower.records import load_client_state

    kept, _ = load_client_state(ctx.state, 0)
    assert torch.equal(kept["phi.weight"], sim.client_states[0]["phi.weight"])
    assert _max_weight_diff(sim.state, st.state) <= 1e-6
    # without a state directory the restart loses phi_0 (the test above can fail): the client says so in one
    # line and is recorded missing, where it used to train a fresh phi_0 silently
    st2, grid2 = _restart_run(tmp_path, None)
    assert load_client_state(grid2.contexts[st2.nodes[0]].state, 0) == (None, None)
    assert st2.driver.missing["round 2"] == [0] and st2.driver.missing["round 3"] == [0]
    why = [h for h in st2.driver.history if h["round"] == 2][0]["missing_why"]["0"]
    assert "client 0 has lost its state of round 1" in why and "--state-dir" in why


# ------------------------------------------------------------------------------------------- faults
def test_failing_and_silent_clients_do_not_end_the_run(tmp_path):
    import json

    cfg = small_config(method="fedavg", clients=3, rounds=3, eval_every=3, participation=1.0, out=str(tmp_path),
                       name="fl")

    def fault(msg, node):  # node 100 + k serves client k
        rnd = msg.metadata.group_id
        if msg.metadata.message_type == "train" and rnd == "2" and node == 101:
            return "fail"
        if msg.metadata.message_type == "train" and rnd == "3" and node == 102:
            return "silent"
        return None

    grid = InProcessGrid([{"partition-id": i} for i in range(3)], fault=fault)
    st = FedltStrategy(cfg, round_timeout=0.5, poll_interval=0.05, **QUIET)
    seen = {}
    aggregate = st.method.aggregate

    def spy(state, rnd, replies):
        seen[rnd] = [cid for cid, _ in replies]
        return aggregate(state, rnd, replies)

    st.method.aggregate = spy
    with server_identity():
        summary = st.run(grid)
    assert seen == {1: [0, 1, 2], 2: [0, 2], 3: [0, 1]}
    recs = [json.loads(x) for x in (tmp_path / "fl" / "metrics.jsonl").read_text().splitlines()]
    rounds = {r["round"]: r for r in recs if "round" in r}
    assert rounds[1]["missing"] == [] and rounds[2]["missing"] == [1] and rounds[3]["missing"] == [2]
    assert "RuntimeError" in rounds[2]["missing_why"]["1"] and "no reply" in rounds[3]["missing_why"]["2"]
    assert summary["missing"] == {"round 2": [1], "round 3": [2]}  # the evaluation after round 3 had everyone
    assert summary["final"]["global"]["global"]["acc"] > 0


# ------------------------------------------------------------------------------------------- real-use data
def test_client_data_directory_equals_partition(tmp_path):
    over = dict(method="fedloge", params=FAST["fedloge"], clients=3, rounds=2, eval_every=2, participation=1.0)
    cfg = small_config(out=str(tmp_path), name="part", **over)
    fed = _fed(cfg)
    nodes = []
    for c in fed.clients:
        d = tmp_path / f"client{c.client_id}"
        d.mkdir()
        np.savez(d / "train.npz", x=c.x.numpy(), y=c.y.numpy())
        np.savez(d / "test.npz", x=c.test_x.numpy(), y=c.test_y.numpy())
        nodes.append({"data-dir": str(d), "client-id": c.client_id})
    st_p, _, s_p = run_inprocess(cfg, **QUIET)
    st_d, _, s_d = run_inprocess(small_config(out=str(tmp_path), name="dirs", **over), node_configs=nodes, **QUIET)
    assert _max_weight_diff(st_p.state, st_d.state) <= 1e-5  # same samples; tensor strides may differ
    _same_evaluation(s_p["final"], s_d["final"], fed)
    bad = tmp_path / "bad"
    bad.mkdir()
    np.savez(bad / "train.npz", x=np.zeros((4, 1, 5, 5), np.uint8), y=np.zeros(4, np.int64))
    with pytest.raises(ConfigError, match="only 0 of 1"):  # the node's error reply: it never joins
        run_inprocess(small_config(out=str(tmp_path), name="bad", **{**over, "clients": 1}),
                      node_configs=[{"data-dir": str(bad), "client-id": 0}], wait_timeout=0.5, **QUIET)


def test_a_diverging_flower_run_stops_with_exit_3_like_the_simulation(tmp_path, capsys):
    """The simulation's divergence check runs in the Flower strategy too: the same round, the same exit status
    and a summary that says diverged."""
    import json

    from fedlt.cli import main as cli_main

    args = ["--method", "fedavg", "--dataset", "digits", "--rho", "10", "--clients", "4", "--alpha", "1",
            "--lr", "50", "--rounds", "4", "--eval-every", "1", "--local-epochs", "1", "--diverge-factor", "100",
            "--threads", "1", "--out", str(tmp_path)]
    assert cli_main(["run", *args, "--no-progress", "--name", "sim"]) == 3
    sim_err = capsys.readouterr().err.strip()
    assert cli_main(["flower", "inprocess", *args, "--name", "fl"]) == 3
    fl_err = capsys.readouterr().err.strip()
    assert len(fl_err.splitlines()) == 1 and "diverged in round" in fl_err, fl_err
    sim, fl = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("sim", "fl"))
    assert fl["status"] == "diverged" and fl["diverged"]["round"] == sim["diverged"]["round"]
    assert sim_err.split(" -- ")[0].split(": ", 1)[1] == fl_err.split(" -- ")[0].split(": ", 1)[1]


# ------------------------------------------------------------------------------------------- resume
def test_a_restarted_supernodes_copy_is_awaited_though_the_dead_nodes_copy_fails(monkeypatch):
    """A SuperNode killed mid-round and restarted is sent the round's message again. The SuperLink later fails
    the first copy (the dead node's heartbeat stopped): that error must not record the client missing while the
    copy re-sent is still on its way; a node that never comes back is still recorded missing with its error."""
    from types import SimpleNamespace

    import fedlt.engine.flower.transport as strategy
    from flwr.app import ConfigRecord, Message as FlwrMessage, RecordDict

    monkeypatch.setattr(strategy, "RESTART_LOOK", 0.0)

    class Grid:
        def __init__(self, back: bool):
            self.pushed, self.back, self.pulls = [], back, 0

        def push_messages(self, msgs):
            self.pushed += [m.metadata.dst_node_id for m in msgs]
            return [f"m{len(self.pushed) - len(msgs) + i}" for i in range(len(msgs))]

        def pull_messages(self, ids):
            self.pulls += 1
            if "m0" in ids and (len(self.pushed) > 1 or not self.back):  # the dead node's copy fails
                err = SimpleNamespace(code=5, reason="Node Unavailable")
                return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m0"), error=err,
                                        has_error=lambda: True, content=None)]
            if "m1" in ids and self.pulls > 3:
                return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"), error=None,
                                        has_error=lambda: False, content="trained")]
            return []

    for back in (True, False):
        grid = Grid(back)
        st = SimpleNamespace(nodes={0: 10}, poll_interval=0.0, echo=lambda s: None)
        st.connect = lambda g, wait=False: st.nodes.update({0: 20} if back and g.pulls > 1 else {})
        with server_identity():
            msg = FlwrMessage(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=10, message_type="train",
                              group_id="2", ttl=60.0)
            got, why = FedltStrategy.exchange(st, grid, {0: msg}, timeout=5.0)
        if back:
            assert grid.pushed == [10, 20] and got == {0: "trained"} and why == {}, (got, why)
        else:
            assert grid.pushed == [10] and got == {} and why == {0: "error 5: Node Unavailable"}, why


# the child's rounds are slowed down, not changed, so that the signal lands mid-run whatever the machine's load
SLOW_ROUNDS = ("import time\nimport fedlt.engine.driver as D\norig = D.Driver.train_round\n"
               "def slow(self):\n    time.sleep(0.3)\n    return orig(self)\nD.Driver.train_round = slow\n")


def test_a_stopped_flower_run_resumes_to_the_metrics_of_an_uninterrupted_one(tmp_path):
    """`fedlt flower inprocess` (a checkpoint after every round by default) stopped by SIGTERM in its own process
    after round r, then `--resume` in a new process (the SuperNodes' memory is gone with it): the checkpoint
    brings back the server state, the history and the clients' personal heads, and the run ends exactly as an
    uninterrupted one. FedLoGe: its clients' state (phi_k) decides PM."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from fedlt.cli import main as cli_main
    from fedlt.runner.runstate import CHECKPOINT

    args = ["flower", "inprocess", "--method", "fedloge", "--set", "sse_steps=200", "--dataset", "digits", "--rho",
            "10", "--clients", "3", "--alpha", "1", "--rounds", "5", "--eval-every", "1", "--local-epochs", "1",
            "--threads", "1", "--out", str(tmp_path)]
    assert cli_main([*args, "--name", "whole"]) == 0
    site = tmp_path / "slow-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_ROUNDS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FEDLT_TENSORBOARD": "0",
           "PYTHONPATH": os.pathsep.join(x for x in (str(site), os.environ.get("PYTHONPATH")) if x)}
    child = subprocess.Popen([sys.executable, "-m", "fedlt", *args, "--name", "cut"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    metrics, deadline = tmp_path / "cut" / "metrics.jsonl", time.time() + 120
    while child.poll() is None and time.time() < deadline and \
            sum('"round"' in x for x in (metrics.read_text().splitlines() if metrics.exists() else [])) < 2:
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 143 and "stopped by SIGTERM" in err and len(err.splitlines()) == 1, (out, err)
    assert (tmp_path / "cut" / CHECKPOINT).is_file() and not (tmp_path / "cut" / "summary.json").exists()
    assert cli_main([*args, "--name", "cut", "--resume"]) == 0
    want, got = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("whole", "cut"))
    assert got["status"] == "finished" and 2 <= got["resumed_after_round"] < 5
    assert got["last3"] == want["last3"]
    strip = lambda ev: {k: v for k, v in ev.items() if k != "eval_time"}  # noqa: E731
    assert strip(got["final"]) == strip(want["final"])
    recs = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in recs if "round" in r] == [1, 2, 3, 4, 5]  # none lost, none twice
    full = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [strip(r["eval"]) for r in recs if "eval" in r] == [strip(r["eval"]) for r in full if "eval" in r]
    assert not (tmp_path / "cut" / CHECKPOINT).exists()  # a finished run keeps no checkpoint


@pytest.mark.parametrize("method", ["ditto", "fedloge"])
def test_a_resumed_deployment_rolls_every_client_back_to_the_checkpointed_round(tmp_path, method):
    """A deployment's resume in one process: the server cannot see the clients' states (``remote``), which stay
    in each SuperNode's state-dir. The run checkpoints every 2 rounds and is stopped in round 6, after some
    clients trained round 5 and round 6: resumed from round 4 in a new Flower run (the nodes' memory is gone),
    every client takes its state of round 4 or earlier, not its newer one, and the run ends exactly as an
    uninterrupted one: server weights, GM and PM per client, and every client's final state."""
    import signal

    from fedlt.runner.preempt import Preempted
    from fedlt.engine.flower.records import load_client_state

    params = FAST.get(method, {})
    over = dict(clients=3, rounds=6, eval_every=3, participation=2, local_epochs=1)
    sim, final = run_small(method, params, **over)
    cfg = small_config(method=method, params=params, out=str(tmp_path), name="dep", **over)
    nodes = [{"partition-id": i, "state-dir": str(tmp_path / f"state{i}")} for i in range(3)]
    trained = []

    def stop_in_round_6(msg, node):
        if msg.metadata.message_type == "train":
            trained.append(int(msg.metadata.group_id))
            if trained.count(6) == 2:  # the second client of round 6: one has trained it already
                raise Preempted(signal.SIGTERM)
        return None

    first = InProcessGrid(nodes, fault=stop_in_round_6, remote=True)
    with pytest.raises(Preempted):
        with server_identity():
            FedltStrategy(cfg, **QUIET).run(first, checkpoint_every=2)
    run = next((tmp_path / "state0").iterdir()).name
    ahead = {i: load_client_state(None, i, tmp_path / f"state{i}", run[4:])[1] for i in range(3)}
    assert max(t for t in ahead.values() if t) > 4  # states of rounds the checkpoint (round 4) did not reach
    again = InProcessGrid(nodes, run_id=2, remote=True)  # a new Flower run, the nodes' memory empty
    st = FedltStrategy(cfg, **QUIET)
    with server_identity():
        summary = st.run(again, checkpoint_every=2, resume=True)
    assert summary["resumed_after_round"] == 4 and st.transport.run == run[4:]
    assert _max_weight_diff(sim.state, st.state) <= 1e-6
    _same_evaluation(summary["final"], final, _fed(cfg))
    for cid in range(3):
        got, tag = load_client_state(None, cid, tmp_path / f"state{cid}", st.transport.run)
        want = sim.client_states[cid] if cid in sim.client_states else None
        if want is None:
            continue
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert torch.allclose(got[k], v, atol=1e-6), (cid, k)


def test_app_directories_written_before_the_apps_moved_still_run(tmp_path):
    """``fedlt flower app`` wrote ``fedlt.flower.server_app:app`` / ``client_app:app`` into an app directory's
    pyproject.toml, then ``fedlt.engine.flower.*`` while the apps lived in the engine: such a directory passes
    Flower's own check (which reads the attribute from the module's file with ``ast``) and its components load
    as the very apps of today's (``fedlt.moved``); so does every other module path of the old place."""
    import importlib

    from flwr.cli.config_utils import load_and_validate
    from flwr.supercore.object_ref import load_app

    from fedlt.flower.deploy import write_app

    write_app(tmp_path / "app", small_config(out=str(tmp_path / "runs")))
    toml = tmp_path / "app" / "pyproject.toml"
    assert '"fedlt.flower.server_app:app"' in toml.read_text()
    toml.write_text(toml.read_text().replace('"fedlt.flower.', '"fedlt.engine.flower.'))
    conf, errors = load_and_validate(toml, check_module=True)
    assert conf is not None, errors
    components = conf["tool"]["flwr"]["app"]["components"]
    for part in ("server_app", "client_app"):
        ref = components[part.replace("_", "")]
        assert ref == f"fedlt.engine.flower.{part}:app"
        assert load_app(ref, ValueError, tmp_path / "app") is importlib.import_module(f"fedlt.flower.{part}").app
    for part in ("strategy", "simulation", "deploy", "settings", "inprocess"):
        assert importlib.import_module(f"fedlt.engine.flower.{part}") is importlib.import_module(f"fedlt.flower.{part}")
    assert importlib.import_module("fedlt.engine.flower.strategy").FedltStrategy.run


# ------------------------------------------------------------------------------------------- exchanges per round
def test_a_rounds_evaluation_rides_in_the_next_rounds_training_messages(tmp_path):
    """FedAvg (PM with the global model) evaluated every round: round r's PM goes with round r+1's training message
    (``train.evaluate``), so a round costs one exchange and only the last round's evaluation has its own, and the run
    records what the simulation does; a personalized method (Ditto: PM reads the client state) keeps its own
    evaluation exchange every round."""
    import json

    over = dict(rounds=3, eval_every=1, participation=1.0)
    sim, final = run_small("fedavg", {}, **over)
    cfg = small_config(method="fedavg", out=str(tmp_path), name="fl", **over)
    st, grid, summary = run_inprocess(cfg, **QUIET)
    kinds = [m.metadata.message_type for m in grid.delivered]
    K = cfg.clients
    assert kinds.count("train.evaluate") == 2 * K and kinds.count("train") == K and kinds.count("evaluate") == K
    for h_sim, h_fl in zip(sim.history, st.history, strict=True):
        assert h_sim["round"] == h_fl["round"]
        _same_evaluation(h_sim["eval"], h_fl["eval"], sim.fed)
    _same_evaluation(final, summary["final"], sim.fed)
    rounds = [json.loads(x)["round"] for x in (tmp_path / "fl" / "metrics.jsonl").read_text().splitlines()
              if '"round"' in x]
    assert rounds == [1, 2, 3]
    cfg = small_config(method="ditto", params=method_test_params("ditto"), out=str(tmp_path), name="ditto",
                       rounds=2, eval_every=1, participation=1.0)
    _, grid, _ = run_inprocess(cfg, **QUIET)
    kinds = [m.metadata.message_type for m in grid.delivered]
    assert "train.evaluate" not in kinds and kinds.count("evaluate") >= 2 * cfg.clients


def test_a_run_stopped_while_a_rounds_evaluation_rides_resumes_to_the_same_metrics(tmp_path):
    """The checkpoint of a round whose PM rides in the next round's messages keeps that round's record without
    PM; a run stopped before the next round resumes, sends that PM with it and ends as an uninterrupted run."""
    import json

    over = dict(rounds=3, eval_every=1, participation=1.0)
    run_inprocess(small_config(method="fedavg", out=str(tmp_path), name="whole", **over), **QUIET)

    def stop_at_round_3(msg, node):
        if msg.metadata.message_type.startswith("train") and msg.metadata.group_id == "3":
            raise KeyboardInterrupt  # the process stops after round 2's checkpoint
        return None

    cfg = small_config(method="fedavg", out=str(tmp_path), name="cut", **over)
    with pytest.raises(KeyboardInterrupt):
        run_inprocess(cfg, fault=stop_at_round_3, **QUIET)
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1]  # round 2 waits for its PM
    _, _, summary = run_inprocess(cfg, resume=True, **QUIET)
    assert summary["resumed_after_round"] == 2
    strip = lambda r: {k: v for k, v in r.items() if k not in ("round_time", "eval_time")}  # noqa: E731
    got, want = ([strip({**r, "eval": strip(r["eval"])}) for r in map(json.loads, (tmp_path / n / "metrics.jsonl")
                  .read_text().splitlines()) if "round" in r] for n in ("cut", "whole"))
    assert got == want


def test_fedlts_cpu_sgd_is_torchs_bit_for_bit():
    """core.training.SGD (what make_optimizer gives on the CPU, so that a SuperNode's process, started per message,
    does not import torch._dynamo for it) steps as torch.optim.SGD does: the same weights and momentum buffers bit
    for bit, with momentum, weight decay and parameter groups, and a torch SGD's state dict loads into it."""
    from fedlt.core.training import SGD

    torch.manual_seed(0)
    w = [torch.randn(30, 10), torch.randn(10)]
    ours, theirs = ([t.clone().requires_grad_(True) for t in w] for _ in range(2))

    def groups(ps):
        return [{"params": [ps[0]], "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
                {"params": [ps[1]], "lr": 0.05, "momentum": 0.5, "weight_decay": 0.0}]

    a, b = SGD(groups(ours), lr=0.1), torch.optim.SGD(groups(theirs), lr=0.1)
    for step in range(6):
        x = torch.randn(8, 30)
        for ps, opt in ((ours, a), (theirs, b)):
            opt.zero_grad(set_to_none=True)
            ((x @ ps[0] + ps[1]).tanh().square().mean()).backward()
            opt.step()
        if step == 2:  # a torch SGD's state carried into ours (a method that keeps its optimiser's state)
            a.load_state_dict(b.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    assert all(torch.equal(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"]) for p, q in zip(ours, theirs))


def test_a_flower_clients_training_imports_no_torch_dynamo():
    """A Flower client's training and evaluation (in process, with the server) run without torch._dynamo, which
    torch.optim.SGD's construction imports (about 1 s for each SuperNode process, started per message)."""
    import subprocess
    import sys

    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import small_config; import tempfile\n"
            "from fedlt.flower.inprocess import run_inprocess\n"
            "with tempfile.TemporaryDirectory() as d:\n"
            "    run_inprocess(small_config(method='fedavg', out=d, name='x', rounds=2), echo=lambda *a: None)\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"
