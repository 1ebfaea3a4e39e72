"""FedAvgM: FedAvg with server momentum (Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data
Distribution for Federated Visual Classification", 2019).

Client: as FedAvg (E local epochs of SGD on cross-entropy from the received model); no client state.
Server, round t:
    w_avg = sum_k n_k w_k / sum_k n_k                      (sample-weighted, as FedAvg)
    g     = w - w_avg                                      (pseudo-gradient, trainable parameters only)
    v     = beta * v + g                                   (momentum buffer, kept on the server, v_0 = 0)
    w     = w - server_lr * v
Buffers (BatchNorm running statistics) take the plain average. With beta = 0 and server_lr = 1 this is
exactly FedAvg.
Inference: the global model; no personal model (PM is the global model on each client's test set).

Defaults: beta = 0.9, server_lr = 1 (the common setting; the paper sweeps beta and notes the effective
learning rate server_lr / (1 - beta)). Other codes: the FedNTD repository uses beta = 0.7 (with a
flatten/write-back bug for models with BN), CReFF 0.97, FL-bench
0.9 with Nesterov momentum (``nesterov=true`` here). RedGrape's Table 9 reports FedAvgM as a generic
baseline without its hyper-parameters.

Measured on fmnist-lt (client SGD lr 0.05, momentum 0.9): the defaults' effective server step of 10x the
averaged update is too large there. Seed 0 reached GM 75.5 (FedAvg 83.6); seed 1 stayed near 73-75 until
round 35, then the training loss rose (0.26 -> 1.9 by round 40) and the model ended predicting one class
(GM 10.0). ``--set server_lr=0.1`` (effective step 1, as FedAvg's) gave GM 82.4 and 81.4 at seeds 0 and 1.

The server-optimiser machinery (pseudo-gradient, step, parameter/buffer split, the ``ServerOpt`` mixin) is in
core/server_opt.py and is shared with FedAdam, FedExP and SCAFFOLD.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.server_opt import ServerOpt, momentum_direction
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


@METHODS.register("fedavgm")
class FedAvgM(ServerOpt, FedAvg):
    secagg = True  # its server step reads only the weighted mean of the replies (--secagg: core.secagg)

    @dataclass
    class Params:
        server_lr: float = setting(1.0, "eta_s, the server's step size", low=0, low_open=True)
        momentum: float = setting(0.9, "beta, the server momentum", low=0, high=1, high_open=True)
        nesterov: bool = setting(False, "FL-bench's variant: direction g + beta * v")

    def direction(self, g, opt):
        return momentum_direction(g, opt, self.p.momentum, self.p.nesterov)
