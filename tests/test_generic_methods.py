"""Generic FL baselines: FedAvgM, FedAdam, SCAFFOLD, FedNTD, FedExP, SphereFed -- each one's defining
mechanism, and that each learns on the small long-tailed federation."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import run_small, small_config
from fedlt.core import Message, RunSpec
from fedlt.core.etf import fixed_classifier
from fedlt.core.server_opt import momentum_direction
from fedlt.core.training import effective_steps
from fedlt.engine import EngineConfig, Simulation
from fedlt.errors import ConfigError
from fedlt.runner.rundir import federation_for, prepare
from fedlt.methods.fedadam import FedAdam
from fedlt.methods.fedexp import FedExP
from fedlt.methods.fedntd import ntd_loss, ntd_term
from fedlt.methods.scaffold import C_UP, Scaffold
from fedlt.methods.spherefed import SphereFed

SPEC = RunSpec(model="smallcnn", in_shape=(1, 8, 8), num_classes=10, seed=0)


def traced_run(method: str, params: dict | None = None, **over):
    """run_small, recording every (client id, payload, reply, client state after) of the training rounds and
    every phase message."""
    cfg = small_config(method=method, params=params or {}, **over)
    pr = prepare(cfg, federation_for(cfg))
    m, log = pr.method, []
    train, phase = m.local_train, m.phase_client

    def local_train(payload, cstate, data, gen):
        before = {k: v.clone() for k, v in cstate.get("c", {}).items()}
        reply, new = train(payload, cstate, data, gen)
        log.append((data.client_id, payload, reply, before, new))
        return reply, new

    def phase_client(name, payload, cstate, data, gen):
        reply, new = phase(name, payload, cstate, data, gen)
        log.append((data.client_id, payload, reply, None, new))
        return reply, new

    m.local_train, m.phase_client = local_train, phase_client
    sim = Simulation(m, pr.fed, EngineConfig.of(cfg, progress=False))
    return sim, sim.run(), log


def fake_replies(weights, scales, sizes, seed=0):
    """Client replies w + s * noise (parameters only), with the given sample counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (s, n) in enumerate(zip(scales, sizes)):
        arrays = {k: v + s * torch.randn(v.shape, generator=g) for k, v in weights.items()}
        out.append((i, Message(arrays, {"num_examples": n})))
    return out


# ------------------------------------------------------------------------------------------ learning
@pytest.mark.parametrize("method", ["fedavgm", "fedadam", "scaffold", "fedntd", "fedexp", "spherefed"])
def test_method_learns_on_the_small_long_tailed_problem(method):
    _, final = run_small(method)
    for mode, r in final["global"].items():
        assert r["acc"] > 0.4, (mode, r["acc"])  # chance is 0.1
    assert next(iter(final["personal"].values()))["acc"] > 0.4


# ------------------------------------------------------------------------------------------ FedAvgM
def test_fedavgm_without_momentum_and_unit_server_lr_is_fedavg():
    sa, fa = run_small("fedavg", rounds=3)
    sm, fm = run_small("fedavgm", {"momentum": 0.0, "server_lr": 1.0}, rounds=3)
    for k, v in sa.state["weights"].items():
        assert torch.allclose(v, sm.state["weights"][k], atol=1e-5, rtol=0), k
    assert abs(fa["global"]["global"]["acc"] - fm["global"]["global"]["acc"]) < 0.01
    # and with momentum the trajectory differs
    s9, _ = run_small("fedavgm", {"momentum": 0.9}, rounds=3)
    w, w9 = sa.state["weights"], s9.state["weights"]
    assert max(float((w[k] - w9[k]).abs().max()) for k in w) > 1e-2


def test_server_momentum_accumulates_the_pseudo_gradients():
    opt, g1, g2 = {}, {"a": torch.tensor([1.0, -2.0])}, {"a": torch.tensor([0.5, 0.5])}
    momentum_direction(g1, opt, 0.9)
    d = momentum_direction(g2, opt, 0.9)
    assert torch.allclose(d["a"], 0.9 * g1["a"] + g2["a"])
    dn = momentum_direction(g2, {"v": {"a": g1["a"].clone()}}, 0.9, nesterov=True)
    assert torch.allclose(dn["a"], g2["a"] + 0.9 * (0.9 * g1["a"] + g2["a"]))


# ------------------------------------------------------------------------------------------ FedAdam
def test_fedadam_state_persists_on_the_server_and_steps_follow_adam():
    p = FedAdam.make_params({"server_lr": 0.05, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3})
    m = FedAdam(SPEC, p)
    state = m.init_server()
    keys = m.param_keys
    mom = {k: torch.zeros_like(state["weights"][k]) for k in keys}
    var = {k: torch.full_like(state["weights"][k], 1e-6) for k in keys}
    for rnd in (1, 2, 3):
        w = {k: v.clone() for k, v in state["weights"].items()}
        replies = fake_replies(w, [0.01, 0.03], [10, 30], seed=rnd)
        avg = {k: (replies[0][1].arrays[k] * 10 + replies[1][1].arrays[k] * 30) / 40 for k in w}
        state = m.aggregate(state, rnd, replies)
        for k in keys:
            g = w[k] - avg[k]
            mom[k] = 0.9 * mom[k] + 0.1 * g
            var[k] = 0.99 * var[k] + 0.01 * g * g
            expected = w[k] - 0.05 * mom[k] / (var[k].sqrt() + 1e-3)
            assert torch.allclose(state["weights"][k], expected, atol=1e-6), (rnd, k)
            assert torch.allclose(state["server_opt"]["m"][k], mom[k], atol=1e-7)
        assert state["server_opt"]["t"] == rnd
    # an Adam step moves every coordinate by at most about server_lr, whatever the update's scale
    w = dict(state["weights"])
    state = m.aggregate(state, 4, fake_replies(w, [100.0, 100.0], [1, 1], seed=9))
    assert max(float((state["weights"][k] - w[k]).abs().max()) for k in keys) < 0.05 / (1 - 0.9) + 1e-6


# ------------------------------------------------------------------------------------------ SCAFFOLD
def test_scaffold_server_variate_is_the_mean_of_client_variates_which_never_leave():
    sim, _, log = traced_run("scaffold", rounds=4)
    N = len(sim.fed.clients)
    c = sim.state["c"]
    for k, v in c.items():
        mean = sum(sim.client_states[i].get("c", {}).get(k, torch.zeros_like(v)) for i in range(N)) / N
        assert torch.allclose(v, mean, atol=1e-6), k
    assert max(float(v.abs().max()) for v in c.values()) > 0
    weight_keys = set(sim.state["weights"])
    seen_before = set()
    for cid, payload, reply, before, after in log:
        assert set(reply.arrays) == weight_keys | {C_UP + k for k in c}
        for k in c:  # the upload is the change of c_i, not c_i itself
            prev = before.get(k, torch.zeros_like(after["c"][k]))
            assert torch.allclose(reply.arrays[C_UP + k], after["c"][k] - prev, atol=1e-6)
            if cid in seen_before:
                assert not torch.allclose(reply.arrays[C_UP + k], after["c"][k], atol=1e-6)
        seen_before.add(cid)
    # c travels with the model: twice FedAvg's bytes each way (the smallcnn has no buffers)
    fa, _ = run_small("fedavg", rounds=1)
    for way in ("bytes_down_per_client", "bytes_up_per_client"):
        assert sim.history[0][way] == 2 * fa.history[0][way]


def test_scaffold_option_two_divisor_matches_momentum_sgd_displacement():
    for rho, K, lr in [(0.0, 7, 0.1), (0.9, 12, 0.05), (0.5, 3, 0.2)]:
        w = torch.zeros(3, requires_grad=True)
        g = torch.tensor([1.0, -2.0, 0.5])
        opt = torch.optim.SGD([w], lr=lr, momentum=rho)
        for _ in range(K):
            opt.zero_grad()
            (w * g).sum().backward()
            opt.step()
        # option II's estimate (x - y) / (K' lr) recovers the constant gradient exactly
        assert torch.allclose(-w.detach() / (effective_steps(K, rho) * lr), g, atol=1e-5)
    assert effective_steps(5, 0.0) == 5


def test_scaffold_option_one_uses_the_full_local_gradient_at_the_received_model():
    sim, _, log = traced_run("scaffold", {"option": "I"}, rounds=1)
    cid, payload, reply, before, after = log[0]
    m = sim.method
    net = m.new_model()
    net.load_state_dict({k: v for k, v in payload.arrays.items() if not k.startswith("c/")})
    data = sim.fed.clients[cid]
    F.cross_entropy(net(data.prep(data.x)), data.y).backward()
    for k, p in net.named_parameters():
        assert torch.allclose(after["c"][k], p.grad, atol=1e-5), k


# ------------------------------------------------------------------------------------------ FedNTD
def test_ntd_distillation_ignores_the_true_class_logit():
    g = torch.Generator().manual_seed(0)
    z, zg = torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g)
    y = torch.tensor([0, 3, 3, 9, 5, 1])
    base = ntd_term(z, zg, y, tau=2.0)
    assert base > 0
    z2, zg2 = z.clone(), zg.clone()
    z2[torch.arange(6), y] += 50.0  # change only the true-class entries, of student and teacher
    zg2[torch.arange(6), y] -= 30.0
    assert torch.allclose(ntd_term(z2, zg2, y, tau=2.0), base, atol=1e-6)
    assert float(ntd_term(zg, zg, y, 1.0)) == pytest.approx(0.0, abs=1e-7)
    # the distillation gradient never touches the true-class logit; with beta = 0 the loss is CE
    zr = z.clone().requires_grad_(True)
    ntd_term(zr, zg, y, 1.0).backward()
    assert torch.all(zr.grad[torch.arange(6), y] == 0) and zr.grad.abs().sum() > 0
    assert torch.allclose(ntd_loss(z, zg, y, 1.0, 0.0), F.cross_entropy(z, y))
    # a full-KL distillation would change with the true logit: the mechanism is the removal
    full = F.kl_div(F.log_softmax(z2, 1), F.softmax(zg2, 1), reduction="batchmean")
    assert not torch.allclose(full, F.kl_div(F.log_softmax(z, 1), F.softmax(zg, 1), reduction="batchmean"))


# ------------------------------------------------------------------------------------------ FedExP
def test_fedexp_step_size_is_at_least_one_and_follows_the_formula():
    m = FedExP(SPEC, FedExP.make_params({"eps": 1e-3}))
    state = m.init_server()
    keys = m.param_keys
    w0 = {k: v.clone() for k, v in state["weights"].items()}
    # two clients moving in opposite directions: their average is short, so the server extrapolates
    g = torch.Generator().manual_seed(1)
    d = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    replies = [(0, Message({k: w0[k] + 1.2 * d[k] for k in w0}, {"num_examples": 30})),
               (1, Message({k: w0[k] - 1.0 * d[k] for k in w0}, {"num_examples": 10}))]
    state = m.aggregate(state, 1, replies)
    sq = sum(float(d[k].double().pow(2).sum()) for k in keys)
    mean_sq = (0.75 * 1.44 + 0.25 * 1.0) * sq
    avg_sq = (0.75 * 1.2 - 0.25) ** 2 * sq
    eta = max(1.0, mean_sq / (2 * (avg_sq + 1e-3)))
    assert eta > 1 and state["eta_g"][-1] == pytest.approx(eta, rel=1e-6)
    for k in keys:
        assert torch.allclose(state["weights"][k], w0[k] + eta * (0.75 * 1.2 - 0.25) * d[k], atol=1e-6)
    # identical client updates: nothing to extrapolate, eta = 1 (plain FedAvg)
    w1 = {k: v.clone() for k, v in state["weights"].items()}
    same = [(i, Message({k: w1[k] + d[k] for k in w1}, {"num_examples": n})) for i, n in ((0, 5), (1, 7))]
    state = m.aggregate(state, 2, same)
    assert state["eta_g"][-1] == 1.0
    assert torch.allclose(state["prev_weights"][keys[0]], w1[keys[0]])
    # the paper's evaluation model is the average of the last two global models
    pred = m.global_model(state)["avg2"]
    assert torch.allclose(pred.head.weight, (w1["head.weight"] + state["weights"]["head.weight"]) / 2)


def test_fedexp_extrapolates_in_training():
    sim, _ = run_small("fedexp", rounds=6, participation=1.0)
    etas = sim.state["eta_g"]
    assert len(etas) == 6 and min(etas) >= 1.0 and max(etas) > 1.2


# ------------------------------------------------------------------------------------------ SphereFed
def test_spherefed_classifier_is_fixed_features_normalised_and_calibration_is_least_squares():
    sim, final, log = traced_run("spherefed", rounds=3)
    m, st = sim.method, sim.state
    d = m.net.feature_dim
    W = fixed_classifier("orthogonal", d, 10, seed=0)
    assert torch.equal(st["weights"]["head.weight"], W) and not st["weights"]["head.bias"].any()
    assert torch.allclose(W @ W.T, torch.eye(10), atol=1e-5)  # orthonormal class vectors
    for _, payload, reply, _, _ in log:  # the classifier never travels
        assert not any(k.startswith("head.") for k in list(payload.arrays) + list(reply.arrays))
    fixed = m.global_model(st)["fixed"]
    f = torch.randn(5, d).abs()
    z = fixed.head(f)
    assert torch.allclose(z, fixed.head(7.0 * f), atol=1e-6) and float(z.abs().max()) <= 1.0 + 1e-6
    # calibration = least squares over all clients' normalised features, solved without pooling the data
    net = m.eval_model(st["weights"])
    with torch.no_grad():
        H = torch.cat([F.normalize(net.backbone(c.prep(c.x)), dim=1) for c in sim.fed.clients]).double()
    Y = F.one_hot(torch.cat([c.y for c in sim.fed.clients]), 10).double()
    pooled = (torch.linalg.pinv(H) @ Y).T
    assert torch.allclose(st["calibrated_head"].double(), pooled, atol=1e-3)
    assert set(final["global"]) == {"calibrated", "fixed"}


@pytest.mark.parametrize("cls,bad", [(FedAdam, {"beta2": "1.0"}), (FedAdam, {"tau": "0"}),
                                     (FedExP, {"eps_mode": "code"}), (Scaffold, {"option": "III"}),
                                     (SphereFed, {"loss": "hinge"})])
def test_bad_parameters_are_config_errors(cls, bad):
    with pytest.raises(ConfigError, match=cls.name):
        cls(SPEC, cls.make_params(bad))
    with pytest.raises(ConfigError, match="has no parameter"):
        cls.make_params({"no_such_knob": 1})
