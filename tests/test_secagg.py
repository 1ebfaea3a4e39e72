"""Secure aggregation (--secagg, fedlt.core.secagg and fedlt.engine.flower.secagg): the simulator's SecAgg+
arithmetic within its error bound of the exact weighted mean; Flower's real protocol (SecAggPlusWorkflow and
secaggplus_mod, in process) giving the simulator's numbers, what crosses in the clear, a client dropping out of a
round above the threshold; --dp client on the securely aggregated sum; the refusals; and, slow, a deployed
SuperLink with three SuperNodes, one of them killed in the round of a second run."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from fedlt.core.method import Method  # noqa: E402
from fedlt.core.secagg import (RoundParams, error_bound, masked_keys, runs_under, secure_mean, update_of,  # noqa: E402
                               vector)
from fedlt.engine import EngineConfig, Simulation  # noqa: E402
from fedlt.runner.rundir import federation_for, prepare  # noqa: E402
from fedlt.runner.runstate import load_final_state  # noqa: E402

from conftest import background, job_result, method_test_params, small_config  # noqa: E402
from test_declared_inputs import FAST, refused, run_cli  # noqa: E402

ONE = dict(clients=3, participation=1.0, rounds=1, eval_every=1, local_epochs=1, threads=1)  # one round of 3


def _mean(updates, weights):
    return [sum(w * u[i] for u, w in zip(updates, weights)) / sum(weights) for i in range(len(updates[0]))]


def test_secure_mean_is_within_its_error_bound_of_the_weighted_mean_and_seeded():
    rng = np.random.default_rng(0)
    for levels, m in ((2 ** 22, 3), (2 ** 12, 5), (2 ** 8, 10)):
        p = RoundParams(m, 2, 50.0, 1.0, levels)
        updates = [[rng.normal(0, 0.05, (7, 3)), rng.normal(0, 0.01, 11)] for _ in range(m)]
        weights = rng.integers(1, 51, m).tolist()
        got = secure_mean(updates, weights, p, list(range(m)))
        exact = _mean(updates, weights)
        err = max(float(np.abs(g - e).max()) for g, e in zip(got, exact))
        bound = error_bound(updates, weights, p)
        assert 0 < err <= bound, (levels, err, bound)  # quantised (never exact), never past the bound
        assert err > bound / 100  # and the bound is not loose by orders of magnitude
        again = secure_mean(updates, weights, p, list(range(m)))
        assert all(np.array_equal(a, b) for a, b in zip(got, again))  # the rounding draws from the seeds
    # an entry past the clipping range is clipped (the weighted entry: W 50, weight 50 -> dq 1)
    big = secure_mean([[np.array([3.0, -0.5])]] * 3, [50] * 3, RoundParams(3, 2, 50.0, 1.0, 2 ** 22), [0, 1, 2])
    assert big[0][0] == pytest.approx(1.0, abs=1e-5) and big[0][1] == pytest.approx(-0.5, abs=1e-5)


def test_a_scalar_entry_is_aggregated_like_the_others():
    """A 0-d floating-point entry (a learnable temperature, FedETF's beta) goes through SecAgg+ as a vector of
    one: Flower's unmasking adds its offsets in place, which a numpy scalar would silently skip (a mean off by
    the clients' offsets)."""
    from fedlt.core.method import Message
    from fedlt.core.secagg import SecAgg

    base = {"beta": torch.tensor(1.0), "w": torch.zeros(4)}
    sent = {c: {"beta": torch.tensor(1.0 + 0.1 * c), "w": torch.full((4,), 0.01 * c)} for c in range(3)}
    replies = [(c, Message(a, {"num_examples": 10 * (c + 1)})) for c, a in sent.items()]
    got, why = SecAgg(None, None, 8.0, 2 ** 22, None, False).simulate({c: Message(base) for c in sent}, replies, 30,
                                                                      lambda c: c)
    exact = sum(10 * (c + 1) * (1.0 + 0.1 * c) for c in sent) / 60
    assert why == {} and all(r.arrays["beta"].shape == () for _, r in got)
    assert float(got[0][1].arrays["beta"]) == pytest.approx(exact, abs=1e-5)
    assert float(got[0][1].arrays["w"][0]) == pytest.approx(sum(10 * (c + 1) * 0.01 * c for c in sent) / 60, abs=1e-5)


def test_an_update_that_is_not_finite_is_left_out_and_too_few_left_halt_the_round():
    """A diverged client's update (NaN) would be quantised into a wrong finite number: its SuperNode refuses to
    mask it (an error reply: SecAgg+ goes on without it), the simulator leaves it out alike; below the threshold
    of the round's parameters (4 clients: threshold 3) nothing is aggregated."""
    from fedlt.core.method import Message
    from fedlt.core.secagg import SecAgg
    from fedlt.engine.flower.records import to_records
    from fedlt.engine.flower.secagg import fitres_of
    from fedlt.errors import ConfigError

    w = {"a": torch.zeros(3), "n": torch.tensor(5)}
    payloads = {c: Message(w) for c in range(4)}

    def replies(bad):
        return [(c, Message({"a": torch.full((3,), float("nan") if c in bad else 0.1 * (c + 1)), "n": w["n"]},
                            {"num_examples": 10 + c})) for c in range(4)]

    sa = SecAgg(None, None, 8.0, 2 ** 22, None, uniform=False)
    got, why = sa.simulate(payloads, replies({3}), 13, lambda c: c)
    assert [c for c, _ in got] == [0, 1, 2] and list(why) == [3] and "not finite" in why[3]
    mean = sum(0.1 * (c + 1) * (10 + c) for c in range(3)) / sum(10 + c for c in range(3))
    assert all(float((r.arrays["a"] - mean).abs().max()) < 1e-5 and int(r.arrays["n"]) == 5 for _, r in got)
    got, why = sa.simulate(payloads, replies({2, 3}), 13, lambda c: c)
    assert got == [] and sorted(why) == [0, 1, 2, 3] and "fewer than the threshold 3" in why[0]
    with pytest.raises(ConfigError, match="not finite"):
        fitres_of(to_records(payloads[3]), to_records(replies({3})[3][1], {"client-id": 3}))


def test_a_method_runs_under_secagg_only_where_its_server_needs_only_the_mean():
    from fedlt.registry import METHODS

    assert all(runs_under(METHODS.get(n)) for n in ("fedavg", "fedprox", "fedavgm", "fedadam", "fedbn", "fedper",
                                                    "fedloge", "balancefl", "feddr+", "dr", "fedetf"))
    assert not any(runs_under(METHODS.get(n)) for n in ("scaffold", "fedexp", "ccvr", "creff", "fednova", "fedbabu"))

    class Reweighted(METHODS.get("fedavg")):  # changes the aggregation without saying it again: not inherited
        def aggregate(self, state, rnd, replies):
            return state

    class Declared(Reweighted):
        secagg = True

    assert not runs_under(Reweighted) and runs_under(Declared) and not runs_under(Method)


@pytest.mark.parametrize("args, says", [
    (["--secagg"], "at least 3 clients a round"),  # FAST: 4 clients, half a round
    (["--secagg", "--participation", "1.0", "--secagg-threshold", "4"], "at least 5 clients a round"),
    (["--secagg", "--participation", "1.0", "--method", "ccvr"], "method ccvr needs more: its clients also send"),
    (["--secagg", "--participation", "1.0", "--method", "scaffold"], "method scaffold needs more"),
    (["--secagg-levels", "1024"], "applies to --secagg"),
])
def test_bad_secagg_settings_are_one_line_exit_2_and_write_nothing(tmp_path, args, says):
    code, err = run_cli(["run", *FAST, "--out", str(tmp_path / "runs"), *args], tmp_path)
    refused("secagg", code, err, tmp_path, set())
    assert says in err, err


def _simulate(tmp, **over):
    """A simulator run of the small federation; (the driver, every training reply as its client sent it)."""
    cfg = small_config(**{**ONE, **over})
    pr = prepare(cfg, federation_for(cfg))
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    sent = []
    sim.on_replies.append(lambda kind, index, replies: sent.extend(replies) if kind == "train" else None)
    sim.run()
    return sim, sent


def _weights_diff(a, b):
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def test_the_simulated_round_is_the_weighted_mean_within_the_quantisation_error(tmp_path):
    plain, sent = _simulate(tmp_path)
    sec, sent2 = _simulate(tmp_path, secagg=True)
    w0 = plain.method.init_server().weights
    assert all(torch.equal(a.arrays[k], b.arrays[k]) for (_, a), (_, b) in zip(sent, sent2) for k in a.arrays)
    keys = masked_keys(sent[0][1].arrays)
    updates = [vector(update_of(w0, r.arrays, str(c)), keys) for c, r in sent]
    weights = [r.meta["num_examples"] for _, r in sent]
    p = RoundParams(3, 2, float(max(weights)), 8.0, 2 ** 22)  # the defaults: max weight the largest client
    diff = _weights_diff(sec.state.weights, plain.state.weights)
    assert 0 < diff <= error_bound(updates, weights, p) + 1e-6, diff  # + the float32 of the weights
    print(f"\nsimulated SecAgg+ vs unmasked after one round: {diff:.2e} (bound {error_bound(updates, weights, p):.2e})")


def test_every_method_secagg_runs_gets_the_unmasked_runs_model_within_the_quantisation_error():
    """For every method that declares --secagg: one round of 3 clients through the simulated SecAgg+ gives the
    global state of the run without it, within the quantisation error (2^22 levels over [-8, 8], weights up to
    the largest client: a few 1e-6; a mishandled entry -- a scalar's offsets, a key in another order -- is off
    by its whole size)."""
    from fedlt.config import secagg_methods

    for name in secagg_methods():
        plain, _ = _simulate(None, method=name, params=method_test_params(name))
        sec, _ = _simulate(None, method=name, params=method_test_params(name), secagg=True)
        a, b = plain.state.weights, sec.state.weights
        assert a.keys() == b.keys(), name
        assert 0 < _weights_diff(a, b) <= 5e-5, (name, _weights_diff(a, b))


def test_dp_noise_goes_on_the_securely_aggregated_sum(tmp_path):
    dp = dict(dp="client", dp_clip=1.0, dp_noise=0.5, clients=4, participation=1.0)  # q 1: every client each round
    plain, sent = _simulate(tmp_path, **dp)
    sec, _ = _simulate(tmp_path, **dp, secagg=True)
    w0 = plain.method.init_server().weights
    keys = masked_keys(sent[0][1].arrays)
    updates = [vector(update_of(w0, r.arrays, str(c)), keys) for c, r in sent]  # clipped, weight 1
    assert all(r.meta == {"num_examples": 1} for _, r in sent)
    p = RoundParams(4, 3, 1.0, 8.0, 2 ** 22)  # under --dp client the max weight is 1
    diff = _weights_diff(sec.state.weights, plain.state.weights)
    assert 0 < diff <= len(sent) / plain.dp.denominator * error_bound(updates, [1] * 4, p) + 1e-6
    assert sec.history[0]["dp_epsilon"] == plain.history[0]["dp_epsilon"]


def test_dp_on_flower_with_secagg_gives_the_simulators_model_and_masks_the_clipping_bit(tmp_path):
    """--dp client with adaptive clipping on Flower's SecAgg+: each ClientApp clips, its update and its clipping
    bit are masked together (the bit is not in the clear), the server's noise and clip step follow the secure sum:
    the simulator's weights and clips, bit for bit."""
    over = dict(dp="client", dp_clip=2.0, dp_noise=0.5, dp_clip_quantile=0.5, dp_count_noise=2.0, clients=4,
                participation=1.0, rounds=2, eval_every=2, secagg=True)
    st, grid, summary, _ = _inprocess(tmp_path, "dp", **over)
    sim, _ = _simulate(tmp_path, **over)
    assert _weights_diff(st.state.weights, sim.state.weights) == 0.0 and summary["missing"] == {}
    clips = [(h["dp_clip"], h["dp_clipped"]) for h in st.driver.history]
    assert clips == [(h["dp_clip"], h["dp_clipped"]) for h in sim.history] and len(set(clips)) == 2
    clear = [m.content.config_records["fitres.metrics"] for m in grid.replied if "fitres.metrics" in m.content]
    assert len(clear) == 8 and all(json.loads(str(c["fedlt.meta"])) == {"num_examples": 1} for c in clear)
    assert all(json.loads(str(c["fedlt.masked"]))[-1] == "fedlt.dp-unclipped" for c in clear)


def _inprocess(tmp, name, fault=None, **over):
    from fedlt.flower.inprocess import run_inprocess

    cfg = small_config(**{**ONE, **over}, out=str(tmp), name=name)
    lines: list[str] = []
    st, grid, summary = run_inprocess(cfg, fault=fault, echo=lines.append)
    return st, grid, summary, lines


@pytest.mark.parametrize("method", ["fedavg", "fedloge", "fedetf"])
def test_flowers_secagg_in_process_gives_the_simulators_numbers_and_masks_every_update(tmp_path, method):
    """Two rounds of 4 clients through SecAggPlusWorkflow and secaggplus_mod: the simulator's weights, bit for
    bit (the stochastic rounding draws from the run seed on both); the server receives no array of a client's
    in a training round, only its weight and meta in the clear; evaluation stays as it was. FedLoGe: its
    backbone and global head through SecAgg+, its personal heads never leaving the clients; FedETF: its scalar
    temperature beta too (a 0-d entry)."""
    over = dict(clients=4, rounds=2, eval_every=2, secagg=True, method=method)
    st, grid, summary, _ = _inprocess(tmp_path, "f", **over)
    sim, _ = _simulate(tmp_path, **over)
    assert _weights_diff(st.state.weights, sim.state.weights) == 0.0
    stages = [m for m in grid.replied if m.metadata.message_type == "train"]
    assert len(stages) == 2 * 4 * 4  # 2 rounds x 4 SecAgg+ stages x 4 clients
    for m in stages:
        assert all(len(rec) == 0 for rec in m.content.array_records.values())  # masked: no array in the clear
        assert set(m.content) <= {"secaggplus_configs", "fitres.parameters", "fitres.num_examples",
                                  "fitres.metrics", "fitres.status"}
    clear = [m.content.config_records["fitres.metrics"] for m in stages if "fitres.metrics" in m.content]
    assert len(clear) == 8 and set(clear[0]) == {"fedlt.masked", "fedlt.entries", "fedlt.meta", "client-id",
                                                 "has-state"}
    meta = json.loads(str(clear[0]["fedlt.meta"]))  # the method's meta, as the simulator's replies carry it
    assert {"num_examples", "loss"} <= set(meta) and isinstance(meta["num_examples"], int)
    evaluations = {"fedavg": 4, "fedloge": 8, "fedetf": 12}[method]  # as without --secagg (queries a client: 1, 2, 3)
    assert summary["missing"] == {} and [m.metadata.message_type for m in grid.replied].count("evaluate") == evaluations


def test_a_client_that_drops_out_of_a_round_is_unmasked_away_and_the_round_aggregates_the_rest(tmp_path):
    """Three clients, threshold 2: the third fails in the masked-vector stage; the others' shares remove its
    masks and the round's model is the weighted mean of the two that stayed, within the quantisation error."""
    from fedlt.engine.flower.records import from_records

    def fault(msg, node):
        return "fail" if node == 102 and "fitins.parameters" in msg.content else None

    st, _, summary, lines = _inprocess(tmp_path, "k", fault, secagg=True)
    assert summary["missing"] == {"round 1": [2]} and any("client 2 missing" in x for x in lines), lines
    plain, grid, _, _ = _inprocess(tmp_path, "u")
    sent = {int(m.content["fedlt"]["client-id"]): from_records(m.content) for m in grid.replied
            if m.metadata.message_type == "train"}
    w0 = plain.method.init_server().weights
    keys = masked_keys(sent[0].arrays)
    updates = [vector(update_of(w0, sent[c].arrays, str(c)), keys) for c in (0, 1)]
    weights = [sent[c].meta["num_examples"] for c in (0, 1)]
    exact = dict(zip(keys, _mean(updates, weights)))
    diff = max(float((st.state.weights[k].double() - w0[k].double() - torch.from_numpy(exact[k])).abs().max())
               for k in keys)
    p = RoundParams(3, 2, float(max(s.meta["num_examples"] for s in sent.values())), 8.0, 2 ** 22)
    assert 0 < diff <= error_bound(updates, weights, p) + 1e-6, diff


def test_a_round_below_the_threshold_is_not_aggregated(tmp_path):
    """Poisson rounds (--dp client) may have fewer clients than SecAgg+ needs: such a round aggregates nothing,
    its clients recorded missing with why (Flower's workflow halts there too)."""
    over = dict(dp="client", dp_clip=1.0, dp_noise=0.5, clients=6, participation=0.5, rounds=3, eval_every=3,
                secagg=True)
    sim, _ = _simulate(tmp_path, **over)
    small = [r for r in sim.history if len(r["clients"]) < 3]
    assert small and all(r["arrived"] == 0 and "needs at least 3 clients" in next(iter(r["missing_why"].values()))
                         for r in small)
    assert all(r["arrived"] == len(r["clients"]) for r in sim.history if len(r["clients"]) >= 3)


# ------------------------------------------------------------------------------------------------ deployed (slow)
SMALL = ["--dataset", "digits", "--imbalance-ratio", "10", "--alpha", "1.0", "--clients", "3", "--participation",
         "1.0", "--rounds", "1", "--eval-every", "1", "--local-epochs", "1", "--batch-size", "16", "--model",
         "smallcnn", "--seed", "0", "--threads", "1", "--lr", "0.05", "--momentum", "0.9"]


def deployed_scenario(tmp: Path) -> dict:
    """A SuperLink and three SuperNodes on 127.0.0.1. Run ``sec``: one round of FedAvg under --secagg. Run
    ``kill``: the same, with SuperNode 2 killed (SIGKILL) once it has received the round's masked-vector stage
    (its payload): the round must still aggregate the two others, above the threshold of 2."""
    from flowercluster import Cluster

    tmp.mkdir(parents=True, exist_ok=True)
    c = Cluster(tmp)
    try:
        c.up(3)
        t0 = time.monotonic()
        run = c.submit(*SMALL, "--method", "fedavg", "--secagg", "--round-timeout", "300", name="sec", log="sec")
        assert run.wait(900) == 0, c.log("sec")[-3000:]
        wall = time.monotonic() - t0
        before = c.log("supernode2").count("Receiving: train message")
        run = c.submit(*SMALL, "--method", "fedavg", "--secagg", "--round-timeout", "300", name="kill", log="kill")
        end = time.monotonic() + 900
        while c.log("supernode2").count("Receiving: train message") < before + 3:  # SecAgg+'s stages 0, 1 and 2
            assert run.poll() is None, c.log("kill")[-3000:]
            assert time.monotonic() < end, "SuperNode 2 never received the masked-vector stage"
            time.sleep(0.2)
        c.kill("supernode2", tree=True)
        assert run.wait(max(end - time.monotonic(), 1)) == 0, c.log("kill")[-3000:]
    finally:
        c.stop_all()
    return {"runs": tmp / "runs", "wall": wall}


def start_background(items, base: Path) -> None:
    """conftest's hook: the deployment, in a thread of its own, once this module's tests are collected."""
    if any("deployed" in i.name for i in items):
        background({"deploy-secagg": lambda: deployed_scenario(base / "secagg")})


@pytest.mark.slow
def test_deployed_secagg_gives_the_simulators_model_and_survives_a_killed_supernode(tmp_path):
    """The deployment of :func:`deployed_scenario`: run ``sec`` ends with the simulator's SecAgg+ model (the
    rounding seeded alike), within the quantisation error of the unmasked one; run ``kill`` records SuperNode 2
    missing and ends with the model of the in-process protocol in which client 2 fails in the same stage: the
    weighted mean of the two others (test_a_client_that_drops_out_...)."""
    res = job_result("deploy-secagg", lambda: deployed_scenario(tmp_path / "secagg"), timeout=2400)
    sim, _ = _simulate(tmp_path, secagg=True)
    dep = load_final_state(res["runs"] / "sec")["state"]["weights"]
    assert _weights_diff(dep, sim.state.weights) < 1e-5
    plain, _ = _simulate(tmp_path)
    print(f"\ndeployed SecAgg+ ({res['wall']:.0f} s) vs the unmasked simulation: "
          f"{_weights_diff(dep, plain.state.weights):.2e}")
    assert 0 < _weights_diff(dep, plain.state.weights) < 1e-4
    summary = json.loads((res["runs"] / "kill" / "summary.json").read_text())
    assert summary["missing"] == {"round 1": [2], "eval 1": [2]}, summary["missing"]
    killed = load_final_state(res["runs"] / "kill")["state"]["weights"]
    dropped, _, _, _ = _inprocess(tmp_path, "k", lambda msg, node: "fail" if node == 102 and "fitins.parameters"
                                  in msg.content else None, secagg=True)
    assert _weights_diff(killed, dropped.state.weights) < 1e-5
