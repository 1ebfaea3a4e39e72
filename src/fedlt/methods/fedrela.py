"""FedReLa (ICML 2026): "FedReLa: Imbalanced Federated Learning via Re-Labeling" -- a plug-in that re-labels some
of a client's samples of its more-populated classes towards its less-populated ones, from a start round on;
here on top of FedLoGe (``fedrela-loge``) and FedETF (``fedrela-etf``), as the official code is.

Client k, the first round r >= ``rela_start`` it trains in (and, with ``rela_period`` P > 0, again every P rounds
after the start), before its local training, with the global model it received:
  1. Q: ``rela_passes`` passes of the global model over the local training data (the training transform), the
     softmax of its generic prediction averaged per sample: q_i [C]. FedLoGe: softmax(SSE-C(f(x))), the frozen
     classifier the backbone trains through; FedETF: softmax(M f^(x)), the ETF without its scale.
  2. local count prior: pi_c = 1 - (n_c - min_c n) / (max_c n - min_c n) over all C classes (1 everywhere when
     the counts are equal): 0 for the client's largest class, 1 for its smallest (a class it lacks has n = 0);
  3. class-wise z-scores: per label class y, mu_y and sigma_y (population std, floored at 1e-6) of q over the
     samples of y; z_i = (q_i - mu_{y_i}) / sigma_{y_i} [C];
  4. adaptive threshold: per class c, tau_c = the (m+1)-th largest z_{i,c} over all the client's samples,
     m = int(``rela_thre`` / 100 * n) (clamped to [0, n-1]): the top ``rela_thre``% of each column;
  5. flip rate rho_{i,c} = tanh(z_{i,c} - tau_c) * max(pi_c - pi_{y_i}, 0): positive only towards classes less
     populated than the sample's own, and only where the sample's score of c is above the column's threshold;
  6. with u_{i,c} ~ U[0, 1), the candidates {c : rho_{i,c} > u_{i,c}}; if any, y_i <- the candidate of largest
     rho_{i,c}, else y_i stays.
  The new labels are kept in the client's state and train every later round (one-shot with P = 0); local
  training is the base method's, on the re-labelled data (FedETF's balanced loss then reads the re-labelled
  counts, as the official ETF loss reads each batch's re-labelled labels). Nothing extra leaves the client:
  the labels, counts and Q stay there. Server and inference: the base method's.

Paper vs. official code (guangzhengh/FedReLa, ``util/FedReLa.py``, ``util/update_baseline.py``
(``update_weights_gaux`` / ``update_weights_etf``), ``fedloge.py``, ``fed_etf.py``, ``options.py`` read at 20a58bd;
the paper's text could not be read here: the algorithm is the code's, the defaults its README's CIFAR-10 suite)
=========================  ==========================================  ==========================================
                           here (default)                              official code
=========================  ==========================================  ==========================================
lr after the start         the run's (``rela_lr_scale=1``)             x 0.1 from ``relabel_start`` on
                                                                       (``relabel_lr_scale``; ``--set
                                                                       rela_lr_scale=0.1``)
early stop                 none: the run's rounds                      stops when the global *test* accuracy has
                                                                       not improved for 10 rounds after the
                                                                       start (patience hard-coded in fedloge.py):
                                                                       selection on the test set, not offered
which clients re-label     each client the first round it trains in    the clients trained in the start round
                           at or after the start                       (``frac 1``: all); a client first sampled
                                                                       later reads no file and never re-labels
Q's passes                 eval mode (BatchNorm's running              the backbone in train mode (BatchNorm's
                           statistics), the training transform         batch statistics), the shuffled training
                                                                       loader; the same without BatchNorm
random draws               the client's generator                      ``np.random`` (global), one draw of C per
                                                                       sample in the loader's first-pass order
base methods               fedlt's FedLoGe and FedETF                  its own copies: ``fedloge.py`` is FedLoGe's;
                                                                       its ``fed_etf.py`` is not FedETF but
                                                                       FedLoGe's code's ETF baseline (a BatchNorm
                                                                       projector, a dense ETF, dot regression, psi
                                                                       and phi_k): ``fedrela-loge --set
                                                                       backbone_loss=etf-dr --set fixed=etf``
start round                the last 10% of the rounds: floor(0.9 R)    ``--relabel_start 450`` of 500 rounds
                           + 1 of R (1-based; 451 of 500)              (0-based), loaded from the base run's
                                                                       round-450 checkpoint
=========================  ==========================================  ==========================================
Defaults: ``rela_thre`` 5 (``--thre 5``, a percentage), 5 passes (``collect_Q(num_epochs=5)``), one-shot
(``--relabel_period 0``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import Message, load_weights
from ..core.losses import etf_features
from ..core.personal import personal_net
from ..decl import setting
from ..registry import METHODS
from .fedetf import FedETF
from .fedloge import FedLoGe

ROUND = "rela.round"  # the training round, in the payload's meta (the clients need it to know when to start)
LABELS = "rela.labels"  # the client's re-labelled training labels, in its state
AT = "rela.at"  # the round they were made in


def count_prior(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """pi_c = 1 - (n_c - min n) / (max n - min n) over all classes (ones where the counts are all equal)."""
    n = torch.bincount(labels, minlength=num_classes).double()
    lo, hi = n.min(), n.max()
    return torch.ones_like(n) if hi <= lo else 1 - (n - lo) / (hi - lo)


def relabel(probs: torch.Tensor, labels: torch.Tensor, thre: float, uniform: torch.Tensor) -> torch.Tensor:
    """FedReLa's re-labelling (steps 2-6 of the module doc) of the samples with averaged predictions ``probs``
    [n, C] and labels [n], the uniform draws ``uniform`` [n, C]: the new labels [n]."""
    n, C = probs.shape
    q = probs.double()
    pi = count_prior(labels, C)
    mu = torch.zeros(C, C, dtype=q.dtype, device=q.device)
    sd = torch.ones(C, C, dtype=q.dtype, device=q.device)
    for c in labels.unique().tolist():
        qc = q[labels == c]
        mu[c] = qc.mean(0)
        sd[c] = qc.std(0, unbiased=False).clamp_min(1e-6)
    z = (q - mu[labels]) / sd[labels]
    m = min(max(int(thre / 100 * n), 0), n - 1)
    tau = torch.kthvalue(z, n - m, dim=0).values  # the (m+1)-th largest of each column
    rho = torch.tanh(z - tau) * (pi[None, :] - pi[labels][:, None]).clamp_min(0)
    cand = rho > uniform.to(rho)
    best = rho.masked_fill(~cand, float("-inf")).argmax(1)
    return torch.where(cand.any(1), best, labels)


def relabelled(data, labels: torch.Tensor):
    """A view of client ``data`` whose training labels are ``labels`` [n] (the samples and everything else
    shared; the sample store's labels copied, so no other client sees the change)."""
    out = copy.copy(data)
    store = data._y.clone()
    new = labels.to(store.device, store.dtype)
    if data.rows is None:
        store = new
    else:
        store[data.rows.to(store.device)] = new
    out._y = store
    out.y = labels.to("cpu", data.y.dtype)
    out.counts = torch.bincount(out.y, minlength=data.num_classes).numpy()
    return out


class ReLa:
    """The FedReLa plug-in, a mixin before its base method (``class FedLoGeReLa(ReLa, FedLoGe)``): the base's
    ``rela_logits(payload, cstate)`` gives the generic prediction that Q is made of."""

    # --dp sample: refused -- a sample's new label depends on the other samples' predictions (z-scores,
    # thresholds and the count prior are over the client's whole data)
    dp_sample = False
    dp_sample_why_not = ("its re-labelling reads every local sample's prediction (class-wise z-scores and column "
                         "thresholds over the client's data), so one sample's label depends on the others")
    # --secagg (core.secagg): the server is the base method's weighted mean; the re-labelling stays on the client
    secagg = True

    @dataclass
    class Params:
        rela_start: int | None = setting(None, "first round whose local training uses the new labels (1-based)",
                                         low=1, limit=10**6, none_means="floor(0.9 * rounds) + 1, the official 450 of 500")
        rela_thre: float = setting(5.0, "the adaptive threshold: the top percentage of each class's z-scores "
                                        "(official --thre)", low=0, high=100)
        rela_passes: int = setting(5, "passes of the global model over the local data for Q (official num_epochs)",
                                   low=1, limit=1000)
        rela_period: int = setting(0, "re-label again every this many rounds after the start (0: once; official "
                                      "--relabel_period)", low=0, limit=10**6)
        rela_lr_scale: float = setting(1.0, "local lr factor from the start on (official: 0.1)", low=0, low_open=True)

    def received_net(self, arrays: dict[str, torch.Tensor]):
        """The client-side evaluation copy of the model, loaded with the received ``arrays``, in eval mode."""
        net = personal_net(self)
        load_weights(net, arrays)
        return net.eval()

    def start_round(self) -> int:
        p = self.p
        return p.rela_start if p.rela_start is not None else int(0.9 * self.spec.rounds) + 1

    def configure(self, state, rnd, cid):
        msg = super().configure(state, rnd, cid)
        if isinstance(rnd, int) and rnd >= 1 and type(rnd) is int:  # a training round (not PHASE / EVALUATION)
            msg = Message(msg.arrays, {**msg.meta, ROUND: rnd}, msg.config)
        return msg

    def due(self, rnd: int, cstate: dict) -> bool:
        """Whether the client re-labels before training in round ``rnd``."""
        start, period = self.start_round(), self.p.rela_period
        if rnd < start:
            return False
        if LABELS not in cstate:
            return True
        return bool(period) and (rnd - start) % period == 0 and cstate.get(AT) != rnd

    def predictions(self, payload, cstate, data, gen) -> torch.Tensor:
        """Q: the softmax of the global model's generic prediction over the local training data (the training
        transform, eval mode), averaged over ``rela_passes`` passes, [n, C] in the samples' order."""
        logits_of = self.rela_logits(payload, cstate)
        total = None
        with torch.no_grad():
            for _ in range(self.p.rela_passes):
                q = torch.cat([F.softmax(logits_of(x), 1).double()
                               for x, _ in data.batches(1000, gen, shuffle=False, train=True)])
                total = q if total is None else total + q
        return total / self.p.rela_passes

    def local_train(self, payload, cstate, data, gen):
        rnd = payload.meta.get(ROUND)
        if rnd is not None and self.due(rnd, cstate):
            q = self.predictions(payload, cstate, data, gen)
            u = torch.rand(q.shape, generator=gen, dtype=torch.float64, device="cpu")
            labels = relabel(q.cpu(), data.y.long(), self.p.rela_thre, u)
            cstate = {**cstate, LABELS: labels, AT: rnd}
        if rnd is not None and rnd >= self.start_round():
            if LABELS in cstate:
                data = relabelled(data, cstate[LABELS])
            if self.p.rela_lr_scale != 1.0:
                payload = payload.with_config({"lr": self.round_lr(payload) * self.p.rela_lr_scale})
        return super().local_train(payload, cstate, data, gen)


@METHODS.register("fedrela-loge")
class FedLoGeReLa(ReLa, FedLoGe):
    @dataclass
    class Params(FedLoGe.Params, ReLa.Params):
        pass

    def rela_logits(self, payload, cstate):
        """FedLoGe's generic prediction during training: the frozen SSE-C on the received backbone; under
        ``backbone_loss=etf-dr`` the ETF on the server's projector's output (the official ``collect_Q``, method
        "etf": ``g_head`` in eval mode, then ``ori_M``)."""
        W, b = self._client_fixed(payload, cstate)
        net = self.received_net(payload.arrays)
        if self.p.backbone_loss == "etf-dr":
            return lambda x: F.linear(etf_features(net.backbone(x), training=False), W)
        return lambda x: F.linear(net.backbone(x), W, b)


@METHODS.register("fedrela-etf")
class FedETFReLa(ReLa, FedETF):
    @dataclass
    class Params(FedETF.Params, ReLa.Params):
        pass

    def rela_logits(self, payload, cstate):
        """FedETF's generic prediction: the fixed ETF on the received model's normalised projection."""
        M = self.net.head.M.detach()
        net = self.received_net({"head.M": M, **payload.arrays})
        return lambda x: net.backbone(x) @ M.T
