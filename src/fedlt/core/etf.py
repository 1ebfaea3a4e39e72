"""Fixed classifiers: the simplex ETF, FedLoGe's sparse ETF (SSE-C) and the other frozen heads of its Table 9.

Used by FedLoGe (SSE-C), FedETF, FedDr+ and SphereFed.

Convention: every matrix here is a **head weight** ``W`` of shape ``[C, d]`` -- row ``c`` is the class vector
of class ``c`` -- so it drops straight into ``nn.Linear(d, C).weight``. (The paper writes ``psi`` as
``d x C`` with columns as class vectors; ``W = psi.T``.) Every function is a pure function of its arguments:
randomness comes from ``torch.Generator`` objects seeded from ``seed``, never from the global RNGs.

SSE-C (FedLoGe, ICLR 2024, Sec. 3.2, Eq. 2-5)
---------------------------------------------
1. Dense simplex ETF ``W = sqrt(C/(C-1)) (I_C - 11^T/C) U^T`` with ``U`` a ``d x C`` matrix with orthonormal
   columns (Eq. 2): unit row norms, pairwise cosine ``-1/(C-1)``.
2. Zero a fraction ``beta`` of the ``d*C`` entries, chosen uniformly over the whole matrix (not per row).
3. With that mask held fixed, minimise over the surviving entries
   ``L = sum_c (||w_c|| - gamma)^2  -  (1/C) sum_c arccos(max_{c' != c} cos(w_c, w_c'))``
   (equal-norm loss Eq. 3 + max-min-angle loss Eq. 4), full batch, Adam, lr 1e-4, 10,000 steps.

Paper vs. official code (ZackZikaiXiao/FedLoGe, ``util/etf_methods.py``, read at
commit f4cac52). The *loss form is the same* in both: the norm
loss is a plain sum of squared deviations, the angle loss is the mean over classes of each class's minimum
angle (not a single global max-min), and there is no weight between the two terms and no temperature.
The official code's "tau" is the *norm target*, i.e. the paper's gamma -- not a softmax temperature -- so
this module has no ``tau`` argument; use ``gamma`` (or ``variant="official"``). They differ in:

=====================  ==========================================  ==============================================
                       ``variant="paper"`` (default)               ``variant="official"``
=====================  ==========================================  ==============================================
norm target gamma      1.0 (paper, App. "Sensitivity analysis for  0.1 (current code; was 1.0 between Sept 2023
                       gamma": ~1.0 best on CIFAR-10/100-LT, 1.6   and Mar 2024; the repo's tau-ablation logs
                       on ImageNet-LT / iNaturalist)               favour 0.1 on CIFAR-100-LT)
basis U                QR of a Gaussian matrix, column signs fixed QR of a U[0,1) matrix, LAPACK signs (its first
                       so U is Haar-random ("any rotation")        column is ~ -(1,..,1)/sqrt(d), so class 0's
                                                                   vector carries a constant offset)
zeroed entries         round(beta*d*C)                             floor(beta*d*C) (equal for d=512, C=100)
=====================  ==========================================  ==============================================

Both use Adam (the paper's text says "SGD"; ``optimizer="sgd"`` gives plain SGD, which at lr 1e-4 barely
moves) and clamp the max cosine to ``[-0.99999, 0.99999]`` so arccos has a finite gradient. The official
code also leaves a *random frozen bias* on the SSE-C ``nn.Linear``; that is the caller's choice (this module
returns only the weight). Masking: the optimised tensor is ``P * mask``, so pruned entries are exactly zero
whatever the optimiser does.

Precision. The 10,000 Adam steps run in float64 (``precision="float64"``, the default) and the result is rounded
to float32 once. In float32 (``precision="float32"``, torch's default dtype, which the official code uses) the
steps amplify the last-bit differences between kernels: the matrix, and so every FedLoGe run after it, differs
between x86 CPUs (and between ``ATEN_CPU_CAPABILITY`` / ``MKL_CBWR`` settings of one CPU); two AVX-512 machines
printed FedAvg's runs alike and FedLoGe's apart. In float64 the differences stay below float32's rounding: on one
AVX-512 CPU, native, ``MKL_CBWR`` COMPATIBLE / AVX2 / SSE4_2 and ``ATEN_CPU_CAPABILITY=default`` gave the same
float32 bits for d x C = 128 x 10, 200 x 10 and 512 x 100, where in float32 each setting gave another matrix
(128 x 10, 200 x 10; ``tests/test_etf.py`` checks four of them). Either precision gives an SSE-C
of the same quality: at d 512, C 100 (``benchmarks/sse_c_construction.py --precision``) mean angle 90.5783 degrees
in both (the ETF's 90.5788), norms within 3e-5 of 1; float64 took 19.7 s there, float32 15.6 s (2-core CPU), once
per setting (the matrix is cached on disk).

Table 9 initialisations (``fixed_classifier`` kinds) mirror the ``torch.nn.init`` defaults whose names the
table uses (the paper gives no scales): ``xavier`` = xavier_uniform (gain 1, bound sqrt(6/(d+C))),
``gaussian`` = N(0, 1), ``uniform`` = U(0, 1), ``orthogonal`` = orthonormal rows (gain 1),
``kaiming_uniform`` = kaiming_uniform (a=0, fan_in=d, bound sqrt(6/d)). Each can be sparsified with the same
mask (``beta``), and optionally refined with the SSE-C loss (``refine=True``).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..safefile import load_tree, save_tree

__all__ = [
    "KINDS",
    "VARIANTS",
    "PRECISIONS",
    "SSE_STEPS",
    "SSE_LR",
    "SSE_PRECISION",
    "FORMAT_VERSION",
    "simplex_etf",
    "random_mask",
    "sse_c_loss",
    "sse_c_grad",
    "refine_fixed_classifier",
    "sparse_etf",
    "init_classifier",
    "fixed_classifier",
    "resolve_spec",
    "etf_report",
    "default_cache_dir",
    "cached_fixed_classifier",
]

KINDS = ("sse-c", "etf", "xavier", "gaussian", "uniform", "orthogonal", "kaiming_uniform")
VARIANTS: dict[str, dict[str, Any]] = {
    "paper": {"gamma": 1.0, "basis": "gaussian", "rounding": "round"},
    "official": {"gamma": 0.1, "basis": "uniform", "rounding": "floor"},
}
# the SSE-C optimisation's defaults (FedLoGe Sec. 3.2 and the official code: Adam, 10,000 full-batch steps at lr
# 1e-4), and the dtype of those steps (module docstring, "Precision"): the one place they are written;
# fedlt.methods.fedloge's sse_steps / sse_lr / sse_precision default to them
SSE_STEPS = 10_000
SSE_LR = 1e-4
SSE_PRECISION = "float64"
OPTIMIZERS = ("adam", "sgd")
PRECISIONS = {"float64": torch.float64, "float32": torch.float32}  # the refinement's dtype (module docstring)
BASES = ("gaussian", "uniform")
COS_CLAMP = 0.99999
_SINGLE_THREAD_MAX_C = 256
# Bump when anything changes the matrix built from the same spec (it invalidates every cache entry).
FORMAT_VERSION = 2  # 2: a safetensors file (fedlt.safefile), no pickle

_STREAM_BASIS, _STREAM_MASK, _STREAM_INIT = 0, 1, 2


def _generator(seed: int, stream: int) -> torch.Generator:
    """An independent CPU generator per (seed, stream), so e.g. the mask does not depend on the init kind."""
    seed = int(seed)
    if seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed}")
    state = np.random.SeedSequence(seed, spawn_key=(stream,)).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def _check_dims(d: int, C: int) -> tuple[int, int]:
    d, C = int(d), int(C)
    if C < 2:
        raise ConfigError(f"a fixed classifier needs at least 2 classes, got C={C}")
    if d < 1:
        raise ConfigError(f"feature dimension must be positive, got d={d}")
    return d, C


# ----------------------------------------------------------------------------------------------------
# Dense ETF
# ----------------------------------------------------------------------------------------------------


def simplex_etf(
    d: int, C: int, seed: int = 0, basis: str = "gaussian", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dense simplex ETF, ``[C, d]`` (rows = class vectors): unit rows, pairwise cosine exactly ``-1/(C-1)``.

    ``W^T = sqrt(C/(C-1)) U (I - 11^T/C)`` with ``U`` ``d x C``, orthonormal columns, from the QR of a seeded
    random matrix: ``basis="gaussian"`` (Haar, column signs fixed by ``sign(diag R)``) or ``"uniform"``
    (U[0,1) entries, raw LAPACK signs, as the official FedLoGe code). Needs ``d >= C``; for ``d == C - 1``
    (the smallest dimension that holds a C-simplex) a random orthonormal frame of the ``1``-orthogonal
    subspace is used instead. Built in float64, returned in ``dtype``.
    """
    d, C = _check_dims(d, C)
    if basis not in BASES:
        raise ConfigError(f"unknown ETF basis {basis!r}; choose one of: {', '.join(BASES)}")
    if d < C - 1:
        raise ConfigError(f"a simplex ETF of C={C} classes needs feature dimension d >= C-1 = {C - 1}, got d={d}")
    g = _generator(seed, _STREAM_BASIS)
    scale = math.sqrt(C / (C - 1))
    centre = torch.eye(C, dtype=torch.float64, device="cpu") - 1.0 / C
    if d >= C:
        A = torch.rand(d, C, generator=g, dtype=torch.float64, device="cpu") if basis == "uniform" else torch.randn(
            d, C, generator=g, dtype=torch.float64, device="cpu")
        U, R = torch.linalg.qr(A, mode="reduced")
        if basis == "gaussian":
            s = torch.sign(torch.diagonal(R))
            U = U * torch.where(s == 0, torch.ones_like(s), s)
        M = scale * U @ centre  # [d, C]
    else:  # d == C - 1
        # Orthonormal basis B (C x (C-1)) of the subspace orthogonal to 1, then a random rotation V of R^d.
        B, _ = torch.linalg.qr(centre[:, : C - 1], mode="reduced")
        A = torch.randn(d, d, generator=g, dtype=torch.float64, device="cpu")
        V, R = torch.linalg.qr(A)
        V = V * torch.sign(torch.diagonal(R))
        M = scale * V @ B.T  # [d, C]; B B^T = I - 11^T/C
    return M.T.contiguous().to(dtype)


# ----------------------------------------------------------------------------------------------------
# Sparsification and refinement
# ----------------------------------------------------------------------------------------------------


def _num_zeros(n: int, beta: float, rounding: str) -> int:
    if rounding == "floor":
        return int(math.floor(beta * n + 1e-9))
    return int(round(beta * n))


def random_mask(C: int, d: int, beta: float, seed: int = 0, rounding: str = "round") -> torch.Tensor:
    """Boolean ``[C, d]`` keep-mask with exactly ``round(beta*C*d)`` (or ``floor``) False entries.

    The zeroed positions are drawn uniformly without replacement over the whole matrix from a generator
    seeded by ``seed`` (its own stream: the same for every init kind).
    """
    beta = float(beta)
    if not 0.0 <= beta < 1.0:
        raise ConfigError(f"sparsity beta must be in [0, 1), got {beta}")
    if rounding not in ("round", "floor"):
        raise ConfigError(f"rounding must be 'round' or 'floor', got {rounding!r}")
    n = int(C) * int(d)
    k = _num_zeros(n, beta, rounding)
    keep = torch.ones(n, dtype=torch.bool, device="cpu")
    if k:
        keep[torch.randperm(n, generator=_generator(seed, _STREAM_MASK), device="cpu")[:k]] = False
    return keep.view(int(C), int(d))


def sse_c_loss(W: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FedLoGe Eq. 3 and Eq. 4 for ``W`` ``[C, d]``: ``(norm_loss, angle_loss)``, to be summed (Eq. 5).

    ``norm_loss = sum_c (||w_c|| - gamma)^2``;
    ``angle_loss = -(1/C) sum_c arccos(clamp(max_{c' != c} cos(w_c, w_c'), +-0.99999))`` (radians).
    """
    norms = W.norm(dim=1)
    norm_loss = (norms - gamma).pow(2).sum()
    Wn = W / norms.clamp_min(1e-12).unsqueeze(1)
    cos = Wn @ Wn.T
    eye = torch.eye(W.shape[0], dtype=torch.bool, device=W.device)
    max_cos = cos.masked_fill(eye, -2.0).amax(dim=1).clamp(-COS_CLAMP, COS_CLAMP)
    angle_loss = -torch.arccos(max_cos).mean()
    return norm_loss, angle_loss


def sse_c_grad(W: torch.Tensor, gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(norm_loss, angle_loss, dL/dW)`` of :func:`sse_c_loss`, with the gradient written out by hand.

    Only the arg-max partner of each class enters the angle term, so besides one ``C x C`` Gram matrix the
    gradient costs O(C*d): several times faster than autograd, which back-propagates through the whole
    cosine matrix. With ``u_i = w_i/||w_i||``, ``j = argmax_{j != i} u_i.u_j`` and ``c = u_i.u_j``:
    ``d arccos(c)/dc = -1/sqrt(1-c^2)``, ``dc/dw_i = (u_j - c u_i)/||w_i||``, ``dc/dw_j = (u_i - c u_j)/||w_j||``;
    the norm term adds ``2 (||w_i|| - gamma) u_i``. Outside the clamp the angle gradient is 0 (as autograd's).
    """
    C = W.shape[0]
    G = W @ W.T
    n = G.diagonal().clamp_min(1e-24).sqrt()
    cos = G / (n.unsqueeze(1) * n.unsqueeze(0))
    cos.fill_diagonal_(-2.0)
    c, j = cos.max(dim=1)
    cc = c.clamp(-COS_CLAMP, COS_CLAMP)
    norm_loss = (n - gamma).pow(2).sum()
    angle_loss = -torch.arccos(cc).mean()
    u = W / n.unsqueeze(1)
    uj = u[j]
    live = ((c > -COS_CLAMP) & (c < COS_CLAMP)).to(W.dtype)
    coef = live / (C * torch.sqrt(1.0 - cc * cc))  # d(angle_loss)/dc_i
    ccol = cc.unsqueeze(1)
    grad = (coef / n).unsqueeze(1) * (uj - ccol * u)
    grad.index_add_(0, j, (coef / n[j]).unsqueeze(1) * (u - ccol * uj))
    grad.add_((2.0 * (n - gamma)).unsqueeze(1) * u)
    return norm_loss, angle_loss, grad


def refine_fixed_classifier(
    W: torch.Tensor,
    mask: torch.Tensor | None = None,
    gamma: float = 1.0,
    steps: int = SSE_STEPS,
    lr: float = SSE_LR,
    optimizer: str = "adam",
    dtype: torch.dtype = torch.float32,
    log_every: int = 0,
    threads: int | None = None,
) -> torch.Tensor:
    """Minimise ``sse_c_loss`` over the entries of ``W`` ``[C, d]`` where ``mask`` is True (all if None).

    Full batch, ``steps`` steps of Adam (torch's update rule: betas (0.9, 0.999), eps 1e-8, no weight
    decay) or plain SGD, on the hand-written gradient :func:`sse_c_grad`, computed in ``dtype``. The gradient
    is multiplied by the mask and the iterate is re-masked, so masked entries are exactly 0 throughout and
    in the result. Returns a new ``[C, d]`` tensor in ``W``'s dtype. Every row needs a surviving non-zero.

    ``threads``: torch intra-op threads for the loop (restored afterwards). ``None`` uses 1 thread up to
    C = 256 classes -- the per-step tensors are too small for threading to pay, and on a busy machine
    spinning OpenMP workers made a 2-thread run 10x slower -- and torch's current setting above that.
    """
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r} for the fixed classifier; choose one of: {', '.join(OPTIMIZERS)}")
    steps = int(steps)
    if steps < 0:
        raise ConfigError(f"steps must be >= 0, got {steps}")
    out_dtype = W.dtype
    m = torch.ones(W.shape, dtype=dtype, device="cpu") if mask is None else mask.to(dtype)
    P = W.detach().to(dtype) * m
    if steps == 0:
        return P.to(out_dtype)
    dead = (P.abs().sum(dim=1) == 0).nonzero().flatten().tolist()
    if dead:
        raise ConfigError(
            f"fixed classifier: class vector(s) {dead[:5]} have no non-zero entry left after sparsification; "
            f"lower beta or raise the feature dimension"
        )
    prev_threads = torch.get_num_threads()
    if threads is None:
        threads = 1 if P.shape[0] <= _SINGLE_THREAD_MAX_C else prev_threads
    torch.set_num_threads(max(1, int(threads)))
    try:
        _optimise(P, m, float(gamma), float(lr), steps, optimizer, log_every)
    finally:
        torch.set_num_threads(prev_threads)
    return P.to(out_dtype)


def _optimise(P: torch.Tensor, m: torch.Tensor, gamma: float, lr: float, steps: int, optimizer: str, log_every: int) -> None:
    """In place on ``P``: ``steps`` masked steps of Adam (torch's update rule) or plain SGD."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    exp_avg = torch.zeros_like(P)
    exp_avg_sq = torch.zeros_like(P)
    with torch.no_grad():
        for step in range(1, steps + 1):
            ln, la, g = sse_c_grad(P, gamma)
            g.mul_(m)
            if log_every and (step - 1) % log_every == 0:
                print(f"sse-c step {step - 1:6d}  loss {(ln + la).item():+.6f}  norm {ln.item():.3e}  angle {la.item():+.6f}")
            if optimizer == "sgd":
                P.add_(g, alpha=-lr)
                continue
            exp_avg.mul_(b1).add_(g, alpha=1 - b1)
            exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
            bc1 = 1 - b1**step
            bc2 = 1 - b2**step
            denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
            P.addcdiv_(exp_avg, denom, value=-lr / bc1)
        P.mul_(m)


def sparse_etf(
    d: int,
    C: int,
    beta: float = 0.6,
    gamma: float | None = None,
    steps: int = SSE_STEPS,
    lr: float = SSE_LR,
    seed: int = 0,
    optimizer: str = "adam",
    variant: str = "paper",
    basis: str | None = None,
    dtype: torch.dtype = torch.float32,
    log_every: int = 0,
    threads: int | None = None,
    precision: str = SSE_PRECISION,
) -> torch.Tensor:
    """SSE-C: a sparse ETF, ``[C, d]``, FedLoGe Sec. 3.2 (see the module docstring for the details).

    Dense ETF (``basis``) -> zero ``round(beta*d*C)`` random entries -> ``steps`` of ``optimizer`` at ``lr`` on
    the surviving entries with the equal-norm (target ``gamma``) + max-min-angle loss, computed in ``precision``,
    returned in ``dtype``.
    ``variant`` sets the defaults of ``gamma`` / ``basis`` / rounding: ``"paper"`` (gamma 1.0, Gaussian
    basis, round) or ``"official"`` (gamma 0.1, U[0,1) basis, floor); explicit ``gamma``/``basis`` win.
    """
    if variant not in VARIANTS:
        raise ConfigError(f"unknown SSE-C variant {variant!r}; choose one of: {', '.join(VARIANTS)}")
    v = VARIANTS[variant]
    gamma = v["gamma"] if gamma is None else float(gamma)
    basis = v["basis"] if basis is None else basis
    W = simplex_etf(d, C, seed=seed, basis=basis, dtype=torch.float64)
    mask = random_mask(C, d, beta, seed=seed, rounding=v["rounding"])
    W = refine_fixed_classifier(W, mask, gamma=gamma, steps=steps, lr=lr, optimizer=optimizer,
                                dtype=_precision(precision), log_every=log_every, threads=threads)
    return W.to(dtype)


# ----------------------------------------------------------------------------------------------------
# Table 9 initialisations and the single entry point
# ----------------------------------------------------------------------------------------------------


def init_classifier(kind: str, d: int, C: int, seed: int = 0, basis: str = "gaussian") -> torch.Tensor:
    """A dense ``[C, d]`` float64 initial matrix of one of ``KINDS`` (``"sse-c"`` and ``"etf"`` give the dense ETF)."""
    d, C = _check_dims(d, C)
    if kind in ("sse-c", "etf"):
        return simplex_etf(d, C, seed=seed, basis=basis, dtype=torch.float64)
    g = _generator(seed, _STREAM_INIT)
    f64 = torch.float64
    if kind == "xavier":
        a = math.sqrt(6.0 / (d + C))
        return (torch.rand(C, d, generator=g, dtype=f64, device="cpu") * 2 - 1) * a
    if kind == "gaussian":
        return torch.randn(C, d, generator=g, dtype=f64, device="cpu")
    if kind == "uniform":
        return torch.rand(C, d, generator=g, dtype=f64, device="cpu")
    if kind == "kaiming_uniform":
        a = math.sqrt(2.0) * math.sqrt(3.0 / d)
        return (torch.rand(C, d, generator=g, dtype=f64, device="cpu") * 2 - 1) * a
    if kind == "orthogonal":
        rows, cols = (C, d) if C <= d else (d, C)
        Q, R = torch.linalg.qr(torch.randn(cols, rows, generator=g, dtype=f64, device="cpu"))
        Q = Q * torch.sign(torch.diagonal(R))  # [cols, rows], orthonormal columns
        return (Q.T if C <= d else Q).contiguous()
    raise ConfigError(f"unknown fixed classifier {kind!r}; choose one of: {', '.join(KINDS)}")


_OPTS = ("variant", "gamma", "basis", "refine", "steps", "lr", "optimizer", "precision")


def _precision(name: str) -> torch.dtype:
    if name not in PRECISIONS:
        raise ConfigError(f"unknown precision {name!r} for the fixed classifier's refinement; choose one of: "
                          f"{', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def resolve_spec(kind: str, d: int, C: int, beta: float | None = None, seed: int = 0, **opts) -> dict:
    """Every setting that determines the matrix, with defaults filled in (the cache key hashes this).

    Options: ``variant`` ("paper"/"official"), ``gamma``, ``basis`` (ETF kinds only), ``refine`` (run the
    SSE-C optimisation; default True for "sse-c", False otherwise), ``steps`` (``SSE_STEPS``), ``lr`` (``SSE_LR``),
    ``optimizer`` ("adam"/"sgd"), ``precision`` of the refinement ("float64"/"float32", module docstring).
    ``beta`` defaults to 0.6 for "sse-c" and 0 (dense) for the others.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown fixed classifier {kind!r}; choose one of: {', '.join(KINDS)}")
    unknown = sorted(set(opts) - set(_OPTS))
    if unknown:
        hint = ""
        if "tau" in unknown:
            hint = " (the official code's tau is the norm target: pass gamma=0.1 or variant='official')"
        raise ConfigError(
            f"unknown fixed-classifier option(s) {', '.join(unknown)}; choose from: {', '.join(_OPTS)}{hint}"
        )
    d, C = _check_dims(d, C)
    variant = opts.get("variant", "paper")
    if variant not in VARIANTS:
        raise ConfigError(f"unknown SSE-C variant {variant!r}; choose one of: {', '.join(VARIANTS)}")
    v = VARIANTS[variant]
    beta = (0.6 if kind == "sse-c" else 0.0) if beta is None else float(beta)
    if not 0.0 <= beta < 1.0:
        raise ConfigError(f"sparsity beta must be in [0, 1), got {beta}")
    seed = int(seed)
    if seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed}")
    spec: dict[str, Any] = {"kind": kind, "d": d, "C": C, "beta": beta, "seed": seed}
    if kind in ("sse-c", "etf"):
        basis = opts.get("basis", v["basis"])
        if basis not in BASES:
            raise ConfigError(f"unknown ETF basis {basis!r}; choose one of: {', '.join(BASES)}")
        spec["basis"] = basis
    elif "basis" in opts:
        raise ConfigError(f"option basis applies only to the 'sse-c' and 'etf' classifiers, not {kind!r}")
    if beta > 0:
        spec["rounding"] = v["rounding"]
    refine = bool(opts.get("refine", kind == "sse-c"))
    spec["refine"] = refine
    if refine:
        opt = opts.get("optimizer", "adam")
        if opt not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {opt!r} for the fixed classifier; choose one of: {', '.join(OPTIMIZERS)}")
        spec.update(
            gamma=float(opts["gamma"]) if opts.get("gamma") is not None else float(v["gamma"]),
            steps=int(opts.get("steps", SSE_STEPS)),
            lr=float(opts.get("lr", SSE_LR)),
            optimizer=opt,
            precision=opts.get("precision", SSE_PRECISION),
        )
        _precision(spec["precision"])
    else:
        ignored = [k for k in ("gamma", "steps", "lr", "optimizer", "precision") if k in opts]
        if ignored:
            raise ConfigError(f"option(s) {', '.join(ignored)} only apply with refine=True (kind {kind!r})")
    return spec


def _build_from_spec(spec: dict) -> torch.Tensor:
    W = init_classifier(spec["kind"], spec["d"], spec["C"], seed=spec["seed"], basis=spec.get("basis", "gaussian"))
    mask = None
    if spec["beta"] > 0:
        mask = random_mask(spec["C"], spec["d"], spec["beta"], seed=spec["seed"], rounding=spec["rounding"])
        W = W * mask
    if spec["refine"]:
        W = refine_fixed_classifier(W, mask, gamma=spec["gamma"], steps=spec["steps"], lr=spec["lr"],
                                    optimizer=spec["optimizer"], dtype=_precision(spec["precision"]))
    return W.to(torch.float32).contiguous()


def fixed_classifier(kind: str, d: int, C: int, beta: float | None = None, seed: int = 0, **opts) -> torch.Tensor:
    """One entry point for every frozen head: a float32 ``[C, d]`` weight (rows = class vectors).

    kinds: ``"sse-c"`` (sparse refined ETF, beta 0.6 -- the FedLoGe default), ``"etf"`` (dense simplex ETF),
    and Table 9's ``"xavier"``, ``"gaussian"``, ``"uniform"``, ``"orthogonal"``, ``"kaiming_uniform"``.
    ``beta`` > 0 zeroes that fraction of entries (same mask for every kind at a given seed); ``refine=True``
    runs the SSE-C optimisation on the result. See :func:`resolve_spec` for the options.
    """
    return _build_from_spec(resolve_spec(kind, d, C, beta, seed, **opts))


# ----------------------------------------------------------------------------------------------------
# Report (the quantities of the paper's Table 6)
# ----------------------------------------------------------------------------------------------------


def etf_report(W: torch.Tensor) -> dict[str, float]:
    """Geometry of a ``[C, d]`` classifier: sparsity, class-vector norms, pairwise cosines and angles.

    Variances are population variances (divide by n). Pairwise statistics run over the ``C(C-1)/2`` pairs
    ``i < j``; ``angle_min_deg`` is the smallest pairwise angle. ``etf_cos`` / ``etf_angle_deg`` are the dense
    ETF's values ``-1/(C-1)`` and its arccos, for comparison.
    """
    W = W.detach().to(torch.float64).cpu()
    C, d = W.shape
    norms = W.norm(dim=1)
    Wn = W / norms.clamp_min(1e-300).unsqueeze(1)
    iu = torch.triu_indices(C, C, offset=1, device="cpu")
    cos = (Wn @ Wn.T)[iu[0], iu[1]].clamp(-1.0, 1.0)
    ang = torch.rad2deg(torch.arccos(cos))
    etf_cos = -1.0 / (C - 1) if C > 1 else float("nan")
    nm = norms.mean().item()
    return {
        "C": int(C),
        "d": int(d),
        "sparsity": (W == 0).double().mean().item(),
        "norm_mean": nm,
        "norm_var": norms.var(unbiased=False).item(),
        "norm_rel_var": (norms.var(unbiased=False) / nm**2).item() if nm > 0 else float("nan"),
        "norm_min": norms.min().item(),
        "norm_max": norms.max().item(),
        "cos_mean": cos.mean().item(),
        "cos_var": cos.var(unbiased=False).item(),
        "cos_min": cos.min().item(),
        "cos_max": cos.max().item(),
        "angle_mean_deg": ang.mean().item(),
        "angle_var_deg2": ang.var(unbiased=False).item(),
        "angle_min_deg": ang.min().item(),
        "angle_max_deg": ang.max().item(),
        "etf_cos": etf_cos,
        "etf_angle_deg": math.degrees(math.acos(etf_cos)) if C > 1 else float("nan"),
    }


# ----------------------------------------------------------------------------------------------------
# Disk cache
# ----------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$FEDLT_CACHE/etf`` if ``FEDLT_CACHE`` is set, else ``~/.cache/fedlt/etf``."""
    root = os.environ.get("FEDLT_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "fedlt") / "etf"


def _cache_key(spec: dict) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, **spec}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _load(path: Path, spec: dict) -> torch.Tensor | None:
    try:
        obj = load_tree(path, "etf-cache")
        W = obj["weight"]
        ok = (
            obj.get("format") == FORMAT_VERSION
            and obj.get("spec") == json.loads(json.dumps(spec))
            and isinstance(W, torch.Tensor)
            and tuple(W.shape) == (spec["C"], spec["d"])
            and W.dtype == torch.float32
            and bool(torch.isfinite(W).all())
        )
    except Exception as e:  # corrupt, truncated, foreign file: rebuild
        warnings.warn(f"fixed-classifier cache file {path} is unreadable ({type(e).__name__}); rebuilding it")
        return None
    if not ok:
        warnings.warn(f"fixed-classifier cache file {path} does not match its settings; rebuilding it")
        return None
    return W


def cached_fixed_classifier(
    cache_dir: str | os.PathLike | None,
    kind: str,
    d: int,
    C: int,
    beta: float | None = None,
    seed: int = 0,
    **opts,
) -> torch.Tensor:
    """:func:`fixed_classifier`, memoised on disk (``cache_dir=None``: :func:`default_cache_dir`).

    The file name holds a SHA-256 of the fully resolved settings (:func:`resolve_spec`) plus
    ``FORMAT_VERSION``; the file also stores the settings, which are checked on load. Writes go to a temp
    file in the same folder and are moved in place with ``os.replace``, so readers never see half a file.
    A corrupt or mismatching file is rebuilt (with a warning); a cache folder that cannot be written only
    costs a warning.
    """
    spec = resolve_spec(kind, d, C, beta, seed, **opts)
    cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cdir / f"{kind}-d{spec['d']}-C{spec['C']}-{_cache_key(spec)[:24]}.safetensors"
    if path.exists():
        W = _load(path, spec)
        if W is not None:
            return W
    t0 = time.perf_counter()
    W = _build_from_spec(spec)
    build_s = time.perf_counter() - t0
    try:
        cdir.mkdir(parents=True, exist_ok=True)
        save_tree(path, {"format": FORMAT_VERSION, "spec": spec, "weight": W, "build_seconds": build_s}, "etf-cache")
    except OSError as e:
        warnings.warn(f"could not write the fixed-classifier cache {path}: {e}")
    return W
