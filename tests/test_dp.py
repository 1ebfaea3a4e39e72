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

from fedlt.core.dp import ClientDP, clip_reply, noise_for, noised_replies  # noqa: E402
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
    z = noise_for(4.0, 0.1, 50, 1e-5)
    assert _eps_by_hand(z, 0.1, 50, 1e-5) <= 4.0 < _eps_by_hand(z * 0.99, 0.1, 50, 1e-5)
    dp = ClientDP(1.0, None, 4.0, 1e-5, None, 100, 10, 50)
    assert dp.noise == pytest.approx(z) and dp.epsilon(50) <= 4.0


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
            "--dp-noise", "1", "--dp-budget", "2"]
    p = subprocess.run([sys.executable, "-m", "fedlt", *argv], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert p.returncode == 0, p.stderr[-2000:]
    said = [line for line in p.stdout.splitlines() if "--dp-budget" in line]
    assert len(said) == 1 and said[0].startswith("stopped before round"), p.stdout[-3000:]
    s = json.loads((tmp_path / "b" / "summary.json").read_text())
    r = s["dp"]["rounds"]
    assert 1 <= r < 20 and s["dp"]["epsilon"] <= 2 < _eps_by_hand(1.0, 0.5, r + 1, s["dp"]["delta"])
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

