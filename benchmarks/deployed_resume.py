"""The deployed resume table of issue 35: one method's final GM and PM (a) in the simulator, (b) deployed on a
SuperLink and SuperNodes on 127.0.0.1, uninterrupted, and (c) deployed with the SuperLink killed (-9, with every
process it started) after round ``--kill-after``, restarted on its database, and the run submitted again with
``--resume``. The SuperNodes keep their ``--state-dir`` throughout.

    python benchmarks/deployed_resume.py                     # Ditto, the issue's settings
    python benchmarks/deployed_resume.py --method fedloge --set sse_steps=200

Prints a Markdown table (GM and PM of the final evaluation, in %, and the largest per-client PM difference to
the simulator) and the interrupted ``fedlt flower run``'s last line and exit status. A few minutes: Flower starts
a process per message."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from flowercluster import Cluster  # noqa: E402


def final(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())["final"]


def headline(f: dict) -> tuple[float, float, list[float]]:
    g = next(iter(f["global"].values()))
    p = next(iter(f["personal"].values()))
    return 100 * g["acc"], 100 * p["acc"], p["per_client"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="ditto")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=3)
    ap.add_argument("--kill-after", type=int, default=3, help="kill the SuperLink once this round is logged")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    a = ap.parse_args()
    settings = ["--method", a.method, "--preset", "smoke", "--clients", str(a.clients), "--rounds", str(a.rounds),
                "--eval-every", str(a.eval_every), "--threads", "1", "--round-timeout", "300",
                *[x for s in a.set for x in ("--set", s)]]
    tmp = Path(tempfile.mkdtemp(prefix="fedlt-deployed-resume-"))
    rows = []
    t0 = time.monotonic()
    sim = tmp / "runs" / "sim"
    subprocess.run([sys.executable, "-m", "fedlt", "run", *[s for s in settings if s not in ("--round-timeout", "300")],
                    "--out", str(tmp / "runs"), "--name", "sim", "--no-progress"], check=True,
                   stdout=subprocess.DEVNULL)
    rows.append(("simulator, same settings", final(sim)))
    c = Cluster(tmp)
    interrupted = ("", None)
    try:
        c.up(a.clients, database=True, state_dirs=True)
        run = c.submit(*settings, name="whole", log="whole")
        assert run.wait(1800) == 0, c.log("whole")[-3000:]
        rows.append(("deployed, uninterrupted", final(tmp / "runs" / "whole")))
        run = c.submit(*settings, name="resumed", log="first")
        c.wait_for("first", f"round {a.kill_after}:")
        c.kill("superlink", tree=True)
        rc = run.wait(300)
        interrupted = ([x for x in c.log("first").splitlines() if x.strip()][-1], rc)
        c.start_superlink(database=True)
        run = c.submit(*settings, "--resume", name="resumed", log="second")
        assert run.wait(1800) == 0, c.log("second")[-3000:]
        rows.append((f"deployed, SuperLink killed (-9) after round {a.kill_after}, restarted on its database, "
                     f"`fedlt flower run ... --resume`", final(tmp / "runs" / "resumed")))
    finally:
        c.stop_all()
    _, _, ref = headline(rows[0][1])
    print(f"{a.method}: {' '.join(settings)}  ({time.monotonic() - t0:.0f} s)\n")
    print("| run | GM final | PM final | max per-client PM difference to the simulator |")
    print("| --- | ---: | ---: | ---: |")
    for label, f in rows:
        gm, pm, per = headline(f)
        print(f"| {label} | {gm:.2f} | {pm:.2f} | {max(abs(x - y) for x, y in zip(per, ref)):.4f} |")
    print(f"\ninterrupted `fedlt flower run`: exit status {interrupted[1]}; last line: {interrupted[0]}")
    if a.keep:
        print(f"kept {tmp}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
