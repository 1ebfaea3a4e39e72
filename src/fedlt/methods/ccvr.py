"""CCVR (Luo et al., NeurIPS 2021): FedAvg, then the classifier re-trained on virtual features from class Gaussians.

"No Fear of Heterogeneity: Classifier Calibration for Federated Learning with Non-IID Data" (Luo, Chen, Hu,
Zhang, Liang & Feng): classifier calibration with virtual representations.

Training: FedAvg, unchanged. After the last round, one post-training phase ``ccvr``:
Client k, with the final global model's feature extractor f (eval mode, no augmentation), for every class c it
holds (N_{c,k} samples, features z):
    mu_{c,k} = mean of z,   Sigma_{c,k} = sum (z - mu)(z - mu)^T / (N_{c,k} - 1)   (0 when N_{c,k} = 1)
and sends (N_{c,k}, mu_{c,k}, Sigma_{c,k}) -- never a sample.
Server, per class, N_c = sum_k N_{c,k} (Eq. 3-4 of the paper, the exact pooled mean and covariance):
    mu_c    = sum_k N_{c,k}/N_c mu_{c,k}
    Sigma_c = sum_k (N_{c,k}-1)/(N_c-1) Sigma_{c,k}
              + sum_k N_{c,k}/(N_c-1) mu_{c,k} mu_{c,k}^T - N_c/(N_c-1) mu_c mu_c^T
then draws M_c = ``per_class`` virtual representations from N(mu_c, Sigma_c) for every class someone holds, and
re-trains the classifier (the head, starting from the FedAvg head) with cross-entropy on them: SGD ``epochs``
epochs, lr ``lr``, momentum ``momentum``, weight decay ``weight_decay``, the run's batch size.
Inference: GM "calibrated" (FedAvg backbone + re-trained head) after the phase; "fedavg" (the FedAvg head) always
-- per-round evaluations, before the phase, are FedAvg's. No personal model.
Communication: FedAvg's during training; in the phase, per held class 1 + d + d^2 floats up (plus its class id).

Paper vs. code: the authors released no code. The calibration settings are those of the reimplementation that
LongTailLib ports (smduan/Fed-CCVR: 2000 virtual features per class, 10 epochs, SGD lr 0.001, momentum 0.9,
weight decay 1e-5, starting from the trained classifier). That code computes each client's covariance with
1/N_{c,k} (``np.cov(bias=1)``) but combines them with the paper's formula, which assumes 1/(N_{c,k}-1);
``biased_local_cov=true`` reproduces it. Sampling: mu + Q diag(sqrt(max(lambda, 0))) eps from the
eigendecomposition of Sigma_c (exact for a positive semi-definite Sigma; the reimplementation adds 1e-6 I and
calls numpy's multivariate_normal).

Under ``--finetune head`` / ``lora`` (docs/finetune.md): the rounds train the head (head) or the LoRA adapters and
the head (lora); the clients' feature means and covariances are of the frozen pre-trained backbone (head) or
the adapted one (lora), and the server calibrates the head on features sampled from them, as in full.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import Message, derive_seed, load_weights
from ..core.privacy import class_gaussian_sends
from ..core.retrain import class_gaussians, draw_class_features, retrain_head, retrained_head_modes
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg

SAMPLE, SHUFFLE = 0xCC1, 0xCC2  # seed purposes
HEAD = ("head.weight", "head.bias")


@METHODS.register("ccvr")
class CCVR(FedAvg):
    phases = ("ccvr",)

    @dataclass
    class Params:
        per_class: int = setting(2000, "M_c, virtual representations per class", low=1, limit=10**6)
        epochs: int = setting(10, "classifier re-training epochs", low=0, limit=10**4)
        lr: float = setting(0.001, "re-training learning rate (SGD)", low=0, low_open=True)
        momentum: float = setting(0.9, "re-training momentum", low=0, high=1, high_open=True)
        weight_decay: float = setting(1e-5, "re-training weight decay", low=0)
        biased_local_cov: bool = setting(False, "the reimplementation's 1/N local covariance")

    @dataclass
    class State(FedAvg.State):
        calibrated: dict[str, torch.Tensor] | None = None  # the calibrated head (None before the ccvr phase)

    # training: FedAvg's; the calibration phase: the class Gaussians of the client's features, never a sample
    sends = FedAvg.sends + class_gaussian_sends("ccvr", "ccvr", "the final global backbone")

    # ------------------------------------------------------------------ the calibration phase
    def phase_configure(self, phase, state, cid):
        return Message(dict(state.weights))

    def phase_client(self, phase, payload, cstate, data, gen):
        net = self.net
        load_weights(net, payload.arrays)
        arrays = class_gaussians(net.backbone, data, "ccvr", self.p.biased_local_cov, 1024)
        return Message(arrays, {"num_examples": len(data)}), cstate

    def phase_aggregate(self, phase, state, replies):
        gen = torch.Generator(device="cpu").manual_seed(derive_seed(self.spec.seed, SAMPLE))
        drawn = draw_class_features([r for _, r in replies], "ccvr", self.p.per_class, gen, self.spec.device)
        W, b = state.weights["head.weight"], state.weights["head.bias"]
        if drawn is not None:
            W, b = self.retrain(*drawn, W, b)
        state.calibrated = {"head.weight": W, "head.bias": b}
        return state

    def retrain(self, feats, labels, W, b):
        """The head re-trained with CE on the virtual representations (mini-batch SGD, shuffled each epoch)."""
        p, s = self.p, self.spec
        head = torch.nn.Linear(W.shape[1], W.shape[0], device=W.device)
        load_weights(head, {"weight": W, "bias": b})
        gen = torch.Generator(device="cpu").manual_seed(derive_seed(s.seed, SHUFFLE))
        retrain_head(feats, labels, head, p.epochs, p.lr, s.batch_size, gen, p.momentum, p.weight_decay)
        return head.weight.detach().clone(), head.bias.detach().clone()

    # ------------------------------------------------------------------ inference
    def global_model(self, state):
        return retrained_head_modes(self.eval_model(state.weights), state.calibrated, "calibrated")
