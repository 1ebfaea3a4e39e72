"""Local-only training: the reference row of BalanceFL (Shuai et al., IPSN 2022, baseline "Local Training":
"the model trained using only the local data at each node, with a traditional cross entropy loss").

Client: its own model, starting from the common initial model, trained with E local epochs of CE each time the
client is sampled (the same per-client compute as FedAvg under the same sampling schedule); it lives only in
the client state.
Server: nothing. No weights are sent either way; a reply carries only the sample count and the loss.
Inference: PM = the client's own model on its own test set. There is no generic model, so no GM is reported.
(BalanceFL instead plots each local model's accuracy on the balanced test set as a box plot; averaging the
local models' weights would be one more round of FedAvg, not local training.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import Message, Method, load_weights, train_local, weights_of
from ..core.personal import initial_weights, personal_predictor
from ..core.privacy import MODEL, sends_with
from ..registry import METHODS


@METHODS.register("local")
class Local(Method):
    personalized = True
    generic = False  # global_model is None

    @dataclass
    class Params:
        pass

    @dataclass
    class State(Method.State):
        weights: dict[str, torch.Tensor] | None = None  # None: no server model (every model stays on its client)

    sends = sends_with(Method.sends, without=(MODEL,))  # no model: the number of samples and the training statistics

    def init_server(self) -> "Local.State":
        return self.State()

    def configure(self, state, rnd, cid):
        return Message()

    def aggregate(self, state, rnd, replies):
        return state

    def init_client(self, cid, data):
        return {"weights": initial_weights(self)}

    def local_train(self, payload, cstate, data, gen):
        net = self.net
        load_weights(net, cstate["weights"])
        stats = train_local(net, data, self.spec, gen, lr=payload.lr)
        return Message(meta={"num_examples": len(data), **stats}), {**cstate, "weights": weights_of(net)}

    def global_model(self, state):
        return None

    def personal_model(self, payload, cstate, data):
        return personal_predictor(self, cstate["weights"])
