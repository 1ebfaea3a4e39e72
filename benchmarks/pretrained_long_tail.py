"""Pre-trained models on the long tail (issue 56 item 6, docs/pretrained-long-tail.md): the fmnist-lt protocol
(Fashion-MNIST, rho 100, Dirichlet 0.5, 20 clients) trained from scratch (``smallcnn``) against EfficientNet-Lite0
(ImageNet weights, fed ``--pretrained-size`` px) under ``--finetune full``, ``head`` and ``lora``, for each method
and seed; then one table: GM and its many / medium / few accuracy, PM (each the mean of the last 3 evaluations,
mean ± sample std over the seeds that finished), many - few, MB sent up per client per round and seconds per round
(the median of the run's rounds; round 1 of ``head`` apart, as it encodes its clients' samples).

Each run is ``fedlt run`` in its own process, in OUT/MODE/METHOD/seedN; a finished run is not run again, so a
stopped grid continues where it stopped. The default is the whole grid at the protocol's 50 rounds (days on a CPU
for ``full`` and ``lora``; hours on a GPU); flags select a part of it::

    python benchmarks/pretrained_long_tail.py                                  # the whole grid, then the table
    python benchmarks/pretrained_long_tail.py --modes head --rounds 20         # a part of it
    python benchmarks/pretrained_long_tail.py --table-only --out DIR           # the table of the runs in DIR

``--lr`` is the local learning rate of every mode but ``full``, ``--lr-full`` full fine-tuning's (the protocol's
0.05 collapsed EfficientNet-Lite0 to one class on the smoke preset, docs/pretrained.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("smallcnn", "head", "lora", "full")
METHODS = ("fedavg", "fedloge", "balancefl", "creff", "fedrod")


def run_args(mode: str, method: str, seed: int, a: argparse.Namespace) -> list[str]:
    """The ``fedlt run`` options of one cell of the grid."""
    args = ["--dataset", "fashion-mnist", "--method", method, "--seed", str(seed), "--rounds", str(a.rounds),
            "--participation", str(a.participation), "--eval-every", str(a.eval_every), "--threads", str(a.threads),
            "--no-progress", "--lr", str(a.lr_full if mode == "full" else a.lr)]
    if mode == "smallcnn":
        return args + ["--model", "smallcnn"]
    return args + ["--model", "efficientnet-lite0", "--pretrained-size", str(a.size), "--finetune", mode]


def summary(run: Path) -> dict | None:
    f = run / "summary.json"
    return json.loads(f.read_text()) if f.exists() else None


def headline(last3: dict, side: str) -> dict:
    """The last-3 means of the first GM or PM mode a run reports: {acc, many, medium, few, mode}."""
    keys = [k for k in last3 if k.startswith(f"{side}[")]
    if not keys:
        return {}
    first = keys[0].split("]")[0] + "]"
    return {"mode": first[len(side) + 1:-1], **{k[len(first) + 1:]: v for k, v in last3.items() if k.startswith(first)}}


def final_gm(s: dict) -> dict:
    """The final evaluation's first global model (after any post-training phase: FedLoGe's GA-FR, CReFF's
    re-trained classifier): {acc, many, medium, few, mode}."""
    models = s.get("final", {}).get("global") or {}
    for mode, m in models.items():
        return {"mode": mode, **{k: m.get(k) for k in ("acc", "many", "medium", "few")}}
    return {}


def cell(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    if not values:
        return "-"
    m = f"{scale * statistics.mean(values):.{digits}f}"
    return m if len(values) < 2 else f"{m} ± {scale * statistics.stdev(values):.{digits}f}"


def round_times(run: Path) -> list[float]:
    f = run / "metrics.jsonl"
    if not f.exists():
        return []
    rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return [r["round_time"] for r in rows if "round_time" in r]


def table(out: Path, modes, methods) -> None:
    print("| model / --finetune | method | GM | many | medium | few | many - few | PM | final GM | final few "
          "| MB up / client / round | s / round (round 1) | rounds | seeds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        for method in methods:
            runs = sorted((out / mode / method).glob("seed*"))
            done = [(r, s) for r in runs if (s := summary(r)) and s.get("status") == "finished"]
            times = [round_times(r) for r in runs]
            later = [t for ts in times for t in ts[1:]]
            first = [ts[0] for ts in times if ts]
            cost = "-" if not first else (f"{statistics.median(later):.2f}" if later else "-") + \
                f" ({statistics.median(first):.1f})"
            mb = [s["bytes_per_round_per_client"]["up"] / 1e6 for _, s in done]
            rounds = sorted({json.loads((r / "config.json").read_text()).get("rounds") for r in runs
                             if (r / "config.json").exists()} - {None})
            rounds = ",".join(map(str, rounds)) or "-"
            label = "smallcnn (scratch)" if mode == "smallcnn" else f"efficientnet-lite0 / {mode}"
            if not done:
                why = f"not finished ({len(runs)} started)" if runs else "not run"
                print(f"| {label} | {method} | {why} | | | | | | | | | {cost} | {rounds} | 0 |")
                continue
            gm = [headline(s["last3"], "GM") for _, s in done]
            pm = [headline(s["last3"], "PM") for _, s in done]
            fin = [final_gm(s) for _, s in done]
            modes_of = lambda xs: "/".join(dict.fromkeys(x.get("mode", "-") for x in xs))  # noqa: E731
            name = method + ("" if {modes_of(gm), modes_of(pm), modes_of(fin)} == {"global"} else
                             f" (GM {modes_of(gm)}, PM {modes_of(pm)}, final GM {modes_of(fin)})")
            g = lambda key: [x[key] for x in gm if x.get(key) is not None]  # noqa: E731
            gap = [x["many"] - x["few"] for x in gm if x.get("many") is not None and x.get("few") is not None]
            print(f"| {label} | {name} | {cell(g('acc'))} | {cell(g('many'))} | {cell(g('medium'))} | "
                  f"{cell(g('few'))} | {cell(gap)} | {cell([x['acc'] for x in pm if 'acc' in x])} | "
                  f"{cell([x['acc'] for x in fin if x.get('acc') is not None])} | "
                  f"{cell([x['few'] for x in fin if x.get('few') is not None])} | "
                  f"{statistics.mean(mb):.3f} | {cost} | {rounds} | {len(done)} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "pretrained-long-tail")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated method names")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--participation", type=float, default=0.5)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--size", type=int, default=32, help="--pretrained-size: EfficientNet-Lite0's input, px")
    p.add_argument("--lr", type=float, default=0.05, help="local lr of smallcnn, head and lora")
    p.add_argument("--lr-full", type=float, default=0.01, help="local lr of --finetune full")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--table-only", action="store_true", help="print the table of the runs in --out, run nothing")
    a = p.parse_args()
    modes, methods = a.modes.split(","), a.methods.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"--modes: {', '.join(bad)} unknown; choose from {', '.join(MODES)}")
    if not a.table_only:
        fedlt = Path(sys.executable).with_name("fedlt")
        for seed in [int(s) for s in a.seeds.split(",")]:
            for mode in modes:
                for method in methods:
                    run = a.out / mode / method / f"seed{seed}"
                    if (s := summary(run)) and s.get("status") == "finished":
                        continue
                    cmd = [str(fedlt), "run", *run_args(mode, method, seed, a), "--out", str(run.parent),
                           "--name", run.name]
                    if (run / "config.json").exists():
                        cmd.append("--resume")
                    print("$", " ".join(cmd[1:]), flush=True)
                    subprocess.run(cmd, check=False)
    table(a.out, modes, methods)
    return 0


if __name__ == "__main__":
    sys.exit(main())
