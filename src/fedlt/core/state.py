"""A method's server state, typed: a dataclass declared beside the method's ``Params``.

Every method keeps what its server knows between rounds in a ``State`` dataclass (``Method.State``), a
subclass of its base method's ``State``::

    class FedYoYo(FedAvg):
        @dataclass
        class State(FedAvg.State):
            prior: torch.Tensor | None = None   # the running class prior (None: no round yet)

and reads and writes it by attribute (``state.weights``, ``state.prior``). A field that is not declared cannot
be set (:class:`ServerState` refuses it, naming the fields), so a misspelt name fails at its first assignment,
and a type checker sees every access. Each field has a default: the base class's ``init_server`` builds the
subclass's ``State`` with the weights only, and a checkpoint written before a field existed resumes with its
default.

Checkpoints and Flower records carry the state as a plain tree (:func:`tree_of`: ``{field: value}``, the dict a
method's state was before it was typed, key for key), and :func:`state_from` turns such a tree -- a new
checkpoint, an old one, or the dict a third-party method's ``init_server`` still returns -- back into the
method's ``State``. Code outside a method (tests, reports, plugins) may also read a state as a mapping
(``state["weights"]``, ``"prior" in state``: a field that is set, not None).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError


@dataclass(eq=False)  # states compare by identity (their tensors have no single truth value)
class ServerState:
    """The server state every method has: the global model's weights (state-dict entries)."""

    weights: dict[str, torch.Tensor] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in type(self).__dataclass_fields__:
            raise AttributeError(f"{type(self).__qualname__} has no field {name!r} (fields: "
                                 f"{', '.join(type(self).__dataclass_fields__)}); declare it in the method's State")
        object.__setattr__(self, name, value)

    # a read-only mapping view, for code outside the method (tests, reports, plugins written for dict states)
    def __getitem__(self, key: str) -> Any:
        if key not in type(self).__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in type(self).__dataclass_fields__ and getattr(self, str(key)) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = getattr(self, key, None) if key in type(self).__dataclass_fields__ else None
        return default if value is None else value

    def keys(self):
        return [k for k in type(self).__dataclass_fields__ if getattr(self, k) is not None]

    def items(self):
        return [(k, getattr(self, k)) for k in self.keys()]


def tree_of(state: Any) -> Any:
    """The plain tree of a server state (``{field: value}``, fields left at None omitted, as a dict state never
    held them); a dict (a third-party method's state) as it is."""
    if isinstance(state, ServerState):
        return {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if getattr(state, f.name) is not None}
    return state


def state_from(cls: type[ServerState], tree: Any, owner: str = "method") -> Any:
    """``cls`` holding the values of ``tree`` (a checkpoint's or a Flower record's state, or the dict an older
    method returned); a field missing there keeps its default. A key that ``cls`` does not declare is a one-line
    ConfigError (a checkpoint of another method or version)."""
    if isinstance(tree, ServerState) or not isinstance(tree, dict):
        return tree
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(tree) - names)
    if extra:
        raise ConfigError(f"the saved server state holds {', '.join(map(repr, extra))}, which {owner}'s State does "
                          f"not declare (fields: {', '.join(sorted(names))}): was it saved by another method or "
                          f"version? start the run afresh without --resume")
    return cls(**{k: v for k, v in tree.items() if v is not None})


def typed(method: Any, state: Any) -> ServerState:
    """``state`` (what ``method.init_server()`` returned), checked to be a :class:`ServerState`: a method written for
    the untyped dict state is a one-line ConfigError that says how to declare its ``State``."""
    if isinstance(state, ServerState):
        return state
    keys = ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__
    raise ConfigError(f"method {getattr(method, 'name', method)}'s init_server returned {type(state).__name__} "
                      f"({keys}); the server state is a dataclass: declare `@dataclass class State(Base.State)` "
                      f"beside Params with a field for each of them and set them as attributes "
                      f"(docs/writing-a-method.md)")


def snapshot(state: Any) -> Any:
    """``state`` with its dicts and lists copied and its tensors shared (a snapshot that what is later added to or
    replaced in the state does not change)."""
    if isinstance(state, ServerState):
        return type(state)(**{f.name: snapshot(getattr(state, f.name)) for f in dataclasses.fields(state)})
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    return state
