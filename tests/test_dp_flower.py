"""--dp client on the Flower engine: the ClientApp clips each update before it leaves the SuperNode and sends none of
its statistics, the server checks what arrives instead of clipping it and adds the simulator's noise, so an in-process
Flower run is the simulator's run (same Poisson sampling, noise, clip, epsilon, model); describe sends no label
counts, and SuperNodes with their own data run without them. --dp sample: each SuperNode trains by DP-SGD and sends
its accountant's entries, the server keeps the accountants, and the run is the simulator's too."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("dp_accounting")

from conftest import small_config  # noqa: E402
from fedlt.core.dp import UNCLIPPED, ClientDP, class_means, client_reply, norm_of, split_stats  # noqa: E402
from fedlt.core.method import Message  # noqa: E402
from fedlt.flower.inprocess import run_inprocess  # noqa: E402
from fedlt.engine.flower.records import control, from_records  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.metrics import GROUPS  # noqa: E402
from fedlt.runner import rundir  # noqa: E402
from fedlt.runner.rundir import federation_for  # noqa: E402
from fedlt.runner.runstate import load_final_state  # noqa: E402

DP = dict(dp="client", dp_clip=0.5, dp_noise=0.3, clients=6, participation=0.5, rounds=3, eval_every=3,
          local_epochs=1, threads=1)
CASES = {"fixed": {}, "adaptive": {"dp_clip_quantile": 0.5, "dp_count_noise": 1.0},
         "secagg": {"secagg": True, "clients": 4, "participation": 1.0, "rounds": 2, "eval_every": 2},
         # RedGrape: its supplementary classifier clipped with the update, its gradient prototypes as class means
         "class-means": {"method": "redgrape", "dp_stats_clip": 0.5, "rounds": 2, "eval_every": 2}}
QUIET = dict(echo=lambda *a: None)


def _timeless(x):
    if isinstance(x, dict):
        return {k: _timeless(v) for k, v in x.items() if "time" not in k}
    return [_timeless(v) for v in x] if isinstance(x, list) else x


def _lines(run, name):
    return [_timeless(json.loads(x)) for x in (run / name).read_text().splitlines()]


def _sent_beside(sim, fl, item: str) -> list[dict]:
    """Flower's sent.jsonl is the simulator's plus what the engine's own protocol sent (``item`` in every training
    round's replies: the clients apply the DP there): those rows, checked against the simulator's. (The engine's
    fields around the replies, rows with "engine", are tests/test_flower_sends.py's.)"""
    a, b = _lines(sim, "sent.jsonl"), [r for r in _lines(fl, "sent.jsonl") if "engine" not in r]
    extra = [r for r in b if r["sent"] == item]
    assert [r for r in b if r["sent"] != item] == a and all(r["category"] == "scalars" for r in extra)
    sizes = {r["round"]: r["clients"] for r in a if "round" in r and r["sent"] == "<model>"}
    assert {r["round"]: r["clients"] for r in extra if "round" in r} == sizes
    return extra


@pytest.mark.parametrize("case", list(CASES))
def test_dp_on_flower_is_the_simulators_run_and_no_unclipped_update_reaches_the_server(tmp_path, case):
    over = {**DP, **CASES[case]}
    sim = rundir.run(small_config(**over, out=str(tmp_path), name="sim"), progress=False, **QUIET)
    st, grid, fl = run_inprocess(small_config(**over, out=str(tmp_path), name="fl"), **QUIET)
    ref = load_final_state(tmp_path / "sim")["state"]["weights"]
    assert all(torch.equal(st.state.weights[k], ref[k]) for k in ref)  # the model, bit for bit
    a, b = _lines(tmp_path / "sim", "metrics.jsonl"), _lines(tmp_path / "fl", "metrics.jsonl")
    norms = [r.pop("dp_update_norm") for r in a if "round" in r]  # the server's, in the simulator
    assert [r.pop("dp_update_norm") for r in b if "round" in r] == [None] * len(norms)  # they stay on the clients
    for key in ("dp_stats_norm", "dp_stats_clipped"):  # the class statistics' norms, likewise
        assert [r.pop(key, None) is None for r in a if "round" in r] == [case != "class-means"] * len(norms)
        assert [r.pop(key, None) for r in b if "round" in r] == [None] * len(norms)
    assert a == b  # the same clients (Poisson sampling), noise, clips, epsilons, metrics
    assert fl["dp"] == sim["dp"] and _timeless(fl["final"]) == _timeless(sim["final"])
    _sent_beside(tmp_path / "sim", tmp_path / "fl", "dp_unclipped")  # the clipping bit: what else left the clients
    assert any(r["dp_clipped"] > 0 for r in a if "round" in r)  # the clip shortened updates
    for m in grid.replied:  # describe: the client id and whether it serves the partition, nothing of its data
        if m.metadata.message_type == "query.describe":
            assert set(control(m.content)) == {"client-id", "partition"}
        if m.metadata.message_type == "evaluate":  # what PM aggregates, no per-class accuracies
            reports = json.loads(str(control(m.content)["reports"]))
            assert reports and all(set(rep) - {"nonfinite"} == {"acc", *GROUPS} for rep in reports.values())
    if case == "secagg":
        return  # its train replies are SecAgg+'s masked vectors (tests/test_secagg.py)
    asked = {m.metadata.message_id: m for m in grid.delivered}
    seen = []
    for m in grid.replied:
        if m.metadata.message_type != "train":
            continue
        ask = asked[m.metadata.reply_to_message_id]
        clip, base, got = float(control(ask.content)["dp-clip"]), from_records(ask.content), from_records(m.content)
        stats, rest = split_stats(got.arrays, class_means(st.method.sends))
        norm = sum(float((rest[k].double() - base.arrays[k].double()).pow(2).sum()) for k in rest) ** 0.5
        assert norm <= clip + 1e-5, (norm, clip)  # as it arrives at the server
        assert (norm_of({k: v.double() for k, v in stats.items() if v.is_floating_point()}) <= 0.5 + 1e-6) \
            and (case != "class-means" or "proto.w" in stats)  # the class statistics too
        assert got.meta == {"num_examples": 1, UNCLIPPED: got.meta[UNCLIPPED]}  # no loss, no size
        seen.append(got.meta[UNCLIPPED])
    assert len(seen) == sum(len(r["clients"]) for r in a if "round" in r) and 0 in seen


def test_the_server_checks_the_clients_clipping_and_uses_no_reply_that_was_not_clipped():
    """What the clients clipped (client_reply with the bit), checked by ClientDP.arrived, gives the server the
    simulator's round (client_side: clipped there), bit for bit, adaptive clip included; a reply whose update is
    longer than the clip, or that carries statistics, is not used and says why."""
    gen = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(50, generator=gen), "n": torch.tensor(3)}
    raw = [(c, Message({"a": w["a"] + s * torch.randn(50, generator=gen), "n": torch.tensor(9)},
                       {"num_examples": 40 + c, "loss": 0.5})) for c, s in enumerate((0.01, 1.0, 5.0))]
    payloads = {c: Message(w, {}) for c, _ in raw}
    sim, fl = (ClientDP(1.0, 0.7, None, 1e-5, None, 10, 3, 5, quantile=0.5, count_noise=2.0) for _ in range(2))
    want = sim.server_side(sim.client_side(payloads, raw), torch.Generator().manual_seed(1))
    sent = [(c, client_reply(w, r, fl.clip, f"client {c}", bit=True)[0]) for c, r in raw]
    arrived, why = fl.arrived(payloads, sent)
    got = fl.server_side(arrived, torch.Generator().manual_seed(1))
    assert why == {} and [c for c, _ in got] == [c for c, _ in want]
    assert all(torch.equal(x.arrays[k], y.arrays[k]) and x.meta == y.meta == {"num_examples": 1}
               for (_, x), (_, y) in zip(got, want) for k in w)
    assert fl.clip == sim.clip != 1.0 and fl.record() == {**sim.record(), "dp_update_norm": None}
    bad = [(0, sent[0][1]), (1, Message(raw[1][1].arrays, {"num_examples": 1, UNCLIPPED: 1})),
           (2, Message(sent[2][1].arrays, {**sent[2][1].meta, "loss": 0.5}))]
    arrived, why = fl.arrived(payloads, bad)
    assert [c for c, _ in arrived] == [0] and set(why) == {1, 2}
    assert "passes the clip" in why[1] and "loss" in why[2] and "\n" not in why[1] + why[2]


def test_supernodes_with_their_own_data_run_dp_without_label_counts(tmp_path):
    """SuperNodes holding their own data (data-dir) under --dp client: the server knows no class totals, so GM has
    no group accuracies (said once) and --split fixed, which needs them, is one line; the run is the partition's."""
    over = dict(DP, clients=3, participation=1.0, rounds=2, eval_every=2)
    nodes = []
    for c in federation_for(small_config(**over)).clients:
        d = tmp_path / f"client{c.client_id}"
        d.mkdir()
        np.savez(d / "train.npz", x=c.x.numpy(), y=c.y.numpy())
        np.savez(d / "test.npz", x=c.test_x.numpy(), y=c.test_y.numpy())
        nodes.append({"data-dir": str(d), "client-id": c.client_id})
    said: list[str] = []
    st_d, _, s_d = run_inprocess(small_config(**over, out=str(tmp_path), name="dirs"), node_configs=nodes,
                                 echo=said.append)
    st_p, _, s_p = run_inprocess(small_config(**over, out=str(tmp_path), name="part"), **QUIET)
    assert sum("no many/medium/few" in x for x in said) == 1
    gd, gp = s_d["final"]["global"]["global"], s_p["final"]["global"]["global"]
    assert gd["acc"] == gp["acc"] and all(gd[g] is None for g in GROUPS) and gp["many"] is not None
    assert all(s_d["final"]["personal"]["global"][g] == s_p["final"]["personal"]["global"][g] for g in GROUPS)
    assert max(float((st_d.state.weights[k] - st_p.state.weights[k]).abs().max()) for k in st_p.state.weights) < 1e-5
    with pytest.raises(ConfigError, match="--split fixed") as e:
        run_inprocess(small_config(**over, split="fixed", out=str(tmp_path), name="fixed"), node_configs=nodes,
                      **QUIET)
    assert "\n" not in str(e.value) and not (tmp_path / "fixed").exists()


SAMPLE = dict(dp="sample", dp_clip=1.0, dp_epsilon=6.0, clients=4, participation=0.5, rounds=3, eval_every=3,
              local_epochs=1, threads=1)


@pytest.mark.parametrize("case", ["fedavg-secagg", "fedloge", "fedrod", "balancefl"])
def test_dp_sgd_on_flower_is_the_simulators_run_and_only_the_model_and_the_accountant_leave(tmp_path, case):
    """Each SuperNode solves its own noise for the target epsilon (the server's delta, its rounds in the schedule),
    trains by DP-SGD and sends its model, its size and its accountant's entries; the server's accountants give the
    simulator's epsilons, table and model bit for bit (FedLoGe: its phases and personal heads too; FedAvg through
    SecAgg+, each update weighted by its client's size; FedRoD: its loss on the client's class counts noised once, the
    release first in each accountant, which the server counted from the first reply's entries; BalanceFL: the same
    through its own local_train, which hands DP-SGD its described steps). Describe sends no
    label counts (a client of the partition not even its size: the server has it from the settings); the per-sample
    gradient norms stay on the clients."""
    pytest.importorskip("opacus")
    over = dict(SAMPLE, method=case) if case != "fedavg-secagg" else \
        dict(SAMPLE, method="fedavg", secagg=True, participation=1.0)
    if case == "balancefl":
        over["params"] = {"optimizer": "sgd", "feat_aug": False}
    sim = rundir.run(small_config(**over, out=str(tmp_path), name="sim"), progress=False, **QUIET)
    st, grid, fl = run_inprocess(small_config(**over, out=str(tmp_path), name="fl"), **QUIET)
    ref = load_final_state(tmp_path / "sim")["state"]
    got = load_final_state(tmp_path / "fl")["state"]
    assert all(torch.equal(got["weights"][k], ref["weights"][k]) for k in ref["weights"])
    a, b = _lines(tmp_path / "sim", "metrics.jsonl"), _lines(tmp_path / "fl", "metrics.jsonl")
    for key in ("dp_clipped", "dp_grad_norm"):
        assert all(r.pop(key) is not None for r in a if "round" in r)
        assert all(r.pop(key) is None for r in b if "round" in r)  # they stay on the clients
    assert a == b and fl["dp"] == sim["dp"] and _timeless(fl["final"]) == _timeless(sim["final"])
    _sent_beside(tmp_path / "sim", tmp_path / "fl", "dp_history")  # the accountant entries left them too
    assert fl["dp"]["epsilon"] <= 6.0 and len({c["noise_multiplier"] for c in fl["dp"]["clients"].values()}) > 1
    if case in ("fedrod", "balancefl"):  # every accountant begins with the counts' release, once
        assert all([h[:2] for h in c["history"]].count([5.0, 1.0]) == 1 and c["history"][0] == [5.0, 1.0, 1]
                   for c in fl["dp"]["clients"].values())
    for m in grid.replied:
        kind = m.metadata.message_type
        if kind == "query.describe":  # a client of the partition: the server has its size from the settings
            assert set(control(m.content)) == {"client-id", "partition"}
        elif kind == "evaluate":
            reports = json.loads(str(control(m.content)["reports"]))
            assert all(set(rep) - {"nonfinite"} == {"acc", *GROUPS} for rep in reports.values())
        elif kind.startswith("train") and case != "fedavg-secagg":  # (SecAgg+'s replies are masked vectors)
            meta = from_records(m.content).meta
            assert set(meta) == {"num_examples", "dp_history"}, meta
            assert kind == "train.phase" or meta["dp_history"]


def test_the_server_keeps_the_accountants_from_what_arrives_and_refuses_a_reply_without_entries():
    """SampleDP.arrived: the clients' entries continue their ledgers, merged as the step hook merges them (the epsilon of
    one client trained here equals the accountant's of the entries sent); a reply without entries, with other meta,
    or whose entries do not have the rate or noise its size and the run's settings give, is not used, in one line."""
    from fedlt.core.dpsgd import SampleDP
    from fedlt.core.dpsgd_accounts import epsilon_of
    from fedlt.core.dpsgd_wire import HISTORY

    dp = SampleDP(1.0, 1.0, None, 1e-5, [[0, 1, 2, 3, 4]], lambda: [100] * 5, batch_size=25)  # L = 4
    w = {"a": torch.zeros(3)}
    payloads = {c: Message(w, {}) for c in range(5)}
    for _ in range(2):
        replies = [(0, Message(w, {"num_examples": 100, HISTORY: [[1.0, 0.25, 4]]})),
                   (1, Message(w, {"num_examples": 100})),
                   (2, Message(w, {"num_examples": 100, HISTORY: [[1.0, 0.25, 4]], "loss": 0.3})),
                   (3, Message(w, {"num_examples": 100, HISTORY: [[1.0, 0.5, 4]]})),  # not its rate
                   (4, Message(w, {"num_examples": 100, HISTORY: [[2.0, 0.25, 4]]}))]  # not the run's noise
        out, why = dp.arrived(payloads, replies)
        assert [c for c, _ in out] == [0] and out[0][1].meta == {"num_examples": 100}
        assert set(why) == {1, 2, 3, 4} and HISTORY in why[1] and "loss" in why[2] and "1/4" in why[3]
        assert "noise multiplier 1" in why[4] and all("\n" not in x for x in why.values())
    a = dp.accounts
    assert a.histories[0] == [(1.0, 0.25, 8)] and a.steps_of[0] == 4 and set(a.histories) == {0}
    assert dp.epsilon(2) == epsilon_of(((1.0, 0.25, 8),), 1e-5)
    assert dp.record()["dp_grad_norm"] is None


def test_what_the_flower_engine_cannot_run_under_dp_is_one_line():
    """Simulated round times (they need each client's counts, which the SuperNodes do not send under --dp), a
    BatchNorm model under --dp sample, and Flower's own Strategy.start loop (the driver adds the noise and checks the
    clipping): refused, one line each."""
    from flwr.app import ArrayRecord, ConfigRecord

    from fedlt.config import RunConfig
    from fedlt.flower.strategy import FedltStrategy

    base = dict(dataset="digits", clients=4, dp_clip=1.0, dp_noise=1.0)
    for over, says in (({"dp": "sample", "model": "resnet8"}, "BatchNorm"),
                       ({"dp": "sample", "speed_sigma": 0.5}, "--speed-sigma"),
                       ({"dp": "client", "speed_sigma": 0.5}, "--speed-sigma")):
        with pytest.raises(ConfigError, match=says) as e:
            FedltStrategy(RunConfig(**base, **over), **QUIET)
        assert "\n" not in str(e.value)
    st = FedltStrategy(RunConfig(**base, dp="client"), **QUIET)
    with pytest.raises(ConfigError, match="Strategy.start"):
        st.configure_train(1, ArrayRecord(), ConfigRecord(), None)
