"""Ditto (Li et al., ICML 2021, "Ditto: Fair and Robust Federated Learning Through Personalization").

Client k, each time it is sampled, receives w^t and
1. global update: E local epochs of CE from w^t (exactly FedAvg's), which it sends back;
2. personal update: ``personal_epochs`` epochs on its persistent personal model v_k of
       F_k(v) + lambda/2 * ||v - w^t||^2,
   the anchor w^t being the model *received* this round (not the one just trained). With plain SGD this is
   the paper's step v <- v - eta (grad F_k(v) + lambda (v - w^t)). v_k starts as the common initial model,
   lives only in the client state and is never sent.
Server: FedAvg (weighted by n_k) of the global updates.
Inference: GM = w; PM = v_k.

Defaults: lambda = 1 (FL-bench and the FedRep repository; the paper tunes lambda on a small grid, about 0.01
to 2), one personal epoch per local epoch of the global update (``personal_epochs`` None = the run's
``local_epochs``), the run's SGD for both updates. Order: global first, then personal, anchored to the
received w^t (FL-bench); PFLlib runs the personal update first -- with the anchor right the two are the same
method. FedLoGe's own "Ditto" baseline differs: it anchors to the client's previous personal model and never
re-aggregates a global model.

Two settings of fedlt's own, off by default (neither is in the paper or its code): ``personal_lr_scale``
multiplies the round's lr for the personal update, and ``personal_clip`` clips its gradient's norm. Under
sample-level DP the noised global model grows (weight and feature norms several times those without DP) and
the paper's unclipped personal step at the global step's lr grows with it until the personal model overflows
(docs/dp-tail.md); either setting bounds that step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from ..core import load_weights, train_local, weights_of
from ..core.personal import initial_weights, personal_net, personal_predictor
from ..core.proximal import proximal_term
from ..decl import setting
from ..registry import METHODS
from .fedavg import FedAvg


@METHODS.register("ditto")
class Ditto(FedAvg):
    personalized = True
    # --dp sample: the global update (sent) is FedAvg's described steps; the personal model never leaves the client
    # and never enters what it sends
    dp_sample = True

    @dataclass
    class Params:
        lam: float = setting(1.0, "lambda: pull of the personal model towards the received global model", low=0)
        personal_epochs: int | None = setting(None, "epochs of the personal update per round", low=1,
                                              none_means="the run's local_epochs", old_none="== 0", limit=10**4)
        personal_lr_scale: float = setting(1.0, "the personal update's lr over the round's lr (fedlt's; the paper: 1)",
                                           low=0, low_open=True, limit=100)
        personal_clip: float | None = setting(None, "clip the personal update's gradient norm to this (fedlt's)",
                                              low=0, low_open=True, none_means="no clipping (the paper)")

    def init_client(self, cid, data):
        return {"personal": initial_weights(self)}

    def local_train(self, payload, cstate, data, gen):
        reply, _ = super().local_train(payload, cstate, data, gen)  # 1. the global update (FedAvg's)
        v = personal_net(self)  # 2. the personal update, anchored at the received w^t
        load_weights(v, cstate["personal"])
        anchor, lam = payload.arrays, self.p.lam

        def loss_fn(model, x, y):
            return F.cross_entropy(model(x), y) + 0.5 * lam * proximal_term(model, anchor)

        lr = self.round_lr(payload) * self.p.personal_lr_scale
        stats = train_local(v, data, self.spec, gen, loss_fn, epochs=self.p.personal_epochs, lr=lr,
                            clip_norm=self.p.personal_clip)
        reply.meta["personal_loss"] = stats["loss"]
        return reply, {**cstate, "personal": weights_of(v)}

    def personal_model(self, payload, cstate, data):
        return personal_predictor(self, cstate["personal"])
