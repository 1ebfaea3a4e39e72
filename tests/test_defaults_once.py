"""Every default that two places share is written once (issue 42): the others read it from its one constant."""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fedlt"
# files whose literal checkpoint default waits for its owner's edit (fedlt.runner.preempt.DEFAULT_CHECKPOINT_EVERY)
PENDING: set[str] = set()


def default(fn, name):
    return inspect.signature(fn).parameters[name].default


def test_the_checkpoint_default_is_preempts_constant():
    from fedlt import api
    from fedlt.experiments import reproduce
    from fedlt.runner.preempt import DEFAULT_CHECKPOINT_EVERY

    for fn in (api.compare, api.reproduce, reproduce.plan_reproduction):
        assert default(fn, "checkpoint_every") == DEFAULT_CHECKPOINT_EVERY, fn.__qualname__
    # `checkpoint_every: int = 1` or `checkpoint_every=1` (not a sweep file's `checkpoint_every = 1`, nor the
    # engines' own `= 0`, which their callers always replace)
    literal = re.compile(r"checkpoint_every(?::\s*int\s*=\s*|=)1\b")
    found = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py") if p.relative_to(SRC).as_posix() not in PENDING
             for i, line in enumerate(p.read_text().splitlines(), 1) if literal.search(line)]
    assert not found, f"a checkpoint default written out again (use DEFAULT_CHECKPOINT_EVERY): {found}"


def test_the_flower_strategys_defaults_are_flower_defaults():
    pytest.importorskip("flwr")
    from fedlt.flower.settings import FLOWER_DEFAULTS
    from fedlt.flower.strategy import FedltStrategy

    for arg in ("round_timeout", "wait_timeout", "poll_interval"):
        assert default(FedltStrategy.__init__, arg) == FLOWER_DEFAULTS[arg.replace("_", "-")], arg


def test_fedloges_sse_c_defaults_are_the_etf_modules():
    from fedlt.core import etf
    from fedlt.methods.fedloge import FedLoGe

    fields = {f.name: f.default for f in dataclasses.fields(FedLoGe.Params)}
    assert (fields["sse_steps"], fields["sse_lr"]) == (etf.SSE_STEPS, etf.SSE_LR) == (10_000, 1e-4)
    assert fields["sse_precision"] == etf.SSE_PRECISION == default(etf.sparse_etf, "precision") == "float64"
    for fn in (etf.refine_fixed_classifier, etf.sparse_etf):
        assert (default(fn, "steps"), default(fn, "lr")) == (etf.SSE_STEPS, etf.SSE_LR), fn.__name__
    spec = etf.resolve_spec("sse-c", 16, 4)
    assert (spec["steps"], spec["lr"], spec["precision"]) == (etf.SSE_STEPS, etf.SSE_LR, etf.SSE_PRECISION)


def test_the_spec_and_the_engine_config_restate_no_setting():
    """RunSpec and EngineConfig hold every setting their part reads, with the declaration's own default and
    declaration (one object, not a copy), and no field of theirs shadows a setting with a default of its own."""
    from fedlt.config import RunConfig
    from fedlt.core.spec import RunSpec
    from fedlt.decl import read_by, settings_of
    from fedlt.engine.driver import EngineConfig

    run = settings_of(RunConfig)
    for cls, part in ((RunSpec, "spec"), (EngineConfig, "engine")):
        mine = settings_of(cls)
        reads = read_by(RunConfig, part)
        assert reads, part
        for alias, name in reads.items():
            assert alias in mine, f"{cls.__name__} lacks {alias}, which the {part} reads"
            assert mine[alias].default == run[name].default, (cls.__name__, alias)
            assert mine[alias].decl.help == run[name].decl.help and mine[alias].decl.low == run[name].decl.low
        # a RunConfig setting by name in the class, not derived from the setting: a restated default
        restated = [f for f in mine if f in run and f not in reads and mine[f].default is not dataclasses.MISSING]
        assert not restated, f"{cls.__name__} restates {restated}: declare reads=({part!r},) on the setting"
    # the run's values reach them converted by their declarations
    cfg = RunConfig(client_state_memory="1GB", lr_milestones="3,7", lr_schedule="step", rounds=9, clients=4)
    eng = EngineConfig.of(cfg)
    assert (eng.client_state_memory, eng.rounds) == (10**9, 9)
    from fedlt.decl import settings_values

    spec = RunSpec(model="mlp", in_shape=(1, 8, 8), num_classes=3, **settings_values(cfg, "spec"))
    assert (spec.num_clients, spec.rounds, spec.lr_at(8)) == (4, 9, pytest.approx(cfg.lr * cfg.lr_gamma ** 2))


def test_a_new_setting_is_one_declaration():
    """A setting declared with reads=("engine",) is a field of the engine's config without another line."""
    from dataclasses import dataclass

    from fedlt.decl import reads_settings, setting, settings_values

    @dataclass
    class Config:
        width: int = setting(7, "a new setting", low=1, reads=("engine",))
        other: int = setting(1, "not the engine's")

    @reads_settings(Config, "engine")
    class Engine:
        progress: bool = True

    assert [f.name for f in dataclasses.fields(Engine)] == ["width", "progress"]
    assert Engine().width == 7 and Engine(**settings_values(Config(width="9"), "engine")).width == 9


def test_the_dp_settings_defaults_are_values_of_the_mechanisms_constants():
    """--dp-stats-clip and --dp-counts-noise default to the constants their mechanisms use (not text that says a
    number), and --dp-noise-seed's None is the engine's default, resolved by fedlt.core.noise."""
    from fedlt.config import RunConfig
    from fedlt.core import dp, dpsgd, noise
    from fedlt.decl import settings_of

    s = settings_of(RunConfig)
    assert s["dp_stats_clip"].default == dp.STATS_CLIP and s["dp_stats_clip"].decl.none_means is None
    assert s["dp_counts_noise"].default == dpsgd.COUNTS_NOISE and s["dp_counts_noise"].decl.none_means is None
    assert dpsgd.counts_of(RunConfig()) == dpsgd.COUNTS_NOISE
    assert s["dp_noise_seed"].default is None and set(noise.ENGINE_DEFAULT.values()) == set(s["dp_noise_seed"].decl
                                                                                              .allowed())
