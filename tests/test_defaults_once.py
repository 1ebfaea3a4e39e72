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
    for fn in (etf.refine_fixed_classifier, etf.sparse_etf):
        assert (default(fn, "steps"), default(fn, "lr")) == (etf.SSE_STEPS, etf.SSE_LR), fn.__name__
    spec = etf.resolve_spec("sse-c", 16, 4)
    assert (spec["steps"], spec["lr"]) == (etf.SSE_STEPS, etf.SSE_LR)
