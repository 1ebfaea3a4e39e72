"""GGEUR (CVPR 2025): the server's class covariance is the covariance of the union of the clients' samples (Eq. 4,
the released ``process_multiple_appearances`` written out here), new features lie on the class's geometric shape
around their anchors and spread by lambda (paper) or sqrt(lambda) (released), the covariances are declared and
sent once, the modes and privacy settings it cannot run under are refused in one line, and it learns a
long-tailed problem on frozen features in a few rounds."""
from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import small_config, tiny_hf_vit
from distances import record
from fedlt.config import validate
from fedlt.core.finetune import feature_prep
from fedlt.core.privacy import rows_of
from fedlt.data.federated import ClientData
from fedlt.errors import ConfigError
from fedlt.methods.ggeur import GGEUR, generate, geometric_shape, union_moments
from fedlt.runner.rundir import federation_for, prepare

D, C = 16, 10  # the tiny ViT's feature width; digits' classes


_FED: dict = {}


def _method(params=None, **over):
    cfg = small_config(**{"method": "ggeur", "clients": 4, "participation": 1.0, "rounds": 3, "params": params or {},
                          **over})
    validate(cfg)
    if "fed" not in _FED:
        _FED["fed"] = federation_for(cfg)
    return prepare(cfg, _FED["fed"]).method


def _client(cid, x, y):
    prep = feature_prep("cpu")
    return ClientData(cid, x, y, C, prep, x[:0], y[:0])


def _synthetic(seed=0, clients=4, rho=10.0, head=120, spread=0.6):
    """Long-tailed Gaussian classes in D dimensions (head class ``head`` samples, rho head/tail), shared anisotropic
    within-class covariance, split over the clients by Dirichlet(0.5); and a balanced test set."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(C, D, generator=g) * 1.5
    shape = torch.randn(D, D, generator=g) * spread / math.sqrt(D)
    counts = [max(2, int(head * rho ** (-c / (C - 1)))) for c in range(C)]
    draw = lambda c, n: means[c] + torch.randn(n, D, generator=g) @ shape  # noqa: E731
    rng = np.random.default_rng(seed)
    parts = [[] for _ in range(clients)]
    for c, n in enumerate(counts):
        share = rng.dirichlet([0.5] * clients)
        cut = np.split(np.arange(n), (np.cumsum(share)[:-1] * n).astype(int))
        for k in range(clients):
            if len(cut[k]):
                parts[k].append((draw(c, len(cut[k])), torch.full((len(cut[k]),), c)))
    data = [_client(k, torch.cat([p[0] for p in ps]), torch.cat([p[1] for p in ps])) for k, ps in enumerate(parts)]
    test_y = torch.arange(C).repeat_interleave(100)
    test_x = torch.cat([draw(c, 100) for c in range(C)])
    return data, test_x, test_y


def _round(m, state, rnd, data, gen, lr=0.05):
    replies = []
    for k, dk in enumerate(data):
        msg = m.configure(state, rnd, k).with_config({"lr": lr})
        reply, _ = m.local_train(msg, {}, dk, gen)
        replies.append((k, reply))
    return m.aggregate(state, rnd, replies), replies


def test_the_pooled_covariance_is_the_union_covariance_and_the_released_formula():
    m = _method()
    data, _, _ = _synthetic(seed=1)
    state, replies = _round(m, m.init_server(), 1, data, torch.Generator().manual_seed(0))
    x = torch.cat([d.x for d in data]).double()
    y = torch.cat([d.y for d in data])
    worst = 0.0
    for c in range(C):
        z = x[y == c]
        union = (z - z.mean(0)).T @ (z - z.mean(0)) / len(z)  # 1/N over the union of the clients' samples
        mu, cov = union_moments(state.count[c], state.total[c], state.outer[c])
        assert torch.allclose(mu, z.mean(0), atol=1e-5) and torch.allclose(cov, union, atol=1e-5)
        # the released aggregation (clip_image_tensor2aggregate_covariance_matrix.py), written out from its lines
        stats = [(r.arrays["ggeur.count"][i].double(), r.arrays["ggeur.mean"][i].double(),
                  r.arrays["ggeur.cov"][i].double())
                 for _, r in replies for i, cc in enumerate(r.arrays["ggeur.classes"].tolist()) if cc == c]
        total = sum(n for n, _, _ in stats)
        combined_mean = sum(n * mk for n, mk, _ in stats) / total
        combined = sum(n * ck for n, _, ck in stats) / total
        combined = combined + sum(n * torch.outer(mk - combined_mean, mk - combined_mean) for n, mk, _ in stats) / total
        assert torch.allclose(cov, combined, atol=1e-5)
        worst = max(worst, (cov - combined).abs().max().item())
        lam, vec = geometric_shape(cov)
        assert torch.allclose(state.lam[c].double(), lam, atol=1e-5)
        assert torch.allclose((vec * lam) @ vec.T, cov, atol=1e-5)  # the shape is the covariance's
    record("ggeur", "server's class covariance vs the released aggregation (every class)", worst)


def test_new_features_lie_on_the_shape_around_their_anchors_and_spread_as_each_scale_says():
    g = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))
    lam = torch.zeros(D, dtype=torch.float64)
    lam[:3] = torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64)  # rank 3
    cov = (basis * lam) @ basis.T
    lam_s, vec = geometric_shape(cov)
    anchors = torch.randn(5, D, generator=g, dtype=torch.float64)
    for scale, expect in (("paper", lam[:3] ** 2), ("official", lam[:3])):
        new = generate(anchors, lam_s, vec, 20000, torch.Generator().manual_seed(1), scale)
        k = math.ceil(20000 / 5)  # m > n: ceil(m / n) around every anchor, in order
        delta = new - anchors.repeat_interleave(k, 0)[:20000]
        top = basis[:, :3]
        off = delta - (delta @ top) @ top.T
        assert off.abs().max() < 1e-9  # in the span of the top eigenvectors, around the anchors
        var = (delta @ top).var(0)
        assert torch.allclose(var, expect, rtol=0.05), (scale, var, expect)
    few = generate(anchors, lam_s, vec, 3, torch.Generator().manual_seed(2))
    near = torch.cdist(few, anchors).argmin(1)
    assert len(set(near.tolist())) == 3  # m <= n: m distinct anchors, one new feature each


def test_the_covariances_are_declared_and_sent_once_per_client():
    rows = {r["name"]: r["category"] for r in rows_of(GGEUR)}
    assert rows["ggeur.cov"] == "class-moments" and rows["ggeur.mean"] == "class-means"
    m = _method()
    data, _, _ = _synthetic()
    gen = torch.Generator().manual_seed(0)
    state, first = _round(m, m.init_server(), 1, data, gen)
    for (k, r), dk in zip(first, data):
        assert r.arrays["ggeur.cov"].shape == (len(dk.classes), D, D)
        assert r.arrays["ggeur.classes"].tolist() == dk.classes.tolist()
    state, second = _round(m, state, 2, data, gen)
    assert not [k for k, r in second if "ggeur.cov" in r.arrays]  # heard once: the features never change
    msg = m.configure(state, 3, 0)  # the shapes of the client's own classes only, once it was heard
    assert msg.arrays["ggeur.shape_classes"].tolist() == data[0].classes.tolist()


@pytest.mark.parametrize("over, where", [
    (dict(finetune="lora"), "--finetune lora"),
    (dict(dp="client", dp_clip=1.0, dp_noise=1.0), "ggeur.cov"),
    (dict(dp="sample", dp_clip=1.0, dp_noise=1.0), "--dp sample"),
    (dict(secagg=True), "secagg"),
])
def test_modes_and_privacy_it_cannot_cover_are_refused_in_one_line(over, where):
    with pytest.raises(ConfigError) as e:
        validate(small_config(**{"method": "ggeur", "model": tiny_hf_vit(), "finetune": "head", **over}))
    msg = str(e.value)
    assert "\n" not in msg and "ggeur" in msg and where in msg, msg


def test_a_from_scratch_run_exits_2_with_one_line():
    p = subprocess.run([sys.executable, "-m", "fedlt", "run", "--method", "ggeur", "--preset", "smoke"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    line = p.stderr.strip()
    assert "\n" not in line and "--finetune full" in line and "--finetune head" in line, line


def test_it_learns_a_long_tailed_problem_on_frozen_features_in_a_few_rounds():
    m = _method()
    data, test_x, test_y = _synthetic(seed=3)
    gen = torch.Generator().manual_seed(0)
    state = m.init_server()
    for rnd in range(1, 5):
        state, _ = _round(m, state, rnd, data, gen)
    pred = m.global_model(state)
    with torch.no_grad():
        acc = (pred.head(pred.backbone(test_x)).argmax(1) == test_y).float()
    per_class = acc.view(C, -1).mean(1)
    assert acc.mean() > 0.5 and per_class[-3:].mean() > 0.2, per_class  # chance: 0.1


def test_one_local_round_matches_the_released_client_under_its_options():
    """``FL_MLP.py``'s ``train_on_client``, written out from its lines: ``MyNet`` (Linear, then softmax), torch's
    CrossEntropyLoss on that output, SGD lr 0.001 momentum 0.9, one epoch of batches of 32 -- in fedlt's batch order
    (the same permutation), from the same weights, on a client with nothing to add (target below its counts):
    ``softmax_output=true`` gives its classifier to float precision; the default (CE on the logits) does not."""
    data, _, _ = _synthetic(seed=2)
    dk = data[1]
    out = {}
    for soft in (True, False):
        m = _method({"softmax_output": soft, "target": 1}, rounds=1, lr=0.001, momentum=0.9, local_epochs=1,
                    batch_size=32)
        state = m.init_server()
        reply, _ = m.local_train(m.configure(state, 1, 1).with_config({"lr": 0.001}), {}, dk,
                                 torch.Generator().manual_seed(7))
        out[soft] = reply.arrays
    W0, b0 = (state.weights[k].clone().requires_grad_(True) for k in ("head.weight", "head.bias"))
    opt = torch.optim.SGD([W0, b0], lr=0.001, momentum=0.9)
    order = torch.randperm(len(dk), generator=torch.Generator().manual_seed(7))  # fedlt's epoch order
    x, y = dk.x[order], dk.y[order]
    for s in range(0, len(y), 32):
        xb, yb = x[s:s + 32], y[s:s + 32]
        if len(xb) == 1:  # fedlt folds a last batch of one sample into the one before
            continue
        if len(y) - s - 32 == 1:
            xb, yb = x[s:], y[s:]
        opt.zero_grad()
        outputs = torch.softmax(xb @ W0.T + b0, dim=1)  # MyNet.forward
        torch.nn.CrossEntropyLoss()(outputs, yb).backward()
        opt.step()
    noise = max((out[True][k] - v.detach()).abs().max().item() for k, v in (("head.weight", W0), ("head.bias", b0)))
    record("ggeur", "softmax_output=true: a local round vs FL_MLP.train_on_client", noise)
    assert torch.allclose(out[True]["head.weight"], W0.detach(), atol=1e-6)
    assert torch.allclose(out[True]["head.bias"], b0.detach(), atol=1e-6)
    apart = (out[False]["head.weight"] - W0.detach()).abs().max().item()
    assert record("ggeur", "default (CE on the logits) vs FL_MLP.train_on_client: a local round", apart) > 1e-4


def test_the_aggregation_is_the_released_uniform_mean_under_its_option_and_fedavgs_by_default():
    """``FL_MLP.py``'s ``aggregate_client_models``, written out: the sum of the clients' state dicts divided by their
    number. ``uniform_mean=true`` gives it to float precision; the default is FedAvg's n_k-weighted mean, as far from
    it as the clients' sizes differ."""
    data, _, _ = _synthetic(seed=4)
    sizes = [len(d) for d in data]
    assert len(set(sizes)) > 1  # the two means differ only where the clients' sizes do
    got = {}
    for uniform in (True, False):
        m = _method({"uniform_mean": uniform})
        state, replies = _round(m, m.init_server(), 1, data, torch.Generator().manual_seed(3))
        got[uniform] = state.weights
    models = [r.arrays for _, r in replies]  # the same replies either way: the option is the server's
    released = {k: torch.zeros_like(v) for k, v in got[True].items()}
    for sd in models:
        for k in released:
            released[k] += sd[k]
    for k in released:
        released[k] /= len(models)
    weighted = {k: sum(sd[k].double() * n for sd, n in zip(models, sizes)) / sum(sizes) for k in released}
    noise = max((got[True][k] - released[k]).abs().max().item() for k in released)
    assert record("ggeur", "uniform_mean=true: aggregation vs FL_MLP.aggregate_client_models", noise) < 1e-6
    assert max((got[False][k].double() - weighted[k]).abs().max().item() for k in released) < 1e-6
    apart = max((got[False][k] - released[k]).abs().max().item() for k in released)
    assert record("ggeur", "default (n_k-weighted) vs aggregate_client_models: aggregation", apart) > 1e-4
