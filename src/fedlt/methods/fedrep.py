"""FedRep (Collins et al., ICML 2021, "Exploiting Shared Representations for Personalized Federated Learning").

Client, every time it is sampled: starting from the received body (representation) and its own head,
1. ``head_epochs`` epochs of CE on the head alone (body frozen), then
2. ``body_epochs`` epochs of CE on the body alone (head frozen);
the head persists on the client and is never sent.
Server: FedAvg (weighted by n_k) of the body only.
Inference: PM = received body + the client's own head. No generic model is reported (the server never holds
a trained head); FedLoGe's Table 1 prints a FedRep GM but public code does not say how it was built.

Defaults are the official code's CIFAR-10 scripts: ``local_ep`` 11 with ``local_rep_ep`` 1, i.e. 10 head
epochs then 1 body epoch (so a round costs more than FedAvg's 2 epochs: the head epochs run the frozen body
forward only). The order is head first, then body. Where the official code uses one SGD optimiser for both
phases, we start a fresh one (the run's lr and momentum) for each phase, which only matters for momentum
carried across the switch. In its last round the official code also has every client fit its head once more
before evaluation; we do not (with half the clients per round every client is trained many times).

Learning rate: FedRep is far more sensitive to it than FedPer. On fmnist-lt (small CNN, rho 100, alpha 0.5)
at the protocol's lr 0.05 / momentum 0.9 the shared body dies in the first rounds: 10 head epochs make each
client's head large (|W| 1.8 -> 6.9 in one client's first round), the body epoch under it takes large steps, and
after averaging 110 of the 128 feature units are never active on the test set by round 5 (119 by round 50);
every client then predicts its own majority class (PM 56.8). With the official scripts' lr 0.01 / momentum 0.5
(``--lr 0.01 --momentum 0.5``) the same run reaches PM 92.2. Fewer head epochs (``--set head_epochs=1``) also
avoid the collapse at lr 0.05.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Trained
from ..core.steps import LocalSteps, Train, ce, run_steps
from ..decl import setting
from ..errors import ConfigError
from ..registry import METHODS
from .fedper import FedPer


@METHODS.register("fedrep")
class FedRep(FedPer):
    """FedPer's sharing (body averaged, head local, no GM) with FedRep's alternating local update."""
    finetune_needs = {"body": "the body's epochs after the head's"}

    @dataclass
    class Params:
        head_epochs: int = setting(10, "local_ep - local_rep_ep in the official scripts", low=0, limit=10**4)
        body_epochs: int = setting(1, "local_rep_ep", low=0, limit=10**4)

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        if self.p.head_epochs + self.p.body_epochs == 0:
            raise ConfigError("fedrep: head_epochs and body_epochs must not both be 0")

    # --dp sample: both phases are described steps, run as DP-SGD on one accountant (core.dpsgd); the head trains by
    # the same DP-SGD and never leaves the client
    dp_sample = True

    def dp_round_epochs(self) -> int:
        return self.p.head_epochs + self.p.body_epochs

    def local_train(self, payload, cstate, data, gen):
        """FedRep's two phases, each described local steps from where the last left the model, answered like the
        other sharing methods (loss: the last phase's mean; steps: both phases')."""
        weights, steps, stats = {**payload.arrays, **cstate["local"]}, 0, {"loss": 0.0}
        for epochs, part, loss in ((self.p.head_epochs, "head.", head_loss), (self.p.body_epochs, "backbone.", ce)):
            if epochs:  # 1. the head on the frozen body's features; 2. the body under the frozen head
                out = run_steps(self, LocalSteps(weights, loss, (Train(part),), epochs=epochs), data, gen, payload.lr)
                weights, stats, steps = out.weights, out.stats, steps + out.stats["steps"]
        return self.local_reply(payload, cstate, data, Trained(weights, {}, {}, {"loss": stats["loss"],
                                                                                 "steps": steps}))


def head_loss(model, x, y, extra):
    """CE through the head only: the body runs forward without a graph."""
    with torch.no_grad():
        h = model.backbone(x)
    return F.cross_entropy(model.head(h), y)
