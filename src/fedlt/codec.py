"""Plain Python objects <-> (JSON skeleton, named tensors): how fedlt values cross a process boundary.

A fedlt ``Message.meta``, a client state (what ``init_client`` / ``local_train`` return) or a server state is
a tree of dicts, lists and tuples whose leaves are numbers, strings, None, torch tensors or numpy arrays.
:func:`pack` turns such a tree into a JSON string plus a flat ``{path: tensor}`` dict -- the tensors go into a
Flower ``ArrayRecord`` and the JSON into a ``ConfigRecord`` (:mod:`fedlt.engine.flower.records`), or both into one
safetensors file (:mod:`fedlt.safefile`); :func:`unpack` rebuilds the very same tree:
tensors bit for bit with their dtype, ints stay ints, tuples stay tuples, numpy arrays stay numpy arrays.

Leaves of any other type (an ``nn.Module``, an optimiser object) cannot leave a process; they raise a
ConfigError that names the entry, because real deployment restarts client processes between messages.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from .errors import ConfigError

_T, _NP, _TUPLE, _DICT, _FLOAT = "__tensor__", "__ndarray__", "__tuple__", "__dict__", "__float__"


def pack(obj: Any, what: str = "value", keep_device: bool = False) -> tuple[str, dict[str, torch.Tensor]]:
    """(JSON skeleton, tensors) for a tree of dicts/lists/tuples of numbers, strings, tensors, arrays. The
    tensors are moved to the CPU unless ``keep_device`` (the caller moves them and records where they were)."""
    arrays: dict[str, torch.Tensor] = {}

    def enc(o: Any, path: str):
        if isinstance(o, torch.Tensor):
            arrays[path] = o.detach() if keep_device else o.detach().cpu()
            return {_T: path}
        if isinstance(o, np.ndarray):
            arrays[path] = torch.from_numpy(np.ascontiguousarray(o))
            return {_NP: path}
        if isinstance(o, (bool, int, str)) or o is None:
            return o
        if isinstance(o, float):
            return o if math.isfinite(o) else {_FLOAT: repr(o)}
        if isinstance(o, np.generic):
            return enc(o.item(), path)
        if isinstance(o, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in o):
                return {k: enc(v, f"{path}/{k}") for k, v in o.items()}
            return {_DICT: [[enc(k, f"{path}/k{i}"), enc(v, f"{path}/{i}")] for i, (k, v) in enumerate(o.items())]}
        if isinstance(o, (list, tuple)):
            items = [enc(v, f"{path}/{i}") for i, v in enumerate(o)]
            return {_TUPLE: items} if isinstance(o, tuple) else items
        raise ConfigError(f"{what} entry {path or '/'} is a {type(o).__name__}, which cannot be sent between "
                          f"processes; keep tensors, numpy arrays, numbers, strings, lists and dicts there")

    skeleton = enc(obj, "")
    return json.dumps(skeleton, separators=(",", ":")), arrays


def unpack(skeleton: str, arrays: dict[str, torch.Tensor]) -> Any:
    """The tree that :func:`pack` packed."""

    def dec(o: Any):
        if isinstance(o, list):
            return [dec(v) for v in o]
        if isinstance(o, dict):
            if len(o) == 1:
                (k, v), = o.items()
                if k == _T:
                    return arrays[v]
                if k == _NP:
                    return arrays[v].numpy()
                if k == _TUPLE:
                    return tuple(dec(x) for x in v)
                if k == _DICT:
                    return {dec(a): dec(b) for a, b in v}
                if k == _FLOAT:
                    return float(v)
            return {k: dec(v) for k, v in o.items()}
        return o

    return dec(json.loads(skeleton))
