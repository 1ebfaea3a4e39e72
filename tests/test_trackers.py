"""Experiment trackers (fedlt.runner.trackers) with the real libraries, offline: what MLflow, W&B and TensorBoard hold
is what metrics.jsonl holds, once per step, across a kill -9 and --resume; sweeps are grouped; a failing
tracker never stops a run; a tracker that is not installed is a one-line error before anything runs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from fedlt.cli import main as cli_main  # noqa: E402
from fedlt.config import load_config  # noqa: E402
from fedlt.runner.rundir import run  # noqa: E402
from fedlt.runner.trackers import wandb_records  # noqa: E402

from slowsite import slow_env  # noqa: E402

TINY = {"dataset": "digits", "imbalance_ratio": 10, "clients": 4, "alpha": 1.0, "rounds": 3, "eval_every": 1,
        "local_epochs": 1, "batch_size": 16, "model": "mlp", "participation": 0.5, "threads": 1}


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rounds(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if "round" in r]


def _mlflow(out: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    exp = client.get_experiment_by_name("fedlt")
    return client, client.search_runs([exp.experiment_id])


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


# what each round's record says, by hand (not through fedlt.runner.trackers.metrics_of)
EXPECTED = {
    "train_loss": lambda r: r["train_loss"],
    "lr": lambda r: r["lr"],
    "bytes_up_per_client": lambda r: r["bytes_up_per_client"],
    "missing": lambda r: len(r["missing"]),
    "clients": lambda r: len(r["clients"]),
    "sampled": lambda r: r["sampled"],  # the dropout counts (issue 34 item 3)
    "arrived": lambda r: r["arrived"],
    "eval/GM/global/acc": lambda r: r["eval"]["global"]["global"]["acc"],
    "eval/GM/global/few": lambda r: r["eval"]["global"]["global"]["few"],
    "eval/PM/global/acc": lambda r: r["eval"]["personal"]["global"]["acc"],
    "eval/PM/global/many": lambda r: r["eval"]["personal"]["global"]["many"],
    "eval/PM/global/medium": lambda r: r["eval"]["personal"]["global"]["medium"],
}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """One 3-round run sent to MLflow, W&B (offline) and TensorBoard at once."""
    out = tmp_path_factory.mktemp("tracked")
    cfg = load_config(None, {**TINY, "out": str(out), "name": "a", "tracker": "mlflow,wandb,tensorboard"})
    run(cfg, progress=False, echo=lambda *_: None)
    return out, out / "a"


def test_mlflow_holds_every_rounds_metrics_of_metrics_jsonl_with_settings_and_files(tracked):
    out, d = tracked
    client, runs = _mlflow(out)
    assert [r.info.run_name for r in runs] == ["a"]  # the run directory's name
    r = runs[0]
    assert r.info.status == "FINISHED"
    assert r.data.params["imbalance_ratio"] == "10.0" and r.data.params["method"] == "fedavg"
    assert r.data.params["clients"] == "4"
    rounds = _rounds(d)
    assert [x["round"] for x in rounds] == [1, 2, 3]
    for key, want in EXPECTED.items():
        assert _history(client, r.info.run_id, key) == [(x["round"], pytest.approx(want(x))) for x in rounds], key
    final = next(x["final"] for x in _records(d) if "final" in x)
    assert _history(client, r.info.run_id, "final/GM/global/acc") == [(3, pytest.approx(final["global"]["global"]["acc"]))]
    files = {f.path for f in client.list_artifacts(r.info.run_id)}
    assert {"config.json", "partition.json", "summary.json", "metrics.jsonl"} <= files
    part = json.loads(Path(client.download_artifacts(r.info.run_id, "partition.json", str(out / "dl"))).read_text())
    assert part == json.loads((d / "partition.json").read_text())


def _wandb_records(run_dir: Path) -> list:
    """The records of a run's (one) offline .wandb file, read with wandb's own protobuf classes, once W&B's
    service has written it to its end (``exit``: it writes after ``finish()`` returns)."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    _written(path)
    return wandb_records(path)


def _written(path: Path, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(path)) and time.time() < deadline:
        time.sleep(0.2)


def _wandb_rows(run_dir: Path) -> list[tuple[str, int, dict]]:
    """(offline folder, step, items) of every history row in the run's offline .wandb files."""
    rows = []
    paths = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    _written(paths[-1])  # the last session's (a killed one has no exit record)
    for path in paths:
        for r in wandb_records(path):
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                rows.append((path.parent.name, r.history.step.num, items))
    return rows


def test_wandb_offline_run_holds_every_rounds_metrics_and_the_settings(tracked):
    _, d = tracked
    recs = _wandb_records(d)
    kinds = [r.WhichOneof("record_type") for r in recs]
    (runrec,) = [r.run for r, k in zip(recs, kinds) if k == "run"]
    assert runrec.display_name == "a"
    assert json.loads((d / "trackers.json").read_text())["wandb"]["id"] == runrec.run_id
    steps = {step: items for _, step, items in _wandb_rows(d)}
    rounds = _rounds(d)
    assert sorted(steps) == [x["round"] for x in rounds]
    for x in rounds:
        for key, want in EXPECTED.items():
            assert steps[x["round"]][key] == pytest.approx(want(x)), (x["round"], key)
    config = {}
    for r, k in zip(recs, kinds):
        if k == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
    assert config["imbalance_ratio"] == 10.0 and config["method"] == "fedavg"
    summary = {}
    for r, k in zip(recs, kinds):
        if k == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update})
    final = next(x["final"] for x in _records(d) if "final" in x)
    assert summary["final/GM/global/acc"] == pytest.approx(final["global"]["global"]["acc"])
    files = {p.name for p in d.glob("wandb/offline-run-*/files/*")}
    assert {"partition.json", "summary.json", "metrics.jsonl"} <= files


def test_tensorboard_events_are_the_same_records(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, d = tracked
    ea = EventAccumulator(str(d / "tensorboard"))
    ea.Reload()
    for key, want in EXPECTED.items():
        assert [(e.step, e.value) for e in ea.Scalars(key)] == [(x["round"], pytest.approx(want(x), rel=1e-6))
                                                                for x in _rounds(d)], key


def test_kill_9_and_resume_continue_the_same_tracked_runs_without_a_step_twice(tmp_path):
    """Killed after round 4 was logged, with the last checkpoint after round 3: the resumed run trains round 4
    again, and MLflow's run (the same one) still holds each round once, equal to metrics.jsonl; so do W&B's
    offline files of the run (the killed process's and the resumed one's, one run id), whatever W&B had not
    written yet when the process was killed."""
    out = tmp_path / "runs"
    argv = [sys.executable, "-m", "fedlt", "run", "--dataset", "digits", "--rho", "10", "--clients", "4",
            "--alpha", "1", "--rounds", "6", "--eval-every", "1", "--local-epochs", "1", "--batch-size", "16",
            "--model", "mlp", "--threads", "1", "--out", str(out), "--name", "k", "--tracker", "mlflow,wandb",
            "--checkpoint-every", "3", "--no-progress"]
    d = out / "k"
    env = slow_env(tmp_path, 1.0)
    env.pop("WANDB_SERVICE", None)  # its own W&B service, killed with it (not this process's)
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and p.poll() is None:
            try:
                if json.loads((d / "trackers.json").read_text())["mlflow"]["records"] >= 4:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        assert p.poll() is None, p.stderr.read().decode()[-2000:]
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    client, runs = _mlflow(out)
    (before,) = runs
    assert before.info.status == "RUNNING"  # killed: nobody closed it
    assert [s for s, _ in _history(client, before.info.run_id, "train_loss")] == [1, 2, 3, 4]
    code = cli_main(argv[3:] + ["--resume"])
    assert code == 0
    client, runs = _mlflow(out)
    (after,) = runs
    assert after.info.run_id == before.info.run_id and after.info.status == "FINISHED"
    rounds = _rounds(d)
    assert [x["round"] for x in rounds] == [1, 2, 3, 4, 5, 6]
    for key, want in EXPECTED.items():
        assert _history(client, after.info.run_id, key) == [(x["round"], pytest.approx(want(x))) for x in rounds], key
    rows = _wandb_rows(d)
    # the killed session's folder and the resumed one's (one when both started in the same second, or when the
    # kill came before W&B wrote a row): together every round once, under the one run id
    assert {p.name.split("-")[-1] for p in d.glob("wandb/offline-run-*")} == {json.loads((d / "trackers.json").read_text())["wandb"]["id"]}
    assert sorted(step for _, step, _ in rows) == [1, 2, 3, 4, 5, 6]
    by_step = {step: items for _, step, items in rows}
    for x in rounds:
        assert by_step[x["round"]]["eval/GM/global/acc"] == pytest.approx(EXPECTED["eval/GM/global/acc"](x))


def test_sweep_runs_are_nested_under_one_mlflow_parent_and_one_wandb_group(tmp_path):
    from fedlt.api import sweep

    out = tmp_path / "tiny-sweep"
    sweep({"seeds": [0], "base": {**TINY, "rounds": 2, "tracker": ["mlflow", "wandb"]},
           "methods": ["fedavg", "fedprox"]}, out=str(out))
    client, runs = _mlflow(out)
    by_name = {r.info.run_name: r for r in runs}
    assert set(by_name) == {"tiny-sweep", "default/fedavg/seed0", "default/fedprox/seed0"}
    parent = by_name["tiny-sweep"]
    assert parent.info.status == "FINISHED"
    for name in ("default/fedavg/seed0", "default/fedprox/seed0"):
        assert by_name[name].data.tags["mlflow.parentRunId"] == parent.info.run_id
        recs = _wandb_records(out / name)
        (runrec,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
        assert runrec.run_group == "tiny-sweep" and runrec.display_name == name
    report = {f.path for f in client.list_artifacts(parent.info.run_id, "report")}
    assert "report/report.md" in report


@pytest.mark.parametrize("how", ["unwritable store", "unreachable server"])
def test_a_failing_tracker_prints_one_line_and_the_run_finishes(tmp_path, monkeypatch, capsys, how):
    out = tmp_path / "runs"
    if how == "unwritable store":
        (out / "mlflow.db").mkdir(parents=True)  # a folder where the SQLite file goes
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    cfg = load_config(None, {**TINY, "out": str(out), "name": "f", "tracker": "mlflow"})
    summary = run(cfg, progress=False, echo=lambda *_: None)
    err = [line for line in capsys.readouterr().err.splitlines() if "tracker" in line]
    assert len(err) == 1 and err[0].startswith("tracker mlflow failed") and "goes on" in err[0]
    assert summary["status"] == "finished"
    assert [x["round"] for x in _rounds(out / "f")] == [1, 2, 3]
    assert (out / "f" / "summary.json").is_file()


def test_a_tracker_not_installed_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    code = cli_main(["run", "--dataset", "digits", "--out", str(tmp_path / "runs"), "--tracker", "mlflow",
                     "--tracker", "wandb"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "wandb" in err[0] and "pip install 'fedlt[wandb]'" in err[0]
    assert not (tmp_path / "runs").exists()
