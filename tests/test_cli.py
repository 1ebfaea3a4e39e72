"""The command line: a real run writes its run directory; bad input is one line, exit 2, nothing written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def fedlt(*args, cwd=None, env=None):
    e = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "fedlt", *args], capture_output=True, text=True, cwd=cwd, env=e,
                          timeout=300)


def test_run_writes_run_directory_and_prints_gm_pm(tmp_path):
    r = fedlt("run", "--preset", "smoke", "--rounds", "4", "--eval-every", "2", "--out", str(tmp_path),
              "--name", "r1", "--no-progress", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "GM global" in r.stdout and "PM global (global model)" in r.stdout
    d = tmp_path / "r1"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dataset"] == "digits" and cfg["rounds"] == 4 and cfg["model"] == "smallcnn"
    part = json.loads((d / "partition.json").read_text())
    assert sum(map(sum, part["client_class_counts"])) == sum(part["train_counts"])
    lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines if "round" in x] == [1, 2, 3, 4]
    assert sum("eval" in x for x in lines) == 2 and "final" in lines[-1]
    summary = json.loads((d / "summary.json").read_text())
    assert 0 <= summary["final"]["global"]["global"]["acc"] <= 1
    assert (d / "final_state.safetensors").is_file()


def test_config_file_with_command_line_override(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('method = "fedprox"\ndataset = "digits"\nrounds = 3\nclients = 5\n[params]\nmu = 0.5\n')
    r = fedlt("run", "--config", str(cfg), "--rounds", "2", "--imbalance-ratio", "5", "--out", str(tmp_path),
              "--name", "c", "--no-progress", "--eval-every", "2")
    assert r.returncode == 0, r.stderr
    saved = json.loads((tmp_path / "c" / "config.json").read_text())
    assert saved["rounds"] == 2 and saved["method"] == "fedprox" and saved["method_params"]["mu"] == 0.5


@pytest.mark.parametrize("args,needle", [
    (["--method", "fedavgg"], "unknown method 'fedavgg' (did you mean 'fedavg'?)"),
    (["--imbalance-ratio", "0.01"], "did you mean 100"),
    (["--alpha", "0"], "alpha must be > 0"),
    (["--clients", "100000"], "use fewer clients"),
    (["--dataset", "mnist", "--data-dir", "EMPTY"], "not found"),
    (["--method", "fedprox", "--set", "nu=1"], "has no parameter 'nu'"),
    (["--participation", "30", "--clients", "10"], "exceeds the 10 clients"),
    (["--config", "MISSING.toml"], "not found"),
    (["--precision", "fp16"], "fp16 needs a CUDA device"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "nonsense"], "device"),
    (["--client-parallel", "0"], "client-parallel must be auto, off or a number of clients >= 1"),
    (["--cuda-graphs"] if not torch.cuda.is_available() else ["--cuda-graphs", "--client-parallel", "off"],
     "--cuda-graphs"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, needle):
    args = [a.replace("EMPTY", str(tmp_path / "empty")) for a in args]
    (tmp_path / "empty").mkdir()
    out = tmp_path / "runs"
    r = fedlt("run", "--preset", "smoke", *args, "--out", str(out), "--no-progress", env={"FEDLT_DATA": ""})
    assert r.returncode == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert needle in err
    assert not out.exists()


def test_list_names_methods_datasets_models_partitions():
    r = fedlt("list")
    assert r.returncode == 0
    for word in ("fedavg", "fedprox", "fashion-mnist", "cifar100", "resnet18", "dirichlet", "tau"):
        assert word in r.stdout


def rendered(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: a carriage return moves back to the start of the line, and what
    follows overwrites what was there (it does not clear the rest)."""
    lines = []
    for raw in text.split("\n"):
        buf: list[str] = []
        for i, part in enumerate(raw.split("\r")):
            for col, ch in enumerate(part):
                if col < len(buf):
                    buf[col] = ch
                else:
                    buf.append(ch)
        lines.append("".join(buf).rstrip())
    return lines


def test_an_error_after_a_progress_bar_starts_on_a_line_of_its_own(tmp_path):
    """A run that diverges while its progress bar is shown: the bar's line is cleared, and the one-line error
    starts a line of its own (it used to be printed at the end of the bar's line)."""
    import contextlib
    import io

    from fedlt.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["run", "--method", "fedavg", "--dataset", "digits", "--lr", "50", "--rounds", "4",
                     "--eval-every", "4", "--diverge-factor", "100", "--threads", "1", "--out", str(tmp_path)])
    text = err.getvalue()
    assert code == 3 and "rounds:" in text and "\r" in text  # the bar was drawn
    (line,) = [x for x in rendered(text) if "fedlt: error:" in x]
    assert line.startswith("fedlt: error: run diverged in round"), line
