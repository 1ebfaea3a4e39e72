"""FedLoGe: realignment formulas, privacy of the local heads, masking, the frozen classifier, learning."""
import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from fedlt.core import Message, RunSpec  # noqa: E402
from fedlt.core.etf import cached_fixed_classifier  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.methods.fedloge import FedLoGe, ga_fr, la_fr  # noqa: E402
from fedlt.metrics import features  # noqa: E402

HOOKS = ("configure", "local_train", "phase_configure", "phase_client", "eval_payload", "init_client")


def _record(run_small, params=None, **over):
    """Run FedLoGe on the small federation with every Message (and every version of every client state)
    recorded, by wrapping the hooks on the class."""
    log = {"messages": [], "cstates": [], "fixed_at_init": None}
    orig = {h: getattr(FedLoGe, h) for h in HOOKS + ("init_server",)}

    def wrap(name):
        f = orig[name]

        def hook(self, *a, **k):
            out = f(self, *a, **k)
            if isinstance(out, Message):
                log["messages"].append((name, out))
            elif isinstance(out, tuple):  # (reply, client state)
                log["messages"].append((name, out[0]))
                log["cstates"].append(out[1])
            else:  # init_client: a client state
                log["cstates"].append(out)
            return out

        return hook

    def init_server(self):
        state = orig["init_server"](self)
        log["fixed_at_init"] = self.fixed_head()[0].clone()
        return state

    try:
        for h in HOOKS:
            setattr(FedLoGe, h, wrap(h))
        FedLoGe.init_server = init_server
        sim, final = run_small("fedloge", params or {}, **over)
    finally:
        for h, f in orig.items():
            setattr(FedLoGe, h, f)
    return sim, final, log


@pytest.fixture(scope="module")
def trained():
    from conftest import run_small

    return _record(run_small)


def _spec(**over):
    return RunSpec(model="smallcnn", in_shape=(1, 8, 8), num_classes=10, **over)


def _method(**params):
    return FedLoGe(_spec(), FedLoGe.make_params(params))


# ------------------------------------------------------------------------------------------- formulas
def test_ga_fr_equalises_norms_and_keeps_directions():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 32, generator=g) * torch.linspace(0.2, 5.0, 10)[:, None]  # long-tailed norms
    for target in (1.0, 1.7):
        out = ga_fr(w, target)
        assert torch.allclose(out.norm(dim=1), torch.full((10,), target), atol=1e-5)
        assert torch.allclose(torch.cosine_similarity(out, w, dim=1), torch.ones(10), atol=1e-5)


def test_ga_fr_phase_paper_and_official_variants():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(10, 128, generator=g) * torch.arange(1, 11)[:, None], torch.randn(10, generator=g)
    tree = {"weights": {"head.weight": w, "head.bias": b}}
    m = _method()
    paper = m.phase_aggregate("ga-fr", m.server_state(dict(tree)), []).generic
    assert torch.allclose(paper["weight"].norm(dim=1), torch.ones(10), atol=1e-5)
    assert torch.count_nonzero(paper["bias"]) == 0  # Eq. 6: the class vectors only
    m = _method(realign="official")
    official = m.phase_aggregate("ga-fr", m.server_state(dict(tree)), []).generic
    assert torch.allclose(official["weight"].norm(dim=1), torch.full((10,), 1.7), atol=1e-5)
    assert torch.equal(official["bias"], b)  # the official code keeps the trained bias


def test_la_fr_rows_have_local_norms():
    g = torch.Generator().manual_seed(2)
    psi = torch.randn(10, 32, generator=g) * torch.linspace(0.5, 3.0, 10)[:, None]
    phi = torch.randn(10, 32, generator=g) * torch.rand(10, 1, generator=g) * 4
    out = la_fr(psi, phi)
    assert torch.allclose(out.norm(dim=1), phi.norm(dim=1), atol=1e-5)
    assert torch.allclose(torch.cosine_similarity(out, psi, dim=1), torch.ones(10), atol=1e-5)
    raw = la_fr(psi, phi, normalize=False)  # official: psi_c * ||phi_k,c|| with the raw psi
    assert torch.allclose(raw, psi * phi.norm(dim=1, keepdim=True))


def test_la_fr_phase_on_trained_clients(trained):
    sim, _, _ = trained
    psi = sim.state["weights"]["head.weight"]
    for cid, cs in sim.client_states.items():
        rw = cs["realigned.weight"]
        assert torch.allclose(rw.norm(dim=1), cs["phi.weight"].norm(dim=1), rtol=1e-5, atol=1e-6)
        assert torch.allclose(torch.cosine_similarity(rw, psi, dim=1), torch.ones(len(rw)), atol=1e-5)
        assert torch.count_nonzero(cs["realigned.bias"]) == 0


# ------------------------------------------------------------------------------------------- privacy
def test_local_heads_never_in_any_message(trained):
    sim, _, log = trained
    kinds = {name for name, _ in log["messages"]}
    assert {"configure", "local_train", "phase_configure", "phase_client", "eval_payload"} <= kinds
    private = [t for cs in log["cstates"] for k, t in cs.items() if k.startswith(("phi.", "realigned."))]
    assert len(private) > 2 * len(sim.client_states)  # initial, per-round and realigned versions
    C = sim.fed.num_classes
    for name, msg in log["messages"]:
        for key, arr in msg.arrays.items():
            assert not key.startswith(("phi", "realigned")), (name, key)
            for t in private:
                assert not (arr.shape == t.shape and torch.equal(arr, t)), (name, key)
        for key, v in msg.meta.items():  # no per-class vector (e.g. local norms) rides in the meta either
            assert not (isinstance(v, (list, tuple, np.ndarray, torch.Tensor)) and len(v) == C), (name, key)


# ------------------------------------------------------------------------------------------- masking
def test_masking_removes_classes_absent_from_training_data(trained):
    sim, _, _ = trained
    m = sim.method
    client = sim.fed.clients[0]
    cs = sim.client_states[0]

    class Partial:  # the client with some of its training classes gone: only .classes is read
        classes = client.classes[::2]

    payload = m.eval_payload(sim.state, 0)
    h = torch.rand(64, m.feature_dim) * 3  # non-negative features, like the backbone's
    absent = np.setdiff1d(np.arange(sim.fed.num_classes), Partial.classes)
    assert len(absent) > 0
    for mode, pred in m.personal_model(payload, cs, Partial).items():
        logits = pred.head(h)
        assert torch.isneginf(logits[:, absent]).all(), mode
        assert torch.isfinite(logits[:, Partial.classes]).all(), mode
        assert np.isin(logits.argmax(1).numpy(), Partial.classes).all(), mode
    m.p.mask_absent = False
    try:
        assert all(torch.isfinite(p.head(h)).all() for p in m.personal_model(payload, cs, Partial).values())
    finally:
        m.p.mask_absent = True


# ------------------------------------------------------------------------------------------- SSE-C
def test_fixed_classifier_bit_identical_through_training(trained):
    sim, _, log = trained
    m = sim.method
    kind, beta, opts = m.fixed_spec()
    fresh = cached_fixed_classifier(m.spec.cache_dir, kind, m.feature_dim, m.spec.num_classes, beta,
                                    seed=m.spec.seed, **opts)
    W, b = m.fixed_head()
    assert torch.equal(W, log["fixed_at_init"]) and torch.equal(W, fresh)
    assert not W.requires_grad and W.grad is None and torch.count_nonzero(b) == 0
    assert abs((W == 0).double().mean().item() - 0.6) < 1e-3  # the SSE-C default: beta 0.6
    feats = torch.rand(5, m.feature_dim)
    assert torch.equal(m.global_model(sim.state)["universal"].head(feats), feats @ fresh.T)


def test_sending_the_fixed_classifier_once_changes_nothing_but_bytes(small):
    derived, _ = small("fedloge", {}, rounds=2, eval_every=2)
    sent, _ = small("fedloge", {"send_fixed": "true"}, rounds=2, eval_every=2)
    for k, v in derived.state["weights"].items():
        assert torch.equal(v, sent.state["weights"][k]), k
    W = derived.method.fixed_head()[0]
    trained_ids = set(sent.schedule[0]) | set(sent.schedule[1])
    for cid in trained_ids:
        assert torch.equal(sent.client_states[cid]["fixed.weight"], W)
    extra = (W.numel() + W.shape[0]) * 4  # weight + bias, float32, once per client
    d0, s0 = derived.history[0]["bytes_down_per_client"], sent.history[0]["bytes_down_per_client"]
    assert s0 - d0 == pytest.approx(extra)
    first_seen = set(sent.schedule[0])
    new_in_2 = len(set(sent.schedule[1]) - first_seen) / len(sent.schedule[1])
    assert sent.history[1]["bytes_down_per_client"] - derived.history[1]["bytes_down_per_client"] == \
        pytest.approx(extra * new_in_2)


# ------------------------------------------------------------------------------------------- learning
def test_learns_and_personalization_beats_the_global_model_on_local_data(trained):
    sim, final, _ = trained
    chance = 1 / sim.fed.num_classes
    assert list(final["global"])[:2] == ["generic", "universal"] and list(final["personal"])[0] == "personalized"
    assert final["global"]["universal"]["acc"] > 3 * chance
    assert final["global"]["generic"]["acc"] > 3 * chance
    # baseline computed here: the GA-FR global model on each client's own test set
    gen = sim.method.global_model(sim.state)["generic"]
    base = []
    for c in sim.fed.clients:
        f, y = features(gen.backbone, c.test_batches())
        base.append((gen.head(f).argmax(1) == y).float().mean().item())
    assert final["personal"]["personalized"]["acc"] > float(np.mean(base))


def test_finetuning_after_la_fr_fits_the_local_data(trained):
    sim, _, _ = trained
    m = FedLoGe(sim.method.spec, FedLoGe.make_params({"finetune_epochs": 3}))
    client, cs = sim.fed.clients[1], sim.client_states[1]
    payload = m.phase_configure("la-fr", sim.state, 1)
    assert "head.weight" in payload.arrays and any(k.startswith("backbone.") for k in payload.arrays)
    reply, new = m.phase_client("la-fr", payload, dict(cs), client, torch.Generator().manual_seed(0))
    m.net.eval()
    f, y = features(m.net.backbone, client.batches(256, torch.Generator(), train=False, shuffle=False))

    def ce(w, b):
        return torch.nn.functional.cross_entropy(f @ w.T + b, y).item()

    start = la_fr(sim.state["weights"]["head.weight"], cs["phi.weight"])
    assert ce(new["realigned.weight"], new["realigned.bias"]) < ce(start, torch.zeros(len(start)))
    assert "realigned.weight" not in reply.arrays and reply.meta["num_examples"] == len(client)


def test_persisted_local_momentum_stays_on_the_client(trained):
    sim, _, _ = trained
    m = FedLoGe(sim.method.spec, FedLoGe.make_params({"persist_phi_momentum": "true"}))
    client, cs = sim.fed.clients[2], dict(sim.client_states[2])
    payload = m.configure(sim.state, 9, 2)
    reply, cs1 = m.local_train(payload, cs, client, torch.Generator().manual_seed(0))
    assert cs1["phi.momentum.weight"].abs().sum() > 0 and not any("momentum" in k for k in reply.arrays)
    # the same round started with vs. without the carried buffer: the local head ends elsewhere, nothing else does
    r1, with_buf = m.local_train(payload, cs1, client, torch.Generator().manual_seed(1))
    no_buf = {k: v for k, v in cs1.items() if "momentum" not in k}
    r2, without = m.local_train(payload, no_buf, client, torch.Generator().manual_seed(1))
    assert not torch.equal(with_buf["phi.weight"], without["phi.weight"])
    assert all(torch.equal(r1.arrays[k], r2.arrays[k]) for k in r1.arrays)  # features are detached for phi_k


# ------------------------------------------------------------------------------------------- options
def test_ablation_switches_modes_and_phases():
    m = _method(ga_fr="false", preview="true")
    assert m.phases == ("la-fr",)
    assert set(m.global_model(m.init_server())) == {"universal", "psi"}
    assert _method(la_fr="false").phases == ("ga-fr",)
    m = _method()
    assert m.phases == ("ga-fr", "la-fr") and "generic-preview" in m.global_model(m.init_server())
    assert _method(fixed="xavier").fixed_spec() == ("xavier", None, {"variant": "paper", "refine": False})
    kind, beta, opts = _method(fixed="xavier", beta="0.6").fixed_spec()  # Table 9's "Sparse Xavier"
    assert beta == 0.6 and opts["refine"] and opts["steps"] == 10_000
    assert _method(sse_variant="official", gamma="0.5").fixed_spec()[2]["gamma"] == 0.5


@pytest.mark.parametrize("params", [{"fixed": "dense"}, {"realign": "code"}, {"beta": "1.0"},
                                    {"pm_logits": "phi"}, {"finetune_epochs": "-1"}, {"tau": "0.1"}])
def test_bad_settings_raise_config_error(params):
    with pytest.raises(ConfigError):
        _method(**params)


@pytest.mark.parametrize("argv, says", [
    (["--set", "fixed_bias=true"], "backbone_loss=etf-dr trains theta on the fixed classifier's vectors, which have "
                                   "no bias; drop fixed_bias"),
    (["--dp", "sample", "--dp-clip", "1", "--dp-noise", "1"], "normalises the features over the batch"),
], ids=["fixed-bias", "dp-sample"])
def test_the_official_etf_baseline_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys, argv, says):
    """``backbone_loss=etf-dr`` (the official code's ETF baseline): its dot regression has no bias term, and its
    BatchNorm projector makes a sample's loss read the batch, which per-sample gradients cannot bound."""
    from fedlt.cli import main as cli_main

    code = cli_main(["run", "--method", "fedloge", "--set", "backbone_loss=etf-dr", "--set", "fixed=etf", "--dataset",
                     "digits", "--rounds", "1", "--out", str(tmp_path), "--no-progress", *argv])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert not any(tmp_path.iterdir())


def test_the_etf_dr_loss_is_zero_on_the_class_vector_and_half_the_squared_length_across_it():
    """reg_dot_loss on one sample (the projector passes a batch of one through; E_y = 1): 0 when the feature points
    along m_y whatever its length, 1/2 when it is orthogonal to m_y; and the projector's outputs are unit vectors.
    (The per-batch scaling E is checked against the released produce_Ew in tests/test_official_2026.py.)"""
    from fedlt.core.losses import etf_dot_regression, etf_features

    C, d = 4, 8
    M = torch.linalg.qr(torch.randn(d, C, generator=torch.Generator().manual_seed(0)))[0].T  # orthonormal rows
    ones, zeros = torch.ones(d), torch.zeros(d)
    y = torch.tensor([2])
    assert etf_dot_regression(M[2:3] * 5.0, y, M, ones, zeros) < 1e-10
    across = M[3:4] * 0.3  # orthogonal to m_2
    assert etf_dot_regression(across, y, M, ones, zeros).item() == pytest.approx(0.5, abs=1e-6)
    h = torch.randn(6, d, generator=torch.Generator().manual_seed(1)) * 7.0
    assert torch.allclose(etf_features(h, ones, zeros).norm(dim=1), torch.ones(6), atol=1e-5)
    assert torch.allclose(etf_features(h[:1], ones, zeros), h[:1] / h[:1].norm(), atol=1e-6)
