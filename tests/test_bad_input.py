"""Bad input, generated: random flags and random TOML configs end with exit status 0 (a complete run
directory), 2 (one line on stderr, no run directory) or 3 (a diverged run, recorded) -- never a traceback,
never a half-written run directory. Plus the malformed data files and an output folder that cannot be
written, one case each.

The property-based tests run the command in-process (no interpreter start per example) on fast settings
(digits or the synthetic set, 1-2 rounds, a handful of clients), so that the examples which are valid train
for real in well under a second. Their numbers of examples are bounded (``derandomize``: the same examples on
every run) and printed with ``pytest -s``.
"""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from fedlt.cli import main as cli_main  # noqa: E402
from fedlt.data.datasets import load_dataset  # noqa: E402
from fedlt.errors import DataError  # noqa: E402

FAST = {"dataset": "digits", "clients": 4, "rounds": 1, "local_epochs": 1, "eval_every": 1, "batch_size": 32}
EXAMPLES = {k: int(os.environ.get("FEDLT_FUZZ_EXAMPLES", n)) for k, n in {"flags": 70, "toml": 50}.items()}
SEEN: dict[str, dict[int, int]] = {"flags": {}, "toml": {}}


def fuzz(kind: str):
    return settings(max_examples=EXAMPLES[kind], deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))

# values a user might type by mistake: wrong type, out of range, non-finite, huge, empty, unicode
JUNK = ["", " ", "-1", "0", "-0.0", "nan", "inf", "-inf", "1e308", "1e-320", "99999999999999999999999", "1.5",
        "2.5", "abc", "ü", "日本", "💥", "0x10", "1_000", "None", "true", "[1]", "--", "=", "\x00"]


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``fedlt ARGV`` in this process: (exit status, stderr). An exception escaping the CLI fails the test."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli_main(argv)
        except SystemExit as e:  # argparse
            code = e.code
    return int(code), err.getvalue()


def check_outcome(code: int, stderr: str, run_dir: Path, kind: str) -> None:
    SEEN[kind][code] = SEEN[kind].get(code, 0) + 1
    assert "Traceback" not in stderr, stderr
    assert code in (0, 2, 3), (code, stderr)
    if code == 2:
        errors = [line for line in stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and stderr.strip().endswith(errors[0].strip()), stderr
        assert not run_dir.exists(), f"bad input left {sorted(p.name for p in run_dir.iterdir())}"
        return
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == ("finished" if code == 0 else "diverged")
    want = {"config.json", "partition.json", "metrics.jsonl", "summary.json"}
    want |= {"final_state.safetensors"} if code == 0 else set()
    assert want <= {p.name for p in run_dir.iterdir()}, sorted(p.name for p in run_dir.iterdir())
    assert not list(run_dir.glob("*.tmp"))


# ------------------------------------------------------------------------------------------- flags
def _valid(values):
    return st.sampled_from([str(v) for v in values])


def _junk():
    return st.one_of(st.sampled_from(JUNK), st.text(max_size=6),
                     st.integers(-10**25, 10**25).map(str), st.floats().map(repr))


# flag -> values that are fine (chosen so that a valid run stays fast)
FLAGS = {
    "--rounds": [1, 2], "--clients": [2, 3, 5], "--participation": [0.5, 1.0, 2, 1], "--lr": [0.01, 0.1],
    "--momentum": [0.0, 0.5], "--weight-decay": [0.0, 1e-4], "--batch-size": [1, 16, 10**6],
    "--local-epochs": [0, 1], "--eval-every": [1, 3, 10**6], "--seed": [0, 7, 2**40], "--alpha": [0.1, 1, 1e6],
    "--imbalance-ratio": [1, 10, 1e9], "--partition": ["dirichlet", "iid", "shards", "tau"],
    "--shards-per-client": [1, 2], "--tau": [1.0, 2.0], "--min-client-size": [0, 1],
    "--lt-profile": ["exp", "step"], "--tail-classes": [0, 3, 10], "--n-max": [1, 50, 10**9],
    "--dataset": ["digits", "synthetic"], "--model": ["mlp", "smallcnn", "smallcnn-bn"],
    "--method": ["fedavg", "fedprox", "fedbn", "fedper", "local"], "--split": ["fedloge", "fixed"],
    "--device": ["cpu"], "--on-diverge": ["stop", "continue"], "--diverge-factor": [0, 100],
    "--set": ["mu=0.1", "mu=0"], "--preset": ["smoke", "fmnist-lt"], "--precision": ["fp32", "bf16"],
    "--client-parallel": ["auto", "off", "2"], "--data-placement": ["auto", "host", "device"],
    "--channels-last": ["auto", "off"],
}


@st.composite
def flag_lists(draw):
    chosen = draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=4, unique=True))
    argv = []
    for flag in chosen:
        argv += [flag, draw(st.one_of(_valid(FLAGS[flag]), _junk()))]
    if draw(st.booleans()):
        argv.append(draw(st.sampled_from(["--bogus", "--rounds", "-x", "extra", "--set"])))
    return argv


@fuzz("flags")
@given(flag_lists())
def test_random_flags_exit_0_2_or_3_never_a_traceback(argv):
    with tempfile.TemporaryDirectory() as tmp:
        base = ["run", "--out", tmp, "--name", "r", "--no-progress", "--threads", "1"]
        fast = [x for k, v in FAST.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        if "--preset" in argv:  # a preset sets the dataset and rounds: keep them fast here too
            fast += ["--rounds", "1", "--dataset", "digits"]
        code, err = run_cli(base + fast + argv)
        check_outcome(code, err, Path(tmp) / "r", "flags")


# ------------------------------------------------------------------------------------------- TOML
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def _toml_key(k: str) -> str:
    return k if k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k) else json.dumps(k)


SCALARS = st.one_of(st.sampled_from([-1, 0, 1, 2, 0.5, 1.5, -0.0, 10**6 + 1, 2**63 - 1, -(2**63), float("nan"),
                                     float("inf"), True, "", "digits", "x", "ü", "💥"]),
                    st.text(max_size=5), st.floats(width=32))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=3), SCALARS, max_size=2))
KEYS = st.sampled_from(["rounds", "clients", "lr", "alpha", "participation", "imbalance_ratio", "batch_size",
                        "local_epochs", "seed", "method", "dataset", "model", "partition", "params", "preset",
                        "eval_every", "momentum", "device", "on_diverge", "n_max", "split", "out", "name"])


# values a config file may hold that make a valid, fast run (so the valid share of the generated files does not
# hinge on hypothesis's choices: it also draws constants from every loaded module of the package, so any change
# elsewhere changes which files it makes)
TOML_VALID = {"rounds": [1, 2], "clients": [2, 3, 5], "lr": [0.01, 0.1], "alpha": [0.1, 1.0],
              "participation": [0.5, 1.0, 2], "seed": [0, 7], "momentum": [0.0, 0.5], "method": ["fedavg", "fedprox"],
              "partition": ["dirichlet", "iid"], "split": ["fedloge", "fixed"]}


@st.composite
def toml_files(draw) -> tuple[bytes, dict]:
    """(file content, the settings it fixes). Mostly FAST with some entries replaced or added."""
    shape = draw(st.sampled_from(["perturbed"] * 8 + ["valid"] * 2 + ["empty", "bytes", "truncated"]))
    if shape == "empty":
        return b"", {}
    if shape == "valid":  # FAST with a few settings changed to other values that are fine: runs that train
        d = dict(FAST)
        for k in draw(st.lists(st.sampled_from(sorted(TOML_VALID)), min_size=1, max_size=3, unique=True)):
            d[k] = draw(st.sampled_from(TOML_VALID[k]))
        return "".join(f"{k} = {_toml_value(v)}\n" for k, v in d.items()).encode(), d
    if shape == "bytes":
        return draw(st.binary(max_size=40)), {}
    d: dict = dict(FAST)
    for k in draw(st.lists(st.one_of(KEYS, st.text(max_size=6)), min_size=1, max_size=3, unique=True)):
        d[k] = draw(VALUES)
    if draw(st.booleans()):
        d["params"] = draw(st.dictionaries(st.sampled_from(["mu", "nu", "ü"]), SCALARS, max_size=2))
    tables = {k: v for k, v in d.items() if isinstance(v, dict)}
    text = "".join(f"{_toml_key(k)} = {_toml_value(v)}\n" for k, v in d.items() if k not in tables)
    text += "".join(f"[{_toml_key(k)}]\n" + "".join(f"{_toml_key(a)} = {_toml_value(b)}\n" for a, b in v.items())
                    for k, v in tables.items())
    data = text.encode()
    if shape == "truncated":  # whatever is left, the command line sets the fast settings (it overrides the file)
        return data[: draw(st.integers(0, len(data)))], {}
    return data, d


@fuzz("toml")
@given(toml_files())
def test_random_toml_configs_exit_0_2_or_3_never_a_traceback(case):
    data, fixed = case
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.toml"
        cfg.write_bytes(data)
        out = Path(tmp) / "runs"
        # the command line sets out/name, and the fast settings the file does not set (it overrides the file)
        argv = ["run", "--config", str(cfg), "--out", str(out), "--name", "r", "--no-progress", "--threads", "1"]
        argv += [x for k, v in FAST.items() if k not in fixed for x in (f"--{k.replace('_', '-')}", str(v))]
        code, err = run_cli(argv)
        check_outcome(code, err, out / "r", "toml")


def test_generated_cases_reached_both_valid_runs_and_errors():
    """The generators are not degenerate: each property test met real runs (0) and rejected input (2).
    Prints how many examples each generated, by exit status (``pytest -s``)."""
    if not SEEN["flags"] or not SEEN["toml"]:
        pytest.skip("run together with the two property-based tests")
    for kind in ("flags", "toml"):
        print(f"\n{kind}: {sum(SEEN[kind].values())} examples, by exit status {dict(sorted(SEEN[kind].items()))}")
        assert SEEN[kind].get(0, 0) >= 3 and SEEN[kind].get(2, 0) >= 10, SEEN[kind]


# ------------------------------------------------------------------------------------------- data files
def _idx(data: np.ndarray, magic_type: int = 0x08) -> bytes:
    return struct.pack(">HBB", 0, magic_type, data.ndim) + struct.pack(">" + "I" * data.ndim, *data.shape) + \
        data.astype(np.uint8).tobytes()


def _mnist_dir(root: Path, n=20, labels=None, n_labels=None, images_raw=None, labels_raw=None) -> Path:
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    y = np.arange(n) % 10 if labels is None else labels
    files = {"train-images-idx3-ubyte": images_raw or _idx(rng.integers(0, 255, (n, 28, 28))),
             "train-labels-idx1-ubyte": labels_raw or _idx(y[: n_labels or n]),
             "t10k-images-idx3-ubyte": _idx(rng.integers(0, 255, (10, 28, 28))),
             "t10k-labels-idx1-ubyte": _idx(np.arange(10))}
    for name, raw in files.items():
        (root / (name + ".gz")).write_bytes(gzip.compress(raw))
    return root


@pytest.mark.parametrize("case,needle", [
    ("truncated gzip", "corrupt idx file"),
    ("wrong magic", "bad magic"),
    ("label out of range", "labels outside 0..9 (found 0..12)"),
    ("count mismatch", "disagree in length"),
    ("images where labels belong", "holds a 3-D array where 1-D labels belong"),
])
def test_malformed_idx_files_are_one_line_data_errors(tmp_path, case, needle):
    good = _mnist_dir(tmp_path / "good")
    assert len(load_dataset("mnist", str(good)).y_train) == 20  # the writer makes loadable files
    d = tmp_path / "bad"
    if case == "truncated gzip":
        _mnist_dir(d)
        f = d / "train-images-idx3-ubyte.gz"
        f.write_bytes(f.read_bytes()[: -30])
    elif case == "wrong magic":
        _mnist_dir(d, images_raw=_idx(np.zeros((20, 28, 28)), magic_type=0x0D))
    elif case == "label out of range":
        _mnist_dir(d, labels=np.array([0, 1, 12] + [2] * 17))
    elif case == "count mismatch":
        _mnist_dir(d, n_labels=19)
    else:
        _mnist_dir(d, labels_raw=_idx(np.zeros((20, 28, 28))))
    with pytest.raises(DataError) as e:
        load_dataset("mnist", str(d))
    assert needle in str(e.value) and "\n" not in str(e.value)
    code, err = run_cli(["run", "--dataset", "mnist", "--data-dir", str(d), "--out", str(tmp_path / "runs"),
                         "--no-progress"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err
    assert not (tmp_path / "runs").exists()


def test_output_folder_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "runs"  # below a regular file: no one can create it, root included
    code, err = run_cli(["run", "--out", str(out), "--name", "r", "--no-progress", "--threads", "1",
                         *[x for k, v in FAST.items() for x in (f"--{k.replace('_', '-')}", str(v))]])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "cannot write" in err and "choose another --out" in err


@pytest.mark.parametrize("figures", [[], ["--no-figures"]])
def test_report_on_a_metrics_file_with_a_garbage_line_is_one_line(tmp_path, figures):
    """A damaged metrics.jsonl (a line that is not JSON, not the last one cut short by a kill) is one line naming
    the file and the line, with or without figures, and no report is written; the same run reports once
    repaired."""
    runs = tmp_path / "runs"
    code, err = run_cli(["run", "--out", str(runs), "--name", "r", "--no-progress", "--threads", "1",
                         *[x for k, v in FAST.items() for x in (f"--{k.replace('_', '-')}", str(v))]])
    assert code == 0, err
    f = runs / "r" / "metrics.jsonl"
    good = f.read_text().splitlines()
    assert len(good) >= 2
    f.write_text("\n".join([good[0], "{garbage", *good[1:]]) + "\n")
    code, err = run_cli(["report", str(runs / "r"), *figures])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "metrics.jsonl line 2 is not a JSON record" in err, err
    assert not (runs / "r" / "report").exists()
    f.write_text("\n".join(good) + "\n")
    code, err = run_cli(["report", str(runs / "r"), *figures])
    assert code == 0 and (runs / "r" / "report" / "table.md").is_file(), err


# ------------------------------------------------------------------------------------------- DP known before the run
DP_SAMPLE = ["--dp", "sample", "--dp-clip", "1"]
DP_CLIENT = ["--dp", "client", "--dp-clip", "1"]


@pytest.mark.parametrize("argv, says", [
    (DP_CLIENT + ["--dp-epsilon", "1e-6", "--dp-delta", "1e-5"], "nothing can train"),
    (DP_CLIENT + ["--dp-noise", "1", "--dp-budget", "0.001"], "below the first round's epsilon"),
    (DP_CLIENT + ["--dp-noise", "1", "--dp-delta", "0.25"], "is not below 1 / 4"),
    (DP_SAMPLE + ["--dp-epsilon", "1e-6"], "nothing can train"),  # solved (dp-accounting), then too noisy to train
    (DP_SAMPLE + ["--dp-noise", "40"], "nothing can train"),
    (DP_SAMPLE + ["--dp-noise", "1", "--dp-budget", "0.001"], "below the first round's epsilon"),
    (DP_SAMPLE + ["--dp-noise", "1", "--dp-delta", "0.05"], "--dp-delta 0.05 is not below 1 /"),
], ids=["client-epsilon", "client-budget", "client-delta", "sample-epsilon", "sample-noise", "sample-budget",
        "sample-delta"])
def test_dp_settings_that_cannot_run_are_refused_before_the_run_writes_anything(tmp_path, argv, says):
    """What DP can tell before the run (issue 55): a noise under which nothing trains, a --dp-budget the first round
    passes, a --dp-delta not below 1 / K (client level: the clients; sample level: the largest client's samples,
    known once the data is split) -- one line, exit 2, no run directory (before, some started, wrote a folder and
    trained 0 rounds or diverged)."""
    fast = [x for k, v in FAST.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    code, err = run_cli(["run", "--out", str(tmp_path), "--name", "r", "--no-progress", "--threads", "1", *fast,
                         "--model", "smallcnn", *argv])
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["--partition-file", "--method-file"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_file_option_is_refused_and_not_read_as_no_file(tmp_path, flag, value):
    """``--partition-file "$SPLIT"`` with $SPLIT unset: before, the empty path meant "no file" and the run went on
    with the default partition (or the built-in method) -- the user's clients silently replaced."""
    fast = [x for k, v in FAST.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    code, err = run_cli(["run", "--out", str(tmp_path), "--name", "r", "--no-progress", *fast, flag, value])
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and f"{flag} is empty" in lines[0], err
    assert not any(tmp_path.iterdir())
