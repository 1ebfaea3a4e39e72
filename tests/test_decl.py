"""One declaration per setting (fedlt.decl): what a declaration allows is what coercion, checks, the command line
and the tables derive from it; RunConfig declares every field, and every command that takes run options has one
option per declared setting, under every spelling fedlt has had."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from fedlt.config import RunConfig, SETTINGS, load_config
from fedlt.decl import (ALLOW_LARGE, Setting, add_arguments, byte_size, check, coerce, from_values, given,
                        read_old, rows, setting, settings_of)
from fedlt.errors import ConfigError
from fedlt.registry import DATASETS


@dataclass
class Demo:
    rate: float = setting(0.1, "a rate", low=0, low_open=True)
    frac: float = setting(0.5, "a fraction", low=0, high=1, high_open=True)
    count: int = setting(3, "a count", low=1, limit=100)
    kind: str = setting("a", "a kind", choices=("a", "b", "c"))
    chunk: str = setting("auto", "auto, off or N", choices=("auto", "off"), numbers=int, low=1, unit="clients")
    scale: float | None = setting(None, "a scale", low=0, none_means="the variant's", old_none="< 0")
    names: tuple[str, ...] = setting((), "trackers", choices=("csv", "tensorboard"))
    size: int | None = setting(None, "memory", parse=byte_size, unit="bytes")
    data: str = setting("digits", "a dataset", registry=DATASETS)
    on: bool = setting(False, "a switch")
    plain: int = 4  # an undeclared field, as a plugin's Params may have


def s(name: str) -> Setting:
    return settings_of(Demo)[name]


def test_types_come_from_the_annotations():
    got = {n: (x.kind, x.item, x.nullable, x.declared) for n, x in settings_of(Demo).items()}
    assert got["rate"] == (float, None, False, True) and got["scale"] == (float, None, True, True)
    assert got["names"] == (tuple, str, False, True) and got["on"] == (bool, None, False, True)
    assert got["plain"] == (int, None, False, False)


@pytest.mark.parametrize("name,value,want", [
    ("rate", "0.5", 0.5), ("rate", 2, 2.0), ("count", "7", 7), ("count", 7.0, 7), ("on", "yes", True),
    ("on", False, False), ("kind", "b", "b"), ("chunk", 4, "4"), ("scale", "none", None), ("scale", None, None),
    ("names", "csv, tensorboard", ("csv", "tensorboard")), ("names", ["csv"], ("csv",)),
    ("size", "2GB", 2 * 10**9), ("size", "512MiB", 512 * 2**20), ("plain", "5", 5),
    ("kind", Path("a"), "a"), ("count", np.int64(7), 7), ("rate", np.float32(0.5), 0.5)])
def test_values_are_coerced_to_the_declared_type(name, value, want):
    got = coerce(s(name), value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("name,value,needle", [
    ("rate", "fast", "rate expects a float, got 'fast'"), ("count", 2.5, "count expects a int, got 2.5"),
    ("count", True, "count expects a int"), ("on", "maybe", "on expects true or false"),
    ("kind", [1], "kind expects a str"), ("rate", None, "rate expects a float, got None"),
    ("size", "2 parsecs", "size: cannot read"), ("plain", "x", "plain expects a int")])
def test_values_of_the_wrong_type_are_one_line_errors(name, value, needle):
    with pytest.raises(ConfigError) as e:
        coerce(s(name), value)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name,value,needle", [
    ("rate", 0.0, "rate must be > 0, got 0"), ("frac", 1.0, "frac must be in [0, 1), got 1"),
    ("frac", -0.1, "frac must be in [0, 1)"), ("count", 0, "count must be >= 1, got 0"),
    ("count", 101, f"count 101 is out of range (at most 100; {ALLOW_LARGE}"),
    ("count", 2**70, "at most 100"),
    ("kind", "d", "unknown kind 'd'; choose a, b or c"),
    ("chunk", "0", "chunk must be auto, off or a number of clients >= 1, got '0'"),
    ("chunk", "many", "chunk must be auto, off or a number of clients >= 1"),
    ("names", ("csv", "wandb"), "unknown names 'wandb'; choose csv or tensorboard"),
    ("rate", float("nan"), "rate must be a finite number, got nan"),
    ("rate", float("inf"), "rate must be a finite number"),
    ("rate", 1e39, "a float32 holds at most"), ("plain", float("inf"), "must be a finite number"),
    ("data", "digit", "did you mean 'digits'")])
def test_values_outside_the_declaration_are_refused(name, value, needle):
    with pytest.raises(ConfigError) as e:
        check(s(name), value)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bounds_hold_exactly_at_the_edges():
    for name, ok in (("rate", 1e-30), ("frac", 0.0), ("frac", 0.999), ("count", 1), ("count", 100),
                     ("chunk", "auto"), ("chunk", "1"), ("rate", 3.4e38)):
        check(s(name), ok)
    check(s("count"), 10**6, allow_large=True)  # a limit is passed on purpose; a bound never
    with pytest.raises(ConfigError):
        check(s("frac"), 5.0, allow_large=True)


def test_old_sentinels_read_as_none_and_unknown_keys_list_the_known_ones():
    d = from_values(Demo, {"scale": -1.0, "count": "5"}, prefix="demo")
    assert d.scale is None and d.count == 5
    assert from_values(Demo, {"scale": 0.0}).scale == 0.0  # the rule is "< 0": 0 is a value
    assert read_old(Demo, {"scale": -1.0, "rate": -1.0}) == {"scale": None, "rate": -1.0}
    with pytest.raises(ConfigError, match="demo.frac must be in"):
        from_values(Demo, {"frac": 2}, prefix="demo")
    with pytest.raises(ConfigError, match="method demo has no parameter 'nu'; its parameters: rate, frac"):
        from_values(Demo, {"nu": 1}, owner="method demo", what="parameter")


def test_argparse_options_and_help_come_from_the_declaration():
    p = argparse.ArgumentParser(prog="demo")
    add_arguments(p, Demo)
    args = p.parse_args(["--rate", "0.2", "--names", "csv", "--on"])
    assert (args.rate, args.names, args.on, args.count) == ("0.2", ["csv"], True, None)  # text, coerced later
    # a list setting: the option repeated or comma-separated, or both
    again = given(p.parse_args(["--names", "csv", "--names", "tensorboard,csv"]), Demo)["names"]
    assert coerce(settings_of(Demo)["names"], again) == ("csv", "tensorboard", "csv")
    text = p.format_help()
    assert "{a,b,c}" in text and "default 0.1; > 0" in text and "default: the variant's" in text
    assert ", ".join(DATASETS.names()) in " ".join(text.split()).replace("- ", "-")  # looked up when shown
    assert "--chunk auto|off|N" in text
    typed = argparse.ArgumentParser(prog="demo")
    add_arguments(typed, Demo, ["count"], typed=True)
    assert typed.parse_args(["--count", "7"]).count == 7
    with pytest.raises(SystemExit):
        typed.parse_args(["--count", "0"])


def test_rows_describe_every_field_for_tables():
    r = {x["name"]: x for x in rows(Demo, comments={"plain": "an old comment"})}
    assert r["frac"]["allowed"] == "in [0, 1)" and r["frac"]["default"] == "0.5"
    assert r["scale"]["default"] == "None: the variant's" and "< 0 also means None" in r["scale"]["allowed"]
    assert r["count"]["allowed"] == f">= 1; at most 100 unless {ALLOW_LARGE}"
    assert r["plain"]["help"] == "an old comment" and r["chunk"]["type"] == "str or int"


# ------------------------------------------------------------------------------------------------ RunConfig
def test_every_run_setting_is_declared_with_help():
    for f in dataclasses.fields(RunConfig):
        assert "decl" in f.metadata and f.metadata["decl"].help, f"{f.name} has no declaration"


# every spelling of a run option that fedlt has had (fedlt 0.1's add_config_arguments): they all stay
SPELLINGS = ["--config", "--preset", "--dataset", "--data-dir", "--imbalance-ratio", "--rho", "--image-size",
             "--lt-profile", "--tail-classes", "--n-max", "--partition", "--partition-file", "--alpha",
             "--shards-per-client", "--classes-per-client", "--balance", "--tau", "--min-client-size", "--clients",
             "--method", "--method-file", "--set", "--model", "--rounds", "--participation", "--local-epochs",
             "--batch-size", "--lr", "--lr-schedule", "--lr-milestones", "--lr-gamma", "--momentum",
             "--weight-decay", "--seed", "--device", "--threads", "--precision", "--channels-last",
             "--client-parallel", "--cuda-graphs", "--deterministic", "--data-placement", "--on-diverge",
             "--diverge-factor", "--eval-every", "--split", "--out", "--name"]


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _subparsers(parser: argparse.ArgumentParser, path=()):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield (*path, name), sub
                yield from _subparsers(sub, (*path, name))


def test_every_command_that_takes_run_options_has_all_of_them():
    from fedlt.cli import build_parser

    declared = {"--" + n.replace("_", "-") for n, x in SETTINGS.items() if x.decl.cli} | {"--rho", "--set"}
    takers = {path: sub for path, sub in _subparsers(build_parser()) if "--rounds" in _option_strings(sub)
              and path[0] != "reproduce"}  # reproduce's --rounds shortens a paper's table
    assert {p for p in takers} >= {("run",), ("compare",), ("flower", "app"), ("flower", "run"),
                                   ("flower", "inprocess"), ("flower", "simulate")}
    for path, sub in takers.items():
        have = _option_strings(sub)
        assert declared <= have and set(SPELLINGS) <= have, (path, sorted(set(SPELLINGS) - have))


def test_soft_limits_are_passed_on_purpose_and_float32_overflow_is_refused():
    with pytest.raises(ConfigError, match="rounds 2000000 is out of range .*--allow-large"):
        load_config(overrides={"rounds": 2_000_000})
    assert load_config(overrides={"rounds": 2_000_000, "allow_large": True}).rounds == 2_000_000
    with pytest.raises(ConfigError, match="lr 1e\\+39 is out of range"):
        load_config(overrides={"lr": "1e39"})
    with pytest.raises(ConfigError, match="did you mean 100"):
        load_config(overrides={"imbalance_ratio": 0.01})


def test_a_run_directory_from_before_a_setting_existed_still_resumes():
    """A saved config without a newer setting compares as that setting's default (and --allow-large, which
    changes no number, is never compared)."""
    from fedlt.runner.runstate import NOT_COMPARED, config_differences

    current = json.loads(json.dumps(RunConfig().to_dict()))
    saved = {k: v for k, v in current.items() if k not in ("allow_large", "lr_gamma")}
    assert config_differences(saved, current) == []
    assert config_differences({**saved, "lr_gamma": 0.5}, current) == ["lr_gamma: 0.5 -> 0.1"]
    assert "allow_large" in NOT_COMPARED and "rounds" not in NOT_COMPARED
    # a method parameter added later (Ditto's personal_clip, personal_lr_scale) had its default: a checkpoint of
    # the run before resumes; a saved value other than the default still differs
    current = {**current, "method": "ditto", "method_params": {"lam": 1.0, "personal_epochs": None,
                                                              "personal_lr_scale": 1.0, "personal_clip": None}}
    before = {**saved, "method": "ditto", "method_params": {"lam": 1.0, "personal_epochs": None}}
    assert config_differences(before, current) == []
    assert config_differences(before, {**current, "method_params": {**current["method_params"], "personal_clip": 1.0}}) \
        == ["method_params: {'lam': 1.0, 'personal_epochs': None, 'personal_lr_scale': 1.0, 'personal_clip': None} -> "
            "{'lam': 1.0, 'personal_epochs': None, 'personal_lr_scale': 1.0, 'personal_clip': 1.0}"]


# ------------------------------------------------------------------------------------------------ method Params
def _methods():
    from fedlt.registry import METHODS

    return [(n, c) for n, c in METHODS.items() if METHODS.origin(n) == "built-in"]


def test_every_built_in_method_parameter_is_declared_with_help_and_no_numeric_sentinel():
    """Typed fields with help; "use the variant's default" is None (with what None means), never a number."""
    for name, cls in _methods():
        for pname, x in settings_of(cls.Params).items():
            assert x.declared and x.decl.help, f"{name}.{pname} is not declared with help"
            assert x.kind in (bool, int, float, str, tuple), f"{name}.{pname}: type {x.kind}"
            if x.default is None:
                assert x.nullable and x.decl.none_means, f"{name}.{pname}: None without its meaning"
            if isinstance(x.default, (int, float)) and not isinstance(x.default, bool):
                check(x, x.default)  # a numeric default inside its own declared range: no sentinel


def test_method_parameters_are_checked_by_the_base_class_however_params_are_made():
    from fedlt.core.spec import RunSpec
    from fedlt.registry import METHODS

    fedloge = METHODS.get("fedloge")
    with pytest.raises(ConfigError, match=r"fedloge.beta must be in \[0, 1\), got 1.5"):
        fedloge.make_params({"beta": "1.5"})
    with pytest.raises(ConfigError, match="unknown fedloge.realign 'offical'; choose paper or official"):
        fedloge.make_params({"realign": "offical"})
    p = fedloge.make_params({"head_lr": "-1", "gafr_norm": 0, "beta": "none"})  # earlier versions' sentinels
    assert (p.head_lr, p.gafr_norm, p.beta) == (None, None, None)
    spec = RunSpec(model="mlp", in_shape=(1, 8, 8), num_classes=10)
    focal = METHODS.get("fedfocal")
    with pytest.raises(ConfigError, match="fedfocal.gamma must be >= 0, got -1"):
        focal(spec, focal.Params(gamma=-1.0))  # made directly, not through make_params
    dr = METHODS.get("dr")  # a subclass that only changes defaults keeps the declaration
    assert dr.make_params().beta == 1.0
    with pytest.raises(ConfigError, match=r"dr.beta must be in \[0, 1\]"):
        dr.make_params({"beta": 2})


def test_a_resumed_run_from_before_none_reads_the_old_sentinel_as_none():
    from fedlt.runner.runstate import config_differences

    current = {"method": "fedloge", "method_params": {"beta": None, "head_lr": None, "fixed": "sse-c"}}
    saved = {"method": "fedloge", "method_params": {"beta": -1.0, "head_lr": -1.0, "fixed": "sse-c"}}
    assert config_differences(saved, current) == []
    saved["method_params"]["beta"] = 0.5
    assert config_differences(saved, current) == ["method_params: {'beta': 0.5, 'head_lr': None, 'fixed': "
                                                  "'sse-c'} -> {'beta': None, 'head_lr': None, 'fixed': 'sse-c'}"]


def test_a_plain_params_dataclass_with_comments_still_works():
    """The style of plugins written before declarations: converted like the default, described by the comment."""
    from fedlt.core.method import Method

    class Old(Method):
        name = "old"

        @dataclass
        class Params:
            scale: float = 2.0  # how much
            steps: int = 3  # how many

    p = Old.make_params({"scale": "0.5", "steps": "4"})
    assert (p.scale, p.steps) == (0.5, 4)
    with pytest.raises(ConfigError, match="old.steps expects a int"):
        Old.make_params({"steps": "many"})
    with pytest.raises(ConfigError, match="method old has no parameter 'nu'"):
        Old.make_params({"nu": 1})
    assert [(r["name"], r["help"]) for r in rows(Old.Params)] == [("scale", "how much"), ("steps", "how many")]


# ------------------------------------------------------------------------------------------------ partitions
def test_each_partition_declares_the_run_settings_it_reads():
    """The registry says what a partition reads (RunConfig fields, so TOML keys and options stay as they were);
    a run passes exactly those, under the partition's own keyword names (fedlt 0.1's partition_kw, pinned)."""
    from fedlt.data.partition import partition_settings, partitions_reading
    from fedlt.registry import PARTITIONS

    for name, fn in PARTITIONS.items():
        assert set(fn.settings.values()) <= set(SETTINGS), name
    cfg = RunConfig(alpha=0.3, min_client_size=2, balance=True, shards_per_client=4, classes_per_client=3, tau=1.5,
                    imbalance_ratio=50.0)
    old = {"dirichlet": {"alpha": 0.3, "min_size": 2, "balance": True}, "shards": {"shards_per_client": 4},
           "tau": {"tau": 1.5}, "pathological": {"classes_per_client": 3, "balance": True},
           "exdir": {"alpha": 0.3, "classes_per_client": 3, "min_size": 2},
           "local-longtail": {"alpha": 0.3, "rho": 50.0}, "iid": {}, "natural": {}, "file": {}}
    assert {n: partition_settings(n, cfg) for n in old} == old
    assert partitions_reading("balance") == ["dirichlet", "pathological"]
    with pytest.raises(ConfigError, match="--balance applies to the dirichlet and pathological partitions, not iid"):
        load_config(overrides={"balance": True, "partition": "iid"})


@dataclass
class Gated:
    mode: str = setting("off", "a mode", choices=("off", "a", "b"))
    on: bool = setting(False, "a switch")
    q: float | None = setting(None, "a quantile", low=0, low_open=True, high=1, high_open=True, metavar="Q")
    clip: float = setting(1.0, "only with a mode", low=0, low_open=True, only_with=("mode", ("a", "b")))
    seed: str | None = setting(None, "only with mode a", choices=("run", "key"), only_with=("mode", ("a",),
                                                                                              {"mode": "b"}))
    width: int = setting(4, "only with the switch", low=2, only_with=("on", (True,)))
    lr: float = setting(0.2, "only with q", low=0, low_open=True, only_with=("q", "given"))
    tag: str | None = setting(None, "only with mode b, and why", only_with=("mode", ("b",), {"mode": "a"},
                                                                            "mode a names its own"))


def test_only_with_generates_the_applies_only_when_relations_their_messages_and_bad_examples():
    from fedlt.decl import check_relations, check_values, only_with_relations

    rels = {r.setting: r for r in only_with_relations(Gated)}
    assert set(rels) == {"clip", "seed", "width", "lr", "tag"} and all(r.kind == "applies only when" for r in rels.values())
    assert rels["clip"].error(Gated()) == "--clip applies to --mode a and --mode b; add one or drop it"
    assert rels["seed"].error(Gated()) == "--seed applies to --mode a; add --mode a or drop it"
    assert rels["width"].error(Gated()) == "--width applies to --on; add --on or drop it"
    assert rels["lr"].error(Gated()) == "--lr applies to --q Q; add --q Q or drop it"
    assert rels["seed"].bad == ({"seed": "run"}, {"mode": "b", "seed": "run"})
    # the declaration's why, in words, goes into the message; a text setting's example is text ("1")
    assert rels["tag"].error(Gated()) == "--tag applies to --mode b (mode a names its own); add --mode b or drop it"
    assert rels["tag"].bad == ({"tag": "1"}, {"mode": "a", "tag": "1"})
    for name, r in rels.items():  # every bad example: a value the setting takes, other than its default, refused
        for bad in r.bad:
            cfg = Gated(**bad)
            check_values(cfg)  # the example is a value the declaration allows
            assert getattr(cfg, name) != getattr(Gated(), name)
            with pytest.raises(ConfigError, match=f"^--{name} applies to"):
                check_relations(cfg, [r])
    ok = [Gated(mode="a", clip=2.0, seed="key"), Gated(on=True, width=8), Gated(q=0.5, lr=1.0),
          Gated(mode="b", tag="x"), Gated()]
    for cfg in ok:  # where the other takes it, or at its default: nothing to refuse
        check_relations(cfg, rels.values())
