"""FedDr+ ("feddr+"), plain dot-regression ("dr") and FedDr+ FT: a frozen ETF head, dot-regression, distillation.

Kim et al., FedKDD 2024, arXiv 2406.02355, "FedDr+: Stabilizing Dot-regression with Global Feature Distillation
for Federated Learning" (Eq. 1; FedDr+ FT in App. D.1).

Model: the backbone ``f`` followed by a frozen simplex-ETF head ``V`` (Sec. 2.2):
``V = sqrt(C/(C-1)) U (I_C - 11^T/C)``, ``U`` a random ``d x C`` matrix with orthonormal columns, no bias
(``core.etf.fixed_classifier("etf", ...)``, seeded by the run seed; needs ``d >= C - 1``).

Client (Eq. 1), starting from the received global model ``theta_g`` (kept frozen as the teacher):
    L_Dr+ = beta * L_DR + (1 - beta) * L_FD
    L_DR  = 1/2 (cos(f(x; theta), v_y) - 1)^2                      dot-regression: only pulls f towards v_y
    L_FD  = 1/d ||f(x; theta) - f(x; theta_g)||^2                   feature distillation to the global model
  both averaged over the batch; beta = 0.9. Only the backbone is trained (the head has requires_grad False,
  so it is outside the optimiser and weight decay cannot move it). ``dr`` is the same method with beta = 1
  (no teacher, no distillation: the paper's Sec. 3.1 baseline).
Server: FedAvg (sample-weighted) of the backbone. The head is never changed.
Inference: generic model ``argmax_c cos(f(x), v_c)`` (= argmax of ``V f(x)``, as the rows of V have unit norm).
FedDr+ FT (App. D.1, a post-training phase ``finetune``): every client fine-tunes the final global model on its
own data with L_Dr+ (``ft_beta``; App. D.2 also tries L_DR, i.e. ``ft_beta=1``) for ``ft_epochs`` epochs and
keeps it as its personalized model (it never leaves the client).

Paper vs. code (etri-edgeai/nn-dist-train ``gfl/algorithms/feddr``, the FedDr+ group's code base;
no standalone official FedDr+ repository exists):
- The code builds U from the QR of the random initial head; here it is the QR of a seeded Gaussian matrix (the
  paper's "randomly initialized orthogonal matrix"). Either way the ETF is a function of the seed only, so
  every process builds the same head and it is never sent: messages carry the backbone only (the code ships
  the whole state dict, frozen head included: C x d more floats per message).
- The learning rate was grid-searched per algorithm in the paper (0.35 on CIFAR-10/VGG-11, 5.0 on
  CIFAR-100/MobileNet; the cosine loss has small gradients). ``lr`` (None = the run's ``--lr``) sets it.
- The code's Dirichlet setting runs a fixed number of steps per client (mean client size / batch x E, on
  fresh random batches); here clients run E epochs over their own data, like every other method of the
  comparison. The code decays the lr x0.1 at rounds 160 and 240: ``--lr-schedule step --lr-milestones 160,240``
  (an own ``lr`` is scaled by the schedule like the run's); the default schedule is constant.
- The exact FT recipe of the paper is not published (the code base's PFL protocol fine-tunes for 5 epochs);
  ``ft_epochs`` = 5 and the run's optimiser settings (``ft_lr`` None: the run's lr).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core import Message, Method, load_weights, make_optimizer, train_local, weights_of
from ..core.etf import fixed_classifier
from ..core.personal import personal_predictor
from ..core.privacy import MODEL, sent, sends_with
from ..core.steps import LocalSteps, Train, strip
from ..decl import setting
from ..models import backbone_keys
from ..registry import METHODS


def dot_regression(h: torch.Tensor, V: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample L_DR = 1/2 (cos(h, v_y) - 1)^2 for features ``h`` [B, d] and class vectors ``V`` [C, d]."""
    return 0.5 * (F.cosine_similarity(h, V[y], dim=1) - 1).pow(2)


def feddr_loss(h: torch.Tensor, h_g: torch.Tensor | None, V: torch.Tensor, y: torch.Tensor, beta: float) -> torch.Tensor:
    """Eq. 1: beta * mean L_DR + (1 - beta) * mean over batch x d of (h - h_g)^2 (``h_g`` unused when beta = 1)."""
    loss = beta * dot_regression(h, V, y).mean()
    if beta < 1:
        loss = loss + (1 - beta) * (h - h_g).pow(2).mean()
    return loss


@METHODS.register("feddr+")
class FedDrPlus(Method):
    finetune_needs = {"body": "the backbone under a fixed ETF classifier"}

    personalized = True
    secagg = True  # its server is FedAvg's weighted mean (--secagg: core.secagg)
    # --dp sample: a sample's L_Dr+ reads it, the frozen ETF and the received backbone (core.dpsgd); the FT phase's
    # personal model never leaves the client and fine-tunes by plain SGD, as Ditto's personal model does
    dp_sample = True

    @dataclass
    class Params:
        beta: float = setting(0.9, "weight of dot-regression vs. feature distillation (Eq. 1; hard-coded 0.9 in the "
                                   "code)", low=0, high=1)
        lr: float | None = setting(None, "local SGD lr (the paper tunes it per algorithm, see the docstring)", low=0,
                                   low_open=True, none_means="the run's --lr", old_none="== 0")
        ft_epochs: int = setting(5, "FedDr+ FT: local fine-tuning epochs after training (0: no personalization "
                                    "phase)", low=0, limit=10**4)
        ft_beta: float = setting(0.9, "beta of the fine-tuning loss (App. D.1: L_Dr+; D.2: L_DR = 1.0 also works)",
                                 low=0, high=1)
        ft_lr: float | None = setting(None, "fine-tuning lr", low=0, low_open=True, none_means="the run's --lr",
                                      old_none="== 0")

    sends = sends_with(
        Method.sends,
        sent(MODEL, "model", "the trained backbone (the fixed ETF classifier never travels)"),
        sent("num_examples", "size", "the number of training samples", meta=True, when="finetune"),
        sent("*", "scalars", "the fine-tuning's mean loss and steps", meta=True, numbers_only=True, when="finetune"),
    )

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        p = self.p
        self.phases = ("finetune",) if p.ft_epochs > 0 else ()
        self.sent = sorted(backbone_keys(self.net))  # what crosses the network: the backbone only
        self._teacher = None

    def new_model(self):
        m = super().new_model()
        V = fixed_classifier("etf", m.feature_dim, m.num_classes, seed=self.spec.seed)
        head = nn.Linear(m.feature_dim, m.num_classes, bias=False)
        with torch.no_grad():
            head.weight.copy_(V)
        head.weight.requires_grad_(False)
        m.head = head.to(self.spec.device)
        return m

    # ---------------------------------------------------------------- server
    def configure(self, state, rnd, cid):
        return Message({k: state.weights[k] for k in self.sent})

    # ---------------------------------------------------------------- client
    def _train(self, arrays, data, gen, beta: float, epochs: int, lr: float) -> dict:
        """Load ``arrays`` into the working model (and the teacher, when distilling) and train it with L_Dr+."""
        net = self.net
        load_weights(net, arrays)
        teacher = None
        if beta < 1:
            if self._teacher is None:
                self._teacher = self.new_model().requires_grad_(False)
            teacher = self._teacher
            load_weights(teacher, arrays)
            teacher.eval()
        V = net.head.weight

        def loss_fn(model, x, y):
            h = model.backbone(x)
            h_g = None
            if teacher is not None:
                with torch.no_grad():
                    h_g = teacher.backbone(x)
            return feddr_loss(h, h_g, V, y, beta)

        opt = make_optimizer(net.parameters(), self.spec, lr=lr)
        return train_local(net, data, self.spec, gen, loss_fn, epochs=epochs, optimizer=opt)

    def local_steps(self, payload, cstate, data):
        """Eq. 1 on the backbone (the ETF head frozen), at the method's own lr where it has one; the received
        backbone frozen as the teacher when distilling."""
        lr = None if self.p.lr is None else self.p.lr * self.round_lr(payload) / self.spec.lr  # scaled like the run's
        teacher = {f"teacher.{k}": v for k, v in payload.arrays.items()} if self.p.beta < 1 else {}
        weights = {**{f"head.{k}": v for k, v in self.net.head.state_dict().items()}, **payload.arrays}  # + the ETF
        return LocalSteps(weights, self.dr_loss, train=(Train("backbone.", lr=lr),), extra=teacher)

    def dr_loss(self, model, x, y, extra):
        h = model.backbone(x)
        h_g = None
        if self.p.beta < 1:
            with torch.no_grad():
                h_g = model.frozen(strip(extra, "teacher."), "backbone")(x)
        return feddr_loss(h, h_g, self.net.head.weight, y, self.p.beta)  # V: the frozen ETF, the same everywhere

    def local_reply(self, payload, cstate, data, out):
        return Message({k: out.weights[k] for k in self.sent}, {"num_examples": len(data), **out.stats}), cstate

    # ---------------------------------------------------------------- FedDr+ FT
    def phase_client(self, phase, payload, cstate, data, gen):
        stats = self._train(payload.arrays, data, gen, self.p.ft_beta, self.p.ft_epochs,
                            self.round_lr(payload) if self.p.ft_lr is None else self.p.ft_lr)
        cstate = {**cstate, "personal": weights_of(self.net, self.sent)}
        return Message(meta={"num_examples": len(data), **stats}), cstate

    def personal_model(self, payload, cstate, data):
        if "personal" not in cstate:
            return None  # before the fine-tuning phase: PM is the global model
        return personal_predictor(self, cstate["personal"])


@METHODS.register("dr")
class DotRegression(FedDrPlus):
    """Plain dot-regression with the frozen ETF (FedDr+ without feature distillation: beta = 1), and
    dot-regression FT (L_DR fine-tuning, App. D.2)."""

    @dataclass
    class Params(FedDrPlus.Params):
        beta: float = 1.0
        ft_beta: float = 1.0
