"""Worker processes (--workers, fedlt.engine.workers): a round's clients trained in parallel processes give the
run of one client after another with one thread, bit for bit; a killed run or worker resumes to the same end; bad
settings are one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fedlt.config import RunConfig, available_cores
from fedlt.engine.workers import Workers
from fedlt.runner import rundir

from conftest import method_test_params, small_config

SRC = str(Path(__file__).resolve().parents[1] / "src")
QUICK = dict(rounds=3, eval_every=2, local_epochs=1, participation=4, clients=6, threads=1)


def _record(run_dir: Path) -> tuple[list, dict]:
    """metrics.jsonl and summary.json without their times (and the engine's own description)."""
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if "time" not in k and k not in ("elapsed", "seconds", "run_dir")}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    rows = [clean(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, clean(json.loads((run_dir / "summary.json").read_text()))


def _run(tmp_path, name, method, **over):
    cfg = small_config(method=method, params=method_test_params(method), out=str(tmp_path), name=name,
                       **{**QUICK, **over})
    rundir.run(cfg, progress=False, echo=lambda *a: None, checkpoint_every=1)
    return tmp_path / name


# a sample of methods: plain FedAvg, a fixed classifier with a post-training phase (FedLoGe), personal models
# trained beside the global one (Ditto), control variates (SCAFFOLD), a server-side step on features (CReFF) and
# a loop of its own with a server prior (FedYoYo)
SAMPLE = ["fedavg", "fedloge", "ditto", "scaffold", "creff", "fedyoyo"]


@pytest.mark.parametrize("method", SAMPLE)
def test_workers_give_the_serial_one_thread_run_bit_for_bit(tmp_path, method, monkeypatch):
    pools = []
    real = Workers._pool
    monkeypatch.setattr(Workers, "_pool", lambda self: pools.append(self.workers) or real(self))
    serial = _record(_run(tmp_path, "serial", method))
    assert not pools
    parallel = _record(_run(tmp_path, "workers", method, workers="2"))
    assert pools and set(pools) == {2}  # the rounds went through two worker processes
    assert parallel == serial


def test_the_spawn_start_method_gives_the_same_replies(tmp_path):
    """Where fork does not exist (macOS, Windows) the workers get the method and the federation pickled once."""
    from fedlt.engine.driver import EngineConfig
    from fedlt.engine.simulation import Simulation
    from fedlt.runner.rundir import prepare

    def states(workers):
        cfg = small_config(**{**QUICK, "rounds": 2})
        pr = prepare(cfg)
        sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
        if workers:
            sim.transport = Workers(pr.method, pr.fed, cfg.seed, 2, sim.transport.client_states, start="spawn")
        sim.train_round()
        sim.train_round()
        if workers:
            sim.transport.close()
        return sim.state.weights

    a, b = states(False), states(True)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


DYING = textwrap.dedent("""
    import os, signal
    from fedlt import METHODS
    from fedlt.methods.fedavg import FedAvg

    @METHODS.register("fedavg-dies")
    class Dies(FedAvg):
        '''FedAvg whose worker process is killed as client 1 trains while the file $FEDLT_TEST_ARMED exists.'''

        def local_train(self, payload, cstate, data, gen):
            armed = os.environ.get("FEDLT_TEST_ARMED", "")
            if data.client_id == 1 and armed and os.path.exists(armed):
                os.unlink(armed)
                os.kill(os.getpid(), signal.SIGKILL)
            return super().local_train(payload, cstate, data, gen)
""")


def _cli(tmp_path, name, *extra, env=None):
    argv = ["run", "--dataset", "digits", "--rho", "10", "--alpha", "1", "--clients", "6", "--participation", "4",
            "--rounds", "4", "--eval-every", "2", "--local-epochs", "1", "--batch-size", "16", "--model", "smallcnn",
            "--out", str(tmp_path), "--name", name, "--no-progress", "--threads", "1", "--checkpoint-every", "1",
            *extra]
    return subprocess.run([sys.executable, "-m", "fedlt", *argv], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": SRC, **(env or {})})


def test_a_worker_killed_mid_round_is_one_line_naming_the_client_and_resume_ends_as_the_uninterrupted_run(tmp_path):
    plugin = tmp_path / "dies.py"
    plugin.write_text(DYING)
    ref = _cli(tmp_path, "ref", "--method-file", str(plugin))
    assert ref.returncode == 0, ref.stderr[-2000:]
    armed = tmp_path / "armed"
    armed.write_text("")
    p = _cli(tmp_path, "killed", "--method-file", str(plugin), "--workers", "2",
             env={"FEDLT_TEST_ARMED": str(armed)})
    err = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1, p.stderr[-2000:]
    assert "worker process died" in err[0] and "client" in err[0] and "1" in err[0] and "--resume" in err[0]
    assert not (tmp_path / "killed" / "summary.json").exists()
    again = _cli(tmp_path, "killed", "--method-file", str(plugin), "--workers", "2", "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert _record(tmp_path / "killed") == _record(tmp_path / "ref")


KILL_RUN = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {src!r})
    from fedlt.runner import rundir, runstate
    from fedlt.config import RunConfig

    real, seen = runstate.save_checkpoint, [0]

    def dying(*a, **k):
        real(*a, **k)
        seen[0] += 1
        if seen[0] == 2:  # the run (and with it, by PR_SET_PDEATHSIG, its workers) killed after round 2
            os.kill(os.getpid(), signal.SIGKILL)

    runstate.save_checkpoint = dying
    rundir.run(RunConfig(**{cfg!r}), progress=False, checkpoint_every=1, echo=lambda *a: None)
""")


def test_kill_9_of_a_run_with_workers_then_resume_ends_as_the_serial_run(tmp_path):
    ref = _run(tmp_path, "ref", "fedloge", rounds=4)
    cfg = small_config(method="fedloge", params=method_test_params("fedloge"), out=str(tmp_path), name="killed",
                       **{**QUICK, "rounds": 4, "workers": "2"})
    p = subprocess.run([sys.executable, "-c", KILL_RUN.format(src=SRC, cfg=cfg.to_dict())], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == -9, p.stderr[-2000:]
    out = rundir.run(cfg, progress=False, echo=lambda *a: None, checkpoint_every=1, resume=True)
    assert out["resumed_after_round"] == 2
    assert _record(tmp_path / "killed")[0] == _record(ref)[0]


@pytest.mark.parametrize("over, says", [
    ({"workers": "0"}, "workers"),
    ({"workers": "-2"}, "workers"),
    ({"workers": "two"}, "workers"),
    ({"workers": "5", "participation": 4}, "4 clients a round"),
    ({"workers": "2", "device": "cuda"}, "--client-parallel"),
    ({"workers": "2", "client_parallel": "2"}, "client-parallel"),
])
def test_bad_worker_settings_are_one_line(over, says):
    from fedlt.config import validate
    from fedlt.errors import ConfigError

    with pytest.raises(ConfigError, match=says) as e:
        validate(RunConfig(**{**dict(clients=6, participation=0.5), **over}))
    assert "\n" not in str(e.value)


def test_workers_times_threads_past_the_cores_is_refused():
    from fedlt.config import validate
    from fedlt.errors import ConfigError

    n = available_cores()
    with pytest.raises(ConfigError, match="cores"):
        validate(RunConfig(clients=4 * n + 4, participation=1.0, workers=str(n), threads=2))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="where a GPU is visible auto chooses none (below)")
def test_auto_uses_the_cores_on_a_cpu_and_nothing_on_one_client_a_round():
    from fedlt.config import worker_count

    n = available_cores()
    assert worker_count(RunConfig(clients=100, participation=1.0, workers="auto")) == (n if n >= 2 else 0)
    assert worker_count(RunConfig(clients=3, participation=1.0, workers="auto")) == (min(n, 3) if n >= 2 else 0)
    assert worker_count(RunConfig(clients=10, participation=0.1, workers="auto")) == 0  # one client a round
    assert worker_count(RunConfig(clients=10, participation=1.0, workers="auto", device="cuda")) == 0
    assert worker_count(RunConfig(clients=10, workers="off")) == 0


def test_a_sweep_does_not_oversubscribe_jobs_times_workers(tmp_path):
    from fedlt.experiments.sweep import PlannedRun, check_cores, share_of_cores

    n = available_cores()
    run = PlannedRun("fedavg", "s", 0, RunConfig(clients=8 * n + 8, participation=1.0, workers=str(max(n, 1))))
    with pytest.raises(Exception, match=r"--jobs 2 x --workers .* past the .* cores.*jobs x workers <= cores"):
        check_cores([run], 2, None)
    check_cores([run], 1, None)  # one run at a time: its workers may take every core
    auto = PlannedRun("fedavg", "s", 0, RunConfig(clients=40, participation=1.0, workers="auto"))
    check_cores([auto], 2, None)  # auto shares the cores out
    assert share_of_cores(auto.cfg, 4) == {"workers": "4", "threads": 1}
    assert share_of_cores(auto.cfg, 1) == {"workers": "off", "threads": 1}
    assert share_of_cores(RunConfig(), 3) == {"threads": 3}


def test_where_a_gpu_is_visible_workers_are_refused_and_auto_chooses_none(monkeypatch):
    """A process forked after a backward pass cannot run autograd where torch sees a GPU (seen on an H200)."""
    import fedlt.config as config
    from fedlt.errors import ConfigError

    monkeypatch.setattr(config, "gpu_visible", lambda: True)
    assert config.worker_count(RunConfig(clients=100, participation=1.0, workers="auto")) == 0
    with pytest.raises(ConfigError, match=r"GPU is visible.*CUDA_VISIBLE_DEVICES") as e:
        config.validate(RunConfig(clients=10, participation=1.0, workers="2"))
    assert "\n" not in str(e.value)
