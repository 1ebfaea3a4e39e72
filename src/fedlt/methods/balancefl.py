"""BalanceFL (Shuai et al., "BalanceFL: Addressing Class Imbalance in Long-Tail Federated Learning", IPSN 2022).

Each client calibrates its local update as if its data were class-balanced: knowledge inheritance keeps the
global model's knowledge of the classes it lacks, and inter-class balancing (class-balanced sampling,
feature-space augmentation, smooth regularisation) treats the imbalance among the classes it has.
The server is plain FedAvg.

Client, round t, teacher = the received global model, student initialised from it; C_pos = the classes the
client holds ("activated"), C_neg = the others ("absent"):
1. Class-balanced sampling (Eq. 5, gamma = 0): each draw picks a class of C_pos uniformly, then one of its
   samples uniformly (with replacement); as many draws per epoch as local samples.
2. Feature-space augmentation: at the start of the round, teacher features of all local data give per-class
   covariances Sigma_j (zero for a class with one sample), averaged with the local counts as weights into
   Sigma (Eq. 6). During training a sample of class c gets ``h + n``, n ~ N(0, Sigma), with probability
   ``p_c = (m_max - m_c) / m_max`` (Eq. 7); the head on the augmented features gives the CE logits.
3. Loss per batch (Eq. 10), averaged over the batch:
   ``CE(y, q)`` on the augmented logits (Eq. 8)
   ``+ ki_weight * L_KI``, ``L_KI = -sum_{j in C_neg} q^'_j log q'_j`` with ``q' = softmax(z / T)`` of the
   student and ``q^'`` of the teacher (Eq. 3-4, T = 2)
   ``+ smooth_weight * L_Smooth``, ``L_Smooth = sum_{j in C_pos} q_j log q_j`` (negative entropy on the
   activated classes, Eq. 9).
   KI and smoothing use the clean (un-augmented) student logits, as the official code does.
4. Optimiser: Adam, lr 0.005 (paper Sec. 7.1; the protocol's SGD is ``optimizer="sgd"``).
Server: sample-weighted FedAvg. Inference: the global model; no personalized model. No extra communication.

Paper vs. official code (official repository sxontheway/BalanceFL, read at commit d6dd21e):
- Class sets. Paper: C_pos / C_neg are the client's classes (``class_sets="client"``, default). Code: the
  classes present in each mini-batch (``class_sets="batch"``), so a held class absent from a batch is
  distilled.
- Softmax. Paper Eq. 4 normalises q' over all C classes and Eq. 8-9 use the full softmax q. Code: the KD
  softmaxes are taken over C_neg only, and CE and entropy over C_pos only (``restrict_softmax=true``).
- Smoothing weight. The paper gives no value for lambda_1; the code uses 0.002 on the *sum* over the batch of
  the entropy, which is what ``smooth_weight`` multiplies here too (so it scales with the batch size).
- Noise. The code pre-draws 500 vectors of N(0, Sigma) per round and uses them in turn; here every augmented
  sample draws its own.
- Optimiser state. The code keeps each client's Adam moments across rounds (``keep_optimizer_state=true``);
  default here is a fresh optimiser every round, like every other method. The code also uses weight decay
  1e-4 (set --weight-decay 1e-4); the paper states none.
- The code runs the teacher in train mode (BN batch statistics); here it runs in eval mode.

Under ``--dp sample`` (DP-SGD, ``fedlt.core.dpsgd``; neither the paper's nor the code's): the client's steps are
described (:meth:`BalanceFL.local_steps`) and run as DP-SGD, the run's SGD on Poisson batches, each sample's loss
alone clipped. What reads more than one sample is replaced or refused:
- the class counts (C_pos, C_neg, the balancing) are the client's counts noised once (``--dp-counts-noise`` S,
  counted in its accountant); a class is the client's when its noised count m~_c reaches ``dp_present`` x S
  (2 S: an absent class passes with probability 2.3 %, where ``m~_c > 0`` would pass half of them);
- class-balanced sampling (Eq. 5) becomes Poisson sampling with each sample's loss weighted by
  ``n / (K max(m~_c, dp_present S, 1))`` (K: the client's classes), whose expected gradient is the balanced
  sampler's before clipping (the clip then caps what the weight can give a rare sample);
- the smoothing term, a batch *sum*, is each sample's own times the expected batch size ``n / L`` (DP-SGD averages
  the clipped gradients over it: the same expected gradient);
- Adam, the feature augmentation (a covariance of every local sample's features) and ``class_sets=batch`` (the
  other samples of the batch) have no DP-SGD form here: ``optimizer=sgd`` and ``feat_aug=false`` are required,
  ``class_sets=batch`` refused, each in one line before the run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, Method, load_weights, make_optimizer, weights_of
from ..core.losses import masked_logits
from ..core.retrain import local_features
from ..core.sampling import class_balanced_batches
from ..core.dpsgd_accounts import batches_per_epoch
from ..core.steps import LocalSteps, strip
from ..core.training import Meter
from ..decl import setting
from ..registry import METHODS


def pooled_covariance(feats: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Eq. 6: sum_j m_j Sigma_j / sum_j m_j, Sigma_j the (unbiased) covariance of class j's features, zero for
    a class with a single sample."""
    d = feats.shape[1]
    total = torch.zeros(d, d, dtype=torch.float64, device=feats.device)
    for c in labels.unique().tolist():
        f = feats[labels == c].double()
        if len(f) > 1:
            total += len(f) * torch.cov(f.T).reshape(d, d)
    return (total / max(len(labels), 1)).float()


def gaussian_sampler(cov: torch.Tensor):
    """A function (n, gen) -> n draws of N(0, cov) (cov may be singular: eigen-decomposition, clamped)."""
    evals, evecs = torch.linalg.eigh(cov.double())
    root = (evecs * evals.clamp_min(0).sqrt()).float()  # root @ root.T = cov

    def draw(n: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(n, root.shape[0], generator=gen, device="cpu").to(root.device, non_blocking=True) @ root.T

    return draw


def ki_loss(student: torch.Tensor, teacher: torch.Tensor, absent: torch.Tensor, T: float,
            restrict: bool) -> torch.Tensor:
    """Eq. 3-4: -sum_{j absent} softmax(t/T)_j log softmax(s/T)_j, batch mean. ``restrict``: both softmaxes over
    the absent classes only (official code). ``absent`` is a boolean mask over classes."""
    s, t = student / T, teacher / T
    if restrict:
        s, t = masked_logits(s, absent), masked_logits(t, absent)
    # a mask product, not boolean indexing: indexing would make the host wait for the mask's size every step
    return -(F.softmax(t, 1) * F.log_softmax(s, 1) * absent).sum(1).mean()


@METHODS.register("balancefl")
class BalanceFL(Method):
    fp16 = False  # a training loop of its own, without fp16's gradient scaler (bf16 and fp32 only)
    secagg = True  # its server is FedAvg's weighted mean (--secagg: core.secagg)
    # --dp sample: the described steps of local_steps (module doc), the class counts noised once
    dp_sample = "counts"
    dp_sample_needs = ("with --set optimizer=sgd --set feat_aug=false (Poisson batches; class-balanced sampling as "
                       "per-sample loss weights)")

    @dataclass
    class Params:
        ki_temperature: float = setting(2.0, "distillation temperature T (paper Sec. 7.1)", low=0, low_open=True)
        ki_weight: float = setting(1.0, "weight of the knowledge-inheritance loss (code: lambda = 1; paper Eq. 10: 1)",
                                   low=0)
        smooth_weight: float = setting(0.002, "lambda_1, on the batch *sum* of the negative entropy (code's value)",
                                       low=0)
        balanced_sampling: bool = setting(True, "class-balanced sampling (Eq. 5)")
        feat_aug: bool = setting(True, "feature-space augmentation of the tail classes (Eq. 7)")
        class_sets: str = setting("client", "client (paper) | batch (official code)", choices=("client", "batch"))
        restrict_softmax: bool = setting(False, "true: KD softmax over absent, CE/entropy over present (official code)")
        optimizer: str = setting("adam", "adam (paper, lr adam_lr) | sgd (the run's SGD settings)",
                                 choices=("adam", "sgd"))
        adam_lr: float = setting(0.005, "the Adam optimizer's lr", low=0, low_open=True)
        keep_optimizer_state: bool = setting(False, "official code: each client keeps its Adam moments across rounds")
        dp_present: float = setting(2.0, "--dp sample: a class is the client's when its noised count reaches this "
                                         "many --dp-counts-noise standard deviations", low=0)

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        self._teacher = None

    @classmethod
    def dp_sample_refusal(cls, p):
        if p.optimizer != "sgd" or p.feat_aug:
            return ("balancefl's Adam and its feature augmentation (a covariance of every local sample's features) have "
                    "no DP-SGD form here; add --set optimizer=sgd --set feat_aug=false")
        if p.class_sets == "batch":
            return "balancefl's class_sets=batch reads the other samples of a batch, which DP-SGD cannot; drop it"
        return ""

    def optimizer(self, params, lr):
        if self.p.optimizer == "sgd":
            return make_optimizer(params, self.spec, lr=lr)
        return torch.optim.Adam(params, lr=self.p.adam_lr, weight_decay=self.spec.weight_decay)

    def batches(self, data, gen):
        """Local indices of every batch: class-balanced draws, or the usual shuffled passes."""
        if self.p.balanced_sampling:
            yield from class_balanced_batches(data.y, self.spec.batch_size, gen, self.spec.local_epochs)
        else:
            for _ in range(self.spec.local_epochs):
                order = torch.randperm(len(data.y), generator=gen, device="cpu")
                yield from order.split(self.spec.batch_size)

    def local_steps(self, payload, cstate, data):
        """--dp sample only (the module doc): Eq. 10 on one sample, the balancing as loss weights, from the noised
        counts that ``data`` carries there."""
        p = self.p
        counts = torch.as_tensor(data.counts, dtype=torch.float32, device=self.spec.device)
        floor = p.dp_present * self.step_runner.counts_noise
        present = counts >= max(floor, 1.0)  # a class of noised count 0 is never the client's
        weight = torch.ones_like(counts)
        if p.balanced_sampling:
            weight = len(data) / (max(int(present.sum()), 1) * counts.clamp_min(max(floor, 1.0)))
        teacher = {f"teacher.{k}": v for k, v in payload.arrays.items()}  # the received global model, frozen
        batch = len(data) / batches_per_epoch(len(data), self.spec.batch_size)  # DP-SGD's expected batch size
        return LocalSteps(payload.arrays, self.dp_step, extra={
            "present": present.float(), "weight": weight, "batch": torch.tensor(batch, device=counts.device),
            **teacher})

    def dp_step(self, model, x, y, extra):
        p, pos = self.p, extra["present"] > 0
        with torch.no_grad():
            t_logits = model.frozen(strip(extra, "teacher."))(x)
        logits = model(x)
        logits_sm = logits
        if p.restrict_softmax:  # over C_pos and the sample's own class (whose noised count may miss the floor)
            own = torch.arange(logits.shape[1], device=y.device) == y[:, None]
            logits_sm = logits.masked_fill(~(pos | own), -1e10)
        ce = (F.cross_entropy(logits_sm, y, reduction="none") * extra["weight"].gather(0, y)).mean()
        ki = ki_loss(logits, t_logits, ~pos, p.ki_temperature, p.restrict_softmax)
        q = F.softmax(logits_sm, 1)
        neg_entropy = (q * F.log_softmax(logits_sm, 1) * pos).sum(1).mean() * extra["batch"]  # a batch's sum
        loss = ce + p.ki_weight * ki + p.smooth_weight * neg_entropy
        return loss, {"ce": ce, "ki": ki}

    def local_train(self, payload, cstate, data, gen):
        if self.step_runner.per_sample:  # --dp sample: local_steps, as DP-SGD
            return super().local_train(payload, cstate, data, gen)
        p, C = self.p, self.spec.num_classes
        net = self.net
        load_weights(net, payload.arrays)
        if self._teacher is None:
            self._teacher = self.new_model()
        teacher = self._teacher
        load_weights(teacher, payload.arrays)
        teacher.eval()

        counts = torch.as_tensor(data.counts, dtype=torch.float32, device=self.spec.device)
        present = counts > 0
        p_aug = torch.where(present, (counts.max() - counts) / counts.max(), torch.zeros_like(counts))
        draw = None
        if p.feat_aug and bool((p_aug > 0).any()):
            h, y = local_features(teacher.backbone, data)
            draw = gaussian_sampler(pooled_covariance(h, y, C))
            del h

        params = list(net.parameters())
        opt = self.optimizer(params, payload.lr)
        if p.keep_optimizer_state and "opt" in cstate:
            opt.load_state_dict(cstate["opt"])
        net.train()
        meter = Meter()
        for idx in self.batches(data, gen):
            x, y = data.sample_batch(idx, gen, train=True)
            if p.class_sets == "batch":
                pos = torch.zeros(C, dtype=torch.bool, device=y.device)
                pos[y] = True
            else:
                pos = present.to(y.device)
            with torch.no_grad():
                t_logits = teacher(x)
            h = net.backbone(x)
            logits = net.head(h)
            if draw is not None:
                mask = torch.rand(len(y), generator=gen, device="cpu").to(y.device, non_blocking=True) < p_aug[y]
                noise = draw(len(y), gen) * mask[:, None]
                logits_ce = net.head(h + noise)
            else:
                logits_ce = logits
            if p.restrict_softmax:
                logits_ce, logits_sm = masked_logits(logits_ce, pos), masked_logits(logits, pos)
            else:
                logits_sm = logits
            ce = F.cross_entropy(logits_ce, y)
            ki = ki_loss(logits, t_logits, ~pos, p.ki_temperature, p.restrict_softmax)
            q = F.softmax(logits_sm, 1)
            neg_entropy = (q * F.log_softmax(logits_sm, 1) * pos).sum()  # Eq. 9, summed over the batch
            loss = ce + p.ki_weight * ki + p.smooth_weight * neg_entropy
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            meter.add(loss)
        if p.keep_optimizer_state:
            cstate = {**cstate, "opt": opt.state_dict()}
        return Message(weights_of(net), {"num_examples": len(data), "loss": meter.mean(),
                                         "steps": meter.steps}), cstate
