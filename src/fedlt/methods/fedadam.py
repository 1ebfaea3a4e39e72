"""FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021; the FedOpt family).

Client: as FedAvg (E local epochs of SGD on cross-entropy from the received model); no client state.
Server, round t (Algorithm 2 of the paper, written on the pseudo-gradient g = -Delta):
    w_avg = sum_k n_k w_k / sum_k n_k
    g     = w - w_avg                                   (trainable parameters only)
    m     = beta1 * m + (1 - beta1) * g                 (m_0 = 0)
    v     = beta2 * v + (1 - beta2) * g^2               (v_0 = tau^2, the paper's v_{-1} >= tau^2)
    w     = w - server_lr * m / (sqrt(v) + tau)
m and v stay on the server. There is no bias correction in the paper (``bias_correction=true`` adds Adam's).
Buffers (BatchNorm statistics) take the plain average.
Inference: the global model; no personal model.

Defaults: beta1 = 0.9, beta2 = 0.99 (the paper, all tasks), tau = 1e-3, server_lr = 0.01 (the paper tunes
server_lr and tau per task on a grid; 1e-2 / 1e-3 is its usual pick for image tasks). Other codes differ:
FL-bench uses server_lr 0.1, beta2 0.999; the FedExP code uses server_lr 0.1 with a bias-corrected variant
and tau inside the square root. The client learning rate and server_lr interact strongly
("Adaptive Federated Optimization", Reddi et al., ICLR 2021).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.server_opt import ServerOpt, adam_direction
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


@METHODS.register("fedadam")
class FedAdam(ServerOpt, FedAvg):
    secagg = True  # its server step reads only the weighted mean of the replies (--secagg: core.secagg)

    @dataclass
    class Params:
        server_lr: float = setting(0.01, "eta, the server's step size", low=0, low_open=True)
        beta1: float = setting(0.9, "first-moment decay", low=0, high=1, high_open=True)
        beta2: float = setting(0.99, "second-moment decay", low=0, high=1, high_open=True)
        tau: float = setting(1e-3, "degree of adaptivity", low=0, low_open=True)
        bias_correction: bool = setting(False, "Adam's bias correction (the paper has none)")

    def direction(self, g, opt):
        p = self.p
        return adam_direction(g, opt, p.beta1, p.beta2, p.tau, p.bias_correction)
