"""How far each 2025-2026 method (issue 58) is from the code its authors released, as the official-code tests
measure it: runs those tests with ``FEDLT_DISTANCES`` set (tests/distances.py) and prints, per method, every
comparison and its largest absolute difference -- under the options that match the released code (float noise),
the defaults against the paper's equations, and the defaults against the released code (how far apart).

    python3 benchmarks/official_distances.py            # the tests' pass/fail line, then the table
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_official_2026.py", "tests/test_official_sam.py", "tests/test_ggeur.py"]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "distances.jsonl"
        env = {**os.environ, "FEDLT_DISTANCES": str(out),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES], cwd=ROOT,
                             env=env, capture_output=True, text=True)
        print(run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr.strip())
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    width = max((len(r["what"]) for r in rows), default=10)
    for name in dict.fromkeys(r["method"] for r in rows):
        print(f"\n{name}")
        for r in rows:
            if r["method"] == name:
                v = r["max_abs_diff"]
                shown = str(int(v)) if v == int(v) and "labels" in r["what"] else f"{v:.3g}"
                print(f"  {r['what']:<{width}}  {shown}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
