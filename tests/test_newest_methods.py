"""Issue 32's methods (FedRS, FedLF, GBME, FedCRAC, DFL-FS, FedGPA) and CReFF's DSA: per method, a test of its
defining mechanism that a wrong implementation would fail, and a learning test on the small long-tailed
federation (digits, rho 10, 6 clients; chance is 10 %). Kill / resume, batched clients, devices and Flower are
checked for every registered method by test_experiments, test_batched, test_devices and test_flower. Trained runs
are shared through a module-scoped fixture."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

from conftest import final_gm, trained_runs  # noqa: E402
from fedlt.core import Message, RunSpec  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402

C = 10


@pytest.fixture(scope="module")
def trained():
    """``trained(name, run=None, **params)``: the small federation trained once per (method, params, run)."""
    return trained_runs()


gm = final_gm


# ------------------------------------------------------------------------------------------------ FedRS
def test_fedrs_restricted_softmax_scales_the_logits_of_absent_classes():
    from fedlt.methods.fedrs import restricted_ce, restricted_scale

    counts = torch.tensor([5.0, 0.0, 20.0, 0.0])
    assert restricted_scale(counts, 0.3).tolist() == pytest.approx([1.0, 0.3, 1.0, 0.3])
    assert restricted_scale(counts, 0.3, "proportional").tolist() == pytest.approx([0.3 + 0.7 * 0.25, 0.3, 1.0, 0.3])
    g = torch.Generator().manual_seed(0)
    h, y = torch.randn(8, 5, generator=g), torch.tensor([0, 2] * 4)
    W = torch.randn(4, 5, generator=g)

    def grad(alpha):
        w = W.clone().requires_grad_(True)
        restricted_ce(h, w, restricted_scale(counts, alpha), y).backward()
        return w.grad

    g0 = grad(0.0)  # alpha 0: the absent classes are out of the softmax, their rows never move
    assert torch.all(g0[[1, 3]] == 0) and torch.all(g0[[0, 2]].abs().sum(1) > 0)
    w = W.clone().requires_grad_(True)  # alpha 1: plain cross-entropy of the bias-free logits
    F.cross_entropy(h @ w.T, y).backward()
    assert torch.allclose(grad(1.0), w.grad)
    with pytest.raises(ConfigError, match="scaling"):
        restricted_scale(counts, 0.5, "linear")


def test_fedrs_learns_better_than_fedavg(trained):
    _, ref = trained("fedavg")
    sim, final = trained("fedrs")
    assert gm(final)["acc"] > gm(ref)["acc"]
    assert "head.bias" in sim.state["weights"]  # the bias stays in the model (untrained by the restricted softmax)


# ------------------------------------------------------------------------------------------------ FedLF
def test_fedlf_running_centres_pull_the_features_unless_detached():
    from fedlt.methods.fedlf import running_centres

    sums, seen = torch.tensor([[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([2.0, 0.0, 0.0])
    G = torch.tensor([[0.0, 0.0], [1.0, 1.0], [5.0, 5.0]])
    y = torch.tensor([0, 1, 1])
    grads = {}
    for detach in (False, True):
        h = torch.tensor([[4.0, 4.0], [2.0, 0.0], [0.0, 2.0]], requires_grad=True)
        centres, total, n = running_centres(sums, seen, h, y, detach)
        assert torch.allclose(centres, torch.tensor([[2.0, 2.0], [1.0, 1.0], [0.0, 0.0]]))  # running means
        assert n.tolist() == [3.0, 2.0, 0.0] and not total.requires_grad
        loss = (centres - G).abs().mean()
        grads[detach] = torch.autograd.grad(loss, h, allow_unused=True)[0] if loss.requires_grad else None
    assert grads[True] is None  # official: the term is a constant, it trains nothing
    assert grads[False][0].abs().sum() > 0  # class 0's centre is away from G_0: its sample is pulled


def test_fedlf_server_centres_and_decorrelation():
    from fedlt.methods.fedlf import adjusted_scale, decorrelation_loss, update_centres

    assert adjusted_scale(torch.tensor([10.0, 5.0, 0.0]), 0.25).tolist() == pytest.approx([1.0, 0.625, 0.25])
    F1 = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # client 1 holds class 0 only
    F2 = torch.tensor([[3.0, 0.0], [0.0, 2.0]])
    H1, H2 = torch.tensor([True, False]), torch.tensor([True, True])
    G = update_centres(None, [F1, F2], [H1, H2])  # first: mean over the holders
    assert torch.allclose(G, torch.tensor([[2.0, 0.0], [0.0, 2.0]]))
    assert torch.allclose(update_centres(None, [F1, F2], [H1, H2], "all"), torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
    F3 = torch.tensor([[0.0, 4.0], [0.0, 0.0]])  # orthogonal to G_0: weight 0; class 1 held by nobody
    G2 = update_centres(G, [F2, F3], [torch.tensor([True, False]), torch.tensor([True, False])])
    assert torch.allclose(G2, torch.tensor([[3.0, 0.0], [0.0, 2.0]]))  # cos-weighted; class 1 kept
    g = torch.Generator().manual_seed(0)
    z = torch.randn(256, 4, generator=g)
    corr = torch.cat([z, z[:, :1] * 2 + 0.01 * torch.randn(256, 1, generator=g)], 1)
    assert decorrelation_loss(corr) > 20 * decorrelation_loss(z) > 0


def test_fedlf_learns_and_builds_global_centres_after_warmup(trained):
    sim, final = trained("fedlf", warmup_rounds=2)
    assert gm(final)["acc"] > 0.3  # chance is 0.1
    G = sim.state["centres"]
    assert G.shape == (C, sim.method.net.feature_dim) and torch.all(G.norm(dim=1) > 0)
    early, _ = trained("fedlf", run={"rounds": 2, "eval_every": 2}, warmup_rounds=2)
    assert "centres" not in early.state  # none during the warm-up rounds


# ------------------------------------------------------------------------------------------------ GBME
def test_gbme_proxy_reads_class_counts_from_a_classifier_update():
    from fedlt.methods.gbme import ExpertHeads, estimated_counts, expert_groups, global_prior

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([60, 25, 10, 5])
    means = torch.eye(4, 8) * 3
    y = torch.repeat_interleave(torch.arange(4), counts)
    h = (means[y] + 0.3 * torch.randn(len(y), 8, generator=g)).relu()
    heads = ExpertHeads(8, 4, 2, normed=False, gen=g)
    W0 = heads.weight.detach().clone()
    opt = torch.optim.SGD(heads.parameters(), lr=0.05)
    for i in range(0, len(y), 10):  # one epoch of plain CE on the mean logits
        opt.zero_grad()
        F.cross_entropy(heads(h[i:i + 10]), y[i:i + 10]).backward()
        opt.step()
    est = estimated_counts(heads.weight.detach() - W0, len(y))
    assert torch.argsort(est, descending=True).tolist() == [0, 1, 2, 3] and abs(int(est.sum()) - len(y)) <= 2
    proxy = torch.tensor([[50.0, 5, 0, 0], [40, 10, 5, 0], [2, 3, 10, 20], [0, 0, 0, 0]])
    known = torch.tensor([True, True, True, False])
    assert global_prior(proxy, known).tolist() == [92.0, 18.0, 15.0, 20.0]  # floor 5 for an unseen class
    assert expert_groups(proxy, known, 3) == {0: 0, 1: 1, 2: 2}  # head-heavy clients first


def test_gbme_expert_rounds_train_and_average_one_expert_per_client():
    import dataclasses

    from fedlt.core.steps import run_steps
    from fedlt.methods.gbme import EXPERT

    m = METHODS.get("gbme")(RunSpec("smallcnn", (1, 8, 8), C, rounds=10, num_clients=4, local_epochs=1,
                                    batch_size=8), METHODS.get("gbme").make_params({}))
    state = m.init_server()
    state["known"][:] = True
    state["proxy"][:] = torch.arange(1, C + 1, dtype=torch.float32)
    msg = m.configure(state, 9, 2)  # round 9 > 0.6 x 10: an expert round
    assert msg.meta["mode"] == EXPERT and msg.arrays["gbme.mask"].sum() == 1

    class Data:
        x = torch.randn(16, 1, 8, 8)
        y = torch.randint(0, C, (16,))

        def __len__(self):
            return 16

        def batches(self, b, gen, epochs=1, **kw):
            for _ in range(epochs):
                yield self.x[:b], self.y[:b]

    out = run_steps(m, m.local_steps(msg, {}, Data()), Data(), torch.Generator().manual_seed(0))
    e = int(msg.arrays["gbme.mask"].argmax())
    moved = (out.weights["head.weight"] - state["weights"]["head.weight"]).abs().sum((1, 2))
    assert moved[e] > 0 and all(moved[j] == 0 for j in range(m.p.experts) if j != e)
    reply, _ = m.local_reply(msg, {}, Data(), out)
    new = m.aggregate(dataclasses.replace(state, weights=dict(state.weights)), 9, [(2, reply)])
    kept = [j for j in range(m.p.experts) if j != e]
    assert torch.equal(new["weights"]["head.weight"][kept], state["weights"]["head.weight"][kept])
    assert torch.equal(new["weights"]["head.weight"][e], out.weights["head.weight"][e])


def test_gbme_balanced_experts_lift_the_few_classes_above_fedavg(trained):
    """At s = 10: on 8x8 digits smallcnn's features start at a norm of about 1.6, where s = 30 makes the first local
    epoch overshoot and the global model collapse to one class on every CPU kernel (docs/fmnist-lt-new-methods.md,
    "GBME's cosine heads on small features").
    Seeds 0 and 1, 16 rounds (seen on the AVX-512, AVX2 and default kernels: GBME few 0.79-0.85 a seed where
    FedAvg has 0.60 and 0.54, GM 0.88-0.91 against 0.85 and 0.81)."""
    few, ref_few, acc = [], [], []
    for seed in (0, 1):
        _, ref = trained("fedavg", run={"rounds": 16, "seed": seed})
        sim, final = trained("gbme", run={"rounds": 16, "seed": seed}, scale=10.0)
        assert bool(sim.state["known"].all())  # every client's proxy was read
        few.append(gm(final)["few"])
        ref_few.append(gm(ref)["few"])
        acc.append(gm(final)["acc"])
    assert np.mean(few) > np.mean(ref_few) + 0.1 and np.mean(acc) > 0.75


# ------------------------------------------------------------------------------------------------ FedCRAC
def test_fedcrac_margin_goes_to_the_other_classes_by_similarity():
    from fedlt.methods.fedcrac import margin_logits, similarity_margin

    means = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    M = similarity_margin(means, 2.0)
    assert M[0, 1] == pytest.approx(2 * 2 ** -0.5) and M[0, 2] == pytest.approx(0.0) and M[1, 1] == pytest.approx(2)
    h, W = torch.tensor([[1.0, 2.0], [0.5, -1.0]]), torch.eye(3, 2)
    y = torch.tensor([0, 2])
    z = margin_logits(h, W, M, y, 5.0)
    plain = 5 * h @ W.T
    assert z[0, 0] == plain[0, 0] and z[1, 2] == plain[1, 2]  # the label's logit has no margin
    assert torch.allclose(z[0, 1:] - plain[0, 1:], 5 * M[0, 1:]) and torch.allclose(z[1, :2] - plain[1, :2], 5 * M[2, :2])


def test_fedcrac_calibration_evens_the_per_class_norms_of_a_biased_classifier():
    from fedlt.methods.fedcrac import calibrate, similarity_margin

    g = torch.Generator().manual_seed(0)
    means = torch.eye(4, 6) * 2
    y = torch.arange(4).repeat_interleave(100)
    feats = means[y] + 0.2 * torch.randn(400, 6, generator=g)
    W = torch.eye(4, 6) * 0.5
    W[0] = torch.tensor([3.0, 0.8, 0.8, 0.8, 0, 0])  # a head class whose row dominates the others' features
    M = similarity_margin(means, 1.0)
    acc = lambda w: float(((feats @ w.T).argmax(1) == y).float().mean())  # noqa: E731
    W2 = calibrate(W, M, feats, y, 100, 0.05, 5.0)
    norms, norms2 = W.norm(dim=1), W2.norm(dim=1)
    assert acc(W2) > acc(W) + 0.3
    assert norms2.max() / norms2.min() < norms.max() / norms.min()


def test_fedcrac_beats_fedavg_at_its_official_optimiser(trained):
    run = {"lr": 0.01, "momentum": 0.0}  # the official optimiser (docs: at the protocol's lr the margin diverges)
    _, ref = trained("fedavg", run=run)
    sim, final = trained("fedcrac", run=run, crt_epochs=50)
    assert gm(final)["acc"] > gm(ref)["acc"] + 0.1
    assert "head.bias" not in sim.state["weights"] and sim.state["margin"].shape == (C, C)


# ------------------------------------------------------------------------------------------------ DFL-FS
def test_dflfs_coverage_clustering_keeps_class_balanced_clients_on_a_planted_federation():
    from fedlt.methods.dflfs import representatives

    g = torch.Generator().manual_seed(0)
    class_means = torch.eye(C) * 4  # one feature direction per class
    head = [torch.tensor([0.5, 0.3, 0.2] + [0.0] * 7)] * 6  # six clients of the head classes 0-2
    tail = [torch.tensor([0.0] * 7 + [0.4, 0.3, 0.3]), torch.full((C,), 0.1)]  # a tail client, a balanced one
    props = torch.stack([p + 0.01 * torch.rand(C, generator=g) for p in head + tail])
    mask = (torch.rand(C, generator=g) < 0.7).float()
    stats = mask * (props @ class_means)  # masked mean features
    keep = representatives(stats, 3, torch.Generator().manual_seed(1), sizes=[100] * 8)
    assert 6 in keep and 7 in keep and len(keep) == 3  # the tail and the balanced client always make it

    def tail_share(ids):
        return float(props[ids][:, 3:].sum() / props[ids].sum())

    assert tail_share(keep) > 2 * tail_share(list(range(8)))


def test_dflfs_regenerated_features_retrain_a_classifier_better_on_the_tail(trained):
    sim, final = trained("dfl-fs", per_class=200, epochs=30)
    assert list(final["global"]) == ["retrained", "fedavg"]
    re, avg = gm(final, "retrained"), gm(final, "fedavg")
    assert re["acc"] > avg["acc"] and re["few"] > avg["few"]
    assert len(sim.state["selected"]) < 3  # 3 clients a round, half kept (rounded up)
    _, plain = trained("dfl-fs", per_class=200, epochs=30, select="all")
    assert gm(plain, "fedavg")["acc"] == gm(trained("fedavg")[1])["acc"]  # select=all: stage 1 is FedAvg


def test_dflfs_official_covariance_adds_a_constant_between_term():
    from fedlt.core.retrain import pooled_gaussian
    from fedlt.methods.dflfs import official_pool

    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5.0, 9.0], dtype=torch.float64)
    means = torch.randn(2, 3, generator=g, dtype=torch.float64)
    covs = torch.stack([torch.eye(3, dtype=torch.float64)] * 2)
    mu, exact = pooled_gaussian(counts, means, covs)
    mu2, off = official_pool(counts, means, covs)
    within = ((counts - 1)[:, None, None] * covs).sum(0) / (counts.sum() - 1)
    diff = off - within
    assert torch.allclose(mu, mu2) and torch.allclose(diff, diff[0, 0].expand(3, 3))  # one scalar everywhere
    assert torch.allclose(diff[0, 0], (exact - within).trace())  # the scalar is the exact term's trace


# ------------------------------------------------------------------------------------------------ FedGPA
def test_gpa_weights_and_gradient_statistics():
    from fedlt.methods.fedgpa import gpa_loss, gpa_weights

    pos_w, neg_w = gpa_weights(torch.tensor([100.0, 0.8, 0.0]), 4.0, 12.0, 0.8)
    assert neg_w[0] == pytest.approx(1) and pos_w[0] == pytest.approx(1)  # the start: plain BCE
    assert neg_w[1] == pytest.approx(0.5) and pos_w[1] == pytest.approx(3)
    assert neg_w[2] < 1e-4 and pos_w[2] == pytest.approx(5, abs=1e-3)  # a starved class: no push-down, 5x pull-up
    g = torch.Generator().manual_seed(0)
    z0, y = torch.randn(6, 3, generator=g), torch.tensor([0, 1, 1, 2, 0, 1])
    for double in (False, True):
        stats = {"pos": torch.zeros(3), "neg": torch.zeros(3), "ratio": torch.tensor([100.0, 0.8, 0.0])}
        z = z0.clone().requires_grad_(True)
        gpa_loss(z, y, stats, 4.0, 12.0, 0.8, double).backward()
        t = F.one_hot(y, 3).float()
        w = pos_w * t + neg_w * (1 - t)
        w = w * w if double else w
        assert torch.allclose(z.grad, w * (torch.sigmoid(z0) - t) / 6, atol=1e-6)
        assert torch.allclose(stats["pos"], (z.grad.abs() * t).sum(0), atol=1e-6)
        assert torch.allclose(stats["ratio"], stats["pos"] / (stats["neg"] + 1e-10))


def test_vit_tower_loads_timm_layout_and_only_the_prompts_travel(tmp_path):
    from conftest import tiny_vit_file
    from fedlt.core.vit import load_vit

    tower = load_vit(tiny_vit_file())
    assert (tower.width, tower.depth, tower.resolution) == (32, 2, 8)
    m = METHODS.get("fedgpa")(RunSpec("smallcnn", (1, 8, 8), C), METHODS.get("fedgpa").make_params(
        {"vit_weights": tiny_vit_file()}))
    assert set(m.init_server()["weights"]) == {"backbone.prompts", "head.weight", "head.bias"}
    bad = tmp_path / "x.safetensors"
    from safetensors.torch import save_file
    save_file({"cls_token": torch.zeros(1, 1, 4)}, str(bad))
    with pytest.raises(ConfigError, match="lacks patch_embed.proj.weight"):
        load_vit(str(bad))
    with pytest.raises(ConfigError, match="vit_weights"):
        METHODS.get("fedgpa")(RunSpec("smallcnn", (1, 8, 8), C))


def test_fedgpa_tunes_prompts_on_a_frozen_tower_and_learns(trained):
    from conftest import tiny_vit_file

    sim, final = trained("fedgpa", vit_weights=tiny_vit_file(), tokens=1)
    assert gm(final)["acc"] > 0.25  # chance is 0.1 (a small random tower, not a pre-trained ViT)
    assert sim.state["weights"]["backbone.prompts"].abs().sum() > 0  # the prompts moved from zero
    ratios = torch.stack([cs["gpa.ratio"] for cs in sim.client_states.values()])
    assert torch.all(ratios < 100)  # every client's statistics started accumulating


# ------------------------------------------------------------------------------------------------ CReFF's DSA
def test_dsa_is_siamese_differentiable_and_seeded():
    from fedlt.core.dsa import OPS, siamese_augment

    g = torch.Generator().manual_seed(0)
    img = torch.rand(1, 1, 8, 8, generator=g)
    x = img.repeat(4, 1, 1, 1).requires_grad_(True)
    for op in OPS:
        out = siamese_augment(x, torch.Generator().manual_seed(3), (op,))
        assert out.shape == x.shape and torch.allclose(out, out[:1].expand_as(out))  # one draw for the batch
        again = siamese_augment(x, torch.Generator().manual_seed(3), (op,))
        assert torch.equal(out, again)
        out.sum().backward()  # differentiable
    flipped = siamese_augment(img, torch.Generator().manual_seed(0), ("flip",))
    assert torch.equal(flipped, img) or torch.equal(flipped, img.flip(3))


def test_creff_dsa_augments_each_real_per_class_batch(monkeypatch):
    import fedlt.methods.creff as creff_mod
    from conftest import run_small

    calls = []

    def spy(x, gen, strategy=None):
        calls.append(x.shape[0])
        return x

    monkeypatch.setattr(creff_mod, "siamese_augment", spy)
    params = {"ipc": 5, "match_epochs": 2, "crt_epochs": 2, "real_repeats": 2, "dsa": True}
    sim, _ = run_small("creff", params, rounds=1)
    held = sum(len(sim.fed.clients[c].classes) for c in sim.history[0]["clients"])
    assert len(calls) == 2 * held  # real_repeats batches per class each client holds
