"""The documentation runs, so that no page can drift from the program: every shell block of README.md and docs/
is run by a test, in order, in an empty folder (shortened where it would train for long), and what a page shows a
command printing is compared with what it prints; a block that cannot run here (it needs a GPU, a SLURM
allocation, other machines, the network, or it sets up the environment the tests run in) says so in its first
line, ``# not run by the tests: WHY``, and its ``fedlt`` command lines are still parsed, so that an option a page
shows exists. Also: the documentation site builds with ``mkdocs build --strict`` (no broken link, no page
missing from the navigation), its generated method and API references complete.

How a fenced block is run, by its info string:

- ``python file=NAME`` / ``toml file=NAME``: the block is written to NAME (before the page's commands run);
  ``python append=NAME``: appended;
- ``python``: run as a script (``python -c``); ``bash``: run by ``bash -euo pipefail`` (any failing command
  fails the test);
- ``text`` after a command: what it printed (:func:`check_output`, the tolerance rule: every line the page shows
  must be one of the output's, ``...`` standing for lines left out; a line without digits verbatim; a line with
  numbers in the same words and layout and, with ``FEDLT_DOCS_EXACT=1``, its numbers within 2 % or 0.5 of the
  printed ones (whichever is larger; times -- a number followed by ``s``, ``ms`` or ``min`` -- are free), and any
  number without it, where the test shortened the command, or where torch runs its plain CPU kernels, not the
  AVX2 / AVX-512 ones the pages were printed with (``PAGE_KERNELS``);
- other ``text`` blocks (listings, transcripts): their ``fedlt`` command lines are parsed.

Shortening (:func:`shorten`, pages named in ``SHORTEN``): every ``fedlt run``/``compare`` line trains one round
(two where it names more: enough for a page's divergence in round 2) of one local epoch (``--local-epochs 1``),
on Fashion-MNIST its long tail from 600 head-class samples instead of 6,000 (``--n-max 600``), with two torch
threads (where the machine has two cores; one beside the other process of `make test`'s two; the numbers of a
shortened command are not compared) and no progress bar, and ``--device cuda`` becomes ``--device cpu``.

The commands run with the test's Python first on PATH (``python``, ``fedlt``, ``pip``, and ``.venv/bin/fedlt`` in
the working folder), one torch thread, a private FEDLT_CACHE, and ``pip install`` redirected to a folder of the
temporary directory that is on PYTHONPATH (offline, no dependencies, no build isolation): the pages' literal
commands, without touching the test's environment.
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
import torch
from conftest import XDIST

ROOT = Path(__file__).resolve().parents[1]
# The pages' numbers were printed with torch's AVX2 / AVX-512 CPU kernels, and print within the tolerance rule with
# either (ATEN_CPU_CAPABILITY=avx2 and avx512: every page passes). Torch's plain kernels (a CPU without AVX2, or
# ATEN_CPU_CAPABILITY=default) round differently, and a short training run on digits lands elsewhere: GM 44.23
# became 47.50, a few-shot 16.83 became 23.08. There a training command's numbers are not compared (its words and
# layout still are), as for a shortened command. And two AVX-512 machines, the pages' and a later one with AMX,
# printed FedAvg's numbers alike but FedLoGe's apart (25.96 and 26.68 on docs/python-api.md, final GM 44.23 and
# 50.48 in docs/writing-a-method.md): FedLoGe's SSE-C was built in float32 then, whose 10,000 Adam steps give
# another matrix under each CPU's kernels. It is built in float64 now (fedlt.core.etf, tests/test_etf.py), and the
# pages' short FedLoGe runs were printed again on the second machine; the long runs' tables say how theirs were
# made. The numbers are still compared only where asked (FEDLT_DOCS_EXACT=1, on an AVX2 / AVX-512 machine), and by
# default a shown line is checked for its words and layout.
PAGE_KERNELS = os.environ.get("FEDLT_DOCS_EXACT") == "1" and \
    torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def code_blocks(text: str, gaps: bool = False) -> list[tuple]:
    """(language, options, code, line) of every fenced block of a Markdown text; with ``gaps``, also the text
    between the block before and this one."""
    out, end = [], 0
    for m in FENCE.finditer(text):
        info = m.group(1).split()
        opts = dict(x.split("=", 1) for x in info[1:] if "=" in x)
        block = (info[0] if info else "", opts, m.group(2), text.count("\n", 0, m.start()) + 1)
        out.append(block + (text[end:m.start()],) if gaps else block)
        end = m.end()
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


SHELL = ("bash", "sh", "shell", "console")
NOT_RUN = re.compile(r"^# not run by the tests: (\S.*)$")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?![\d.])", re.I)
TIME = re.compile(r"^\s?(?:s|ms|min)\b")


def not_run(code: str) -> str | None:
    """Why a block is not run (its first line, after a ``#!`` line, ``# not run by the tests: WHY``), or None."""
    lines = [x for x in code.strip().splitlines() if not x.startswith("#!")]
    first = lines[0] if lines else ""
    m = NOT_RUN.match(first.strip())
    return m.group(1) if m else None


def command_lines(code: str) -> list[str]:
    """The ``fedlt ...`` commands of a block (continuation lines joined, comments and prompts dropped)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"^\s*\$\s+", "", line)
        line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
        for part in re.split(r"\s*(?:&&|;|\|)\s*", line):
            part = re.sub(r"^(?:\.venv/bin/|\S*/)?fedlt\s", "fedlt ", part.strip())
            if part.startswith("fedlt "):
                out.append(part)
    return out


def parse_check(where: str, code: str) -> int:
    """Every ``fedlt`` command line of a block that is not run must parse (its sub-command and options exist);
    shell variables and placeholders are given stand-in values. Returns how many were checked."""
    import shlex

    from fedlt.cli import build_parser

    n = 0
    for cmd in command_lines(code):
        cmd = re.sub(r"\$\{?\w+\}?", "x", cmd)  # $HOME, $head:$port, ...
        cmd = re.sub(r"\[([^\]]*)\]", "", cmd)  # [--seed 1], [options of the row]: optional parts
        cmd = cmd.replace("...", "")
        argv = shlex.split(cmd)[1:]
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{where}: `{cmd}` does not parse (exit {e.code})")
        n += 1
    return n


# a shortened command's torch threads: the pages' commands run one at a time, and their numbers are not compared;
# one beside the other xdist worker (conftest.XDIST)
SHORT_THREADS = 1 if XDIST else min(2, os.cpu_count() or 1)


def shorten(code: str) -> str:
    """A block's commands as the test runs them (``SHORTEN``): one or two training rounds of one local epoch, less
    Fashion-MNIST, ``SHORT_THREADS`` threads, no progress bar, the CPU for CUDA."""
    def one(m):
        cmd = m.group(0)
        sub = re.match(r"(\S*fedlt)\s+(run|compare)\b", cmd)
        if sub is None:
            return cmd.replace("--device cuda", "--device cpu")
        rounds = re.search(r"--rounds[ =](\d+)", cmd)
        cmd = (cmd.replace(rounds.group(0), f"--rounds {min(int(rounds.group(1)), 2)}") if rounds
               else cmd + " --rounds 1")
        if "--local-epochs" not in cmd:
            cmd += " --local-epochs 1"
        data = re.search(r"--dataset[ =](\S+)", cmd)
        preset = re.search(r"--preset[ =](\S+)", cmd)
        fmnist = data.group(1) == "fashion-mnist" if data else preset is None or preset.group(1).startswith("fmnist")
        if fmnist and "--n-max" not in cmd and "--config" not in cmd:
            cmd += " --n-max 600"  # Fashion-MNIST's long tail from 600 head-class samples, not 6,000
        for flag, extra in (("--threads", f"--threads {SHORT_THREADS}"), ("--no-progress", "--no-progress")):
            if flag not in cmd and not (flag == "--no-progress" and sub.group(2) == "compare"):
                cmd += " " + extra
        return cmd.replace("--device cuda", "--device cpu")
    joined = re.sub(r"\\\n\s*", " ", code)
    return "\n".join(re.sub(r"^[^#\n]*?\S*fedlt\s+\w+[^#\n]*?(?=\s*(?:#.*)?$)", one, line)
                     for line in joined.splitlines())


def _masked(line: str) -> str:
    return " ".join(NUMBER.sub("<n>", line).split())


def _numbers(line: str) -> list[tuple[float, bool]]:
    """(value, is a time) of every number of a line."""
    out = []
    for m in NUMBER.finditer(line):
        try:
            v = float(m.group(0).replace(",", ""))
        except ValueError:
            continue
        out.append((v, bool(TIME.match(line[m.end():]))))
    return out


def check_output(where: str, shown: str, printed: str, exact: bool) -> None:
    """The tolerance rule (module docstring): every line ``shown`` is one of ``printed``'s -- without digits
    verbatim, with numbers in the same words and layout and, if ``exact``, each number within 2 % or 0.5 (times
    free)."""
    # pytest adds "(H:MM:SS)" to a summary past a minute (a slow machine): a time like the rest, free
    lines = [re.sub(r" \(\d+:\d\d:\d\d\)$", "", x.rstrip()) for x in printed.splitlines()]
    for expected in shown.splitlines():
        e = expected.strip()
        if not e or e == "...":
            continue
        if "..." in e:  # a line cut short: its pieces in order (a shortened command's numbers: any number)
            def piece(text):
                if exact:
                    return re.escape(text.strip())
                parts = NUMBER.split(text.strip())
                return r"[-+\d.,e]+".join(re.escape(x) for x in parts)
            pieces = [piece(p) for p in e.split("...")]
            pat = re.compile(".*".join(pieces))
            assert any(pat.search(x) for x in lines), f"{where}: no output line reads like {e!r}:\n{printed[-3000:]}"
            continue
        if not re.search(r"\d", e):
            assert any(e in x for x in lines), f"{where}: {e!r} is not in the output:\n{printed[-3000:]}"
            continue
        mask = _masked(e)
        cands = [x for x in lines if _masked(x).endswith(mask) or mask in _masked(x)]
        assert cands, f"{where}: no output line reads like {e!r}:\n{printed[-3000:]}"
        if not exact:
            continue
        want = _numbers(e)

        def close(x):
            got = _numbers(x)[-len(want):] if want else []
            return len(got) == len(want) and all(t or abs(a - b) <= max(0.02 * abs(b), 0.5)
                                                 for (a, _), (b, t) in zip(got, want))
        assert any(close(x) for x in cands), f"{where}: {e!r} is printed with other numbers: {cands[:3]}"


def run_blocks(name: str, text: str, cwd: Path, env: dict[str, str], short: bool = False,
               python: bool = True) -> list[str]:
    """Run every block of the Markdown ``text`` in order in ``cwd`` (``short``: shortened, :func:`shorten`;
    ``python``: the ``python`` blocks too, else they are excerpts); returns the output of each command run. A
    block marked not run is parsed instead."""
    outputs: list[str] = []
    last, exact = None, True
    blocks = code_blocks(text, gaps=True)
    for lang, opts, code, line, _ in blocks:  # the files a page defines, before its commands use them
        if lang in ("python", "toml", "text") and "file" in opts:
            (cwd / opts["file"]).write_text(code)
    for lang, opts, code, line, gap in blocks:
        where = f"{name}:{line}"
        if gap.strip():  # prose between: a text block after it is not what the command before printed
            last = None
        if "file" in opts and lang in ("python", "toml", "text"):
            last = None
        elif lang == "python" and "append" in opts:
            with open(cwd / opts["append"], "a") as f:
                f.write(code)
        elif lang in SHELL and not_run(code):
            parse_check(where, code)
            last = None
        elif ((lang == "python" and python) or lang in SHELL) and not opts:
            run = shorten(code) if short and lang in SHELL else code
            exact = run == code
            argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", run]
            t0 = time.perf_counter()
            r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
            if os.environ.get("FEDLT_DOCS_TIMES"):
                print(f"{where}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            assert r.returncode == 0, f"{where} failed ({r.returncode}):\n{run}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            last = r.stdout + r.stderr
            outputs.append(last)
        elif lang == "text" and not opts:
            if last is None:
                parse_check(where, code)  # a listing or transcript: its commands must exist
            else:
                check_output(where, code, last, exact and PAGE_KERNELS)
                last = None
        elif lang in ("", "text", "toml", "python") and not opts:
            last = None  # a listing, a code excerpt
        else:
            pytest.fail(f"{where}: a ```{lang} {opts} block this test does not know how to run")
    return outputs


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


# ------------------------------------------------------------------------------------------- every other page
# pages (and sections) that a test above runs block by block
RUN_ABOVE = {"README.md": "A 30-second tour", "docs/getting-started.md": "A 30-second tour",
             "docs/writing-a-method.md": None, "docs/python-api.md": None, "docs/reproduce.md": None,
             "docs/evaluation.md": None, "docs/trackers.md": None, "docs/flower-datasets.md": None,
             "docs/dropout.md": None}  # tests/test_dropout.py runs dropout.md
# pages whose commands train for long as written: run shortened (module docstring)
SHORTEN = {"docs/running.md", "docs/sweeps.md", "docs/methods-guide.md", "docs/cluster.md"}
# files a page's commands use that the page does not show (a sweep file of the reader's)
GRID = """seeds = [0]
out = "runs/grid"
[base]
dataset = "digits"
imbalance_ratio = 10
clients = 4
rounds = 1
local_epochs = 1
eval_every = 1
[methods]
fedavg = {}
fedprox = { params = { mu = 0.01 } }
"""
FIXTURES = {"docs/sweeps.md": {"grid.toml": GRID}, "docs/cluster.md": {"grid.toml": GRID},
            "docs/running.md": {"my.toml": ("toml", 0)}}  # the page's first TOML block is the my.toml it runs


def pages() -> list[str]:
    return ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


def page_text(page: str) -> str:
    """A page less the section a test above runs (the whole page: "")."""
    text = (ROOT / page).read_text()
    if page in RUN_ABOVE:
        heading = RUN_ABOVE[page]
        return text.replace(section(text, heading), "") if heading else ""
    return text


def work_dir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """An empty folder with ``.venv/bin/fedlt`` (the test's fedlt, as the pages write it) and the environment
    the pages' commands run in (this checkout's fedlt first)."""
    work = tmp_path / "work"
    (work / ".venv" / "bin").mkdir(parents=True)
    for name, cmd in (("fedlt", "-m fedlt"), ("python", "")):
        f = work / ".venv" / "bin" / name
        f.write_text(f'#!/bin/sh\nexec "{sys.executable}" {cmd} "$@"\n')
        f.chmod(0o755)
    env = {**doc_env(tmp_path), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "HOME": str(work)}
    return work, env


def test_every_shell_block_is_run_or_says_why_not():
    """A shell block is run by a test (a page above, or test_page_commands_run), or its first line says why not
    here; what is not run is at most the blocks that need what the test machines lack."""
    unrun, marked = [], []
    for page in pages():
        for lang, opts, code, line in code_blocks((ROOT / page).read_text()):
            if lang not in SHELL and lang != "":
                continue
            if lang == "" and not command_lines(code):
                continue  # a listing (a folder tree)
            why = not_run(code)
            first = code.strip().splitlines()[0] if code.strip() else ""
            assert why or not first.startswith("# not run"), \
                f"{page}:{line}: its first line must read '# not run by the tests: WHY' (else the block runs)"
            (marked if why else unrun).append((f"{page}:{line}", why))
    print(f"\n{len(unrun)} shell blocks run, {len(marked)} marked not run here:")
    for where, why in marked:
        print(f"  {where}: {why}")
    assert all(why.strip() for _, why in marked)
