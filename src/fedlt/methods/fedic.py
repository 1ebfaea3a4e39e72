"""FedIC (Shang et al., ICME 2022): a calibrated ensemble of the client models distilled on a server-side set.

"FEDIC: Federated Learning on Non-IID and Long-Tailed Data via Calibrated Distillation" (Shang, Lu, Cheung &
Wang).

The clients' models, as an ensemble, know more about the tail than their average; the server calibrates that
ensemble on a small balanced auxiliary set and distils it into the global model.

**This method needs labelled data on the server**: ``aux_per_class`` samples of every class, drawn as Ratio
Loss's auxiliary set (``core.auxiliary.auxiliary_set``: samples the long-tailed subset left out, where there are any).
Client: E local epochs of SGD on cross-entropy (FedAvg's); sends its model.
Server, round t, with the round's client models w_1..w_M (features f_k, logits z_k) and D_aux:
0. w_avg = FedAvg(w_1..w_M).
1. Calibration reference: w_cal = w_avg fine-tuned on labelled aux batches (``steps`` Adam steps, CE).
2. Calibrated ensemble ("highway", kept across rounds), ``steps`` Adam steps on labelled aux batches of CE of
       a_k   = sigmoid(z_k s + b_s)                        (per sample and client; s [C, 1], b_s [1] learnt)
       z_ens = sum_k (a_k / sum_j a_j) z_k                 (client weights that depend on the input)
       z_cal = z_ens * g + beta                            (class-wise logit scale g and bias beta, learnt)
       c     = sigmoid(v^T mean_k f_k + b_v)               (the calibration gate, learnt)
       z_T   = c z_cal + (1 - c) z_{w_cal}(x)
3. Distillation: the global model, starting from w_avg, ``steps`` Adam steps on
       ld * KL(softmax(z_T / T) || softmax(z / T)) on an aux batch (batch mean) + (1 - ld) * CE on a labelled one.
Inference: the distilled global model. No personal model. Communication: FedAvg's.
Server compute per round: 3 x ``steps`` steps, the ensemble's M models run on every batch of stages 2 and 3.

Defaults (official code, shangxinyi/FEDIC ``options.py``, as LongTailLib's port records it): 100 steps per stage,
Adam lr 0.001 (weight decay 2e-4 for the models), T = 2, ld = 0.5, labelled batches of 20, distillation batches of
128, 100 auxiliary samples per class (CIFAR-10: the 100 of each class left out of its 4,900-per-class pool).
Differences from the official code:
- Its distillation batches are drawn from the *whole* training set, the clients' images included, without labels;
  here from the auxiliary set (the server sees no client data). Not offered.
- Its three Adam optimisers persist across rounds although the models they step are reloaded every round; here
  each stage starts a fresh optimiser every round (the highway's parameters persist, as there).
- The KL carries no T^2 factor, as in the code. LongTailLib's port adds logit centring, a 1/C initial ensemble
  scale and gradient clipping; not here (official initial scale 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import derive_seed, load_weights, weighted_average, weights_of
from ..core.auxiliary import auxiliary_set
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg

HIGHWAY_INIT, BATCHES = 0x1C1, 0x1C2  # seed purposes


def highway(p: dict, feats: list[torch.Tensor], logits: list[torch.Tensor], ref_logits: torch.Tensor) -> torch.Tensor:
    """The calibrated ensemble's logits z_T (parameters ``p``: scale [C, 1], bias [1], g [C], beta [C], v [1, d],
    b_v [1])."""
    a = torch.cat([torch.sigmoid(z @ p["scale"] + p["bias"]) for z in logits], dim=1)  # [B, M]
    a = a / a.sum(1, keepdim=True).clamp_min(1e-8)
    z_ens = sum(a[:, k:k + 1] * z for k, z in enumerate(logits))
    z_cal = z_ens * p["g"] + p["beta"]
    gate = torch.sigmoid(F.linear(torch.stack(feats).mean(0), p["v"], p["b_v"]))  # [B, 1]
    return gate * z_cal + (1 - gate) * ref_logits


@METHODS.register("fedic")
class FedIC(FedAvg):
    finetune_needs = {"images": "the server's auxiliary images of each class"}

    @dataclass
    class Params:
        aux_per_class: int = setting(100, "labelled server samples per class", low=1, limit=10**6)
        steps: int = setting(100, "Adam steps of each of the three server stages, every round", low=0, limit=10**6)
        lr: float = setting(0.001, "the server stages' Adam lr", low=0, low_open=True)
        weight_decay: float = setting(2e-4, "of the two models' Adam (not the highway's)", low=0)
        T: float = setting(2.0, "distillation temperature", low=0, low_open=True)
        ld: float = setting(0.5, "weight of the distillation term (1 - ld: CE on labelled aux data)", low=0, high=1)
        batch_labeled: int = setting(20, "batch size on the labelled auxiliary data", low=1, high=2**31 - 1)
        batch_distill: int = setting(128, "batch size of the distillation", low=1, high=2**31 - 1)

    @dataclass
    class State(FedAvg.State):
        highway: dict[str, torch.Tensor] | None = None  # the calibration highway (scale, bias, g, beta, v, b_v)

    def __init__(self, spec, params=None):
        super().__init__(spec, params)
        self._aux = None
        self._ens: list = []

    @property
    def aux(self):
        if self._aux is None:
            self._aux, self.aux_overlap = auxiliary_set(self.spec, self.p.aux_per_class, "fedic")
        return self._aux

    # ------------------------------------------------------------------ server
    def init_server(self) -> "FedIC.State":
        self.aux  # noqa: B018 -- fail early if the data settings are missing
        st = super().init_server()
        s, C, d = self.spec, self.spec.num_classes, self.net.feature_dim
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(derive_seed(s.seed, HIGHWAY_INIT))
            gate = torch.nn.Linear(d, 1).to(s.device)  # drawn on the seeded CPU generator on every device
        st.highway = {"scale": torch.ones(C, 1, device=s.device), "bias": torch.zeros(1, device=s.device),
                      "g": torch.ones(C, device=s.device), "beta": torch.zeros(C, device=s.device),
                      "v": gate.weight.detach().clone(), "b_v": gate.bias.detach().clone()}
        return st

    def _model(self, i: int, weights):
        while len(self._ens) <= i:
            self._ens.append(self.new_model())
        load_weights(self._ens[i], weights)
        return self._ens[i]

    def aggregate(self, state, rnd, replies):
        p, aux = self.p, self.aux
        keys = list(state.weights)
        avg = weighted_average([(r.arrays, r.meta["num_examples"]) for _, r in replies], keys)
        clients = [self._model(2 + i, r.arrays).eval() for i, (_, r) in enumerate(replies)]
        gen = torch.Generator(device="cpu").manual_seed(derive_seed(self.spec.seed, BATCHES, rnd))
        n = len(aux)

        def batch(size):
            idx = torch.randperm(n, generator=gen, device="cpu")[:size]
            return aux.sample_batch(idx, gen, train=True)

        def ensemble(x):
            with torch.no_grad():
                feats = [m.backbone(x) for m in clients]
                return feats, [m.head(f) for m, f in zip(clients, feats)]

        with torch.enable_grad():
            # 1. the calibration reference: FedAvg fine-tuned on labelled aux data
            ref = self._model(0, avg).train()
            opt = torch.optim.Adam(ref.parameters(), lr=p.lr, weight_decay=p.weight_decay)
            for _ in range(p.steps):
                x, y = batch(p.batch_labeled)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(ref(x), y).backward()
                opt.step()
            ref.eval()
            # 2. the calibrated ensemble
            hw = {k: v.detach().clone().requires_grad_(True) for k, v in state.highway.items()}
            opt = torch.optim.Adam(hw.values(), lr=p.lr)
            for _ in range(p.steps):
                x, y = batch(p.batch_labeled)
                feats, logits = ensemble(x)
                with torch.no_grad():
                    zr = ref(x)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(highway(hw, feats, logits, zr), y).backward()
                opt.step()
            hw = {k: v.detach() for k, v in hw.items()}
            # 3. distillation into the global model
            student = self._model(1, avg).train()
            opt = torch.optim.Adam(student.parameters(), lr=p.lr, weight_decay=p.weight_decay)
            for _ in range(p.steps):
                xu, _ = batch(p.batch_distill)
                x, y = batch(p.batch_labeled)
                feats, logits = ensemble(xu)
                with torch.no_grad():
                    teacher = highway(hw, feats, logits, ref(xu))
                soft = F.kl_div(F.log_softmax(student(xu) / p.T, 1), F.log_softmax(teacher / p.T, 1),
                                reduction="batchmean", log_target=True)
                loss = p.ld * soft + (1 - p.ld) * F.cross_entropy(student(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        state.highway = hw
        state.weights = weights_of(student)
        return state
