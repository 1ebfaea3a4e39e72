"""Issue 58: FedNPC, FedVLS and FedReLa against their released code, written out here from the released files (not
calls of fedlt's functions), on identical weights, batches and counts:

- FedNPC (JintongGao/FedNPC ``FedAvg-FedNPC.py`` at 48ad8d1): ``Local.local_train`` (plain SGD on CE),
  ``Global.initialize_for_model_fusion`` (sum_k n_k w_k / sum_k n_k) and ``re_train_classifier``'s steps (fresh
  ``torch.randint`` labels then ``torch.randn`` features each step, SGD momentum 0.9 on the classifier) from the
  same RNG stream, kept after a fixed number of steps (the released script's best-test-accuracy choice is left out).
- FedVLS (krumpguo/FedVLS ``clientvls.py`` / ``servervls.py`` at 7d8163f): ``PriorCELoss + new_LADEloss + lamda *
  VLSloss`` and its SGD (momentum 0.9, no weight decay) for a local round, then the n_k-weighted aggregate, under
  the defaults (the released form and weight); ``logit_form=paper logit_weight=1`` against Algorithm 1 (Technical
  Appendix) written out.
- FedReLa (guangzhengh/FedReLa ``util/FedReLa.py``, ``util/update_baseline.py`` at 20a58bd): the re-labelling
  pipeline in numpy (priors, class-wise z-scores, adaptive thresholds, tanh flip rates, one uniform draw of C a
  sample), and a local FedLoGe round on the re-labelled batch (``update_weights_gaux``'s three SGDs).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

from fedlt.core import Message, RunSpec, derive_seed, load_weights  # noqa: E402
from fedlt.data.federated import ClientData, Prep  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402
from distances import record  # noqa: E402

C = 10


def client(counts: dict[int, int], seed: int = 0, cid: int = 0) -> ClientData:
    """A client whose samples of class c are a class pattern plus noise (float input, no augmentation)."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(C, 1, 8, 8, generator=torch.Generator().manual_seed(99))
    y = torch.cat([torch.full((n,), c, dtype=torch.long) for c, n in counts.items()])
    x = protos[y] + 0.5 * torch.randn(len(y), 1, 8, 8, generator=g)
    return ClientData(cid, x, y, C, Prep((0.0,), (1.0,)), x[:0], y[:0])


def method(name: str, lr: float = 0.1, momentum: float = 0.0, epochs: int = 1, rounds: int = 50, **params):
    """``name`` on smallcnn (no BatchNorm: train and eval mode agree), every client's data in one batch."""
    spec = RunSpec(model="smallcnn", in_shape=(1, 8, 8), num_classes=C, batch_size=256, local_epochs=epochs, lr=lr,
                   momentum=momentum, rounds=rounds)
    cls = METHODS.get(name)
    return cls(spec, cls.make_params(params))


def official_aggregate(states, nums):
    """The released aggregations (FedNPC ``initialize_for_model_fusion``, FedVLS ``aggregate_parameters``,
    FedReLa ``FedAvg_noniid``): per key, sum_k w_k n_k / sum_k n_k."""
    total = sum(nums)
    return {k: sum(s[k] * (n / total) for s, n in zip(states, nums)) for k in states[0]}


def sgd_round(model, params, loss_of, x, y, lr, momentum, epochs, wd=0.0):
    """An official client's loop: a fresh ``torch.optim.SGD`` and ``epochs`` passes over the one batch."""
    opt = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd)
    for _ in range(epochs):
        loss = loss_of(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close(got: dict, want: dict, keys, atol=1e-6) -> float:
    worst = 0.0
    for k in keys:
        d = (got[k].double() - want[k].double()).abs().max().item()
        worst = max(worst, d)
        assert d <= atol, (k, d)
    return worst


# ------------------------------------------------------------------------------------------------ FedNPC
def official_npc(classifier: torch.nn.Linear, E: int, M: int, lr: float):
    """``re_train_classifier`` without its test-set selection: for epoch in range(1, E), generate_noisy_batch
    (``torch.randint(0, n_classes, (M,))`` then ``torch.randn((M, d))``, the global RNG), one CE step of SGD
    (lr, momentum 0.9) on the classifier alone; the classifier after the last step."""
    opt = torch.optim.SGD(classifier.parameters(), lr=lr, momentum=0.9)
    n_classes, d = classifier.weight.shape
    for _ in range(1, E):
        fake = torch.randint(0, n_classes, (M,))
        feats = torch.randn((M, d))
        loss = torch.nn.CrossEntropyLoss()(classifier(feats), fake)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return classifier.weight.detach(), classifier.bias.detach()


def test_fednpc_round_aggregation_and_stage2_match_the_released_script():
    m = method("fednpc", lr=0.1, momentum=0.0, epochs=2, steps=27, samples=2000)
    state = m.init_server()
    clients = [client({0: 9, 1: 5, 3: 2}, seed=1, cid=0), client({1: 7, 4: 6, 9: 3}, seed=2, cid=1)]
    replies, refs = [], []
    for k, data in enumerate(clients):
        payload = m.configure(state, 1, k)
        reply, _ = m.local_train(payload, {}, data, torch.Generator().manual_seed(k))
        replies.append((k, reply))
        ref = m.new_model()  # Local.local_train: SGD (no momentum) on CE from the global model
        load_weights(ref, payload.arrays)
        x, y = next(data.batches(256, None, shuffle=False, train=False))
        refs.append(sgd_round(ref, ref.parameters(), lambda net, a, b: F.cross_entropy(net(a), b), x, y, 0.1, 0.0, 2))
        record("fednpc", f"default: client {k}'s local round (Local.local_train)",
               assert_close(reply.arrays, refs[-1], refs[-1]))
    state = m.aggregate(state, 1, replies)
    want = official_aggregate(refs, [len(d) for d in clients])
    record("fednpc", "default: aggregation (initialize_for_model_fusion)", assert_close(state.weights, want, want))

    # stage 2 on the aggregate: the released steps from the same RNG stream, E = 28 -> 27 steps
    state = m.phase_aggregate("npc", state, [(k, Message(meta={"num_examples": len(d)})) for k, d in enumerate(clients)])
    head = torch.nn.Linear(*reversed(want["head.weight"].shape))
    with torch.no_grad():
        head.weight.copy_(state.weights["head.weight"])
        head.bias.copy_(state.weights["head.bias"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(m.spec.seed, 0x4E9C))
        W, b = official_npc(head, 28, 2000, 0.1)
    record("fednpc", "default: stage 2, 27 steps on noise (re_train_classifier, fixed epochs)",
           assert_close(state.npc, {"weight": W, "bias": b}, ("weight", "bias")))
    assert (state.npc["bias"] - state.weights["head.bias"]).abs().max() > 1e-3  # stage 2 moved the classifier
    # inference: the calibrated head on the stage-1 backbone; the preview before the phase is the same head
    modes = m.global_model(state)
    assert list(modes) == ["npc", "fedavg"]
    state.npc = None
    x, _ = next(clients[0].batches(256, None, shuffle=False, train=False))
    prev = m.global_model(state)["npc-preview"]
    torch.testing.assert_close(prev.head(prev.backbone(x)), F.linear(prev.backbone(x), W, b), atol=1e-5, rtol=1e-5)


def test_fednpc_stage2_balances_a_biased_classifier():
    """What stage 2 is for: a classifier with head-class biases, fitted to class-balanced noise, ends with its
    predictions on noise spread over the classes (the biases pulled together)."""
    from fedlt.methods.fednpc import noise_calibrate

    g = torch.Generator().manual_seed(0)
    W = torch.randn(C, 16, generator=g) * 0.3
    b = torch.linspace(3.0, -3.0, C)  # class 0 favoured, class 9 suppressed
    W2, b2 = noise_calibrate(W, b, 27, 0.1, 0.9, 10000, torch.Generator().manual_seed(1))
    f = torch.randn(20000, 16, generator=g)
    before = torch.bincount(F.linear(f, W, b).argmax(1), minlength=C).float() / len(f)
    after = torch.bincount(F.linear(f, W2, b2).argmax(1), minlength=C).float() / len(f)
    assert before.max() > 0.5 and after.max() < 0.25 and int((after > 0.03).sum()) >= 8 > int((before > 0.03).sum())
    assert b2.std() < 0.5 * b.std()


# ------------------------------------------------------------------------------------------------ FedVLS
class OfficialVLS:
    """clientVLS's losses, written out from the released file (prior from the client's counts)."""

    def __init__(self, counts: torch.Tensor, lamda: float):
        self.num_classes = len(counts)
        self.num_per_class = counts.float()
        self.prior = self.num_per_class / self.num_per_class.sum()
        self.no_exist_label = torch.where(self.prior == 0)[0].int()
        self.lamda = lamda

    def new_LADEloss(self, y_pred, target):
        cls_weight = self.num_per_class.float() / torch.sum(self.num_per_class.float())
        balanced_prior = torch.tensor(1. / self.num_classes).float()
        pred_spread = (y_pred - torch.log(self.prior + 1e-9) + torch.log(balanced_prior + 1e-9)).T * \
            (target != torch.arange(0, self.num_classes).view(-1, 1).type_as(target))
        N = pred_spread.size(-1)
        second_term = torch.logsumexp(pred_spread, -1) - np.log(N)
        loss = - torch.sum((- second_term) * cls_weight)
        return loss * 0.005

    def PriorCELoss(self, output, y):
        return torch.nn.CrossEntropyLoss()(output + torch.log(self.prior + 1e-9), y)

    def VLSloss(self, output, teach_output):
        # the released dim=None: the implicit dimension of a 2-D input, 1
        s = torch.nn.functional.log_softmax(output[:, self.no_exist_label], dim=1)
        t = torch.nn.functional.softmax(teach_output[:, self.no_exist_label], dim=1)
        return torch.nn.KLDivLoss(reduction='batchmean')(s, t)

    def loss(self, teacher):
        def f(net, x, y):
            output = net(x)
            teach_output = teacher(x).detach()
            return self.PriorCELoss(output, y) + self.new_LADEloss(output, y) + \
                self.VLSloss(output, teach_output) * self.lamda
        return f


def paper_vls(counts: torch.Tensor, lam: float):
    """Algorithm 1, lines 14-18: L_cal (p(c) = 0 drops a class) + lambda KL over the vacant classes O + L_logit =
    sum_c p(c) log mean_i 1[y_i != c] e^{z_ic}, with exp and log as written."""
    p = counts.double() / counts.sum()
    vacant = p == 0

    def f(net, teacher, x, y):
        z = net(x).double()
        with torch.no_grad():
            zg = teacher(x).double()
        num = p[y] * torch.exp(z.gather(1, y[:, None]).squeeze(1))
        cal = -torch.log(num / (p[None, :] * torch.exp(z)).sum(1)).mean()
        q, qg = torch.softmax(z[:, vacant], 1), torch.softmax(zg[:, vacant], 1)
        dis = (qg * torch.log(qg / q)).sum(1).mean()
        other = (y[:, None] != torch.arange(C)[None, :]).double()
        mean = (other * torch.exp(z)).mean(0)
        held = (p > 0) & (other.sum(0) > 0)
        logit = (p[held] * torch.log(mean[held])).sum()
        return (cal + lam * dis + logit).float()
    return f


def vls_round(m, data, state, loss, lr, epochs):
    payload = m.configure(state, 1, data.client_id)
    ref = m.new_model()
    load_weights(ref, payload.arrays)
    teacher = m.new_model()
    load_weights(teacher, payload.arrays)
    x, y = next(data.batches(256, None, shuffle=False, train=False))
    want = sgd_round(ref, ref.parameters(), loss(teacher), x, y, lr, 0.9, epochs)
    reply, _ = m.local_train(payload, {}, data, torch.Generator().manual_seed(5))
    return reply, want


def test_fedvls_default_matches_the_released_client_and_server():
    clients = [client({0: 12, 2: 6, 5: 3, 7: 1}, seed=3, cid=0), client({1: 8, 2: 2, 5: 9}, seed=4, cid=1)]
    m = method("fedvls", lr=0.05, momentum=0.9, epochs=3, lam=0.7)  # the default: the released form and weight
    state = m.init_server()
    replies, refs = [], []
    for data in clients:
        counts = torch.as_tensor(data.counts)
        official = OfficialVLS(counts, 0.7)
        reply, want = vls_round(m, data, state, official.loss, 0.05, 3)
        record("fedvls", f"default: client {data.client_id}'s local round (clientvls.train)",
               assert_close(reply.arrays, want, want))
        replies.append((data.client_id, reply))
        refs.append(want)
    state = m.aggregate(state, 1, replies)
    want = official_aggregate(refs, [len(d) for d in clients])
    record("fedvls", "default: aggregation (aggregate_parameters)", assert_close(state.weights, want, want))


def test_fedvls_paper_options_are_algorithm_1_and_differ_from_the_released_loss():
    data = client({0: 12, 2: 6, 5: 3, 7: 1}, seed=3)
    counts = torch.as_tensor(data.counts)
    m = method("fedvls", lr=0.05, momentum=0.9, epochs=3, lam=0.7, logit_form="paper", logit_weight=1.0)
    state = m.init_server()
    paper = paper_vls(counts, 0.7)
    reply, want = vls_round(m, data, state, lambda t: (lambda net, x, y: paper(net, t, x, y)), 0.05, 3)
    record("fedvls", "logit_form=paper logit_weight=1: local round vs Algorithm 1",
           assert_close(reply.arrays, want, want, atol=2e-6))
    official = method("fedvls", lr=0.05, momentum=0.9, epochs=3, lam=0.7)
    other, _ = official.local_train(official.configure(state, 1, 0), {}, data, torch.Generator().manual_seed(5))
    apart = max((reply.arrays[k] - other.arrays[k]).abs().max().item() for k in want)
    assert record("fedvls", "Algorithm 1 (paper options) vs the released loss (default): local round", apart) > 1e-3


def test_fedvls_paper_logit_term_skips_a_class_alone_in_its_batch_and_ignores_vacant_classes():
    from fedlt.methods.fedvls import logit_suppression

    z = torch.randn(4, 3, requires_grad=True)
    prior = torch.tensor([0.5, 0.5, 0.0])
    only0 = logit_suppression(z, torch.zeros(4, dtype=torch.long), prior, "paper")
    # class 0 is every sample's label: no term; class 1: log mean exp over all 4; class 2 (vacant): weight 0
    assert only0.item() == pytest.approx(0.5 * (torch.logsumexp(z[:, 1], 0) - math.log(4)).item(), rel=1e-6)
    (grad,) = torch.autograd.grad(only0, z)
    assert torch.isfinite(grad).all() and not grad[:, 0].any() and not grad[:, 2].any()
    assert torch.allclose(grad[:, 1], 0.5 * torch.softmax(z[:, 1], 0))


# ------------------------------------------------------------------------------------------------ FedReLa
def official_relabel(preds: np.ndarray, targets: np.ndarray, class_num: int, thre: float, rand):
    """util/FedReLa.py steps 2-6 on the averaged predictions (keys in sample order), ``rand(C)`` for
    ``np.random.rand(class_num)``: the relabel_flag dict {sample: new class}."""
    keys = [str(i) for i in range(len(targets))]
    unique_cls, cls_counts = np.unique(targets, return_counts=True)
    cls_cnt_full = np.zeros(class_num, dtype=int)
    cls_cnt_full[unique_cls] = cls_counts
    priors_raw = cls_cnt_full.astype(float)
    lo, hi = priors_raw.min(), priors_raw.max()
    priors = 1 - (priors_raw - lo) / (hi - lo) if hi > lo else np.ones(class_num)
    mean, std, zs = np.zeros((class_num, class_num)), np.zeros((class_num, class_num)), {}
    for c in range(class_num):
        mask = targets == c
        if mask.any():
            mean[c] = preds[mask].mean(axis=0)
            std[c] = np.clip(preds[mask].std(axis=0), 1e-6, None)
            zc = (preds[mask] - mean[c]) / std[c]
            zs.update({keys[i]: zc[j] for j, i in enumerate(np.where(mask)[0])})
    zmat = np.array([(preds[i] - mean[targets[i]]) / std[targets[i]] for i in range(len(targets))])
    n = zmat.shape[0]
    m = max(0, min(int(thre / 100 * n), n - 1))
    k = max(0, min(n - 1 - m, n - 1))
    threclass = np.partition(zmat, k, axis=0)[k, np.arange(zmat.shape[1])]
    flags = {}
    for i, key in enumerate(keys):
        fliprate = np.tanh(zs[key] - threclass) * np.maximum(priors - priors[targets[i]], 0)
        cand = np.where(fliprate > rand(class_num))[0]
        if len(cand) > 0:
            flags[key] = np.arange(class_num)[cand[np.argmax(fliprate[cand])]]
    return flags


def test_fedrela_relabelling_matches_the_released_module():
    from fedlt.methods.fedrela import relabel

    g = torch.Generator().manual_seed(0)
    counts = [40, 25, 12, 6, 3, 0, 9, 2, 0, 1]
    y = torch.cat([torch.full((n,), c, dtype=torch.long) for c, n in enumerate(counts)])
    logits = torch.randn(len(y), C, generator=g, dtype=torch.float64) + 2.0 * F.one_hot(y, C)
    q = torch.softmax(logits, 1)
    u = torch.rand(len(y), C, generator=g, dtype=torch.float64)
    rows = iter(u.numpy())
    flags = official_relabel(q.numpy(), y.numpy(), C, 5.0, lambda _: next(rows))
    want = y.clone()
    for key, c in flags.items():
        want[int(key)] = int(c)
    got = relabel(q, y, 5.0, u)
    record("fedrela", f"re-labelling (util/FedReLa.py): labels that differ, of {len(y)}", int((got != want).sum()))
    assert torch.equal(got, want)
    moved = got != y
    assert 0 < int(moved.sum()) < len(y) // 2
    n = torch.tensor(counts)
    assert bool((n[got[moved]] < n[y[moved]]).all())  # always towards a less-populated class


def official_heads(net, phi, feats, y, opt_a, opt_l):
    """update_weights_gaux's and update_weights_etf's g_aux and l_head steps: CE on the detached features, each by
    its SGD; then what the client keeps (the model's state and l_head's weight)."""
    F.cross_entropy(net.head(feats.detach()), y).backward()
    opt_a.step()
    F.cross_entropy(phi(feats.detach()), y).backward()
    opt_l.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, phi.weight.detach().clone()


def released_labels(q, y, probe):
    """util/FedReLa.py's labels from Q, with the uniform draws the client's generator gives from state ``probe``."""
    g2 = torch.Generator()
    g2.set_state(probe)
    rows = iter(torch.rand(q.shape, generator=g2, dtype=torch.float64).numpy())
    flags = official_relabel(q.numpy(), y.numpy(), C, 5.0, lambda _: next(rows))
    assert flags, "nothing was re-labelled: the test would not test the plug-in"
    y2 = y.clone()
    for key, c in flags.items():
        y2[int(key)] = int(c)
    return y2


def local_head(cstate, d):
    """l_head as the client state holds phi_k."""
    phi = torch.nn.Linear(d, C)
    with torch.no_grad():
        phi.weight.copy_(cstate["phi.weight"])
        phi.bias.copy_(cstate["phi.bias"])
    return phi


def official_loge_step(net, fixed_w, fixed_b, phi, x, y, lr, momentum):
    """update_weights_gaux's batch: CE(g_head(f(x))) steps the backbone, CE(g_aux(f.detach())) the aux head,
    CE(l_head(f.detach())) the local head, three SGDs (lr, momentum)."""
    backbone = [p for n, p in net.named_parameters() if n.startswith("backbone.")]
    opt_b = torch.optim.SGD(backbone, lr=lr, momentum=momentum)
    opt_a = torch.optim.SGD(net.head.parameters(), lr=lr, momentum=momentum)
    opt_l = torch.optim.SGD(phi.parameters(), lr=lr, momentum=momentum)
    for o in (opt_b, opt_a, opt_l):
        o.zero_grad()
    feats = net.backbone(x)
    F.cross_entropy(F.linear(feats, fixed_w, fixed_b), y).backward()
    opt_b.step()
    return official_heads(net, phi, feats, y, opt_a, opt_l)


def test_fedloge_rela_round_relabels_then_trains_as_the_released_update(tmp_path):
    data = client({0: 30, 1: 14, 2: 6, 4: 3, 6: 9}, seed=5)
    m = method("fedrela-loge", lr=0.05, momentum=0.5, epochs=1, rounds=10, rela_passes=1, sse_steps=20,
               rela_lr_scale=0.1)  # the released lr x 0.1 from relabel_start on
    m.spec.cache_dir = str(tmp_path)
    state = m.init_server()
    cstate = m.init_client(0, data)
    payload = m.configure(state, 10, 0)  # start: floor(0.9 * 10) + 1 = 10
    assert payload.meta["rela.round"] == 10 and m.start_round() == 10
    gen = torch.Generator().manual_seed(7)
    probe = gen.get_state()
    reply, new_state = m.local_train(payload, dict(cstate), data, gen)

    # the official side: Q from the received backbone through the frozen SSE-C, the released re-labelling with
    # the same uniform draws, then one batch of update_weights_gaux on the re-labelled labels
    W, b = m.fixed_head()
    ref = m.new_model()
    load_weights(ref, payload.arrays)
    x, y = next(data.batches(256, None, shuffle=False, train=False))
    with torch.no_grad():
        q = torch.softmax(F.linear(ref.backbone(x), W, b), 1).double()
    y2 = released_labels(q, y, probe)
    assert torch.equal(new_state["rela.labels"], y2)
    want, phi_w = official_loge_step(ref, W, b, local_head(cstate, W.shape[1]), x, y2, 0.05 * 0.1, 0.5)
    record("fedrela", "rela_lr_scale=0.1: FedLoGe local round after re-labelling (update_weights_gaux)",
           assert_close(reply.arrays, want, want))
    assert torch.allclose(new_state["phi.weight"], phi_w, atol=1e-6)
    # the default (the run's lr from the start on) is the released update at ten times its step
    default = method("fedrela-loge", lr=0.05, momentum=0.5, epochs=1, rounds=10, rela_passes=1, sse_steps=20)
    default.spec.cache_dir = str(tmp_path)
    g3 = torch.Generator()
    g3.set_state(probe)
    plain, _ = default.local_train(default.configure(state, 10, 0), dict(cstate), data, g3)
    apart = max((plain.arrays[k].double() - want[k].double()).abs().max().item() for k in want)
    assert record("fedrela", "default (rela_lr_scale=1) vs the released update: local round", apart) > 1e-4
    # the server is FedLoGe's weighted mean, the released FedAvg_noniid
    other = {k: v + 0.01 for k, v in reply.arrays.items()}
    state = m.aggregate(state, 10, [(0, reply), (1, Message(other, {"num_examples": 7}))])
    agg = official_aggregate([reply.arrays, other], [len(data), 7])
    record("fedrela", "aggregation (FedAvg_noniid)", assert_close(state.weights, agg, agg))
    # one-shot: the next round reuses the labels (no new draws), before the start nothing changes
    assert not m.due(11, new_state) and m.due(10, cstate) and not m.due(9, cstate)


def official_etf_dr_step(net, M, phi, x, y, lr, momentum, epochs):
    """update_weights_etf (fed_etf.py's client) on one batch a local epoch: ``g_head`` an ETF_Classifier (BN_H, as
    copied from the server: affine 1 and 0) whose BN_H trains in the backbone's SGD; per batch ``produce_Ew``'s
    scaling of ``ori_M`` (``M`` [d, C]), the projector's forward (BN_H on batches of more than one sample, then
    the L2 normalisation), ``reg_dot_loss`` (reg_lam 0); then g_aux and l_head by CE on the detached features."""
    C = M.shape[1]
    bn = torch.nn.BatchNorm1d(M.shape[0])
    backbone = [p for n, p in net.named_parameters() if n.startswith("backbone.")]
    opt_b = torch.optim.SGD([{"params": backbone}, {"params": bn.parameters()}], lr=lr, momentum=momentum)
    opt_a = torch.optim.SGD(net.head.parameters(), lr=lr, momentum=momentum)
    opt_l = torch.optim.SGD(phi.parameters(), lr=lr, momentum=momentum)
    for _ in range(epochs):
        for o in (opt_b, opt_a, opt_l):
            o.zero_grad()
        uni, count = torch.unique(y, return_counts=True)  # produce_Ew
        gamma = y.size(0) / uni.size(0)
        Ew = torch.ones(1, C)
        for i in range(uni.size(0)):
            Ew[0, uni[i]] = torch.sqrt(gamma / count[i])
        cur_M = Ew * M
        feat = net.backbone(x)
        features = bn(feat) if feat.size(0) > 1 else feat  # ETF_Classifier.forward
        features = features / torch.clamp(torch.sqrt(torch.sum(features ** 2, dim=1, keepdims=True)), min=1e-8)
        with torch.no_grad():
            H_length = torch.clamp(torch.sqrt(torch.sum(features.detach() ** 2, dim=1, keepdims=False)), 1e-8)
        target = cur_M[:, y].T  # dot_loss(..., 'reg_dot_loss', H_length, reg_lam=0)
        dot = torch.bmm(features.unsqueeze(1), target.unsqueeze(2)).view(-1)
        with torch.no_grad():
            M_length = torch.sqrt(torch.sum(target ** 2, dim=1, keepdims=False))
        loss = (1 / 2) * torch.mean(((dot - (M_length * H_length)) ** 2) / H_length)
        loss.backward()
        opt_b.step()
        out = official_heads(net, phi, feat, y, opt_a, opt_l)
    return out


def test_fedrela_on_the_released_etf_base_relabels_and_trains_as_fed_etf_py(tmp_path):
    """FedReLa's ``fed_etf.py``: FedLoGe's code's ETF baseline, here ``fedrela-loge --set backbone_loss=etf-dr --set
    fixed=etf``. Q from the received backbone through the server's projector (eval mode) and the ETF (``collect_Q``,
    method "etf"), the released re-labelling, then two local epochs of ``update_weights_etf`` at the released lr x 0.1;
    the projector never leaves the client."""
    data = client({0: 30, 1: 14, 2: 6, 4: 3, 6: 9}, seed=7)
    m = method("fedrela-loge", lr=0.05, momentum=0.5, epochs=2, rounds=10, rela_passes=1, backbone_loss="etf-dr",
               fixed="etf", rela_lr_scale=0.1)
    m.spec.cache_dir = str(tmp_path)
    state = m.init_server()
    cstate = m.init_client(0, data)
    payload = m.configure(state, 10, 0)
    gen = torch.Generator().manual_seed(8)
    probe = gen.get_state()
    reply, new_state = m.local_train(payload, dict(cstate), data, gen)
    assert not any(k.startswith("proj.") for k in (*reply.arrays, *new_state))

    W, _ = m.fixed_head()
    M = W.T.contiguous()  # ori_M [d, C]
    ref = m.new_model()
    load_weights(ref, payload.arrays)
    x, y = next(data.batches(256, None, shuffle=False, train=False))
    with torch.no_grad():  # collect_Q: g_head.eval() (BN_H's initial statistics), then ori_M
        bn = torch.nn.BatchNorm1d(M.shape[0]).eval()
        out = bn(ref.backbone(x))
        out = out / torch.clamp(torch.sqrt(torch.sum(out ** 2, dim=1, keepdims=True)), min=1e-8)
        q = torch.softmax(torch.matmul(out, M), 1).double()
    y2 = released_labels(q, y, probe)
    record("fedrela", "etf base: re-labelling vs collect_Q(method='etf') + util/FedReLa.py: labels that differ, "
                      f"of {len(y)}", int((new_state["rela.labels"] != y2).sum()))
    assert torch.equal(new_state["rela.labels"], y2)
    want, phi_w = official_etf_dr_step(ref, M, local_head(cstate, W.shape[1]), x, y2, 0.05 * 0.1, 0.5, 2)
    record("fedrela", "etf base (backbone_loss=etf-dr fixed=etf): local round vs update_weights_etf",
           assert_close(reply.arrays, want, want))
    assert torch.allclose(new_state["phi.weight"], phi_w, atol=1e-6)


def test_the_etf_base_universal_prediction_is_globaltest_etfs(tmp_path):
    """``globaltest_etf``: the backbone's features through ``g_head`` -- left in train mode there, so BN_H normalises
    by the batch's statistics, its affine as the server holds it (1 and 0) -- then ``ori_M``; fedlt's "universal"
    under ``backbone_loss=etf-dr``, on the batch it is given (the evaluation gives it the whole test set)."""
    m = method("fedloge", backbone_loss="etf-dr", fixed="etf")
    m.spec.cache_dir = str(tmp_path)
    pred = m.global_model(m.init_server())["universal"]
    x, _ = next(client({c: 6 for c in range(C)}, seed=9).batches(256, None, shuffle=False, train=False))
    with torch.no_grad():
        h = pred.backbone(x)
        M = m.fixed_head()[0].T
        g_head = torch.nn.BatchNorm1d(M.shape[0])  # ETF_Classifier's BN_H, in train mode
        out = g_head(h)
        out = out / torch.clamp(torch.sqrt(torch.sum(out ** 2, dim=1, keepdims=True)), min=1e-8)
        want = torch.matmul(out, M)
        got = pred.head(h)
    gap = record("fedrela", "etf base: universal prediction vs globaltest_etf (logits)", (got - want).abs().max().item())
    assert gap < 1e-6
    assert not torch.equal(got.argmax(1), F.linear(h, M.T).argmax(1))  # not M h's: the batch's statistics matter


def test_fedetf_rela_before_the_start_is_fedetf():
    data = client({0: 20, 3: 5, 8: 2}, seed=6)
    base, rela = method("fedetf", lr=0.05, pers_rounds=0), method("fedrela-etf", lr=0.05, pers_rounds=0, rela_start=5)
    state = base.init_server()
    a, _ = base.local_train(base.configure(state, 4, 0), {}, data, torch.Generator().manual_seed(1))
    b, cs = rela.local_train(rela.configure(state, 4, 0), {}, data, torch.Generator().manual_seed(1))
    assert "rela.labels" not in cs
    record("fedrela", "fedrela-etf before the start vs fedetf: local round",
           max((a.arrays[k] - b.arrays[k]).abs().max().item() for k in a.arrays))
    assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
    c, cs = rela.local_train(rela.configure(state, 5, 0), {}, data, torch.Generator().manual_seed(1))
    assert "rela.labels" in cs and cs["rela.labels"].shape == data.y.shape


def test_fedvls_released_logit_term_is_bounded_below_and_algorithm_1s_is_not():
    """Why the default is the released form: scores of each class on the other classes' samples driven to -k make
    Algorithm 1's term fall without bound, while the released one stays above sum_c p_c log(n_c in batch / B)."""
    from fedlt.methods.fedvls import logit_suppression

    y = torch.tensor([0, 0, 1, 2])
    prior = torch.tensor([0.5, 0.25, 0.25])
    floor = sum(p * math.log(n / 4) for p, n in ((0.5, 2), (0.25, 1), (0.25, 1)))
    paper, official = [], []
    for k in (10.0, 100.0, 1000.0):
        z = -k * (1 - F.one_hot(y, 3).float())
        paper.append(logit_suppression(z, y, prior, "paper").item())
        official.append(logit_suppression(z, y, prior, "official").item())
    assert paper[2] < paper[1] - 800 < paper[0] - 880
    assert all(v >= floor - 1e-6 for v in official) and official[2] == pytest.approx(floor, abs=1e-4)
