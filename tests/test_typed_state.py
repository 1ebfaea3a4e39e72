"""Every method's server state is a typed dataclass (issue 42 item 2): declared beside its Params, read and written
by attribute, checkpointed as the tree the untyped dict was (so old checkpoints resume), and a misspelt or
undeclared field fails at its first assignment."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from fedlt.core.method import Method, RunSpec
from fedlt.core.state import ServerState, snapshot, state_from, tree_of, typed
from fedlt.errors import ConfigError
from fedlt.registry import METHODS

METHOD_DIR = Path(__file__).resolve().parents[1] / "src" / "fedlt" / "methods"
# a server state read or written by string key: state["k"], state.get("k"), state.setdefault / pop / update,
# "k" in state, {**super().init_server(), ...} (client states, cstate, stay dicts)
STRING_KEYS = re.compile(r"(?<![A-Za-z_])state(\[|\.get\(|\.setdefault\(|\.pop\(|\.update\()|\"\w+\" in state\b"
                         r"|\*\*super\(\)\.init_server\(\)")


def test_no_method_file_reads_its_server_state_by_string_key():
    found = [f"{p.name}:{i}: {line.strip()}" for p in sorted(METHOD_DIR.glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if STRING_KEYS.search(line)]
    assert not found, "server state by string key (declare a State field):\n" + "\n".join(found)


def test_the_scan_finds_a_planted_string_key():
    for line in ('x = state["prior"]', "p = state.get('prior')", "state.setdefault('a', {})", '"prior" in state',
                 "return {**super().init_server(), 'x': 1}"):
        assert STRING_KEYS.search(line), line
    for line in ('cstate["local"]', "state.prior", "self.state_dict()", "for k in state.weights"):
        assert not STRING_KEYS.search(line), line


@pytest.mark.parametrize("name", METHODS.names())
def test_every_methods_state_is_a_server_state_that_keeps_its_bases_fields(name):
    cls = METHODS.get(name)
    assert issubclass(cls.State, ServerState)
    fields = [f for f in dataclasses.fields(cls.State)]
    assert "weights" in {f.name for f in fields}
    for f in fields:  # the base class builds a subclass's State from the weights alone: every field has a default
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, (name, f.name)
    for base in cls.__mro__[1:]:
        if "State" in base.__dict__:
            assert issubclass(cls.State, base.__dict__["State"]), (name, base.__name__)


def test_a_state_that_drops_its_bases_fields_is_refused_when_the_class_is_made():
    @dataclasses.dataclass
    class Mine(ServerState):
        prior: torch.Tensor | None = None

    class Base(Method):
        State = Mine

    with pytest.raises(TypeError, match=r"State must subclass .*Base\.State"):
        class Child(Base):
            State = ServerState


@dataclasses.dataclass
class PriorState(ServerState):
    prior: torch.Tensor | None = None
    seen: dict = dataclasses.field(default_factory=dict)


def test_an_undeclared_field_fails_at_its_first_assignment_naming_the_fields():
    s = PriorState(weights={"w": torch.ones(2)})
    s.prior = torch.zeros(3)
    with pytest.raises(AttributeError, match=r"no field 'priro' \(fields: weights, prior, seen\)"):
        s.priro = torch.zeros(3)


def test_the_tree_is_the_old_dict_and_an_old_checkpoint_comes_back_typed():
    s = PriorState(weights={"w": torch.ones(2)}, seen={3: 1})
    tree = tree_of(s)
    assert list(tree) == ["weights", "seen"]  # prior unset: absent, as the dict never held it
    back = state_from(PriorState, {"weights": {"w": torch.ones(2)}, "prior": torch.arange(3.0)})
    assert isinstance(back, PriorState) and back.prior.tolist() == [0, 1, 2] and back.seen == {}
    assert state_from(PriorState, back) is back
    with pytest.raises(ConfigError, match=r"holds 'other', which method x's State does not declare"):
        state_from(PriorState, {"weights": {}, "other": 1}, owner="method x")
    # the mapping view for code outside the method
    assert s["weights"] is s.weights and "prior" not in s and "seen" in s and s.get("prior", 5) == 5


def test_a_snapshot_does_not_see_later_changes():
    s = PriorState(weights={"w": torch.ones(2)})
    snap = snapshot(s)
    s.weights["v"] = torch.zeros(1)
    s.prior = torch.ones(1)
    assert list(snap.weights) == ["w"] and snap.prior is None and snap.weights["w"] is s.weights["w"]


def test_a_method_written_for_the_dict_state_is_one_line_saying_what_to_declare():
    with pytest.raises(ConfigError, match=r"init_server returned dict \(weights, prior\).*declare"):
        typed(Method(RunSpec("mlp", (1, 4, 4), 3)), {"weights": {}, "prior": None})


def test_a_checkpoint_holds_the_plain_tree_and_resumes_typed():
    from fedlt.config import load_config
    from fedlt.engine import Simulation
    from fedlt.engine.driver import EngineConfig
    from fedlt.runner.rundir import prepare

    cfg = load_config(overrides=dict(method="ratioloss", dataset="synthetic", synthetic_per_class=20, clients=4, imbalance_ratio=5,
                                     rounds=2, local_epochs=1, participation=1.0, eval_every=2, threads=1))
    pr = prepare(cfg)
    sim = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    sim.train_round()
    d = sim.state_dict()
    assert type(d["state"]) is dict and set(d["state"]) <= {f.name for f in dataclasses.fields(pr.method.State)}
    again = Simulation(pr.method, pr.fed, EngineConfig.of(cfg, progress=False))
    again.load_state_dict(d)
    assert isinstance(again.state, pr.method.State)
    assert all(torch.equal(again.state.weights[k], sim.state.weights[k]) for k in sim.state.weights)
