#!/usr/bin/env bash
# Every GPU figure that issues 11 and 12 ask for, one file per part, into DIR (default gpu-results/):
#   gpu_tests.txt        python -m pytest -m gpu (the Flower test only where flwr is installed)
#   client_parallel.txt  batched vs one-after-another rounds, with and without CUDA graphs, peak memory
#   gpu.txt              engine vs plain loop, FedLoGe vs FedAvg (also as CUDA graphs), resnet18 bf16 vs fp32,
#                        15 runs with --jobs 15 vs one after another
#   smoke.txt            every method through `fedlt run --device cuda`, 2 rounds: exit status, GM, PM
#   determinism.txt      FedLoGe twice with --deterministic and twice without, same seed: metrics and times
# Each part is written as it finishes and DIR/DONE at the end, so the script can run in the background
# (setsid nohup bash benchmarks/gpu_all.sh DIR &) and be collected part by part. Needs CUDA and the
# Fashion-MNIST files (FEDLT_DATA); starts NVIDIA MPS for the parallel parts where it can.
#
#     bash benchmarks/gpu_all.sh [DIR] [PART ...]      # parts: tests parallel gpu smoke determinism
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
shift || true
parts=${*:-tests parallel gpu smoke determinism}
for part in $parts; do
    case $part in tests|parallel|gpu|smoke|determinism) ;;
    *) echo "benchmarks/gpu_all.sh: unknown part $part; choose from tests parallel gpu smoke determinism" >&2; exit 2 ;;
    esac
done
export PYTHONPATH=src PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "benchmarks/gpu_all.sh: no CUDA device here; run it on a machine with an NVIDIA GPU" >&2
    exit 2
fi
mkdir -p "$out"
rm -f "$out/DONE"
nvidia-cuda-mps-control -d 2>/dev/null && echo "NVIDIA MPS started" >>"$out/log.txt"
for part in $parts; do
    start=$(date +%s)
    case $part in
    tests)
        skip=()
        "$py" -c "import flwr" 2>/dev/null || skip=(-k "not flower")
        "$py" -m pytest -m gpu -q -p no:cacheprovider "${skip[@]}" >"$out/gpu_tests.txt" 2>&1 ;;
    parallel)
        "$py" benchmarks/client_parallel.py --device cuda --reps 3 --cases smallcnn,resnet8,resnet18 \
            >"$out/client_parallel.txt" 2>&1 ;;
    gpu)
        "$py" benchmarks/gpu.py --reps 3 >"$out/gpu.txt" 2>&1 ;;
    smoke)
        "$py" benchmarks/device_smoke.py --device cuda --jobs 8 >"$out/smoke.txt" 2>&1 ;;
    determinism)
        "$py" - >"$out/determinism.txt" 2>&1 <<'EOF'
import json, subprocess, sys, tempfile, time
from pathlib import Path

def run(tmp, name, det):
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fedlt", "run", "--method", "fedloge", "--device", "cuda", "--rounds", "10",
                    "--eval-every", "5", "--no-progress", "--out", tmp, "--name", name]
                   + (["--deterministic"] if det else []), check=True, capture_output=True)
    final = json.loads((Path(tmp) / name / "summary.json").read_text())["final"]
    accs = {f"{side}/{mode}": r["acc"] for side in ("global", "personal") for mode, r in final[side].items()}
    return accs, time.perf_counter() - t0

with tempfile.TemporaryDirectory() as tmp:
    res = {(det, i): run(tmp, f"{'det' if det else 'fast'}{i}", det) for det in (True, False) for i in (0, 1)}
for det in (True, False):
    (a, ta), (b, tb) = res[(det, 0)], res[(det, 1)]
    gap = max(abs(a[k] - b[k]) for k in a)
    print(f"{'--deterministic' if det else 'default        '}  run 1 {ta:6.1f} s  run 2 {tb:6.1f} s  "
          f"largest metric difference between the two runs {100 * gap:.4f} points")
    for k in a:
        print(f"    {k:<28} {100 * a[k]:7.3f} {100 * b[k]:7.3f}")
t_det = (res[(True, 0)][1] + res[(True, 1)][1]) / 2
t_fast = (res[(False, 0)][1] + res[(False, 1)][1]) / 2
print(f"--deterministic costs {t_det / t_fast:.2f}x the time of a default run (FedLoGe, fmnist-lt, 10 rounds)")
EOF
        ;;
    esac
    echo "$part: exit $? after $(( $(date +%s) - start )) s" >>"$out/log.txt"
done
touch "$out/DONE"
