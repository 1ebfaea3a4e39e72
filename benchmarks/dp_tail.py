"""What client-level DP costs the tail classes: the tables of docs/dp-tail.md from a finished sweep of
benchmarks/dp-tail.toml (``fedlt sweep benchmarks/dp-tail.toml``).

For each method and epsilon: GM and its many / medium / few accuracy (mean of the last 3 evaluations), PM, the
accuracy the many and the few classes lost against the method's run without DP (points), and the disparate-impact
ratio, few loss / many loss (above 1: DP takes more from the tail than from the head), given where the many
classes lost at least one point (a ratio over a smaller loss says nothing). With several seeds, each number is the
mean over the seeds that finished (GM and few: ± their sample standard deviation; the epsilon: the largest; the
losses: each seed's DP run against the run without DP of the same seed), and the last column says how many, and
why the others did not finish.

    python benchmarks/dp_tail.py [SWEEP_DIR]        # default runs/dp-tail
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SETTINGS = ("nodp", "eps8", "eps8fixed", "eps2", "eps2fixed")


def headline(last3: dict, side: str, mode: str | None) -> dict:
    """The last-3 means of one GM or PM mode (the first the run reports, where ``mode`` is None)."""
    keys = [k for k in last3 if k.startswith(f"{side}[") and (mode is None or k.startswith(f"{side}[{mode}]"))]
    if not keys:
        return {}
    first = keys[0].split("]")[0] + "]"
    return {k[len(first) + 1:]: v for k, v in last3.items() if k.startswith(first)}


def mean_of(dicts: list[dict]) -> dict:
    """Key by key, the mean over the runs that have a value for it (None where none has)."""
    keys = dict.fromkeys(k for d in dicts for k in d)
    have = {k: [d[k] for d in dicts if d.get(k) is not None] for k in keys}
    return {k: sum(v) / len(v) if v else None for k, v in have.items()}


def std_of(values: list[float]) -> float | None:
    """The sample standard deviation (None for fewer than two values)."""
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    return (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5


def runs_of(root: Path, setting: str, method: str) -> dict[str, dict]:
    """{seed folder: summary} of one row's runs."""
    return {f.parent.name: json.loads(f.read_text()) for f in sorted((root / setting / method).glob("seed*/summary.json"))}


def main(root: Path) -> int:
    methods = sorted({p.parent.name for p in root.glob("*/*/seed*")})
    rows = []
    for m in methods:
        base = {}  # seed -> the run without DP's GM
        for s in SETTINGS:
            runs = runs_of(root, s, m)
            if not runs:
                continue
            done = {k: x for k, x in runs.items() if x.get("status") == "finished"}
            gms = {k: headline(x["last3"], "GM", None) for k, x in done.items()}
            gm = mean_of(list(gms.values()))
            pm = mean_of([headline(x["last3"], "PM", None) for x in done.values()])
            eps = max((x.get("dp", {}).get("epsilon") or 0.0 for x in done.values()), default=None) \
                if s != "nodp" else None
            if s == "nodp":
                base = gms
            # the losses seed by seed (each DP run against the run without DP of its own seed), then their mean
            pairs = [(base[k], g) for k, g in gms.items() if k in base and s != "nodp"]
            loss = (sum(b["many"] - g["many"] for b, g in pairs) / len(pairs),
                    sum(b["few"] - g["few"] for b, g in pairs) / len(pairs)) if pairs else None
            spread = {g: std_of([x[g] for x in gms.values() if x.get(g) is not None]) for g in ("acc", "few")}
            bad = [x for x in runs.values() if x.get("status") != "finished"]
            status = None
            if bad:
                first = bad[0]
                why = f"diverged in round {first.get('diverged', {}).get('round')}" \
                    if first.get("status") == "diverged" else str(first.get("status"))
                status = why if len(bad) == 1 else f"{len(bad)} seeds: {why}, ..."
            rows.append((m, s, eps, gm, pm, loss, status, len(done), spread))
    print("| method | DP | epsilon (delta 1e-5) | GM | many | medium | few | PM | many loss | few loss | few / many loss "
          "| seeds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    pct = lambda x: "-" if x is None else f"{100 * x:.2f}"  # noqa: E731
    pm_sd = lambda x, sd: pct(x) + ("" if sd is None else f" ± {100 * sd:.2f}")  # noqa: E731
    for m, s, eps, gm, pm, loss, status, seeds, spread in rows:
        e = "-" if eps is None else f"{eps:.2f}"
        lost = "- | -" if loss is None else f"{pct(loss[0])} | {pct(loss[1])}"
        r = "-" if loss is None or loss[0] < 0.01 else f"{loss[1] / loss[0]:.2f}"
        note = "" if status is None else f" ({status})"
        if not seeds:
            print(f"| {m} | {s} | {e} | {status} | | | | | | | | 0 |")
            continue
        print(f"| {m} | {s} | {e} | {pm_sd(gm.get('acc'), spread['acc'])} | {pct(gm.get('many'))} | "
              f"{pct(gm.get('medium'))} | {pm_sd(gm.get('few'), spread['few'])} | {pct(pm.get('acc'))} | {lost} | "
              f"{r} | {seeds}{note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/dp-tail")))
