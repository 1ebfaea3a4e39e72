"""The client-state store (fedlt.engine.clientstate): states exist for the clients that trained, spill to disk
beyond a memory budget and come back bit for bit, checkpoints are incremental, a killed run resumes exactly, and
a damaged state file stops the run with one line naming the client."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlt.runner import rundir
from fedlt.core.method import Method
from fedlt.engine import EngineConfig, Simulation
from fedlt.engine.clientstate import ClientStates, state_name
from fedlt.data.partition import partition_settings
from fedlt.data import build_federation
from fedlt.engine.driver import client_generator
from fedlt.seeds import Purpose
from fedlt.errors import ConfigError
from fedlt.runner.rundir import federation_for, prepare
from fedlt.registry import METHODS
from fedlt.safefile import load_tree

from conftest import dies_in_round, method_test_params, small_config

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _state(g: torch.Generator) -> dict:
    return {"w": torch.randn(4, 3, generator=g), "t": (1, 2.5, "x"), 3: np.arange(4), "n": None,
            "half": torch.randn(5, generator=g).to(torch.bfloat16)}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------------------------------------- the store
def test_store_keeps_its_budget_spills_the_least_recently_used_and_reads_them_back_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(0)
    states = {c: _state(g) for c in range(6)}
    one = 4 * 3 * 4 + 4 * 8 + 5 * 2 + 64  # bytes of one state's arrays, and what a state costs beyond them
    store = ClientStates(budget=2 * one, directory=tmp_path)
    for c, s in states.items():
        store.tag = 10 + c
        store[c] = s
        assert store.memory <= 2 * one
    assert store.spilled == 4 and sorted(store) == list(range(6)) and len(store) == 6
    assert sorted(os.listdir(tmp_path)) == sorted(state_name(c, 10 + c) for c in range(4))
    for c in range(6):  # the spilled ones come back as they were, with their round tag
        assert _same(store[c], states[c]) and store.tag_of(c) == 10 + c
    store.tag = 20
    store[0] = states[5]  # a new version replaces the old file (no checkpoint refers to it)
    store.commit()
    assert state_name(0, 10) not in os.listdir(tmp_path) and state_name(0, 20) in os.listdir(tmp_path)
    assert "1" not in {str(k) for k in ClientStates()}  # a new store holds nobody


def test_checkpoints_are_incremental_and_a_restored_store_reads_its_states_lazily(tmp_path):
    g = torch.Generator().manual_seed(1)
    store = ClientStates(directory=tmp_path)
    written = []
    for rnd in range(1, 5):  # 2 clients change per round out of 50 that have trained once
        store.tag = rnd
        for c in ([*range(50)] if rnd == 1 else [rnd, rnd + 10]):
            store[c] = {"w": torch.randn(64, generator=g)}
        before = store.written_bytes
        index = store.commit()
        written.append(store.written_bytes - before)
    assert written[1] == written[2] == written[3] < written[0] / 20  # the changed clients only
    # the kept checkpoints' versions stay on disk (the newest ones and those a previous checkpoint refers to)
    assert {state_name(3, 1), state_name(3, 3)} <= set(os.listdir(tmp_path))
    fresh = ClientStates(directory=tmp_path)
    fresh.restore(index)
    assert fresh.memory == 0 and fresh.tag_of(4) == 4 and fresh.tag_of(5) == 1
    assert torch.equal(fresh[4]["w"], store[4]["w"]) and torch.equal(fresh[49]["w"], store[49]["w"])


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_a_damaged_state_file_is_a_one_line_error_naming_the_client(tmp_path, damage):
    store = ClientStates(budget=0, directory=tmp_path)
    store.tag = 3
    store[7] = {"w": torch.ones(100)}
    index = store.commit()
    path = tmp_path / state_name(7, 3)
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:50])
    elif damage == "garbage":
        path.write_bytes(b"\0" * 300)
    else:
        path.unlink()
    fresh = ClientStates(directory=tmp_path)
    fresh.restore(index)
    with pytest.raises(ConfigError) as e:
        fresh[7]
    msg = str(e.value)
    assert "client 7's state" in msg and "\n" not in msg


def test_the_settings_of_a_population_are_declared_and_checked():
    """--client-state-memory reads byte sizes; --eval-clients is a fraction or a whole count of the clients;
    --client-test-fraction is in [0, 1); a bad value is one line naming the setting."""
    from fedlt.config import load_config

    cfg = load_config(overrides={"client_state_memory": "1.5GiB", "eval_clients": "500", "clients": 1000,
                                 "client_test_fraction": "0.25"})
    assert (cfg.client_state_memory, cfg.eval_clients, cfg.client_test_fraction) == (int(1.5 * 2**30), 500, 0.25)
    assert EngineConfig.of(cfg).client_state_memory == int(1.5 * 2**30)
    assert load_config().client_state_memory == 2 * 10**9
    for over, words in [({"client_state_memory": "lots"}, "client-state-memory: cannot read 'lots'"),
                        ({"client_state_memory": "-1GB"}, "client-state-memory: cannot read"),
                        ({"eval_clients": 0}, "eval-clients must be > 0"),
                        ({"eval_clients": 2.5}, "eval-clients 2.5 is neither a fraction"),
                        ({"eval_clients": 30, "clients": 10}, "eval-clients 30 clients exceeds the 10 clients"),
                        ({"client_test_fraction": 1}, "client-test-fraction must be in [0, 1)"),
                        ({"synthetic_per_class": 100}, "--synthetic-per-class applies to synthetic, not")]:
        with pytest.raises(ConfigError) as e:
            load_config(overrides=over)
        assert words in str(e.value) and "\n" not in str(e.value), (over, str(e.value))


def test_a_resumed_run_may_change_its_memory_budget_but_not_its_evaluation_sample():
    from fedlt.runner.runstate import config_differences

    base = small_config().to_dict()
    assert config_differences(base, {**base, "client_state_memory": 10**6}) == []
    assert config_differences(base, {**base, "eval_clients": 3.0}) == ["eval_clients: 1.0 -> 3.0"]
    old = {k: v for k, v in base.items() if k not in ("eval_clients", "client_test_fraction")}  # an older run dir
    assert config_differences(old, base) == []


# ---------------------------------------------------------------------------------------------- in runs
_FED: dict = {}
QUICK = dict(rounds=3, eval_every=3, local_epochs=1, participation=0.5)


def _sim(method: str, budget=None, **over) -> Simulation:
    cfg = small_config(method=method, **{**QUICK, "params": method_test_params(method), **over})
    if "fed" not in _FED:
        _FED["fed"] = federation_for(cfg)
    pr = prepare(cfg, _FED["fed"])
    ec = EngineConfig.of(cfg, progress=False)
    if budget is not None:
        ec.client_state_memory = budget
    return Simulation(pr.method, pr.fed, ec)


def _writes_state(name: str) -> bool:
    """Whether a method keeps client state: its init_client returns some, or a client's training or
    post-training phase writes some (one client, one round: a probe, not a run)."""
    sim = _sim(name)
    m, data = sim.method, sim.fed.clients[0]
    if m.init_client(0, data):
        return True
    state = m.init_server()
    reply, cs = m.local_train(m.configure(state, 1, 0), {}, data, client_generator(0, Purpose.TRAIN, 1, 0))
    if cs:
        return True
    state = m.aggregate(state, 1, [(0, reply)])
    for phase in m.phases:  # each phase after the one before it, as the driver runs them
        reply, cs = m.phase_client(phase, m.phase_configure(phase, state, 0), {}, data,
                                   client_generator(0, Purpose.TRAIN, 1, 0))
        if cs:
            return True
        state = m.phase_aggregate(phase, state, [(0, reply)])
    return False


STATEFUL = [name for name in METHODS.names() if _writes_state(name)]


def test_the_stateful_methods_are_found():
    assert {"ditto", "moon", "fedloge", "scaffold", "fedrep", "fedbn", "local"} <= set(STATEFUL)
    assert "fedavg" not in STATEFUL and "fedprox" not in STATEFUL


def _strip(ev):
    return {k: v for k, v in ev.items() if k != "eval_time"}


@pytest.mark.parametrize("method", STATEFUL)
def test_a_run_whose_states_are_spilled_and_read_back_ends_as_one_held_in_memory(method):
    """Budget 0: every state is written out as soon as it is stored and read back whenever its client is needed
    again; the run's every number is the one of the run that keeps them all in memory."""
    held, spilled = _sim(method), _sim(method, budget=0)
    a, b = held.run(), spilled.run()
    assert _strip(a) == _strip(b), method
    assert [h.get("train_loss") for h in held.history] == [h.get("train_loss") for h in spilled.history]
    assert spilled.client_states.spilled > 0 and spilled.client_states.memory == 0
    assert held.client_states.spilled == 0


def test_only_the_clients_that_trained_have_a_state_and_pm_is_over_the_evaluation_sample():
    from fedlt.engine.driver import eval_sample

    sim = _sim("ditto", clients=6, participation=1 / 6, rounds=2, eval_every=2, eval_clients=3)
    assert sim.eval_clients == eval_sample(6, 3, sim.cfg.seed)
    ev = sim.run()
    trained = sorted({c for r in sim.schedule for c in r})
    assert sorted(sim.client_states) == trained and len(trained) <= 2
    assert ev["eval_clients"] == {"sampled": 3, "of": 6}
    assert len(ev["personal"]["personal"]["per_client"]) == 3 - ev["untested"]
    assert eval_sample(6, 6, 0) == list(range(6)) and len(set(eval_sample(1000, 0.05, 0))) == 50


# ---------------------------------------------------------------------------------------------- phases
PHASED = [name for name in METHODS.names() if _sim(name).method.phases]
# phases in which each client personalises its own model (their aggregates take nothing from the replies)
PERSONALISING = {"fedloge", "fedbabu", "feddr+", "dr", "fedetf"}
LIGHTER = {"fedloge": {"finetune_epochs": 1}, "feddr+": {"ft_epochs": 1}, "dr": {"ft_epochs": 1}, "fedetf": {"pers_rounds": 2}}


def test_the_methods_with_phases_are_found():
    assert PERSONALISING | {"ccvr", "rucr"} <= set(PHASED)


@pytest.mark.parametrize("method", PHASED)
def test_post_training_phases_reach_the_clients_that_trained_and_the_evaluation_sample(method):
    """With every client evaluated, a phase reaches every client, as it always did. With a sample, it reaches
    the clients that trained and the sample, and only they get a state; a client outside both that is evaluated
    later is brought through the phases then, and every client's numbers are those of the run whose phases
    reached everyone (for phases whose aggregate takes nothing from the replies: a personalisation)."""
    over = dict(participation=1 / 6, rounds=2, eval_every=2,
                params={**method_test_params(method), **LIGHTER.get(method, {})})
    everyone, sampled = _sim(method, **over), _sim(method, **over, eval_clients=2)
    a, b = everyone.run(), sampled.run()
    assert everyone.phased == set(range(6))
    reached = {c for r in sampled.schedule for c in r} | set(sampled.eval_clients)
    assert sampled.phased == reached and len(reached) < 6
    assert set(sampled.client_states) <= reached
    if method not in PERSONALISING:
        return
    assert a["global"] == b["global"]
    late = sampled.evaluate("later", clients=range(6))  # the 6 - len(reached) others personalised on demand
    assert sampled.phased == set(range(6))
    assert late["personal"] == a["personal"] and late["global"] == a["global"]
    assert late["eval_clients"] == {"sampled": 6, "of": 6}


# ---------------------------------------------------------------------------------------------- kill -9
CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {src!r})
    import fedlt.engine.clientstate as cs
    from fedlt.runner import rundir
    from fedlt.config import RunConfig

    real, seen = cs.save_tree, [0]

    def dying(path, obj, kind, durable=True):
        seen[0] += 1
        if seen[0] == {kill_at}:  # half a state written, then the process is gone
            with open(str(path) + f".{{os.getpid()}}.tmp", "wb") as f:
                f.write(b"half a state")
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, obj, kind, durable)

    cs.save_tree = dying
    cfg = RunConfig(**{cfg!r})
    cfg.client_state_memory = 0
    rundir.run(cfg, progress=False, checkpoint_every=1, echo=lambda *a: None)
""")


def _run_cfg(tmp_path, name):
    cfg = small_config(method="fedloge", **{**QUICK, "rounds": 4, "eval_every": 2}, out=str(tmp_path), name=name,
                       threads=1)
    return cfg


def test_kill_9_during_a_spill_then_resume_ends_as_the_uninterrupted_run(tmp_path):
    ref = rundir.run(_run_cfg(tmp_path, "ref"), progress=False, echo=lambda *a: None)
    cfg = _run_cfg(tmp_path, "killed")
    # 3 clients a round, each state spilled when stored, plus the commit of each round's checkpoint: the 9th
    # write is during round 3, after the checkpoints of rounds 1 and 2
    code = CHILD.format(src=SRC, kill_at=9, cfg=cfg.to_dict())
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, p.stderr[-2000:]
    run_dir = tmp_path / "killed"
    assert (run_dir / "checkpoint.safetensors").is_file() and not (run_dir / "summary.json").exists()
    assert any(n.endswith(".tmp") for n in os.listdir(run_dir / "client-states"))
    out = rundir.run(cfg, progress=False, echo=lambda *a: None, checkpoint_every=1, resume=True)
    assert out["resumed_after_round"] in (1, 2)
    assert _strip(out["final"]) == _strip(ref["final"])
    hist = lambda d: [{k: v for k, v in json.loads(x).items() if "time" not in k}  # noqa: E731
                      for x in (d / "metrics.jsonl").read_text().splitlines()]
    strip_eval = lambda rows: [{k: (_strip(v) if isinstance(v, dict) and "global" in v else v)  # noqa: E731
                                for k, v in r.items()} for r in rows]
    assert strip_eval(hist(run_dir)) == strip_eval(hist(tmp_path / "ref"))
    assert not (run_dir / "client-states").exists()  # a finished run keeps no client state


def test_resuming_with_a_damaged_state_file_stops_with_one_line_naming_the_client(tmp_path):
    cfg = _run_cfg(tmp_path, "damaged")
    code = CHILD.format(src=SRC, kill_at=9, cfg=cfg.to_dict())
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    run_dir = tmp_path / "damaged"
    ck = load_tree(run_dir / "checkpoint.safetensors", "checkpoint")
    cid, tag = min(ck["sim"]["client_states"]["versions"].items())  # a state the checkpoint refers to
    victim = run_dir / "client-states" / state_name(cid, tag)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    argv = ["run", "--method", "fedloge", "--dataset", "digits", "--rho", "10", "--alpha", "1", "--clients", "6",
            "--participation", "0.5", "--rounds", "4", "--eval-every", "2", "--local-epochs", "1",
            "--batch-size", "16", "--lr", "0.05", "--model", "smallcnn", "--out", str(tmp_path),
            "--name", "damaged", "--resume", "--no-progress", "--threads", "1"]
    p = subprocess.run([sys.executable, "-m", "fedlt", *argv], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert p.returncode == 2, p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and f"client {cid}'s state" in err[0], p.stderr


def test_a_checkpoint_of_an_earlier_fedlt_with_every_state_in_it_resumes_into_the_run_directory(tmp_path,
                                                                                                 monkeypatch):
    """Before the store, a checkpoint held every client's state itself and a run directory had no
    client-states/. Such a run resumes: the states it loads are written to client-states/ by the next
    checkpoint (the store once removed that folder before loading them, and the next write failed), and the
    run ends as the uninterrupted one."""
    from fedlt.engine.driver import Driver
    from fedlt.safefile import save_tree

    ref = rundir.run(_run_cfg(tmp_path, "ref"), progress=False, echo=lambda *a: None)
    cfg = _run_cfg(tmp_path, "old")
    with dies_in_round(Driver, 3):
        rundir.run(cfg, progress=False, echo=lambda *a: None, checkpoint_every=1)
    run_dir = tmp_path / "old"
    ck = load_tree(run_dir / "checkpoint.safetensors", "checkpoint")  # rewritten as an earlier fedlt wrote it
    versions = ck["sim"]["client_states"]["versions"]
    assert versions
    ck["sim"]["client_states"] = {str(cid): load_tree(run_dir / "client-states" / state_name(cid, tag), "client-state")
                                  for cid, tag in versions.items()}
    save_tree(run_dir / "checkpoint.safetensors", ck, "checkpoint")
    for f in run_dir.glob("checkpoint.prev*"):
        f.unlink()
    for f in (run_dir / "client-states").iterdir():
        f.unlink()
    (run_dir / "client-states").rmdir()
    out = rundir.run(cfg, progress=False, echo=lambda *a: None, checkpoint_every=1, resume=True)
    assert out["resumed_after_round"] == 2
    assert _strip(out["final"]) == _strip(ref["final"])


# ---------------------------------------------------------------------------------------------- scale
def test_per_client_test_data_from_the_clients_own_samples_leaf_split():
    from fedlt.data.federated import own_test_split

    cfg = small_config(clients=6)
    plain, own = federation_for(cfg), build_federation(
        cfg.dataset, None, cfg.imbalance_ratio, None, 3, None, cfg.partition, cfg.clients, cfg.seed, "cpu",
        partition_settings(cfg.partition, cfg), client_test_fraction=0.25)
    for k in range(6):
        a, b = plain.clients[k], own.clients[k]
        both = np.concatenate([b.train_index, b.test_index])
        assert sorted(both) == sorted(a.train_index)  # the client's samples, split between training and tests
        assert len(b.test_y) == len(a) - max(1, int(0.75 * len(a)))
        assert torch.equal(b.test_y, torch.as_tensor(own.dataset.y_train.numpy()[b.test_index]))
        assert not b.tests_on_test_set
    assert own.counts.sum() == sum(len(c) for c in own.clients) < plain.counts.sum()
    tr, te = own_test_split(np.arange(2), 0.1, 0, 0)
    assert len(tr) == len(te) == 1 and len(own_test_split(np.arange(1), 0.5, 0, 0)[1]) == 0
    cfg_pm = small_config(method="fedrep", rounds=2, eval_every=2, local_epochs=1)
    pr = prepare(cfg_pm, own)
    ev = Simulation(pr.method, pr.fed, EngineConfig.of(cfg_pm, progress=False)).run()
    assert len(ev["personal"]["personal"]["per_client"]) == 6 and ev["untested"] == 0


def test_a_federation_of_many_clients_costs_its_indices_not_a_client_object_each():
    fed = build_federation("synthetic", None, 1.0, "none", 3, None, "iid", 20_000, 0, "cpu", {},
                                      {"n_per_class": 2_000})
    assert len(fed.clients) == 20_000 and len(fed.clients._views) == 0
    c = fed.clients[19_999]
    assert c.client_id == 19_999 and len(c) == 1 and fed.clients[-1] is c
    assert sum(map(len, fed.train_indices())) == 20_000 and len(fed.test_sizes()) == 20_000
