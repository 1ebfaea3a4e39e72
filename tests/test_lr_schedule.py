"""Learning-rate schedules per round: the formula, the per-round record, resume, and bad settings."""
from __future__ import annotations

import json
import math

import pytest
import torch

from fedlt.cli import main
from fedlt.config import RunConfig, load_config, lr_at
from fedlt.core.state import tree_of
from fedlt.errors import ConfigError
from fedlt.registry import METHODS

from conftest import dies_in_round


def test_step_schedule_decays_after_each_milestone_like_multisteplr():
    cfg = load_config(overrides={"lr": 0.35, "rounds": 320, "lr_schedule": "step", "lr_milestones": "160,240"})
    lrs = [lr_at(cfg, r) for r in range(1, 321)]
    assert set(lrs[:160]) == {0.35}  # rounds 1..160
    assert all(math.isclose(v, 0.035) for v in lrs[160:240])  # 161..240
    assert all(math.isclose(v, 0.0035) for v in lrs[240:])
    import torch  # the reference: torch's MultiStepLR stepped once after every round

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.35)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [160, 240], 0.1)
    ref = []
    for _ in range(320):
        ref.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert all(math.isclose(a, b) for a, b in zip(lrs, ref))


def test_cosine_schedule_and_constant():
    cfg = RunConfig(lr=0.1, rounds=10, lr_schedule="cosine")
    lrs = [lr_at(cfg, r) for r in range(1, 11)]
    assert lrs[0] == 0.1 and all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 0
    assert math.isclose(lrs[5], 0.1 * (1 + math.cos(math.pi * 5 / 10)) / 2)
    assert lr_at(RunConfig(lr=0.07), 33) == 0.07


@pytest.mark.parametrize("over,msg", [({"lr_schedule": "linear"}, "unknown lr-schedule"),
                                      ({"lr_schedule": "step"}, "needs --lr-milestones"),
                                      ({"lr_milestones": "160,240"}, "apply to --lr-schedule step"),
                                      ({"lr_schedule": "step", "lr_milestones": "240,160"}, "increasing"),
                                      ({"lr_schedule": "step", "lr_milestones": "a,b"}, "comma-separated")])
def test_bad_schedules_are_one_line_errors(over, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(overrides=over)


def test_unknown_schedule_on_the_command_line_exits_2(capsys):
    assert main(["run", "--lr-schedule", "exp", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown lr-schedule" in err


def test_each_rounds_lr_is_logged_and_a_resumed_run_has_the_same_sequence(tmp_path, monkeypatch):
    from fedlt.engine.simulation import Simulation
    from fedlt.runner.rundir import prepare, run
    from fedlt.runner.runstate import CHECKPOINT

    over = dict(dataset="synthetic", model="mlp", clients=4, participation=1.0, local_epochs=1, eval_every=2,
                lr=0.1, lr_schedule="step", lr_milestones="1,2", lr_gamma=0.5, threads=1, out=str(tmp_path), rounds=3)
    quiet = dict(progress=False, echo=lambda *_: None, checkpoint_every=1)
    run(load_config(overrides={**over, "name": "full"}), **quiet)
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "round" in r]
    assert lrs == [0.1, 0.05, 0.025]

    cfg = load_config(overrides={**over, "name": "resumed"})
    with dies_in_round(Simulation, 3):
        run(cfg, **quiet)
    assert (tmp_path / "resumed" / CHECKPOINT).is_file()
    pr = prepare(cfg)
    assert pr.method.spec.lr == 0.1  # a new process: nothing but the settings and the round decide the lr
    run(cfg, prepared=pr, resume=True, **quiet)
    resumed = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in resumed if "round" in r] == lrs
    final = [json.loads((tmp_path / n / "summary.json").read_text())["final"]["global"] for n in ("full", "resumed")]
    assert final[0] == final[1]


def test_flower_clients_follow_the_schedule_like_the_simulation(tmp_path):
    pytest.importorskip("flwr")
    from functools import partial

    from conftest import small_config
    from fedlt.engine import EngineConfig, Simulation
    from fedlt.runner.rundir import prepare
    from fedlt.flower.inprocess import run_inprocess

    def sim_state(cfg, schedule=True):
        pr = prepare(cfg)
        sim = Simulation(pr.method, pr.fed, EngineConfig(rounds=cfg.rounds, participation=cfg.participation,
                                                         eval_every=cfg.eval_every, seed=cfg.seed, progress=False,
                                                         lr_of_round=partial(lr_at, cfg) if schedule else None))
        sim.run()
        return sim.state["weights"]

    cfg = small_config(rounds=2, eval_every=2, participation=1.0, lr_schedule="step", lr_milestones="1",
                       lr_gamma=0.1, out=str(tmp_path), name="fl")
    st, _, summary = run_inprocess(cfg, echo=lambda *_: None)
    sim = sim_state(cfg)
    assert max((st.state["weights"][k] - v).abs().max().item() for k, v in sim.items()) <= 1e-6
    constant = sim_state(cfg, schedule=False)  # and the schedule changed the outcome
    assert max((constant[k] - v).abs().max().item() for k, v in sim.items()) > 1e-4
    assert [h["lr"] for h in st.history] == [0.05, pytest.approx(0.005)]


# ------------------------------------------------------------------------- the round's lr rides in the message
def test_the_rounds_lr_is_in_every_message_and_the_spec_never_changes():
    """In-process: every training payload carries lr_at(round) in its config and every phase payload the last
    round's; the method's spec ends the run exactly as it began (nothing writes the lr into it)."""
    from dataclasses import asdict

    from conftest import method_test_params, small_config
    from fedlt.engine import EngineConfig, Simulation
    from fedlt.runner.rundir import prepare

    cfg = small_config(method="fedloge", params=method_test_params("fedloge"), rounds=3, eval_every=3,
                       local_epochs=1, lr_schedule="step", lr_milestones="1,2", lr_gamma=0.5)
    pr = prepare(cfg)
    before = asdict(pr.method.spec)
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    seen, send = [], sim.transport.send_and_receive

    def spy(kind, index, payloads):
        seen.append((kind, index, sorted({p.lr for p in payloads.values()})))
        return send(kind, index, payloads)

    sim.transport.send_and_receive = spy
    sim.run()
    assert seen == [("train", 1, [0.05]), ("train", 2, [0.025]), ("train", 3, [0.0125]),
                    ("ga-fr", 0, [0.0125]), ("la-fr", 1, [0.0125])]
    assert asdict(pr.method.spec) == before and pr.method.spec.lr == 0.05


def _same(a, b) -> bool:
    a, b = tree_of(a), tree_of(b)  # a method's typed server state as its tree
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_trains_at_the_lr_its_message_carries(method):
    """Method A's spec says lr 0.04, then 0.01 from round 2 on; method B's says 0.01 throughout. A's round-2
    payloads carry 0.01 (as the driver sends them), B's carry nothing (its spec's lr applies): every reply,
    the aggregated server state (server-side training takes the round's lr from the schedule) and every phase
    are bit for bit the same. A client hook that read its lr from the spec instead of the message fails here."""
    from conftest import method_test_params, small_config
    from fedlt.engine.driver import client_generator
    from fedlt.seeds import Purpose
    from fedlt.runner.rundir import federation_for, prepare

    over = dict(method=method, params=method_test_params(method), rounds=2, local_epochs=1, clients=4)
    cfg_a = small_config(lr=0.04, lr_schedule="step", lr_milestones="1", lr_gamma=0.25, **over)
    lr2 = lr_at(cfg_a, 2)
    cfg_b = small_config(lr=lr2, **over)
    fed = _FED.setdefault("fed", federation_for(cfg_a))
    pa = prepare(cfg_a, fed)
    a, b, data = pa.method, prepare(cfg_b, fed).method, pa.fed.clients[0]  # (--finetune head: the features)
    assert a.spec.lr != b.spec.lr
    sa, sb = a.init_server(), b.init_server()
    ca, cb = a.init_client(0, data), b.init_client(0, data)
    ra, ca = a.local_train(a.configure(sa, 2, 0).with_config({"lr": lr2}), ca, data,
                           client_generator(0, Purpose.TRAIN, 2, 0))
    rb, cb = b.local_train(b.configure(sb, 2, 0), cb, data, client_generator(0, Purpose.TRAIN, 2, 0))
    assert _same(ra.arrays, rb.arrays) and _same(ra.meta, rb.meta) and _same(ca, cb), f"{method}: round 2 reply"
    sa, sb = a.aggregate(sa, 2, [(0, ra)]), b.aggregate(sb, 2, [(0, rb)])
    assert _same(sa, sb), f"{method}: server state after round 2"
    for i, phase in enumerate(a.phases):
        pp = a.phase_configure(phase, sa, 0).with_config({"lr": lr2})
        ra, ca = a.phase_client(phase, pp, ca, data, client_generator(0, Purpose.PHASE, i, 0))
        rb, cb = b.phase_client(phase, b.phase_configure(phase, sb, 0), cb, data,
                                client_generator(0, Purpose.PHASE, i, 0))
        assert _same(ra.arrays, rb.arrays) and _same(ca, cb), f"{method}: phase {phase}"
        sa, sb = a.phase_aggregate(phase, sa, [(0, ra)]), b.phase_aggregate(phase, sb, [(0, rb)])
        assert _same(sa, sb), f"{method}: server state after phase {phase}"


_FED: dict = {}
