"""What a Flower client sends, held item by item to what ``fedlt list`` declares: every reply an in-process Flower
client sends (describe, train, phase, evaluate) is captured as it crosses the grid; each of its records is either
the method's message (every array and meta value matched to the method's ``sends``) or the engine's ``fedlt``
record (every field matched to the Flower engine's items as ``fedlt list`` prints them, for the reply's message, the
run's ``--dp`` mode and whether the SuperNode holds its own data); every item declared for what ran was sent, in its
form; and ``sent.jsonl`` records the engine's items with the categories declared. FedAvg (two rounds: its first
evaluation rides in a ``train.evaluate`` message), CReFF (class gradients), FedLoGe (post-training phases), each with SuperNodes of both kinds (their own data, a client of the partition), and
FedAvg's ``--dp client`` and ``--dp sample`` forms."""
from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("flwr")

from conftest import _FEDS, method_test_params, small_config  # noqa: E402
from fedlt.core.privacy import UNDECLARED, classify, engine_match  # noqa: E402
from fedlt.flower.inprocess import run_inprocess  # noqa: E402
from fedlt.engine.flower.records import control, from_records  # noqa: E402
from fedlt.engine.flower.sends import (DESCRIBE, ENGINE, EVALUATE, PHASE, SENDS, TITLE, TRAIN,  # noqa: E402
                                       TRAIN_EVALUATE, fields_of)
from fedlt.runner.rundir import federation_for  # noqa: E402

QUIET = dict(echo=lambda *a: None)
LIGHT = {"fedloge": {"sse_steps": 200}, "creff": {"match_epochs": 5, "crt_epochs": 10}}
RUN = dict(clients=4, participation=1.0, rounds=1, eval_every=1, local_epochs=1, threads=1)
OWN = (0, 1)  # the clients whose SuperNodes hold their own data (data-dir); the others serve a partition-id
METHOD_RECORDS = {"arrays", "meta", "meta-arrays", "config"}  # the method's message (records.to_records)
NEVER_IN_A_HEALTHY_RUN = {"reports.*.nonfinite"}  # sent only where a personal model outputs non-finite values


def listed(method: str, capsys) -> list[dict]:
    """The Flower engine's items as ``fedlt list METHOD`` prints them: its table's columns, read at the header's
    offsets (message and dp split into lists)."""
    from fedlt.cli import main

    assert main(["list", method]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"{TITLE}:"))
    header = lines[start + 1]
    cols = ["message", "name", "dp", "nodes", "category"]
    at = [header.index(c) for c in cols] + [None]
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("  "):
            break
        if ln[: at[1]].strip():  # an item's line (the next, indented to the name, says what it is)
            r = {c: ln[at[i]:at[i + 1]].strip() for i, c in enumerate(cols)}
            rows.append({**r, "message": r["message"].split(", "), "dp": r["dp"].split(", ")})
    assert rows
    return rows


def declared_for(rows: list[dict], message: str, name: str, dp: str, own: bool) -> dict | None:
    """The listed row that covers field ``name`` of a ``message`` reply (as fedlt.core.privacy.engine_match)."""
    from fnmatch import fnmatchcase

    for r in rows:
        if message in r["message"] and (r["dp"] == ["any"] or dp in r["dp"]) and (own or r["nodes"] == "any") \
                and fnmatchcase(name, r["name"]):
            return r
    return None


def _nodes(cfg, tmp_path) -> list[dict]:
    key = (cfg.dataset, cfg.imbalance_ratio, cfg.alpha, cfg.clients, cfg.partition, cfg.seed)
    if key not in _FEDS:
        _FEDS[key] = federation_for(cfg)
    nodes = []
    for c in _FEDS[key].clients:
        if c.client_id not in OWN:
            nodes.append({"partition-id": c.client_id})
            continue
        d = tmp_path / f"client{c.client_id}"
        d.mkdir()
        np.savez(d / "train.npz", x=c.x.numpy(), y=c.y.numpy())
        np.savez(d / "test.npz", x=c.test_x.numpy(), y=c.test_y.numpy())
        nodes.append({"data-dir": str(d), "client-id": c.client_id})
    return nodes, _FEDS[key]


def _captured(method: str, tmp_path, capsys, **over):
    """The run over SuperNodes of both kinds; every reply held to the listed declaration. Returns what was seen:
    {(message, listed name)} of the engine's items, and the run."""
    cfg = small_config(method=method, params={**method_test_params(method), **LIGHT.get(method, {})},
                       out=str(tmp_path), name="fl", **{**RUN, **over})
    nodes, fed = _nodes(cfg, tmp_path)
    st, grid, _ = run_inprocess(cfg, node_configs=nodes, **QUIET)
    rows = listed(method, capsys)
    asked = {m.metadata.message_id: m for m in grid.delivered}
    seen: set[tuple[str, str]] = set()
    kinds = set()
    for m in grid.replied:
        assert not m.has_error(), m.error
        message = m.metadata.message_type.removeprefix("query.")
        kinds.add(message)
        ctl = dict(control(m.content))
        cid = int(ctl["client-id"])
        own = cid in OWN
        assert set(m.content) <= METHOD_RECORDS | {"fedlt"}, (message, set(m.content))  # no other record crosses
        # the method's message: its declaration (a describe or evaluation reply carries none)
        fm = from_records(m.content)
        if message in (DESCRIBE, EVALUATE):
            assert not fm.arrays and not fm.meta and not fm.config, (message, fm)
        else:
            ex = "rounds" if message in (TRAIN, TRAIN_EVALUATE) else str(control(asked[m.metadata.reply_to_message_id].content)["phase"])
            got = classify(st.method, ex, fm)
            assert not [r for r in got if r["category"] == UNDECLARED], (message, got)
            for r in got:  # the engine's own meta values riding in the method's message (fedlt list: "meta: NAME")
                row = declared_for(rows, message, f"meta: {r['name']}", cfg.dp, own)
                if row is not None:
                    assert row["category"] == r["category"]
                    seen.add((message, row["name"]))
            assert not fm.config  # a reply echoes no per-round config
        # the engine's fields: each one declared for this message, --dp mode and kind of SuperNode
        for name, value in fields_of(message, ctl).items():
            row = declared_for(rows, message, name, cfg.dp, own)
            assert row is not None, f"{method} --dp {cfg.dp}: client {cid} sent {name!r} in its {message} reply, " \
                                    f"which `fedlt list` does not declare for it"
            e = engine_match(SENDS, message, name, cfg.dp, own)
            assert e is not None and (e.name, e.category) == (row["name"], row["category"])  # the list is the code's
            seen.add((message, row["name"]))
            if name == "counts":  # its form: the client's label counts, [C]
                assert value == [int(c) for c in fed.clients[cid].counts]
            if name == "num-examples":
                assert value == len(fed.clients[cid])
        if message == DESCRIBE and not own:  # a client of the partition: nothing of its data
            assert set(ctl) == {"client-id", "partition"} and ctl["partition"] is True
    # every declared item that applies to what ran was sent
    for r in rows:
        for message in set(r["message"]) & kinds:
            if (r["dp"] == ["any"] or cfg.dp in r["dp"]) and r["name"] not in NEVER_IN_A_HEALTHY_RUN:
                assert (message, r["name"]) in seen, f"{method} --dp {cfg.dp}: {r['name']} is declared for " \
                                                     f"{message} replies but no client sent it"
    # sent.jsonl: the engine's items with their categories, as captured
    lines = [json.loads(x) for x in (tmp_path / "fl" / "sent.jsonl").read_text().splitlines()]
    recorded = {(r["message"], r["sent"], r["category"]) for r in lines if r.get("engine") == ENGINE}
    fields_seen = {(msg, n) for msg, n in seen if not n.startswith("meta: ")}
    assert {(msg, n) for msg, n, _ in recorded} == fields_seen
    assert all(c == next(x["category"] for x in rows if x["name"] == n) for _, n, c in recorded)
    return seen, kinds, st


@pytest.mark.parametrize("method", ["fedavg", "creff", "fedloge"])
def test_every_reply_of_a_flower_client_is_what_fedlt_list_declares(tmp_path, capsys, method):
    # FedAvg over two rounds: round 1's evaluation rides in round 2's training message (train.evaluate)
    seen, kinds, st = _captured(method, tmp_path, capsys, **({"rounds": 2} if method == "fedavg" else {}))
    assert (TRAIN_EVALUATE in kinds) == (method == "fedavg")
    assert {DESCRIBE, TRAIN, EVALUATE} <= kinds and (PHASE in kinds) == bool(st.method.phases)
    # the own-data SuperNodes' describe form without --dp: counts and both sizes; the group accuracies go back
    assert {(DESCRIBE, "counts"), (DESCRIBE, "test-size"), (DESCRIBE, "num-examples"),
            (EVALUATE, "reports.*.few")} <= seen
    # the server knows every client's counts: from the settings for a partition client, from the reply otherwise
    part = json.loads((tmp_path / "fl" / "partition.json").read_text())
    assert np.array_equal(part["client_class_counts"], st.fed.counts) and st.fed.counts.sum() > 0


@pytest.mark.parametrize("dp", ["client", "sample"])
def test_the_dp_forms_of_a_flower_clients_replies_are_what_fedlt_list_declares(tmp_path, capsys, dp):
    """Under --dp the describe reply says no label counts (under --dp sample an own-data SuperNode's size only) and
    the engine's meta value rides in the training replies (the clipping bit, the accountant's entries)."""
    if dp == "sample":
        pytest.importorskip("opacus")
    pytest.importorskip("dp_accounting")
    seen, _, _ = _captured("fedavg", tmp_path, capsys, dp=dp, dp_clip=1.0, dp_noise=1.0,
                           participation=0.5 if dp == "sample" else 1.0)
    assert (DESCRIBE, "counts") not in seen and (DESCRIBE, "test-size") not in seen
    assert ((DESCRIBE, "num-examples") in seen) == (dp == "sample")
    assert (TRAIN, "meta: dp_unclipped" if dp == "client" else "meta: dp_history") in seen
