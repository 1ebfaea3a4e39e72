"""Paper-style tables (and the report page) from run directories.

``fedlt report DIR`` reads every run under DIR (a sweep, a comparison, or one run): rows are methods, columns
settings, each cell GM and PM as mean +- std over seeds (in %, sample standard deviation, n-1), the best mean
of each column in bold (ties, at the printed precision, all bold) -- like Tables 1-3 of FedLoGe (ICLR 2024).
A second table per setting gives many / medium / few / GM / PM, like its Table 2.

Which number a run contributes (``--metric``):
- ``last3`` (default, docs/protocol.md): the mean of the last 3 evaluated rounds;
- ``final``: the final evaluation, after any post-training phase (FedLoGe's GA-FR / LA-FR, fine-tuning).
GM is a method's first global inference mode, PM its first personal mode (the order its hooks return them;
methods without personal models are evaluated for PM with the global model on the clients' test sets).

A run that diverged (its summary says ``status: diverged``) contributes no number: its cell reads
``diverged`` (with how many seeds, when only some did), never a mean, and it is not a column's best.

Labels: runs made by a sweep carry (method, setting, seed) in config.json; for other runs the method is the
method name and the setting is made of the run settings that differ between the runs found.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import SETTINGS
from ..errors import ConfigError
from ..jsonutil import read_json, read_json_lines

METRICS = ("GM", "many", "medium", "few", "PM")
MAIN = ("GM", "PM")
# what never names a setting: the settings that change where or how a run executes, never its numbers (declared
# result=False: --threads, --device, --client-state-memory, ...), and the labels'
VARYING_IGNORED = {name for name, s in SETTINGS.items() if not s.decl.result} | \
    {"seed", "method", "params", "labels", "method_params", "engine", "method_file"}


@dataclass
class Run:
    dir: Path
    method: str
    setting: str
    seed: int
    config: dict
    summary: dict | None  # None: not finished
    records: list[dict] = field(default_factory=list)  # its metrics.jsonl, read once (:func:`collect`)

    @property
    def diverged(self) -> bool:
        return self.summary is not None and self.summary.get("status") == "diverged"

    @property
    def finished(self) -> bool:
        """Finished with results (a diverged run has a summary but no result)."""
        return self.summary is not None and not self.diverged

    def metrics(self, which: str = "last3") -> dict[str, float | None]:
        return headline_metrics(self.summary, which) if self.finished else {}


@dataclass
class Cell:
    values: list[float]
    diverged: int = 0  # seeds that diverged: the cell then shows "diverged", never a number

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return float(np.mean(self.values)) if self.values else None

    @property
    def std(self) -> float | None:
        """Sample standard deviation over seeds (n-1); None for a single seed."""
        return float(np.std(self.values, ddof=1)) if len(self.values) > 1 else None


# ------------------------------------------------------------------------------------------------ reading
def headline_metrics(summary: dict, which: str = "last3") -> dict[str, float | None]:
    """GM (first global mode) with its many/medium/few, and PM (first personal mode), from a summary."""
    if which == "last3":
        src = summary.get("last3", {})
        gm = next((k[: -len(".acc")] for k in src if k.startswith("GM[") and k.endswith(".acc")), None)
        pm = next((k[: -len(".acc")] for k in src if k.startswith("PM[") and k.endswith(".acc")), None)
        out = {m: src.get(f"{gm}.{'acc' if m == 'GM' else m}") if gm else None for m in METRICS[:4]}
        out["PM"] = src.get(f"{pm}.acc") if pm else None
        return out
    if which == "final":
        fin = summary["final"]
        g = next(iter(fin["global"].values()), {})
        p = next(iter(fin["personal"].values()), {})
        return {"GM": g.get("acc"), "many": g.get("many"), "medium": g.get("medium"), "few": g.get("few"),
                "PM": p.get("acc")}
    raise ConfigError(f"unknown metric {which!r}; choose last3 or final")


def headline_modes(summary: dict, which: str = "last3") -> tuple[str | None, str | None]:
    """The inference modes behind GM and PM (e.g. ``universal``, ``phi+psi``)."""
    if which == "last3":
        keys = list(summary.get("last3", {}))
        pick = [next((k[3:].split("]")[0] for k in keys if k.startswith(p)), None) for p in ("GM[", "PM[")]
        return pick[0], pick[1]
    fin = summary["final"]
    return next(iter(fin["global"]), None), next(iter(fin["personal"]), None)


def collect(root: str | Path) -> tuple[list[Run], list[str], list[str]]:
    """The runs under ``root`` and the method (row) and setting (column) order."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory; give a run directory or a sweep directory")
    dirs = [root] if (root / "config.json").is_file() else sorted(p.parent for p in root.rglob("config.json"))
    if not dirs:
        raise ConfigError(f"no runs under {root} (a run directory holds config.json)")
    configs = [_read_json(d / "config.json") for d in dirs]
    derived = _derived_settings(configs)
    runs = []
    for d, cfg, setting in zip(dirs, configs, derived):
        lab = cfg.get("labels") or {}
        summ = _read_json(d / "summary.json") if (d / "summary.json").is_file() else None
        m = d / "metrics.jsonl"  # a damaged one is one line here, before any of the report is written
        recs = read_json_lines(m, "re-run that run or remove its directory") if m.is_file() else []
        runs.append(Run(d, str(lab.get("method", _row_label(cfg))), str(lab.get("setting", setting)),
                        int(lab.get("seed", cfg.get("seed", 0))), cfg, summ, recs))
    methods = list(dict.fromkeys(r.method for r in runs))
    settings = list(dict.fromkeys(r.setting for r in runs))
    manifest = root / "sweep.json"
    if manifest.is_file():
        m = _read_json(manifest)
        methods = [x for x in m.get("methods", []) if x in methods] + [x for x in methods if x not in m.get("methods", [])]
        settings = [x for x in m.get("settings", []) if x in settings] + [x for x in settings if x not in m.get("settings", [])]
    return runs, methods, settings


def _read_json(path: Path) -> dict:
    """A JSON object from a run directory, or a one-line ConfigError naming the file."""
    obj = read_json(path, hint="re-run that run or remove its directory")
    if not isinstance(obj, dict):
        raise ConfigError(f"{path} holds a JSON {type(obj).__name__}, not an object; re-run that run or remove "
                          f"its directory")
    return obj


def _row_label(cfg: dict) -> str:
    """For runs without labels: the method, with the hyper-parameters the user set (so ablations of one
    method, e.g. FedLoGe with a dense ETF, are rows of their own rather than pooled as if they were seeds)."""
    params = cfg.get("params") or {}
    if not params:
        return str(cfg.get("method"))
    return f"{cfg.get('method')}[{','.join(f'{k}={_short(v)}' for k, v in sorted(params.items()))}]"


def _derived_settings(configs: list[dict]) -> list[str]:
    """For runs without labels: the settings that differ between the runs, e.g. 'imbalance_ratio=10'."""
    keys = sorted({k for c in configs for k in c} - VARYING_IGNORED)
    varying = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True) for c in configs}) > 1]
    out = []
    for c in configs:
        if varying:
            out.append(",".join(f"{k}={_short(c.get(k))}" for k in varying))
        else:
            out.append(f"{c.get('dataset')}-rho{_short(c.get('imbalance_ratio'))}-{c.get('partition')}")
    return out


def _short(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


# ------------------------------------------------------------------------------------------------ tables
def aggregate(runs: list[Run], which: str = "last3") -> dict[tuple[str, str], dict[str, Cell]]:
    """(method, setting) -> metric -> the values over the finished seeds."""
    cells: dict[tuple[str, str], dict[str, Cell]] = {}
    for r in sorted(runs, key=lambda r: r.seed):
        if r.summary is None:
            continue
        slot = cells.setdefault((r.method, r.setting), {k: Cell([]) for k in METRICS})
        if r.diverged:
            for k in METRICS:
                slot[k].diverged += 1
            continue
        m = r.metrics(which)
        for k in METRICS:
            if m.get(k) is not None:
                slot[k].values.append(float(m[k]))
    return cells


def best(cells, methods: list[str], setting: str, metric: str, digits: int = 2) -> set[str]:
    """Methods whose mean is the column's best at the printed precision (all of them when tied)."""
    means = {m: cells[(m, setting)][metric].mean for m in methods
             if (m, setting) in cells and not cells[(m, setting)][metric].diverged}
    shown = {m: round(100 * v, digits) for m, v in means.items() if v is not None}
    if not shown:
        return set()
    top = max(shown.values())
    return {m for m, v in shown.items() if v == top}


def _cell_text(c: Cell | None, fmt: str, bold: bool, digits: int = 2) -> str:
    if c is not None and c.diverged:
        return "diverged" + (f" ({c.diverged} of {c.diverged + c.n} seeds)" if c.n else "")
    if c is None or c.mean is None:
        return "-"
    mean = f"{100 * c.mean:.{digits}f}"
    std = None if c.std is None else f"{100 * c.std:.{digits}f}"
    if fmt == "md":
        body = mean + (f" ± {std}" if std else "")
        return f"**{body}**" if bold else body
    if fmt == "tex":
        m = f"\\textbf{{{mean}}}" if bold else mean
        return m + (f"{{\\scriptsize$\\pm${std}}}" if std else "")
    raise ValueError(fmt)


def markdown_table(cells, methods, settings, metrics=MAIN) -> str:
    head = ["method"] + [f"{s} {m}" for s in settings for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    bests = {(s, m): best(cells, methods, s, m) for s in settings for m in metrics}
    for meth in methods:
        row = [meth] + [_cell_text(cells.get((meth, s), {}).get(m), "md", meth in bests[(s, m)])
                        for s in settings for m in metrics]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


_TEX = {"\\": r"\textbackslash{}", "_": r"\_", "&": r"\&", "%": r"\%", "#": r"\#", "$": r"\$",
        "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\^{}"}


def _tex(s: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in str(s))


def latex_table(cells, methods, settings, metrics=MAIN, caption: str = "") -> str:
    k = len(metrics)
    cols = "l" + (" " + "c" * k) * len(settings)
    lines = ["\\begin{table}[t]", "\\centering", f"\\begin{{tabular}}{{{cols}}}", "\\toprule",
             " & " + " & ".join(f"\\multicolumn{{{k}}}{{c}}{{{_tex(s)}}}" for s in settings) + " \\\\",
             "".join(f"\\cmidrule(lr){{{2 + i * k}-{1 + (i + 1) * k}}}" for i in range(len(settings))),
             "Method & " + " & ".join(_tex(m) for _ in settings for m in metrics) + " \\\\", "\\midrule"]
    bests = {(s, m): best(cells, methods, s, m) for s in settings for m in metrics}
    for meth in methods:
        row = [_tex(meth)] + [_cell_text(cells.get((meth, s), {}).get(m), "tex", meth in bests[(s, m)])
                              for s in settings for m in metrics]
        lines.append(" & ".join(row) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    if caption:
        lines.append(f"\\caption{{{caption}}}")  # LaTeX as given
    lines.append("\\end{table}")
    return "\n".join(lines)


def csv_table(cells, methods, settings) -> str:
    """Long format: one line per (method, setting, metric), accuracies as fractions."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["method", "setting", "metric", "mean", "std", "n", "best", "status"])
    for s in settings:
        for m in METRICS:
            b = best(cells, methods, s, m)
            for meth in methods:
                c = cells.get((meth, s), {}).get(m)
                if c is not None and c.diverged:
                    w.writerow([meth, s, m, "", "", c.n + c.diverged, 0, "diverged"])
                    continue
                if c is None or c.mean is None:
                    continue
                w.writerow([meth, s, m, f"{c.mean:.6f}", "" if c.std is None else f"{c.std:.6f}", c.n,
                            int(meth in b), "ok"])
    return buf.getvalue()


def runs_csv(runs: list[Run], which: str) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["method", "setting", "seed", "finished", *METRICS, "wall_time", "dir", "status"])
    for r in runs:
        m = r.metrics(which)
        w.writerow([r.method, r.setting, r.seed, int(r.finished),
                    *("" if m.get(k) is None else f"{m[k]:.6f}" for k in METRICS),
                    "" if r.summary is None else f"{r.summary.get('wall_time', math.nan):.1f}", str(r.dir),
                    "diverged" if r.diverged else "finished" if r.finished else "unfinished"])
    return buf.getvalue()


def clients_table(runs: list[Run]) -> str | None:
    """Who took part, per run: the mean per round of the clients sampled, trained and arrived (their replies
    aggregated; fedlt.engine.faults), the fewest that arrived, the rounds without a reply and the simulated
    time; None when every sampled client of every run answered (nothing to show)."""
    rows = []
    for r in runs:
        c = (r.summary or {}).get("clients_per_round")
        if not c or (c["arrived"] == c["sampled"] and "sim_time" not in r.summary):
            continue
        arrived = [h["arrived"] for h in r.records if "round" in h and "arrived" in h]
        sim = r.summary.get("sim_time")
        rows.append(f"| {r.setting} | {r.method} | {r.seed} | {c['sampled']:.2f} | {c['trained']:.2f} | "
                    f"{c['arrived']:.2f} | {min(arrived, default=0)} | {sum(a == 0 for a in arrived)} | "
                    f"{'-' if sim is None else f'{sim:.1f}'} |")
    if not rows:
        return None
    return "\n".join(["| setting | method | seed | sampled | trained | arrived | fewest arrived | rounds without "
                      "replies | simulated s |", "|---|---|---|---|---|---|---|---|---|", *rows])


# ------------------------------------------------------------------------------------------------ the page
METRIC_TEXT = {"last3": "the mean of the last 3 evaluated rounds", "final": "the final evaluation (after any "
               "post-training phase)"}


def write_report(root: str | Path, out: str | Path | None = None, which: str = "last3", figures: bool = True,
                 echo=print) -> Path:
    """Write tables (Markdown, CSV, LaTeX), figures (PNG, if matplotlib is installed) and report.md; returns
    the report directory. Prints the main table."""
    if which not in METRIC_TEXT:
        raise ConfigError(f"unknown metric {which!r}; choose last3 or final")
    root = Path(root)
    runs, methods, settings = collect(root)
    out = Path(out) if out else root / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write the report to {out}: "
                          f"{'a file is in the way' if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or e}"
                          f"; choose another --out") from None
    cells = aggregate(runs, which)
    seeds = sorted({r.seed for r in runs})
    main_md = markdown_table(cells, methods, settings)
    detail_md = {s: markdown_table(cells, methods, [s], ("many", "medium", "few", "GM", "PM")) for s in settings}
    cap = (f"Accuracy (\\%), mean $\\pm$ std over seeds {seeds} of {METRIC_TEXT[which]}; best per column in bold.")
    (out / "table.md").write_text(main_md + "\n")
    (out / "table.csv").write_text(csv_table(cells, methods, settings))
    (out / "runs.csv").write_text(runs_csv(runs, which))
    tex = [latex_table(cells, methods, settings, caption=cap)]
    tex += [latex_table(cells, methods, [s], ("many", "medium", "few", "GM", "PM"), caption=f"{_tex(s)}: {cap}")
            for s in settings]
    (out / "table.tex").write_text("\n\n".join(tex) + "\n")

    figs: list[tuple[str, str, str]] = []
    fig_note = ""
    if figures:
        try:
            from . import figures as F
        except ImportError:
            fig_note = ("Figures skipped: matplotlib is not installed (`pip install 'fedlt[report]'`).")
        else:
            figs = F.all_figures(runs, methods, settings, out / "figures")
    unfinished = [r for r in runs if r.summary is None]
    diverged = [r for r in runs if r.diverged]
    lines = [f"# fedlt report: {root}", "",
             f"{len(runs)} runs ({len(runs) - len(unfinished) - len(diverged)} finished"
             f"{f', {len(diverged)} diverged' if diverged else ''}): methods {', '.join(methods)}; "
             f"settings {', '.join(settings)}; seeds {', '.join(map(str, seeds))}.", "",
             f"Cells: accuracy in %, mean ± sample std (n-1) over seeds of {METRIC_TEXT[which]}; GM on the balanced "
             "test set, PM the mean over clients of the personalized model on the client's own test set (the "
             "global model where a method has none). Best per column in **bold**.", "",
             "## GM and PM per setting", "", main_md, ""]
    modes = {}
    for r in runs:
        if r.finished:
            modes.setdefault(r.method, headline_modes(r.summary, which))
    lines += ["Inference mode behind each number (GM / PM): " +
              "; ".join(f"{m}: {g or '-'} / {p or '-'}" for m, (g, p) in modes.items()) + ".", ""]
    if unfinished:
        lines += ["Not finished (left out of the tables): " +
                  ", ".join(f"{r.setting}/{r.method}/seed{r.seed}" for r in unfinished), ""]
    if diverged:
        lines += ["Diverged (shown as \"diverged\", no number): " + "; ".join(
            f"{r.setting}/{r.method}/seed{r.seed} in round {r.summary['diverged']['round']}: "
            f"{r.summary['diverged']['reason']}" for r in diverged), ""]
    clients = clients_table(runs)
    if clients:
        lines += ["## Clients per round", "", "Mean per round of the clients sampled, those that trained and those "
                  "whose reply arrived and was aggregated (--availability, --drop-rate, --round-deadline, "
                  "--over-select; docs/dropout.md); every round's numbers are in the run's metrics.jsonl.", "",
                  clients, ""]
    lines += ["## Many / medium / few per setting", ""]
    for s in settings:
        lines += [f"### {s}", "", detail_md[s], ""]
    lines += ["## Figures", ""]
    if fig_note:
        lines += [fig_note, ""]
    for title, path, caption in figs:
        rel = Path(path).relative_to(out)
        lines += [f"### {title}", "", f"![{title}]({rel.as_posix()})", "", caption, ""]
    lines += ["## Files", "", "table.md, table.csv (long format, fractions), table.tex (booktabs), runs.csv "
              "(one line per run)" + (", figures/*.png" if figs else ""), ""]
    (out / "report.md").write_text("\n".join(lines))
    echo(f"{METRIC_TEXT[which]}, mean ± std over seeds {seeds}; best per column in bold")
    echo(main_md)
    if clients:
        echo("clients per round (mean):\n" + clients)
    echo(f"report: {out / 'report.md'}")
    return out


def group_metrics(out: Path) -> dict[str, float]:
    """The comparison's final GM and PM per method (and setting, where a sweep has several), averaged over its
    finished seeds, as percentages: ``final.GM/fedavg``, ``final.PM/setting-a/fedloge``. What a sweep's MLflow
    parent run shows on its charts (its runs' own metrics are the nested runs')."""
    import re

    try:
        runs, _, settings = collect(out)
    except Exception:  # noqa: BLE001 -- no runs, or a damaged one: the report says so; the charts stay empty
        return {}
    cells: dict[str, list[float]] = {}
    for r in runs:
        for name, v in (r.metrics("final") if r.finished else {}).items():
            if name in ("GM", "PM") and v is not None:
                where = f"{r.setting}/{r.method}" if len(settings) > 1 else r.method
                cells.setdefault(re.sub(r"[^A-Za-z0-9_\-./ ]", "_", f"final.{name}/{where}"), []).append(100 * v)
    return {k: sum(v) / len(v) for k, v in cells.items()}
