"""Sample-level differential privacy (--dp sample, fedlt.core.dpsgd): DP-SGD on each client with opacus.

Each client's accountant against dp-accounting's computed here on the run's own inputs (and near the values
opacus's own tests hold for its RDP accountant, which it replaced), per-sample gradients against autograd one sample
at a time, the clip bounding a client's update, the noise's standard deviation, zero noise with an unreachable clip
against plain SGD on the same Poisson batches, resume after a kill, what is refused, and learning under moderate
noise."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("opacus")

import dp_accounting  # noqa: E402
from dp_accounting import rdp  # noqa: E402
from opacus.accountants import RDPAccountant  # noqa: E402

from conftest import final_gm, run_small, small_config  # noqa: E402
from fedlt.core.dpsgd import SampleDP, per_sample_grads  # noqa: E402
from fedlt.core.dpsgd_accounts import batches_per_epoch, epsilon_of, sample_noise_multiplier  # noqa: E402
from fedlt.core.steps import LocalSteps, StepRun, Train, ce, split_loss  # noqa: E402
from fedlt.runner import rundir  # noqa: E402

DP = dict(dp="sample", dp_clip=1.0, dp_noise=1.0, rounds=3, eval_every=3, threads=1)


def _reference_epsilon(history, delta):
    """dp-accounting's RdpAccountant (fedlt.core.dp.ORDERS), each entry (z, q, n) composed as n Poisson-sampled
    Gaussian mechanisms, the events built here from the library's own classes."""
    from fedlt.core.dp import ORDERS

    acc = rdp.RdpAccountant(list(ORDERS))
    for z, q, n in history:
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), int(n))
    return acc.get_epsilon(delta)


def test_the_accountant_is_dp_accountings_and_near_opacus_and_the_noise_is_calibrated_by_it():
    # the RDP accountant of --dp client (dp-accounting) for both levels: near opacus's RDP on its own tests' inputs
    # (opacus/tests/accountants_test.py: 7.32911117143 for z 1.5, q 0.04, 90 epochs; z 1.3562 for epsilon 8 at q
    # 0.04, 2000 steps) -- the orders differ (opacus's include fractional ones, dp-accounting's here are integers)
    e = epsilon_of(((1.5, 0.04, int(90 / 0.04)),), 1e-5)
    assert e == pytest.approx(_reference_epsilon(((1.5, 0.04, 2250),), 1e-5), rel=1e-12)
    assert e == pytest.approx(7.32911117143, rel=1e-3)
    ref = RDPAccountant()
    ref.history = [(1.5, 0.04, 2250)]
    assert e >= ref.get_epsilon(1e-5)  # integer orders: here a little looser than opacus's
    z = sample_noise_multiplier(8.0, 0.04, 2000, 1e-5)  # calibrate_dp_mechanism: the smallest noise meeting the target
    assert epsilon_of(((z, 0.04, 2000),), 1e-5) <= 8.0 < epsilon_of(((z - 1e-5, 0.04, 2000),), 1e-5)
    assert z == pytest.approx(1.3562, rel=1e-2)


def test_each_clients_epsilon_is_dp_accountings_for_its_rate_and_steps_and_nothing_but_the_model_leaves(tmp_path):
    cfg = small_config(**DP, batch_size=64, out=str(tmp_path), name="s")  # clients of 28 and 51 samples: one batch
    summary = rundir.run(cfg, progress=False, echo=lambda *a: None)
    d, fed = summary["dp"], rundir.federation_for(cfg)
    rows = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in rows if "round" in r]
    sizes = [len(c) for c in fed.clients]
    assert d["level"] == "sample" and d["delta"] == min(1e-5, 1 / (10 * max(sizes))) < 1 / (10 * max(sizes))
    trained = {}
    for r in rounds:
        for c in r["clients"]:
            trained[c] = trained.get(c, 0) + 1
        # the round's epsilon: the worst client's so far, by dp-accounting from each one's rate and steps
        worst = max(_reference_epsilon([(1.0, 1 / batches_per_epoch(sizes[c], cfg.batch_size),
                                         k * cfg.local_epochs * batches_per_epoch(sizes[c], cfg.batch_size))],
                                       d["delta"]) for c, k in trained.items())
        assert r["dp_epsilon"] == pytest.approx(worst, rel=1e-9) and r["train_loss"] is None
    assert set(d["clients"]) == set(trained)
    for c, row in d["clients"].items():
        L = batches_per_epoch(sizes[c], cfg.batch_size)
        assert row["samples"] == sizes[c] and row["sample_rate"] == 1 / L
        assert row["steps"] == trained[c] * cfg.local_epochs * L and row["noise_multiplier"] == 1.0
        assert row["epsilon"] == pytest.approx(_reference_epsilon([(1.0, 1 / L, row["steps"])], d["delta"]), rel=1e-9)
    assert d["epsilon"] == max(r["epsilon"] for r in d["clients"].values()) == rounds[-1]["dp_epsilon"]
    line = rundir.format_summary(summary).splitlines()[-1]
    assert line.startswith(f"privacy: sample-level ({d['epsilon']:.3g}, {d['delta']:.3g})-DP for the worst client")
    # the clients whose samples fit one batch sample at rate 1 (no amplification), and the line counts them
    alone = sorted(c for c in trained if batches_per_epoch(sizes[c], cfg.batch_size) == 1)
    assert alone and d["unamplified"] == alone and d["clients"][alone[0]]["sample_rate"] == 1
    assert f"; {len(alone)} of {len(trained)} clients without amplification by sampling" in line
    assert "noise drawn from --seed" in line  # fedlt run's default noise source, said
    sent = [json.loads(x) for x in (tmp_path / "s" / "sent.jsonl").read_text().splitlines()]
    assert {r["category"] for r in sent} == {"model", "size"}  # the losses stay on the clients


def test_a_target_epsilon_gives_each_client_its_own_noise_ending_at_the_target(tmp_path):
    cfg = small_config(**{**DP, "dp_noise": None, "dp_epsilon": 3.0}, out=str(tmp_path), name="e")
    d = rundir.run(cfg, progress=False, echo=lambda *a: None)["dp"]
    noises = {row["noise_multiplier"] for row in d["clients"].values()}
    assert len(noises) > 1  # the clients' rates and steps differ
    for row in d["clients"].values():  # every client trained all its scheduled rounds: at the target, within
        assert 3.0 - 0.01 <= row["epsilon"] <= 3.0  # calibrate_dp_mechanism's tolerance (1e-6 in the noise)
        assert _reference_epsilon([(row["noise_multiplier"] * 0.99, row["sample_rate"], row["steps"])],
                                  d["delta"]) > 3.0


def _client(method: str = "fedavg", params=None, **over):
    cfg = small_config(method=method, params=params or {}, **over)
    pr = rundir.prepare(cfg, rundir.federation_for(cfg))
    return pr.method, pr.fed.clients[1]


def _needs(name: str) -> dict:
    """The parameters ``fedlt list NAME``'s sample-level line says the method needs (``--set K=V``)."""
    import re

    from fedlt.core.dp import verdict
    from fedlt.registry import METHODS

    return dict(x.split("=", 1) for x in re.findall(r"--set (\\S+=\\S+)", verdict(METHODS.get(name), "sample")))


def _sample_methods() -> list[str]:
    from fedlt.config import dp_sample_methods

    return dp_sample_methods()


@pytest.mark.parametrize("name", _sample_methods())
def test_per_sample_gradients_are_each_samples_own_for_every_method_dp_sgd_runs(name):
    """For every method that declares --dp sample: the vectorised per-sample gradients of its described loss are
    autograd's on each sample alone, with every extra it reads (a proximal anchor, a teacher, noised counts, a
    personal head), its weights moved off what it received so that terms against it count."""
    params = {**_needs(name), **({"mu": 0.5} if name == "fedprox" else {})}
    m, data = _client(name, params)
    m.step_runner = SampleDP(1.0, 1.0, None, 1e-5, [[1]], lambda: [len(data)], counts_noise=5.0).trainer
    steps = m.local_steps(m.configure(m.init_server(), 1, 1), m.init_client(1, data), m.step_runner.client_data(data))
    steps.weights = {k: v + 0.05 if v.is_floating_point() else v for k, v in steps.weights.items()}
    run = StepRun(m, steps)
    x, y = data.sample_batch(torch.arange(6), None, train=False)
    grads, _ = per_sample_grads(m, steps, run, [])({k: run.live[k].detach() for k in run.groups}, x, y)
    names = list(run.groups)
    for i in range(6):
        loss, _ = split_loss(steps.loss(run.view, x[i:i + 1], y[i:i + 1], run.extra))
        own = torch.autograd.grad(loss, [run.live[k] for k in names], allow_unused=True)
        for k, g in zip(names, own):  # to float rounding at the gradient's scale (vmap's convolutions are grouped
            g = torch.zeros_like(grads[k][i]) if g is None else g  # ones: measured up to 2.2e-4 of it)
            gap, scale = float((grads[k][i] - g).abs().max()), float(g.abs().max())
            assert gap <= 1e-3 * scale + 1e-7, (k, gap, scale)
    assert any(float(grads[k][0].norm()) > 0 for k in names)


def _one_sample(data, i=0):
    """``data`` cut to its ``i``-th sample: every DP-SGD step's batch is that sample (q = 1)."""
    one = copy.copy(data)
    one.rows, one.y = data.rows[i:i + 1], data.y[i:i + 1]
    return one


def test_the_clip_bounds_a_clients_update_and_leaves_a_small_one_alone():
    """A client of one sample, one step at lr 0.1 without momentum and noise: its update is 0.1 times its gradient
    clipped to C -- of norm 0.1 C exactly when the gradient is longer, the gradient itself when it is shorter."""
    m, data = _client()
    one = _one_sample(data)
    w = m.init_server().weights
    steps = LocalSteps(w, ce, (Train("", lr=0.1, momentum=0.0, weight_decay=0.0),), epochs=1)
    run = StepRun(m, steps)
    x, y = one.sample_batch(torch.arange(1), None, train=False)
    g = torch.autograd.grad(ce(run.view, x, y, {}), list(run.params.values()))
    norm = float(torch.cat([t.flatten() for t in g]).norm())
    for clip in (norm / 10, norm * 10):
        dpsgd = SampleDP(clip, 0.0, None, 1e-5, [[1]], lambda: [len(data)]).trainer
        out = dpsgd.run_steps(m, steps, one, torch.Generator().manual_seed(0))
        step = float(torch.cat([(out.weights[k] - w[k]).flatten() for k in run.params]).norm())
        assert step == pytest.approx(0.1 * min(clip, norm), rel=1e-4)


def test_the_noise_has_the_mechanisms_standard_deviation():
    """Gradients of zero, lr 1, no momentum: the update after T steps is minus the sum of T draws of
    N(0, (z C)^2 I) over the expected batch size n q: over the model's 22,000 coordinates, its std is
    z C sqrt(T) / (n q) and its mean 0, to sampling error."""
    m, data = _client()
    w = m.init_server().weights
    zero = lambda model, x, y, extra: 0.0 * ce(model, x, y, extra)  # noqa: E731
    steps = LocalSteps(w, zero, (Train("", lr=1.0, momentum=0.0, weight_decay=0.0),), epochs=1)
    dp = SampleDP(2.0, 0.7, None, 1e-5, [[1]], lambda: [len(data)])
    out = dp.trainer.run_steps(m, steps, data, torch.Generator().manual_seed(0))
    (z, q, T), = dp.accounts.histories[1]
    delta = torch.cat([(out.weights[k] - w[k]).flatten() for k in w if w[k].is_floating_point()]).double()
    expected = 0.7 * 2.0 * math.sqrt(T) / (len(data) * q)
    assert (z, q, T) == (0.7, 1 / batches_per_epoch(len(data), 16), batches_per_epoch(len(data), 16))
    N = len(delta)  # 5 standard errors of the sample std and mean of N normal draws
    assert float(delta.std()) == pytest.approx(expected, rel=5 / math.sqrt(2 * N))
    assert abs(float(delta.mean())) < 5 * expected / math.sqrt(N)


def test_dp_sgd_reaches_the_local_steps_as_the_methods_step_runner():
    """The run's privacy mechanism hands its DP-SGD to the method as its step runner (core.steps.StepRunner), which
    Method.local_train and run_steps call without asking what it is: the run's method trains by the mechanism's
    trainer, whose accountants count every client it sampled, while the class keeps plain SGD; a runner handed to a
    method is what trains its described steps, with the data its client_data gives."""
    from fedlt.core.steps import PLAIN_STEPS, PlainSteps

    sim, _ = run_small("fedavg", **{**DP, "rounds": 1, "eval_every": 1})
    assert sim.method.step_runner is sim.dp.trainer and type(sim.method).step_runner is PLAIN_STEPS
    assert set(sim.dp.accounts.histories) == set(sim.schedule[0]) and not PLAIN_STEPS.per_sample

    m, data = _client()
    seen = []

    class Recording(PlainSteps):
        def client_data(self, d):
            seen.append(("data", d.client_id))
            return d

        def run_steps(self, method, steps, d, gen, lr=None):
            seen.append(("steps", d.client_id))
            return super().run_steps(method, steps, d, gen, lr)

    payload = m.configure(m.init_server(), 1, 1)
    plain, _ = m.local_train(payload, {}, data, torch.Generator().manual_seed(0))
    m.step_runner = Recording()
    again, _ = m.local_train(payload, {}, data, torch.Generator().manual_seed(0))
    assert seen == [("data", data.client_id), ("steps", data.client_id)]
    assert all(torch.equal(plain.arrays[k], again.arrays[k]) for k in plain.arrays)


def test_zero_noise_and_an_unreachable_clip_train_as_plain_sgd_on_the_same_poisson_batches():
    """With z 0 and C 1e9, DP-SGD is SGD on the batches' summed loss over the expected batch size n q: here
    plain autograd on the same Poisson batches (drawn as opacus's sampler draws them), momentum and weight decay
    as the run's. The per-sample sum runs in another order than the batch's backward: equal to float rounding."""
    m, data = _client()
    w = m.init_server().weights
    steps = m.local_steps(m.configure(m.init_server(), 1, 1), {}, data)
    dpsgd = SampleDP(1e9, 0.0, None, 1e-5, [[1]], lambda: [len(data)]).trainer
    out = dpsgd.run_steps(m, steps, data, torch.Generator().manual_seed(3))
    gen, n = torch.Generator().manual_seed(3), len(data)
    L = batches_per_epoch(n, m.spec.batch_size)
    run = StepRun(m, steps)
    torch.randint(0, 2**62, (1,), generator=gen)  # the noise generator's seed, drawn first
    sizes = []
    for _ in range(m.spec.local_epochs * L):
        idx = (torch.rand(n, generator=gen) < 1 / L).nonzero().reshape(-1)
        run.opt.zero_grad()
        if len(idx):
            x, y = data.sample_batch(idx, gen, train=True)
            (ce(run.view, x, y, {}) * len(idx) / (n / L)).backward()
        else:
            for p in run.params.values():
                p.grad = torch.zeros_like(p)
        run.opt.step()
        sizes.append(len(idx))
    ref = run.trained({}).weights
    assert len(set(sizes)) > 1  # Poisson batches: their sizes vary
    gap = max(float((out.weights[k] - ref[k]).abs().max()) for k in w)
    assert gap <= 1e-6, gap  # measured 9e-8
    assert any(not torch.equal(out.weights[k], w[k]) for k in w)


def test_resume_after_a_kill_gives_the_same_epsilon_and_model(tmp_path):
    from safetensors.torch import load_file

    from conftest import resumed_as_uninterrupted

    ref, out = resumed_as_uninterrupted(tmp_path, {**DP, "rounds": 4, "eval_every": 2})
    assert out["dp"] == ref["dp"] and out["dp"]["epsilon"] > 0

    a, b = (load_file(str(tmp_path / n / "final_state.safetensors")) for n in ("ref", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_batchnorm_model_is_refused_on_the_command_line_naming_models_that_work(tmp_path):
    from fedlt.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), contextlib.chdir(tmp_path):
        code = main(["run", "--dataset", "digits", "--clients", "4", "--rounds", "1", "--model", "smallcnn-bn",
                     "--dp", "sample", "--dp-clip", "1", "--dp-noise", "1", "--no-progress", "--out", "runs"])
    lines = [x for x in err.getvalue().splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    assert "smallcnn-bn" in lines[0] and "BatchNorm" in lines[0] and "--model smallcnn" in lines[0]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("method, says", [("climb", "climb.loss"), ("fedgrab", "does not declare"),
                                          ("perfedavg", "does not declare"), ("ccvr", "class-counts")])
def test_a_method_dp_sgd_cannot_cover_is_refused_in_one_line(method, says):
    from fedlt.config import RunConfig, validate
    from fedlt.errors import ConfigError

    with pytest.raises(ConfigError, match=says) as e:
        validate(RunConfig(dp="sample", dp_clip=1.0, dp_noise=1.0, method=method, clients=10))
    assert "\n" not in str(e.value) and f"method {method}" in str(e.value) and "fedavg" in str(e.value)
    for ok in ("fedavg", "fedprox", "ditto", "fedper", "fedloge"):
        validate(RunConfig(dp="sample", dp_clip=1.0, dp_noise=1.0, method=ok, clients=10))


BALANCEFL_DP = {"optimizer": "sgd", "feat_aug": False}  # what balancefl needs under --dp sample


def test_a_method_of_two_stages_solves_its_noise_for_both_and_ends_at_the_target(tmp_path):
    """FedRep's head epochs, then its body epochs, are both DP-SGD on one accountant: each client's noise is solved
    for the steps of both stages in each of its rounds (Method.dp_round_epochs), so its epsilon ends at the target,
    not past it (solved for one stage's steps, the second stage would overspend it)."""
    cfg = small_config(**{**DP, "dp_noise": None, "dp_epsilon": 6.0, "rounds": 3, "eval_every": 3},
                       method="fedrep", params={"head_epochs": 2, "body_epochs": 1}, out=str(tmp_path), name="r")
    d = rundir.run(cfg, progress=False, echo=lambda *a: None)["dp"]
    for row in d["clients"].values():
        L = batches_per_epoch(row["samples"], cfg.batch_size)
        assert row["steps"] % (3 * L) == 0 and row["steps"] > 0  # 2 + 1 epochs of L steps a round
        assert 6.0 - 0.01 <= row["epsilon"] <= 6.0, row


def test_scaffold_runs_dp_sgd_with_its_control_variates_derived_and_option_i_is_refused(tmp_path):
    """SCAFFOLD under --dp sample: its Delta c_i, computed from the DP-SGD-trained model, leaves beside it (the
    server keeps c the mean of the client variates), K being DP-SGD's steps; option I's full gradient over the
    local data is refused in one line."""
    from fedlt.config import RunConfig, validate
    from fedlt.errors import ConfigError

    with pytest.raises(ConfigError, match="option=II") as e:
        validate(RunConfig(dp="sample", dp_clip=1.0, dp_noise=1.0, method="scaffold", clients=10,
                           params={"option": "I"}))
    assert "\n" not in str(e.value)
    sim, _ = run_small("scaffold", **{**DP, "rounds": 2, "eval_every": 2})
    steps = {int(c): row["steps"] for c, row in sim.dp.table(2)["clients"].items()}
    c = sim.state.c
    assert any(float(v.abs().max()) > 0 for v in c.values())  # the clients' variates reached the server
    assert all(s % 2 == 0 and s > 0 for s in steps.values())  # 2 epochs of L Poisson steps each


@pytest.mark.parametrize("method, params", [("fedavg", {}), ("balancefl", BALANCEFL_DP)])
def test_dp_sgd_with_moderate_noise_still_learns(method, params):
    sim, final = run_small(method, params, **{**DP, "rounds": 8, "eval_every": 8})
    # at the default delta, 1e-5 here (13.2 for these settings by dp-accounting's RDP, 12.7 by opacus's before it;
    # 9.8 at the 1 / n_max^1.1 of before that)
    assert sim.dp.accounts.delta == 1e-5 and sim.dp.epsilon(8) < 13.5 + 2 * (method == "balancefl")  # BalanceFL: its counts'
    assert final_gm(final)["acc"] > 0.3  # chance: 0.1


def test_balancefl_under_dp_sgd_balances_by_loss_weights_from_noised_counts(tmp_path):
    """BalanceFL's DP-SGD form (methods/balancefl.py): the class-balanced sampler becomes per-sample loss weights
    that give each of the client's classes the same total (n / K, the sampler's expected gradient), and a class
    whose noised count is under dp_present x S is one the client lacks (distilled, not smoothed). Its paper's Adam
    and feature augmentation are refused in one line."""
    from fedlt.config import RunConfig, validate
    from fedlt.errors import ConfigError

    for bad, says in (({}, "--set optimizer=sgd --set feat_aug=false"), ({**BALANCEFL_DP, "class_sets": "batch"},
                                                                       "class_sets=batch")):
        with pytest.raises(ConfigError, match=says) as e:
            validate(RunConfig(dp="sample", dp_clip=1.0, dp_noise=1.0, method="balancefl", clients=10, params=bad))
        assert "\n" not in str(e.value)
    validate(RunConfig(dp="sample", dp_clip=1.0, dp_noise=1.0, method="balancefl", clients=10, params=BALANCEFL_DP))
    with pytest.raises(ConfigError, match="feat_aug=false"):  # a RunConfig run from Python, not validated
        rundir.run(small_config(**DP, method="balancefl", out=str(tmp_path), name="r"), progress=False,
                   echo=lambda *a: None)
    assert not any(tmp_path.iterdir())

    m, data = _client("balancefl", {**BALANCEFL_DP, "restrict_softmax": True})
    m.step_runner = SampleDP(1.0, 1.0, None, 1e-5, [[1]], lambda: [len(data)], counts_noise=5.0).trainer
    noised = copy.copy(data)  # counts as the noise may leave them: three classes under 2 S = 10, one at 0
    noised.counts = np.array([60, 31, 17, 10, 9, 4, 0, 12, 25, 40], dtype=np.float64)
    steps = m.local_steps(m.configure(m.init_server(), 1, 1), {}, noised)
    present, w = steps.extra["present"] > 0, steps.extra["weight"]
    assert present.tolist() == [c >= 10 for c in noised.counts]
    given = w * torch.as_tensor(np.maximum(noised.counts, 10), dtype=torch.float32)
    assert torch.allclose(given, torch.full_like(given, len(data) / 7))  # each class: n / K, K = 7



def test_the_budget_stops_before_the_round_whose_worst_client_would_pass_it(tmp_path):
    """--dp-budget under --dp sample: the run ends cleanly (its phases and final evaluation) after the last round in
    which no client passes the budget; the same run without a budget shows that the next round's worst client
    would have passed it (its epsilon after that round, from its accountant)."""
    over = {**DP, "rounds": 8, "eval_every": 8, "local_epochs": 1}
    free = rundir.run(small_config(**over, out=str(tmp_path), name="free"), progress=False, echo=lambda *a: None)
    eps = [json.loads(x)["dp_epsilon"] for x in (tmp_path / "free" / "metrics.jsonl").read_text().splitlines()
           if '"round"' in x]
    budget = (eps[3] + eps[4]) / 2  # between the worst epsilons after rounds 4 and 5
    assert eps[3] < budget < eps[4] and free["dp"]["epsilon"] == eps[-1]
    said = []
    stopped = rundir.run(small_config(**over, dp_budget=budget, out=str(tmp_path), name="b"), progress=False,
                         echo=lambda *a: said.append(" ".join(map(str, a))))
    assert stopped["dp"]["rounds"] == 4 and stopped["dp"]["epsilon"] == eps[3] <= budget
    assert stopped["stopped"].startswith("stopped before round 5") and stopped["final"] is not None
    # the round's worst client, as its accountant would have it after the round (the free run's: the clients that
    # did not train in round 5 stay below the budget, so its worst after round 5 trained in it)
    assert f"would reach {eps[4]:.3g} in it" in stopped["stopped"], stopped["stopped"]


def test_a_loss_that_reads_class_counts_reads_them_noised_once_and_each_accountant_counts_their_release(
        tmp_path, monkeypatch):
    """FedRoD under --dp sample: its loss reads the client's counts plus N(0, S^2) per class, rounded, at least 0 --
    the same draw in every round (one release) -- and every client's accountant history begins with that release
    (S, 1, 1), whose epsilon opacus gives for the whole history; --dp-epsilon solves each client's DP-SGD noise
    for the rest of the budget, so it ends at the target, with more noise than without the release."""
    from fedlt.core.dpsgd import COUNTS_NOISE, reads_counts
    from fedlt.methods.fedrod import FedRoD

    seen: dict[int, list] = {}
    steps_of = FedRoD.local_steps

    def spy(self, payload, cstate, data):
        out = steps_of(self, payload, cstate, data)
        seen.setdefault(int(data.client_id), []).append(out.extra["counts"].cpu().numpy().copy())
        return out

    monkeypatch.setattr(FedRoD, "local_steps", spy)
    assert reads_counts(FedRoD) and not reads_counts(type(None))
    cfg = small_config(**{**DP, "dp_noise": None, "dp_epsilon": 6.0, "rounds": 4, "eval_every": 4},
                       method="fedrod", out=str(tmp_path), name="r")
    d = rundir.run(cfg, progress=False, echo=lambda *a: None)["dp"]
    fed = rundir.federation_for(cfg)
    assert d["counts_noise"] == COUNTS_NOISE and set(seen) == {int(c) for c in d["clients"]}
    moved = 0
    for c, row in d["clients"].items():
        first, *rest = seen[int(c)]
        assert all((r == first).all() for r in rest)  # one release, read in every round
        true = fed.clients[int(c)].counts
        assert (first >= 0).all() and (first == first.round()).all() and (fed.clients[int(c)].counts == true).all()
        moved += int((first != true).sum())
        assert row["history"][0] == [COUNTS_NOISE, 1.0, 1] and row["steps"] == sum(h[2] for h in row["history"]) - 1
        assert row["epsilon"] == pytest.approx(_reference_epsilon(row["history"], d["delta"]), rel=1e-12)
        assert 6.0 - 0.01 <= row["epsilon"] <= 6.0
        L, z = 1 / row["sample_rate"], row["noise_multiplier"]
        alone = sample_noise_multiplier(6.0, row["sample_rate"], row["steps"], d["delta"])
        assert z > alone and epsilon_of(((z, row["sample_rate"], row["steps"]),), d["delta"]) < 6.0 - 0.01
        assert L == batches_per_epoch(row["samples"], cfg.batch_size)
    assert moved > 0


def test_the_counts_noise_has_its_standard_deviation_and_a_release_past_the_budget_is_one_line():
    from types import SimpleNamespace

    from fedlt.errors import ConfigError

    dp = SampleDP(1.0, 1.0, None, 1e-5, [], lambda: [], counts_noise=3.0, seed=7)
    counts = [1000] * 10  # far from 0: no clamping
    diffs = torch.from_numpy(np.array([dp.trainer.client_data(SimpleNamespace(client_id=c, counts=counts)).counts - 1000
                                       for c in range(400)], dtype=np.float64))
    # rounding adds variance 1/12; the sample std of 4000 draws is within 5 % of the truth
    assert diffs.std().item() == pytest.approx(math.sqrt(9 + 1 / 12), rel=0.05) and abs(diffs.mean()) < 0.2
    again = dp.trainer.client_data(SimpleNamespace(client_id=3, counts=counts)).counts
    assert (again - 1000 == diffs[3].numpy()).all()  # the same release every time
    with pytest.raises(ConfigError, match="counts' release alone") as e:
        sample_noise_multiplier(0.5, 0.1, 100, 1e-5, ((3.0, 1.0, 1),))
    assert "\n" not in str(e.value) and "--dp-counts-noise" in str(e.value)


def test_a_budget_the_counts_release_alone_spends_stops_before_anything_is_written(tmp_path):
    from fedlt.errors import ConfigError

    cfg = small_config(**{**DP, "dp_noise": None, "dp_epsilon": 0.5, "dp_counts_noise": 1.0}, method="fedrod",
                       out=str(tmp_path), name="r")
    with pytest.raises(ConfigError, match="class counts alone spends") as e:
        rundir.run(cfg, progress=False, echo=lambda *a: None)
    assert "\n" not in str(e.value) and "--dp-counts-noise 1" in str(e.value) and not any(tmp_path.iterdir())
    rundir.run(small_config(**{**DP, "dp_noise": None, "dp_epsilon": 0.5, "rounds": 1, "eval_every": 1},
                            method="fedavg", out=str(tmp_path), name="a"), progress=False, echo=lambda *a: None)


def test_the_counts_noise_help_names_the_methods_whose_loss_reads_the_counts_from_their_declarations():
    """--dp-counts-noise's help lists the methods that declare dp_sample = "counts" (core.dpsgd.reads_counts), as its
    relation's message does: BalanceFL and FedETF among them, Fed-Focal (whose loss reads none) not."""
    from fedlt.config import RunConfig, counts_methods
    from fedlt.core.dpsgd import reads_counts
    from fedlt.decl import help_text, settings_of
    from fedlt.registry import METHODS

    text = help_text(settings_of(RunConfig)["dp_counts_noise"])
    readers = [n for n, cls in METHODS.items() if reads_counts(cls)]
    assert counts_methods() == readers and {"balancefl", "fedetf", "fedrod"} <= set(readers)
    assert all(n in text for n in readers) and "fedfocal" not in text and "Fed-Focal" not in text
    assert "default 5" in text
