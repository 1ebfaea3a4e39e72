"""--finetune head | lora (fedlt.core.finetune): what trains is all a model's state dict holds, so only that leaves
a client; the frozen backbone is one object per process whose tensors every model shares; head's features are
computed once per sample; FFA-LoRA's aggregate is the mean of the clients' updates B A and FedIT's is not; every
method runs under head and lora or is refused in one line; kill -9 and --resume give the uninterrupted run.
No network: the pre-trained model is a tiny random ViT saved with ``save_pretrained`` (HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from conftest import method_test_params, run_killed, small_config, timeless, tiny_clip_files  # noqa: E402
from fedlt.config import validate  # noqa: E402
from fedlt.core import finetune  # noqa: E402
from fedlt.core.finetune import lora_gap, lora_pairs, shared_backbone, shared_lora  # noqa: E402
from fedlt.engine import EngineConfig, Simulation  # noqa: E402
from fedlt.engine.driver import TRAINING  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.plugins import method_class  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402
from fedlt.runner import rundir  # noqa: E402
from fedlt.runner.rundir import federation_for, prepare  # noqa: E402

ONE_ROUND = dict(rounds=1, eval_every=1, clients=4, participation=0.5, local_epochs=1)
WIDTH = 16  # the tiny ViT's
LIGHT = {"fedloge": {"sse_steps": 200}, "fedetf": {"pers_rounds": 2}, "creff": {"match_epochs": 5, "crt_epochs": 10}}


@pytest.fixture(scope="module")
def vit(tmp_path_factory) -> str:
    """``hf:DIR`` of a tiny random ViT (8x8 images, patches of 4, width 16, one block) in safetensors."""
    from transformers import ViTConfig, ViTModel

    os.environ["HF_HUB_OFFLINE"] = "1"
    d = tmp_path_factory.mktemp("tiny-vit")
    torch.manual_seed(0)
    ViTModel(ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=WIDTH, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=32)).save_pretrained(d)
    return f"hf:{d}"


_FEDS: dict = {}


def _prepared(vit, **over):
    cfg = small_config(**{**ONE_ROUND, "model": vit, **over})
    key = (cfg.clients, cfg.seed)
    if key not in _FEDS:
        _FEDS[key] = federation_for(cfg)
    validate(cfg)
    return prepare(cfg, _FEDS[key]), cfg


def _replies(sim) -> list:
    got = []
    sim.on_replies.append(lambda kind, i, replies: got.extend(replies) if kind == TRAINING else None)
    return got


def test_lora_models_hold_and_send_only_adapters_and_head(vit):
    pr, cfg = _prepared(vit, finetune="lora")
    keys = set(pr.method.new_model().state_dict())
    assert keys and all(k.startswith(("backbone.adapters.", "head.")) for k in keys)
    assert {k for k in keys if ".lora_A." in k} and {k for k in keys if ".lora_B." in k}
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    replies = _replies(sim)
    sim.run()
    assert replies and all(set(r.arrays) == keys for _, r in replies)
    # what leaves: r (in + out) per adapted layer (the ViT's query and value), and the head
    r, C = pr.spec.lora_rank, pr.spec.num_classes
    sent = sum(t.numel() for t in replies[0][1].arrays.values())
    assert sent == 2 * r * (WIDTH + WIDTH) + (WIDTH + 1) * C


def test_ffa_keeps_a_out_of_the_model(vit):
    pr, _ = _prepared(vit, finetune="lora", lora_agg="ffa")
    keys = set(pr.method.new_model().state_dict())
    assert {k for k in keys if ".lora_B." in k} and not {k for k in keys if ".lora_A." in k}


def test_models_share_the_frozen_backbone_storage(vit):
    pr, _ = _prepared(vit, finetune="lora")
    before = finetune.LOADS["count"]
    a, b = pr.method.new_model(), pr.method.new_model()
    assert finetune.LOADS["count"] == before  # no backbone loaded per model
    assert a.backbone.base is b.backbone.base is shared_lora(pr.spec)
    pre = dict(shared_backbone(pr.spec).net.named_parameters())
    base = {n: p for n, p in a.backbone.base.named_parameters() if "lora_" not in n}
    assert len(base) == len(pre)  # peft's layers wrap the same tensors: base_layer.weight is the loaded weight
    assert {p.data_ptr() for p in base.values()} == {p.data_ptr() for p in pre.values()}
    # each model's adapters are its own
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert all(pa[n].data_ptr() != pb[n].data_ptr() for n in pa)


def _round_replies(vit, agg):
    pr, cfg = _prepared(vit, finetune="lora", lora_agg=agg, lr=0.5, participation=1.0)
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    replies = _replies(sim)
    sim.train_round()
    return pr, sim, replies


@pytest.mark.parametrize("agg", ["ffa", "fedit"])
def test_ffa_aggregate_is_the_mean_of_the_updates_and_fedit_is_not(vit, agg):
    """Round 1 starts from B = 0, so a client's update of each adapted layer is B_k A_k; the server's aggregate
    gives mean(B) mean(A). FFA-LoRA: equal to mean_k(B_k A_k) to float precision; FedIT: not."""
    pr, sim, replies = _round_replies(vit, agg)
    base = finetune.base_adapters(pr.spec)
    weights = [float(r.meta["num_examples"]) for _, r in replies]
    updates = [lora_pairs(r.arrays, base) for _, r in replies]
    agg_pairs = lora_pairs(sim.state.weights, base)
    assert agg_pairs and set(agg_pairs) == set(updates[0])
    err = scale = 0.0
    for layer, (A, B) in agg_pairs.items():
        mean_update = sum(w * (u[layer][1] @ u[layer][0]) for u, w in zip(updates, weights)) / sum(weights)
        err = max(err, float((B @ A - mean_update).abs().max()))
        scale = max(scale, float(mean_update.abs().max()))
    gap = lora_gap([(r.arrays, r.meta["num_examples"]) for _, r in replies], base)
    assert scale > 0
    if agg == "ffa":
        assert err <= 1e-6 * scale and gap["relative"] < 1e-6
    else:
        assert err > 1e-4 * scale and gap["relative"] > 1e-4


def test_a_run_records_the_gap_each_round(vit, tmp_path):
    cfg = small_config(model=vit, finetune="lora", out=str(tmp_path), name="r", **{**ONE_ROUND, "rounds": 2})
    rundir.run(cfg, progress=False, echo=lambda *a: None)
    recs = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["lora_gap"] for r in recs if "round" in r]
    assert len(gaps) == 2 and all(g > 0 for g in gaps)
    sent = [json.loads(x) for x in (tmp_path / "r" / "sent.jsonl").read_text().splitlines()]
    for rnd in (1, 2):  # the adapters' part of the model's row: 2 layers' A and B, r (in + out) floats each
        model, part = [r for r in sent if r["round"] == rnd and r["sent"] == "<model>"]
        assert part["part"] == "LoRA adapters" and part["arrays"] == 4 and part["clients"] == model["clients"]
        assert part["bytes"] == 4 * model["clients"] * 2 * cfg.lora_rank * 2 * WIDTH < model["bytes"]


def test_head_encodes_each_sample_once(vit):
    """Two rounds of every client: the backbone runs over each training and test sample once (the first round
    and the evaluation), never in the second round."""
    pr, cfg = _prepared(vit, finetune="head", participation=1.0, rounds=2, eval_every=1)
    net = shared_backbone(pr.spec).net
    assert pr.spec.in_shape == (shared_backbone(pr.spec).feature_dim,)
    seen: list[int] = []
    hook = net.register_forward_hook(lambda m, i, o: seen.append(len(o)))
    try:
        sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
        sim.train_round()
        first = sum(seen)
        sim.train_round()
        assert sum(seen) == first  # the second round computed no feature
        sim.evaluate("final")
    finally:
        hook.remove()
    train = sum(len(c) for c in pr.fed.clients)
    tests = len(pr.fed.test_y)
    assert first == train  # every client's samples once
    assert train < sum(seen) <= train + tests + sum(len(c.test_y) for c in pr.fed.clients)
    assert sum(s.encoded for s in pr.fed.stores) == sum(seen)  # no sample encoded twice
    assert set(pr.method.new_model().state_dict()) == {"head.weight", "head.bias"}


def test_lora_bn_stats_frozen_by_default_and_local_kept_per_model(tmp_path):
    """smallcnn-bn under lora: by default no BatchNorm statistics in the model and the shared ones never move;
    --bn-stats local: each model's own, updated in training, and FedBN keeps them on its clients."""
    cfg = small_config(model="smallcnn-bn", finetune="lora", **ONE_ROUND)
    pr = prepare(cfg, federation_for(cfg))
    assert not [k for k in pr.method.new_model().state_dict() if "running" in k]
    shared = {k: v.clone() for k, v in shared_lora(pr.spec).state_dict().items() if "running" in k}
    Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False)).run()
    assert all(torch.equal(v, shared_lora(pr.spec).state_dict()[k]) for k, v in shared.items())
    for method, sends_bn in (("fedavg", True), ("fedbn", False)):
        cfg = small_config(model="smallcnn-bn", finetune="lora", bn_stats="local", method=method, **ONE_ROUND)
        validate(cfg)
        pr = prepare(cfg, federation_for(cfg))
        keys = [k for k in pr.method.new_model().state_dict() if "running_mean" in k]
        assert keys and all(k.startswith("backbone.bn.") for k in keys)
        sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
        replies = _replies(sim)
        sim.run()
        assert any(k in r.arrays for _, r in replies for k in keys) == sends_bn
        trained = replies[0][1].arrays if sends_bn else sim.client_state(replies[0][0])
        assert sends_bn or trained  # FedBN's client keeps them


@pytest.mark.parametrize("mode", ["head", "lora"])
@pytest.mark.parametrize("method", METHODS.names())
def test_every_method_runs_or_is_refused_in_one_line(vit, method, mode):
    params = {**method_test_params(method), **LIGHT.get(method, {}),
              **(tiny_clip_files(embed=WIDTH) if method == "clip2fl" else {})}  # its contrast: the ViT's width
    why = finetune.finetune_refusal(method_class(small_config(method=method)), mode)
    if why:
        with pytest.raises(ConfigError) as e:
            _prepared(vit, method=method, finetune=mode, params=params)
        assert "\n" not in str(e.value) and why in str(e.value) and method in str(e.value)
        return
    pr, cfg = _prepared(vit, method=method, finetune=mode, params=params)
    keys = set(pr.method.new_model().state_dict())
    frozen = {n for n, _ in shared_backbone(pr.spec).net.named_parameters()}
    assert not {k for k in keys for n in frozen if k.endswith("." + n) and ".adapters." not in k}
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    replies = _replies(sim)
    final = sim.run()
    assert replies and final
    for _, r in replies:  # nothing of the frozen backbone leaves a client
        assert not [k for k in r.arrays if any(k.endswith("." + n) for n in frozen) and ".adapters." not in k]


def test_kill_9_and_resume_with_lora_give_the_uninterrupted_run(vit, tmp_path):
    over = dict(method="ditto", finetune="lora", model=vit, rounds=3, eval_every=3, clients=4, local_epochs=1,
                out=str(tmp_path), threads=1, lora_dropout=0.1)
    ref = rundir.run(small_config(name="ref", **over), progress=False, echo=lambda *a: None)
    cfg = small_config(name="killed", **over)
    p = run_killed(cfg, kill_after=2)
    assert p.returncode == -9, p.stderr[-2000:]
    out = rundir.run(cfg, progress=False, echo=lambda *a: None, checkpoint_every=1, resume=True)
    assert out["resumed_after_round"] == 2
    rows = lambda name: [timeless(json.loads(x))  # noqa: E731
                         for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert rows("killed") == rows("ref") and timeless(out["final"]) == timeless(ref["final"])


@pytest.mark.parametrize("mode", ["head", "lora"])
def test_flower_runs_the_same_and_its_replies_hold_only_what_trains(vit, tmp_path, mode):
    """Flower's engine (in process): the simulation's weights, and the replies as in the simulation."""
    pytest.importorskip("flwr")
    from fedlt.flower.inprocess import run_inprocess

    over = dict(finetune=mode, model=vit, rounds=2, eval_every=2, clients=4, local_epochs=1)
    pr, cfg = _prepared(vit, **over)
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    sim.run()
    st, _, _ = run_inprocess(small_config(out=str(tmp_path), name="fl", **over), echo=lambda s: None)
    assert set(st.state["weights"]) == set(sim.state.weights) == set(pr.method.new_model().state_dict())
    for k, v in sim.state.weights.items():
        assert torch.allclose(v, st.state["weights"][k], atol=1e-6), k


def test_the_page_lists_every_refusal_the_methods_declare():
    """docs/finetune.md's table of refused methods is what the methods declare (finetune_needs)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "finetune.md").read_text()
    table = text.split("| method | refused under | why |")[1].split("\n\n")[0].splitlines()[2:]
    shown = {m: set(re.findall(r"`([^`]+)`", row.split("|")[2]))
             for row in table for m in re.findall(r"`([^`]+)`", row.split("|")[1])}
    declared = {m: {mode for mode in ("head", "lora") if finetune.finetune_refusal(METHODS.get(m), mode)}
                for m in METHODS.names()}
    assert shown == {m: modes for m, modes in declared.items() if modes}


@pytest.mark.parametrize("mode", ["head", "lora"])
def test_worker_processes_share_the_backbone_and_give_the_same_run(vit, tmp_path, mode):
    """--workers 2 (forked: the frozen backbone shared copy-on-write) ends with the weights of one process."""
    over = dict(finetune=mode, model=vit, rounds=2, eval_every=2, clients=4, local_epochs=1, threads=1,
                out=str(tmp_path), lora_dropout=0.1 if mode == "lora" else 0.0)
    states = []
    for workers in ("off", "2"):
        cfg = small_config(name=f"w{workers}", workers=workers, **over)
        rundir.run(cfg, progress=False, echo=lambda *a: None)
        from safetensors.torch import load_file

        states.append(load_file(str(tmp_path / f"w{workers}" / "final_state.safetensors")))
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@pytest.mark.parametrize("privacy", [dict(dp="client", dp_clip=1.0, dp_noise=0.5),
                                     dict(dp="sample", dp_clip=1.0, dp_noise=0.5), dict(secagg=True)],
                         ids=["dp-client", "dp-sample", "secagg"])
@pytest.mark.parametrize("mode", ["head", "lora"])
def test_dp_and_secagg_cover_exactly_what_trains(vit, mode, privacy):
    """Under --dp client, --dp sample (DP-SGD on the trainable parameters) and --secagg the replies hold the
    trainable entries only, and the round trains them (the server's state moves)."""
    pr, cfg = _prepared(vit, finetune=mode, participation=1.0, **privacy)
    keys = set(pr.method.new_model().state_dict())
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    before = {k: v.clone() for k, v in sim.state.weights.items()}
    replies = _replies(sim)
    sim.train_round()
    assert replies and all(set(r.arrays) <= keys for _, r in replies)
    assert set(sim.state.weights) == keys
    assert any(not torch.equal(before[k], sim.state.weights[k]) for k in keys)


def test_a_supernodes_own_data_is_encoded_under_head(vit, tmp_path):
    """A SuperNode serving its own directory (data-dir=DIR): the images are checked against the data's shape and
    its samples become the frozen backbone's features, as the partition's do."""
    pytest.importorskip("flwr")
    import numpy as np

    from fedlt.engine.flower.client import load_client_dir

    pr, _ = _prepared(vit, finetune="head")
    c0 = pr.fed.clients[0]
    raw = federation_for(small_config(**{**ONE_ROUND, "model": vit})).clients[0]
    np.savez(tmp_path / "train.npz", x=raw.x.numpy(), y=raw.y.numpy())
    own = finetune.feature_client(load_client_dir(str(tmp_path), 0, pr.spec, raw.prep), pr.spec)
    assert own.x.shape == (len(raw), WIDTH)
    assert torch.allclose(own.x, c0.x, atol=1e-5)  # the partition's client 0, encoded the same way


def _attention(net) -> set:
    """How the Hugging Face models a fedlt model runs attend (its LoRA backbone's shared base too)."""
    return {m.config._attn_implementation for m in finetune.run_modules(net) if hasattr(m, "set_attn_implementation")}


def test_dp_sgd_runs_hf_attention_eager_and_gives_the_shared_backbone_back_as_it_was(vit):
    """torch's vmap has no batching rule for scaled_dot_product_attention on a CPU, so DP-SGD's per-sample gradients
    ran a Hugging Face ViT's attention one sample at a time (torch warned of the performance drop): under --dp sample
    the round now attends "eager" while it trains, without that warning, and the process's shared backbone attends as
    before afterwards; eager and sdpa per-sample gradients are the same to float rounding."""
    import warnings

    from torch.func import functional_call, grad, vmap

    from fedlt.core.dpsgd import eager_attention

    pr, cfg = _prepared(vit, finetune="lora", participation=1.0, dp="sample", dp_clip=1.0, dp_noise=0.5)
    net = pr.method.new_model()
    assert _attention(net) == {"sdpa"}
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sim.train_round()
    assert not [w for w in seen if "performance drop" in str(w.message)], [str(w.message) for w in seen]
    assert _attention(net) == {"sdpa"} and _attention(pr.method.net) == {"sdpa"}

    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.arange(6) % pr.spec.num_classes
    params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}

    def loss(p, xi, yi):
        return torch.nn.functional.cross_entropy(functional_call(net, p, (xi[None],)), yi[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sdpa's fallback, which this compares against
        want = per_sample(params, x, y)
    with eager_attention(net) as switched:
        assert switched and _attention(net) == {"eager"}
        got = per_sample(params, x, y)
    assert _attention(net) == {"sdpa"}
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-5
