"""`fedlt reproduce`: the seed papers' tables as data, their protocols as presets, and a table run as a sweep
whose report puts ours beside the paper's numbers.

End-to-end runs use small files in the datasets' real on-disk formats (tests/datafixtures.py: CIFAR-10's
python pickles, ImageNet-LT's lists and JPEGs), 1-2 rounds and a small model (``--override``)."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import pytest

import fedlt
from fedlt.cli import main as cli_main
from fedlt.config import PRESETS, load_config
from fedlt.engine import Simulation
from fedlt.experiments.reproduce import plan_reproduction
from fedlt.experiments.sweep import plan
from fedlt.experiments.report import METRICS
from fedlt.papers import PAPERS, presets, tables
from fedlt.registry import METHODS

from datafixtures import write_cifar10, write_imagenet_lt
from conftest import dies_in_round

SMALL = ["--override", "model=smallcnn", "--override", "clients=4", "--override", "local_epochs=1",
         "--threads", "1", "--no-progress", "--no-figures"]


def _csv(path: Path) -> list[dict]:
    return list(csv.DictReader(io.StringIO(path.read_text())))


# ------------------------------------------------------------------------------------------------ the data
@pytest.mark.parametrize("name", list(tables()))
def test_table_file_shape_and_every_method_exists_or_is_marked_missing(name):
    t = tables()[name]
    assert t.metric in ("final", "last3") and t.source and t.title
    assert set(s for s, _ in t.columns) == set(t.settings) and len(set(t.columns)) == len(t.columns)
    assert all(m in METRICS for _, m in t.columns)
    assert len(t.cells) == len(t.methods) * len(t.columns)  # every row has one entry per column
    for m in t.methods.values():
        assert m.missing is not None or m.method in METHODS, f"{name}: {m.method} is neither in fedlt nor marked"
    for c in t.cells:
        assert c.value is None or 0 <= c.value <= 1, c
        assert c.std is None or (c.value is not None and 0 <= c.std < 0.2), c
        assert c.source.startswith(t.source) and t.methods[c.method].row in c.source
    assert any(c.value is not None for c in t.cells)
    for s, over in t.settings.items():
        assert over["preset"] in PRESETS and over["preset"] in presets()
    # every run of the full table is a valid fedlt run (method names and parameters included)
    runs = plan(plan_reproduction(name, seeds=[0]).sweep)
    assert len(runs) == sum(m.missing is None for m in t.methods.values()) * len(t.settings)


def test_every_paper_preset_value_names_its_source_and_list_shows_them(capsys):
    for name, p in presets().items():
        assert name.split("-")[0] in PAPERS
        assert set(p.settings) <= set(p.sources), f"{name}: no source for {set(p.settings) - set(p.sources)}"
        load_config(None, {"preset": name})  # valid
    assert cli_main(["list"]) == 0
    out = capsys.readouterr().out
    for name, p in presets().items():
        assert name in out and p.paper in out
    assert "[paper Sec. 4.1 and App. A.1]" in out  # a value's source, beside it


def test_fedloge_presets_and_tables_hold_the_papers_stated_values():
    """FedLoGe (ICLR 2024) Sec. 4.1 and App. A.1; where the paper is silent, its official code (batch 8, lr 0.03,
    momentum 0.5, no weight decay); CIFAR-100-LT's K, given as 20 and as 40 by the paper, is the code's 40."""
    c10 = load_config(None, {"preset": "fedloge-cifar10-lt"})
    assert (c10.dataset, c10.model, c10.clients, c10.participation, c10.local_epochs, c10.rounds) == \
        ("cifar10", "resnet18", 40, 1.0, 5, 500)
    assert (c10.partition, c10.lt_profile, c10.split) == ("dirichlet", "exp", "fedloge")
    assert (c10.batch_size, c10.lr, c10.momentum, c10.weight_decay, c10.lr_schedule) == (8, 0.03, 0.5, 0.0, "constant")
    c100 = load_config(None, {"preset": "fedloge-cifar100-lt"})
    assert (c100.dataset, c100.model, c100.clients, c100.local_epochs) == ("cifar100", "resnet34", 40, 5)
    inet = load_config(None, {"preset": "fedloge-imagenet-lt"})
    assert (inet.dataset, inet.model, inet.clients, inet.participation, inet.local_epochs, inet.rounds, inet.alpha,
            inet.lt_profile) == ("imagenet-lt", "resnet50", 20, 0.4, 3, 500, 0.1, "none")
    inat = load_config(None, {"preset": "fedloge-inat"})
    assert (inat.dataset, inat.model, inat.clients, inat.participation, inat.alpha) == \
        ("inat-user", "resnet50", 20, 0.4, 0.5)
    t1 = tables()["fedloge-table1"]
    axes = {(s["preset"], s["alpha"], s["imbalance_ratio"]) for s in t1.settings.values()}
    assert axes == {(p, a, i) for p in ("fedloge-cifar10-lt", "fedloge-cifar100-lt") for a in (0.5, 1.0)
                    for i in (50.0, 100.0)}
    # Table 1, CIFAR-10-LT, alpha 0.5, IF 100: FedLoGe GM 0.7672, PM 0.9096; FedPer has no GM ("-")
    assert t1.cell("fedloge", "cifar10-lt-a0.5-if100", "GM").value == pytest.approx(0.7672)
    assert t1.cell("fedloge", "cifar10-lt-a0.5-if100", "PM").value == pytest.approx(0.9096)
    assert t1.cell("fedper", "cifar10-lt-a1-if100", "GM").value is None
    assert t1.cell("fedavg", "cifar100-lt-a1-if100", "PM").value == pytest.approx(0.6269)
    t2 = tables()["fedloge-table2"]  # ImageNet-LT: FedLoGe many/med/few/GM/PM
    assert [t2.cell("fedloge", "imagenet-lt-a0.1", m).value for m in ("many", "medium", "few", "GM", "PM")] == \
        pytest.approx([0.430, 0.373, 0.285, 0.356, 0.726])
    assert t2.cell("fedrod", "imagenet-lt-a0.1", "PM").value == pytest.approx(0.7033)


# ------------------------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    return write_cifar10(tmp_path_factory.mktemp("cifar"))


def _check_report(out: Path, table: str, setting: str, methods: list[str], metrics: list[str], seeds: int):
    rows = _csv(out / "report" / "reproduction.csv")
    t = tables()[table]
    assert {(r["method"], r["metric"]) for r in rows} == {(m, k) for m in methods for k in metrics}
    for r in rows:
        paper = t.cell(r["method"], setting, r["metric"])
        if paper.value is None:
            assert r["paper"] == "" and r["diff"] == ""
            continue
        assert float(r["paper"]) == pytest.approx(paper.value, abs=1e-6)
        if r["ours_mean"]:  # ours beside the paper's, and the difference of the two
            assert int(r["ours_n"]) == seeds
            assert float(r["diff"]) == pytest.approx(float(r["ours_mean"]) - float(r["paper"]), abs=2e-6)
    assert sum(bool(r["ours_mean"]) for r in rows) >= len(methods)  # each method has a number of ours
    md = (out / "report" / "reproduction.md").read_text()
    assert "ours | " in md and "paper | " in md and "diff |" in md
    return rows, md


def test_reproduce_cifar10_pickles_end_to_end(cifar_dir, tmp_path, capsys):
    out = tmp_path / "rep"
    assert cli_main(["reproduce", "fedloge-table1", "--methods", "fedavg,fedloge", "--settings",
                     "cifar10-lt-a0.5-if100", "--rounds", "1", "--seeds", "0", "--data-dir", str(cifar_dir),
                     "--out", str(out), *SMALL]) == 0
    rows, md = _check_report(out, "fedloge-table1", "cifar10-lt-a0.5-if100", ["fedavg", "fedloge"], ["GM", "PM"], 1)
    assert "Shortened: every run at 1 of 500 rounds" in md and "model=smallcnn" in md
    assert (out / "report" / "table.md").is_file()  # the usual `fedlt report` tables beside it
    assert "paper's winner wins here" in capsys.readouterr().out


def test_reproduce_imagenet_lt_lists_from_python(tmp_path):
    data = write_imagenet_lt(tmp_path / "inet", counts=(16, 8, 4, 3), test_per_class=4)
    res = fedlt.reproduce("fedloge-table2", methods="fedavg,fedloge", settings=["imagenet-lt-a0.1"], seeds=[0],
                          rounds=1, data_dir=str(data), out=str(tmp_path / "rep"), threads=1, figures=False,
                          overrides={"model": "smallcnn", "clients": 3, "min_client_size": 1, "image_size": 32,
                                     "local_epochs": 1})
    _check_report(tmp_path / "rep", "fedloge-table2", "imagenet-lt-a0.1", ["fedavg", "fedloge"],
                  ["many", "medium", "few", "GM", "PM"], 1)
    assert res.report_path == tmp_path / "rep" / "report" / "reproduction.md"
    for k in res.rankings:  # each side ranked by its own numbers
        by = {r.method: r for r in res.rows if (r.setting, r.metric) == (k["setting"], k["metric"])}
        assert [by[m].paper for m in k["paper"]] == sorted((by[m].paper for m in k["paper"]), reverse=True)
        assert [by[m].ours for m in k["ours"]] == sorted((by[m].ours for m in k["ours"]), reverse=True)


def test_killed_reproduction_resumes_and_ends_like_an_uninterrupted_one(cifar_dir, tmp_path, monkeypatch):
    kw = dict(methods=["fedavg", "fedloge"], settings=["cifar10-lt-a1-if50"], seeds=[0], rounds=2,
              data_dir=str(cifar_dir), threads=1, figures=False,
              overrides={"model": "smallcnn", "clients": 4, "local_epochs": 1, "eval_every": 1})
    ref = fedlt.reproduce("fedloge-table1", out=str(tmp_path / "ref"), **kw)
    with dies_in_round(Simulation, 2, only=lambda sim: type(sim.method).__name__.lower().startswith("fedloge")):
        fedlt.reproduce("fedloge-table1", out=str(tmp_path / "cut"), **kw)
    again = fedlt.reproduce("fedloge-table1", out=str(tmp_path / "cut"), **kw)
    assert again.runs.counts == {"skipped": 1, "resumed": 1, "started": 0, "elsewhere": 0, "diverged": 0}
    key = lambda r: (r.method, r.setting, r.metric)  # noqa: E731
    assert [(key(r), r.ours, r.paper) for r in again.rows] == [(key(r), r.ours, r.paper) for r in ref.rows]
    assert all(r.ours is not None for r in again.rows if r.metric == "GM")


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("args,says", [
    (["nosuch-table"], "unknown table 'nosuch-table'"),
    (["fedloge-table1", "--methods", "fedavg,fedsomething"], "has no method 'fedsomething'"),
    (["fedloge-table1", "--settings", "cifar10-lt-a9-if1"], "has no setting 'cifar10-lt-a9-if1'"),
    (["fedloge-table1", "--rounds", "2.5"], "--rounds expects"),
    (["fedloge-table1", "--override", "seed=3"], "--override seed"),
    (["fedloge-table1", "--settings", "cifar10-lt-a1-if50", "--data-dir", "EMPTY"],
     "needs cifar10, not found"),
    (["fedloge-table2", "--settings", "imagenet-lt-a0.1", "--data-dir", "EMPTY"], "cannot be fetched"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args, says, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDLT_DATA", str(tmp_path / "nothing-here"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "nor-here"))
    (tmp_path / "empty").mkdir()
    args = [str(tmp_path / "empty") if a == "EMPTY" else a for a in args]
    out = tmp_path / "out"
    assert cli_main(["reproduce", *args, "--out", str(out), "--seeds", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "Traceback" not in err
    if "needs cifar10" in says:
        assert "fedlt data fetch cifar10" in err
    assert not out.exists()


def test_dry_run_lists_every_run_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDLT_DATA", str(tmp_path / "nothing-here"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "nor-here"))
    out = tmp_path / "out"
    assert cli_main(["reproduce", "redgrape-table2", "--methods", "fedavg,redgrape", "--seeds", "0,1",
                     "--rounds", "0.1", "--out", str(out), "--dry-run", "--device", "cuda"]) == 0
    text = capsys.readouterr().out  # a GPU reproduction is planned on any machine
    assert "36 runs = 2 methods x 9 settings x 2 seeds" in text
    assert sum(line.startswith("new ") for line in text.splitlines()) == 36
    assert "data cifar10: NOT FOUND; fedlt data fetch cifar10" in text
    assert "50 of 500 rounds" in text and "100 of 1000 rounds" in text  # RedGrape's partial setting, shortened
    assert not out.exists()
    assert math.isclose(tables()["redgrape-table2"].cell("redgrape", "cifar10-lt-ir100", "GM").value, 0.5711)
