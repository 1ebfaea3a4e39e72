"""`fedlt sweep --backend ray` on a real two-node Ray cluster on this machine (``ray start --head`` and a second
``ray start --address`` with its own temporary folder and resources): the table equals a sequential sweep's, also
after a SIGTERM to the sweep (exit 143, then started again) and when the worker node dies mid-way (its raylet and
its workers ``kill -9``-ed at once), its runs then retried on the head from their checkpoints. Without Ray installed,
``--backend ray`` is a one-line error.

Every node address is the loopback 127.0.0.2: for a multi-node cluster Ray replaces 127.0.0.1 (and localhost)
by the machine's outward address (``ray._private.services.resolve_ip_for_localhost``), any other loopback
address it keeps."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedlt.cli import main as cli_main
from fedlt.experiments import report as R
from fedlt.experiments.sweep import load_sweep, plan, run_plan

from slowsite import slow_env, sweep_grid

GRID = sweep_grid([0, 1])
QUIET = dict(progress=False, echo=lambda *a: None, threads=1)
LOOPBACK = "127.0.0.2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ray(args, env, timeout=120):
    ray = Path(sys.executable).with_name("ray")
    return subprocess.run([str(ray), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _raylet_pid(temp_dir: Path) -> int:
    """The raylet whose session lives under ``temp_dir`` (found by its command line, killed by its pid)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"raylet") and any(str(temp_dir).encode() in c for c in cmd):
                return int(proc.name)
    raise AssertionError(f"no raylet under {temp_dir}")


def _node_pids(temp_dir: Path) -> list[int]:
    """Every process of the Ray node whose session lives under ``temp_dir``: those whose command lines name its
    folder (its raylet, its log monitor) and every descendant of its raylet (the workers, which rename
    themselves ``ray::...``)."""
    parent, named = {}, set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                stat = (proc / "stat").read_text()
                parent[int(proc.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
                if str(temp_dir).encode() in (proc / "cmdline").read_bytes():
                    named.add(int(proc.name))
            except (OSError, ValueError):
                continue
    out, grew = set(named), True
    while grew:
        grew = False
        for pid, pp in parent.items():
            if pp in out and pid not in out:
                out.add(pid)
                grew = True
    return sorted(out)


@pytest.fixture(scope="module")
def cluster():
    """Head: 1 CPU; worker node: 2 CPUs and a resource of its own. A run asks for 1 CPU, so three run at once,
    two of them on the worker node. Every child process (Ray's workers too) has slower rounds."""
    pytest.importorskip("ray")
    # short: Ray's socket paths under it must fit AF_UNIX's 107 bytes (an xdist worker's tmp_path is longer)
    tmp = Path(tempfile.mkdtemp(prefix="fedlt-ray-"))
    env = {**slow_env(tmp, 0.4), "RAY_USAGE_STATS_ENABLED": "0"}
    port = _free_port()
    common = ["--node-ip-address", LOOPBACK, "--object-store-memory", str(80 * 2**20), "--disable-usage-stats"]
    try:
        head = _ray(["start", "--head", "--port", str(port), "--num-cpus", "1", "--include-dashboard", "false",
                     "--temp-dir", str(tmp / "head"), *common], env)
        assert head.returncode == 0, head.stdout + head.stderr
        work = _ray(["start", "--address", f"{LOOPBACK}:{port}", "--num-cpus", "2", "--resources",
                     '{"fedlt_test_worker": 2}', "--temp-dir", str(tmp / "worker"), *common], env)
        assert work.returncode == 0, work.stdout + work.stderr
        deadline = time.time() + 60
        while time.time() < deadline and "2.0 fedlt_test_worker" not in _ray(
                ["status", "--address", f"{LOOPBACK}:{port}"], env, 60).stdout.replace("0.0/", ""):
            time.sleep(1)
        yield {"address": f"{LOOPBACK}:{port}", "env": env, "worker_dir": tmp / "worker", "tmp": tmp}
    finally:
        _stop(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(tmp: Path) -> None:
    """End this cluster's processes by their ids (:func:`_node_pids` of its temporary folder), not with `ray stop`,
    which ends every Ray process of the machine, other users' clusters too."""
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 15)):
        for pid in _node_pids(tmp):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while time.time() < deadline and _node_pids(tmp):
            time.sleep(0.2)


def _sweep(toml, out, cluster):
    return subprocess.Popen([sys.executable, "-m", "fedlt", "sweep", str(toml), "--out", str(out), "--backend", "ray",
                             "--ray-address", cluster["address"], "--threads", "1", "--no-report", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cluster["env"])


def _table(out) -> str:
    return (R.write_report(out, echo=lambda *a: None, figures=False) / "table.md").read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seq")
    toml = tmp / "grid.toml"
    toml.write_text(GRID)
    run_plan(plan(load_sweep(toml, str(tmp / "seq"))), **QUIET)
    return toml, _table(tmp / "seq")


@pytest.mark.ray
@pytest.mark.slow
def test_sweep_on_a_two_node_ray_cluster_gives_the_sequential_table_also_after_a_sigterm(cluster, reference,
                                                                                         tmp_path):
    toml, want = reference
    runs = plan(load_sweep(toml, str(tmp_path / "ray")))
    p = _sweep(toml, tmp_path / "ray", cluster)
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None and sum(r.status() == "partial" for r in runs) < 2:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)  # what a scheduler sends the sweep's process: its Ray tasks are cancelled
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 143, out
    assert re.search(rf"^fedlt: stopped by SIGTERM: sweep {re.escape(str(tmp_path / 'ray'))} stopped with \d of 4 "
                     r"runs unfinished; run the same command again", out, re.M), out
    p = _sweep(toml, tmp_path / "ray", cluster)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    assert re.search(r"running \d runs as Ray tasks on 3 CPUs \(2 nodes\)", out), out
    m = re.search(r"(\d) started, (\d) resumed from a checkpoint, (\d) finished before", out)
    assert m and sum(map(int, m.groups())) == 4 and int(m.group(2)) >= 2, out
    assert _table(tmp_path / "ray") == want


@pytest.mark.ray
@pytest.mark.slow
def test_killing_the_worker_node_mid_sweep_retries_its_runs_from_their_checkpoints(cluster, reference, tmp_path):
    toml, want = reference
    runs = plan(load_sweep(toml, str(tmp_path / "ray")))
    p = _sweep(toml, tmp_path / "ray", cluster)
    deadline = time.time() + 240  # three runs under way at once: two of them are on the worker node
    while time.time() < deadline and p.poll() is None and sum(r.status() == "partial" for r in runs) < 3:
        time.sleep(0.05)
    assert p.poll() is None, p.communicate()[0]
    # the node dies as a machine does: its raylet and every worker process of it at once (the raylet alone left its
    # workers a moment in which, on a loaded machine, a run could finish its last rounds before it noticed)
    node = _node_pids(cluster["worker_dir"])
    assert _raylet_pid(cluster["worker_dir"]) in node and len(node) > 1, node
    for pid in node:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    cut = [i for i, r in enumerate(runs) if r.status() == "partial"]  # the runs under way when it died
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    resumed = [json.loads((r.dir / "summary.json").read_text()).get("resumed_after_round") for r in runs]
    # the dead node's runs from their checkpoints: all of those cut off but the head's one
    assert sum(resumed[i] is not None for i in cut) >= max(1, len(cut) - 1), (cut, resumed, out)
    for r in runs:  # every round logged once
        recs = [json.loads(x) for x in (r.dir / "metrics.jsonl").read_text().splitlines()]
        assert [x["round"] for x in recs if "round" in x] == list(range(1, 6))
    assert _table(tmp_path / "ray") == want


def test_backend_ray_without_ray_installed_is_one_line_saying_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    toml = tmp_path / "grid.toml"
    toml.write_text(GRID)
    assert cli_main(["sweep", str(toml), "--out", str(tmp_path / "o"), "--backend", "ray"]) == 2
    err = capsys.readouterr().err
    assert err == ("fedlt: error: --backend ray needs Ray, which is not installed; install it with: "
                   "pip install 'fedlt[ray]'\n")
    assert not (tmp_path / "o").exists()
    assert cli_main(["run", "--dataset", "digits", "--clients", "4", "--rounds", "1", "--model", "mlp",
                     "--out", str(tmp_path / "r"), "--no-progress", "--threads", "1"]) == 0  # fedlt run needs none
