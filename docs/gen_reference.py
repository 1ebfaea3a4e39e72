"""MkDocs hook (mkdocs.yml ``hooks:``): the reference pages are written from the code at every build, so they
cannot drift from it.

- ``methods/index.md`` and one ``methods/<name>.md`` per registered method: its paper (the first line of the
  method module's docstring), its parameters (name, type, default, and the meaning written beside the field
  of its ``Params``), its inference modes and its paper-vs-official options (the docstring's "Inference" and
  "Paper vs." paragraphs), whether it has a generic and a personal model, whether its clients can be batched,
  its post-training phases, and the whole docstring (the algorithm box).
- ``settings.md``: every run setting (``fedlt.config.RunConfig``), from its declaration (``fedlt.decl``): TOML
  key, command line, type, default, what it allows and what it means.
- ``privacy.md``: what leaves the client -- every method's declaration of what its clients send
  (``Method.sends``, ``fedlt.core.privacy``), by category, and what each category reveals.
- ``api.md``: every name of ``fedlt.__all__``, rendered by mkdocstrings from its docstring.

The package is imported from this checkout's ``src`` (not from whatever fedlt is installed).
"""
from __future__ import annotations

import inspect
import re
import sys
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
    return ["api.md", "settings.md", "privacy.md", "methods/index.md"] + \
        [f"methods/{name}.md" for name, _ in _methods(root)]


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
    files.append(File.generated(config, "settings.md", content=settings_page(_fedlt(_root(config)))))
    files.append(File.generated(config, "privacy.md", content=privacy_page(methods)))
    return files


FENCE_OPTION = re.compile(r"^```(\w+) (file|append)=(\S+)[ \t]*$", re.M)


def on_page_markdown(markdown, page, config, files):
    """The tutorials' code blocks name the file the tests write them to (```` ```python file=x.py ````,
    ``append=x.py``: tests/test_docs.py), which the fences extension does not take for a fence: shown on the
    site as a block titled with the file."""
    return FENCE_OPTION.sub(lambda m: f'```{m.group(1)} title="{m.group(3)}'
                                      f'{" (continued)" if m.group(2) == "append" else ""}"', markdown)


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
    from fedlt.core.dp import verdict

    doc = _doc(cls)
    gm, pm, batched = _flags(cls)
    source = f"src/{cls.__module__.replace('.', '/')}.py"
    out = [f"# `{name}`", "", f"**{_md_text(_paper(cls))}**" if doc else "", "",
           "| | |", "| --- | --- |",
           f"| class | `{cls.__module__}.{cls.__qualname__}` (`{source}`) |",
           f"| generic model (GM) | {gm} |", f"| personal models (PM) | {pm} |",
           f"| batched clients | {batched} |",
           f"| post-training phases | {', '.join(f'`{p}`' for p in cls.phases) or 'none'} |",
           f"| secure aggregation (`--secagg`) | {_secagg(cls)} |",
           f"| client-level DP (`--dp client`) | {_cell(verdict(cls, 'client'))} |",
           f"| sample-level DP (`--dp sample`) | {_cell(verdict(cls, 'sample'))} |", "",
           "## Parameters", ""]
    params = parameters(cls)
    if params:
        out += ["| name | type | default | allowed | meaning |", "| --- | --- | --- | --- | --- |"]
        out += [f"| `{r['name']}` | {r['type']} | {_cell(r['default'])} | {_cell(r['allowed'])} | {_cell(r['help'])} |"
                for r in params]
        out += ["", f"Set one with `fedlt run --method {name} --set {params[0]['name']}=VALUE` (or `params = "
                    f"{{{params[0]['name']} = ...}}` in a TOML config); `fedlt list {name}` shows this table. None "
                    f"stands for what its default says."]
    else:
        out += ["None."]
    out += ["", "## What leaves the client", ""] + sends_table(cls) + [
        "", f"Categories: [What leaves the client](../privacy.md). A run records what its clients actually sent in "
            f"its directory (`sent.jsonl`); `fedlt list {name}` prints this table. On the Flower engine the clients' "
            f"replies also carry the engine's own items: [Flower engine](../privacy.md#flower-engine)."]
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


def _secagg(cls) -> str:
    from fedlt.core.secagg import runs_under, why_not

    return "yes: its server needs only the weighted mean of the replies" if runs_under(cls) else \
        f"no: {_cell(why_not(cls))}"


def parameters(cls) -> list[dict[str, str]]:
    """name, type, default (None with its meaning), allowed (range, choices) and help of every field of
    ``cls.Params``, from its declaration (``fedlt.decl``); a plain field's help is the comment beside it."""
    from fedlt.decl import rows

    return rows(cls.Params)


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


# ------------------------------------------------------------------------------------------------ privacy
def sends_table(cls) -> list[str]:
    """A method's declaration of what its clients send (``cls.sends``), one row per item."""
    from fedlt.core.privacy import rows_of

    out = ["| when | name | kind | category | what it is |", "| --- | --- | --- | --- | --- |"]
    for r in rows_of(cls):
        name = r["name"] if r["name"].startswith("the ") else f"`{r['name']}`"
        out.append(f"| {_cell(r['when'])} | {name} | {r['kind']} | {r['category']} | {_cell(r['what'])} |")
    return out


def privacy_page(methods) -> str:
    """Every built-in method's declaration in one table, by category, and what each category reveals."""
    from fedlt.core.privacy import CATEGORIES, ROUNDS

    cats = list(CATEGORIES)
    rows = ["| method | " + " | ".join(cats) + " |", "| --- |" + " --- |" * len(cats)]
    for name, cls in methods:
        cells = []
        for c in cats:
            whens = {s.when for s in cls.sends if s.category == c}
            rounds = bool(whens & {ROUNDS, "*"})
            phases = sorted(w for w in whens if w not in (ROUNDS, "*"))
            cells.append(" + ".join((["R"] if rounds else []) + (["P"] if phases else [])))
        rows.append(f"| [`{name}`](methods/{name}.md) | " + " | ".join(cells) + " |")
    return "\n".join([
        "# What leaves the client", "",
        "Every method declares, beside its parameters, every array and meta value its clients send -- in the "
        "training rounds and in each post-training phase -- with what it reveals about the client's data "
        "(`Method.sends`, a tuple of `fedlt.sent(...)`; `fedlt.core.privacy`). This page is written from those "
        "declarations when the site is built; each method's page lists its own, item by item, and "
        "`fedlt list METHOD` prints the same.", "",
        "The declarations cannot drift from the code: the run driver hands every reply to a check, and with "
        "`FEDLT_CHECK_SENDS=1` in the environment (the test suite sets it) an array or meta value a method does not "
        "declare stops the run with one line naming the method, the client, the item and the round; a test runs "
        "every registered method through a round and its phases and compares what was sent with the declaration. "
        "Without the variable the run goes on, records the item as `undeclared` and says so once.", "",
        "Every run records what actually left its clients in its directory, `sent.jsonl`: one JSON line per round "
        "(`round`) or post-training phase (`phase`) and per declared item -- `sent` (the item's name; `<model>`: "
        "the model's state-dict entries), `category`, `arrays` or `values` (how many one client sent), `shape` (of "
        "one client's, where it sent one and all agree), `bytes` (summed over the clients; a number in meta counts "
        "8) and `clients`. A resumed run appends to it.", "",
        "## Categories", "",
        "| category | what it reveals |", "| --- | --- |",
        *[f"| {c} | {_cell(w)} |" for c, w in CATEGORIES.items()], "",
        "## Every method", "",
        "R: sent in the training rounds; P: in a post-training phase (the method's page says which). "
        "A method page's *What leaves the client* table names every item and its shape.", "",
        *rows, "",
        "## Besides the methods' messages", "",
        "What the engines themselves move, whatever the method (not in the table above):", "",
        "- the simulator (one process, or `--workers` processes on one machine): nothing crosses a network; every "
        "client's class counts are known to it (the federation is built there) and written to `partition.json`.",
        *engine_section(), ""])


def engine_section() -> list[str]:
    """The Flower engine's own items (``fedlt.engine.flower.sends``), one row each: the replies that carry it, the
    ``--dp`` modes and SuperNodes it is sent by, its category."""
    from fedlt.core.privacy import engine_rows_of
    from fedlt.engine.flower import sends as flower

    rows = ["| reply | name | `--dp` | SuperNodes | category | what it is |", "| --- | --- | --- | --- | --- | --- |"]
    for r in engine_rows_of(flower.SENDS):
        rows.append(f"| {r['message']} | `{r['name']}` | {r['dp']} | {r['nodes']} | {r['category']} | "
                    f"{_cell(r['what'])} |")
    return [
        "", f"### {flower.TITLE}", "",
        f"Every reply of a Flower client carries, beside the method's message (matched to its declaration above), the "
        f"engine's own fields, declared in `{flower.WHERE}` the way a method declares its `sends`; `fedlt list METHOD` "
        f"prints them under the method's, a run records them in `sent.jsonl` (rows with `\"engine\": "
        f"\"{flower.ENGINE}\"`, the `message`, and the `round` or `phase` where there is one), and a test captures "
        "every reply an in-process Flower client sends and holds it to both declarations. A SuperNode serving a "
        "client of the run's partition (`partition-id`) sends nothing of its data in its `describe` reply (the "
        "server rebuilds that client from the run's settings); one holding its own data (`data-dir`) sends what the "
        "rows marked *own data* say, under `--dp` less (the `--dp` column: the modes an item is sent under). An "
        "evaluation reply holds the accuracy and group accuracies PM aggregates, under every mode alike. Under "
        "`--secagg` a training round's replies are SecAgg+'s stages instead (see "
        "[Secure aggregation](secure-aggregation.md)).", "",
        *rows]


# ------------------------------------------------------------------------------------------------ settings
def settings_page(fedlt) -> str:
    """Every run setting, in tables by group, from its declaration."""
    from fedlt.config import setting_rows

    out = ["# Run settings", "",
           "Every setting of a run, written from its declaration in `fedlt.config.RunConfig` when the site is built "
           "(`fedlt list settings` prints the same). A setting is a key of a TOML config (`rounds = 50`), a "
           "command-line option of `fedlt run`, `compare` and `flower run/simulate/inprocess/app` (`--rounds 50`), "
           "and a keyword of `fedlt.run(...)`; the same checks apply everywhere, and bad input is one line and exit "
           "status 2. Method parameters are listed on each method's page (`--set KEY=VALUE`, `[params]`).", "",
           "A *limit* catches a typo (an extra zero) before an hour of allocation: pass it on purpose with "
           "`--allow-large` (`allow_large = true`). Every float must be finite and fit a float32.", ""]
    group = None
    for r in setting_rows():
        if r["group"] != group:
            group = r["group"]
            out += ["", f"## {group.capitalize() if group else 'Other'}", "",
                    "| setting | command line | type | default | allowed | meaning |",
                    "| --- | --- | --- | --- | --- | --- |"]
        flag = ", ".join(f"`{f}`" for f in r["flag"].split(", ")) if r["flag"] else "(TOML, Python)"
        out.append(f"| `{r['name']}` | {flag} | {r['type']} | {_cell(r['default'])} | {_cell(r['allowed'])} | "
                   f"{_cell(r['help'])} |")
    return "\n".join(out + relations_section(fedlt) + [""])


def relations_section(fedlt) -> list[str]:
    """The relations between settings (``fedlt.config.RELATIONS``, ``fedlt.engine.faults.RELATIONS``), each with the
    example that breaks it and the one line fedlt answers it with (computed here: the page cannot drift from the
    checks)."""
    from fedlt.config import FAST_RUN, RELATIONS, load_config
    from fedlt.engine.faults import RELATIONS as TIMING, check_settings
    from fedlt.errors import ConfigError

    out = ["", "## Relations between settings", "",
           "Checked like the settings themselves, before anything is read or written: a setting that the "
           "configuration would ignore is refused, not dropped, and a setting that needs another says which. "
           "Each relation, a configuration that breaks it, and the one line `fedlt` then prints (exit status 2):",
           "", "| relation | for example | fedlt says |", "| --- | --- | --- |"]
    for r in [*RELATIONS, *TIMING]:
        example, said = "", ""
        if r.bad:
            bad = r.bad[0]
            example = " ".join(f"`--set {k}={v}`" if name == "params" else f"`--{name.replace('_', '-')}`"
                               if v is True else f"`--{name.replace('_', '-')} {v}`"
                               for name, val in bad.items()
                               for k, v in (val.items() if name == "params" else [(name, val)]))
            try:
                check_settings(load_config(None, {**FAST_RUN, **bad}))
            except ConfigError as e:
                said = str(e)
        out.append(f"| {_cell(r.text())} | {example} | {_cell(said)} |")
    return out


# ------------------------------------------------------------------------------------------------ API
GROUPS = [
    ("Running and reading experiments", ["run", "compare", "sweep", "report", "load", "make_config",
                                         "list_methods", "RunResult", "Comparison", "Metrics", "MethodInfo",
                                         "RunConfig"]),
    ("Writing a method", ["Method", "Message", "Predictor", "RunSpec", "train_local", "weights_of",
                          "load_weights", "LocalSteps", "Train", "Trained", "StepModel", "ce", "strip",
                          "setting", "sent", "Sent"]),
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
