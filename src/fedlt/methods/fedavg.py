"""FedAvg (McMahan et al., AISTATS 2017).

Server: broadcast w; aggregate w <- sum_k n_k w_k / sum_k n_k over the round's clients (every state-dict
entry, BatchNorm running statistics included).
Client: E local epochs of mini-batch SGD on cross-entropy, starting from w.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core import Message, Method, load_weights, train_local, weights_of
from ..registry import METHODS


@METHODS.register("fedavg")
class FedAvg(Method):
    name = "fedavg"

    @dataclass
    class Params:
        pass

    def local_train(self, payload, cstate, data, gen):
        net = self.net
        load_weights(net, payload.arrays)
        stats = train_local(net, data, self.spec, gen)
        return Message(weights_of(net), {"num_examples": len(data), **stats}), cstate
