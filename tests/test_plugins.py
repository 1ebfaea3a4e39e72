"""Methods from outside the package: an installed plugin (entry point ``fedlt.methods``) and ``--method-file``
work wherever a built-in method does, and a broken one is a one-line error that never breaks the built-ins.

The plugin is a path-based distribution (a ``*.dist-info`` folder with ``entry_points.txt`` beside the package
on PYTHONPATH, what ``pip install`` leaves in site-packages): fast, offline, nothing installed into the test's
environment. ``tinyavg`` is FedAvg written with the public API only, so every run of it must equal FedAvg's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fedlt
from fedlt import plugins
from fedlt.cli import main as cli_main
from fedlt.errors import ConfigError
from fedlt.registry import METHODS

TINY_METHOD = '''
    """tinyavg: FedAvg from the public API (a test plugin)."""
    import os
    from dataclasses import dataclass

    import fedlt


    class TinyAvg(fedlt.Method):
        @dataclass
        class Params:
            scale: float = 1.0  # unused: a parameter for sweeps to set

        def local_train(self, payload, cstate, data, gen):
            net = self.net
            fedlt.load_weights(net, payload.arrays)
            stats = fedlt.train_local(net, data, self.spec, gen)
            return fedlt.Message(fedlt.weights_of(net), {"num_examples": len(data), **stats}), cstate

        def aggregate(self, state, rnd, replies):
            if os.environ.get("TINY_STOP_AT") == str(rnd):  # stands for the process being killed
                raise KeyboardInterrupt
            return super().aggregate(state, rnd, replies)


    class NotAMethod:
        pass
'''
# the same settings for every run: a tiny synthetic federation, two rounds
SETTINGS = ["--dataset", "synthetic", "--clients", "4", "--rounds", "2", "--eval-every", "1", "--local-epochs", "1",
            "--participation", "0.5", "--threads", "1"]


def make_dist(site: Path, dist: str, module: str, entry_points: dict[str, str], code: str = TINY_METHOD) -> None:
    """A distribution as pip installs it: the module and ``<dist>-0.1.dist-info/`` with METADATA and
    entry_points.txt."""
    site.mkdir(parents=True, exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(code))
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedlt.methods]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))


# ------------------------------------------------------------------------------------------- the chain
DRIVER = r'''
import contextlib, io, json, os, sys
from fedlt.cli import main
results = []
for env, argv in json.loads(sys.argv[1]):
    os.environ.pop("TINY_STOP_AT", None)
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    results.append([argv[0], rc, out.getvalue(), err.getvalue()])
print(json.dumps(results))
'''


def chain(method: str, extra: list[str], out: Path, sweep_base: str) -> list:
    """Every place a method can be named, in one process (the `fedlt` command's own main, command by command):
    list, run killed after round 1 then --resume, a 2-run sweep with FedAvg, report, the in-process Flower
    engine, a Flower app directory."""
    sweep = out / "grid.toml"
    sweep.write_text(f'seeds = [0]\nmethods = ["fedavg", "{method}"]\ncheckpoint_every = 1\n'
                     f'[base]\ndataset = "synthetic"\nclients = 4\nrounds = 2\neval_every = 1\nlocal_epochs = 1\n'
                     f'participation = 0.5\n{sweep_base}')
    run = ["run", "--method", method, *extra, *SETTINGS, "--out", str(out), "--name", "r", "--no-progress",
           "--checkpoint-every", "1"]
    return [({}, ["list", *extra]),
            ({"TINY_STOP_AT": "2"}, run),
            ({}, run + ["--resume"]),
            ({}, ["sweep", str(sweep), "--out", str(out / "grid"), "--no-progress", "--no-report"]),
            ({}, ["report", str(out / "grid"), "--no-figures"]),
            ({}, ["flower", "inprocess", "--method", method, *extra, *SETTINGS, "--out", str(out), "--name", "fl"]),
            ({}, ["flower", "app", "--app-dir", str(out / "app"), "--method", method, *extra, *SETTINGS])]


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """Both chains in one subprocess (the plugin reaches it through PYTHONPATH, as an installed one would)."""
    pytest.importorskip("flwr")
    tmp = tmp_path_factory.mktemp("plugins")
    make_dist(tmp / "site", "tinyplug", "tinyplug", {"tinyavg": "tinyplug:TinyAvg"})
    method_file = tmp / "my_method.py"
    method_file.write_text(textwrap.dedent(TINY_METHOD) + '\nfedlt.METHODS.register("tinyfile", TinyAvg)\n')
    (tmp / "ep").mkdir()
    (tmp / "file").mkdir()
    steps = (chain("tinyavg", [], tmp / "ep", "") +
             chain("tinyfile", ["--method-file", "my_method.py"], tmp / "file", 'method_file = "my_method.py"\n'))
    env = {**os.environ, "PYTHONPATH": str(tmp / "site"), "OMP_NUM_THREADS": "1", "FEDLT_TENSORBOARD": "0",
           "FEDLT_PLUGIN_PATH": str(tmp / "site")}
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(steps)], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.splitlines()[-1])
    half = len(results) // 2
    return tmp, {"ep": results[:half], "file": results[half:]}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _numbers(summary: dict) -> tuple:
    """Every accuracy of a summary (final GM and PM modes, last-3 means), without timings."""
    return summary["final"]["global"], summary["final"]["personal"], summary["last3"]


@pytest.mark.parametrize("kind,method,origin", [("ep", "tinyavg", "(plugin tinyplug 0.1)"),
                                                ("file", "tinyfile", "(file ")])
def test_outside_method_works_everywhere_a_builtin_does(chains, kind, method, origin):
    tmp, results = chains
    out = tmp / kind
    (lst, killed, resumed, sweep, report, flower, app) = results[kind]
    assert all(rc == 0 for _, rc, _, _ in (lst, resumed, sweep, report, flower, app)), results[kind]
    # fedlt list: the method, where it comes from, and the built-ins around it
    line = next(x for x in lst[2].splitlines() if x.strip().startswith(method))
    assert origin in line and "params: scale=1.0" in lst[2] and "fedloge" in lst[2]
    # a run killed after round 1 (exit 130) resumes from its checkpoint and ends as the uninterrupted run
    assert killed[1] == 130
    summary = _json(out / "r" / "summary.json")
    assert summary["resumed_after_round"] == 1 and not list((out / "r").glob("checkpoint*"))
    cfg = _json(out / "r" / "config.json")
    assert cfg["method"] == method
    # the sweep: the method beside FedAvg on the same clients; being FedAvg, it must give FedAvg's numbers
    grid = out / "grid" / "default"
    fa, tiny = _json(grid / "fedavg" / "seed0" / "summary.json"), _json(grid / method / "seed0" / "summary.json")
    assert _numbers(tiny) == _numbers(fa)
    assert _numbers(summary) == _numbers(tiny)  # and the resumed run is that same run
    # the report has its row
    assert f"| {method} |" in (out / "grid" / "report" / "table.md").read_text()
    # the Flower engine (ServerApp strategy + ClientApps in one process) gives the simulation's GM
    fl = _json(out / "fl" / "summary.json")
    assert _json(out / "fl" / "config.json")["engine"] == "flower"
    assert fl["final"]["global"]["global"]["acc"] == fa["final"]["global"]["global"]["acc"]
    if kind == "file":
        # the file is found by its absolute path: in config.json, in the sweep's runs, in the Flower app's config
        path = str((tmp / "my_method.py").resolve())
        assert cfg["method_file"] == path
        assert _json(grid / method / "seed0" / "config.json")["method_file"] == path
        assert f'method-file = "{path}"' in (out / "app" / "pyproject.toml").read_text()


# ------------------------------------------------------------------------------------------- broken ones
@pytest.fixture
def isolated_methods(monkeypatch):
    """The method registry as it is, restored after the test (what a test registers or discovers goes away)."""
    METHODS._load()
    for attr in ("_items", "_origin", "_broken", "_warned"):
        monkeypatch.setattr(METHODS, attr, type(getattr(METHODS, attr))(getattr(METHODS, attr)))
    monkeypatch.setattr(METHODS, "_plugins", None)  # discover again, with the test's sys.path
    monkeypatch.setattr(plugins, "_LOADED", {})
    return METHODS


TINY_RUN = ["--dataset", "synthetic", "--clients", "4", "--rounds", "1", "--eval-every", "1", "--local-epochs", "1",
            "--no-progress", "--threads", "1"]


def test_broken_plugins_are_one_line_errors_and_builtins_keep_working(tmp_path, monkeypatch, capsys,
                                                                      isolated_methods):
    site = tmp_path / "site"
    make_dist(site, "brokenplug", "brokenplug", {"broken-import": "brokenplug_missing:TinyAvg",
                                                 "fedavg": "brokenplug:TinyAvg",
                                                 "not-a-method": "brokenplug:NotAMethod",
                                                 "raises": "brokenplug_raises:X"})
    (site / "brokenplug_raises.py").write_text("raise RuntimeError('bad plugin code\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("FEDLT_PLUGIN_PATH", str(site))
    out = tmp_path / "runs"
    errs = []
    for method, needle in [("broken-import", "import failed: ModuleNotFoundError: No module named 'brokenplug_missing'"),
                           ("not-a-method", "is not a subclass of fedlt.Method"),
                           ("raises", "import failed: RuntimeError: bad plugin code")]:
        assert cli_main(["run", "--method", method, *TINY_RUN, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        (line,) = [x for x in err.splitlines() if not x.startswith("fedlt: warning: ")]
        assert line.startswith("fedlt: error: ") and "Traceback" not in err, err
        assert f"method plugin {method!r}" in line and "brokenplug 0.1" in line and needle in line, err
        assert not out.exists()
        errs.append(err)
    # the clash: said once, on one line, when the plugins were first looked at; the built-in is what runs
    (clash,) = [x for e in errs for x in e.splitlines() if x.startswith("fedlt: warning: ")]
    assert "method plugin 'fedavg'" in clash and "clashes with the built-in method 'fedavg', which is used" in clash
    assert cli_main(["run", "--method", "fedavg", *TINY_RUN, "--out", str(out), "--name", "ok"]) == 0
    assert (out / "ok" / "summary.json").is_file()
    assert cli_main(["list"]) == 0
    cap = capsys.readouterr()
    assert "fedloge" in cap.out and "fedavg " in cap.out and "not-a-method" not in cap.out
    warnings = cap.err.splitlines()
    assert len(warnings) == 3, cap.err  # each plugin left out, once (the clash was said already)
    assert all(w.startswith("fedlt: warning: method plugin '") and "brokenplug 0.1" in w for w in warnings)
    assert METHODS.origin("fedavg") == "built-in"


@pytest.mark.parametrize("code,needle", [
    ("import not_a_module_anywhere\n", "ModuleNotFoundError: No module named 'not_a_module_anywhere'"),
    ("def broken(:\n", "SyntaxError"),
    ("import fedlt\n\n@fedlt.METHODS.register('fedavg')\nclass Mine(fedlt.Method):\n    pass\n",
     "'fedavg' is already registered (built-in"),
    ("import fedlt\n\n@fedlt.METHODS.register('mine')\nclass Mine:\n    pass\n", "not a subclass of fedlt.Method"),
    ("x = 1\n", "registers no method"),
])
def test_broken_method_file_is_one_line_error_and_undone(tmp_path, isolated_methods, code, needle):
    f = tmp_path / "mine.py"
    f.write_text(code)
    before = METHODS.names()
    with pytest.raises(ConfigError) as e:
        fedlt.make_config(method_file=f, dataset="synthetic")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and str(f) in msg and needle in msg, msg
    assert METHODS.names() == before and METHODS.get("fedavg").__module__ == "fedlt.methods.fedavg"


def test_method_file_defaults_the_method_and_reloads_after_an_edit(tmp_path, isolated_methods):
    f = tmp_path / "mine.py"
    f.write_text(textwrap.dedent(TINY_METHOD) + '\nfedlt.METHODS.register("mine", TinyAvg)\n')
    cfg = fedlt.make_config(method_file=str(f), dataset="synthetic")
    assert cfg.method == "mine" and cfg.method_file == str(f.resolve())
    assert fedlt.make_config(method_file=str(f), method="fedprox").method == "fedprox"  # built-ins stay usable
    first = METHODS.get("mine")
    f.write_text(f.read_text().replace("scale: float = 1.0", "scale: float = 2.0") + "\n# edited\n")
    cfg = fedlt.make_config(method_file=str(f), dataset="synthetic")
    assert METHODS.get("mine") is not first and METHODS.get("mine").make_params().scale == 2.0
