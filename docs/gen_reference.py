"""MkDocs hook (mkdocs.yml ``hooks:``): the reference pages are written from the code at every build, so they
cannot drift from it.

- ``methods/index.md`` and one ``methods/<name>.md`` per registered method: its paper (the first line of the
  method module's docstring), its parameters (name, type, default, and the meaning written beside the field
  of its ``Params``), its inference modes and its paper-vs-official options (the docstring's "Inference" and
  "Paper vs." paragraphs), whether it has a generic and a personal model, whether its clients can be batched,
  its post-training phases, and the whole docstring (the algorithm box).
- ``api.md``: every name of ``fedlt.__all__``, rendered by mkdocstrings from its docstring.

The package is imported from this checkout's ``src`` (not from whatever fedlt is installed).
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from pathlib import Path

SECTION = "Method reference"  # the nav entry whose children are generated


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _fedlt(root: Path):
    src = str(root / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    import fedlt

    return fedlt


def _methods(root: Path) -> list[tuple[str, type]]:
    fedlt = _fedlt(root)
    return [(n, c) for n, c in fedlt.METHODS.items() if fedlt.METHODS.origin(n) == "built-in"]


def page_uris(root: Path) -> list[str]:
    """The pages this hook writes, relative to ``docs/`` (pages and tests may link to them)."""
    return ["api.md", "methods/index.md"] + [f"methods/{name}.md" for name, _ in _methods(root)]


def on_config(config):
    """The ``Method reference`` nav section: the index, then one page per built-in method (sorted)."""
    pages = [{"Overview": "methods/index.md"}] + [{name: f"methods/{name}.md"} for name, _ in _methods(_root(config))]
    for item in config.nav or []:
        if isinstance(item, dict) and SECTION in item:
            item[SECTION] = pages
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    methods = _methods(_root(config))
    files.append(File.generated(config, "methods/index.md", content=method_index(methods)))
    for name, cls in methods:
        files.append(File.generated(config, f"methods/{name}.md", content=method_page(name, cls)))
    files.append(File.generated(config, "api.md", content=api_page(_fedlt(_root(config)))))
    return files


ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc):<code>(~?)([\w.]+)</code>")


def on_page_content(html, page, config, files):
    """Docstrings cross-reference in Sphinx's roles (``:class:`~fedlt.errors.Diverged```), which mkdocstrings
    prints as they are: shown as code, ``~`` keeping the last name only, as Sphinx would."""
    return ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)


# ------------------------------------------------------------------------------------------------ methods
def _doc(cls) -> str:
    return inspect.cleandoc(sys.modules[cls.__module__].__doc__ or cls.__doc__ or "")


def _paper(cls) -> str:
    """The docstring's first paragraph (the method, its authors, venue and title), on one line."""
    return " ".join(_doc(cls).split("\n\n")[0].split())


def _flags(cls) -> tuple[str, str, str]:
    gm = "yes" if cls.generic else "no"
    pm = "own" if cls.personalized else "global model"
    return gm, pm, "yes" if cls.describes_steps() else "no"


def method_index(methods) -> str:
    rows = ["| method | paper | GM | PM | batched |", "| --- | --- | --- | --- | --- |"]
    for name, cls in methods:
        gm, pm, batched = _flags(cls)
        rows.append(f"| [`{name}`]({name}.md) | {_cell(_paper(cls))} | {gm} | "
                    f"{pm} | {batched} |")
    return "\n".join([
        "# Method reference", "",
        "One page per registered method, written from the code when the site is built: the method module's "
        "docstring (its algorithm box), its `Params` dataclass (the defaults are the paper's) and its class "
        "attributes. `fedlt list` shows the same parameters on the command line; `--set NAME=VALUE` changes one.",
        "",
        "GM: the method has a generic (global) model. PM `own`: it has personal models; `global model`: the "
        "personalized metric evaluates the global model on each client's test set (labelled so in the results). "
        "Batched: it describes its local training, so a round's clients can train together "
        "(`--client-parallel`; see [Batched clients](../batched-clients.md)).", "",
        *rows, ""])


def method_page(name: str, cls) -> str:
    doc = _doc(cls)
    gm, pm, batched = _flags(cls)
    source = f"src/{cls.__module__.replace('.', '/')}.py"
    out = [f"# `{name}`", "", f"**{_md_text(_paper(cls))}**" if doc else "", "",
           "| | |", "| --- | --- |",
           f"| class | `{cls.__module__}.{cls.__qualname__}` (`{source}`) |",
           f"| generic model (GM) | {gm} |", f"| personal models (PM) | {pm} |",
           f"| batched clients | {batched} |",
           f"| post-training phases | {', '.join(f'`{p}`' for p in cls.phases) or 'none'} |", "",
           "## Parameters", ""]
    params = parameters(cls)
    if params:
        out += ["| name | type | default | meaning |", "| --- | --- | --- | --- |"]
        out += [f"| `{n}` | `{t}` | `{d!r}` | {_cell(m)} |" for n, t, d, m in params]
        out += ["", f"Set one with `fedlt run --method {name} --set {params[0][0]}=VALUE` (or `params = "
                    f"{{{params[0][0]} = ...}}` in a TOML config)."]
    else:
        out += ["None."]
    for title, pattern, none in (
            ("Inference modes", r"inference\b", "The docstring has no inference paragraph: GM is the global "
                                                "model, PM as the table above says."),
            ("Paper vs. official code", r"paper vs\.?", "The docstring records no difference between the paper "
                                                         "and its code.")):
        out += ["", f"## {title}", ""]
        part = paragraph(doc, pattern)
        out += ["```text", part, "```"] if part else [none]
    out += ["", "## The method's docstring", "", "```text", doc, "```", ""]
    return "\n".join(out)


def parameters(cls) -> list[tuple[str, str, object, str]]:
    """(name, type, default, meaning) of every field of ``cls.Params``; the meaning is the comment written
    after the field (searched in each class of the Params hierarchy that declares it)."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.Params.__mro__):
        if klass is object:
            continue
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        comments.update(field_comments(src))
    out = []
    for f in dataclasses.fields(cls.Params):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append((f.name, typ, default, comments.get(f.name, "")))
    return out


def field_comments(source: str) -> dict[str, str]:
    """``{field: the comment on its line}`` for the annotated assignments of a class's source."""
    source = inspect.cleandoc("\n" + source) if source.startswith((" ", "\t")) else source
    line_comment = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line_comment[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = " ".join(line_comment[n] for n in range(node.lineno, node.end_lineno + 1) if n in line_comment)
            if text:
                out[node.target.id] = text
    return out


def paragraph(doc: str, pattern: str) -> str:
    """The lines of ``doc`` from the first that matches ``pattern`` (at its start, or after a sentence's end)
    to the next blank line."""
    lines = doc.splitlines()
    rx = re.compile(rf"(^|[.;)]\s+){pattern}", re.I)
    for i, line in enumerate(lines):
        m = rx.search(line)
        if m:
            first = line[m.start() + len(m.group(1)):]
            rest = []
            for nxt in lines[i + 1:]:
                if not nxt.strip():
                    break
                rest.append(nxt)
            return "\n".join([first, *rest])
    return ""


def _md_text(s: str) -> str:
    return s.replace("*", r"\*").replace("_", r"\_").replace("<", "&lt;")


def _cell(s: str) -> str:
    return _md_text(s).replace("|", r"\|")


# ------------------------------------------------------------------------------------------------ API
GROUPS = [
    ("Running and reading experiments", ["run", "compare", "sweep", "report", "load", "make_config",
                                         "list_methods", "RunResult", "Comparison", "Metrics", "MethodInfo",
                                         "RunConfig"]),
    ("Writing a method", ["Method", "Message", "Predictor", "RunSpec", "train_local", "weights_of",
                          "load_weights", "LocalSteps", "Train", "Trained", "StepModel", "ce", "strip"]),
    ("Registries and errors", ["METHODS", "DATASETS", "MODELS", "PARTITIONS", "FedltError", "ConfigError",
                               "DataError"]),
]


def api_page(fedlt) -> str:
    """Every name of ``fedlt.__all__``, in the groups above; a name that is in no group gets one of its own (so
    a new public name appears without editing this file)."""
    grouped = [n for _, names in GROUPS for n in names]
    groups = [(t, [n for n in names if n in fedlt.__all__]) for t, names in GROUPS]
    other = [n for n in fedlt.__all__ if n not in grouped]
    if other:
        groups.append(("Other", other))
    out = ["# API reference", "",
           "The stable API: the names of `fedlt.__all__`, documented from their docstrings. Everything else may "
           "change between versions. The guides show them at work: [Python API](python-api.md), "
           "[Writing a method](writing-a-method.md).", ""]
    for title, names in groups:
        out += [f"## {title}", ""]
        for n in names:
            out += [f"::: fedlt.{n}", "    options:", "      heading_level: 3", ""]
    return "\n".join(out)
