"""--dp-noise-seed: the DP noise from the run's seed (reproducible by whoever knows the seed, which config.json
records) or from a secret key (fedlt.core.noise.new_key): kept in the checkpoints only, so that a resumed run draws
the noise the uninterrupted one would, and in no file of a finished run; a Flower SuperNode's DP-SGD noise from a
key of its own (fedlt.engine.flower.records.node_noise_key), which never leaves it."""
from __future__ import annotations

import json
import os
import stat

import pytest
import torch

pytest.importorskip("dp_accounting")

from conftest import dies_in_round, small_config  # noqa: E402
from fedlt.core import noise as dpmod  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.runner import rundir  # noqa: E402
from fedlt.runner.runstate import load_final_state  # noqa: E402

QUIET = dict(progress=False, echo=lambda *a: None)
LEVELS = {"client": dict(dp="client", dp_clip=0.5, dp_noise=1.0, clients=6, participation=0.5),
          "sample": dict(dp="sample", dp_clip=1.0, dp_noise=1.0)}
K1, K2, K3 = ("%064x" % (i * 0x1234567890ABCDEF987) for i in (1, 2, 3))


def _weights(run_dir):
    return load_final_state(run_dir)["state"]["weights"]


def _same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("level", list(LEVELS))
def test_the_secret_key_decides_the_noise_resume_keeps_it_and_no_file_of_the_finished_run_holds_it(
        tmp_path, monkeypatch, level):
    """With the run's seed the noise is a function of the seed (two runs agree: anyone with config.json can redraw
    it); with --dp-noise-seed secret it is the key's: two keys, two models from one seed. A run killed in round 3
    and resumed ends as the uninterrupted run with its key -- though the resumed process would draw another key,
    the checkpoint's wins -- and the key is in no file of either finished run directory."""
    from fedlt.engine.driver import Driver

    pytest.importorskip("opacus")
    keys = iter([K1, K2, K1, K3])  # the runs "a", "b", "cut" and the resumed "cut" draw these in turn
    monkeypatch.setattr(dpmod, "new_key", lambda: next(keys))
    over = dict(LEVELS[level], rounds=4, eval_every=2, local_epochs=1, threads=1)
    for name in ("s1", "s2"):
        rundir.run(small_config(**over, out=str(tmp_path), name=name), **QUIET)
    for name in ("a", "b"):
        rundir.run(small_config(**over, dp_noise_seed="secret", out=str(tmp_path), name=name), **QUIET)
    cfg = small_config(**over, dp_noise_seed="secret", out=str(tmp_path), name="cut")
    with dies_in_round(Driver, 3):
        rundir.run(cfg, checkpoint_every=1, **QUIET)
    out = rundir.run(cfg, checkpoint_every=1, resume=True, **QUIET)
    assert out["resumed_after_round"] == 2 and next(keys, None) is None  # every key above was drawn
    w = {n: _weights(tmp_path / n) for n in ("s1", "s2", "a", "b", "cut")}
    assert _same(w["s1"], w["s2"]) and not _same(w["a"], w["s1"]) and not _same(w["a"], w["b"])
    assert _same(w["cut"], w["a"])  # K1's noise in every round, also in those after the resume
    assert out["dp"]["noise_seed"].startswith("secret") and out["dp"] == {**out["dp"], "noise_seed":
                                                                           dpmod.NOISE_SEEDS["secret"]}
    for run in ("a", "cut"):
        for f in (tmp_path / run).rglob("*"):
            if f.is_file():
                assert K1.encode() not in f.read_bytes(), f


def test_the_key_and_the_round_give_unrelated_seeds_and_a_damaged_key_is_one_line():
    a = dpmod.noise_generator(K1, 0, 14, 1, 0)
    b = dpmod.noise_generator(K1, 0, 14, 2, 0)
    c = dpmod.noise_generator(K2, 0, 14, 1, 0)
    same = dpmod.noise_generator(K1, 99, 14, 1, 0)  # the run's seed plays no part
    seeds = {g.initial_seed() for g in (a, b, c)}
    assert len(seeds) == 3 and same.initial_seed() == a.initial_seed()
    assert dpmod.noise_generator(None, 5, 14, 1, 0).initial_seed() != dpmod.noise_generator(None, 6, 14, 1, 0) \
        .initial_seed()
    assert len(dpmod.new_key()) == 64 and dpmod.new_key() != dpmod.new_key()
    with pytest.raises(ConfigError, match="64 hex digits") as e:
        dpmod.keyed_seed(K1[:40], 1)
    assert "\n" not in str(e.value)


def test_a_supernode_keeps_its_own_key_in_its_state_dir_and_memory(tmp_path):
    """The key a SuperNode draws for a run is written once to its --state-dir (owner-only) and kept in its memory
    (context.state): a ClientApp process of a later message (a fresh context) reads the same; another run gets
    another; without a --state-dir the memory keeps it; a damaged file is one line."""
    pytest.importorskip("flwr")
    from flwr.app import RecordDict

    from fedlt.engine.flower.records import NOISE_KEY, node_noise_key

    mem = RecordDict()
    k = node_noise_key(mem, tmp_path, "r1")
    f = tmp_path / "run-r1" / NOISE_KEY
    assert f.read_text() == k and stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert node_noise_key(RecordDict(), tmp_path, "r1") == k == node_noise_key(mem, tmp_path, "r1")
    assert node_noise_key(RecordDict(), tmp_path, "r2") != k
    alone = RecordDict()
    m = node_noise_key(alone, None, "r1")
    assert m != k and node_noise_key(alone, None, "r1") == m and node_noise_key(alone, None, "r3") != m
    f.write_text("not a key")
    with pytest.raises(ConfigError, match="damaged") as e:
        node_noise_key(RecordDict(), tmp_path, "r1")
    assert "\n" not in str(e.value)


def test_supernodes_draw_their_dp_sgd_noise_from_their_own_keys_and_send_none(tmp_path):
    """--dp sample --dp-noise-seed secret on the Flower engine: the SuperNodes' keys, not the run's seed, decide the
    noise (two runs from one seed differ, and differ from the simulator's), the accountants are the simulator's
    (the noise's size is the same), and no message a SuperNode sends holds its key."""
    pytest.importorskip("flwr")
    pytest.importorskip("opacus")
    from fedlt.flower.inprocess import run_inprocess
    from fedlt.engine.flower.records import NOISE_KEY

    over = dict(dp="sample", dp_clip=1.0, dp_noise=1.0, clients=4, participation=0.5, rounds=2, eval_every=2,
                local_epochs=1, threads=1)
    sim = rundir.run(small_config(**over, out=str(tmp_path), name="sim"), **QUIET)
    runs = [run_inprocess(small_config(**over, dp_noise_seed="secret", out=str(tmp_path), name=n),
                          echo=lambda *a: None) for n in ("f1", "f2")]
    w = {n: _weights(tmp_path / n) for n in ("sim", "f1", "f2")}
    assert not _same(w["f1"], w["sim"]) and not _same(w["f1"], w["f2"])
    for _, grid, summary in runs:
        assert {k: v for k, v in summary["dp"].items() if k not in ("noise_seed", "noise_source")} == \
            {k: v for k, v in sim["dp"].items() if k not in ("noise_seed", "noise_source")}
        keys = {str(c.state[NOISE_KEY]["key"]) for c in grid.contexts.values() if NOISE_KEY in c.state}
        assert len(keys) == len(summary["dp"]["clients"]) > 1  # each node that trained, with a key of its own
        sent = b"".join(repr(m.content).encode() for m in grid.replied)
        assert not any(k.encode() in sent for k in keys)


def test_the_noise_seeds_default_is_the_engines_run_where_fedlt_runs_every_client_secret_on_a_deployment():
    """--dp-noise-seed's default is a value derived from where the clients run (core.noise.ENGINE_DEFAULT), not text:
    run for fedlt run / inprocess / simulate, secret for a deployment; a given one wins either way. The ServerApp that
    `flwr run` starts (the app `fedlt flower run` writes) serves as a deployment, Flower's simulation does not."""
    pytest.importorskip("flwr")
    from fedlt.config import RunConfig
    from fedlt.flower import server_app
    from fedlt.flower.settings import flatten, to_run_config

    assert [dpmod.noise_seed(None, d) for d in (False, True)] == ["run", "secret"]
    assert [dpmod.noise_seed(c, d) for c in ("run", "secret") for d in (False, True)] == ["run"] * 2 + ["secret"] * 2
    assert RunConfig().dp_noise_seed is None and dpmod.noise_key(RunConfig(dp="client")) is None
    assert len(dpmod.noise_key(RunConfig(dp="client"), deployed=True)) == 64
    seen = {}

    class Strategy:  # what the deployment's ServerApp hands the strategy
        def __init__(self, cfg, *a, deployed=False, **k):
            seen["deployed"] = deployed

        def run(self, *a, **k):
            return {}

    class Context:
        run_config = flatten(to_run_config(RunConfig(dp="sample", dp_clip=1.0, dp_noise=1.0, clients=2)))

    old = server_app.FedltStrategy
    server_app.FedltStrategy = Strategy
    try:
        server_app.main(None, Context())
        assert seen == {"deployed": True}
        server_app.serve(None, Context(), deployed=False)
        assert seen == {"deployed": False}
    finally:
        server_app.FedltStrategy = old


@pytest.mark.parametrize("given", [None, "run"])
def test_on_a_deployment_each_supernode_draws_its_dp_sgd_noise_from_its_own_key_unless_run_is_asked_for(
        tmp_path, given):
    """--dp sample served as a deployment (the in-process grid, its server a deployment's): by default each SuperNode's
    key source -- its --state-dir's run-<id>/fedlt.dp-noise-key -- holds a key of its own, the model is not the
    simulator's, and the privacy line says where the noise came from; with --dp-noise-seed run asked for, no
    SuperNode draws a key, the model is the simulator's and the line says the server can subtract the noise."""
    pytest.importorskip("flwr")
    pytest.importorskip("opacus")
    from fedlt.flower.inprocess import run_inprocess
    from fedlt.engine.flower.records import NOISE_KEY

    over = dict(dp="sample", dp_clip=1.0, dp_noise=1.0, clients=4, participation=0.5, rounds=2, eval_every=2,
                local_epochs=1, threads=1)
    sim = rundir.run(small_config(**over, out=str(tmp_path), name="sim"), **QUIET)
    nodes = [{"partition-id": i, "state-dir": str(tmp_path / f"node{i}")} for i in range(4)]
    _, grid, summary = run_inprocess(small_config(**over, dp_noise_seed=given, out=str(tmp_path), name="dep"),
                                     node_configs=nodes, echo=lambda *a: None, deployed=True)
    keys = {p.parent.parent.name: p.read_text() for p in tmp_path.glob(f"node*/run-*/{NOISE_KEY}")}
    trained = {f"node{c}" for c in summary["dp"]["clients"]}
    line = rundir.format_summary(summary).splitlines()[-1]
    same = _same(_weights(tmp_path / "sim"), _weights(tmp_path / "dep"))
    if given is None:
        assert set(keys) == trained and len(set(keys.values())) == len(trained) > 1 and not same
        assert "each SuperNode's noise drawn from a secret key of its own" in line
    else:
        assert not keys and not any(NOISE_KEY in c.state for c in grid.contexts.values()) and same
        assert "noise drawn from --seed, as --dp-noise-seed run asks: the server knows it and can subtract" in line
    assert json.loads((tmp_path / "dep" / "config.json").read_text())["dp_noise_seed"] == given
    assert "noise drawn from --seed (reproducible)" in rundir.format_summary(sim).splitlines()[-1]
