"""Issue 41, items 5, 6 and 8: GBME against the official code's formulas written out here (Spinozaaa/
Federated-Long-tailed-Learning at 9944e7a: ``FDGELoss.forward``, the client slices of ``fedavg_api.py`` and
``NormedLinear``), and the collapse warning every method's run gives when its global model predicts one class.

- ``expert_factor``: FDGELoss multiplies an expert round's loss by its configuration's ``num_experts`` (5), whatever
  the model's expert count; joint rounds are the plain sum over the experts (no factor), under either option.
- groups: the ranked clients are sliced ``order[int(N e / E) : int(N (e + 1) / E)]`` (the extra client of an uneven
  split in the later groups).
- ``head_init=unit``: NormedLinear's unit rows; the default keeps nn.Linear's range.
- a global model that predicts one class for every balanced test sample is said in one line, once per run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

from fedlt.core import RunSpec  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402

C = 10


def gbme(**params):
    cls = METHODS.get("gbme")
    return cls(RunSpec("smallcnn", (1, 8, 8), C, rounds=10, num_clients=4, local_epochs=1, batch_size=8),
               cls.make_params(params))


def known_state(m):
    state = m.init_server()
    state["known"][:] = True
    state["proxy"][:] = torch.arange(1, C + 1, dtype=torch.float32)
    return state


def official_fdge(logits, y, cls_num_list, training_exp, num_experts):
    """FDGELoss.forward with extra_info: the balanced softmax (log of the prior + 1e-9) of each expert in
    ``training_exp`` (None: every expert), summed, times ``num_experts`` when training one expert."""
    prior = torch.tensor(np.array(cls_num_list) / np.sum(cls_num_list))
    loss = 0
    for exp_id, z in enumerate(logits):
        if training_exp is None or str(exp_id) in training_exp:
            loss += F.cross_entropy(z + torch.log(prior + 1e-9).float(), y)
    if training_exp is not None:
        loss = loss * num_experts
    return loss


@pytest.mark.parametrize("expert_factor", [None, 5.0])
def test_gbme_expert_round_loss_is_the_official_fdge_loss(expert_factor):
    from fedlt.methods.gbme import EXPERT, JOINT, global_prior

    m = gbme(**({} if expert_factor is None else {"expert_factor": expert_factor}))
    E = m.p.experts
    state = known_state(m)
    model = m.new_model()
    model.load_state_dict(state["weights"], strict=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, C, (8,), generator=g)
    counts = global_prior(state["proxy"], state["known"]).tolist()

    class Net:  # the functional view step_loss reads: the backbone and the parameters by name
        backbone = model.backbone
        params = dict(model.named_parameters())

    for rnd, cid in ((9, 2), (3, 1)):  # an expert round (9 > 0.6 x 10) and a joint one
        msg = m.configure(state, rnd, cid)
        steps = m.local_steps(msg, {}, None)
        ours = m.step_loss(Net, x, y, steps.extra)
        z = m.p.scale * torch.einsum("bd,ecd->ebc", F.normalize(model.backbone(x), dim=1),
                                     F.normalize(model.head.weight, dim=2))
        if msg.meta["mode"] == EXPERT:
            e = int(msg.arrays["gbme.mask"].argmax())
            ref = official_fdge(z, y, counts, [str(e)], E if expert_factor is None else 5)
        else:
            assert msg.meta["mode"] == JOINT
            ref = official_fdge(z, y, counts, None, 5)
        assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-6)
        ga = torch.autograd.grad(ours, [model.head.weight, model.backbone.fc[0].weight])
        gb = torch.autograd.grad(ref, [model.head.weight, model.backbone.fc[0].weight])
        assert all((a - b).abs().max() <= 1e-5 * b.abs().max() for a, b in zip(ga, gb))  # float noise
    if expert_factor is not None:  # the official factor is 5/3 the default's at E = 3
        assert m.p.experts == 3


def official_groups(proxy, known, E):
    """fedavg_api.py: the known clients ranked by sum_c P_c q_c / n (P = max(sum of their estimates, 5)),
    most head-heavy first, then the slices int(N e / E) : int(N (e + 1) / E)."""
    ids = [k for k in range(len(known)) if known[k]]
    P = np.maximum(sum(proxy[k] for k in ids), 5.0)
    score = {k: float((P * proxy[k]).sum() / max(proxy[k].sum(), 1)) for k in ids}
    order = sorted(ids, key=lambda k: (-score[k], k))
    N = len(order)
    return {k: e for e in range(E) for k in order[int(N * e / E):int(N * (e + 1) / E)]}


def test_gbme_groups_follow_the_official_slices():
    from fedlt.methods.gbme import expert_groups

    rng = np.random.default_rng(0)
    uneven = 0
    for N in range(1, 12):
        for E in (2, 3, 5):
            proxy = rng.integers(0, 50, size=(N + 2, 6)).astype(np.float32)
            known = np.array([True] * N + [False, False])
            ours = expert_groups(torch.from_numpy(proxy), torch.from_numpy(known), E)
            assert ours == official_groups(proxy, known, E)
            uneven += N % E != 0
    assert uneven > 10
    proxy = torch.tensor([[40.0, 1], [30, 2], [2, 30], [1, 40]])  # 4 clients, 3 groups: the last holds two
    assert expert_groups(proxy, torch.ones(4, dtype=torch.bool), 3) == {0: 0, 1: 1, 2: 2, 3: 2}


def test_gbme_unit_head_init_is_normedlinears_and_the_default_is_linears():
    dim = gbme().new_model().feature_dim
    W = gbme(head_init="unit").new_model().head.weight.detach()
    assert torch.allclose(W.norm(dim=2), torch.ones(W.shape[:2]))
    W0 = gbme().new_model().head.weight.detach()
    assert W0.abs().max() <= 1 / dim ** 0.5 and (W0.norm(dim=2) < 0.9).all()


def test_a_collapsed_global_model_is_said_once(small, monkeypatch):
    """Every evaluation of a model that predicts one class: one warning line for the run, and the record names
    the class; a model that learns (the fixture's FedAvg) is never flagged."""
    import fedlt.metrics as metrics
    from fedlt.engine import EngineConfig, Simulation
    from fedlt.runner.rundir import federation_for, prepare
    from conftest import small_config

    cfg = small_config(rounds=4, eval_every=2)
    pr = prepare(cfg, federation_for(cfg))
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    said = []
    sim.echo = said.append
    real = metrics.head_predict
    monkeypatch.setattr(metrics, "head_predict", lambda head, f: torch.full_like(real(head, f), 3))
    final = sim.run()
    assert final["global"]["global"]["collapsed"] == 3
    lines = [s for s in said if "collapsed" in s]
    assert len(lines) == 1 and "predicts class 3 for every test sample" in lines[0] and "\n" not in lines[0]
    monkeypatch.setattr(metrics, "head_predict", real)
    _, final = small("fedavg", rounds=4, eval_every=2)
    assert "collapsed" not in final["global"]["global"]


def test_personal_models_that_output_non_finite_values_are_counted_and_said_once(small, monkeypatch):
    """A personal model whose training diverged (its logits NaN) predicts arbitrary classes, which PM would average
    silently: PM counts those clients (``nonfinite``) and the run says so once; Ditto that learns is never flagged."""
    import fedlt.metrics as metrics
    from fedlt.engine import EngineConfig, Simulation
    from fedlt.runner.rundir import federation_for, prepare
    from conftest import small_config

    cfg = small_config(method="ditto", rounds=2, eval_every=1, local_epochs=1)
    pr = prepare(cfg, federation_for(cfg))
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    said = []
    sim.echo = said.append
    real = metrics.head_logits
    monkeypatch.setattr(metrics, "head_logits", lambda head, f: real(head, f) * float("nan"))
    final = sim.run()
    assert final["personal"]["personal"]["nonfinite"] == len(final["personal"]["personal"]["per_client"]) == 6
    lines = [s for s in said if "non-finite" in s]
    assert len(lines) == 1 and "6 of 6 clients" in lines[0] and "\n" not in lines[0]
    monkeypatch.setattr(metrics, "head_logits", real)
    _, final = small("ditto", rounds=2, eval_every=2, local_epochs=1)
    assert "nonfinite" not in final["personal"]["personal"]
    # FedLoGe's personal heads give -inf to the classes a client lacks (mask_absent): by design, not divergence
    _, final = small("fedloge", rounds=2, eval_every=2, local_epochs=1)
    assert not any("nonfinite" in rep for rep in final["personal"].values()), final["personal"].keys()
    inf = float("inf")
    assert not metrics.diverged(torch.tensor([[1.0, -inf], [-inf, 2.0]]))
    assert all(metrics.diverged(torch.tensor(t)) for t in ([[1.0, float("nan")]], [[inf, 0.0]], [[0.0, 1.0], [-inf, -inf]]))
