"""Bad input drawn from the declarations: every run setting (``RunConfig``) and every built-in method's parameter
(its ``Params``) is declared with its type and range (:mod:`fedlt.decl`); these property-based tests draw, for
each, values outside what the declaration allows -- below its lower bound, above its upper bound or its limit
(without ``--allow-large``), not one of its choices, non-finite, past a float32 or an int64, of the wrong type --
and give them to the command line, to a TOML run config, to a sweep file, and draw broken partition files.
Every one must end with exit status 2, one line on stderr that names what is wrong, no traceback, and nothing
written (the output folder stays empty).

The commands run in this process (``fedlt.cli.main``): a refused input costs milliseconds. The numbers of
examples are bounded (``derandomize``: the same inputs on every run); ``test_inputs_drawn`` prints how many were
drawn (``pytest -s``) and checks that every declared setting was reached.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import functools
import math
import os
import re
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from fedlt.cli import build_parser, main as cli_main  # noqa: E402
from fedlt.config import RunConfig  # noqa: E402
from fedlt.decl import FLOAT32_MAX, INT64, settings_of, was_none  # noqa: E402
from fedlt.registry import METHODS  # noqa: E402
from test_bad_input import _toml_value  # noqa: E402

DRAWN: dict[str, int] = {}
REACHED: dict[str, set[tuple[str, str]]] = {}
FAST = ["--dataset", "digits", "--clients", "4", "--rounds", "1", "--local-epochs", "1", "--eval-every", "1",
        "--batch-size", "32", "--threads", "1", "--no-progress"]


# ------------------------------------------------------------------------------------------- the declarations
def _run_settings():
    """(owner, setting) for every run setting a user can give (not ``params``: a table of its own)."""
    return [("run", s) for s in settings_of(RunConfig).values() if s.kind is not dict]


def _method_params():
    out = []
    for name in METHODS.names():
        if METHODS.origin(name) != "built-in":
            continue
        out += [(name, s) for s in settings_of(METHODS.get(name).Params).values() if s.kind is not dict]
    return out


DECLARED = _run_settings() + _method_params()
# every declared setting gets PER_SETTING inputs (its channel, the command line or a TOML config, and its value
# drawn); sweep files and partition files get a sample
PER_SETTING = int(os.environ.get("FEDLT_FUZZ_PER_SETTING", 2))
EXAMPLES = {k: int(os.environ.get("FEDLT_FUZZ_EXAMPLES", n)) for k, n in {"sweep": 60, "partition": 60}.items()}


def fuzz(kind: str):
    return settings(max_examples=EXAMPLES[kind], deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def _numeric(s) -> type | None:
    """int or float for a numeric setting (a list's items), else None."""
    kind = s.item if s.kind is tuple else s.kind
    return kind if kind in (int, float) else None


def bad_values(s) -> list:
    """Values the declaration of ``s`` refuses (Python values; text forms are made by the callers)."""
    d, kind = s.decl, _numeric(s)
    out: list = []
    if d.parse is not None:  # a notation of its own (a byte size, a list of rounds): what it cannot read
        out += ["abc", "-1", "[[]", "1,,x", True]
    elif kind is not None:
        eps = 1 if kind is int else (abs(d.low or d.high or 1) * 1e-6 or 1e-9)
        if d.low is not None:
            out.append(d.low if d.low_open else (d.low - eps if kind is float else int(math.floor(d.low)) - 1))
        if d.high is not None:
            out.append(d.high if d.high_open else (d.high + eps if kind is float else int(d.high) + 1))
        if d.limit is not None:
            out.append(kind(d.limit) * 10 if kind is float else int(d.limit) * 10 + 1)
        if kind is float:
            out += [math.nan, math.inf, -math.inf, FLOAT32_MAX * 10, "abc", "1.5.2", True]
        else:
            out += [INT64[1] + 1, 1.5, "abc", "2.5", math.nan, True]
            if d.low is None or d.low > -(2**63):
                out.append(INT64[0] - 1)
    elif s.kind is bool:
        out += ["maybe", 2, "2", 0.5]
    elif s.kind is str:
        allowed = d.allowed()
        if d.registry is not None or allowed is not None:
            out += ["no-such-" + s.name, "ü", ""] if d.numbers is None else ["no-such", "-3", "0", "1.5", "٣"]
        if d.path is not None:
            out += [123, "a\x00b", "x" * 5000]
            if d.path == "name":
                out += ["../x", "/abs/x", "..", ".", "a/b", "a\nb", "n" * 300]
    if s.kind is tuple:
        out = [[v] for v in out if not isinstance(v, list)] + ["a,b"]
    return [v for v in out if v is not None and not (s.decl.old_none and was_none(s, v))]  # an old None: valid


def text_of(v) -> str:
    """A value as a user types it on the command line."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, list):
        return ",".join(text_of(x) for x in v)
    return str(v)


def toml_of(v) -> str:
    """A value as TOML (test_bad_input's writer); what TOML cannot hold, as JSON (an unreadable file is a case too)."""
    try:
        return _toml_value(v)
    except TypeError:
        return json.dumps(v)


def bad_value(s):
    """A value the declaration of ``s`` refuses."""
    values = bad_values(s)
    if not values:  # a setting that declares nothing to refuse (a free-form string): a value of a wrong type
        values = [[1, 2]] if s.kind is not tuple else [{"a": 1}]
    return st.sampled_from(values)


@st.composite
def bad_setting(draw):
    """(owner, setting, a value it refuses), of any declared setting."""
    owner, s = draw(st.sampled_from(DECLARED))
    return owner, s, draw(bad_value(s))


# ------------------------------------------------------------------------------------------- running
def run_cli(argv: list[str], cwd: str | Path) -> tuple[int, str]:
    """``fedlt ARGV`` in this process, in the folder ``cwd`` (a relative path a bad input would write to lands
    there, where the test looks)."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), contextlib.chdir(cwd):
        try:
            code = cli_main(argv)
        except SystemExit as e:  # argparse
            code = e.code
    return int(code), err.getvalue()


@functools.cache
def options_of(command: str) -> frozenset[str]:
    """The options ``fedlt COMMAND`` takes (its argparse parser's); ``COMMAND`` may name a sub-command's own
    (``flower app``)."""
    parser = build_parser()
    for word in command.split():
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return frozenset(o for a in parser._actions for o in a.option_strings)


def command_of(argv: list[str]) -> str:
    """The (sub-)command an argument list runs: its leading words that name one (``flower app ...`` -> "flower
    app")."""
    words, parser = [], build_parser()
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        words.append(word)
        parser = subs[0].choices[word]
    return " ".join(words)


QUOTED = re.compile(r"(?<!\w)'[^']*'(?!\w)|\"[^\"]*\"")  # a value the message repeats (the input): no suggestion
OPTION = re.compile(r"(?<![\w.-])--[a-z][a-z0-9-]*")


def unknown_options(command: str, line: str) -> list[str]:
    """The ``--options`` a message names (outside the quoted values it repeats) that ``fedlt COMMAND`` does not
    take: a fix that does not exist."""
    return [o for o in OPTION.findall(QUOTED.sub("", line)) if o not in options_of(command)]


def refused(kind: str, code: int, stderr: str, tmp: Path, inputs: set[str], *names: str, command: str = "run") -> None:
    """Exit status 2, one line (naming one of ``names`` where given) whose every ``--option`` is one of
    ``fedlt COMMAND``'s, no traceback, nothing but the ``inputs`` in ``tmp``."""
    DRAWN[kind] = DRAWN.get(kind, 0) + 1
    assert "Traceback" not in stderr, stderr
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, (code, stderr[-2000:])
    assert lines[0].startswith("fedlt"), lines
    assert not unknown_options(command, lines[0]), (f"suggests {unknown_options(command, lines[0])}, not options "
                                                     f"of fedlt {command}", lines[0])
    if names:
        assert any(n in lines[0] for n in names), (names, lines[0])
    left = sorted(p.name for p in tmp.iterdir() if p.name not in inputs)
    assert not left, f"bad input left {left}: {lines[0]}"


def labels(owner: str, s) -> tuple[str, ...]:
    """How a message may name the setting."""
    flag = s.name.replace("_", "-")
    return (flag, s.name, s.label(), "--" + flag, s.name.replace("_", " ")) + \
        ((f"{owner}.{s.name}",) if owner != "run" else ())


def _cli_args(owner, s, v) -> list[str]:
    if owner != "run":
        return ["--method", owner, "--set", f"{s.name}={text_of(v)}"]
    if s.kind is bool and not s.nullable:  # a switch: a value after it is an argument too many
        return [s.flag, text_of(v)]
    return [f"{s.flag}={text_of(v)}"]


# ------------------------------------------------------------------------------------------- the channels
@pytest.mark.parametrize("owner,s", DECLARED, ids=[f"{o}.{s.name}" for o, s in DECLARED])
@settings(max_examples=PER_SETTING, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_values_outside_each_declaration_are_one_line_errors(owner, s, data):
    """Each declared setting, on the command line or in a TOML run config, with a value its declaration
    refuses."""
    v = data.draw(bad_value(s), label="value")
    # text is all a command line holds: a value refused only for its type (a number for a path) goes in TOML
    typed = not isinstance(v, str) and (s.decl.path is not None or not bad_values(s))
    channel = "toml" if typed else data.draw(st.sampled_from(["cli", "toml"]), label="channel")
    REACHED.setdefault(channel, set()).add((owner, s.name))
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        if channel == "cli":
            if isinstance(v, str) and "\x00" in v:  # a NUL byte cannot be passed in argv (TOML carries it)
                v = "a\tb"
            code, err = run_cli(["run", *FAST, "--out", tmp, "--name", "r", *_cli_args(owner, s, v)], tmp)
            named = () if (s.kind is bool and not s.nullable and owner == "run") else labels(owner, s)
            refused("cli", code, err, t, set(), *named)
            return
        body = f"{s.name} = {toml_of(v)}\n" if owner == "run" else \
            f'method = "{owner}"\n[params]\n{s.name} = {toml_of(v)}\n'
        (t / "c.toml").write_text(body)
        argv = ["run", "--config", str(t / "c.toml"), *FAST, "--out", str(t / "runs"), "--name", "r"]
        if owner == "run":  # the file's value must count: the command line's same setting goes
            argv = _without(argv, s.flag)
        code, err = run_cli(argv, tmp)
        refused("toml", code, err, t, {"c.toml"}, *labels(owner, s))


def _without(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == flag:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return out


@fuzz("sweep")
@given(bad_setting(), st.sampled_from(["base", "setting", "method"]))
def test_sweep_file_values_outside_the_declarations_are_one_line_errors(case, where):
    owner, s, v = case
    hypothesis.assume(not (owner == "run" and s.name in ("out", "name", "seed")))  # the sweep sets these itself
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        base = "".join(f"{k} = {toml_of(x)}\n" for k, x in {"dataset": "digits", "clients": 4, "rounds": 1,
                                                             "local_epochs": 1}.items()
                       if not (owner == "run" and k == s.name and where == "base"))
        if owner == "run":
            entry = f"{s.name} = {toml_of(v)}\n"
            table = {"base": f"[base]\n{base}{entry}[methods]\nfedavg = {{}}\n",
                     "setting": f"[base]\n{base}[settings.a]\n{entry}[methods]\nfedavg = {{}}\n",
                     "method": f"[base]\n{base}[methods.fedavg]\n{entry}"}[where]
        else:
            table = f"[base]\n{base}[methods.{json.dumps(owner)}]\nparams = {{ {s.name} = {toml_of(v)} }}\n"
        (t / "grid.toml").write_text(f'seeds = [0]\nout = "{t / "sweep"}"\n{table}')
        code, err = run_cli(["sweep", str(t / "grid.toml"), "--no-report", "--threads", "1"], tmp)
        refused("sweep", code, err, t, {"grid.toml"}, *labels(owner, s), command="sweep")


NUM_TRAIN = 1277  # digits' training split (a partition file indexes it)
BAD_CLIENTS = st.sampled_from([
    [[-1]], [[NUM_TRAIN]], [[2**63]], [[2**70]], [[-(2**64)]], [[1.5]], [[True]], [["3"]], [[[1]]], [[]], [[1, 1]],
    [[1], [1]], [None], [{"a": 1}], "x", 3, {"a": "x"},
])


@st.composite
def partition_documents(draw) -> bytes:
    shape = draw(st.sampled_from(["list", "mapping", "document", "raw"]))
    if shape == "raw":
        return draw(st.sampled_from([b"", b"{", b"\xff\xfe", b"[" * 5000 + b"]" * 5000, b"null", b"12", b"[]",
                                     b'{"clients": []}', b'{"clients": {}}',
                                     b'{"clients": 5}', json.dumps({"a": "x"}).encode()]))
    good = [list(range(i * 10, i * 10 + 10)) for i in range(3)]
    bad = draw(BAD_CLIENTS)
    clients = (good + bad) if isinstance(bad, list) else bad
    if shape == "list":
        doc = clients
    elif shape == "mapping":
        doc = {str(k): c for k, c in enumerate(clients)} if isinstance(clients, list) else clients
    else:
        extra = draw(st.sampled_from([{}, {"dataset": "cifar10"}, {"num_train": 5}, {"num_train": NUM_TRAIN}]))
        doc = {"clients": clients, **extra}
    return json.dumps(doc).encode()


@fuzz("partition")
@given(partition_documents())
def test_broken_partition_files_are_one_line_errors(data):
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "p.json").write_bytes(data)
        code, err = run_cli(["run", "--dataset", "digits", "--partition-file", str(t / "p.json"), "--rounds", "1",
                             "--local-epochs", "1", "--threads", "1", "--no-progress", "--out", str(t / "runs"),
                             "--name", "r"], tmp)
        refused("partition", code, err, t, {"p.json"}, "partition")


def test_inputs_drawn():
    """How many inputs the tests above drew (``pytest -s`` prints it), and that every declared setting was reached
    by at least one of the setting channels."""
    if len(DRAWN) < 4:
        pytest.skip("run together with the property-based tests above")
    total = sum(DRAWN.values())
    print(f"\nbad inputs drawn: {total} ({', '.join(f'{k} {n}' for k, n in sorted(DRAWN.items()))}) from the "
          f"declarations of {len(DECLARED)} settings (run settings and method parameters)")
    missing = sorted(f"{o}.{s.name}" for o, s in DECLARED
                     if not any((o, s.name) in REACHED.get(k, ()) for k in ("cli", "toml")))
    assert not missing, f"settings never drawn: {missing}"


# ------------------------------------------------------------------------------------------- limits on purpose
def test_limits_can_be_passed_on_purpose_bounds_cannot():
    """A declared limit guards against typos; ``--allow-large`` passes it, for run settings and method
    parameters alike (the configuration is accepted; nothing is run here). A bound cannot be passed."""
    from fedlt.config import load_config
    from fedlt.errors import ConfigError

    with pytest.raises(ConfigError, match="personal_epochs"):
        load_config(None, {"method": "ditto", "params": {"personal_epochs": 10**9}})
    cfg = load_config(None, {"method": "ditto", "params": {"personal_epochs": 10**5}, "allow_large": True,
                             "rounds": 2 * 10**6})
    assert cfg.params["personal_epochs"] == 10**5 and cfg.rounds == 2 * 10**6
    with pytest.raises(ConfigError, match="ki_weight"):  # a loss weight below 0: no switch allows it
        load_config(None, {"method": "balancefl", "params": {"ki_weight": -5}, "allow_large": True})
    with pytest.raises(ConfigError, match="gamma"):
        load_config(None, {"method": "fedloge", "params": {"gamma": 0}})


def test_every_numeric_setting_is_bounded():
    """Every int setting (run settings and method parameters) has an upper bound or a limit, and every float
    one a lower bound unless a negative value means something: what a typo can cost is bounded."""
    free_floats = {("run", "momentum"), ("fedgpa", "mu"), ("fedgpa", "vit_mean")}
    unbounded = []
    for owner, s in DECLARED:
        kind, d = _numeric(s), s.decl
        if kind is int and d.high is None and d.limit is None and d.choices is None and d.parse is None:
            unbounded.append(f"{owner}.{s.name} (int: no high, no limit)")
        if kind is float and d.low is None and (owner, s.name) not in free_floats:
            unbounded.append(f"{owner}.{s.name} (float: no low)")
    assert not unbounded, unbounded


@pytest.mark.parametrize("drop", ["sim", "elapsed", "sim.rng", "sim.history", "sim.round"])
def test_a_checkpoint_missing_a_section_is_a_one_line_error_naming_it(tmp_path, drop):
    """A checkpoint that lacks a section a resume reads (written by another program, edited) is refused with one
    line naming the section, as a damaged file is -- never a KeyError."""
    import torch

    from fedlt.errors import ConfigError
    from fedlt.runner.runstate import CHECKPOINT, load_checkpoint
    from fedlt.safefile import save_tree

    sim = {"round": 1, "state": {"w": torch.zeros(2)}, "client_states": {}, "history": [{"round": 1}],
           "missing": {}, "method": {}, "rng": {"torch": torch.get_rng_state()}}
    tree = {"sim": sim, "config": {}, "elapsed": 1.0}
    part, _, key = drop.rpartition(".")
    del (tree[part] if part else tree)[key]
    save_tree(tmp_path / CHECKPOINT, tree, "checkpoint")
    with pytest.raises(ConfigError) as e:
        load_checkpoint(tmp_path, {})
    assert drop in str(e.value) and "\n" not in str(e.value), str(e.value)


# ------------------------------------------------------------------------------- lines that misled (issue 57)
MISLED = {  # what a new user typed, and what the line must name: the thing, then a fix that exists
    "speed file named by nothing": (["--speed-file", ""], ("--speed-file ''", "leave --speed-file out")),
    "a partitioner that takes no arguments": (
        ["--partition", "flwr:IidPartitioner", "--set", "partition.bogus=1"],
        ("'bogus'", "it takes none", "drop partition.bogus")),
    "clients a partitioner's arguments leave empty": (
        ["--partition", "flwr:DirichletPartitioner", "--set", "partition.alpha=0.05", "--set",
         "partition.min_partition_size=0", "--clients", "100"],
        ("clients got no training sample", "--set partition.KEY=VALUE")),
}


@pytest.mark.parametrize("case", MISLED)
def test_lines_that_misled_name_the_input_and_a_fix_that_exists(tmp_path, case):
    """Inputs that were refused with a blank where the name belongs, or a fix that does not exist (an option
    ``fedlt run`` lacks): one line that names both, every option in it one of ``fedlt run``'s (``refused``)."""
    argv, says = MISLED[case]
    code, err = run_cli(["run", *_without(FAST, "--clients"), "--clients", "4", "--out", str(tmp_path / "runs"),
                         "--name", "r", *argv], tmp_path)
    refused("misled", code, err, tmp_path, set())
    assert all(s in err for s in says), (says, err)


def test_a_resume_with_other_settings_says_how_to_resume_or_start_anew(tmp_path):
    """A run that lives in --out, resumed with another setting: the line says to resume with the settings it was
    written with, or to start a new run under another --name -- not another --out, where there is nothing to
    resume -- and the --name it suggests starts that run."""
    from conftest import dies_in_round

    from fedlt.engine.driver import Driver

    argv = ["run", *FAST, "--rounds", "3", "--checkpoint-every", "1", "--out", str(tmp_path / "runs"), "--name", "r"]
    with dies_in_round(Driver, 2):
        run_cli(argv, tmp_path)
    code, err = run_cli([*argv, "--resume", "--lr", "0.2"], tmp_path)
    line = err.strip()
    assert code == 2 and "\n" not in line and "other settings (lr" in line, err
    assert not unknown_options("run", line) and "--name" in line and "another --out" not in line, line
    assert run_cli([*argv[:-1], "r2", "--lr", "0.2"], tmp_path)[0] == 0  # the fix it names
