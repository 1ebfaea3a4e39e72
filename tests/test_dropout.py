"""Clients that are away, drop out or straggle (fedlt.engine.faults, issue 34 item 3): the model's draws and
definitions, the driver's bookkeeping (sampled / trained / arrived, the missing records), every family of method
through a round without replies, the engines alike (simulation one by one and batched, Flower in process,
Flower's Ray simulation), kill -9 and --resume, and bad input."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedlt.runner import rundir
from fedlt.cli import main as cli_main
from fedlt.config import load_config
from fedlt.engine import EngineConfig
from fedlt.engine.faults import Faults, availability, scaled_to_mean, tail_scores

from conftest import method_test_params, run_killed, run_small, small_config

SRC = str(Path(__file__).resolve().parents[1] / "src")
COUNTS = np.array([[50, 10, 0], [5, 5, 5], [0, 2, 8], [30, 0, 1], [1, 0, 0], [10, 10, 10]])


def _weights(sim):
    return {k: v.clone() for k, v in sim.state["weights"].items()}


def _same_state(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- definitions
def test_tail_score_is_0_for_the_head_class_1_for_the_rarest_and_orders_clients_by_their_lean():
    f = COUNTS.sum(0)  # 96, 27, 24: class 0 the head, class 2 the rarest
    t = tail_scores(COUNTS)
    assert t[4] == 0.0  # only the head class
    assert t.min() >= 0 and t.max() <= 1
    only_rarest = tail_scores(np.vstack([COUNTS, [0, 0, 1]]))[-1]  # class 2 stays the rarest
    assert only_rarest == pytest.approx(1.0)
    rarity = np.log(f.max() / f) / np.log(f.max() / f.min())
    assert t[1] == pytest.approx(rarity.mean())  # equal counts of every class: the mean rarity
    assert t[2] > t[1] > t[0] > t[4]  # leaning further to the tail
    assert np.allclose(tail_scores(np.ones((3, 4))), 0)  # a balanced set has no tail


def test_profiles_have_the_asked_mean_and_follow_their_weight():
    for profile in ("size", "tail"):
        p = availability(profile, 0.4, COUNTS)
        assert p.mean() == pytest.approx(0.4) and p.max() <= 1 and p.min() >= 0
    size = COUNTS.sum(1)
    p = availability("size", 0.4, COUNTS)
    below = p < 1
    assert np.allclose(p[below] / size[below], (p[below] / size[below])[0])  # proportional where not capped
    t = tail_scores(COUNTS)
    p = availability("tail", 0.4, COUNTS)
    assert np.all(np.diff(p[np.argsort(t)]) <= 1e-12)  # leaning to the tail: online less often
    assert availability("tail", 0.4, COUNTS, skew=0) == pytest.approx(np.full(6, 0.4))
    assert availability("0.3", 0.9, COUNTS) == pytest.approx(np.full(6, 0.3))
    capped = scaled_to_mean(np.array([100.0, 1, 1, 1]), 0.5)  # the capped client raises the others
    assert capped[0] == 1 and capped.mean() == pytest.approx(0.5)


def test_online_clients_are_drawn_with_their_availability_and_only_they_are_sampled():
    f = Faults(availability="tail", availability_mean=0.5)
    p = f.availability_of(COUNTS)
    online = np.zeros(6)
    short = 0
    for rnd in range(1, 4001):
        plan = f.plan(rnd, [0, 1, 2], 3, seed=7, counts_of=lambda: COUNTS)
        assert plan.wanted == 3 and len(plan.sampled) == min(3, plan.online)
        short += plan.online < 3
        online[plan.sampled] += 1
        if plan.online <= 3:  # fewer online than wanted: all of them train
            online_set = set(plan.sampled)
            assert len(online_set) == plan.online
    assert short > 0
    # a client is sampled only when online: its sampling frequency is below its availability, and it follows it
    freq = online / 4000
    assert np.all(freq <= p + 0.03)
    assert np.corrcoef(freq, p)[0, 1] > 0.9


def test_drop_rate_loses_that_share_of_the_sampled_replies_and_keeps_the_sampling():
    f = Faults(drop_rate=0.3)
    lost = total = 0
    for rnd in range(1, 2001):
        base = [1, 3, 4]
        plan = f.plan(rnd, base, 3, seed=0, counts_of=lambda: COUNTS)
        assert plan.sampled == base  # the driver's sampling schedule, untouched
        kept, why, t = f.arrivals(plan, base)
        assert set(kept) | set(why) == set(base) and not set(kept) & set(why) and t is None
        lost += len(why)
        total += 3
    assert lost / total == pytest.approx(0.3, abs=0.02)


def test_deadline_and_over_selection_aggregate_the_first_replies_within_the_deadline():
    speeds = np.array([1.0, 0.5, 2.0, 0.25, 1.0, 4.0])
    f = Faults(speed_sigma=0.0, round_deadline=0.05, over_select=1.5, local_epochs=2)
    f._times = COUNTS.sum(1) * 2 / (1000 * speeds)
    assert f.timed and f.selects
    for rnd in range(1, 50):
        plan = f.plan(rnd, [], 2, seed=3, counts_of=lambda: COUNTS)
        assert len(plan.sampled) == math.ceil(1.5 * 2) and plan.wanted == 2
        kept, why, t = f.arrivals(plan, plan.sampled)
        within = sorted((plan.time[c], c) for c in plan.sampled if plan.time[c] <= 0.05)
        assert kept == sorted(c for _, c in within[:2])  # the first two to arrive within the deadline
        for c, reason in why.items():
            assert ("deadline" in reason) == (plan.time[c] > 0.05)
        assert t == (0.05 if len(kept) < 2 else max(plan.time[c] for c in kept))


def test_straggler_times_are_samples_times_epochs_over_speed(tmp_path):
    path = tmp_path / "speeds.json"
    path.write_text(json.dumps({str(i): s for i, s in enumerate([1, 2, 0.5, 1, 4, 1])}))
    f = Faults(speed_file=str(path), local_epochs=3)
    assert f.times(COUNTS, seed=0) == pytest.approx(COUNTS.sum(1) * 3 / (1000 * np.array([1, 2, 0.5, 1, 4, 1])))
    s = Faults(speed_sigma=0.5).speeds(20000, seed=1)
    assert np.median(s) == pytest.approx(1.0, rel=0.03) and np.log(s).std() == pytest.approx(0.5, rel=0.03)
    assert np.array_equal(s, Faults(speed_sigma=0.5).speeds(20000, seed=1))


# ---------------------------------------------------------------------------------------------- the driver
def test_everything_is_off_by_default_and_a_model_that_loses_nobody_changes_nothing():
    cfg = small_config()
    assert EngineConfig.of(cfg).faults is None
    ref, final = run_small(rounds=3, eval_every=3)
    # the time model drawn (speeds, times), nobody late: the same clients, generators and numbers, bit for bit
    timed, final2 = run_small(rounds=3, eval_every=3, speed_sigma=1.0, round_deadline=1e6)
    assert timed.cfg.faults is not None
    assert [h["clients"] for h in timed.history] == [h["clients"] for h in ref.history] == ref.schedule[:3]
    assert _same_state(_weights(ref), _weights(timed)) and final2["global"] == final["global"]
    assert all(h["sampled"] == h["trained"] == h["arrived"] == 3 for h in ref.history)
    assert all("sim_time" in h and "sim_time" not in r for h, r in zip(timed.history, ref.history))


def test_dropped_replies_are_missing_and_counted_once_in_the_records():
    sim, _ = run_small(rounds=4, eval_every=4, drop_rate=0.5)
    dropped_any = False
    for h in sim.history:
        plan = sim.plans[h["round"]]
        assert h["clients"] == sim.schedule[h["round"] - 1] == plan.sampled
        assert h["missing"] == sorted(plan.dropped)
        assert h["sampled"] == h["trained"] == 3 and h["arrived"] == 3 - len(plan.dropped)
        assert set(h.get("missing_why", {}).values()) <= {"dropped out (--drop-rate)"}
        if plan.dropped:
            dropped_any = True
            assert sim.missing[f"round {h['round']}"] == sorted(plan.dropped)
    assert dropped_any


def test_the_batched_transport_loses_the_same_replies_with_the_same_numbers():
    over = dict(rounds=3, eval_every=3, drop_rate=0.4, availability="tail", availability_mean=0.6)
    one, a = run_small(client_parallel="off", **over)
    together, b = run_small(client_parallel="2", **over)
    assert [h["missing"] for h in one.history] == [h["missing"] for h in together.history]
    assert [h["clients"] for h in one.history] == [h["clients"] for h in together.history]
    for k in one.state["weights"]:
        assert torch.allclose(one.state["weights"][k], together.state["weights"][k], atol=1e-5)


def _empty_then_partial(drop_rate=0.6, clients=6):
    """A seed whose round 1 loses every reply and round 2 keeps some (found from the model's own draws)."""
    from fedlt.engine.driver import clients_per_round, sampling_schedule

    for seed in range(200):
        f = Faults(drop_rate=drop_rate)
        s = sampling_schedule(clients, clients_per_round(clients, 0.5), 2, seed)
        p1 = f.plan(1, s[0], 3, seed, lambda: None)
        p2 = f.plan(2, s[1], 3, seed, lambda: None)
        if p1.dropped == set(p1.sampled) and 0 < len(p2.dropped) < len(p2.sampled):
            return seed
    raise AssertionError("no such seed")


@pytest.mark.parametrize("method", ["fedavg", "ditto", "fedloge", "creff"])
def test_every_family_goes_through_a_round_without_replies_and_one_with_fewer(method):
    """FedAvg-like, personalised (Ditto), FedLoGe (phases, personal heads), CReFF (server-side feature
    re-training every round): round 1 loses every reply (no update, said once), round 2 keeps some."""
    seed = _empty_then_partial()
    said = []
    params = {"fedloge": {"sse_steps": 200}, "creff": {"match_epochs": 5, "crt_epochs": 10}}.get(
        method, method_test_params(method))
    cfg = small_config(method=method, params=params, rounds=2, eval_every=1, drop_rate=0.6, seed=seed)
    pr = rundir.prepare(cfg, rundir.federation_for(cfg))
    from fedlt.engine import Simulation

    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    sim.echo = said.append
    before = {k: v.clone() for k, v in sim.state["weights"].items()}
    rec1 = sim.train_round()
    assert rec1["arrived"] == 0 and rec1["trained"] == rec1["sampled"] == 3
    assert _same_state(before, sim.state["weights"])  # no update
    sim.history.append(rec1)
    rec2 = sim.train_round()
    assert 0 < rec2["arrived"] < 3
    assert not _same_state(before, sim.state["weights"])
    sim.history.append(rec2)
    for phase in sim.method.phases:
        sim.run_phase(phase)
    final = sim.evaluate("final")
    assert final["global"] and all(np.isfinite(v["acc"]) for v in final["global"].values())
    notes = [s for s in said if "no update" in s]
    assert len(notes) == 1 and notes[0].startswith("note: round 1:"), said


def test_a_run_where_no_reply_ever_arrives_keeps_its_initial_model(tmp_path, capsys):
    """A deadline that every client of this federation misses (0.01 simulated s: 10 samples at speed 1, where each
    client holds more); --drop-rate 1, which could never train, is refused (test_declared_relations)."""
    code = cli_main(["run", "--dataset", "digits", "--rho", "10", "--clients", "4", "--rounds", "3", "--eval-every",
                     "3", "--local-epochs", "1", "--model", "mlp", "--round-deadline", "0.01", "--threads", "1",
                     "--no-progress", "--out", str(tmp_path), "--name", "none"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.count("leaves the server state as it was (no update)") == 1
    recs = [json.loads(x) for x in (tmp_path / "none" / "metrics.jsonl").read_text().splitlines() if '"round"' in x]
    assert [r["arrived"] for r in recs] == [0, 0, 0] and [r["trained"] for r in recs] == [2, 2, 2]
    summary = json.loads((tmp_path / "none" / "summary.json").read_text())
    assert summary["clients_per_round"] == {"sampled": 2.0, "trained": 2.0, "arrived": 0.0}
    assert sorted(summary["missing"]) == ["round 1", "round 2", "round 3"]
    from fedlt.experiments.report import write_report

    write_report(tmp_path, figures=False, echo=lambda *a: None)
    page = (tmp_path / "report" / "report.md").read_text()
    row = "| fedavg | 0 | 2.00 | 2.00 | 0.00 | 0 | 3 | 0.0 |"  # simulated s: the deadline's, 3 x 0.01
    assert "## Clients per round" in page and row in page


# ---------------------------------------------------------------------------------------------- resume
FAULTY = dict(drop_rate=0.3, availability="tail", availability_mean=0.7, speed_sigma=1.0, round_deadline=0.2,
              over_select=1.5)


def _no_wall_time(rec):
    if isinstance(rec, dict):
        return {k: _no_wall_time(v) for k, v in rec.items() if not k.endswith("time") or k == "sim_time"}
    return rec


def _records(d):
    return [_no_wall_time(json.loads(x)) for x in (d / "metrics.jsonl").read_text().splitlines()]


def test_kill_9_and_resume_draw_the_same_clients_losses_and_deadlines(tmp_path):
    over = dict(method="ditto", rounds=5, eval_every=5, out=str(tmp_path), threads=1, **FAULTY)
    ref = rundir.run(small_config(name="ref", **over), progress=False, echo=lambda *a: None)
    cfg = small_config(name="killed", **over)
    p = run_killed(cfg, kill_after=3)
    assert p.returncode == -9, p.stderr[-2000:]
    out = rundir.run(cfg, progress=False, echo=lambda *a: None, checkpoint_every=1, resume=True)
    assert out["resumed_after_round"] == 3
    a, b = _records(tmp_path / "ref"), _records(tmp_path / "killed")
    assert [r.get("missing_why") for r in a] == [r.get("missing_why") for r in b]
    assert any(r.get("missing") for r in a) and any("online" in r for r in a)
    assert a == b
    assert out["missing"] == ref["missing"] and out["final"]["global"] == ref["final"]["global"]


# ---------------------------------------------------------------------------------------------- Flower
def test_flower_inprocess_loses_the_replies_the_simulation_loses(tmp_path):
    pytest.importorskip("flwr")
    from fedlt.flower.inprocess import run_inprocess

    over = dict(rounds=3, eval_every=3, **FAULTY)
    sim, final = run_small(**over)
    st, _, summary = run_inprocess(small_config(out=str(tmp_path), name="fl", **over), echo=lambda s: None)
    for h_sim, h_fl in zip(sim.history, st.history):
        for k in ("clients", "missing", "missing_why", "sampled", "trained", "arrived", "online", "sim_time"):
            assert h_sim.get(k) == h_fl.get(k), k
    for k in sim.state["weights"]:
        assert torch.allclose(sim.state["weights"][k], st.state["weights"][k], atol=1e-6)
    assert summary["missing"] == sim.missing


def test_flowers_own_round_loop_loses_the_same_replies():
    """Strategy.start (Flower's round loop over the fedlt strategy) with faults: the simulation's weights."""
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord

    from fedlt.flower.inprocess import InProcessGrid, server_identity
    from fedlt.flower.strategy import FedltStrategy

    over = dict(method="fedprox", rounds=2, eval_every=1, drop_rate=0.5, availability="tail")
    cfg = small_config(**over)
    st = FedltStrategy(cfg, echo=lambda s: None)
    with server_identity():
        st.start(InProcessGrid([{"partition-id": i} for i in range(cfg.clients)]), ArrayRecord(), num_rounds=2)
    sim, _ = run_small(**over)
    assert any(h["arrived"] < h["sampled"] for h in sim.history)
    for k in sim.state["weights"]:
        assert torch.allclose(sim.state["weights"][k], st.state["weights"][k], atol=1e-6)


@pytest.mark.ray
@pytest.mark.slow
def test_flower_simulation_on_ray_loses_the_replies_the_inprocess_run_loses(tmp_path, capsys):
    pytest.importorskip("ray")
    pytest.importorskip("flwr")
    from test_flower_simulation import RUN, _simulated_like

    args = [*RUN, "--drop-rate", "0.5", "--availability", "tail", "--over-select", "1.5", "--speed-sigma", "1",
            "--round-deadline", "0.3", "--out", str(tmp_path)]
    assert cli_main(["flower", "inprocess", *args, "--name", "inprocess"]) == 0
    capsys.readouterr()
    sa, sb = _simulated_like(tmp_path / "inprocess", [*args, "--name", "sim"])
    assert sa["missing"] and sb["missing"] == sa["missing"]
    assert sb["clients_per_round"] == sa["clients_per_round"]


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args,message", [
    (["--availability", "1.5"], "availability must be always, size, tail or a number in (0, 1]"),
    (["--availability", "often"], "availability must be always, size, tail or a number"),
    (["--drop-rate", "-0.1"], "drop-rate"),
    (["--over-select", "0.5"], "over-select"),
    (["--round-deadline", "0"], "round-deadline"),
    (["--speed-file", "missing.json"], "speed file missing.json not found"),
    (["--speed-file", "SPEEDS", "--speed-sigma", "1"], "--speed-file and --speed-sigma exclude each other"),
    (["--speed-file", "SHORT"], "must hold a list of 4 speeds"),
    (["--speed-file", "NEGATIVE"], "every speed must be a positive finite number"),
])
def test_bad_fault_settings_are_one_line_before_anything_is_written(tmp_path, capsys, args, message):
    files = {"SPEEDS": [1, 1, 1, 1], "SHORT": [1, 2], "NEGATIVE": [1, -1, 1, 1]}
    for i, a in enumerate(args):
        if a in files:
            (tmp_path / f"{a}.json").write_text(json.dumps(files[a]))
            args[i] = str(tmp_path / f"{a}.json")
    out = tmp_path / "runs"
    code = cli_main(["run", "--dataset", "digits", "--clients", "4", "--rounds", "1", *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_the_dropout_page_runs(tmp_path):
    """docs/dropout.md's example: every fault at once on a small run, and the report's table of clients."""
    from test_docs import ROOT, doc_env, run_blocks

    work = tmp_path / "work"
    work.mkdir()
    doc = ROOT / "docs" / "dropout.md"
    env = doc_env(tmp_path)
    env["PYTHONPATH"] += os.pathsep + SRC  # this tree's fedlt, not only the installed one
    (out,) = run_blocks(doc.name, doc.read_text(), work, env)
    recs = [json.loads(x) for x in (work / "runs" / "faulty" / "metrics.jsonl").read_text().splitlines()
            if '"round"' in x]
    assert all(r["arrived"] <= 3 <= r["sampled"] for r in recs if r["sampled"] >= 3)
    assert "missing (dropped out (--drop-rate))" in out or "missed the deadline" in out
