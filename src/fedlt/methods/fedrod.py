"""FedRoD (Chen & Chao, ICLR 2022, "On Bridging Generic and Personalized Federated Learning for Image
Classification").

Model: a shared body f, a generic head g (both averaged) and, on each client, a personal head p_k of the
same shape (initialised as a copy of the initial g, kept in the client state, never sent).
Client, for every mini-batch (x, y) of E local epochs, with h = f(x):
- generic, balanced risk: Balanced Softmax, L_G = CE(g(h) + log pi_k, y) with pi_k the client's class
  frequencies, trains f and g;
- personalized: L_P = CE(stopgrad(g(h)) + p_k(stopgrad(h)), y) trains p_k only.
Server: FedAvg (weighted by n_k) of f and g.
Inference: GM = g(f(x)) on the balanced test set (no prior added at test time); PM = g(f(x)) + p_k(f(x)) on the
client's test set. Both are reported.

No official code exists; this follows the paper, PFLlib and the FedETF repository. Options for the known
variants:
- ``detach`` (default true): false gives FL-bench's variant, where L_P's gradient also trains f;
- ``sum_logits`` (default true): false gives FL-bench's personalized logits p_k(h) alone (in training and
  inference).
Missing classes in BSM: a class absent from the client gets log(1e-12), i.e. it is effectively masked (PFLlib
uses log 0 = -inf; the FedETF repository clamps counts to 1). The personal head trains with the run's lr and
momentum (PFLlib and the FedETF repository use no momentum for it; the paper does not say).

Under ``--dp sample`` (not in the paper, which has no DP): pi_k comes from the client's class counts noised once
(``--dp-counts-noise``, :mod:`fedlt.core.dpsgd`), since the true counts would let one sample move every other
sample's gradient; the release is counted in the client's accountant.

Under ``--finetune head`` / ``lora`` (docs/finetune.md): the generic head (BSM) trains on the pre-trained features
(head) or with the LoRA adapters (lora); each client's personal head trains on the same features as in full.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core import LocalSteps, Message, Predictor, Train, load_weights
from ..core.losses import balanced_softmax_loss
from ..core.personal import initial_weights, personal_net
from ..models import head_keys
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


@METHODS.register("fedrod")
class FedRoD(FedAvg):
    personalized = True
    # --dp sample: a sample's losses (L_G, L_P) read the client's class counts, given noised once (core.dpsgd); the
    # personal head trains by the same DP-SGD
    dp_sample = "counts"

    @dataclass
    class Params:
        detach: bool = setting(True, "false: the personal loss also trains the body (FL-bench)")
        sum_logits: bool = setting(True, "false: personalized logits are p_k(h) alone (FL-bench)")

    def init_client(self, cid, data):
        return {"phead": {k.removeprefix("head."): v for k, v in initial_weights(self, head_keys(self.net)).items()}}

    def _phead(self, arrays) -> nn.Linear:
        """The client-side working copy of a personal head, loaded with ``arrays``."""
        if getattr(self, "_ph", None) is None:
            self._ph = self.new_model().head
        load_weights(self._ph, arrays)
        return self._ph

    def personal_logits(self, g_logits: torch.Tensor, p_logits: torch.Tensor) -> torch.Tensor:
        return g_logits + p_logits if self.p.sum_logits else p_logits

    def local_steps(self, payload, cstate, data):
        extra = {"phead.weight": cstate["phead"]["weight"], "phead.bias": cstate["phead"]["bias"],
                 "counts": torch.as_tensor(data.counts, dtype=torch.float32, device=self.spec.device)}
        return LocalSteps(payload.arrays, self.rod_step, train=(Train(("backbone.", "head.", "phead.")),),
                          extra=extra)

    def rod_step(self, model, x, y, extra):
        h = model.backbone(x)
        z = model.head(h)
        loss_g = balanced_softmax_loss(z, y, extra["counts"])  # trains f and g
        hp = h.detach() if self.p.detach else h
        p_logits = F.linear(hp, extra["phead.weight"], extra["phead.bias"])
        loss_p = F.cross_entropy(self.personal_logits(z.detach(), p_logits), y)  # trains p_k (and f if not detach)
        return loss_g + loss_p, {"loss": loss_g, "personal_loss": loss_p}

    def local_reply(self, payload, cstate, data, out):
        phead = {"weight": out.extra["phead.weight"], "bias": out.extra["phead.bias"]}
        return Message(out.weights, {"num_examples": len(data), **out.stats}), {**cstate, "phead": phead}

    def personal_model(self, payload, cstate, data):
        net = personal_net(self)
        load_weights(net, payload.arrays)
        net.eval()
        ph = self._phead(cstate["phead"]).eval()
        g = net.head

        def head(h):
            return self.personal_logits(g(h), ph(h))

        return Predictor(net.backbone, head, shared_backbone=True)
