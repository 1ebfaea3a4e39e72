"""FedBN (Li et al., ICLR 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch Normalization").

Client: E local epochs of CE from the received shared weights and the client's own BatchNorm layers; the BN
affine parameters *and* running statistics (mean, var, num_batches_tracked) stay on the client and persist
across rounds. BN entries are found by module type (``models.bn_keys``), never by a name such as 'bn'.
Server: FedAvg (weighted by n_k) of every entry that is not a BatchNorm entry; BN is in no message.
Inference:
- PM: shared weights + the client's own BN layers, on the client's test set (the paper's evaluation).
- GM: the paper has no generic model (the server never sees a BN layer). Ours: the shared weights with every
  BN layer normalising by the statistics of the test batch itself (batches of 1,000 balanced test images)
  and its affine parameters at their initial values (weight 1, bias 0). Public re-implementations get a GM
  differently: PFLlib never averages buffers, so its global model keeps the first uploader's BN statistics,
  and FedLoGe's ``dispatch_fedbn`` averages everything on the server and only keeps BN local on download;
  both send BN to the server, which FedBN is meant not to do.

A model without BatchNorm layers (``smallcnn``, ``mlp``, ``cnn-mcmahan``) has nothing to keep local: FedBN is
then FedAvg, step for step. Use ``--model resnet8`` (or larger) to see the method act.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.nn.modules.batchnorm import _BatchNorm

from ..core import Predictor
from ..core.personal import PartialSharing
from ..core.privacy import MODEL, sent, sends_with
from ..models import bn_keys
from ..registry import METHODS


@METHODS.register("fedbn")
class FedBN(PartialSharing):
    @dataclass
    class Params:
        pass

    sends = sends_with(PartialSharing.sends,
                       sent(MODEL, "model", "the trained model but its BatchNorm layers (they stay on the client)"))
    secagg = True  # the weighted mean of the shared entries (--secagg: core.secagg)

    def local_keys(self, model):
        return bn_keys(model)

    def global_model(self, state):
        net = self.eval_model(state.weights)
        if not getattr(self, "_batch_stats", False):  # BN layers use each batch's own statistics from now on
            for m in net.modules():
                if isinstance(m, _BatchNorm):
                    m.track_running_stats = False
                    m.running_mean = m.running_var = m.num_batches_tracked = None
            self._batch_stats = True
        return Predictor(net.backbone, net.head, shared_backbone=not self.local)
