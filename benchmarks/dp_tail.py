"""What client-level DP costs the tail classes: the tables of docs/dp-tail.md from a finished sweep of
benchmarks/dp-tail.toml (``fedlt sweep benchmarks/dp-tail.toml``).

For each method and epsilon: GM and its many / medium / few accuracy (mean of the last 3 evaluations), PM, the
accuracy the many and the few classes lost against the method's run without DP (points), and the disparate-impact
ratio, few loss / many loss (above 1: DP takes more from the tail than from the head), given where the many
classes lost at least one point (a ratio over a smaller loss says nothing). With several seeds, each number is the
mean over the seeds that finished (the epsilon: the largest), and the last column says how many.

    python benchmarks/dp_tail.py [SWEEP_DIR]        # default runs/dp-tail
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SETTINGS = ("nodp", "eps8", "eps2", "eps2fixed")


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


def main(root: Path) -> int:
    methods = sorted({p.parent.name for p in root.glob("*/*/seed*")})
    rows = []
    for m in methods:
        base = None
        for s in SETTINGS:
            summs = [json.loads(f.read_text()) for f in sorted((root / s / m).glob("seed*/summary.json"))]
            if not summs:
                continue
            done = [x for x in summs if x.get("status") == "finished"]
            gm = mean_of([headline(x["last3"], "GM", None) for x in done])
            pm = mean_of([headline(x["last3"], "PM", None) for x in done])
            eps = max((x.get("dp", {}).get("epsilon") or 0.0 for x in done), default=None) if s != "nodp" else None
            if s == "nodp":
                base = gm
            loss = None
            if base and s != "nodp" and gm:
                loss = (base["many"] - gm["many"], base["few"] - gm["few"])
            status = None if done else summs[0].get("status")
            if status == "diverged":
                status = f"diverged in round {summs[0].get('diverged', {}).get('round')}"
            rows.append((m, s, eps, gm, pm, loss, status, len(done)))
    print("| method | DP | epsilon (delta 1e-5) | GM | many | medium | few | PM | many loss | few loss | few / many loss "
          "| seeds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    pct = lambda x: "-" if x is None else f"{100 * x:.2f}"  # noqa: E731
    for m, s, eps, gm, pm, loss, status, seeds in rows:
        e = "-" if eps is None else f"{eps:.2f}"
        lost = "- | -" if loss is None else f"{pct(loss[0])} | {pct(loss[1])}"
        r = "-" if loss is None or loss[0] < 0.01 else f"{loss[1] / loss[0]:.2f}"
        if status not in (None, "finished"):
            print(f"| {m} | {s} | {e} | {status} | | | | | | | | 0 |")
            continue
        print(f"| {m} | {s} | {e} | {pct(gm.get('acc'))} | {pct(gm.get('many'))} | {pct(gm.get('medium'))} | "
              f"{pct(gm.get('few'))} | {pct(pm.get('acc'))} | {lost} | {r} | {seeds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/dp-tail")))
