"""Compare, sweep, resume and report: behaviour that could break, on tiny digits federations."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fedlt.experiments
from fedlt import safefile
from fedlt.cli import main as cli_main
from fedlt.engine import EngineConfig, Simulation
from fedlt.errors import ConfigError
from fedlt.runner import rundir
from fedlt.runner.rundir import federation_for, prepare
from fedlt.experiments import report as R
from fedlt.runner.runstate import load_final_state
from fedlt.experiments.sweep import Sweep, parse_sweep, plan, run_plan
from fedlt.registry import METHODS

from conftest import dies_in_round, method_test_params, small_config

TINY = dict(dataset="digits", clients=6, alpha=1.0, rounds=2, eval_every=1, local_epochs=1, batch_size=16,
            model="smallcnn")
QUIET = dict(progress=False, echo=lambda *a, **k: None)


def _strip(ev: dict) -> dict:
    return {k: v for k, v in ev.items() if k != "eval_time"}


def _evals(history):
    return [_strip(h["eval"]) for h in history if "eval" in h]


# ---------------------------------------------------------------------------------------------- resume
_FED = {}


def _sim(method: str, params: dict | None = None, **over) -> Simulation:
    cfg = small_config(method=method, rounds=2, eval_every=1, local_epochs=1,
                       params={**method_test_params(method), **(params or {})}, **over)
    if "fed" not in _FED:
        _FED["fed"] = federation_for(cfg)
    pr = prepare(cfg, _FED["fed"])
    return Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))


# options that add random draws of their own to a round (each resumes like its method's default)
VARIANTS = {"creff+dsa": ("creff", {"dsa": True})}


@pytest.mark.parametrize("variant", METHODS.names() + list(VARIANTS))
def test_every_method_resumes_exactly(variant):
    """Round + server state + client states + method state + RNG states suffice: the state saved after round 1,
    loaded into a fresh Simulation (fresh method object) and continued, ends exactly as the run it came from."""
    method, params = VARIANTS.get(variant, (variant, {}))
    full, saved = _sim(method, params), {}

    def save_after_first(sim):
        if sim.round == 1:  # written as a checkpoint is (safetensors + JSON), read back by the safe loader
            saved["ck"] = safefile.dumps(sim.state_dict(), "checkpoint")

    full.after_round.append(save_after_first)
    ref = full.run()
    torch.manual_seed(12345)  # whatever the global RNG holds now must not matter
    resumed = _sim(method, params)
    resumed.load_state_dict(safefile.loads(saved["ck"], "checkpoint"))
    assert resumed.round == 1
    out = resumed.run()
    assert _strip(out) == _strip(ref), f"{method}: resumed run ends differently"
    cls = METHODS.get(method)  # what `fedlt list` says of the method is what its evaluation has
    assert bool(ref["global"]) == cls.generic and (ref["personal"][next(iter(ref["personal"]))]["source"]
                                                     == "personal") == cls.personalized, method
    assert _evals(resumed.history) == _evals(full.history)


def _tiny_sweep(out, methods=("fedavg", "fedprox"), settings=None, seeds=(0,), **base) -> Sweep:
    return parse_sweep({"seeds": list(seeds), "base": {**TINY, **base},
                        "settings": settings or {"rho10": {"imbalance_ratio": 10}},
                        "methods": list(methods)}, str(out))


def test_killed_run_resumes_from_checkpoint_without_duplicate_rounds(tmp_path, monkeypatch):
    """Killed in round 4 with checkpoints at rounds 2 and 4: round 3 was logged after the last checkpoint.
    The restart continues from round 2, ends with the uninterrupted run's metrics, and logs each round once."""
    base = dict(rounds=5, eval_every=1)
    ref_runs = plan(_tiny_sweep(tmp_path / "ref", methods=["fedavg"], **base))
    run_plan(ref_runs, checkpoint_every=2, **QUIET)

    runs = plan(_tiny_sweep(tmp_path / "cut", methods=["fedavg"], **base))
    with dies_in_round(Simulation, 4):
        run_plan(runs, checkpoint_every=2, **QUIET)
    d = runs[0].dir
    assert runs[0].status() == "partial"
    assert [json.loads(x)["round"] for x in (d / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    counts = run_plan(runs, checkpoint_every=2, **QUIET)
    assert counts == {"skipped": 0, "resumed": 1, "started": 0, "elsewhere": 0, "diverged": 0}
    got = json.loads((d / "summary.json").read_text())
    want = json.loads((ref_runs[0].dir / "summary.json").read_text())
    assert got["resumed_after_round"] == 2
    assert got["last3"] == want["last3"]
    assert _strip(got["final"]) == _strip(want["final"])
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in recs if "round" in r] == [1, 2, 3, 4, 5]
    assert not any(d.glob("checkpoint*"))


def test_a_checkpointed_sweep_run_with_other_settings_names_the_sweeps_fixes(tmp_path):
    """A sweep's partial run resumed under changed settings: the line names the run and what changed, and the
    fixes a sweep has (as for a finished run) -- not ``fedlt run``'s --resume or --name, which ``fedlt sweep``
    does not take."""
    runs = plan(_tiny_sweep(tmp_path, methods=["fedavg"], rounds=3))
    with dies_in_round(Simulation, 2):
        run_plan(runs, checkpoint_every=1, **QUIET)
    with pytest.raises(ConfigError) as e:
        run_plan(plan(_tiny_sweep(tmp_path, methods=["fedavg"], rounds=3, lr=0.01)), checkpoint_every=1, **QUIET)
    line = str(e.value)
    assert f"checkpointed run {runs[0].dir}" in line and "(lr: " in line and "another sweep directory" in line, line
    assert "--" not in line, line


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    """2 methods x 2 settings x 1 seed, finished (shared by the skip, report and figure tests)."""
    out = tmp_path_factory.mktemp("sweep")
    sw = _tiny_sweep(out, settings={"rho10": {"imbalance_ratio": 10}, "rho50": {"imbalance_ratio": 50}})
    run_plan(plan(sw), **QUIET)
    return out, sw


def test_sweep_skips_finished_runs_and_reruns_only_missing(sweep_dir, monkeypatch):
    out, sw = sweep_dir
    runs = plan(sw)
    assert len(runs) == 4 and len({r.dir for r in runs}) == 4
    assert all(r.status() == "done" for r in runs)
    calls = []
    real = rundir.run
    monkeypatch.setattr(rundir, "run", lambda cfg, *a, **k: calls.append(cfg.name) or real(cfg, *a, **k))
    assert run_plan(runs, **QUIET) == {"skipped": 4, "resumed": 0, "started": 0, "elsewhere": 0, "diverged": 0}
    assert calls == []
    victim = runs[2]
    (victim.dir / "summary.json").unlink()
    assert run_plan(plan(sw), **QUIET) == {"skipped": 3, "resumed": 0, "started": 1, "elsewhere": 0, "diverged": 0}
    assert calls == [victim.cfg.name]
    changed = _tiny_sweep(out, settings={"rho10": {"imbalance_ratio": 10}, "rho50": {"imbalance_ratio": 50}},
                          lr=0.01)
    with pytest.raises(ConfigError, match="other settings"):
        run_plan(plan(changed), **QUIET)


def test_compare_gives_every_method_the_same_partition_and_clients(tmp_path):
    argv = ["compare", "--methods", "fedavg,fedprox", "--seeds", "0,1", "--dataset", "digits", "--rho", "10",
            "--clients", "6", "--alpha", "1", "--rounds", "3", "--eval-every", "3", "--local-epochs", "1",
            "--model", "smallcnn", "--out", str(tmp_path), "--name", "cmp", "--no-progress", "--no-report",
            "--set", "fedprox.mu=0.5"]
    assert cli_main(argv) == 0
    root = tmp_path / "cmp"
    (setting,) = [p.name for p in root.iterdir() if p.is_dir()]

    def load(method, seed):
        d = root / setting / method / f"seed{seed}"
        part = json.loads((d / "partition.json").read_text())
        sched = [json.loads(x)["clients"] for x in (d / "metrics.jsonl").read_text().splitlines()
                 if '"round"' in x]
        return part, sched, json.loads((d / "config.json").read_text())

    for seed in (0, 1):
        pa, sa, ca = load("fedavg", seed)
        pp, sp, cp = load("fedprox", seed)
        assert pa == pp and sa == sp and len(sa) == 3
        assert cp["method_params"] == {"mu": 0.5} and ca["method"] == "fedavg"
    # and the check has teeth: another seed is another partition and another sampling stream
    assert load("fedavg", 0)[0] != load("fedavg", 1)[0]
    assert load("fedavg", 0)[1] != load("fedavg", 1)[1]


def test_federation_and_schedule_are_functions_of_the_seed():
    """Why separate processes (a restarted sweep) see the same clients: rebuilt from scratch, equal."""
    cfg = small_config()
    a, b = federation_for(cfg), federation_for(cfg)
    assert (a.counts == b.counts).all()
    assert all(torch.equal(x.x, y.x) and torch.equal(x.test_y, y.test_y) for x, y in zip(a.clients, b.clients))
    s1 = Simulation(prepare(cfg, a).method, a, EngineConfig(rounds=8, participation=0.5, eval_every=4, seed=0, progress=False)).schedule
    s2 = Simulation(prepare(cfg, b).method, b, EngineConfig(rounds=8, participation=0.5, eval_every=4, seed=0, progress=False)).schedule
    assert s1 == s2


# ---------------------------------------------------------------------------------------------- report
def _fake_run(root, method, setting, seed, gm, pm, many=0.5):
    d = root / setting / method / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"method": method, "seed": seed,
                                               "labels": {"method": method, "setting": setting, "seed": seed}}))
    last3 = {"GM[global].acc": gm, "GM[global].many": many, "GM[global].medium": None, "GM[global].few": 0.1,
             "PM[personal].acc": pm}
    final = {"global": {"global": {"acc": gm / 2, "many": None, "medium": None, "few": None}},
             "personal": {"personal": {"acc": pm / 2}}}
    (d / "summary.json").write_text(json.dumps({"last3": last3, "final": final, "wall_time": 1.0}))


def test_report_mean_std_and_best_per_column(tmp_path):
    # setting s1: A best on GM, B best on PM; s2: B and C tie on GM at the printed precision
    vals = {("A", "s1"): ([0.80, 0.82, 0.84], [0.60, 0.61, 0.62]),
            ("B", "s1"): ([0.70, 0.75, 0.71], [0.90, 0.70, 0.80]),
            ("C", "s1"): ([0.10, 0.20, 0.30], [0.50, 0.50, 0.50]),
            ("A", "s2"): ([0.40, 0.40, 0.40], [0.30, 0.35, 0.40]),
            ("B", "s2"): ([0.50, 0.60, 0.70], [0.20, 0.20, 0.20]),
            ("C", "s2"): ([0.60, 0.60, 0.60], [0.10, 0.10, 0.10])}
    for (m, s), (gms, pms) in vals.items():
        for seed, (g, p) in enumerate(zip(gms, pms)):
            _fake_run(tmp_path, m, s, seed, g, p)
    runs, methods, settings = R.collect(tmp_path)
    assert sorted(methods) == ["A", "B", "C"] and sorted(settings) == ["s1", "s2"]
    cells = R.aggregate(runs)
    for (m, s), (gms, pms) in vals.items():
        assert cells[(m, s)]["GM"].mean == pytest.approx(statistics.mean(gms))
        assert cells[(m, s)]["GM"].std == pytest.approx(statistics.stdev(gms))
        assert cells[(m, s)]["PM"].std == pytest.approx(statistics.stdev(pms))
    assert cells[("A", "s1")]["medium"].mean is None  # None values are left out, not counted as 0
    assert R.best(cells, methods, "s1", "GM") == {"A"}
    assert R.best(cells, methods, "s1", "PM") == {"B"}
    assert R.best(cells, methods, "s2", "GM") == {"B", "C"}  # 60.00 and 60.00
    methods, settings = ["A", "B", "C"], ["s1", "s2"]
    md = R.markdown_table(cells, methods, settings).splitlines()
    assert md[0] == "| method | s1 GM | s1 PM | s2 GM | s2 PM |"
    row = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in md[2:]}
    assert row["A"][0] == f"**82.00 ± {100 * statistics.stdev([0.80, 0.82, 0.84]):.2f}**"
    assert [c.startswith("**") for c in row["B"]] == [False, True, True, False]
    assert [c.startswith("**") for c in row["C"]] == [False, False, True, False]
    tex = R.latex_table(cells, methods, settings)
    assert tex.count("\\textbf{") == 5
    csv_best = [line.split(",") for line in R.csv_table(cells, methods, settings).splitlines()[1:]]
    assert sorted((m, s, k) for m, s, k, *_, b, _status in csv_best if b == "1" and k in ("GM", "PM")) == \
        [("A", "s1", "GM"), ("A", "s2", "PM"), ("B", "s1", "PM"), ("B", "s2", "GM"), ("C", "s2", "GM")]
    fin = R.aggregate(runs, "final")
    assert fin[("A", "s1")]["GM"].mean == pytest.approx(0.41)


def test_report_tables_without_matplotlib(tmp_path, monkeypatch):
    _fake_run(tmp_path, "A", "s1", 0, 0.5, 0.6)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "fedlt.experiments.figures", raising=False)
    monkeypatch.delattr(fedlt.experiments, "figures", raising=False)  # imported by an earlier test: forget it
    out = R.write_report(tmp_path, echo=lambda *a: None)
    page = (out / "report.md").read_text()
    assert "matplotlib is not installed" in page and "50.00" in page
    assert not (out / "figures").exists() or not list((out / "figures").iterdir())


def test_report_figures_are_valid_pngs(sweep_dir):
    pytest.importorskip("matplotlib")
    from PIL import Image

    out, sw = sweep_dir
    heads = load_final_state(out / "rho10" / "fedavg" / "seed0")["heads"]
    assert heads["server"]["weights/head.weight"].shape[0] == 10  # found generically, labelled by key
    rep = R.write_report(out, echo=lambda *a: None)
    pngs = sorted((rep / "figures").glob("*.png"))
    kinds = {p.name.split("_rho")[0] for p in pngs}
    assert kinds == {"curves", "per_class", "head_norms", "partition"} and len(pngs) == 8
    page = (rep / "report.md").read_text()
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(p) as im:
            im.verify()
        with Image.open(p) as im:
            assert min(im.size) > 200
            assert len(np.unique(np.asarray(im.convert("L")))) > 20  # something was drawn
        assert f"figures/{p.name}" in page


def test_run_json_has_a_line_per_row_and_reads_back_as_written():
    """jsonutil.dumps (partition.json, summary.json): the same JSON as json.dumps, with each list of plain values
    on one line -- rows of numbers cut between rows, never inside a string that looks like one."""
    from fedlt.jsonutil import dumps, jsonable

    doc = {"counts": np.arange(12).reshape(4, 3), "sizes": [3, 1], "empty": [[], [1]], "deep": [[[1]], [2]],
           "words": [["a"], ["b], [c"]], "mixed": [np.arange(2), [3.5, None]], "t": {"u": {}, "v": ()}, "s": 'x"y'}
    text = dumps(doc)
    assert json.loads(text) == json.loads(json.dumps(doc, default=jsonable))
    lines = text.splitlines()
    assert "  [3, 4, 5]," in lines and ' "sizes": [3, 1],' in lines and '  ["b], [c"]' in lines
    assert len(lines) == len(dumps(json.loads(text)).splitlines())  # numpy or lists: the same layout


def test_the_partition_figure_of_a_large_population_draws_a_seeded_sample(tmp_path, monkeypatch):
    """A per-client figure of 100,000 clients costs what one of 100 costs: every client up to HEATMAP_CLIENTS,
    else that many drawn from the run's seed (sorted, distinct), said in the axis label and the caption."""
    pytest.importorskip("matplotlib")
    from types import SimpleNamespace

    from matplotlib.axes import Axes

    from fedlt.experiments import figures

    drawn = []
    real = Axes.imshow
    monkeypatch.setattr(Axes, "imshow", lambda self, a, **kw: drawn.append(np.asarray(a)) or real(self, a, **kw))
    rng = np.random.default_rng(0)
    for K in (30, 5000):
        run = SimpleNamespace(dir=tmp_path / f"K{K}", seed=3)
        run.dir.mkdir()
        counts = rng.integers(0, 5, (K, 10))
        (run.dir / "partition.json").write_text(json.dumps({"client_class_counts": counts.tolist()}))
        title, path, caption = figures.partition_heatmap([run], ["fedavg"], f"K{K}", tmp_path)
        rows = figures.shown_clients(K, 3)
        assert len(rows) == min(K, figures.HEATMAP_CLIENTS) and len(set(rows.tolist())) == len(rows)
        assert list(rows) == sorted(rows) and list(rows) == list(figures.shown_clients(K, 3))
        assert np.array_equal(drawn[-1], np.log1p(counts[rows]))
        assert ("100 of the 5,000 clients" in caption) == (K == 5000)


def test_sweep_file_errors_are_one_line_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown key"):
        parse_sweep({"sede": [0]}, str(tmp_path))
    with pytest.raises(ConfigError, match="label"):
        parse_sweep({"settings": {"a/b": {}}}, str(tmp_path))
    with pytest.raises(ConfigError, match="rho10/nosuch/seed0"):
        plan(_tiny_sweep(tmp_path, methods=["nosuch"]))
    with pytest.raises(ConfigError, match="set by the sweep"):
        plan(_tiny_sweep(tmp_path, seed=3))
    f = tmp_path / "bad.toml"
    f.write_text("seeds = [0, 0]\n")
    assert cli_main(["sweep", str(f)]) == 2


@pytest.mark.parametrize("toml", sorted((Path(__file__).parents[1] / "benchmarks").glob("*.toml")),
                         ids=lambda p: p.name)
def test_the_benchmark_sweeps_plan_every_run_they_document(toml):
    """A sweep file the docs tell users to run resolves every run: a method parameter misspelt or out of range,
    or a setting that does not exist, fails here instead of after hours of the runs before it."""
    from fedlt.experiments.sweep import load_sweep

    sweep = load_sweep(toml)
    runs = plan(sweep)
    assert len(runs) == len(sweep.seeds) * len(sweep.settings) * len(sweep.methods)
    assert {r.cfg.method for r in runs} <= set(METHODS.names())
