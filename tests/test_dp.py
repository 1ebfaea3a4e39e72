"""Client-level differential privacy (--dp client, fedlt.core.dp): clipping on the client, the server's noise on the
sum over the fixed denominator, Poisson sampling, the RDP accountant's epsilon (recomputed here with the library
directly), the noise solved for a target epsilon, the budget that stops a run, resume, and what is refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("dp_accounting")

from fedlt.core.dp import ClientDP, client_noise_multiplier, clip_reply, noised_replies  # noqa: E402
from fedlt.runner import rundir  # noqa: E402

from conftest import small_config  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")
DP = dict(dp="client", dp_clip=1.0, dp_noise=0.5, clients=10, participation=0.5, rounds=4, eval_every=2,
          local_epochs=1, threads=1)


def test_an_update_is_clipped_to_the_norm_keeping_its_direction_and_integer_entries_stay_as_received():
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(5, generator=g), "n": torch.tensor(7)}
    big = {"a": w["a"] + 3 * torch.randn(4, 3, generator=g), "b": w["b"] + 3, "n": torch.tensor(19)}
    out, norm = clip_reply(w, big, 1.0, "client 0")
    delta = torch.cat([(out[k] - w[k]).flatten() for k in ("a", "b")])
    orig = torch.cat([(big[k] - w[k]).flatten() for k in ("a", "b")])
    assert norm == pytest.approx(float(orig.norm()), rel=1e-6) and norm > 1
    assert float(delta.norm()) == pytest.approx(1.0, rel=1e-5)
    assert torch.allclose(delta / delta.norm(), orig / orig.norm(), atol=1e-5)  # same direction
    assert int(out["n"]) == 7  # a step count never leaves the client
    small = {"a": w["a"] + 1e-3, "b": w["b"], "n": torch.tensor(8)}
    out2, _ = clip_reply(w, small, 1.0, "client 1")
    assert torch.equal(out2["a"], small["a"])  # under the norm: unchanged
    with pytest.raises(Exception, match="did not receive"):
        clip_reply(w, {**big, "extra": torch.ones(2)}, 1.0, "client 2")


def test_the_replies_mean_is_the_noised_sum_over_the_fixed_denominator():
    w = {"a": torch.zeros(2000, dtype=torch.float32)}
    deltas = [torch.full((2000,), 0.01 * (i + 1)) for i in range(3)]
    clipped = {i: {"a": w["a"] + d} for i, d in enumerate(deltas)}
    bases = {i: w for i in clipped}
    exact = noised_replies(bases, clipped, 0.0, 1.0, 8.0, torch.Generator().manual_seed(1))
    mean = sum(r["a"] for r in exact.values()) / 3
    assert torch.allclose(mean, sum(deltas) / 8.0, atol=1e-6)  # (sum of updates) / (q K), not / 3
    noisy = noised_replies(bases, clipped, 2.0, 0.5, 8.0, torch.Generator().manual_seed(1))
    noise = sum(r["a"] for r in noisy.values()) / 3 - sum(deltas) / 8.0
    assert float(noise.std()) == pytest.approx(2.0 * 0.5 / 8.0, rel=0.05)  # z C / (q K)
    assert abs(float(noise.mean())) < 0.01


def _tensors(tree, at=""):
    """Every tensor of a state tree, by its path."""
    if isinstance(tree, torch.Tensor):
        return {at: tree}
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _tensors(sub, f"{at}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _tensors(sub, f"{at}/{i}").items()}
    return {}


@pytest.mark.parametrize("method", ["fedavg", "fedloge", "balancefl", "ditto", "fedrod", "creff", "redgrape"])
def test_zero_noise_and_an_unreachable_clip_give_the_run_without_dp_bit_for_bit(tmp_path, method):
    """The methods of the tail page (docs/dp-tail.md): with noise 0 and a clip no update reaches, every client
    sampled (participation 1: Poisson at rate 1) and clients of one size (DP's uniform weights are then the
    sample weights), --dp client's round -- clipping, the sum over the fixed denominator, the privatised class
    statistics (CReFF's and RedGrape's noised per-class means, their counts' noise 0 too) -- is the run without
    DP's, every tensor of the server's state bit for bit (CReFF's and RedGrape's statistics with their own clip,
    --dp-stats-clip, out of reach too)."""
    from fedlt.runner.runstate import load_final_state

    base = dict(method=method, imbalance_ratio=1.0, partition="iid", clients=4, participation=1.0, rounds=1,
                eval_every=1, local_epochs=1, threads=1, out=str(tmp_path))
    assert len({len(c) for c in rundir.federation_for(small_config(**base)).clients}) == 1  # one size
    unreachable = dict(dp="client", dp_clip=1e9, dp_noise=0.0,
                       **({"dp_stats_clip": 1e9} if method in ("creff", "redgrape") else {}))  # their statistics' clip
    for name, extra in (("plain", {}), ("dp", unreachable)):
        rundir.run(small_config(**base, name=name, **extra), progress=False, echo=lambda *a: None)
    a, b = (_tensors(load_final_state(tmp_path / n)["state"]) for n in ("plain", "dp"))
    assert a.keys() == b.keys() and "/weights/head.bias" in a or "/weights/head.fixed.bias" in a
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    w0 = rundir.prepare(small_config(**base), rundir.federation_for(small_config(**base))).method.init_server()
    assert any(not torch.equal(a[f"/weights/{k}"], v) for k, v in w0.weights.items())  # it trained


def _eps_by_hand(z, q, rounds, delta):
    import dp_accounting as dpa
    from dp_accounting import rdp

    acc = rdp.RdpAccountant(list(range(2, 256)) + [256, 512, 1024])
    acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), rounds)
    return acc.get_epsilon(delta)


def test_a_run_records_each_rounds_epsilon_and_a_table_that_recomputes_it(tmp_path):
    cfg = small_config(**DP, out=str(tmp_path), name="dp")
    summary = rundir.run(cfg, progress=False, echo=lambda *a: None, checkpoint_every=1)
    d = summary["dp"]
    assert d["scheme"] == "poisson" and d["sample_rate"] == 0.5 and d["population"] == 10 and d["rounds"] == 4
    assert d["epsilon"] == pytest.approx(_eps_by_hand(d["noise_multiplier"], d["sample_rate"], d["rounds"],
                                                      d["delta"]))
    rows = [json.loads(x) for x in (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()]
    eps = [r["dp_epsilon"] for r in rows if "round" in r]
    assert eps == sorted(eps) and len(set(eps)) == 4 and eps[-1] == pytest.approx(d["epsilon"])
    assert eps[0] == pytest.approx(_eps_by_hand(0.5, 0.5, 1, d["delta"]))
    line = rundir.format_summary(summary).splitlines()[-1]
    assert line.startswith(f"privacy: client-level ({d['epsilon']:.3g}, {d['delta']:.3g})-DP after 4 rounds")
    sizes = [len(r["clients"]) for r in rows if "round" in r]
    assert len(set(sizes)) > 1 or sizes[0] != 5  # Poisson sampling: not always exactly q K clients


def test_the_noise_is_solved_for_a_target_epsilon():
    z = client_noise_multiplier(4.0, 0.1, 50, 1e-5)
    assert _eps_by_hand(z, 0.1, 50, 1e-5) <= 4.0 < _eps_by_hand(z * 0.99, 0.1, 50, 1e-5)
    dp = ClientDP(1.0, None, 4.0, 1e-5, None, 100, 10, 50)
    assert dp.noise == pytest.approx(z) and dp.epsilon(50) <= 4.0


def test_the_pld_accountant_is_dp_accountings_own_and_solves_less_noise_for_the_same_epsilon(tmp_path):
    """--dp-accountant pld: each round's epsilon is dp-accounting's PLDAccountant on the run's events (computed here
    with the library), at most RDP's for the same noise; solved for a target, its noise is smaller than RDP's and
    ends within the target; the table names it."""
    import dp_accounting as dpa
    from dp_accounting import pld

    from fedlt.core.dp import PLD_INTERVAL

    def by_hand(z, q, rounds, delta):
        acc = pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
        acc.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), rounds)
        return acc.get_epsilon(delta)

    cfg = small_config(**{**DP, "dp_noise": None, "dp_epsilon": 4.0, "dp_delta": 1e-5, "rounds": 3, "eval_every": 3},
                       dp_accountant="pld", out=str(tmp_path), name="pld")
    d = rundir.run(cfg, progress=False, echo=lambda *a: None)["dp"]
    rdp_noise = client_noise_multiplier(4.0, 0.5, 3, 1e-5)
    assert d["noise_multiplier"] < 0.95 * rdp_noise and "PLDAccountant" in d["accountant"]
    rows = [json.loads(x) for x in (tmp_path / "pld" / "metrics.jsonl").read_text().splitlines()]
    eps = [r["dp_epsilon"] for r in rows if "round" in r]
    assert eps == [pytest.approx(by_hand(d["noise_multiplier"], 0.5, r, 1e-5), rel=1e-9) for r in (1, 2, 3)]
    assert 3.9 < eps[-1] <= 4.0 < _eps_by_hand(d["noise_multiplier"], 0.5, 3, 1e-5)  # RDP would say more


def test_adaptive_clipping_follows_the_target_quantile_of_the_update_norms():
    """Andrew et al.'s geometric update: with updates whose norms are spread 1..100 (every client every round,
    negligible count noise), the clip settles where about Q of them are unclipped, from above and from below."""
    from fedlt.core.method import Message

    norms = torch.linspace(1.0, 100.0, 50)
    w = {"a": torch.zeros(3)}
    gen = torch.Generator().manual_seed(0)
    for q, first in ((0.5, 0.1), (0.8, 1000.0)):
        dp = ClientDP(first, 1e-6, None, 1e-5, None, 50, 50, 400, quantile=q, clip_lr=0.2, count_noise=1e-6)
        for _ in range(300):
            payloads = {i: Message(w, {}) for i in range(50)}
            replies = [(i, Message({"a": torch.tensor([float(n), 0.0, 0.0])}, {})) for i, n in enumerate(norms)]
            dp.server_side(dp.client_side(payloads, replies), gen)
        unclipped = float((norms <= dp.clip).float().mean())
        assert abs(unclipped - q) <= 0.06, (q, dp.clip, unclipped)
        assert dp.record()["dp_clip"] == dp.used and dp.table(300)["clip"] == first


def test_adaptive_clipping_gives_the_update_the_noise_left_by_the_count():
    """The round is one Gaussian mechanism of multiplier z: z_update^-2 + (2 s)^-2 = z^-2 (Andrew et al., Thm 1);
    the accountant composes z, so the epsilon is the fixed clip's."""
    from fedlt.errors import ConfigError

    fixed = ClientDP(1.0, 0.8, None, 1e-5, None, 100, 20, 10)
    dp = ClientDP(1.0, 0.8, None, 1e-5, None, 100, 20, 10, quantile=0.5)
    assert dp.count_noise == 1.0  # 20 expected clients / 20
    assert dp.update_noise ** -2 + (2 * dp.count_noise) ** -2 == pytest.approx(0.8 ** -2)
    assert dp.update_noise > 0.8 and dp.epsilon(10) == fixed.epsilon(10)
    with pytest.raises(ConfigError, match="must exceed half"):
        ClientDP(1.0, 2.0, None, 1e-5, None, 100, 20, 10, quantile=0.5)


def test_the_budget_stops_before_the_round_that_would_pass_it_with_exit_0(tmp_path):
    argv = ["run", "--dataset", "digits", "--rho", "10", "--clients", "10", "--participation", "0.5",
            "--rounds", "20", "--eval-every", "5", "--local-epochs", "1", "--model", "smallcnn", "--threads", "1",
            "--no-progress", "--out", str(tmp_path), "--name", "b", "--dp", "client", "--dp-clip", "1",
            "--dp-noise", "1", "--dp-budget", "8"]  # at delta 1e-5: round 1 spends 3.91, round 5 passes 8
    p = subprocess.run([sys.executable, "-m", "fedlt", *argv], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert p.returncode == 0, p.stderr[-2000:]
    said = [line for line in p.stdout.splitlines() if "--dp-budget" in line]
    assert len(said) == 1 and said[0].startswith("stopped before round"), p.stdout[-3000:]
    s = json.loads((tmp_path / "b" / "summary.json").read_text())
    r = s["dp"]["rounds"]
    assert 1 <= r < 20 and s["dp"]["epsilon"] <= 8 < _eps_by_hand(1.0, 0.5, r + 1, s["dp"]["delta"])
    assert s["stopped"] == said[0] and s["final"] is not None


@pytest.mark.parametrize("adaptive", [{}, {"dp_clip_quantile": 0.5, "dp_clip": 0.3, "dp_count_noise": 1.0}],
                         ids=["fixed", "adaptive"])
def test_resume_continues_the_accountant_and_the_noise_exactly(tmp_path, adaptive):
    from conftest import resumed_as_uninterrupted

    ref, out = resumed_as_uninterrupted(tmp_path, {**DP, **adaptive})
    if adaptive:  # the clip moved, so the resumed run must have kept it
        clips = [json.loads(x).get("dp_clip") for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
        assert len({c for c in clips if c is not None}) == 4
    assert out["dp"] == ref["dp"]


@pytest.mark.parametrize("over, says", [
    ({"dp": "client", "dp_noise": 1.0}, "--dp-clip"),
    ({"dp": "client", "dp_clip": 1.0}, "exactly one of --dp-noise"),
    ({"dp_clip": 1.0}, "applies to --dp client"),
    ({"dp": "client", "dp_clip": 1.0, "dp_noise": 1.0, "drop_rate": 0.3}, "Poisson|probability"),
])
def test_bad_dp_settings_are_one_line(over, says):
    from fedlt.config import RunConfig, validate
    from fedlt.errors import ConfigError

    with pytest.raises(ConfigError, match=says) as e:
        validate(RunConfig(**{"clients": 10, **over}))
    assert "\n" not in str(e.value)


def test_a_method_whose_clients_send_class_statistics_is_refused_naming_them():
    from fedlt.config import RunConfig, validate
    from fedlt.errors import ConfigError
    from fedlt.registry import METHODS

    if not getattr(METHODS.get("ccvr"), "sends", None):
        pytest.skip("the methods' sends declarations are not there yet")
    with pytest.raises(ConfigError, match=r"method ccvr's clients also send .*class-") as e:
        validate(RunConfig(dp="client", dp_clip=1.0, dp_noise=1.0, method="ccvr", clients=10))
    assert "\n" not in str(e.value)
    validate(RunConfig(dp="client", dp_clip=1.0, dp_noise=1.0, method="fedavg", clients=10))  # FedAvg runs


def test_fedloge_runs_under_dp_with_its_phases_sending_nothing_but_a_count_of_one(tmp_path):
    """A phase that sends only its size and statistics runs under --dp with nothing of them leaving (FedLoGe's
    GA-FR and LA-FR: the generic and personalised models still come out); one that sends a model part is refused."""
    from fedlt.config import RunConfig, validate
    from fedlt.errors import ConfigError

    cfg = small_config(**{**DP, "rounds": 2}, method="fedloge", params={"sse_steps": 200}, out=str(tmp_path),
                       name="lg")
    summary = rundir.run(cfg, progress=False, echo=lambda *a: None)
    assert "generic" in summary["final"]["global"] and "personalized" in summary["final"]["personal"]
    phases = [json.loads(x) for x in (tmp_path / "lg" / "sent.jsonl").read_text().splitlines() if '"phase"' in x]
    assert {r["phase"] for r in phases} == {"ga-fr", "la-fr"}
    assert all(r["sent"] == "num_examples" and r["values"] == 1 for r in phases), phases
    with pytest.raises(ConfigError, match=r"head\.\* \(model-part, phase rucr-crt\)"):
        validate(RunConfig(dp="client", dp_clip=1.0, dp_noise=1.0, method="rucr", clients=10))



# ------------------------------------------------------------------ class statistics as noised per-class means
def _class_replies(n: int, num_classes: int, gen, held=None):
    """``n`` replies of per-class arrays under prefix "grad" (CReFF's packing: core.classgrad)."""
    from fedlt.core.classgrad import pack_class_grads
    from fedlt.core.method import Message

    out = []
    for i in range(n):
        cls = held[i] if held is not None else sorted(torch.randperm(num_classes, generator=gen)[:2].tolist())
        out.append((i, Message(pack_class_grads("grad", cls, torch.randn(len(cls), 3, 2, generator=gen),
                                                torch.randn(len(cls), 3, generator=gen)), {})))
    return out


def test_class_statistics_reach_the_method_as_the_noised_per_class_sum_over_the_noised_count():
    """Without noise, the method's own per-class mean (core.classgrad.mean_class_grads) of the rewritten replies is
    its mean of the replies as sent, and a class nobody holds is left out. With noise: each class's sum gets
    N(0, (z C_s)^2) per entry and its count of holders N(0, z^2 num_classes)."""
    from fedlt.core.classgrad import mean_class_grads
    from fedlt.core.dp import noised_class_means
    from fedlt.core.method import Message

    gen = torch.Generator().manual_seed(0)
    replies = _class_replies(5, 6, gen, held=[[0, 2], [2], [0, 1, 2], [4], [1, 4]])  # class 3 and 5: nobody
    rows = noised_class_means({c: r.arrays for c, r in replies}, ("grad",), 6, 0.0, 1.0, gen)
    want, got = mean_class_grads([r for _, r in replies], "grad"), mean_class_grads(
        [Message(rows[c], {}) for c, _ in replies], "grad")
    assert sorted(got) == sorted(want) == [0, 1, 2, 4]
    for c in want:
        assert torch.allclose(got[c][0], want[c][0], atol=1e-6) and torch.allclose(got[c][1], want[c][1], atol=1e-6)

    # the sums' noise: 400 clients holding class 0 with zero arrays, a 2000-entry array: mean x count = the noise
    zeros = {i: {"grad.classes": torch.tensor([0]), "grad.w": torch.zeros(1, 2000), "grad.b": torch.zeros(1, 3)}
             for i in range(400)}
    rows = noised_class_means(zeros, ("grad",), 1, 0.5, 2.0, torch.Generator().manual_seed(1))
    noise = mean_class_grads([Message(r, {}) for r in rows.values()], "grad")[0][0]
    assert float((noise * 400).std()) == pytest.approx(0.5 * 2.0, rel=0.06)  # z C_s (the count: 400 +- 0.5)
    # the counts' noise: 400 classes each held by all 50 clients with the same array (its sum's noise negligible)
    same = {i: {"grad.classes": torch.arange(400), "grad.w": torch.full((400, 1), 1e-3), "grad.b": torch.zeros(400, 1)}
            for i in range(50)}
    rows = noised_class_means(same, ("grad",), 400, 0.1, 1e-6, torch.Generator().manual_seed(2))
    means = mean_class_grads([Message(r, {}) for r in rows.values()], "grad")
    counts = torch.tensor([50 * 1e-3 / float(means[c][0]) for c in range(400)])
    assert float(counts.mean()) == pytest.approx(50, abs=0.5)
    assert float(counts.std()) == pytest.approx(0.1 * 400 ** 0.5, rel=0.12)  # z sqrt(num_classes)


def test_class_statistics_are_clipped_on_the_client_and_the_server_refuses_what_was_not():
    """client_reply clips the class-mean arrays together to --dp-stats-clip apart from the update (class ids as
    they are); not_clipped takes that reply and refuses one whose statistics pass the clip."""
    from fedlt.core.dp import client_reply, not_clipped
    from fedlt.core.method import Message

    gen = torch.Generator().manual_seed(3)
    w = {"a": torch.zeros(4)}
    (_, stats), = _class_replies(1, 5, gen, held=[[1, 3]])
    reply = Message({"a": torch.full((4,), 2.0), **stats.arrays}, {"num_examples": 30, "loss": 0.3})
    sent, norm, stats_norm = client_reply(w, reply, 1.0, "client 0", bit=True, means=("grad",), stats_clip=0.25)
    assert norm == pytest.approx(4.0) and float(sent.arrays["a"].norm()) == pytest.approx(1.0, rel=1e-6)
    flat = torch.cat([sent.arrays["grad.w"].flatten(), sent.arrays["grad.b"].flatten()])
    assert stats_norm > 0.25 and float(flat.norm()) == pytest.approx(0.25, rel=1e-6)
    assert torch.equal(sent.arrays["grad.classes"], torch.tensor([1, 3]))
    assert sent.meta == {"num_examples": 1, "dp_unclipped": 0}
    assert not_clipped(w, sent, 1.0, ("grad",), 0.25) is None
    assert "class statistics" in not_clipped(w, sent, 1.0, ("grad",), 0.2)
    unclipped = Message({**sent.arrays, "grad.w": stats.arrays["grad.w"]}, sent.meta)
    assert "passes --dp-stats-clip" in not_clipped(w, unclipped, 1.0, ("grad",), 0.25)


def test_the_round_shares_one_noise_multiplier_between_the_update_and_the_class_statistics():
    """A method with one class-mean prefix releases three Gaussian mechanisms a round (the update, the sums, the
    counts) beside adaptive clipping's count: sum of their z^-2 = z^-2, so the accountant's epsilon is the update's
    alone at z."""
    dp = ClientDP(1.0, 0.8, None, 1e-5, None, 100, 20, 10, quantile=0.5, means=("grad",), num_classes=10)
    assert dp.releases == 3
    assert 3 * dp.update_noise ** -2 + (2 * dp.count_noise) ** -2 == pytest.approx(0.8 ** -2)
    fixed = ClientDP(1.0, 0.8, None, 1e-5, None, 100, 20, 10, means=("grad",), num_classes=10)
    assert fixed.update_noise == pytest.approx(0.8 * 3 ** 0.5) and fixed.epsilon(10) == dp.epsilon(10)
    assert fixed.table(10)["release_noise"] == fixed.update_noise and fixed.table(10)["class_means"] == ["grad"]


@pytest.mark.parametrize("method", ["creff", "redgrape"])
def test_a_method_with_class_statistics_runs_under_dp_and_what_it_sends_is_clipped(tmp_path, method):
    """CReFF and RedGrape under --dp client: accepted (not under --dp sample), every round records the share of
    class statistics clipped, and the summary's dp table names the class-mean prefix; the run learns at low noise
    (GM well above chance on the 10 digits: CReFF's re-trained head matches the noised per-class means)."""
    from fedlt.config import RunConfig, validate
    from fedlt.errors import ConfigError

    prefix = {"creff": "grad", "redgrape": "proto"}[method]
    with pytest.raises(ConfigError, match=rf"{prefix}\.\[wb\] \(class-gradients\)"):
        validate(RunConfig(dp="sample", dp_clip=1.0, dp_noise=1.0, method=method, clients=10))
    params = {"creff": {"ipc": 20, "match_epochs": 100, "crt_epochs": 100}, "redgrape": {}}[method]
    cfg = small_config(**{**DP, "dp_noise": 0.01, "dp_clip": 5.0, "rounds": 8, "eval_every": 8, "participation": 1.0,
                          "local_epochs": 2}, dp_stats_clip=0.5, method=method, params=params, out=str(tmp_path),
                       name="c")
    summary = rundir.run(cfg, progress=False, echo=lambda *a: None)
    rounds = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines() if '"round"' in x]
    assert all(0 <= r["dp_stats_clipped"] <= 1 and r["dp_stats_norm"] > 0 for r in rounds)
    assert summary["dp"]["class_means"] == [prefix] and summary["dp"]["stats_clip"] == 0.5
    gm = next(iter(summary["final"]["global"].values()))["acc"]  # CReFF's re-trained head, RedGrape's model
    assert gm > 0.5, gm


def test_the_default_delta_is_far_below_one_over_the_units_and_a_given_one_not_below_it_is_refused():
    """delta's default, min(1e-5, 1 / (10 K)): at most 1e-5 and at most a tenth of 1 / K (K x delta, what a mechanism
    publishing each unit with probability delta would expose, at most 0.1; 1 / K^1.1 gave 0.79 at K 10). A given
    --dp-delta of 1 / K or more is refused in one line; just below it runs."""
    from fedlt.config import RunConfig, validate
    from fedlt.core.dp import default_delta
    from fedlt.core.dpsgd_accounts import sample_delta
    from fedlt.errors import ConfigError

    for k in (2, 6, 10, 100, 9_999, 10_000, 10**5, 10**7):
        d = default_delta(k)
        assert d <= 1e-5 and k * d <= 0.1 + 1e-12 and (d == 1e-5 or d == pytest.approx(1 / (10 * k)))
    assert default_delta(10**6) == pytest.approx(1e-7) and sample_delta([17, 85, 40]) == default_delta(85)
    base = dict(dp="client", dp_clip=1.0, dp_noise=0.5, dataset="digits", clients=10, rounds=1)
    for delta in (0.1, 0.5):
        with pytest.raises(ConfigError, match=r"--dp-delta .* is not below 1 / 10") as e:
            validate(RunConfig(**base, dp_delta=delta))
        assert "\n" not in str(e.value)
    validate(RunConfig(**base, dp_delta=0.0999))


def test_a_noise_larger_than_the_clip_on_the_averaged_update_and_a_budget_the_first_round_passes_are_refused():
    """Refused before the run, in one line: the noise on the averaged update, z_u C / (q K), above the clip C (z_u
    > q K, adaptive clipping's larger z_u included) -- at --dp-epsilon 1e-6 the solved multiplier, named in the line
    -- and a --dp-budget below the first round's epsilon (the accountant's, recomputed here)."""
    from fedlt.config import RunConfig, validate
    from fedlt.errors import ConfigError

    base = dict(dp="client", dp_clip=1.0, dataset="digits", clients=4, participation=0.5, rounds=1)  # q K = 2
    validate(RunConfig(**base, dp_noise=2.0))
    for over, says in (({"dp_noise": 2.01}, "noise multiplier 2.01 (--dp-noise)"),
                       ({"dp_epsilon": 1e-6, "dp_delta": 1e-5}, "(solved for --dp-epsilon 1e-06)"),
                       ({"dp_noise": 1.5, "dp_clip_quantile": 0.5, "dp_count_noise": 0.8}, "noise multiplier 1.5")):
        with pytest.raises(ConfigError, match="nothing can train") as e:
            validate(RunConfig(**base, **over))
        assert says in str(e.value) and "\n" not in str(e.value)
    first = _eps_by_hand(1.0, 0.5, 1, 1e-5)
    validate(RunConfig(**base, dp_noise=1.0, dp_budget=first * (1 + 1e-9)))
    with pytest.raises(ConfigError, match=rf"--dp-budget 0.001 is below the first round's epsilon {first:.3g}") as e:
        validate(RunConfig(**base, dp_noise=1.0, dp_budget=0.001))
    assert "\n" not in str(e.value)


def test_noise_0_is_refused_alike_on_the_command_line_and_in_fedlt_run(tmp_path):
    """Noise 0 would be clipping without any guarantee: the command line and the Python API say the same one line."""
    import fedlt
    from fedlt.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        fedlt.run(method="fedavg", dataset="digits", clients=4, rounds=1, dp="client", dp_clip=1.0, dp_noise=0,
                  out=str(tmp_path))
    assert "dp-noise must be > 0" in str(e.value) and "1e-6" in str(e.value)
    proc = subprocess.run([sys.executable, "-m", "fedlt", "run", "--dataset", "digits", "--dp", "client",
                           "--dp-clip", "1", "--dp-noise", "0", "--out", str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": SRC})
    assert proc.returncode == 2 and proc.stderr.strip() == f"fedlt: error: {e.value}" and not any(tmp_path.iterdir())
