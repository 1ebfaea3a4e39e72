"""`fedlt flower simulate`: the fedlt ServerApp and ClientApp on Flower's Ray-backed simulation runtime give, for
the same settings, the metrics of `fedlt flower inprocess` (FedLoGe: client states, a post-training phase)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fedlt.cli import main as cli_main
from fedlt.runner.raystart import NICENESS

from conftest import dies_in_round

RUN = ["--method", "fedloge", "--dataset", "digits", "--clients", "4", "--alpha", "1.0", "--rounds", "2",
       "--eval-every", "1", "--local-epochs", "1", "--batch-size", "16", "--model", "mlp", "--threads", "1"]


def _no_time(rec):
    if isinstance(rec, dict):
        return {k: _no_time(v) for k, v in rec.items() if not k.endswith("time")}
    if isinstance(rec, list):
        return [_no_time(v) for v in rec]
    return rec


def _records(d):
    return [_no_time(json.loads(x)) for x in (d / "metrics.jsonl").read_text().splitlines()]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "FEDLT_TENSORBOARD": "0", "RAY_USAGE_STATS_ENABLED": "0"}
ENV.pop(NICENESS, None)  # fedlt's own default is what the niceness test checks


def _simulated_like(want, args) -> tuple[dict, dict]:
    """`fedlt flower simulate ARGS` (two Ray CPUs) in a child process; its records must be those of the run
    directory ``want``. Returns both summaries (want's, the simulation's). Clients that do not appear are the
    run's own one-line error (``--wait-timeout``), well before the child's time is up."""
    p = subprocess.run([sys.executable, "-m", "fedlt", "flower", "simulate", *args, "--cpus-per-client", "1",
                        "--wait-timeout", "240",
                        "--backend-config", '{"init_args": {"num_cpus": 2, "object_store_memory": 83886080}}'],
                       env=ENV, capture_output=True, text=True, timeout=480)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = want.parent / args[args.index("--name") + 1]
    assert _records(got) == _records(want)
    return tuple(json.loads((d / "summary.json").read_text()) for d in (want, got))


@pytest.mark.ray
@pytest.mark.slow
def test_flower_simulation_equals_the_inprocess_flower_run(tmp_path, capsys):
    pytest.importorskip("ray")
    pytest.importorskip("flwr")
    assert cli_main(["flower", "inprocess", *RUN, "--out", str(tmp_path), "--name", "inprocess"]) == 0
    capsys.readouterr()
    sa, sb = _simulated_like(tmp_path / "inprocess", [*RUN, "--out", str(tmp_path), "--name", "sim"])
    assert sb["last3"] == sa["last3"] and _no_time(sb["final"]) == _no_time(sa["final"])
    assert sb["missing"] == sa["missing"]


@pytest.mark.ray
def test_the_ray_that_fedlt_starts_runs_its_workers_at_normal_priority():
    """Ray's default lowers its workers to niceness 15; the clients that train there then got almost no CPU beside
    other busy processes (a 4-client simulation had not described its clients after 300 s on 2 busy cores, where
    at niceness 0 it ended in 120 s). fedlt starts Ray with its workers at the caller's priority."""
    pytest.importorskip("ray")
    code = ("import os, ray\n"
            "from fedlt.flower.simulation import _init_ray\n"
            "_init_ray({'num_cpus': 1, 'object_store_memory': 83886080, 'log_to_driver': False})\n"
            "print('niceness', os.nice(0), ray.get(ray.remote(lambda: os.nice(0)).remote()))\n")
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    caller, worker = (int(x) for x in p.stdout.split("niceness")[1].split())
    assert worker == caller, f"Ray's worker runs at niceness {worker}, the caller at {caller}"


def test_bad_backend_config_is_one_line(tmp_path, capsys):
    pytest.importorskip("flwr")
    code = cli_main(["flower", "simulate", *RUN, "--out", str(tmp_path), "--backend-config", "{init_args: 1}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--backend-config is not JSON" in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.ray
@pytest.mark.slow
def test_flower_simulation_resumes_through_the_run_driver(tmp_path, monkeypatch):
    """`fedlt flower simulate --resume` continues a run from its checkpoint (the run driver's, as every engine's):
    a FedAvg run stopped after round 1 in one process, resumed on the simulation runtime, ends with the records
    of an uninterrupted run. (FedAvg keeps no client state; a stateful method's clients would restart afresh on
    Ray's virtual SuperNodes, whose memory a checkpoint cannot reach.)"""
    pytest.importorskip("ray")
    pytest.importorskip("flwr")
    from fedlt.engine.driver import Driver

    run = [*RUN, "--method", "fedavg", "--rounds", "3", "--out", str(tmp_path)]
    assert cli_main(["flower", "inprocess", *run, "--name", "whole"]) == 0
    with dies_in_round(Driver, 2):
        cli_main(["flower", "inprocess", *run, "--name", "cut"])
    sa, sb = _simulated_like(tmp_path / "whole", [*run, "--name", "cut", "--resume"])
    assert sb["resumed_after_round"] == 1 and sb["last3"] == sa["last3"]
