"""FedNPC (Gao, Zhao, Yang & Guo, CVPR Findings 2026): "FedNPC: Stochastic Noise-driven Post-hoc Classifier
Calibration Method for Federated Long-tailed Learning".

Stage 1 is FedAvg; stage 2 re-calibrates the aggregated classifier on the server, on pure noise: features drawn
from a standard normal with labels drawn uniformly over the classes. A classifier trained on long-tailed data
is biased towards the head classes (larger norms, larger biases); fitting it to class-balanced noise, whose
features say nothing about any class, pulls its per-class scores towards equal priors while the backbone stays
as stage 1 left it.

Stage 1 (rounds)  client: E local epochs of SGD on CE (FedAvg); server: the n_k-weighted mean of the replies.
Stage 2 (phase "npc", on the server after the last round; the clients send only their size)
                  (W, b) <- the aggregated classifier; SGD, lr ``lr``, momentum ``momentum``, no weight decay;
                  ``steps`` times:
                      F ~ N(0, I), [M, d]  (M = ``samples``);   y ~ U{0, ..., C-1}, [M]   (fresh each step)
                      one full-batch step on CE(W F + b, y)
                  the backbone is untouched.
Inference         "npc": the stage-1 backbone with the calibrated classifier (GM, after the phase);
                  "fedavg": the stage-1 model as aggregated. Before the phase, per-round evaluations report
                  "fedavg" and, with ``preview``, "npc-preview": stage 2 applied to the current aggregate with
                  the same noise (what the phase would give if training stopped here; at the last round
                  identical to it). No personalized model.
Communication:    FedAvg's; stage 2 needs no data and nothing from the clients but their size.

Paper vs. official code (JintongGao/FedNPC, ``FedAvg-FedNPC.py`` read at 48ad8d1; the paper's text could not be
read here, so its values are the code's and the README's)
==========================  ========================================  ===========================================
                            here (default)                            official code
==========================  ========================================  ===========================================
which stage-2 classifier    the one after ``steps`` steps (27:        the step with the best *global test*
is kept                     ``--E 28`` runs steps 1..27), a fixed     accuracy, evaluated after every step (and
                            number; no test data is read              None when no step beats stage 1's): model
                                                                      selection on the test set, which fedlt does
                                                                      not do, so there is no option for it
steps                       27 (CIFAR-10's ``--E 28``)                ``range(1, E)``: E - 1; README CIFAR-100:
                                                                      ``--E 50`` (``--set steps=49``)
stage-1 local optimiser     the run's (the table's protocol: SGD      SGD lr 0.1, no momentum, 10 epochs, batch
                            lr 0.05, momentum 0.9, 2 epochs)          32, a fresh optimiser every round (the
                                                                      preset ``fednpc-cifar10-lt``)
stage-1 augmentation        the dataset's (crop + flip for CIFAR)     RandomCrop(32, 4) + flip on the normalised
                                                                      tensors of every batch
==========================  ========================================  ===========================================
Defaults (official ``args_parser``): lr 0.1, momentum 0.9, 10,000 noise samples a step, E 28.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, Predictor, derive_seed
from ..core.privacy import sent
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg

NOISE = 0x4E9C  # seed purpose: the stage-2 noise (the same for the preview and the phase)
HEAD = ("head.weight", "head.bias")


def noise_calibrate(weight: torch.Tensor, bias: torch.Tensor | None, steps: int, lr: float, momentum: float,
                    samples: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FedNPC's stage 2: ``steps`` full-batch SGD steps (``lr``, ``momentum``) of the linear classifier (W [C, d],
    b [C] or None) on CE over ``samples`` fresh N(0, I) features with labels uniform over the C classes, both drawn
    from ``gen`` (CPU; the labels first, then the features, every step). Returns the new (W, b)."""
    C, d = weight.shape
    dev = weight.device
    W = weight.detach().clone().requires_grad_(True)
    b = None if bias is None else bias.detach().clone().requires_grad_(True)
    opt = torch.optim.SGD([W] if b is None else [W, b], lr=lr, momentum=momentum)
    with torch.enable_grad():
        for _ in range(steps):
            y = torch.randint(0, C, (samples,), generator=gen, device="cpu").to(dev)
            f = torch.randn(samples, d, generator=gen, device="cpu").to(dev)
            loss = F.cross_entropy(F.linear(f, W, b), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return W.detach(), (None if b is None else b.detach())


@METHODS.register("fednpc")
class FedNPC(FedAvg):
    phases = ("npc",)
    # --dp sample: stage 1 is FedAvg's per-sample cross-entropy; stage 2 reads no client data
    dp_sample = True
    # --secagg (core.secagg): the rounds' aggregate is FedAvg's weighted mean; stage 2 reads only that aggregate
    secagg = True

    @dataclass
    class Params:
        steps: int = setting(27, "stage-2 SGD steps on noise (official range(1, E), E = 28; CIFAR-100: E = 50)",
                             low=0, limit=10**5)
        lr: float = setting(0.1, "stage-2 learning rate (official --lr)", low=0, low_open=True)
        momentum: float = setting(0.9, "stage-2 SGD momentum", low=0, high=1, high_open=True)
        samples: int = setting(10000, "noise features drawn per step (official --M)", low=1, limit=10**7)
        preview: bool = setting(True, "per-round evaluations also report stage 2 applied to the current aggregate")

    @dataclass
    class State(FedAvg.State):
        npc: dict[str, torch.Tensor] | None = None  # the calibrated classifier {"weight", "bias"} (after the phase)

    sends = FedAvg.sends + (
        sent("num_examples", "size", "the number of training samples", meta=True, when="npc"),
    )

    def calibrated(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stage 2 on the classifier of ``weights``, with the run's stage-2 noise."""
        p = self.p
        gen = torch.Generator().manual_seed(derive_seed(self.spec.seed, NOISE))
        W, b = noise_calibrate(weights["head.weight"], weights.get("head.bias"), p.steps, p.lr, p.momentum,
                               p.samples, gen)
        return {"weight": W, "bias": b}

    # ------------------------------------------------------------------ stage 2
    def phase_configure(self, phase, state, cid):
        return Message()  # the clients send only their size

    def phase_client(self, phase, payload, cstate, data, gen):
        return Message(meta={"num_examples": len(data)}), cstate

    def phase_aggregate(self, phase, state, replies):
        state.npc = self.calibrated(state.weights)
        return state

    # ------------------------------------------------------------------ inference
    def global_model(self, state):
        m = self.eval_model(state.weights)

        def head(c):
            return Predictor(m.backbone, lambda h: F.linear(h, c["weight"], c["bias"]), shared_backbone=True)

        if state.npc is not None:
            return {"npc": head(state.npc), "fedavg": Predictor(m.backbone, m.head, shared_backbone=True)}
        modes = {"fedavg": Predictor(m.backbone, m.head, shared_backbone=True)}
        if self.p.preview:
            modes["npc-preview"] = head(self.calibrated(state.weights))
        return modes
