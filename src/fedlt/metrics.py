"""GM and PM accuracy, per class and split into many / medium / few classes.

GM: a global model on the balanced test set. PM: mean over clients of each client's personalized model on
its own test set (drawn with the client's training label distribution). A method without personal models is
evaluated for PM with its global model on the same per-client sets, and the record says so. A method without
a generic model (``global_model`` returns None: FedPer, FedRep, local-only training) has no GM entry.

Two ways to split classes into many / medium / few:
- ``fedloge`` (default, the FedLoGe code's ``shot_split``): sort classes by training count, descending; "many"
  are the classes up to and including the one where the cumulative share of samples crosses 75 %, "medium"
  up to the one crossing 95 %, "few" the rest.
- ``fixed``: many > 100 training samples, few < 20, medium in between (the usual LT thresholds).
For PM the ``fedloge`` split is computed per client from the client's own counts (as the official code
does) and each group is averaged over the clients that have it; ``fixed`` uses the global counts.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .errors import ConfigError

GROUPS = ("many", "medium", "few")


def shot_split(counts, mode: str = "fedloge", cuts=(0.75, 0.95), thresholds=(100, 20)) -> dict[str, np.ndarray]:
    counts = np.asarray(counts, dtype=np.float64)
    if mode == "fedloge":
        order = np.argsort(-counts, kind="stable")
        order = order[counts[order] > 0]
        share = np.cumsum(counts[order]) / max(counts.sum(), 1)
        a = int(np.searchsorted(share, cuts[0] - 1e-12)) + 1  # include the class crossing the cut
        b = int(np.searchsorted(share, cuts[1] - 1e-12)) + 1
        return {"many": order[:a], "medium": order[a:b], "few": order[b:]}
    if mode == "fixed":
        hi, lo = thresholds
        c = np.arange(len(counts))
        return {"many": c[counts > hi], "medium": c[(counts <= hi) & (counts >= lo)], "few": c[counts < lo]}
    raise ConfigError(f"unknown shot split {mode!r}; choose fedloge or fixed")


def report(pred: torch.Tensor, y: torch.Tensor, num_classes: int, split: dict[str, np.ndarray]) -> dict:
    """Accuracy, per-class accuracy and group accuracies (correct / total within each group); ``collapsed``, the
    class, only where the model predicts one class for every sample of a test set that holds several."""
    pred, y = pred.cpu(), y.cpu()
    correct = torch.bincount(y[pred == y], minlength=num_classes).numpy()
    total = torch.bincount(y, minlength=num_classes).numpy()
    out = {"acc": float(correct.sum() / max(total.sum(), 1)),
           "per_class": [float(c / t) if t else None for c, t in zip(correct, total)]}
    if num_classes > 1 and int((total > 0).sum()) > 1 and bool((pred == pred[0]).all()):
        out["collapsed"] = int(pred[0])  # one class predicted for every sample of a test set holding several
    for g in GROUPS:
        cls = split[g]
        t = total[cls].sum() if len(cls) else 0
        out[g] = float(correct[cls].sum() / t) if t else None
    return out


@torch.no_grad()
def features(backbone: Callable, batches) -> tuple[torch.Tensor, torch.Tensor]:
    fs, ys = [], []
    if hasattr(backbone, "eval"):
        backbone.eval()
    for x, y in batches:
        fs.append(backbone(x))
        ys.append(y)
    if not fs:
        return torch.zeros(0, device="cpu"), torch.zeros(0, dtype=torch.long, device="cpu")
    return torch.cat(fs), torch.cat(ys)


@torch.no_grad()
def head_logits(head: Callable, feats: torch.Tensor) -> torch.Tensor | None:
    """The head's outputs on ``feats`` in eval mode (None for no features)."""
    if hasattr(head, "eval"):
        head.eval()
    return head(feats) if len(feats) else None


def predicted(logits: torch.Tensor | None, feats: torch.Tensor) -> torch.Tensor:
    """The predicted classes of :func:`head_logits`'s outputs (none for no features)."""
    return logits.argmax(1) if logits is not None else torch.zeros(0, dtype=torch.long, device=feats.device)


def head_predict(head: Callable, feats: torch.Tensor) -> torch.Tensor:
    return predicted(head_logits(head, feats), feats)


def as_modes(p, default: str) -> dict:
    return p if isinstance(p, dict) else {default: p}


def client_split(counts, split_mode: str, gsplit: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A client's many/medium/few split for PM: from its own counts (``fedloge``) or the global one."""
    return shot_split(counts, "fedloge") if split_mode == "fedloge" else gsplit


def diverged(logits: torch.Tensor) -> bool:
    """Whether a model's logits say its training diverged: NaN or +inf anywhere, or a sample with no finite logit.
    A logit of -inf alone is a class the model rules out by design (FedLoGe's personal heads give it to the classes
    a client lacks, ``mask_absent``)."""
    return bool(torch.isnan(logits).any() or torch.isposinf(logits).any() or
                (~torch.isfinite(logits)).all(dim=-1).any())


def client_reports(pp, client, num_classes: int, csplit: dict[str, np.ndarray], shared=None) -> dict[str, dict]:
    """One client's :func:`report` for every personal inference mode of ``pp`` on its own test set.
    ``shared``: the global backbone's test-set features (reused by heads with ``shared_backbone``). The Flower
    engine calls this on the client itself."""
    out = {}
    for mode, pred in as_modes(pp, "personal").items():
        if pred.shared_backbone and shared is not None and client.tests_on_test_set:
            idx = torch.from_numpy(client.test_index).to(shared[0].device)
            f, y = shared[0][idx], shared[1][idx]
        else:
            f, y = features(pred.backbone, client.test_batches())
        logits = head_logits(pred.head, f)
        out[mode] = report(predicted(logits, f), y, num_classes, csplit)
        if logits is not None and diverged(logits):  # a personal model whose training diverged
            out[mode]["nonfinite"] = True
    return out


def summarize_personal(per_mode: dict[str, list[dict]], source: str) -> dict[str, dict]:
    """PM of every personal mode from the clients' reports: mean/std/min/max accuracy over clients, and each
    group averaged over the clients that have it. ``source``: "personal", or "global" when clients had no
    personal model and were evaluated with the global one."""
    out = {}
    for mode, reps in per_mode.items():
        accs = np.array([r["acc"] for r in reps])
        agg = {"acc": float(accs.mean()), "std": float(accs.std()), "min": float(accs.min()),
               "max": float(accs.max()), "per_client": accs.round(4).tolist(), "source": source}
        for g in GROUPS:
            vals = [r[g] for r in reps if r[g] is not None]
            agg[g] = float(np.mean(vals)) if vals else None
        if bad := sum(bool(r.get("nonfinite")) for r in reps):  # clients whose personal model outputs NaN or inf
            agg["nonfinite"] = bad
        out[mode] = agg
    return out


def evaluate(method, state: dict, client_states, fed, split_mode: str = "fedloge",
             personal: bool = True, clients: list[int] | None = None) -> dict:
    """One evaluation: every global inference mode on the balanced test set, and every personal mode on the own
    test set of each of ``clients`` (None: every client). Backbone features are computed once per distinct
    backbone and reused for heads. ``client_states``: a client's state by id, a mapping (a client without one
    gets ``{}``) or a function. ``untested`` in the result: how many of the clients had no test sample."""
    C = fed.num_classes
    gsplit = shot_split(fed.train_counts, split_mode)
    gm = method.global_model(state)  # None: the method has no generic model (FedPer, FedRep, Local)
    gmodes = as_modes(gm, "global") if gm is not None else {}
    out: dict = {"global": {}, "personal": {}, "split": split_mode,
                 "split_classes": {g: gsplit[g].tolist() for g in GROUPS}}
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    shared = None
    for mode, pred in gmodes.items():
        key = id(pred.backbone)
        if key not in cache:
            cache[key] = features(pred.backbone, fed.test_batches())
        f, y = cache[key]
        if pred.shared_backbone and shared is None:
            shared = (f, y)
        out["global"][mode] = report(head_predict(pred.head, f), y, C, gsplit)
    if not personal:
        return out
    main_global = next(iter(gmodes.values()), None)
    per_mode: dict[str, list] = {}
    source = "personal"
    state_of = client_states if callable(client_states) else (lambda cid: client_states.get(cid, {}))
    untested = 0
    for cid in range(len(fed.clients)) if clients is None else clients:
        c = fed.clients[cid]
        if len(c.test_y) == 0:
            untested += 1
            continue
        pp = method.personal_model(method.eval_payload(state, c.client_id), state_of(c.client_id), c)
        if pp is None:
            if main_global is None:
                raise ValueError(f"method {method.name} has neither a global nor a personal model")
            pp, source = {"global": main_global}, "global"
        for mode, rep in client_reports(pp, c, C, client_split(c.counts, split_mode, gsplit), shared).items():
            per_mode.setdefault(mode, []).append(rep)
    out["personal"] = summarize_personal(per_mode, source)
    out["untested"] = untested
    return out


def headline(ev: dict) -> dict[str, float | None]:
    """The main numbers of an evaluation: GM (first global mode), its groups, PM (first personal mode)."""
    g = next(iter(ev["global"].values()), None)
    res = {"GM": g["acc"], "many": g["many"], "medium": g["medium"], "few": g["few"]} if g else \
        {"GM": None, "many": None, "medium": None, "few": None}  # a method without a generic model
    if ev["personal"]:
        res["PM"] = next(iter(ev["personal"].values()))["acc"]
    return res
