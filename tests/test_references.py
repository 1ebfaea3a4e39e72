"""No dangling references: what the code, tests, benchmarks and docs cite must be in this repository.

A reference is dangling when it names a folder outside the repository (``shared/...``: the project's private
notes), a top-level Markdown file that is not there (``BENCHMARKS.md``), a repository path (``docs/...``,
``src/...``, ``tests/...``, ``benchmarks/...``) that does not exist, or a relative Markdown link whose target
does not exist. Papers and official code are cited by title and repository name instead.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("src", "tests", "benchmarks", "docs", ".ci")
TOP = ("README.md", "pyproject.toml", "Makefile", "mkdocs.yml")
SUFFIXES = {".py", ".md", ".toml", ".sh", ".yml", ".yaml", ".cfg", ".txt", ""}

OUTSIDE = re.compile(r"(?<![\w./-])(?:\.\./)*shared/[\w./-]*")
TOP_MD = re.compile(r"(?<![\w./-])([A-Z][A-Z0-9_-]*\.md)\b")
REPO_PATH = re.compile(r"(?<![\w./-])((?:docs|src|tests|benchmarks|\.ci)/[\w./-]*[\w-])")
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def files(root: Path) -> list[Path]:
    """The repository's files that may cite others (not what a build or an install leaves: caches, egg-info
    with a copy of an older README)."""
    out = [root / n for n in TOP if (root / n).is_file()]
    for d in SCANNED:
        out += sorted(p for p in (root / d).rglob("*") if p.is_file() and p.suffix in SUFFIXES
                      and not any(part == "__pycache__" or part.endswith(".egg-info") for part in p.parts))
    return out


def generated_pages(root: Path) -> set[Path]:
    """The pages the documentation site's hook (docs/gen_reference.py) writes at build time -- the method, API,
    settings and privacy references: not files of the repository, but a link or path to one is not dangling."""
    hook = root / "docs" / "gen_reference.py"
    if not hook.is_file():
        return set()
    spec = importlib.util.spec_from_file_location("_fedlt_gen_reference", hook)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {(root / "docs" / p).resolve() for p in mod.page_uris(root)}


def dangling(root: Path, skip: tuple[Path, ...] = ()) -> list[str]:
    """``file:line: reference (why)`` for every dangling reference under ``root`` (less the ``skip`` files)."""
    found = []
    generated = generated_pages(root)
    for path in files(root):
        if path in skip:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(root)
        for n, line in enumerate(text.splitlines(), 1):
            bad = [f"{m.group(0)} (outside the repository)" for m in OUTSIDE.finditer(line)]
            bad += [f"{m.group(1)} (no such file)" for m in TOP_MD.finditer(line) if not (root / m.group(1)).exists()]
            bad += [f"{m.group(1)} (no such path)" for m in REPO_PATH.finditer(line)
                    if not _exists(root, m.group(1)) and (root / m.group(1)).resolve() not in generated]
            if path.suffix == ".md":
                bad += [f"{m.group(1)} (broken link)" for m in MD_LINK.finditer(line)
                        if "://" not in m.group(1) and not m.group(1).startswith("mailto:")
                        and not (path.parent / m.group(1)).exists()
                        and (path.parent / m.group(1)).resolve() not in generated]
            found += [f"{rel}:{n}: {b}" for b in bad]
    return sorted(found)


def _exists(root: Path, ref: str) -> bool:
    ref = ref.rstrip(".")
    return (root / ref).exists() or any((root / ref).parent.glob((root / ref).name))


def test_the_repository_has_no_dangling_reference():
    assert dangling(ROOT, skip=(Path(__file__).resolve(),)) == []  # this file shows the patterns it finds


def test_a_planted_reference_is_found(tmp_path):
    """The check fails on each kind of dangling reference and passes what exists."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "protocol.md").write_text("see [the tables](tables.md) and [the protocol](protocol.md)\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text('"""Paper vs. code (see shared/reference/baseline-methods.md A3).\n'
                                            'The protocol: BENCHMARKS.md B, docs/protocol.md, docs/missing.md."""\n')
    (tmp_path / "README.md").write_text("[ok](docs/protocol.md), see README.md\n")
    assert dangling(tmp_path) == [
        "docs/protocol.md:1: tables.md (broken link)",
        "src/m.py:1: shared/reference/baseline-methods.md (outside the repository)",
        "src/m.py:2: BENCHMARKS.md (no such file)",
        "src/m.py:2: docs/missing.md (no such path)",
    ]
    (tmp_path / "src" / "m.py").write_text('"""Paper vs. official code (sxontheway/BalanceFL); docs/protocol.md."""\n')
    (tmp_path / "docs" / "tables.md").write_text("")
    assert dangling(tmp_path) == []


def test_every_method_is_named_once_and_its_name_file_and_page_agree():
    """A built-in method's name is its registration's (issue 42 item 3): its class sets no ``name`` of its own,
    the class's ``name`` is the registered one, its file is named after it (``fedavg-bsm`` in bsm.py, ``dr`` beside
    ``feddr+`` in feddr.py: one name contains the other, less punctuation), its generated page is titled with it
    and names its class, and the README's method table lists it."""
    import ast
    import inspect

    from fedlt.registry import METHODS

    spec = importlib.util.spec_from_file_location("_fedlt_gen_reference", ROOT / "docs" / "gen_reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    readme = (ROOT / "README.md").read_text()
    methods = hook._methods(ROOT)
    assert len(methods) >= 45
    for name, cls in methods:
        assert cls.name == name, (name, cls.name)
        source = Path(inspect.getsourcefile(cls))
        assert source.parent == ROOT / "src" / "fedlt" / "methods", (name, source)
        tree = ast.parse(source.read_text())
        body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
        second = [n.lineno for n in body if isinstance(n, (ast.Assign, ast.AnnAssign)) and
                  any(getattr(t, "id", None) == "name" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
        assert not second, f"{source.name}:{second[0]}: {name}'s class names itself; its registration does"
        a, b = re.sub(r"\W|_", "", name), re.sub(r"\W|_", "", source.stem)
        assert a in b or b in a, (name, source.name)
        page = hook.method_page(name, cls)
        assert page.startswith(f"# `{name}`") and f"{cls.__module__}.{cls.__qualname__}" in page
        assert f"`{name}`" in readme, f"README.md's method table does not list {name}"
