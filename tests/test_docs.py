"""The documentation runs: every code block of docs/writing-a-method.md in order in an empty folder, the
README's 30-second tour and the Python API page's example, so none can rot; and the documentation site builds
with ``mkdocs build --strict`` (no broken link, no page missing from the navigation), its generated method and
API references complete.

How a fenced block is run, by its info string:

- ``python file=NAME`` / ``toml file=NAME``: the block is written to NAME; ``python append=NAME``: appended;
- ``python``: run as a script (``python -c``); ``bash``: run by ``bash -euo pipefail`` (any failing command
  fails the test);
- ``text``: what the block before printed. Its lines without a digit (headers, mode names) must appear in that
  output; lines with numbers are the ones a reader's run may change, and ``...`` stands for lines left out.

Any other block fails the test, so a new block cannot be left unrun. The commands run with the test's Python
first on PATH (``python``, ``fedlt``, ``pip``), one torch thread, a private FEDLT_CACHE, and ``pip install``
redirected to a folder of the temporary directory that is on PYTHONPATH (offline, no dependencies, no build
isolation): the tutorial's literal commands, without touching the test's environment.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def code_blocks(text: str) -> list[tuple[str, dict[str, str], str, int]]:
    """(language, options, code, line) of every fenced block of a Markdown text."""
    out = []
    for m in FENCE.finditer(text):
        info = m.group(1).split()
        opts = dict(x.split("=", 1) for x in info[1:] if "=" in x)
        out.append((info[0] if info else "", opts, m.group(2), text.count("\n", 0, m.start()) + 1))
    return out


def doc_env(tmp: Path) -> dict[str, str]:
    site = tmp / "site-packages"
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "FEDLT_CACHE": str(tmp / "cache"),
            "FEDLT_PLUGIN_PATH": str(site),
            "FEDLT_TENSORBOARD": "0", "MPLBACKEND": "Agg",
            # pip stores PIP_NO_BUILD_ISOLATION's value in build_isolation: "0" is --no-build-isolation
            "PIP_TARGET": str(site), "PIP_NO_DEPS": "1", "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def run_blocks(name: str, text: str, cwd: Path, env: dict[str, str]) -> list[str]:
    """Run every block of the Markdown ``text`` in order in ``cwd``; returns the output of each command."""
    outputs: list[str] = []
    last = None
    for lang, opts, code, line in code_blocks(text):
        where = f"{name}:{line}"
        if lang in ("python", "toml") and "file" in opts:
            (cwd / opts["file"]).write_text(code)
        elif lang == "python" and "append" in opts:
            with open(cwd / opts["append"], "a") as f:
                f.write(code)
        elif lang in ("python", "bash") and not opts:
            argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
            t0 = time.perf_counter()
            r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
            if os.environ.get("FEDLT_DOCS_TIMES"):
                print(f"{where}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            assert r.returncode == 0, f"{where} failed ({r.returncode}):\n{code}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            last = r.stdout + r.stderr
            outputs.append(last)
        elif lang == "text" and not opts:
            assert last is not None, f"{where}: an output block with no command before it"
            for expected in code.splitlines():
                if expected.strip() and expected.strip() != "..." and not re.search(r"\d", expected):
                    assert expected.rstrip() in last, f"{where}: {expected!r} is not in the output:\n{last}"
        else:
            pytest.fail(f"{where}: a ```{lang} {opts} block this test does not know how to run")
    return outputs


def test_writing_a_method_tutorial_runs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    doc = ROOT / "docs" / "writing-a-method.md"
    outputs = run_blocks(doc.name, doc.read_text(), work, doc_env(tmp_path))
    assert len(outputs) == 4
    # the blocks did what the tutorial says: a method file, its tests, a comparison with a report, a plugin
    assert "4 passed" in outputs[0]
    report = (work / "runs" / "la-vs-fedloge" / "report" / "report.md").read_text()
    assert "fedavg-la" in report and "fedloge" in report
    assert list((tmp_path / "site-packages").glob("fedavg_la-*.dist-info/entry_points.txt"))
    assert "(plugin fedavg-la 0.1.0)" in outputs[-1]


def section(text: str, heading: str) -> str:
    """A ``## heading`` section of a Markdown text, up to the next ``## ``."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_python_api_page_example_runs(tmp_path):
    """The notebook-style example of docs/python-api.md (its python and text blocks)."""
    text = (ROOT / "docs" / "python-api.md").read_text()
    assert [b for b in code_blocks(text) if b[0] == "python"], "the Python API page lost its example"
    work = tmp_path / "work"
    work.mkdir()
    (out,) = run_blocks("python-api.md", text, work, doc_env(tmp_path))
    assert "| fedavg |" in out and "| fedloge |" in out


def test_readme_tour_runs(tmp_path):
    """The README's tour, as printed (``.venv/bin/fedlt``, here the test's fedlt): one run, one comparison, one
    report with the figure the README shows. The getting-started page shows the same commands."""
    tour = section((ROOT / "README.md").read_text(), "A 30-second tour")
    commands = [b for b in code_blocks(tour) if b[0] == "bash"]
    assert commands, "the README's tour lost its commands"
    guide = section((ROOT / "docs" / "getting-started.md").read_text(), "A 30-second tour")
    assert [b[2] for b in code_blocks(guide) if b[0] == "bash"] == [b[2] for b in commands], \
        "docs/getting-started.md's tour differs from the README's"
    work = tmp_path / "work"
    (work / ".venv" / "bin").mkdir(parents=True)
    fedlt = work / ".venv" / "bin" / "fedlt"
    fedlt.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fedlt "$@"\n')
    fedlt.chmod(0o755)
    env = {**doc_env(tmp_path), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # this checkout's fedlt
    (out,) = run_blocks("README.md#a-30-second-tour", tour, work, env)
    assert "| fedavg |" in out and "| fedloge |" in out
    figures = work / "runs" / "cmp" / "report" / "figures"
    assert list(figures.glob("head_norms_*.png")), f"no head-norm figure in {figures}"
    assert (ROOT / "docs" / "img" / "tour-head-norms.png").is_file()


def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict`` of mkdocs.yml succeeds, with one reference page per built-in method (its
    parameters and defaults from its Params), every name of ``fedlt.__all__`` in the API reference, and every
    page of docs/ in the navigation; the same site with one broken link planted fails."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    import dataclasses

    import fedlt

    def build(root: Path, out: Path):
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                               str(root / "mkdocs.yml"), "--site-dir", str(out)],
                              env=env, capture_output=True, text=True, timeout=300)

    site = tmp_path / "site"
    r = build(ROOT, site)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name, cls in fedlt.METHODS.items():
        if fedlt.METHODS.origin(name) != "built-in":
            continue
        page = (site / "methods" / name / "index.html").read_text()
        for f in dataclasses.fields(cls.Params):
            assert f"<code>{f.name}</code>" in page, f"methods/{name}: parameter {f.name} missing"
    api = (site / "api" / "index.html").read_text()
    missing = [n for n in fedlt.__all__ if f'id="fedlt.{n}"' not in api]
    assert not missing, f"the API reference lacks {missing}"
    pages = {p.relative_to(ROOT / "docs").with_suffix("").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert all((site / p / "index.html").is_file() or p == "index" for p in pages)

    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text())
    (planted / "src").symlink_to(ROOT / "src")
    shutil.copytree(ROOT / "docs", planted / "docs")
    with open(planted / "docs" / "running.md", "a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    r = build(planted, tmp_path / "planted-site")
    assert r.returncode != 0 and "no-such-page.md" in r.stdout + r.stderr


def test_reproduce_page_runs(tmp_path):
    """docs/reproduce.md: its `--list` and `--dry-run` blocks (no data needed; the GPU commands are indented
    text, not run)."""
    work = tmp_path / "work"
    work.mkdir()
    doc = ROOT / "docs" / "reproduce.md"
    outputs = run_blocks(doc.name, doc.read_text(), work, {**doc_env(tmp_path), "FEDLT_DATA": str(tmp_path / "none")})
    assert len(outputs) == 2 and "fedloge-table1" in outputs[0] and "balancefl-table4" in outputs[0]
    assert "6 runs = 2 methods x 1 settings x 3 seeds" in outputs[1] and not (work / "runs").exists()


def test_evaluation_page_runs(tmp_path):
    """docs/evaluation.md's cross-device example: 1,000 clients, PM over a seeded sample of 100."""
    work = tmp_path / "work"
    work.mkdir()
    doc = ROOT / "docs" / "evaluation.md"
    (out,) = run_blocks(doc.name, doc.read_text(), work, doc_env(tmp_path))
    assert "PM over 100 of 1,000 clients (a seeded sample; --eval-clients)" in out


def test_trackers_page_runs(tmp_path):
    """docs/trackers.md: a run sent to MLflow and W&B (offline), and its numbers read back from MLflow's store
    beside metrics.jsonl's (this tree's fedlt, not the installed one)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    work = tmp_path / "work"
    work.mkdir()
    doc = ROOT / "docs" / "trackers.md"
    env = doc_env(tmp_path)
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env["PYTHONPATH"]]), WANDB_MODE="offline",
               WANDB_SILENT="true", MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("WANDB_SERVICE", None)  # a W&B service of this test process (other tests): the command starts its own
    _, out = run_blocks(doc.name, doc.read_text(), work, env)
    rows = [line.split() for line in out.splitlines() if line.startswith("round ")]
    assert [r[1] for r in rows] == ["1", "2", "3"] and all(r[5] == r[7] for r in rows)  # jsonl == MLflow
    assert list(work.glob("runs/first/wandb/offline-run-*/run-*.wandb")), list(work.rglob("*"))[:40]


def test_flower_datasets_page_runs(tmp_path):
    """docs/flower-datasets.md: a saved Hugging Face dataset run, Flower Datasets partitioners, the one-line error
    of an unknown partitioner, and LongTailPartitioner giving the run's clients (offline, telemetry off; this
    tree's fedlt, not the installed one)."""
    pytest.importorskip("flwr_datasets")
    work = tmp_path / "work"
    work.mkdir()
    doc = ROOT / "docs" / "flower-datasets.md"
    env = doc_env(tmp_path)
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env["PYTHONPATH"]]))
    outputs = run_blocks(doc.name, doc.read_text(), work, env)
    assert len(outputs) == 6 and "the same rows as partition.json: True" in outputs[-1]
    runs = [p.name for p in (work / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 3 and "digits-hf" in runs and not [r for r in runs if "flwr-Dirichlet-" in r]
