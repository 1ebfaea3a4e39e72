"""FedAvg (McMahan et al., AISTATS 2017).

Server: broadcast w; aggregate w <- sum_k n_k w_k / sum_k n_k over the round's clients (every state-dict
entry, BatchNorm running statistics included).
Client: E local epochs of mini-batch SGD on cross-entropy, starting from w.
(Described as local steps: the engine runs the clients one after another or, on a GPU, together.)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core import LocalSteps, Method, ce
from ..registry import METHODS


@METHODS.register("fedavg")
class FedAvg(Method):
    dp_sample = True  # cross-entropy of each sample (--dp sample: core.dpsgd)
    secagg = True  # the server takes the num_examples-weighted mean of the replies (--secagg: core.secagg)

    @dataclass
    class Params:
        pass

    def local_steps(self, payload, cstate, data):
        return LocalSteps(payload.arrays, ce)  # every parameter trains at the run's lr; reply: the whole model
