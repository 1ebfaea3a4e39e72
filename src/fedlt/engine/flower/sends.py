"""What the Flower engine itself has a client send, besides the method's replies: declared here, item by item, as a
method declares its ``sends`` (:class:`fedlt.core.privacy.EngineSent`), shown by ``fedlt list METHOD`` and on the
generated page ``docs/privacy.md`` under "Flower engine", and recorded in a run's ``sent.jsonl`` (rows with
``"engine": "flower"`` and the ``message``). ``tests/test_flower_sends.py`` captures every reply an in-process
Flower client sends and holds it to this declaration (and the method's), under each ``--dp`` mode.

Every reply carries the engine's ``fedlt`` record (the fields below) beside the method's message (its arrays and
meta, matched to the method's ``sends``; a describe or evaluation reply's is empty). A SuperNode that serves a client
of the run's partition (``partition-id``) says nothing of its data in its ``describe`` reply: the server rebuilds
that client from the run's settings. Only a SuperNode holding its own data (``data-dir``) says its label counts and
sizes, and under ``--dp`` less: none under ``--dp client``, its number of samples under ``--dp sample`` (its DP-SGD
sampling rate, public in the analysis). An evaluation reply holds, per inference mode, the accuracy and the group
accuracies PM aggregates, under every ``--dp`` mode alike (no per-class accuracies: the server reads none). Where the
evaluation of round r rides in round r+1's training message (``train.evaluate``: a method whose PM uses the global
model, without ``--dp``, ``--secagg`` or simulated faults), that reply holds both replies' fields.

This module imports no Flower: ``fedlt list`` and the docs read it without the ``flower`` extra.
"""
from __future__ import annotations

import json
from typing import Any

from ...core.privacy import DATA_DIR, ENGINE_SENDS, EngineSent
from ...metrics import GROUPS

ENGINE = "flower"
TITLE = "Flower engine"
WHERE = "fedlt.engine.flower.sends.SENDS"
DESCRIBE, TRAIN, PHASE, EVALUATE = "describe", "train", "train.phase", "evaluate"  # the replies, by message type
# a round's training message that also carries the previous round's evaluation (GridTransport.ride): its reply holds
# the training reply's fields and the evaluation reply's
TRAIN_EVALUATE = "train.evaluate"
REPORTS = "reports"  # an evaluation reply's JSON field, declared per entry: reports.MODE.ENTRY
REPORTED = ("acc", *GROUPS, "nonfinite")  # what an evaluation report holds, per mode (client.evaluate)


def _riding(name: str, messages: tuple[str, ...], dp: tuple[str, ...]) -> EngineSent:
    """A meta value the ClientApp adds to a method's reply (:data:`fedlt.core.privacy.ENGINE_SENDS`, matched and
    recorded with the method's items), listed here under the engine that adds it."""
    s = next(s for s in ENGINE_SENDS if s.name == name)
    return EngineSent(messages, f"meta: {name}", s.category, s.what, dp=dp)


SENDS: tuple[EngineSent, ...] = (
    EngineSent((DESCRIBE, TRAIN, TRAIN_EVALUATE, PHASE, EVALUATE), "client-id", "protocol",
               "which client answers: its partition-id, or the client-id of a SuperNode with its own data"),
    EngineSent((DESCRIBE,), "partition", "protocol",
               "whether it serves a client of the run's partition (partition-id), whose label counts and sizes the "
               "server then rebuilds from the run's settings: such a SuperNode sends none"),
    EngineSent((DESCRIBE,), "counts", "class-counts",
               "its training label counts, [C] (the server's many/medium/few split, partition.json, the client "
               "sizes --speed-sigma reads)", dp=("off",), nodes=DATA_DIR),
    EngineSent((DESCRIBE,), "test-size", "size", "the number of its test samples (partition.json)",
               dp=("off",), nodes=DATA_DIR),
    EngineSent((DESCRIBE,), "num-examples", "size",
               "its number of training samples (under --dp sample its DP-SGD sampling rate, public in the "
               "analysis)", dp=("off", "sample"), nodes=DATA_DIR),
    EngineSent((TRAIN, TRAIN_EVALUATE, PHASE), "has-state", "protocol",
               "whether it keeps a client state after the message (the server's record of the states a resumed run "
               "needs)"),
    EngineSent((EVALUATE, TRAIN_EVALUATE), "source", "protocol",
               "which model it evaluated: personal, global, needs-global (no personal model yet: it is sent the "
               "global one), none (its test set is empty)"),
    EngineSent((EVALUATE, TRAIN_EVALUATE), f"{REPORTS}.*.acc", "scalars", "its accuracy on its own test set, per inference mode"),
    EngineSent((EVALUATE, TRAIN_EVALUATE), f"{REPORTS}.*.nonfinite", "scalars",
               "true where its personal model outputs non-finite values (its local training diverged)"),
    *(EngineSent((EVALUATE, TRAIN_EVALUATE), f"{REPORTS}.*.{g}", "class-counts",
                 f"its accuracy on the run's {g}-shot classes, per mode; null where its test set holds none") for g in GROUPS),
    _riding("dp_unclipped", (TRAIN,), ("client",)),
    _riding("dp_history", (TRAIN, PHASE), ("sample",)),
)


def fields_of(message: str, record: dict[str, Any]) -> dict[str, Any]:
    """The engine's fields of a ``message`` reply's ``fedlt`` record, as declared: an evaluation's ``reports`` (JSON,
    by inference mode) as ``reports.MODE.ENTRY`` each."""
    evaluation = message in (EVALUATE, TRAIN_EVALUATE)
    out = {k: v for k, v in record.items() if not (evaluation and k == REPORTS)}
    if evaluation and REPORTS in record:
        for mode, rep in json.loads(str(record[REPORTS])).items():
            out.update({f"{REPORTS}.{mode}.{k}": v for k, v in rep.items()})
    return out
