"""RedGrape, CReFF, BalanceFL, Ratio Loss, CLIMB: per method, a test of its defining mechanism and a learning
test on the small long-tailed federation (digits, rho 10, 6 clients; chance is 10 %)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from fedlt.core import Message, RunSpec  # noqa: E402
from fedlt.core.classgrad import head_ce_grads  # noqa: E402
from fedlt.core.sampling import class_balanced_indices  # noqa: E402
from fedlt.data.federated import ClientData, Prep  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.metrics import features, head_predict  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402

C = 10


def spec(**over) -> RunSpec:
    return RunSpec(model="smallcnn", in_shape=(1, 8, 8), num_classes=C, batch_size=16, local_epochs=1, **over)


def synthetic_client(cid: int, counts: dict[int, int], seed: int = 0) -> ClientData:
    """A client whose samples of class c are a class-specific pattern plus noise (float input)."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(C, 1, 8, 8, generator=torch.Generator().manual_seed(99))
    y = torch.cat([torch.full((n,), c, dtype=torch.long) for c, n in counts.items()])
    x = protos[y] + 0.5 * torch.randn(len(y), 1, 8, 8, generator=g)
    return ClientData(cid, x, y, C, Prep((0.0,), (1.0,)), x[:0], y[:0])


def learn(small, method, params=None, **over):
    sim, final = small(method, params or {}, **over)
    return sim, final["global"][next(iter(final["global"]))]


# ------------------------------------------------------------------------------------------- shared core
def test_closed_form_head_gradients_match_autograd():
    g = torch.Generator().manual_seed(0)
    h, y = torch.randn(40, 6, generator=g), torch.randint(0, 4, (40,), generator=g)
    W = torch.randn(4, 6, generator=g, requires_grad=True)
    b = torch.randn(4, generator=g, requires_grad=True)
    gw, gb = head_ce_grads(h, y, W.detach(), b.detach(), [1, 3])
    for i, c in enumerate([1, 3]):
        m = y == c
        aw, ab = torch.autograd.grad(torch.nn.functional.cross_entropy(h[m] @ W.T + b, y[m]), (W, b))
        assert torch.allclose(gw[i], aw, atol=1e-6) and torch.allclose(gb[i], ab, atol=1e-6)


# ------------------------------------------------------------------------------------------- RedGrape
def test_redgrape_prototypes_of_absent_classes_come_from_other_clients_and_stay_stale():
    m = METHODS.get("redgrape")(spec())
    a = synthetic_client(0, {0: 30, 1: 30, 2: 30}, seed=1)
    b = synthetic_client(1, {3: 30, 4: 30}, seed=2)
    state = m.init_server()
    gen = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    ra, _ = m.local_train(m.configure(state, 1, 0), {}, a, gen(1))
    rb, _ = m.local_train(m.configure(state, 1, 1), {}, b, gen(2))
    # the upload holds prototypes of the held classes only, and the bytes count them
    assert ra.arrays["proto.classes"].tolist() == [0, 1, 2]
    extra = 3 * (C * 128 + C) * 4 + 3 * 8
    model_and_sup = sum(v.numel() * v.element_size() for k, v in ra.arrays.items() if not k.startswith("proto."))
    assert ra.nbytes() == model_and_sup + extra
    state = m.aggregate(state, 1, [(0, ra), (1, rb)])
    assert sorted(state["protos"]) == [0, 1, 2, 3, 4]
    assert torch.equal(state["protos"][3][0], rb.arrays["proto.w"][0])  # only client 1 holds class 3
    payload = m.configure(state, 2, 0)
    assert {3, 4} <= set(payload.arrays["gproto.classes"].tolist())  # client 0 receives what it lacks
    # round 2, only client 0: its classes are refreshed, classes 3 and 4 keep their stale prototypes
    ra2, _ = m.local_train(payload, {}, a, gen(3))
    old3 = state["protos"][3][0].clone()
    state = m.aggregate(state, 2, [(0, ra2)])
    assert torch.equal(state["protos"][3][0], old3)
    assert torch.equal(state["protos"][0][0], ra2.arrays["proto.w"][0])
    # the re-balancing step pulls the head towards the classes client 0 lacks (their bias rises)
    m0 = METHODS.get("redgrape")(spec(), METHODS.get("redgrape").make_params({"lam": 0.0}))
    r_off, _ = m0.local_train(payload, {}, a, gen(3))
    assert (ra2.arrays["head.bias"][[3, 4]] > r_off.arrays["head.bias"][[3, 4]]).all()


def test_redgrape_learns_and_rejects_bad_params(small):
    sim, gm = learn(small, "redgrape")
    assert gm["acc"] > 0.5
    assert "sup.weight" in sim.state["weights"] and "sup.weight" not in sim.method.eval_model(sim.state["weights"]).state_dict()
    with pytest.raises(ConfigError, match="rebalance_step"):
        METHODS.get("redgrape")(spec(), METHODS.get("redgrape").make_params({"rebalance_step": "both"}))


# ------------------------------------------------------------------------------------------- CReFF
def test_creff_gradient_matching_moves_features_towards_real_gradients():
    from fedlt.methods.creff import match_distance, match_features

    g = torch.Generator().manual_seed(0)
    W, b = torch.randn(C, 16, generator=g), torch.randn(C, generator=g)
    real_h = torch.randn(200, 16, generator=g).abs() + 1.0
    real_y = torch.randint(0, C, (200,), generator=g)
    gw, gb = head_ce_grads(real_h, real_y, W, b, range(C))
    targets = {c: (gw[c], gb[c]) for c in range(C)}
    feats, labels = torch.randn(5 * C, 16, generator=g), torch.arange(C).repeat_interleave(5)
    before = match_distance(*head_ce_grads(feats, labels, W, b, range(C)), gw, gb)
    after_f = match_features(feats, labels, W, b, targets, steps=50, lr=0.1)
    after = match_distance(*head_ce_grads(after_f, labels, W, b, range(C)), gw, gb)
    assert after < 0.5 * before


def test_creff_retrained_head_differs_from_fedavg_head_and_is_used_at_inference(small):
    params = {"ipc": 20, "match_epochs": 30, "crt_epochs": 60}
    sim, gm = learn(small, "creff", params, rounds=6, eval_every=3)
    assert gm["acc"] > 0.5
    st = sim.state
    assert not torch.allclose(st["crt"]["crt.weight"], st["weights"]["head.weight"])
    modes = sim.method.global_model(st)
    assert list(modes)[0] == "retrained"
    assert torch.equal(modes["retrained"].head.weight, st["crt"]["crt.weight"])
    f, y = features(modes["retrained"].backbone, sim.fed.test_batches())
    acc = float((head_predict(modes["retrained"].head, f) == y).float().mean())
    assert acc == pytest.approx(gm["acc"])  # the headline GM is the re-trained head's accuracy
    fedavg_acc = float((head_predict(modes["fedavg_head"].head, f) == y).float().mean())
    assert acc != fedavg_acc


# ------------------------------------------------------------------------------------------- BalanceFL
def test_balancefl_sampler_draws_classes_uniformly():
    labels = torch.cat([torch.full((1000,), 0), torch.full((10,), 4), torch.full((1,), 7)])
    idx = class_balanced_indices(labels, 30000, torch.Generator().manual_seed(0))
    freq = torch.bincount(labels[idx], minlength=C).float() / len(idx)
    assert torch.allclose(freq[[0, 4, 7]], torch.full((3,), 1 / 3), atol=0.02)
    within = torch.bincount(idx[labels[idx] == 4] - 1000, minlength=10).float()  # uniform inside a class
    assert within.min() > 0.7 * within.mean()


def test_balancefl_covariance_and_distillation_follow_eqs_3_4_6():
    from fedlt.methods.balancefl import ki_loss, pooled_covariance

    g = torch.Generator().manual_seed(0)
    f = torch.randn(31, 5, generator=g)
    y = torch.tensor([0] * 20 + [1] * 10 + [2])
    cov = pooled_covariance(f, y, 3)
    manual = (20 * np.cov(f[:20].numpy().T) + 10 * np.cov(f[20:30].numpy().T)) / 31  # class 2: one sample
    assert np.allclose(cov.numpy(), manual, atol=1e-5)
    s, t = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    absent = torch.tensor([False, False, True, True, False, True])
    q_t, logq_s = torch.softmax(t / 2, 1), torch.log_softmax(s / 2, 1)
    assert torch.allclose(ki_loss(s, t, absent, 2.0, False), -(q_t * logq_s)[:, absent].sum(1).mean())
    # the official variant renormalises over the absent classes: present logits do not matter
    s2 = s.clone()
    s2[:, ~absent] += 5.0
    assert torch.allclose(ki_loss(s, t, absent, 2.0, True), ki_loss(s2, t, absent, 2.0, True))


def test_balancefl_learns(small):
    _, gm = learn(small, "balancefl")
    assert gm["acc"] > 0.5


# ------------------------------------------------------------------------------------------- Ratio Loss
def test_ratio_loss_weights_follow_the_ratio_of_monitor_gradients():
    from fedlt.methods.ratioloss import ratio_weights

    d = 4
    g = torch.tensor([1.0, 2.0, 8.0])  # how hard each class's auxiliary data pulls its own row
    o = torch.tensor([0.5, 0.25, 0.5])  # how hard each monitor pushes the other rows down
    w_last = torch.zeros(3, d)
    monitors = torch.stack([-o[c] * torch.ones(3, d) for c in range(3)])
    for c in range(3):
        monitors[c, c] = g[c]
    alpha, R = ratio_weights(w_last, monitors)
    expect = torch.stack([g[c] / (o[torch.arange(3) != c]).mean() for c in range(3)])
    assert torch.allclose(R, expect) and torch.allclose(alpha, 1 + 0.1 * expect)
    assert alpha.argsort().tolist() == [0, 1, 2]


def test_ratio_loss_auxiliary_set_is_balanced_and_avoids_client_samples(small):
    from fedlt.data.longtail import longtail_indices
    from fedlt.core.auxiliary import auxiliary_set

    sim, gm = learn(small, "ratioloss", lr=0.01)  # weights up to ~10x the loss: the official lr is small too
    assert gm["acc"] > 0.3
    assert "ratio.alpha" in sim.method.configure(sim.state, 1, 0).arrays
    s = sim.method.spec
    aux, overlap = auxiliary_set(s, 12)
    assert torch.bincount(aux.y, minlength=C).tolist() == [12] * C
    ds = sim.fed.dataset
    y = ds.y_train.numpy()
    keep = longtail_indices(y, C, s.data["imbalance_ratio"], s.data["seed"])
    spare = np.bincount(np.delete(y, keep), minlength=C)
    assert overlap == int(np.maximum(0, 12 - spare).sum())
    with pytest.raises(ConfigError, match="RunSpec.data"):
        METHODS.get("ratioloss")(spec()).init_server()  # a spec without the data settings


# ------------------------------------------------------------------------------------------- CLIMB
def test_climb_duals_move_towards_clients_with_higher_loss():
    m = METHODS.get("climb")(spec(num_clients=4), METHODS.get("climb").make_params({"dual_every": 1}))
    state = m.init_server()
    w = state["weights"]

    def reply(arrays, loss):
        return Message({**arrays, "climb.loss": torch.tensor([loss])}, {"num_examples": 10})

    state = m.aggregate(state, 1, [(0, reply(w, 0.2)), (1, reply(w, 2.0)), (2, reply(w, 0.5))])
    lam = state["lam"]
    assert lam[1] > 0 and lam[0] == 0 and lam[2] == 0 and lam[3] == 0  # only the high-loss client
    assert torch.isclose(lam[1], torch.tensor(2.0 * (2.0 - 0.9 - 0.01) / 4))
    # next round client 1 moved its model: its weight 1 + lam_1 - mean(lam) exceeds FedAvg's 1/2
    w0 = {k: v.clone() for k, v in state["weights"].items()}
    state = m.aggregate(state, 2, [(0, reply(w0, 1.0)), (1, reply({k: v + 1.0 for k, v in w0.items()}, 1.0))])
    shift = float((state["weights"]["head.bias"] - w0["head.bias"]).mean())
    assert shift == pytest.approx((1 + float(lam[1]) - float(lam.mean())) / 2, rel=1e-5) and shift > 0.5


def test_climb_uploads_the_received_models_loss_and_learns(small):
    from fedlt.methods.climb import dataset_loss

    sim, gm = learn(small, "climb")
    assert gm["acc"] > 0.5
    m, c = sim.method, sim.fed.clients[0]
    payload = m.configure(sim.state, 9, 0)
    reply, _ = m.local_train(payload, {}, c, torch.Generator().manual_seed(0))
    ref = m.eval_model(sim.state["weights"])
    assert float(reply.arrays["climb.loss"][0]) == pytest.approx(dataset_loss(ref, c), rel=1e-5)
    assert (sim.state["lam"] > 0).any()
