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

The server-optimiser machinery (pseudo-gradient, step, parameter/buffer split) is in core/server_opt.py and
is shared with FedAdam, FedExP and SCAFFOLD.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core import weighted_average
from ..core.server_opt import ParamKeys, momentum_direction, pseudo_gradient, server_step
from ..errors import ConfigError
from ..registry import METHODS
from .fedavg import FedAvg


class ServerOptMethod(ParamKeys, FedAvg):
    """FedAvg clients plus a server optimiser on the pseudo-gradient; subclasses give ``direction``.

    ``Params`` must have ``server_lr``. The optimiser state is ``state["server_opt"]``.
    """

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        if not self.p.server_lr > 0:
            raise ConfigError(f"{self.name}: server_lr must be > 0, got {self.p.server_lr}")

    def init_server(self) -> dict:
        return {**super().init_server(), "server_opt": {}}

    def direction(self, g: dict, opt: dict) -> dict:
        raise NotImplementedError

    def aggregate(self, state, rnd, replies):
        avg = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies])
        g = pseudo_gradient(state["weights"], avg, self.param_keys)
        d = self.direction(g, state.setdefault("server_opt", {}))
        state["weights"] = server_step(state["weights"], avg, d, self.p.server_lr)
        return state


@METHODS.register("fedavgm")
class FedAvgM(ServerOptMethod):
    name = "fedavgm"

    @dataclass
    class Params:
        server_lr: float = 1.0  # eta_s
        momentum: float = 0.9  # beta
        nesterov: bool = False  # FL-bench's variant: direction g + beta * v

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        if not 0.0 <= self.p.momentum < 1.0:
            raise ConfigError(f"fedavgm: momentum must be in [0, 1), got {self.p.momentum}")

    def direction(self, g, opt):
        return momentum_direction(g, opt, self.p.momentum, self.p.nesterov)
