"""The report's figures (PNG; needs matplotlib, the optional ``report`` extra). One of each per setting:

- ``curves_<setting>.png``: GM and PM per evaluated round for every method (mean over seeds, +- std band);
  the final evaluation after a post-training phase is drawn as a separate marker.
- ``per_class_<setting>.png``: per-class GM test accuracy (final evaluation) against the class's training
  count, log scale: the long tail made visible.
- ``head_norms_<setting>.png``: the L2 norm of each class vector of every classifier-like weight (a 2-D tensor
  whose first dimension is the number of classes) against the class count. Left: the server's, at the end
  (and before the post-training phases, where they differ); right: one client's own head against that
  client's counts. Found generically in final_state.safetensors, labelled by state key.
- ``partition_<setting>.png``: the client-by-class training counts as a heat map: every client up to
  ``HEATMAP_CLIENTS``, else a seeded sample of that many (a figure of 100,000 clients costs what 100 cost).
The head-norm and partition figures use the first seed's runs; the head-norm figure's client is the largest
of the (at most 20) clients whose heads the run kept.
"""
from __future__ import annotations

import functools
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from ..errors import ConfigError  # noqa: E402
from ..jsonutil import read_json  # noqa: E402
from ..runner.runstate import head_like, load_final_state  # noqa: E402


STYLES = ("-o", "--s", "-.^", ":D", "-v", "--P", "-.X", ":*")  # overlapping methods stay distinguishable
HEATMAP_CLIENTS = 100  # rows of the partition figure
DPI = 110  # every figure's resolution


def _safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_.+=" else "_" for ch in label)


def _save(fig, out: Path, kind: str, setting: str) -> str:
    """Lay out, write ``<out>/<kind>_<setting>.png`` and close a figure; returns the file's path."""
    fig.tight_layout()
    path = out / f"{kind}_{_safe(setting)}.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return str(path)


def _finished(runs, setting):
    return [r for r in runs if r.setting == setting and r.finished]


def all_figures(runs, methods: list[str], settings: list[str], out: Path) -> list[tuple[str, str, str]]:
    """Write every figure; returns (title, path, caption) for the report page."""
    out.mkdir(parents=True, exist_ok=True)
    figs = []
    for s in settings:
        rs = _finished(runs, s)
        if not rs:
            continue
        for fn in (curves, per_class, head_norms, partition_heatmap):
            res = fn(rs, [m for m in methods if any(r.method == m for r in rs)], s, out)
            if res is not None:
                figs.append(res)
    return figs


def _evals(run) -> tuple[list[int], list[float | None], list[float | None], bool, list[str | None]]:
    """Rounds, GM and PM of every evaluation (first global / personal mode), whether phases ran, the modes."""
    rounds, gm, pm, phases, modes = [], [], [], False, [None, None]
    for rec in run.records:
        if "phase" in rec:
            phases = True
        if "eval" not in rec:
            continue
        ev = rec["eval"]
        modes = [next(iter(ev["global"]), None), next(iter(ev["personal"]), None)]
        rounds.append(rec["round"])
        gm.append(next(iter(ev["global"].values()), {}).get("acc"))  # no global model: no GM
        pm.append(next(iter(ev["personal"].values()))["acc"] if ev["personal"] else None)
    return rounds, gm, pm, phases, modes


def _final(run) -> tuple[tuple[str, float] | None, tuple[str, float] | None]:
    """(mode, accuracy) of the final evaluation's first global and first personal mode."""
    fin = run.summary["final"]
    out = []
    for side in ("global", "personal"):
        mode = next(iter(fin[side]), None)
        out.append(None if mode is None or fin[side][mode].get("acc") is None else (mode, fin[side][mode]["acc"]))
    return out[0], out[1]


def curves(rs, methods, setting, out: Path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    for i, m in enumerate(methods):
        color = f"C{i % 10}"
        series = [_evals(r) for r in rs if r.method == m]
        finals = [_final(r) for r in rs if r.method == m]
        for k, (ax, name) in enumerate(zip(axes, ("GM", "PM"))):
            rounds = series[0][0]
            vals = [s[1 + k] for s in series if s[0] == rounds]
            if not rounds or any(v is None for vs in vals for v in vs):
                continue
            a = 100 * np.array(vals, dtype=float)
            mu = a.mean(0)
            mode = series[0][4][k]
            ax.plot(rounds, mu, STYLES[i % len(STYLES)], color=color, ms=4,
                    label=m if mode in (None, "global", "personal") else f"{m} [{mode}]")
            if len(a) > 1:
                sd = a.std(0, ddof=1)
                ax.fill_between(rounds, mu - sd, mu + sd, color=color, alpha=0.15)
            if any(s[3] for s in series):  # a post-training phase: its final evaluation is another point
                fv = [f[k] for f in finals if f[k] is not None]
                if fv:
                    ax.plot([rounds[-1]], [100 * np.mean([v for _, v in fv])], "*", color=color, ms=12,
                            label=f"{m} [{fv[0][0]}] after phases")
    for ax, name in zip(axes, ("GM (balanced test set)", "PM (clients' own test sets)")):
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy (%)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.legend(fontsize=8)
    n = len({r.seed for r in rs})
    fig.suptitle(f"{setting}: accuracy per evaluated round (mean over {n} seed{'s' * (n > 1)}"
                 f"{', band: ±1 std' if n > 1 else ''})")
    path = _save(fig, out, "curves", setting)
    return (f"Accuracy per round: {setting}", path,
            "GM and PM at every evaluated round, one line per method (mean over seeds; band ±1 std), in the "
            "method's first inference mode [in brackets where it has several]. A star marks the final evaluation "
            "of a method with post-training phases, in its first mode after them.")


def _partition(run) -> dict:
    """The run's partition.json, read once per report (at 100,000 clients it holds every client's indices)."""
    path = run.dir / "partition.json"
    st = path.stat()
    return _read_partition(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _read_partition(path: str, mtime_ns: int, size: int) -> dict:
    return read_json(path, hint="re-run that run or remove its directory")


def shown_clients(K: int, seed: int, n: int = HEATMAP_CLIENTS) -> np.ndarray:
    """The clients a per-client figure draws: all ``K`` up to ``n``, else a sample of ``n`` drawn from the
    run's seed (sorted)."""
    if K <= n:
        return np.arange(K)
    return np.sort(np.random.default_rng([seed, K]).choice(K, size=n, replace=False))


def per_class(rs, methods, setting, out: Path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, m in enumerate(methods):
        mine = [r for r in rs if r.method == m]
        accs, counts = [], []
        for r in mine:
            gmode = next(iter(r.summary["final"]["global"]), None)
            if gmode is None:
                continue
            pc = r.summary["final"]["global"][gmode]["per_class"]
            accs.append([np.nan if v is None else v for v in pc])
            counts.append(_partition(r)["train_counts"])
        if not accs:
            continue
        a = 100 * np.nanmean(np.array(accs, dtype=float), 0)
        c = np.mean(np.array(counts, dtype=float), 0)
        order = np.argsort(-c)
        ax.plot(c[order], a[order], STYLES[i % len(STYLES)], color=f"C{i % 10}", ms=4,
                label=m if gmode == "global" else f"{m} [{gmode}]")
    c0 = np.array(_partition(rs[0])["train_counts"], dtype=float)
    for cls, n in enumerate(c0):
        ax.annotate(str(cls), (n, 0), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7,
                    color="gray")
    ax.set_xscale("log")
    ax.set_xlabel("training samples of the class (log scale; class ids in gray)")
    ax.set_ylabel("test accuracy of the class (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{setting}\nper-class GM accuracy vs. class size (final evaluation, mean over seeds)",
                 fontsize=10)
    path = _save(fig, out, "per_class", setting)
    return (f"Per-class accuracy vs. training count: {setting}", path,
            "Each point is one class: its test accuracy under the global model (first global mode, final "
            "evaluation) against how many training samples it has; head classes on the right, tail on the left.")


def _heads(run, num_classes: int) -> dict:
    """The run's classifier-like tensors from its final state (safetensors; {} without one). A fedlt 0.1
    ``final_state.pt`` (a pickle) is never loaded: the figure says so and tells how to re-create it."""
    try:
        obj = load_final_state(run.dir)
    except ConfigError as e:
        return {"unreadable": str(e)}
    return obj.get("heads") or {"server": head_like(obj.get("state", {}), num_classes)}


def head_norms(rs, methods, setting, out: Path):
    seed = min(r.seed for r in rs)
    first = {r.method: r for r in rs if r.seed == seed}
    methods = [m for m in methods if m in first]
    if not methods:
        return None
    fig, axes = plt.subplots(len(methods), 2, figsize=(11, 3.2 * len(methods)), squeeze=False)
    for row, m in enumerate(methods):
        r = first[m]
        part = _partition(r)
        counts = np.array(part["train_counts"], dtype=float)
        C = len(counts)
        heads = _heads(r, C)
        if "unreadable" in heads:
            print(f"note: head-norm figure of {m} left empty: {heads['unreadable']}")
        ax = axes[row, 0]
        order = np.argsort(-counts)
        drawn = 0
        final = heads.get("server", {})
        before = heads.get("server_before_phases", {})
        for key, w in final.items():
            ax.plot(counts[order], w.norm(dim=1).numpy()[order], "-o", ms=3, label=f"{key} (final)")
            drawn += 1
        for key, w in before.items():
            if key in final and torch.equal(final[key], w):
                continue
            ax.plot(counts[order], w.norm(dim=1).numpy()[order], "--s", ms=3, label=f"{key} (before phases)")
            drawn += 1
        ax.set_xscale("log")
        ax.set_title(f"{m}: server classifiers vs. global class count", fontsize=9)
        ax.set_xlabel("training samples of the class (log)")
        ax.set_ylabel("row norm ||w_c||")
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "final state not readable (see the report's notes)" if "unreadable" in heads else
                    "no classifier-like tensor in the server state", ha="center", transform=ax.transAxes)
        ax.grid(alpha=0.3)
        ax = axes[row, 1]
        known = len(part["client_class_counts"]) > 0  # not under --dp client on Flower: the clients send none
        clients = heads.get("clients", {}) if known else {}
        if clients:
            cc = np.array(part["client_class_counts"], dtype=float)
            cid = max(clients, key=lambda k: cc[int(k)].sum())
            lc = cc[int(cid)]
            order = np.argsort(-lc)
            for key, w in clients[cid].items():
                ax.plot(lc[order], w.norm(dim=1).numpy()[order], "-o", ms=3, label=key)
            ax.set_xscale("symlog", linthresh=1)
            ax.legend(fontsize=7)
            ax.set_title(f"{m}: client {cid}'s own classifier vs. its class counts", fontsize=9)
        else:
            ax.text(0.5, 0.5, "no client-side classifier (clients keep no head)" if known else
                    "the clients' label counts are not known (--dp client on Flower)", ha="center",
                    transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"{m}: local head", fontsize=9)
        ax.set_xlabel("client's training samples of the class (symlog)")
        ax.set_ylabel("row norm ||w_c||")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{setting}: classifier row norms per class (seed {seed})")
    path = _save(fig, out, "head_norms", setting)
    return (f"Classifier row norms vs. class count: {setting}", path,
            "The L2 norm of each class's row of every classifier-like weight (first dimension = number of "
            "classes) in the final server state (solid), before the post-training phases where that differs "
            "(dashed), and in the largest client's own state (right), against the class's training count.")


def partition_heatmap(rs, methods, setting, out: Path):
    r = min(rs, key=lambda r: r.seed)
    counts = _partition(r)["client_class_counts"]
    if not len(counts):  # the clients' counts are not known (a Flower run under --dp client: they send none)
        return None
    K = len(counts)
    rows = shown_clients(K, r.seed)
    cc = np.array([counts[k] for k in rows], dtype=float).reshape(len(rows), -1)
    n, C = cc.shape
    fig, ax = plt.subplots(figsize=(min(2 + 0.55 * C, 14), min(1.5 + 0.35 * n, 14)))
    im = ax.imshow(np.log1p(cc), aspect="auto", cmap="viridis")
    if n * C <= 400:
        hi = np.log1p(cc).max() / 2
        for k in range(n):
            for c in range(C):
                ax.text(c, k, f"{int(cc[k, c])}", ha="center", va="center", fontsize=7,
                        color="white" if np.log1p(cc[k, c]) < hi else "black")
    ax.set_xlabel("class")
    ax.set_ylabel("client" if n == K else f"client ({n} of {K:,}: a seeded sample)")
    ax.set_xticks(range(C))
    if n <= 40:
        ax.set_yticks(range(n), [str(k) for k in rows])
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("log(1 + samples)")
    ax.set_title(f"{setting}: training samples per client and class (seed {r.seed})")
    path = _save(fig, out, "partition", setting)
    sampled = "" if n == K else f" {n} of the {K:,} clients are drawn (a sample seeded by the run's seed)."
    return (f"Partition: {setting}", path,
            "Client-by-class training counts (every method of this setting and seed trains on exactly this "
            f"partition); color on a log scale, numbers are counts.{sampled}")
