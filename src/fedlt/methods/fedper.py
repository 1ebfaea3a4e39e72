"""FedPer (Arivazhagan et al., 2019, "Federated Learning with Personalization Layers").

Client: E local epochs of CE on the whole model, base and personalization layers jointly, starting from the
received base and the client's own head; the head (the personalization layer: ``models.head_keys``, i.e. the
last linear layer) persists on the client and is never sent.
Server: FedAvg (weighted by n_k) of the base (every ``backbone.*`` entry) only.
Inference: PM = received base + the client's own head. There is no generic model (the server never holds a
trained head), so no GM is reported -- FedLoGe's Table 1 prints '-' for FedPer's GM as well.

The FedBABU repository runs FedPer the same way (``local_upt_part full``, ``aggr_part body``); FL-bench and
PFLlib differ only in how they name the personal layer (a 'classifier' key substring, ``model.head``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.personal import PartialSharing
from ..core.privacy import MODEL, sent, sends_with
from ..models import head_keys
from ..registry import METHODS


@METHODS.register("fedper")
class FedPer(PartialSharing):
    generic = False  # global_model is None

    @dataclass
    class Params:
        pass

    sends = sends_with(PartialSharing.sends,
                       sent(MODEL, "model", "the trained body (the head never leaves the client)"))
    secagg = True  # the weighted mean of the body (--secagg: core.secagg)

    def local_keys(self, model):
        return head_keys(model)

    def global_model(self, state):
        return None  # no generic model: the heads never leave the clients
