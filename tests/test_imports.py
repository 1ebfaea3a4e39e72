"""No import circles inside ``src/fedlt``: the module graph drawn from the source (read with ``ast``, nothing
imported) has no cycle. Every ``import``/``from ... import`` counts, those inside functions and relative ones
included: an import moved into a function to dodge a circle at load time is still a circle of the design.

Edges are module to module: ``from pkg import name`` goes to ``pkg.name`` where that is a module of the package,
else to ``pkg`` itself (its ``__init__``); ``import a.b.c`` goes to ``a.b.c`` (or its nearest ancestor that is a
module here). Imports of anything outside the package are ignored.
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fedlt"
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module of the same package: line of the first such import}}`` for the package at
    ``root`` (a folder with ``__init__.py``)."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        here = mod if path.name == "__init__.py" else mod.rpartition(".")[0]  # what `from .` names
        deps: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    up = here.split(".")
                    base = ".".join(up[: len(up) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:  # a name inside a module -> the module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    deps.setdefault(t, node.lineno)
        graph[mod] = deps
    return graph


def knots(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative): each holds
    at least one circle. Sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    return sorted(components)


def _cycle_in(graph: dict[str, dict[str, int]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    first = min(comp)
    prev: dict[str, str] = {}
    frontier = [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == first:
                    path = [v]
                    while path[-1] != first:
                        path.append(prev[path[-1]])
                    return [first, *reversed(path[:-1]), first] if v != first else [first, first]
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {first}")  # cannot happen in a strongly connected component


def describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def cycle_report(root: Path) -> str:
    """One line per knot: its shortest circle through its first module, the lines of the imports, and the other
    modules caught in the same knot. Empty: no circle."""
    graph = import_graph(root)
    lines = []
    for knot in knots(graph):
        cycle = _cycle_in(graph, set(knot))
        rest = [m for m in knot if m not in cycle]
        lines.append(f"import circle: {describe(graph, cycle)}" + (f" (same knot: {', '.join(rest)})" if rest else ""))
    return "\n".join(lines)


def test_fedlt_has_no_import_cycle():
    graph = import_graph(SRC)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 200, "the import graph lost its modules or edges"
    report = cycle_report(SRC)
    assert not report, (f"{report}\nCut it: move what both sides need into a module that imports neither "
                        f"(an import inside a function counts too)")


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_planted_circle_is_found_and_named(tmp_path):
    """A circle made only of an import inside a function and a relative import is reported, named module by
    module with the lines of the imports; the same modules without the back edge pass."""
    files = {"a.py": "import os\nfrom .sub import b\n",
             "sub/__init__.py": "",
             "sub/b.py": "from ..c import f\n",
             "c.py": "def f():\n    from pkg import a\n    return a\n",
             "d.py": "import pkg.c\n"}
    report = cycle_report(_package(tmp_path / "bad", files))
    assert report == "import circle: pkg.a (line 2) -> pkg.sub.b (line 1) -> pkg.c (line 2) -> pkg.a"
    files["c.py"] = "def f():\n    return 1\n"
    assert cycle_report(_package(tmp_path / "good", files)) == ""


def test_an_init_reexport_closes_a_circle(tmp_path):
    """``from pkg import X`` where X is re-exported by ``pkg/__init__.py`` depends on the ``__init__``: a module
    the ``__init__`` imports and that takes a name from it is a circle; each component is reported once."""
    files = {"__init__.py": "from .core import X\n", "core.py": "from . import util\nX = 1\n",
             "util.py": "from pkg import X\n",
             "p.py": "from . import q\n", "q.py": "import pkg.p\n"}
    lines = cycle_report(_package(tmp_path, files)).splitlines()
    assert lines == ["import circle: pkg (line 1) -> pkg.core (line 1) -> pkg.util (line 1) -> pkg",
                     "import circle: pkg.p (line 1) -> pkg.q (line 1) -> pkg.p"]


# ------------------------------------------------------------------------------ layers: imports point down
def read_layers(doc: Path) -> list[tuple[str, list[str]]]:
    """The layer table of ``doc`` (docs/architecture.md, between ``<!-- layers`` and ``<!-- /layers -->``), top
    to bottom: ``[(layer, [path, ...])]``, a path relative to the package (``core/``: every module in it)."""
    text = doc.read_text()
    start = text.index("<!-- layers")
    rows = text[start:text.index("<!-- /layers -->", start)].splitlines()[1:]
    layers = []
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("layer", "---"):
            continue
        layers.append((cells[0], [p.strip().strip("`") for p in cells[1].split(",")]))
    return layers


def module_path(root: Path, mod: str) -> str:
    """A module's file relative to the package folder ``root`` (``pkg.core.steps`` -> ``core/steps.py``)."""
    rel = Path(*mod.split(".")[1:])
    return (rel / "__init__.py").as_posix() if (root / rel).is_dir() else rel.with_suffix(".py").as_posix()


def layer_report(root: Path, layers: list[tuple[str, list[str]]]) -> str:
    """One line per module that no layer holds, per layer entry that names nothing, and per import from a lower
    layer into a higher one (modules, layers, file and line). Empty: the imports point down."""
    graph = import_graph(root)
    paths = {mod: module_path(root, mod) for mod in graph}

    def level(path: str) -> int | None:  # the most specific entry that holds the path decides
        found = [(len(e), i) for i, (_, entries) in enumerate(layers) for e in entries
                 if path == e or (e.endswith("/") and path.startswith(e))]
        return max(found)[1] if found else None

    lines = [f"{m} ({paths[m]}) is in no layer: add it to the table" for m in sorted(graph) if level(paths[m]) is None]
    lines += [f"layer {name!r} names {e}, inside {f} of layer {other!r}: every folder is one layer"
              for name, entries in layers for e in entries for other, folders in layers for f in folders
              if f.endswith("/") and e != f and e.startswith(f)]
    lines += [f"layer {name!r} names {e}, which holds no module" for name, entries in layers for e in entries
              if not any(p == e or (e.endswith("/") and p.startswith(e)) for p in paths.values())]
    for mod in sorted(graph):
        low = level(paths[mod])
        for dep, line in sorted(graph[mod].items()):
            high = level(paths[dep])
            if low is not None and high is not None and high < low:
                lines.append(f"upward import: {mod} (layer {layers[low][0]!r}) imports {dep} (layer "
                             f"{layers[high][0]!r}, above it) at {paths[mod]} line {line}")
    return "\n".join(lines)


def test_imports_point_down_the_layers_of_the_architecture_page():
    """Every module is in one layer of docs/architecture.md's table, and imports only its own layer or those
    below (an import inside a function counts too); every folder is one layer (no entry inside another's folder:
    the Flower engine, engine/flower/, is an engine and imports no runner; the apps over it are flower/)."""
    layers = read_layers(ARCHITECTURE)
    assert len(layers) >= 8 and layers[0][0] == "command line" and "registry.py" in layers[-1][1], layers
    report = layer_report(SRC, layers)
    assert not report, (f"{report}\nLayers, top to bottom, are the table in docs/architecture.md: move what the "
                        f"lower module needs down, or the module to the layer it belongs to")


def test_a_planted_upward_import_is_named(tmp_path):
    """A lower module importing a higher one (inside a function, relatively) is found and named; the same
    import the other way passes; a module left out of the table, or an entry naming nothing, is reported."""
    files = {"app.py": "from .core import base\n",
             "core/__init__.py": "", "core/base.py": "import os\n\ndef f():\n    from .. import app\n",
             "util.py": "X = 1\n"}
    layers = [("top", ["app.py", "__init__.py"]), ("core", ["core/"]), ("bottom", ["util.py"])]
    root = _package(tmp_path / "bad", files)
    assert layer_report(root, layers) == ("upward import: pkg.core.base (layer 'core') imports pkg.app (layer "
                                          "'top', above it) at core/base.py line 4")
    files["core/base.py"] = "from ..util import X\n"
    assert layer_report(_package(tmp_path / "good", files), layers) == ""
    lines = layer_report(_package(tmp_path / "odd", files), layers[:2] + [("bottom", ["helpers.py"])]).splitlines()
    assert lines == ["pkg.util (util.py) is in no layer: add it to the table",
                     "layer 'bottom' names helpers.py, which holds no module"]
    nested = [("top", ["app.py", "__init__.py", "core/base.py"]), ("core", ["core/"]), ("bottom", ["util.py"])]
    assert layer_report(_package(tmp_path / "nested", files), nested) == (
        "layer 'top' names core/base.py, inside core/ of layer 'core': every folder is one layer")


# ------------------------------------------------------------------------------ methods stand on core
def registered_classes(path: Path) -> set[str]:
    """The classes of a method file that register a method (decorated ``@METHODS.register(...)``)."""
    out = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Call) and ast.unparse(d.func).endswith("METHODS.register") for d in node.decorator_list):
            out.add(node.name)
    return out


def foreign_helpers(methods: Path, package: str = "fedlt.methods") -> list[str]:
    """Where a method file takes from another method file anything but a registered method class (the class it
    builds on, as its paper does): a helper function, a constant, an unregistered base class, the module itself.
    Such a piece belongs in a core module. One line per import, with its file and line."""
    files = {p.stem: p for p in methods.glob("*.py") if p.stem != "__init__"}
    bad = []
    for stem, path in sorted(files.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                sibling = (node.module or "") if node.level == 1 else \
                    (node.module or "").removeprefix(package + ".") if node.level == 0 else None
                if node.level == 1 and not node.module or node.level == 0 and node.module == package:
                    mods = [a.name for a in node.names if a.name in files]  # `from . import fedprox`
                    bad += [f"{path.name}:{node.lineno}: imports the method module {m}" for m in mods]
                    continue
                if sibling not in files or sibling == stem:
                    continue
                ok = registered_classes(files[sibling])
                bad += [f"{path.name}:{node.lineno}: imports {a.name} from {sibling}.py, which is not a registered "
                        f"method class" for a in node.names if a.name not in ok]
            elif isinstance(node, ast.Import):
                bad += [f"{path.name}:{node.lineno}: imports the method module {a.name}" for a in node.names
                        if a.name.startswith(package + ".") and a.name.rpartition(".")[2] in files]
    return bad


def test_no_method_imports_another_methods_helpers():
    """A method builds on core and, where its paper does, on another method's class (FedProx on FedAvg, FedRep on
    FedPer, CLIP2FL on CReFF); helpers two methods share live in core modules (core/priors.py, proximal.py,
    retrain.py, server_opt.py, auxiliary.py, training.py ...)."""
    methods = SRC / "methods"
    assert len(list(methods.glob("*.py"))) > 30 and "FedAvg" in registered_classes(methods / "fedavg.py")
    bad = foreign_helpers(methods)
    assert not bad, "\n".join(bad) + "\nMove the shared piece into a core module and import it from there"


def test_a_planted_helper_import_is_named(tmp_path):
    """Every form of reaching into another method file is found; building on a registered class is not."""
    files = {"base.py": "@METHODS.register('base')\nclass Base:\n    pass\n\nclass Mixin:\n    pass\n\n"
                        "def helper():\n    pass\n",
             "good.py": "from .base import Base\nfrom ..core import thing\n",
             "bad.py": "from .base import Base, helper\nfrom fedlt.methods.base import Mixin\n"
                       "def f():\n    from . import base\n    import fedlt.methods.base\n"}
    root = _package(tmp_path, files)
    assert foreign_helpers(root) == [
        "bad.py:1: imports helper from base.py, which is not a registered method class",
        "bad.py:2: imports Mixin from base.py, which is not a registered method class",
        "bad.py:4: imports the method module base",
        "bad.py:5: imports the method module fedlt.methods.base"]
