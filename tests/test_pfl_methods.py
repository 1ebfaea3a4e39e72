"""Personalized and reference baselines: FedBN, FedPer, FedRep, Ditto, FedRoD, FedBABU, Per-FedAvg, local-only
and centralized training. Per method: its defining mechanism, and that it learns on the small long-tailed
problem (digits, rho 10, 6 clients)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conftest import run_small
from fedlt.core import Message
from fedlt.engine.driver import client_generator
from fedlt.seeds import Purpose
from fedlt.errors import ConfigError
from fedlt.models import bn_keys, build_model, head_keys
from fedlt.registry import METHODS, MODELS

CHANCE = 0.1  # 10 balanced test classes


class TinyBN(nn.Module):
    """A small conv net whose BatchNorm layers have no 'bn' in their names (picked by type or not at all)."""

    def __init__(self, in_shape):
        super().__init__()
        c, h, w = in_shape
        self.net = nn.Sequential(nn.Conv2d(c, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                 nn.Flatten(), nn.Linear(8 * (h // 2) * (w // 2), 32), nn.BatchNorm1d(32), nn.ReLU())
        self.feature_dim = 32

    def forward(self, x):
        return self.net(x)


if "test-tinybn" not in MODELS.names():
    MODELS.register("test-tinybn", TinyBN)


@pytest.fixture
def wire(monkeypatch):
    """Records every Message a method's hooks produce (both directions, training, phases and evaluation)."""
    sent: list[Message] = []

    def spy(cls):
        for hook in ("configure", "local_train", "phase_configure", "phase_client", "eval_payload"):
            orig = getattr(cls, hook)

            def wrapped(self, *a, _orig=orig, **k):
                out = _orig(self, *a, **k)
                sent.append(out[0] if isinstance(out, tuple) else out)
                return out

            monkeypatch.setattr(cls, hook, wrapped)
        return sent

    return spy


def majority_pm(fed) -> float:
    """PM of a predictor that answers each client's most frequent test class: the bar a PM must clear."""
    return float(np.mean([np.bincount(c.test_y.numpy(), minlength=fed.num_classes).max() / len(c.test_y)
                          for c in fed.clients if len(c.test_y)]))


def pm(final) -> dict:
    return next(iter(final["personal"].values()))


def assert_learns(sim, final, gm=True):
    if gm:
        assert final["global"]["global"]["acc"] > CHANCE + 0.3
    else:
        assert final["global"] == {}  # no generic model, and none is faked
    assert pm(final)["source"] == "personal"
    assert pm(final)["acc"] > majority_pm(sim.fed) + 0.15


def flat(weights: dict, keys) -> torch.Tensor:
    return torch.cat([weights[k].flatten().float() for k in sorted(keys)])


# ------------------------------------------------------------------------------------------------ FedBN
def test_fedbn_keeps_batchnorm_on_clients_and_learns(wire):
    sent = wire(METHODS.get("fedbn"))
    sim, final = run_small("fedbn", model="test-tinybn", rounds=6, eval_every=6)
    m = sim.method
    bn = bn_keys(m.net)
    assert len(bn) == 10 and not any("bn" in k for k in bn)  # two BN layers, found by type
    assert sent and all(not (set(msg.arrays) & bn) for msg in sent)  # BN never on the wire
    trained = sorted({c for r in sim.schedule for c in r})
    stats = [flat(sim.client_states[c]["local"], [k for k in bn if "running_mean" in k]) for c in trained]
    assert all(not torch.allclose(stats[0], s) for s in stats[1:])  # each client's own statistics
    init = build_model("test-tinybn", sim.fed.in_shape, 10, seed=0).state_dict()
    assert all(torch.equal(sim.state["weights"][k], init[k]) for k in bn)  # the server never saw a BN entry
    assert_learns(sim, final)


def test_fedbn_without_batchnorm_is_fedavg():
    a, _ = run_small("fedbn", rounds=2, eval_every=2)
    b, _ = run_small("fedavg", rounds=2, eval_every=2)
    assert all(torch.equal(v, b.state["weights"][k]) for k, v in a.state["weights"].items())


# ------------------------------------------------------------------------------------------------ FedPer / FedRep
@pytest.mark.parametrize("method", ["fedper", "fedrep"])
def test_heads_never_leave_the_clients_and_bodies_are_shared(wire, method):
    sent = wire(METHODS.get(method))
    sim, final = run_small(method)
    heads = head_keys(sim.method.net)
    assert sent and all(not (set(msg.arrays) & heads) for msg in sent)
    trained = sorted({c for r in sim.schedule for c in r})
    h = [flat(sim.client_states[c]["local"], heads) for c in trained]
    assert all(not torch.allclose(h[0], x) for x in h[1:])  # one head per client
    assert_learns(sim, final, gm=False)


def test_fedrep_trains_the_head_first_then_the_body(monkeypatch):
    import fedlt.methods.fedrep as fedrep

    sim, _ = run_small("fedrep", rounds=1, eval_every=1)
    m, cid = sim.method, sim.schedule[0][0]
    calls = []
    orig = fedrep.run_steps

    def spy(method, steps, data, gen, lr=None):
        out = orig(method, steps, data, gen, lr)
        moved = {n.split(".")[0] for n, t in out.weights.items() if not torch.equal(t, steps.weights[n])}
        calls.append(([t.prefix for t in steps.train], steps.epochs, moved))
        return out

    monkeypatch.setattr(fedrep, "run_steps", spy)
    m.local_train(m.configure(sim.state, 2, cid), sim.client_states[cid], sim.fed.clients[cid],
                  client_generator(0, Purpose.TRAIN, 2, cid))
    assert calls == [(["head."], 10, {"head"}), (["backbone."], 1, {"backbone"})]


# ------------------------------------------------------------------------------------------------ Ditto
def test_ditto_personal_model_is_pulled_to_the_received_global_model_as_lambda_grows():
    sim, final = run_small("ditto")
    m, state = sim.method, sim.state
    trained = sorted({c for r in sim.schedule for c in r})
    w = state["weights"]
    keys = [n for n, _ in m.net.named_parameters()]
    for c in trained:  # personal and global models differ
        assert not torch.allclose(flat(sim.client_states[c]["personal"], keys), flat(w, keys))
    assert_learns(sim, final)

    cid = trained[0]
    payload, data = m.configure(state, 9, cid), sim.fed.clients[cid]
    fedavg = METHODS.get("fedavg")(m.spec)
    ref, _ = fedavg.local_train(payload, {}, data, client_generator(0, Purpose.TRAIN, 9, cid))
    dist = []
    for lam in (0.0, 0.1, 1.0, 10.0):
        m.p.lam = lam
        reply, cs = m.local_train(payload, sim.client_states[cid], data, client_generator(0, Purpose.TRAIN, 9, cid))
        assert all(torch.equal(v, ref.arrays[k]) for k, v in reply.arrays.items())  # the reply is FedAvg's
        dist.append(float((flat(cs["personal"], keys) - flat(payload.arrays, keys)).norm()))
    assert dist[0] > dist[1] > dist[2] > dist[3]


def test_train_local_clip_norm_bounds_every_step():
    """clip_norm clips the gradient's total norm before the step: one plain-SGD step moves the parameters by
    exactly lr * clip when the gradient is longer than the clip, and by lr * |grad| when it is shorter."""
    from types import SimpleNamespace

    from fedlt.core import train_local
    torch.manual_seed(0)
    x, y = torch.randn(8, 5) * 10, torch.randint(0, 3, (8,))
    data = SimpleNamespace(batches=lambda bs, gen, epochs: iter([(x, y)] * epochs))
    spec = SimpleNamespace(batch_size=8, local_epochs=1, precision="fp32", lr=0.1, device="cpu")
    for clip in (1e-3, 1e6):
        net = nn.Linear(5, 3)
        before = torch.cat([p.detach().flatten() for p in net.parameters()])
        net.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        grad = float(torch.cat([p.grad.flatten() for p in net.parameters()]).norm())
        train_local(net, data, spec, torch.Generator(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                    clip_norm=clip)
        moved = float((torch.cat([p.detach().flatten() for p in net.parameters()]) - before).norm())
        assert moved == pytest.approx(0.1 * min(clip, grad), rel=1e-4)


def test_ditto_personal_clip_and_lr_scale_bound_the_personal_step():
    """fedlt's two Ditto settings act on the personal update only: the reply stays FedAvg's, a clip c bounds
    each personal step by lr * c / (1 - momentum) (SGD with momentum, no weight decay), and a small lr scale
    moves the personal model proportionally less."""
    sim, _ = run_small("ditto", rounds=2)
    m, state = sim.method, sim.state
    assert m.spec.weight_decay == 0 and m.spec.momentum < 1
    keys = [n for n, _ in m.net.named_parameters()]
    cid = sorted({c for r in sim.schedule for c in r})[0]
    payload, data = m.configure(state, 3, cid), sim.fed.clients[cid]
    m.p.lam = 0.0

    def personal_move(**params):
        for k, v in params.items():
            setattr(m.p, k, v)
        reply, cs = m.local_train(payload, sim.client_states[cid], data, client_generator(0, Purpose.TRAIN, 3, cid))
        for k in params:
            setattr(m.p, k, type(m.p)().__getattribute__(k))
        return reply, float((flat(cs["personal"], keys) - flat(sim.client_states[cid]["personal"], keys)).norm())

    ref, free = personal_move()
    clip = 1e-4
    reply, clipped = personal_move(personal_clip=clip)
    assert all(torch.equal(v, ref.arrays[k]) for k, v in reply.arrays.items())
    steps = len(data) * m.spec.local_epochs  # at least the number of batches
    assert 0 < clipped <= steps * m.spec.lr * clip / (1 - m.spec.momentum) < free / 10
    _, slow = personal_move(personal_lr_scale=1e-3)
    assert 0 < slow < free / 100


# ------------------------------------------------------------------------------------------------ FedRoD
def test_fedrod_generic_head_uses_balanced_softmax_and_personal_head_detached_features():
    """On a client holding one class, Balanced Softmax with the client's prior gives that class all the mass,
    so body and generic head get no gradient; the personal head, on detached features, still learns."""
    sim, final = run_small("fedrod")
    assert_learns(sim, final)
    assert final["global"]["global"]["few"] is not None
    m = sim.method
    c0 = sim.fed.clients[0]
    cls = int(np.argmax(c0.counts))
    keep = c0.y == cls
    one = type(c0)(99, c0.x[keep], c0.y[keep], c0.num_classes, c0.prep, c0.test_x, c0.test_y)
    payload = m.configure(sim.state, 9, 99)
    for detach in (True, False):
        m.p.detach = detach
        cs = m.init_client(99, one)
        reply, cs2 = m.local_train(payload, cs, one, torch.Generator().manual_seed(0))
        assert set(reply.arrays) == set(payload.arrays)  # only body and generic head travel
        body = [k for k in payload.arrays if k.startswith("backbone.") and payload.arrays[k].is_floating_point()]
        gen_head = [k for k in payload.arrays if k.startswith("head.")]
        assert torch.allclose(flat(reply.arrays, gen_head), flat(payload.arrays, gen_head), atol=1e-6)
        body_moved = not torch.allclose(flat(reply.arrays, body), flat(payload.arrays, body), atol=1e-6)
        assert body_moved == (not detach)  # FL-bench's variant lets the personal loss train the body
        assert not torch.allclose(flat(cs2["phead"], ["weight"]), flat(cs["phead"], ["weight"]))


# ------------------------------------------------------------------------------------------------ FedBABU
def test_fedbabu_head_stays_at_its_initialisation_and_finetuning_personalizes(wire):
    sent = wire(METHODS.get("fedbabu"))
    sim, final = run_small("fedbabu")
    m = sim.method
    heads = head_keys(m.net)
    init = build_model("smallcnn", sim.fed.in_shape, 10, seed=0).state_dict()
    assert all(torch.equal(sim.state["weights"][k], init[k]) for k in heads)  # bit-identical
    for c, cs in sim.client_states.items():
        assert all(torch.equal(cs["local"][k], init[k]) for k in heads)
        assert not torch.equal(cs["finetuned"]["head.weight"], init["head.weight"])  # fine-tuned
    body = [k for k in init if k.startswith("backbone.")]
    assert not torch.allclose(flat(sim.state["weights"], body), flat(init, body))
    assert sent and all(not (set(msg.arrays) & heads) for msg in sent)  # body-only communication
    assert_learns(sim, final)


# ------------------------------------------------------------------------------------------------ Per-FedAvg
def test_perfedavg_first_order_step_is_the_maml_update():
    sim, final = run_small("perfedavg", batch_size=8)  # a meta-step takes 2B samples: small B, more steps
    assert_learns(sim, final)
    m = sim.method
    m.alpha, m.beta, m.spec.momentum, m.spec.local_epochs = 0.03, 0.07, 0.0, 1  # plain SGD, to compare
    c, B = sim.fed.clients[0], m.spec.batch_size
    one = type(c)(0, c.x[: 2 * B], c.y[: 2 * B], c.num_classes, c.prep, c.test_x, c.test_y)  # one meta-step
    payload = m.configure(sim.state, 9, 0)
    reply, _ = m.local_train(payload, {}, one, torch.Generator().manual_seed(3))
    (x, y), = list(one.batches(2 * B, torch.Generator().manual_seed(3)))
    net = build_model("smallcnn", sim.fed.in_shape, 10)
    theta = {n: payload.arrays[n] for n, _ in net.named_parameters()}

    def loss(params, xb, yb):
        return nn.functional.cross_entropy(torch.func.functional_call(net, params, (xb,)), yb)

    g0 = torch.func.grad(loss)(theta, x[:B], y[:B])  # inner step on D
    inner = {n: t - 0.03 * g0[n] for n, t in theta.items()}
    g1 = torch.func.grad(loss)(inner, x[B:], y[B:])  # gradient at theta' on D', applied to theta
    for n, t in theta.items():
        assert torch.allclose(reply.arrays[n], t - 0.07 * g1[n], atol=1e-6), n


def test_perfedavg_hessian_free_variant():
    from fedlt.methods.perfedavg import hessian_vector

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(20, 6, dtype=torch.double), torch.randint(0, 3, (20,))
    params = list(net.parameters())
    v = [torch.randn_like(p) for p in params]
    before = [p.detach().clone() for p in params]
    approx = hessian_vector(net, params, v, x, y, 1e-4)
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # theta is left where it was
    g = torch.autograd.grad(nn.functional.cross_entropy(net(x), y), params, create_graph=True)
    exact = torch.autograd.grad(sum((a * b).sum() for a, b in zip(g, v)), params)
    for a, e in zip(approx, exact):
        assert torch.allclose(a, e, atol=1e-6, rtol=1e-4)
    sim, final = run_small("perfedavg", {"variant": "hf"}, batch_size=8)
    assert_learns(sim, final)


# ------------------------------------------------------------------------------------------------ local / centralized
def test_local_training_sends_nothing_and_keeps_one_model_per_client(wire):
    sent = wire(METHODS.get("local"))
    sim, final = run_small("local")
    assert sent and all(not msg.arrays for msg in sent)
    trained = sorted({c for r in sim.schedule for c in r})
    w = [flat(sim.client_states[c]["weights"], ["head.weight"]) for c in trained]
    assert all(not torch.allclose(w[0], x) for x in w[1:])
    assert_learns(sim, final, gm=False)


def test_centralized_trains_the_pooled_data_on_the_server(monkeypatch):
    import fedlt.methods.centralized as centralized

    seen = []
    orig = centralized.train_local
    monkeypatch.setattr(centralized, "train_local", lambda net, data, *a, **k: seen.append(len(data)) or orig(
        net, data, *a, **k))
    sim, final = run_small("centralized", rounds=4, eval_every=4)
    assert seen == [sum(len(c) for c in sim.fed.clients)] * 4  # every round, all clients' samples
    assert final["global"]["global"]["acc"] > CHANCE + 0.5
    assert pm(final)["source"] == "global"  # PM is the global model on the K clients' own test sets
    assert len(pm(final)["per_client"]) == len(sim.fed.clients)
    m = METHODS.get("centralized")(sim.method.spec)  # without the experiment layer there is no pool
    with pytest.raises(ConfigError, match="pooled"):
        m.aggregate(m.init_server(), 1, [])
