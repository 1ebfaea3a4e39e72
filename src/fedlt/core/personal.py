"""Machinery shared by the personalized methods: models with a part that never leaves the client, and
predictors built from a client's own weights.

:class:`PartialSharing` is FedAvg in which some state-dict entries (``local_keys``: BatchNorm layers for
FedBN, the head for FedPer / FedRep / FedBABU) are neither sent nor received: they live in the client state,
start from the common initial model, and are loaded back on the client before every local training. The
server holds, sends and averages (weighted by n_k) only the other entries.
"""
from __future__ import annotations

import torch

from ..models import Model
from .method import Message, Method, Predictor, load_weights, weights_of
from .steps import LocalSteps, Train, ce


def personal_net(method: Method) -> Model:
    """The client-side evaluation copy of the model (apart from ``net`` and ``eval_model``).

    One copy serves every client: the evaluator uses a personal predictor before asking for the next client's,
    so a predictor is valid until the next call for another client.
    """
    if getattr(method, "_personal_net", None) is None:
        method._personal_net = method.new_model()
    return method._personal_net


def personal_predictor(method: Method, *weights: dict[str, torch.Tensor], shared_backbone: bool = False
                       ) -> Predictor:
    """A predictor from the given weight dicts, loaded in order (later entries win) into :func:`personal_net`."""
    net = personal_net(method)
    for w in weights:
        load_weights(net, w)
    net.eval()
    return Predictor(net.backbone, net.head, shared_backbone=shared_backbone)


def initial_weights(method: Method, keys=None) -> dict[str, torch.Tensor]:
    """A fresh copy of the common initial model's entries (all, or those in ``keys``): the starting point of
    every client's own part, the same on every process since it is a pure function of the run seed."""
    if getattr(method, "_initial_weights", None) is None:
        method._initial_weights = weights_of(method.new_model())
    return {k: v.clone() for k, v in method._initial_weights.items() if keys is None or k in keys}


class PartialSharing(Method):
    """FedAvg over every state-dict entry except ``local_keys``, which each client keeps to itself."""

    personalized = True
    dp_sample = True  # cross-entropy of each sample; the local part trains by the same DP-SGD (core.dpsgd)
    secagg = True  # the weighted mean of the shared entries (--secagg: core.secagg)

    def local_keys(self, model: Model) -> set[str]:
        raise NotImplementedError

    def _split(self) -> tuple[set[str], set[str]]:
        if getattr(self, "_keys", None) is None:
            local = self.local_keys(self.net)
            self._keys = (set(self.net.state_dict()) - local, local)
        return self._keys

    @property
    def shared(self) -> set[str]:
        return self._split()[0]

    @property
    def local(self) -> set[str]:
        return self._split()[1]

    def configure(self, state, rnd, cid):
        return Message({k: v for k, v in state.weights.items() if k in self.shared})

    def init_client(self, cid, data):
        return {"local": initial_weights(self, self.local)}

    trains: tuple[Train, ...] = (Train(),)  # what local training updates (FedBABU: the body only)

    def local_steps(self, payload, cstate, data):
        """Local training of the assembled model (shared part received + local part): CE, FedAvg's."""
        return LocalSteps({**payload.arrays, **cstate["local"]}, ce, self.trains)

    def local_reply(self, payload, cstate, data, out):
        """The shared part goes to the server; the local part stays in the client state."""
        cstate = {**cstate, "local": {k: v for k, v in out.weights.items() if k in self.local}}
        return Message({k: v for k, v in out.weights.items() if k in self.shared},
                       {"num_examples": len(data), **out.stats}), cstate

    def personal_model(self, payload, cstate, data):
        """The shared part received + the client's own local part. Features are the global model's only when
        no local entry sits in the backbone (FedPer, FedRep; not FedBN)."""
        shared_backbone = not any(k.startswith("backbone.") for k in self.local)
        return personal_predictor(self, payload.arrays, cstate["local"], shared_backbone=shared_backbone)
