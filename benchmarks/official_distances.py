"""How far each 2025-2026 method (issue 58) is from the code its authors released, as the official-code tests
measure it: runs those tests with ``FEDLT_DISTANCES`` set (tests/distances.py) and prints, per method, every
comparison and its largest absolute difference -- under the options that match the released code (float noise),
the defaults against the paper's equations, and the defaults against the released code (how far apart).

    python3 benchmarks/official_distances.py              # the tests' pass/fail line, then the table
    python3 benchmarks/official_distances.py --markdown   # the same as a Markdown table (docs/fmnist-lt-new-methods.md)
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
RELEASED = {  # the released files each method's tests write out, and the commit they were read at
    "fednpc": "JintongGao/FedNPC `FedAvg-FedNPC.py` @ 48ad8d1",
    "fedvls": "krumpguo/FedVLS `system/flcore/clients/clientvls.py`, `servers/servervls.py` @ 7d8163f",
    "fedrela": "guangzhengh/FedReLa `util/FedReLa.py`, `util/update_baseline.py` @ 20a58bd",
    "fedsam": "Huang-Yongzhi/NeurlPS_FedWMSAM `client/fedsam.py`, `optimizer/ESAM.py`, `server/FedSAM.py` @ a922a1d",
    "mofedsam": "Huang-Yongzhi/NeurlPS_FedWMSAM `client/mofedsam.py`, `optimizer/ESAM.py`, `server/MoFedSAM.py` "
                "@ a922a1d",
    "fedwmsam": "Huang-Yongzhi/NeurlPS_FedWMSAM `client/fedwmsam.py`, `optimizer/WMSAM.py`, `server/FedWMSAM.py` "
                "@ a922a1d",
    "ggeur": "WeiDai-David/2025CVPR_GGEUR `Single Domian/clip_image_tensor2aggregate_covariance_matrix.py`, "
             "`FL_MLP.py` @ 455832a",
}


def shown(row: dict) -> str:
    v = row["max_abs_diff"]
    return str(int(v)) if "labels that differ" in row["what"] else f"{v:.3g}"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "distances.jsonl"
        env = {**os.environ, "FEDLT_DISTANCES": str(out),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES], cwd=ROOT,
                             env=env, capture_output=True, text=True)
        print(run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr.strip())
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    names = list(dict.fromkeys(r["method"] for r in rows))
    if "--markdown" in sys.argv[1:]:
        print("\n| method (released code) | compared | largest difference |\n|---|---|---|")
        for name in names:
            for i, r in enumerate(x for x in rows if x["method"] == name):
                first = f"{name} ({RELEASED.get(name, '')})" if i == 0 else ""
                print(f"| {first} | {r['what']} | {shown(r)} |")
    else:
        width = max((len(r["what"]) for r in rows), default=10)
        for name in names:
            print(f"\n{name}: {RELEASED.get(name, '')}")
            for r in rows:
                if r["method"] == name:
                    print(f"  {r['what']:<{width}}  {shown(r)}")
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
