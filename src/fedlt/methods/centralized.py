"""Centralized training: the reference row of BalanceFL (Shuai et al., IPSN 2022, baseline "Centralized
Training": "the model trained on an overall dataset aggregating all distributed data together, using the
traditional cross entropy loss").

One node holds the union of all clients' training data (``Federation.pooled()``: the same long-tailed set
the federation was cut from). The method asks for it with the class attribute ``needs_pool = True``; the
run layer (``fedlt.runner.rundir.prepare``) then hands the pool to the method (``method.pool``) before the run. The
server trains on it: every round, ``epochs_per_round`` epochs of mini-batch SGD with CE (the run's batch size,
the round's lr, the run's momentum). At the fmnist-lt defaults (half the clients per round, 2 local epochs)
one epoch over the pool is the number of sample visits of one FedAvg round, so the default 1 gives both the
same training budget.
Clients: nothing to do; they receive nothing and reply only a zero sample count.
Stability: this is plain SGD over 50+ epochs with no federated averaging to damp it. On fmnist-lt at the
protocol's lr 0.05 / momentum 0.9 it reached GM 82 by round 15, then fell and ended predicting one class
(GM 10.0 at round 50, weights finite, all 128 feature units dead on the test set); at ``--lr 0.01`` it ends
at GM 85.0, the reference row we report.
Inference: GM = the centrally trained model; it has no personal model, so PM is that model on the clients'
own test sets (labelled as the global model in the output).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import Message, Method, derive_seed, load_weights, train_local, weights_of
from ..core.privacy import sent
from ..decl import setting
from ..errors import ConfigError
from ..registry import METHODS

POOL_TRAIN = 21  # purpose key of the server's training generator


@METHODS.register("centralized")
class Centralized(Method):
    needs_pool = True  # the run layer (rundir.prepare) sets self.pool = Federation.pooled()

    @dataclass
    class Params:
        epochs_per_round: int = setting(1, "epochs over the pooled data per round", low=1, limit=10**4)

    # a reference, not a federated method: every client's data is pooled on the server (outside any message); the
    # clients' replies carry nothing of theirs
    sends = (sent("num_examples", "size", "always 0: the clients do not train (the server trains on the pooled "
                  "data)", meta=True),)

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        self.pool = None

    def configure(self, state, rnd, cid):
        return Message()

    def local_train(self, payload, cstate, data, gen):
        return Message(meta={"num_examples": 0}), cstate

    def aggregate(self, state, rnd, replies):
        if self.pool is None:
            raise ConfigError("centralized needs the pooled training data: run it through `fedlt run` or "
                              "fedlt.runner.rundir.prepare, which attach it (method.pool = federation.pooled())")
        net = self.net
        load_weights(net, state.weights)
        gen = torch.Generator().manual_seed(derive_seed(self.spec.seed, POOL_TRAIN, rnd))
        train_local(net, self.pool, self.spec, gen, epochs=self.p.epochs_per_round, lr=self.spec.lr_at(rnd))
        state.weights = weights_of(net)
        return state
