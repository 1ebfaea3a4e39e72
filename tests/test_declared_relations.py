"""Bad input drawn from the declared relations between settings (``fedlt.config.RELATIONS``, made with
:func:`fedlt.decl.applies_when` / ``requires`` / ``excludes``), as test_declared_inputs does for each setting: for
every relation, a configuration that breaks it (its declared ``bad`` examples), on the command line or in a TOML
run config, must end with exit status 2, one line naming the setting, no traceback, and nothing written; and the
ConfigError of :func:`fedlt.config.load_config` is that one line. Then the other causes of issue 42 item 5: type
holes, tracebacks, one-line fixes and the progress bar.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from fedlt.config import FAST_RUN, RELATIONS, load_config  # noqa: E402
from fedlt.decl import Relation, check_relations, is_set  # noqa: E402
from fedlt.engine.faults import RELATIONS as TIMING, check_settings  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402
from test_declared_inputs import FAST, command_of, refused, run_cli, toml_of  # noqa: E402

DECLARED = RELATIONS + TIMING
WITH_EXAMPLES = [r for r in DECLARED if r.bad]


def _names(r: Relation) -> tuple[str, ...]:
    out = []
    for n in (r.setting, *r.others):
        out += [n, n.replace("_", "-"), n.replace("_", " ")]
    return tuple(out) + (("partition",) if r.setting == "partition_args" else ())


def _argv(over: dict) -> list[str]:
    out = []
    for k, v in over.items():
        if k == "params":
            for pk, pv in v.items():
                out += ["--set", f"{pk}={pv}"]
        elif isinstance(v, bool):
            out.append("--" + k.replace("_", "-"))
        else:
            out.append(f"--{k.replace('_', '-')}={v}")
    return out


def _toml(over: dict) -> str:
    lines, tables = [], []
    for k, v in over.items():
        if k == "params":
            tables.append("[params]\n" + "".join(f"{json.dumps(pk)} = {toml_of(pv)}\n" for pk, pv in v.items()))
        else:
            lines.append(f"{k} = {toml_of(v)}\n")
    return "".join(lines) + "".join(tables)


def test_every_relation_is_declared_with_a_message_and_most_with_an_example():
    assert len(DECLARED) >= 20
    for r in DECLARED:
        assert r.kind in ("applies only when", "requires", "excludes") and r.text()
    # the relations without an example need a GPU or a method of a kind (fp16, cuda graphs) or a file
    assert len(WITH_EXAMPLES) >= len(DECLARED) - 5, [r.text() for r in DECLARED if not r.bad]


@pytest.mark.parametrize("r", WITH_EXAMPLES, ids=[f"{i}-{r.setting}" for i, r in enumerate(WITH_EXAMPLES)])
@settings(max_examples=2, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_breaking_each_relation_is_one_line_and_writes_nothing(r, data):
    over = data.draw(st.sampled_from(r.bad), label="bad")
    channel = data.draw(st.sampled_from(["cli", "toml", "api"]), label="channel")
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        if channel == "api":  # the ConfigError itself: one line, naming the setting
            with pytest.raises(ConfigError) as e:  # the engine's relations: checked as a run is prepared
                check_settings(load_config(None, {**FAST_RUN, "out": str(t / "runs"), **over}))
            assert "\n" not in str(e.value) and any(n in str(e.value) for n in _names(r)), str(e.value)
            assert not any(t.iterdir())
            return
        fast = [a for a in FAST if a != "--no-progress"] + ["--no-progress"]
        if channel == "cli":
            argv = ["run", *fast, "--out", str(t / "runs"), "--name", "r", *_argv(over)]
            code, err = run_cli(argv, tmp)
            refused("cli", code, err, t, set(), *_names(r))
            return
        (t / "c.toml").write_text(_toml(over))
        keep = []  # the file's settings must count: the command line's same settings go
        skip = False
        for i, a in enumerate(fast):
            if skip:
                skip = False
                continue
            if a.lstrip("-").replace("-", "_") in over:
                skip = i + 1 < len(fast) and not fast[i + 1].startswith("--")
                continue
            keep.append(a)
        code, err = run_cli(["run", "--config", str(t / "c.toml"), *keep, "--out", str(t / "runs"), "--name", "r"],
                            tmp)
        refused("toml", code, err, t, {"c.toml"}, *_names(r))


def test_a_restated_default_or_a_presets_value_is_not_a_given_setting():
    """A relation about an ignored setting fires for what the user set, not for a default written out (a Flower
    run config, RunConfig.to_dict()) nor for what a preset states."""
    cfg = load_config(None, {**FAST_RUN, "availability": "0.5", "availability_mean": 0.5, "over_select": 1.0})
    assert not is_set(cfg, "availability_mean") and is_set(cfg, "availability")
    load_config(None, {"preset": "feddr-cifar10"})  # the paper's alpha on its shards partition: the paper's
    with pytest.raises(ConfigError, match="--alpha applies"):
        load_config(None, {"preset": "feddr-cifar10", "alpha": 0.3})
    check_relations(cfg, DECLARED)


# ------------------------------------------------------------------------------------------- the other causes
def _one_line(tmp, argv, *inputs):
    code, err = run_cli(argv, tmp)
    refused("other", code, err, Path(tmp), set(inputs), command=command_of(argv))
    return err.strip()


@pytest.mark.parametrize("body,words", [('drop_rate = "0.3"', "drop-rate expects a number"),
                                        ('round_deadline = "10"', "round-deadline expects a number"),
                                        ('balance = "true"', "balance expects true or false")])
def test_numbers_written_as_text_in_toml_are_refused(tmp_path, body, words):
    (tmp_path / "c.toml").write_text(body + "\n")
    line = _one_line(tmp_path, ["run", "--config", str(tmp_path / "c.toml"), *FAST, "--out", str(tmp_path / "r")],
                     "c.toml")
    assert words in line and "without quotes" in line


@pytest.mark.parametrize("speeds,words", [([True, 1, 1, 1], "client 0's speed is true"),
                                          (["2", 1, 1, 1], "client 0's speed is \"2\""),
                                          ([1, 1e-320, 1, 1], "client 1's speed is 1e-320")])
def test_speed_files_hold_numbers_in_range(tmp_path, speeds, words):
    (tmp_path / "s.json").write_text(json.dumps(speeds))
    line = _one_line(tmp_path, ["run", *FAST, "--speed-file", str(tmp_path / "s.json"), "--out",
                                str(tmp_path / "r")], "s.json")
    assert words in line, line


@pytest.mark.parametrize("args,words", [
    (["--drop-rate", "1"], "nothing trains"), (["--round-deadline", "1e-30"], "use at least"),
    (["--availability", "1e-300"], "nothing would train"), (["--tracker="], "names nothing"),
    (["--tracker", "none,tensorboard"], "cannot go with tensorboard"), (["--set", "mu=1", "--set", "mu=2"], "twice"),
    (["--client-state-memory", "1XB"], "GiB"), (["--eval-clients", "50"], "use at most 4"),
    (["--over-select", "2", "--participation", "1.0"], "drop it"),
])
def test_settings_that_cannot_train_or_are_ignored_are_one_line_with_a_fix(tmp_path, args, words):
    line = _one_line(tmp_path, ["run", *FAST, "--out", str(tmp_path / "r"), "--method", "fedprox", *args])
    assert words in line, line


def test_a_missing_data_dir_says_how_to_fetch_and_where_to_point(tmp_path):
    line = _one_line(tmp_path, ["run", "--dataset", "cifar10", "--data-dir", str(tmp_path / "new"), *FAST[2:],
                                "--out", str(tmp_path / "r")])
    assert f"fedlt data fetch cifar10 --data-dir {tmp_path / 'new'}" in line and "give the folder" in line


@pytest.mark.parametrize("argv,words", [
    (["superlink", "--port", "99999"], "--port"), (["supernode", "--superlink", "nonsense", "--partition-id", "0"],
                                                   "HOST:PORT"),
    (["supernode", "--superlink", "127.0.0.1:9092", "--partition-id", "-1"], "--partition-id"),
    (["inprocess", "--round-timeout", "-1"], "--round-timeout"), (["inprocess", "--round-timeout", "nan"], "nan"),
])
def test_flower_commands_refuse_bad_numbers_in_one_line(tmp_path, argv, words):
    pytest.importorskip("flwr")
    code, err = run_cli(["flower", *argv], tmp_path)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0], err[-500:]


def test_flower_app_dir_naming_a_file_is_one_line(tmp_path):
    pytest.importorskip("flwr")
    (tmp_path / "f").write_text("")
    line = _one_line(tmp_path, ["flower", "app", "--app-dir", str(tmp_path / "f"), *FAST[:-1], "--no-progress",
                                "--out", str(tmp_path / "r")], "f")
    assert "is a file" in line


def test_flower_settings_refuse_nan_and_negative_timeouts():
    from fedlt.config import RunConfig
    from fedlt.flower.settings import to_run_config

    for bad in (-1, float("nan"), "x"):
        with pytest.raises(ConfigError, match="round-timeout"):
            to_run_config(RunConfig(), round_timeout=bad)


def test_hf_folders_missing_keys_and_one_class_sets_are_one_line(tmp_path):
    datasets = pytest.importorskip("datasets")
    from fedlt.data.hf import load_hf
    from fedlt.errors import DataError

    d = datasets.DatasetDict({s: datasets.Dataset.from_dict({"x": [[0.0, 1.0]] * n, "label": [0] * n})
                              for s, n in (("train", 8), ("test", 4))})
    d.save_to_disk(str(tmp_path / "one"))
    with pytest.raises(DataError, match="holds 1 class"):
        load_hf(str(tmp_path / "one"), image_column="x")
    (tmp_path / "one" / "dataset_dict.json").write_text("{}")
    with pytest.raises(DataError, match="lacks the key 'splits'"):
        load_hf(str(tmp_path / "one"))


def test_flwr_partition_arguments_of_the_wrong_type_name_the_argument():
    pytest.importorskip("flwr_datasets")
    for args, words in (({"partition.alpha": "abc"}, "partition.alpha expects a list or a number"),
                        ({"partition.alpha": "0.5", "partition.min_partition_size": "abc"},
                         "partition.min_partition_size expects an int")):
        with pytest.raises(ConfigError, match=words):
            load_config(None, {**FAST_RUN, "partition": "flwr:DirichletPartitioner", "params": args})


def test_a_progress_bar_into_a_file_is_not_redrawn_each_round():
    import io
    import sys

    from fedlt.engine.driver import _progress

    old, sys.stderr = sys.stderr, io.StringIO()
    try:
        bar = _progress(50, 0, True)
        for _ in range(50):
            bar.update(1)
            bar.set_postfix({"loss": "1.0"})
        bar.close()
        text = sys.stderr.getvalue()
    finally:
        sys.stderr = old
    assert text.count("\r") <= 4, text
