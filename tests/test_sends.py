"""What leaves the client (fedlt.core.privacy): every registered method's clients send exactly what its ``sends``
declares, in one round and its phases; an undeclared item stops the run with one line (FEDLT_CHECK_SENDS, which
conftest sets for the whole suite) or, without it, is recorded and said once; ``sent.jsonl`` records what left the
clients, bytes and all, and a resumed run appends to it; ``fedlt list`` and the generated page show the
declarations."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import _FEDS, HEAD_ONLY, dies_in_round, method_test_params, small_config, tiny_hf_vit
from fedlt.core.method import Message
from fedlt.core.privacy import (CATEGORIES, ENV, MODEL, SENT, UNDECLARED, Sent, categories_of, classify, exchange_of,
                                 sent, sends_with)
from fedlt.engine import EngineConfig, Simulation
from fedlt.errors import ConfigError
from fedlt.methods.fedavg import FedAvg
from fedlt.registry import METHODS
from fedlt.runner.rundir import Prepared, federation_for, prepare, run

ONE_ROUND = dict(rounds=1, eval_every=1, clients=4, participation=0.5, local_epochs=1)
# the same code paths, seconds less (tests/test_flower.py's FAST)
LIGHT = {"fedloge": {"sse_steps": 200}, "fedetf": {"pers_rounds": 2}, "creff": {"match_epochs": 5, "crt_epochs": 10}}
# declared items that the default parameters never send: (method, Sent name, when) -> the parameter that sends it
NON_DEFAULT = {("fedloge", "*", "la-fr"): "finetune_epochs > 0: the fine-tuning's loss",
               ("fedrela-loge", "*", "la-fr"): "finetune_epochs > 0: the fine-tuning's loss (FedLoGe's)"}


def _fed(cfg):
    key = (cfg.dataset, cfg.imbalance_ratio, cfg.alpha, cfg.clients, cfg.partition, cfg.seed)
    if key not in _FEDS:
        _FEDS[key] = federation_for(cfg)
    return _FEDS[key]


def _sim(method: str, params=None, **over):
    cfg = small_config(method=method, params={**method_test_params(method), **LIGHT.get(method, {}), **(params or {})},
                       **{**ONE_ROUND, **over})
    pr = prepare(cfg, _fed(cfg))
    return Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False)), cfg


@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_sends_what_it_declares(method):
    """One round and the post-training phases (strict: an undeclared item would stop the run); then every declared
    item that applies to an exchange that ran was sent there, and every phase a declaration names is one the
    method has."""
    sim, _ = _sim(method)
    seen: dict[str, set[str]] = {}  # exchange -> the declared names its replies matched

    def record(kind, index, replies):
        ex = exchange_of(kind)
        for _, msg in replies:
            rows = classify(sim.method, ex, msg)
            assert not [r for r in rows if r["category"] == UNDECLARED]  # strict mode raised already
            seen.setdefault(ex, set()).update(r["declared"] for r in rows)

    sim.on_replies.append(record)
    sim.run()
    assert "rounds" in seen and set(seen) == {"rounds", *sim.method.phases}
    cls = type(sim.method)
    for s in cls.sends:
        key = (method, s.name, s.when)
        if key in NON_DEFAULT:
            continue
        assert s.when in ("rounds", "*", *sim.method.phases), f"{method}: {s.name!r} is declared for {s.when!r}, " \
                                                              f"not one of its exchanges"
        applies = [ex for ex in seen if s.applies(ex)]
        assert any(s.name in seen[ex] for ex in applies), \
            f"{method} declares {s.name!r} ({s.category}) in {s.when}, but its clients never sent it there"


@pytest.mark.parametrize("method,params", [("fedloge", {"finetune_epochs": 1}), ("fedlf", {"loss": "distance"}),
                                           ("dfl-fs", {"select": "all"}), ("scaffold", {"option": "I"}),
                                           ("fedloge", {"send_fixed": True})])
def test_parameters_that_change_the_replies_stay_declared(method, params):
    """Parameters that change what the clients send (strict: an undeclared item stops the run)."""
    sim, _ = _sim(method, params)
    sim.run()


class Planted(FedAvg):
    """FedAvg whose clients also send an array it does not declare."""

    name = "planted"

    def local_reply(self, payload, cstate, data, out):
        msg, cstate = super().local_reply(payload, cstate, data, out)
        msg.arrays["proto.2"] = torch.zeros(10, 64)
        return msg, cstate


def _planted(tmp_path, name):
    cfg = small_config(method="fedavg", rounds=2, eval_every=2, out=str(tmp_path), name=name)
    fed = _fed(cfg)
    pr = prepare(cfg, fed)
    return cfg, Prepared(cfg, fed, Planted(pr.spec, FedAvg.Params()), pr.spec)


def test_undeclared_item_stops_the_run_with_one_line(tmp_path):
    cfg, pr = _planted(tmp_path, "strict")
    with pytest.raises(ConfigError) as e:
        run(cfg, progress=False, echo=lambda s: None, prepared=pr)
    clients = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False)).schedule[0]
    assert str(e.value) == (f"method planted's client {clients[0]} sent 'proto.2' (an array [10, 64]) in round 1, "
                            f"which Planted.sends does not declare: add a Sent for it (docs/privacy.md)")


def test_undeclared_item_without_the_check_is_recorded_and_said_once(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    cfg, pr = _planted(tmp_path, "lenient")
    said: list[str] = []
    run(cfg, progress=False, echo=said.append, prepared=pr)
    notes = [s for s in said if "does not declare" in s]
    assert len(notes) == 1 and "'proto.2'" in notes[0] and SENT in notes[0]
    rows = [json.loads(x) for x in (tmp_path / "lenient" / SENT).read_text().splitlines()]
    planted = [r for r in rows if r["sent"] == "proto.2"]
    assert [r["round"] for r in planted] == [1, 2]
    assert all(r["category"] == UNDECLARED and r["shape"] == [10, 64] and r["bytes"] == 10 * 64 * 4 * r["clients"]
               for r in planted)


def test_sent_record_of_a_fedavg_run(tmp_path):
    """sent.jsonl of 2 FedAvg rounds: per round the model (every state-dict entry, its bytes summed over the
    clients: metrics.jsonl's bytes up), the number of samples and the training statistics."""
    cfg = small_config(method="fedavg", rounds=2, eval_every=2, out=str(tmp_path), name="fedavg")
    run(cfg, progress=False, echo=lambda s: None, prepared=prepare(cfg, _fed(cfg)))
    out = tmp_path / "fedavg"
    rows = [json.loads(x) for x in (out / SENT).read_text().splitlines()]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"round"' in x]
    sd = FedAvg(prepare(cfg, _fed(cfg)).spec).net.state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    assert [(r["round"], r["sent"]) for r in rows] == [(rnd, s) for rnd in (1, 2)
                                                         for s in (MODEL, "num_examples", "*")]
    for r, m in zip(rows[::3], metrics):
        assert r == {"round": m["round"], "sent": MODEL, "category": "model", "arrays": len(sd),
                     "bytes": model_bytes * m["arrived"], "clients": m["arrived"]}
        assert r["bytes"] == m["bytes_up_per_client"] * m["arrived"]
    for r, m in zip(rows[1::3], metrics):
        assert r == {"round": m["round"], "sent": "num_examples", "category": "size", "values": 1, "shape": [],
                     "bytes": 8 * m["arrived"], "clients": m["arrived"]}
    assert all(r["category"] == "scalars" and r["values"] == 2 for r in rows[2::3])  # loss, steps


def test_resumed_run_appends_to_the_record(tmp_path):
    """A run killed before round 3 and resumed from its checkpoint of round 2 ends with the record of the
    uninterrupted run: the rounds before the checkpoint kept, a row the killed run wrote after it dropped."""
    over = dict(method="fedavg", rounds=3, eval_every=3, out=str(tmp_path))
    whole = small_config(**over, name="whole")
    run(whole, progress=False, echo=lambda s: None, prepared=prepare(whole, _fed(whole)))
    cut = small_config(**over, name="cut")
    with dies_in_round(Simulation, 3):
        run(cut, progress=False, echo=lambda s: None, prepared=prepare(cut, _fed(cut)), checkpoint_every=2)
    record = tmp_path / "cut" / SENT
    with open(record, "a") as f:  # as if the killed run had got round 3's replies before it died
        f.write(json.dumps({"round": 3, "sent": "stale", "category": "model", "arrays": 1, "bytes": 1,
                            "clients": 1}) + "\n")
    run(cut, progress=False, echo=lambda s: None, prepared=prepare(cut, _fed(cut)), checkpoint_every=2, resume=True)
    assert record.read_text() == (tmp_path / "whole" / SENT).read_text()


def test_categories_of_the_methods_the_issue_names():
    assert categories_of(METHODS.get("rucr"), "rounds") == ["model", "size", "scalars", "class-counts", "class-means"]
    assert categories_of(METHODS.get("rucr"), "phases") == ["model-part", "size", "class-counts", "class-means"]
    assert categories_of(METHODS.get("fednh")) == ["model", "size", "scalars", "class-counts", "class-means"]
    assert categories_of(METHODS.get("ccvr"), "phases") == ["size", "class-counts", "class-means", "class-moments"]
    assert categories_of(METHODS.get("creff")) == ["model", "size", "scalars", "class-counts", "class-gradients"]
    assert categories_of(METHODS.get("fedavg")) == ["model", "size", "scalars"]
    with pytest.raises(ValueError, match="category 'labels' is none of"):
        Sent("x", "labels", "what")


def test_a_sends_that_is_not_a_tuple_of_sent_is_refused():
    with pytest.raises(TypeError, match="Bad.sends must be a tuple"):
        type("Bad", (FedAvg,), {"sends": [Sent("x", "model", "w")]})


def test_sends_built_by_name_match_as_declared():
    """``sends_with``: the model entry replaced where it stands, a meta number placed before the statistics' "*"
    (which the matching, first declared first, would otherwise take for it), an array and a phase's item added, a
    named item left out; checked through the matching itself."""
    body = sent(MODEL, "model-part", "the trained body")
    a_norm, feats = sent("a_norm", "size", "a count", meta=True), sent("f.*", "features", "its features")
    tuned = sent("num_examples", "size", "its size", meta=True, when="tune")
    client = type("Client", (), {"sends": sends_with(FedAvg.sends, body, a_norm, feats, tuned)})()
    client.net = torch.nn.Linear(2, 2)
    t = torch.zeros(2)
    rows = {r["name"]: r["category"] for r in classify(client, "rounds", Message(
        {"weight": t, "f.x": t}, {"a_norm": 3, "loss": 0.5, "num_examples": 4}))}
    assert rows == {"weight": "model-part", "f.x": "features", "a_norm": "size", "loss": "scalars", "num_examples": "size"}
    assert [r["category"] for r in classify(client, "tune", Message({}, {"num_examples": 4}))] == ["size"]
    assert len(client.sends) == len(FedAvg.sends) + 3
    assert [s.name for s in sends_with(FedAvg.sends, without=(MODEL,))] == ["num_examples", "*"]


def test_classify_rows():
    sim, _ = _sim("rucr")
    m = sim.method
    msg = Message({"head.weight": torch.zeros(10, 128), "rucr.mean": torch.zeros(10, 128)},
                  {"num_examples": 5, "loss": 0.5, "note": "text"})
    rows = {r["name"]: r for r in classify(m, "rounds", msg)}
    assert rows["head.weight"]["declared"] == MODEL and rows["head.weight"]["bytes"] == 10 * 128 * 4
    assert rows["rucr.mean"]["category"] == "class-means"
    assert rows["loss"]["category"] == "scalars" and rows["note"]["category"] == UNDECLARED  # text is no number
    crt = {r["name"]: r for r in classify(m, "rucr-crt", msg)}
    assert crt["head.weight"]["category"] == "model-part" and crt["rucr.mean"]["category"] == UNDECLARED


def test_list_prints_the_declaration(capsys):
    from fedlt.cli import main

    assert main(["list", "creff"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("what leaves the client"):]
    assert "grad.[wb]" in table and "class-gradients" in table and "grad.classes" in table
    assert CATEGORIES["class-gradients"] in table and out.index("parameters") < out.index("what leaves the client")


def test_privacy_page_has_every_method():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
    try:
        import gen_reference
    finally:
        sys.path.pop(0)
    methods = list(METHODS.items())
    page = gen_reference.privacy_page(methods)
    for name, _ in methods:
        assert f"| [`{name}`](methods/{name}.md) |" in page
    for c, what in CATEGORIES.items():
        assert f"| {c} |" in page
    creff = next(line for line in page.splitlines() if line.startswith("| [`creff`]"))
    cells = [c.strip() for c in creff.split("|")[2:-1]]
    assert dict(zip(CATEGORIES, cells))["class-gradients"] == "R" and dict(zip(CATEGORIES, cells))["features"] == ""
    assert "## What leaves the client" in gen_reference.method_page("creff", METHODS.get("creff"))


@pytest.mark.parametrize("mode", ["client", "sample"])
def test_list_says_of_every_method_what_dp_then_accepts(capsys, tmp_path, mode):
    """`fedlt list METHOD`'s DP line is what --dp MODE does with the method: "yes" exactly where the configuration
    (with the parameters the line says it needs, ``--set K=V``) is not refused for DP's sake, and where it says yes
    a round runs under it (a server that reads what DP does not send -- FedNova's step weights, CLIMB's losses,
    SCAFFOLD's control variates -- once passed the first check and failed in its first round)."""
    pytest.importorskip("opacus")
    from fedlt.cli import main
    from fedlt.config import RunConfig, validate
    from fedlt.errors import ConfigError

    for name in METHODS.names():
        assert main(["list", name]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(f"{mode}-level DP"))
        try:
            needs = dict(x.split("=", 1) for x in re.findall(r"--set (\S+=\S+)", line))
            frozen = dict(finetune="head", model=tiny_hf_vit()) if name in HEAD_ONLY else {}  # where it can run
            validate(RunConfig(method=name, dp=mode, dp_clip=1.0, dp_noise=1.0, clients=10, params=needs, **frozen))
            refused = False
        except ConfigError as e:
            refused = "--dp" in str(e)
        assert line.split(": ", 1)[1].startswith("no" if refused else "yes"), (name, line)
        if not refused:  # a noise that the tiny federation's models survive: the point is the round's plumbing
            cfg = small_config(method=name, params={**method_test_params(name), **needs}, dp=mode, dp_clip=1.0,
                               dp_noise=0.05 if mode == "client" else 0.5, rounds=1, eval_every=1, local_epochs=1, clients=4, threads=1,
                               participation=1.0 if mode == "client" else 0.5, out=str(tmp_path), name=name)
            run(cfg, progress=False, echo=lambda *a: None)
