"""Shared machinery: the method interface, messages, aggregation, the local training loop, fixed heads."""
from .aggregation import weighted_average
from .method import (EVALUATION, PHASE, Message, Method, Predictor, RunSpec, Stage, derive_seed, load_weights,
                     weights_of)
from .privacy import MODEL, Sent, sent
from .steps import LocalSteps, StepModel, Train, Trained, ce, strip
from .training import Meter, ce_loss, make_optimizer, train_local

__all__ = ["Message", "Method", "Predictor", "RunSpec", "Stage", "PHASE", "EVALUATION", "derive_seed", "load_weights",
           "weights_of",
           "weighted_average", "Meter", "ce_loss", "make_optimizer", "train_local", "LocalSteps", "StepModel",
           "Train", "Trained", "ce", "strip", "MODEL", "Sent", "sent"]
