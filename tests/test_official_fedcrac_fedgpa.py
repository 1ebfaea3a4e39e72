"""Issue 41, items 3, 4 and 7: the official-code options of FedCRAC and FedGPA against the official formulas written
out here (xujli/fedcrac ``Server.retrain`` and ``SoftmaxMargin``; the GPA module's backward hook of
miilue/Federated-prompt-tuning-framework-under-long-tailed-datasets), and their defaults against the paper's form,
bit for bit where the default did not change:

- FedCRAC ``calib_start``: ``previous`` calibrates the classifier the server broadcast this round (the official
  ``retrain()`` runs before the aggregate is loaded), ``aggregate`` (default) the clients' averaged one; the
  backbone is the aggregate either way.
- FedCRAC ``calib_chunks``: ``official`` sums each chunk's mean loss / 4 over the bounds range(0, N, N // 4) + [N]
  and takes one step (N % 4 != 0 here, where it differs from ``full``, the full-batch mean, the default).
- FedCRAC ``crt_weight_decay`` (issue 55, item 7): ``none`` steps the calibration's SGD with the run's weight
  decay, as the official ``SGD(..., weight_decay=args.wd, nesterov=True)`` does; 0 (default) with none.
- FedGPA ``double_weight``: the gradient is w^2 (sigmoid(z) - t) / B as before, the loss's (logged) value now the
  official sum(w BCE) / B.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

from fedlt.core import Message, RunSpec  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402


# ------------------------------------------------------------------------------------------------ FedCRAC
def official_logits(W, M, h, y, s=5.0):
    """SoftmaxMargin.forward: z = h W^T, minus each row's minimum, + M[y] on every class but the label, times s."""
    z = h @ W.T
    z = z - z.min(dim=1, keepdim=True)[0]
    label = F.one_hot(y, z.shape[1]).bool()
    return s * torch.where(~label, z + M[y], z)


def official_retrain(W0, M, h, y, steps, lr, chunked, reduction="batchmean", a=0.5, T=0.5, wd=0.0):
    """Server.retrain: student and teacher from W0; per epoch zero_grad, for each chunk loss_fn_kd(chunk) / 4 and
    backward (gradients accumulate), then one SGD step (momentum 0.9, Nesterov, weight_decay=args.wd, here ``wd``).
    ``chunked=False``: one chunk of all N samples, not divided by 4 (the paper's full-batch mean)."""
    W = W0.clone().requires_grad_(True)
    opt = torch.optim.SGD([W], lr=lr, momentum=0.9, nesterov=True, weight_decay=wd)
    N = len(y)
    bounds = list(range(0, N, N // 4)) + [N] if chunked else [0, N]
    div = 4 if chunked else 1
    for _ in range(steps):
        opt.zero_grad()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            out = official_logits(W, M, h[lo:hi], y[lo:hi])
            teacher = official_logits(W0, M, h[lo:hi], y[lo:hi]).detach()
            kd = F.kl_div(F.log_softmax(out / T, dim=1), F.softmax(teacher / T, dim=1), reduction=reduction)
            loss = (kd * (a * T * T) + F.cross_entropy(out, y[lo:hi]) * (1.0 - a)) / div
            loss.backward()
        opt.step()
    return W.detach()


def paper_form(W0, M, h, y, steps, lr, s=5.0, a=0.5, T=0.5):
    """The default as it was before the options: full-batch (1 - a) CE + a T^2 KL(batchmean), the same operations."""
    def logits(W):
        others = torch.ones(len(y), W.shape[0]).scatter(1, y[:, None], 0.0)
        return s * (h @ W.T + M[y] * others)

    W = W0.detach().clone().requires_grad_(True)
    opt = torch.optim.SGD([W], lr=lr, momentum=0.9, nesterov=True)
    with torch.no_grad():
        teacher = F.softmax(logits(W0) / T, 1)
    for _ in range(steps):
        out = logits(W)
        loss = a * T * T * F.kl_div(F.log_softmax(out / T, 1), teacher, reduction="batchmean") + \
            (1 - a) * F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return W.detach()


def toy_calibration(counts=(7, 4, 2), d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = len(counts)
    means = torch.randn(C, d, generator=g)
    y = torch.arange(C).repeat_interleave(torch.tensor(counts))  # ordered by class, as the pseudo samples are
    h = means[y] + 0.5 * torch.randn(len(y), d, generator=g)
    W = torch.randn(C, d, generator=g) * 0.5
    M = F.cosine_similarity(means[:, None], means[None], dim=2)
    return W, M, h, y


def test_fedcrac_official_chunks_follow_the_official_bounds():
    from fedlt.methods.fedcrac import official_chunks

    for n in (4, 11, 12, 13, 16, 103):
        assert official_chunks(n) == list(range(0, n, n // 4)) + [n]
    assert official_chunks(13) == [0, 3, 6, 9, 12, 13]  # a fifth chunk: the last sample alone weighs 1/4
    assert official_chunks(2) == [0, 1, 2]  # N < 4 (the official code divides by zero): chunks of one


def test_fedcrac_calibration_chunks_official_matches_the_official_loop_and_full_the_paper():
    from fedlt.methods.fedcrac import calibrate

    W, M, h, y = toy_calibration()  # N = 13: chunks 3, 3, 3, 3, 1
    steps, lr = 30, 0.05
    full = calibrate(W, M, h, y, steps, lr, 5.0)
    assert torch.equal(full, paper_form(W, M, h, y, steps, lr))  # the default: bit for bit the former code
    assert torch.allclose(full, official_retrain(W, M, h, y, steps, lr, chunked=False), atol=1e-5)
    off = calibrate(W, M, h, y, steps, lr, 5.0, chunks="official")
    assert torch.allclose(off, official_retrain(W, M, h, y, steps, lr, chunked=True), atol=1e-5)
    assert (off - full).abs().max() > 5e-3  # another objective: 0.012 apart (|W| <= 0.95)
    with pytest.warns(UserWarning):  # F.kl_div's reduction="mean" warns, in the official code too
        off_mean = calibrate(W, M, h, y, 5, lr, 5.0, reduction="mean", chunks="official")
        ref_mean = official_retrain(W, M, h, y, 5, lr, chunked=True, reduction="mean")
    assert torch.allclose(off_mean, ref_mean, atol=1e-5)
    with pytest.raises(ConfigError, match="chunks"):
        calibrate(W, M, h, y, 1, lr, 5.0, chunks="four")


def crac(C, weight_decay=0.0, **params):
    M = METHODS.get("fedcrac")
    return M(RunSpec("smallcnn", (1, 8, 8), C, seed=3, weight_decay=weight_decay),
             M.make_params({"crt_epochs": 20, "crt_lr": 0.05, **params}))


def crac_round(m, start):
    """One aggregation of ``m`` (3 classes) over two clients' replies, and independently what the official
    retrain() calibrates: the n_k-weighted FedAvg, count-weighted class means, M = cos, the pseudo representations
    the class means (variance 0), N_c = sum_k n_{k,c} of them in class order. Returns the new weights, the
    aggregate, and (W0, M, h, y) of the calibration (W0 by ``start``)."""
    C, counts = 3, [(5, 3, 0), (2, 0, 6)]  # N = 16: official chunks of 4
    g = torch.Generator().manual_seed(1)
    d = 128
    means = [torch.randn(C, d, generator=g) for _ in counts]
    state = m.init_server()
    state["weights"]["head.weight"] = torch.randn(C, d, generator=torch.Generator().manual_seed(2)) * 0.1
    broadcast = {k: v.clone() for k, v in state["weights"].items()}
    replies = []
    for k, (n, mu) in enumerate(zip(counts, means)):
        gk = torch.Generator().manual_seed(10 + k)
        w = {key: v + 0.1 * torch.randn(v.shape, generator=gk) for key, v in broadcast.items()}
        n = torch.tensor(n, dtype=torch.float32)
        arrays = {**w, "fedcrac.count": n, "fedcrac.mean": mu, "fedcrac.var": torch.zeros(C, d),
                  "fedcrac.stat": n >= 2}
        replies.append((k, Message(arrays, {"num_examples": int(n.sum())})))
    new = m.aggregate(state, 1, replies)
    sizes = [float(sum(n)) for n in counts]
    avg = {key: sum(s * r.arrays[key] for s, (_, r) in zip(sizes, replies)) / sum(sizes) for key in broadcast}
    n = torch.tensor(counts, dtype=torch.float32)  # [K, C]
    mean = (n[..., None] * torch.stack(means)).sum(0) / n.sum(0)[:, None]
    Mg = F.cosine_similarity(mean[:, None], mean[None], dim=2)
    y = torch.arange(C).repeat_interleave(n.sum(0).long())
    W0 = broadcast["head.weight"] if start == "previous" else avg["head.weight"]
    return new["weights"], avg, (W0, Mg, mean[y], y)


def test_fedcrac_calibration_starts_from_the_previous_classifier_with_calib_start_previous():
    out = {}
    for start in ("aggregate", "previous"):
        new, avg, calib = crac_round(crac(3, calib_start=start), start)
        assert torch.allclose(new["head.weight"], official_retrain(*calib, 20, 0.05, chunked=False), atol=1e-5)
        for key in avg:  # the backbone is the aggregate either way
            if key != "head.weight":
                assert torch.allclose(new[key], avg[key], atol=1e-6)
        out[start] = new["head.weight"]
    assert (out["previous"] - out["aggregate"]).abs().max() > 0.01


def test_fedcrac_crt_weight_decay_none_is_the_official_sgd_with_the_runs_weight_decay():
    """Issue 55, item 7: the official retrain() steps SGD(..., weight_decay=args.wd, nesterov=True), the run's
    weight decay; the paper's calibration (the default, ``crt_weight_decay=0``) none."""
    from fedlt.methods.fedcrac import calibrate

    W, M, h, y = toy_calibration()
    steps, lr, wd = 30, 0.05, 5e-4
    for chunked, chunks in ((False, "full"), (True, "official")):
        ref = official_retrain(W, M, h, y, steps, lr, chunked=chunked, wd=wd)
        assert torch.allclose(calibrate(W, M, h, y, steps, lr, 5.0, chunks=chunks, weight_decay=wd), ref, atol=1e-6)
        # without it: 4e-3 apart after 30 steps, decay's lr wd W summed with momentum (|W| <= 0.95)
        assert (calibrate(W, M, h, y, steps, lr, 5.0, chunks=chunks) - ref).abs().max() > 1e-3
    # the method: crt_weight_decay=none takes the run's --weight-decay; the default (0) ignores it; a value is used
    runs = {(None, wd): wd, (0.0, wd): 0.0, (wd, 0.0): wd}
    for (crt_wd, run_wd), want in runs.items():
        new, _, calib = crac_round(crac(3, weight_decay=run_wd, crt_weight_decay=crt_wd), "aggregate")
        ref = official_retrain(*calib, 20, 0.05, chunked=False, wd=want)
        assert torch.allclose(new["head.weight"], ref, atol=1e-5), (crt_wd, run_wd)
    assert METHODS.get("fedcrac").make_params({}).crt_weight_decay == 0.0
    assert METHODS.get("fedcrac").make_params({"crt_weight_decay": "none"}).crt_weight_decay is None


def test_fedcrac_options_refuse_unknown_values():
    M = METHODS.get("fedcrac")
    assert (M.make_params({}).calib_start, M.make_params({}).calib_chunks) == ("aggregate", "full")
    with pytest.raises(ConfigError, match="calib_start"):
        M.make_params({"calib_start": "broadcast"})
    with pytest.raises(ConfigError, match="calib_chunks"):
        M.make_params({"calib_chunks": "4"})


# ------------------------------------------------------------------------------------------------ FedGPA
def test_fedgpa_double_weight_logs_the_official_loss_with_the_squared_gradient():
    from fedlt.methods.fedgpa import gpa_loss, gpa_weights

    g = torch.Generator().manual_seed(0)
    z0, y = torch.randn(6, 3, generator=g), torch.tensor([0, 1, 1, 2, 0, 1])
    ratio, varphi, sigma, mu, B = torch.tensor([100.0, 0.8, 0.0]), 4.0, 12.0, 0.8, 6
    t = F.one_hot(y, 3).float()
    q = 1 / (1 + torch.exp(-sigma * (ratio - mu)))  # the official map_func
    w = (varphi * (1 - q) + 1) * t + q * (1 - t)
    bce = bce_of(z0, t)
    # the official module: loss sum(w BCE) / B, and a hook that multiplies the logits' gradient by w in place
    zo = z0.clone().requires_grad_(True)
    zo.register_hook(lambda grad: grad.mul_(w))
    official = (bce_of(zo, t) * w).sum() / B
    official.backward()
    for double in (False, True):
        stats = {"pos": torch.zeros(3), "neg": torch.zeros(3), "ratio": ratio.clone()}
        z = z0.clone().requires_grad_(True)
        loss = gpa_loss(z, y, stats, varphi, sigma, mu, double)
        loss.backward()
        ww = w * w if double else w
        logged = float((w * bce).sum() / B)  # the logged value: sum(w BCE) / B, not w^2, either way
        assert float(loss.detach()) == pytest.approx(logged, rel=1e-6)
        assert torch.allclose(z.grad, ww * (torch.sigmoid(z0) - t) / B, atol=1e-7)
        # bit for bit the gradient of the former code: sum(w' BCE) / B, w' its weights (squared if double)
        pos_w, neg_w = gpa_weights(ratio, varphi, sigma, mu)
        wf = pos_w * t + neg_w * (1 - t)
        wf = wf * wf if double else wf
        zf = z0.clone().requires_grad_(True)
        ((wf * F.binary_cross_entropy_with_logits(zf, t, reduction="none")).sum() / B).backward()
        assert torch.equal(z.grad, zf.grad)
        if double:
            assert float(loss.detach()) == pytest.approx(float(official.detach()), rel=1e-6)
            assert torch.allclose(z.grad, zo.grad, atol=1e-7)
            assert torch.allclose(stats["pos"], (zo.grad.abs() * t).sum(0), atol=1e-7)  # the hook's statistics
            assert float((ww * bce).sum() / B) / float(loss.detach()) > 1.5  # what was logged before was far off


def bce_of(z, t):
    """BCE with logits, written out."""
    return torch.clamp(z, min=0) - z * t + torch.log1p(torch.exp(-z.abs()))
