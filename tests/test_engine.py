"""The simulation engine, FedAvg / FedProx, aggregation and the GM/PM metrics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import run_small
from fedlt.core.aggregation import weighted_average
from fedlt.engine.driver import clients_per_round, sampling_schedule
from fedlt.metrics import report, shot_split


def test_weighted_average_is_the_sample_weighted_mean():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(2)}
    b = {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(4)}
    out = weighted_average([(a, 1), (b, 3)])
    assert torch.allclose(out["w"], torch.tensor([3.25, 6.5]))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 4  # 3.5 rounded back to an integer buffer


def test_sampling_schedule_is_drawn_up_front_from_the_seed():
    s1 = sampling_schedule(20, 10, 30, seed=1)
    assert s1 == sampling_schedule(20, 10, 30, seed=1) and s1 != sampling_schedule(20, 10, 30, seed=2)
    assert all(len(set(r)) == 10 and max(r) < 20 for r in s1)
    assert clients_per_round(20, 0.5) == 10 and clients_per_round(20, 3) == 3


def test_fedavg_aggregate_is_the_weighted_mean_of_replies():
    seen = {}
    sim, _ = run_small("fedavg", rounds=1)
    m = sim.method
    state = m.init_server()
    cids = sim.schedule[0]
    replies = []
    from fedlt.engine.driver import client_generator
    from fedlt.seeds import Purpose
    for c in cids:
        r, _ = m.local_train(m.configure(state, 1, c), {}, sim.fed.clients[c], client_generator(0, Purpose.TRAIN, 1, c))
        replies.append((c, r))
        seen[c] = (r.arrays, len(sim.fed.clients[c]))
    new = m.aggregate(state, 1, replies)["weights"]
    n = sum(w for _, w in seen.values())
    for k, v in new.items():
        if v.is_floating_point():
            expected = sum(a[k].double() * w / n for a, w in seen.values())
            assert torch.allclose(v.double(), expected, atol=1e-6), k
    # and the engine reached the same global weights
    for k, v in sim.state["weights"].items():
        assert torch.allclose(v.float(), new[k].float(), atol=1e-6), k


def test_fedavg_learns_on_a_long_tailed_problem():
    _, final = run_small("fedavg", rounds=8)
    gm = final["global"]["global"]["acc"]
    assert gm > 0.5  # chance is 0.1
    assert final["personal"]["global"]["source"] == "global"


def test_runs_are_reproducible_and_independent_of_client_order():
    sim1, f1 = run_small("fedavg", rounds=2)
    sim2, f2 = run_small("fedavg", rounds=2)
    assert f1["global"]["global"]["acc"] == f2["global"]["global"]["acc"]
    for k in sim1.state["weights"]:
        assert torch.equal(sim1.state["weights"][k], sim2.state["weights"][k])
    # reverse the visiting order inside each round: every (round, client) has its own generator
    from conftest import small_config
    from fedlt.engine import EngineConfig, Simulation
    from fedlt.runner.rundir import prepare
    cfg = small_config(rounds=2)
    pr = prepare(cfg, sim1.fed)
    sim3 = Simulation(pr.method, pr.fed, EngineConfig(rounds=2, participation=cfg.participation, eval_every=1, seed=0, progress=False))
    sim3.schedule = [list(reversed(r)) for r in sim3.schedule]
    sim3.run()
    for k, v in sim1.state["weights"].items():
        assert torch.allclose(v.float(), sim3.state["weights"][k].float(), atol=1e-5), k


def test_a_clients_global_seed_is_torch_manual_seeds_without_queueing_seeds_for_absent_devices(monkeypatch):
    """client_generator seeds the global RNG as torch.manual_seed does (the same draws after it), but where no
    accelerator is waiting to start it does not queue the seed with a formatted traceback for each (1 ms a
    client: most of a phase over 10,000 clients)."""
    import traceback

    from fedlt.engine.driver import client_generator, seed_global
    from fedlt.seeds import Purpose

    torch.manual_seed(123)
    want = torch.randn(5), torch.randint(0, 1000, (3,))
    seed_global(7)
    torch.manual_seed(0)
    seed_global(123)
    assert torch.equal(torch.randn(5), want[0]) and torch.equal(torch.randint(0, 1000, (3,)), want[1])
    a = torch.rand(4, generator=client_generator(0, Purpose.TRAIN, 2, 5)), torch.rand(4)
    b = torch.rand(4, generator=client_generator(0, Purpose.TRAIN, 2, 5)), torch.rand(4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    if not any(d.is_available() for d in (torch.cuda, torch.xpu, torch.mtia)) and not torch.backends.mps.is_available():
        def stack(*a, **k):
            raise AssertionError("a seed queued with a traceback")
        monkeypatch.setattr(traceback, "format_stack", stack)
        seed_global(5)
        client_generator(0, Purpose.TRAIN, 1, 1)
        with pytest.raises(AssertionError):
            torch.manual_seed(5)  # what it replaces does queue them


def test_fedprox_with_mu_zero_equals_fedavg_and_large_mu_stays_close():
    a, _ = run_small("fedavg", rounds=1)
    b, _ = run_small("fedprox", {"mu": 0.0}, rounds=1)
    c, _ = run_small("fedprox", {"mu": 10.0}, rounds=1)
    init = a.method.init_server()["weights"]
    dist = lambda s: sum(float((s.state["weights"][k].float() - init[k].float()).norm()) for k in init  # noqa
                         if init[k].is_floating_point())
    for k in a.state["weights"]:
        assert torch.allclose(a.state["weights"][k].float(), b.state["weights"][k].float(), atol=1e-6), k
    assert dist(c) < 0.5 * dist(a)


def test_fedloge_shot_split_cuts_cumulative_share_at_75_and_95_percent():
    counts = np.array([700, 100, 100, 50, 30, 20])
    s = shot_split(counts, "fedloge")
    assert s["many"].tolist() == [0, 1]  # 70% < 75%, crossing at class 1 (80%)
    assert s["medium"].tolist() == [2, 3]  # 90%, crossing 95% at class 3 (95%)
    assert s["few"].tolist() == [4, 5]
    f = shot_split(counts, "fixed")
    assert f["many"].tolist() == [0] and f["few"].tolist() == []


def test_report_groups_are_correct_over_total_within_group():
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    pred = torch.tensor([0, 0, 1, 0, 0, 0])
    r = report(pred, y, 3, {"many": np.array([0]), "medium": np.array([1]), "few": np.array([2])})
    assert r["acc"] == 0.5 and r["many"] == 1.0 and r["medium"] == 0.5 and r["few"] == 0.0
    assert r["per_class"] == [1.0, 0.5, 0.0]
