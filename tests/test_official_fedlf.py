"""Issue 41 item 1: FedLF's ``loss=distance`` option against the released 18sym/FedLF ``algorithm/fedlf.py``.

- The official local loss is written out here from the released file's formula, independently of fedlt's helpers:
  CE on the proportionally restricted logits (alpha 0.25) + 0.01 x CE(-(sqrt(|h|^2 - 2 h.c + |c|^2) + gap e_y))
  with class centres from the received model (1e-8 for a class the client lacks) and gap the largest distance
  between two centres (at most 100) + 0.01 x the official ``DecorrLoss``. On a tiny model, the option's loss, its
  gradients and one local SGD step of ``FedLF.local_train`` match it to float precision, and the server stays
  plain FedAvg (no class centres go up or down).
- The default (``loss=centres``) is still the paper's form: one local step equals SGD on CE + lambda |F - G|_1 /
  (C d) + 0.1 x decorrelation written out here, and it still sends its class centres.
- A class with a single sample (distance 0 to its own centre) gives finite gradients under the option, where the
  official formula gives NaN.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

from fedlt.core import RunSpec, load_weights  # noqa: E402
from fedlt.data.federated import ClientData, Prep  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402

C = 10
LR = 0.1


def client(counts: dict[int, int], seed: int = 0) -> ClientData:
    """A client whose samples of class c are a class pattern plus noise (float input, no augmentation)."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(C, 1, 8, 8, generator=torch.Generator().manual_seed(99))
    y = torch.cat([torch.full((n,), c, dtype=torch.long) for c, n in counts.items()])
    x = protos[y] + 0.5 * torch.randn(len(y), 1, 8, 8, generator=g)
    return ClientData(0, x, y, C, Prep((0.0,), (1.0,)), x[:0], y[:0])


def fedlf(spec_over: dict | None = None, **params):
    """FedLF on smallcnn (no BatchNorm), one local epoch of one batch (64 > the client's samples), plain SGD."""
    spec = RunSpec(**{"model": "smallcnn", "in_shape": (1, 8, 8), "num_classes": C, "batch_size": 64,
                      "local_epochs": 1, "lr": LR, "momentum": 0.0, **(spec_over or {})})
    cls = METHODS.get("fedlf")
    return cls(spec, cls.make_params(params))


# ------------------------------------------------------------------------ the official formula, written out
def official_decorr(x):
    """algorithm/fedlf.py's DecorrLoss."""
    N, D = x.shape
    if N == 1:
        return 0.0
    x = x - x.mean(dim=0, keepdim=True)
    x = x / torch.sqrt(1e-8 + x.var(dim=0, keepdim=True))
    corr = x.t() @ x
    off = corr.flatten()[:-1].view(D - 1, D + 1)[:, 1:].flatten()
    return off.pow(2).mean() / N


def official_centres(feats, labels):
    """The pre-training pass: per-class mean features, 1e-8 for the classes the client lacks; the gap."""
    centres = torch.zeros(C, feats.shape[1])
    counts = torch.zeros(C)
    for i in range(feats.size(0)):
        centres[labels[i]] += feats[i]
        counts[labels[i]] += 1
    valid = counts != 0
    centres[valid] /= counts[valid].unsqueeze(1)
    centres[~valid] = 1e-8
    gap = torch.ones(C, C) * 1e9
    for i in range(C):
        for j in range(i):
            gap[i, j] = gap[j, i] = torch.norm(centres[i] - centres[j], p=2)
    max_gap = torch.max(gap[torch.triu(torch.ones_like(gap), diagonal=1) > 0])
    return centres, min(max_gap.item(), 100)


def official_loss(hs, ws, cnts, labels, centres, gap, rs_alpha=0.25):
    """One batch's loss of algorithm/fedlf.py's local_train."""
    dist = cnts / cnts.sum()
    cdist = (dist / dist.max() * (1.0 - rs_alpha) + rs_alpha).reshape((1, -1))
    loss1 = F.cross_entropy(cdist * hs.mm(ws.transpose(0, 1)), labels)
    features_square = torch.sum(torch.pow(hs, 2), 1, keepdim=True)
    centers_square = torch.sum(torch.pow(centres, 2), 1, keepdim=True)
    dist_2 = torch.sqrt(features_square - 2 * torch.matmul(hs, centres.T) + centers_square.T)
    dist_2 = dist_2 + F.one_hot(labels, C) * gap
    loss2 = F.cross_entropy(-dist_2, labels)
    return loss1 + loss2 * 0.01 + official_decorr(hs) * 0.01


# ------------------------------------------------------------------------------------------------ the tests
def test_distance_option_matches_the_official_fedlf_loss_gradients_and_local_step():
    data = client({0: 6, 2: 3, 5: 4, 7: 2}, seed=1)  # classes 1, 3, 4, 6, 8, 9 absent: their centres at 1e-8
    m = fedlf(loss="distance", decorr_weight=0.01)
    state = m.init_server()
    payload = m.configure(state, 1, 0)
    x, y = next(data.batches(64, None, shuffle=False, train=False))

    ref = m.new_model()  # the official side: the received model, its features and gradients by autograd
    load_weights(ref, payload.arrays)
    with torch.no_grad():
        centres, gap = official_centres(ref.backbone(x), y)
    cnts = torch.as_tensor(data.counts, dtype=torch.float32)
    want = official_loss(ref.backbone(x), ref.head.weight, cnts, y, centres, gap)
    names = [n for n, _ in ref.named_parameters() if n != "head.bias"]
    want_grads = torch.autograd.grad(want, [dict(ref.named_parameters())[n] for n in names])

    # the option's loss of the same batch on the same model, from its own centres and margin
    from fedlt.methods.fedlf import adjusted_scale, centre_gap, distance_loss, model_centres

    net = m.new_model()
    load_weights(net, payload.arrays)
    mine_centres = model_centres(net, data, m.spec, torch.Generator().manual_seed(0))
    assert torch.allclose(mine_centres, centres, rtol=1e-6, atol=1e-7)
    assert float(centre_gap(mine_centres)) == pytest.approx(gap, rel=1e-6)
    loss, parts = distance_loss(net.backbone(x), net.head.weight, adjusted_scale(cnts, 0.25), y, mine_centres,
                                centre_gap(mine_centres), 0.01, 0.01)
    assert set(parts) == {"loss_ce", "loss_distance", "loss_decorr"}
    got_grads = torch.autograd.grad(loss, [dict(net.named_parameters())[n] for n in names])
    assert torch.allclose(loss, want, rtol=1e-6, atol=1e-6)
    for n, a, b in zip(names, got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (n, (a - b).abs().max().item())

    # FedLF.local_train: one step of SGD on that loss (the batch's order differs: the mean does not care)
    reply, _ = m.local_train(payload, {}, data, torch.Generator().manual_seed(3))
    assert reply.meta["steps"] == 1 and reply.meta["loss"] == pytest.approx(want.item(), rel=1e-6)
    for n, g in zip(names, want_grads):
        assert torch.allclose(reply.arrays[n], payload.arrays[n] - LR * g, rtol=1e-6, atol=1e-7), n
    assert torch.equal(reply.arrays["head.bias"], payload.arrays["head.bias"])  # no gradient reaches the bias

    # the server is FedAvg: nothing but the model goes up or down, even after the warm-up
    assert set(reply.arrays) == set(state["weights"])
    state = m.aggregate(state, m.p.warmup_rounds + 1, [(0, reply), (1, reply)])
    assert "centres" not in state and set(m.configure(state, 12, 0).arrays) == set(state["weights"])
    assert all(torch.equal(state["weights"][k], reply.arrays[k]) for k in state["weights"])


def test_default_is_still_the_papers_running_centre_loss():
    from fedlt.methods.fedlf import FedLF

    p = FedLF.Params()
    assert (p.loss, p.alpha, p.centre_weight, p.decorr_weight, p.centre_detach, p.centre_init) == \
        ("centres", 0.25, 0.5, 0.1, False, "holders")
    with pytest.raises(ConfigError, match="fedlf.loss"):
        FedLF.make_params({"loss": "official"})

    data = client({0: 6, 2: 3, 5: 4, 7: 2}, seed=1)
    m = fedlf()
    G = torch.randn(C, m.net.feature_dim, generator=torch.Generator().manual_seed(5))
    state = m.init_server()
    state.centres = G  # after the warm-up: the server's centres come down
    payload = m.configure(state, 12, 0)
    x, y = next(data.batches(64, None, shuffle=False, train=False))
    ref = m.new_model()
    load_weights(ref, payload.arrays)
    h = ref.backbone(x)  # the paper's loss, written out: F the batch's class means, with their gradient
    cnts = torch.as_tensor(data.counts, dtype=torch.float32)
    a = 0.25 + 0.75 * cnts / cnts.max()
    onehot = F.one_hot(y, C).float()
    Fc = onehot.T @ h / onehot.sum(0).clamp_min(1)[:, None]
    z = (h - h.mean(0)) / torch.sqrt(1e-8 + h.var(0))
    off = z.T @ z
    off = off - torch.diag(torch.diagonal(off))
    d = h.shape[1]
    want = F.cross_entropy(h @ ref.head.weight.T * a, y) + 0.5 * (Fc - G).abs().mean() \
        + 0.1 * off.pow(2).sum() / (d * (d - 1)) / h.shape[0]
    names = [n for n, _ in ref.named_parameters() if n != "head.bias"]
    grads = torch.autograd.grad(want, [dict(ref.named_parameters())[n] for n in names])
    reply, _ = m.local_train(payload, {}, data, torch.Generator().manual_seed(3))
    assert reply.meta["loss"] == pytest.approx(want.item(), rel=1e-6)
    assert set(reply.meta) >= {"loss_ce", "loss_centre", "loss_decorr"} and "loss_distance" not in reply.meta
    for n, g in zip(names, grads):
        assert torch.allclose(reply.arrays[n], payload.arrays[n] - LR * g, rtol=1e-6, atol=1e-7), n
    assert torch.allclose(reply.arrays["fedlf.centres"], Fc.detach(), atol=1e-6)  # the centres still go up
    assert reply.arrays["fedlf.held"].tolist() == [c in (0, 2, 5, 7) for c in range(C)]


def test_a_class_with_one_sample_gives_finite_gradients_under_the_option():
    from fedlt.methods.fedlf import centre_gap, distance_ce, distance_loss

    # tensors: sample 0 is its class's only one, so its feature is its class centre (distance 0)
    h0 = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 3.0], [1.5, -1.0, 2.0]])
    y = torch.tensor([0, 1, 1])
    centres = torch.cat([h0[:1], h0[1:].mean(0, keepdim=True), torch.full((C - 2, 3), 1e-8)])
    gap = centre_gap(centres)
    h = h0.clone().requires_grad_(True)
    W = torch.randn(C, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    scale = torch.full((C,), 0.25)
    loss, _ = distance_loss(h, W, scale, y, centres, gap, 0.01, 0.01)
    gh, gw = torch.autograd.grad(loss, (h, W))
    assert torch.isfinite(loss) and torch.isfinite(gh).all() and torch.isfinite(gw).all()
    hd = h0.clone().requires_grad_(True)  # the distance term alone: a 0 gradient from the zero distance
    gd = torch.autograd.grad(distance_ce(hd, centres, y, gap), hd)[0]
    assert torch.isfinite(gd).all()
    ho = h0.clone().requires_grad_(True)  # the official square root of the expanded square: NaN
    official = official_loss(ho, W.detach(), torch.tensor([1.0, 2.0] + [0.0] * (C - 2)), y, centres, gap.item())
    assert torch.isnan(torch.autograd.grad(official, ho)[0]).any()

    # a client whose class 3 has one sample: a round of local training under the option stays finite
    data = client({0: 5, 3: 1, 6: 4}, seed=2)
    m = fedlf({"local_epochs": 3, "batch_size": 4}, loss="distance", decorr_weight=0.01)
    reply, _ = m.local_train(m.configure(m.init_server(), 1, 0), {}, data, torch.Generator().manual_seed(1))
    assert all(torch.isfinite(v).all() for v in reply.arrays.values())
    assert all(torch.isfinite(torch.tensor(reply.meta[k])) for k in ("loss", "loss_distance", "loss_decorr"))


def test_fedrs_proportional_scaling_is_fedrepos_fixed_one_not_its_first_uploads_decaying_one():
    """Issue 41 item 2: fedlt's ``scaling=proportional`` is FedRepo's ``algorithms/fedrs.py`` as fixed (617ee01:
    the scale computed from the counts at every step, the same every step), not its first upload (18eeb6d: the
    scaled vector written back into ``dist`` at each step, so the restriction decays towards 1 within a round)."""
    from fedlt.methods.fedrs import restricted_scale

    counts, alpha = torch.tensor([40.0, 10.0, 0.0, 5.0]), 0.5
    ours = restricted_scale(counts, alpha, "proportional")
    fixed = []  # 617ee01: cdist = dist / dist.max(); cdist = cdist * (1 - alpha) + alpha, from the counts each step
    decaying, dist = [], counts.clone()  # 18eeb6d: dist = dist / dist.max(); dist = dist * (1 - alpha) + alpha
    for _ in range(5):
        fixed.append((counts / counts.max()) * (1 - alpha) + alpha)
        dist = dist / dist.max()
        dist = dist * (1 - alpha) + alpha
        decaying.append(dist.clone())
    assert all(torch.allclose(ours, f) for f in fixed)
    assert torch.allclose(ours, decaying[0]) and not torch.allclose(ours, decaying[-1])
    assert (decaying[-1] > ours)[1:].all() and decaying[-1].min() > 0.95  # towards the plain softmax
