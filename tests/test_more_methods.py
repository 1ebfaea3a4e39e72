"""Issue 15's methods (CCVR, FedGraB, FedNH, FedIC, RUCR, FedYoYo, MOON, CLIP2FL, FedNova, FedDyn): per method, a
test of its defining mechanism and a learning test on the small long-tailed federation (digits, rho 10, 6 clients;
chance is 10 %). Trained runs are shared between tests through module-scoped fixtures."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

from conftest import final_gm, trained_runs  # noqa: E402
from fedlt.core import Message, RunSpec, weighted_average  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402

C = 10


def spec(**over) -> RunSpec:
    return RunSpec(**{"model": "smallcnn", "in_shape": (1, 8, 8), "num_classes": C, "batch_size": 16,
                      "local_epochs": 1, **over})


def method(name, spec_over=None, **params):
    cls = METHODS.get(name)
    return cls(spec(**(spec_over or {})), cls.make_params(params))


@pytest.fixture(scope="module")
def trained():
    """``trained(name, run=None, **params)``: the small federation trained once per (method, params, run settings)
    in this module (``run``: overrides of conftest's small_config, e.g. fewer rounds)."""
    return trained_runs()


gm = final_gm


# ------------------------------------------------------------------------------------------------ FedNova
def test_fednova_normalises_updates_by_local_steps():
    m = method("fednova")
    keys = m.param_keys
    x = m.init_server()["weights"]
    g = torch.Generator().manual_seed(0)
    dirs = [{k: torch.randn(x[k].shape, generator=g) for k in keys} for _ in range(2)]
    steps, sizes = (10.0, 40.0), (30, 60)  # client 2 took four times the steps, in the same direction per step
    replies = [(i, Message({**x, **{k: x[k] - 0.01 * a * d[k] for k in keys}}, {"num_examples": n, "a_norm": a}))
               for i, (d, a, n) in enumerate(zip(dirs, steps, sizes))]
    new = m.aggregate(m.server_state({"weights": dict(x)}), 1, replies).weights
    p = [n / sum(sizes) for n in sizes]
    tau_eff = sum(pi * a for pi, a in zip(p, steps))
    for k in keys:  # x - tau_eff * lr * sum_i p_i d_i: each client counts by p_i, not by how far it moved
        want = x[k] - 0.01 * tau_eff * (p[0] * dirs[0][k] + p[1] * dirs[1][k])
        assert torch.allclose(new[k], want, atol=1e-6), k
    # with equal step counts FedNova is FedAvg
    same = [(i, Message(r.arrays, {**r.meta, "a_norm": 7.0})) for i, r in replies]
    fedavg = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in same])
    new = m.aggregate(m.server_state({"weights": dict(x)}), 1, same).weights
    assert all(torch.allclose(new[k], fedavg[k], atol=1e-6) for k in x)


def test_fednova_learns_and_reports_momentum_normalised_steps(trained):
    from fedlt.core.training import effective_steps

    sim, final = trained("fednova")
    assert gm(final)["acc"] > 0.5
    m = sim.method
    reply, _ = m.local_train(m.configure(sim.state, 9, 0), {}, sim.fed.clients[0], torch.Generator().manual_seed(1))
    assert reply.meta["a_norm"] == pytest.approx(effective_steps(reply.meta["steps"], m.spec.momentum))
    assert reply.meta["a_norm"] > reply.meta["steps"]  # momentum 0.9: early gradients weigh more


# ------------------------------------------------------------------------------------------------ FedDyn
def test_feddyn_server_state_is_the_mean_of_the_client_gradient_states(trained):
    sim, final = trained("feddyn")
    m, st = sim.method, sim.state
    m_clients = m.spec.num_clients
    for k in m.param_keys:  # h = (1/m) sum over ALL clients of g_k (clients never sampled hold g_k = 0)
        total = sum(cs["g"][k] for cs in sim.client_states.values() if "g" in cs)
        assert torch.allclose(st["h"][k], total / m_clients, atol=1e-6), k
        assert torch.allclose(st["weights"][k], st["average"][k] - st["h"][k] / m.p.alpha, atol=1e-6), k
    assert any(float(st["h"][k].abs().max()) > 0 for k in m.param_keys)
    assert list(final["global"]) == ["server", "average"] and gm(final)["acc"] > 0.5


# ------------------------------------------------------------------------------------------------ MOON
def test_moon_contrastive_loss_is_the_two_way_softmax_and_pulls_towards_the_global_representation():
    from fedlt.methods.moon import model_contrastive_loss

    g = torch.Generator().manual_seed(0)
    z, zg, zp = (torch.randn(8, 16, generator=g) for _ in range(3))
    tau = 0.5
    sg, sp = F.cosine_similarity(z, zg) / tau, F.cosine_similarity(z, zp) / tau
    want = -torch.log(torch.exp(sg) / (torch.exp(sg) + torch.exp(sp)))
    assert torch.allclose(model_contrastive_loss(z, zg, zp, tau), want, atol=1e-6)
    zz = z.clone().requires_grad_(True)
    model_contrastive_loss(zz, zg, zp, tau).sum().backward()
    z2 = z - 0.5 * zz.grad  # a gradient step moves z towards z_glob and away from z_prev
    assert (F.cosine_similarity(z2, zg) > F.cosine_similarity(z, zg)).all()
    assert (F.cosine_similarity(z2, zp) < F.cosine_similarity(z, zp)).all()


def test_moon_keeps_the_previous_local_model_on_the_client_and_learns(trained):
    sim, final = trained("moon")
    m = sim.method
    assert m.net.backbone.feature_dim == 256 and m.net.head.in_features == 256  # the projection head
    init = m.init_client(0, None)["prev"]
    sampled = {c for r in sim.schedule for c in r}
    for cid, cs in sim.client_states.items():
        same_as_init = all(torch.equal(cs["prev"][k], init[k]) for k in init)
        assert same_as_init == (cid not in sampled)
    assert gm(final)["acc"] > 0.3
    with pytest.raises(ConfigError):
        method("moon", projection="linear")


# ------------------------------------------------------------------------------------------------ CCVR
def test_ccvr_pooled_statistics_equal_those_of_the_union():
    from fedlt.core.retrain import class_statistics, pooled_gaussian, sample_gaussian

    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, 5, generator=g, dtype=torch.float64) * s + s for n, s in ((7, 1.0), (1, 3.0), (20, 0.5))]
    stats = [class_statistics(p, torch.zeros(len(p), dtype=torch.long), [0]) for p in parts]
    n, mu, cov = (torch.cat([s[i] for s in stats]) for i in range(3))
    pm, pc = pooled_gaussian(n, mu, cov)
    allz = torch.cat(parts)
    assert torch.allclose(pm, allz.mean(0)) and torch.allclose(pc, torch.cov(allz.T))
    draws = sample_gaussian(pm, pc, 20000, torch.Generator().manual_seed(1))
    assert torch.allclose(draws.mean(0), pm, atol=0.1) and torch.allclose(torch.cov(draws.T), pc, atol=0.15)


def test_ccvr_calibration_raises_the_tail_and_sends_statistics_not_samples(trained):
    sim, final = trained("ccvr")
    assert list(final["global"]) == ["calibrated", "fedavg"]
    cal, avg = gm(final, "calibrated"), gm(final, "fedavg")
    assert cal["acc"] > avg["acc"] and cal["few"] > avg["few"] and cal["acc"] > 0.5
    assert all("calibrated" not in ev["eval"]["global"] for ev in sim.history if "eval" in ev)


# ------------------------------------------------------------------------------------------------ FedNH
def test_fednh_prototypes_move_smoothly_towards_client_class_means():
    from fedlt.methods.fednh import class_prototypes, smooth_prototypes

    g = torch.Generator().manual_seed(0)
    feats, y = torch.randn(30, 8, generator=g), torch.randint(0, 3, (30,), generator=g)
    y[y == 2] = 1  # class 2 absent
    scaled, counts = class_prototypes(feats, y, 4)
    for c in (0, 1):
        mean = F.normalize(feats[y == c], dim=1).mean(0)
        assert torch.allclose(scaled[c], F.normalize(mean, dim=0) * (y == c).sum(), atol=1e-5)
    assert torch.count_nonzero(scaled[2:]) == 0 and counts.tolist() == [(y == 0).sum(), (y == 1).sum(), 0, 0]
    W = F.normalize(torch.randn(4, 8, generator=g), dim=1)
    new = smooth_prototypes(W, scaled, counts, 0.9)
    assert torch.allclose(new.norm(dim=1), torch.ones(4), atol=1e-6)
    assert torch.allclose(new[2:], W[2:], atol=1e-6)  # classes nobody held keep their prototype
    target = F.normalize(scaled[:2], dim=1)
    assert ((new[:2] * target).sum(1) > (W[:2] * target).sum(1)).all()  # ... the others turn towards their mean
    assert torch.allclose(smooth_prototypes(W, scaled, counts, 1.0), W, atol=1e-6)


def test_fednh_prototypes_are_not_trained_locally_and_personal_models_fit_the_clients(trained):
    sim, final = trained("fednh")
    m = sim.method
    payload = m.configure(sim.state, 9, 0)
    reply, cs = m.local_train(payload, {}, sim.fed.clients[0], torch.Generator().manual_seed(1))
    assert torch.equal(reply.arrays["head.prototype"], payload.arrays["head.prototype"])
    assert not torch.equal(reply.arrays["head.scaling"], payload.arrays["head.scaling"])  # s is learnt
    W = sim.state["weights"]["head.prototype"]
    assert torch.allclose(W.norm(dim=1), torch.ones(C), atol=1e-5)
    assert gm(final)["acc"] > 0.4 and final["personal"]["local"]["acc"] > gm(final)["acc"]


# ------------------------------------------------------------------------------------------------ FedGraB
def test_fedgrab_balancer_scales_gradients_and_raises_the_positive_weight_of_a_starved_class():
    from fedlt.methods.fedgrab import Balancer, scale_grad, sgb_map

    z = torch.randn(4, 3, requires_grad=True)
    w = torch.rand(4, 3)
    out = scale_grad(z, w)
    assert torch.equal(out, z)
    out.sum().backward()
    assert torch.allclose(z.grad, w)
    assert float(sgb_map(torch.zeros(()))) == pytest.approx(1.0)
    bal = Balancer(Balancer.fresh(3, "cpu", torch.tensor([True, True, False])))
    onehot = F.one_hot(torch.tensor([0, 0, 0, 1]), 3).float()
    for _ in range(5):  # class 2 never appears, classes 0/1 get their positives: negatives of 1 dominate...
        wts = bal.weights(onehot)
        bal.accumulate(torch.zeros(4, 3), onehot, wts)
    pos_w, neg_w = wts[3, 1], wts[0, 1]  # class 1: more negative than positive gradient so far
    assert float(bal.s["neg"][1]) > float(bal.s["pos"][1]) and pos_w > 1 > neg_w
    assert torch.all(wts[:, 2] == 1) and float(bal.s["u"][2]) == 0  # a closed controller leaves plain BCE


def test_fedgrab_lifts_the_few_classes_above_fedavg(trained):
    _, final = trained("fedgrab")
    _, ref = trained("ccvr")  # its "fedavg" mode is FedAvg's training, untouched
    assert gm(final)["acc"] > 0.5 and gm(final)["few"] > gm(ref, "fedavg")["few"] + 0.1


# ------------------------------------------------------------------------------------------------ RUCR
def test_rucr_prototype_term_and_mixed_up_features():
    from fedlt.methods.rucr import mixup_features, prototype_loss

    protos = torch.eye(4, 6)
    known = torch.tensor([True, True, True, False])
    f = protos[[0, 1]] * 3.0  # each sample sits on its class's prototype
    y = torch.tensor([0, 1])
    flat = torch.full((4,), 0.25)
    cos = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]])  # the unknown class scores 0
    assert torch.allclose(prototype_loss(f, y, protos, known, flat, 0.5, 0.0), F.cross_entropy(cos / 0.5, y))
    skewed = torch.tensor([0.7, 0.1, 0.1, 0.1])  # class 1 rare: its own score is lowered by log 0.1
    l_rare = prototype_loss(f[1:], y[1:], protos, known, skewed, 1.0, 1.0)
    l_head = prototype_loss(f[:1], y[:1], protos, known, skewed, 1.0, 1.0)
    assert l_rare > l_head
    own = torch.zeros(5, 6)
    own[:, 5] = 2.0  # every own feature normalises to e_5, orthogonal to the prototypes
    v, vy = mixup_features(protos, known, own, 50, 0.35, 0.95, torch.Generator().manual_seed(0))
    assert vy.bincount().tolist() == [50, 50, 50]
    lam = (v * protos[vy]).sum(1)
    assert ((lam >= 0.35 - 1e-6) & (lam <= 0.95 + 1e-6)).all()
    assert torch.allclose(lam * 100, (lam * 100).round(), atol=1e-4)
    assert torch.allclose(v[:, 5], 1 - lam, atol=1e-6)


def test_rucr_sends_unified_prototypes_and_retrains_the_classifier(trained):
    sim, final = trained("rucr")
    st = sim.state
    assert st["rucr"]["known"].all() and torch.allclose(st["rucr"]["ratio"].sum(), torch.ones(()))
    assert list(final["global"]) == ["retrained", "fedavg"]
    rt, avg = gm(final, "retrained"), gm(final, "fedavg")
    assert rt["acc"] > 0.5 and rt["few"] >= avg["few"]
    assert not torch.equal(st["retrained"]["head.weight"], st["weights"]["head.weight"])


# ------------------------------------------------------------------------------------------------ FedYoYo
def test_fedyoyo_dispersion_statistic_and_self_distillation():
    from fedlt.methods.fedyoyo import asd_loss, dispersion, strong_view, weak_view

    g = torch.Generator().manual_seed(0)
    feats, y = torch.randn(23, 5, generator=g), torch.randint(0, 3, (23,), generator=g)
    got = dispersion(feats, y, 3, 8, torch.Generator().manual_seed(7))
    mu = torch.stack([feats[y == c].mean(0) for c in range(3)])
    cen = feats - mu[y]
    order, want = torch.randperm(23, generator=torch.Generator().manual_seed(7)), torch.zeros(3)
    for s in range(0, 23, 8):  # brute force: 1 / mean of the full cosine-similarity matrix, per class and batch
        idx = order[s:s + 8]
        for c in range(3):
            h = cen[idx][y[idx] == c]
            if len(h) == 1:
                want[c] += 1  # a lone sample in the batch counts 1 (the official code's rule)
            elif len(h):
                want[c] += 1 / F.cosine_similarity(h[:, None], h[None], dim=2).mean()
    assert torch.allclose(got, want, atol=1e-4)
    # a client's only sample of a class (centred feature exactly zero) counts 1, not 1 / eps: with 1 / eps the
    # rarest classes got the largest prior on fmnist-lt (0.36 for a class of 100 samples, 0.0009 for one of 6000)
    one = dispersion(torch.randn(5, 4, generator=g), torch.tensor([0, 0, 0, 0, 1]), 2, 8, torch.Generator())
    assert one[1] == 1 and one[0] < 1e3
    z_w = torch.tensor([[3.0, 0.0], [0.0, 3.0]])
    z_s = torch.tensor([[1.0, 1.0], [2.0, 0.0]], requires_grad=True)
    yy = torch.tensor([0, 0])  # the second sample's weak view is wrong: it does not teach
    loss = asd_loss(z_w, z_s, yy, 1.5)
    t, s = F.softmax(z_w[0] / 1.5, 0), F.log_softmax(z_s[0].detach() / 1.5, 0)
    assert float(loss.detach()) == pytest.approx(float((t * (t.log() - s)).sum()), rel=1e-5)
    loss.backward()
    assert torch.count_nonzero(z_s.grad[1]) == 0 and abs(float(asd_loss(z_w, z_w.clone(), yy, 1.5))) < 1e-6
    x = torch.randn(4, 1, 8, 8, generator=g)
    assert weak_view(x, g).shape == x.shape and not torch.equal(strong_view(x, g), x)


def test_fedyoyo_prior_from_dispersion_and_learning(trained):
    m = method("fedyoyo")
    st = m.init_server()
    w = st["weights"]
    reply = lambda eff: (0, Message({**w, "yoyo.eff": torch.tensor(eff)}, {"num_examples": 1}))  # noqa: E731
    st = m.aggregate(st, 1, [reply([1.0] * 9 + [1e6])])  # an outlier class: replaced by the others' mean
    assert torch.allclose(st["eff"], torch.full((C,), 2.0)) and float(st["prior"].sum()) == pytest.approx(1)
    st = m.aggregate(st, 2, [reply([3.0] * C)])
    assert torch.allclose(st["eff"], torch.full((C,), 4.0))  # the first two estimates are taken as they are
    st = m.aggregate(st, 3, [reply([9.0] * C)])
    assert torch.allclose(st["eff"], torch.full((C,), 0.9 * 4 + 0.1 * 10))  # then a moving average
    sim, final = trained("fedyoyo", momentum=0.9)
    assert gm(final)["acc"] > 0.3
    assert not torch.allclose(sim.state["prior"], torch.full((C,), 1 / C))


# ------------------------------------------------------------------------------------------------ FedIC
def test_fedic_calibrated_ensemble_weights_clients_by_their_logits_and_gates_to_the_reference():
    from fedlt.methods.fedic import highway

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(5, C, generator=g) for _ in range(3)]
    feats = [torch.randn(5, 7, generator=g) for _ in range(3)]
    ref = torch.randn(5, C, generator=g)
    p = {"scale": torch.randn(C, 1, generator=g), "bias": torch.zeros(1), "g": torch.full((C,), 2.0),
         "beta": torch.arange(C, dtype=torch.float), "v": torch.zeros(1, 7), "b_v": torch.tensor([50.0])}
    a = torch.stack([torch.sigmoid(z @ p["scale"]).squeeze(1) for z in logits], 1)
    a = a / a.sum(1, keepdim=True)
    want = sum(a[:, k:k + 1] * z for k, z in enumerate(logits)) * 2.0 + p["beta"]
    assert torch.allclose(highway(p, feats, logits, ref), want, atol=1e-5)  # gate open: the calibrated ensemble
    p["b_v"] = torch.tensor([-50.0])
    assert torch.allclose(highway(p, feats, logits, ref), ref, atol=1e-5)  # gate shut: the reference model


def test_fedic_distils_a_model_better_on_the_tail_than_fedavg(trained):
    sim, final = trained("fedic", steps=20, aux_per_class=20)
    _, ref = trained("ccvr")
    assert gm(final)["acc"] > 0.5 and gm(final)["few"] > gm(ref, "fedavg")["few"] + 0.1
    assert not torch.equal(sim.state["highway"]["g"], torch.ones(C))  # the calibration was learnt


# ------------------------------------------------------------------------------------------------ CLIP2FL
@pytest.fixture(scope="module")
def clip_files():
    """conftest's informative tiny CLIP teacher (zero-shot about 50 % on the digits) and the federation."""
    from conftest import informative_clip_files, small_config
    from fedlt.runner.rundir import federation_for

    return informative_clip_files(), federation_for(small_config())


def test_clip_tower_loads_openai_layout_from_safetensors_and_rejects_bad_files(tmp_path):
    from safetensors.torch import save_file

    from fedlt.core.clip import ImageTower, load_image_tower, load_text_embeddings

    ref = ImageTower(16, 8, 64, 2, 1, 24)
    g = torch.Generator().manual_seed(3)
    sd = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in ref.state_dict().items()}
    ref.load_state_dict(sd)
    save_file({f"visual.{k}": v for k, v in sd.items()} | {"logit_scale": torch.ones(())}, str(tmp_path / "v.st"))
    tower = load_image_tower(str(tmp_path / "v.st"))
    assert (tower.resolution, tower.proj.shape) == (16, (64, 24))
    x = torch.randn(3, 3, 16, 16, generator=g)
    assert torch.allclose(tower(x), ref.eval()(x), atol=1e-5) and not tower.proj.requires_grad
    (tmp_path / "bad.st").write_bytes(b"\x80\x04not a safetensors file")
    for bad in ("bad.st", "missing.st"):
        with pytest.raises(ConfigError, match="CLIP image tower"):
            load_image_tower(str(tmp_path / bad))
    save_file({"text": torch.randn(3, 24)}, str(tmp_path / "t.st"))
    with pytest.raises(ConfigError, match=r"\[10, embed\]"):
        load_text_embeddings(str(tmp_path / "t.st"), 10)
    with pytest.raises(ConfigError, match="needs pretrained CLIP files"):
        method("clip2fl")


def test_clip2fl_contrast_and_distillation_towards_clips_zero_shot_predictions(clip_files):
    from fedlt.methods.clip2fl import kd_loss, supcon_text

    g = torch.Generator().manual_seed(0)
    f, lab, text = torch.randn(9, 4, generator=g), torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2]), torch.randn(3, 4)
    want = []
    for i in range(9):  # the official SupConLoss_text, one anchor at a time
        others = [j for j in range(9) if j != i]
        logit = torch.stack([f[i] @ text[lab[j]] / 0.1 for j in others])
        lp = logit - torch.logsumexp(logit, 0)
        want.append(-torch.stack([lp[n] for n, j in enumerate(others) if lab[j] == lab[i]]).mean())
    assert torch.allclose(supcon_text(f, lab, text, 0.1), torch.stack(want).mean(), atol=1e-5)
    assert abs(float(kd_loss(f, f, 3.0))) < 1e-6
    files, fed = clip_files
    client = fed.clients[0]
    kd = {}
    for alpha in (0.0, 5.0):  # one local round from the same model: distillation brings it closer to CLIP
        m = method("clip2fl", {"local_epochs": 10}, **files, alpha=alpha)
        reply, _ = m.local_train(m.configure(m.init_server(), 1, 0), {}, client, torch.Generator().manual_seed(1))
        net = m.new_model()
        net.load_state_dict({k: v for k, v in reply.arrays.items() if k in net.state_dict()})
        net.eval()
        x, _ = next(client.batches(len(client), None, shuffle=False, train=False))
        with torch.no_grad():
            kd[alpha] = float(kd_loss(net(x), m.clip_logits(x, client.prep), m.p.T))
    assert kd[5.0] < 0.5 * kd[0.0], kd
    with pytest.raises(ConfigError, match="feature width"):  # mlp features are 200 wide, the text 128
        method("clip2fl", {"model": "mlp"}, **files)


def test_clip2fl_learns_with_an_informative_teacher(trained, clip_files):
    files, _ = clip_files
    sim, final = trained("clip2fl", **files, match_epochs=20, crt_epochs=50)
    assert list(final["global"]) == ["retrained", "fedavg_head"] and gm(final)["acc"] > 0.5
