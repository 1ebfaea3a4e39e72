"""FedBABU (Oh et al., ICLR 2022, "FedBABU: Toward Enhanced Representation for Federated Image Classification").

Training: the head keeps its random initialisation for the whole of federated training; it is a pure function of
the run seed, so every client builds the same one and it never needs sending. Client: E local epochs of CE
updating the body only (the optimiser never holds the head, so neither momentum nor weight decay can move it).
Server: FedAvg of the body only.
Post-training phase ``finetune``: every client fine-tunes the whole model (body and head), starting from the
final global body and the initial head, for ``finetune_epochs`` epochs of CE on its training data (SGD with lr
``finetune_lr`` and the run's momentum, body and head alike); the result is its personalized model and stays
on the client.
Inference: GM = final body + the initial head (meaningful, since the features were aligned to that head).
PM = the fine-tuned model on the client's test set; before the fine-tuning phase, PM is the global model
on the clients' test sets (labelled so in the output).

Where paper and official code differ: the official code averages the bodies *unweighted* (it divides by the
number of participants); the paper aggregates as FedAvg does, weighted by n_k -- the default here,
``uniform=true`` gives the official code's. Fine-tuning: the official evaluation (``analysis.ipynb``) uses
5 epochs at lr 1e-3 with momentum 0.9, a hundredth of its training lr 0.1 -- our defaults; PFLlib uses 10
epochs, FL-bench at least one. The small lr matters: the body has learnt large features to suit the small
random head, so a step at the training lr (0.05 here) moves the head far; on fmnist-lt, fine-tuning at 0.05
dropped PM from 90.3 (global model) to 69.3, with some clients near 35 %.

Under ``--finetune head`` / ``lora`` (docs/finetune.md): refused under head (the body trains under a head fixed in
the rounds; with the backbone frozen nothing would train). Under lora the rounds train the LoRA adapters only
(the random head stays fixed), and the fine-tuning phase trains each client's adapters and head.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core import Message, Train, load_weights, make_optimizer, train_local, weighted_average, weights_of
from ..core.personal import PartialSharing, personal_predictor
from ..core.privacy import MODEL, sent, sends_with
from ..decl import setting
from ..models import head_keys
from ..registry import METHODS


@METHODS.register("fedbabu")
class FedBABU(PartialSharing):
    finetune_needs = {"body": "the body under a random head fixed in the rounds"}

    phases = ("finetune",)

    @dataclass
    class Params:
        finetune_epochs: int = setting(5, "personalization epochs of the official evaluation", low=0, limit=10**4)
        finetune_lr: float = setting(1e-3, "its fine-tuning lr (training used 0.1)", low=0)
        uniform: bool = setting(False, "true: average bodies without weights, as the official code does")

    sends = sends_with(
        PartialSharing.sends,
        sent(MODEL, "model", "the trained body (the fixed head never leaves the client)"),
        sent("num_examples", "size", "the number of training samples", meta=True, when="finetune"),
        sent("*", "scalars", "the fine-tuning's mean loss and steps", meta=True, numbers_only=True, when="finetune"),
    )

    trains = (Train("backbone."),)  # the body trains; the head is in no optimiser

    def local_keys(self, model):
        return head_keys(model)  # the fixed head: the client's copy of the common initial one

    def aggregate(self, state, rnd, replies):
        if not self.p.uniform:
            return super().aggregate(state, rnd, replies)
        state.weights = {**state.weights, **weighted_average([(r.arrays, 1.0) for _, r in replies])}
        return state

    # ---------------------------------------------------------------- post-training: personalization
    def phase_client(self, phase, payload, cstate, data, gen):
        net = self.net
        load_weights(net, payload.arrays)
        load_weights(net, cstate["local"])
        opt = make_optimizer(net.parameters(), self.spec, lr=self.p.finetune_lr)
        stats = train_local(net, data, self.spec, gen, epochs=self.p.finetune_epochs, optimizer=opt)
        return Message(meta={"num_examples": len(data), **stats}), {**cstate, "finetuned": weights_of(net)}

    def personal_model(self, payload, cstate, data):
        if "finetuned" not in cstate:
            return None  # before the fine-tuning phase: the global model
        return personal_predictor(self, cstate["finetuned"])
