"""The handlers of the one generic fedlt ClientApp (``fedlt.flower.client_app:app``, which routes each message type
to its handler here): any registered method's client hooks on a SuperNode's data.

Messages it answers (every server message carries a ``fedlt`` ConfigRecord with the run's settings, so a
client needs nothing but its data and this package):

======================  ==========================================================================
message type            what the client does
======================  ==========================================================================
``query.describe``      says who it is: client id, and whether it serves the run's partition (then
                        nothing of its data: the server rebuilds it from the settings); a SuperNode
                        with its own data also its label counts and sizes (under ``--dp client``
                        none, under ``--dp sample`` its number of samples): each form declared in
                        :mod:`fedlt.engine.flower.sends`
``train``               ``method.local_train(payload, cstate, data, gen)`` at the round's lr (the
                        payload's config, ``payload.lr``), gen = the driver's (round, client)
                        generator; under ``--secagg`` through Flower's ``secaggplus_mod``, which
                        masks the update (``fedlt.engine.flower.secagg``); under ``--dp client`` the
                        reply clipped here, under ``--dp sample`` trained by DP-SGD here (below)
``train.phase``         ``method.phase_client(name, payload, cstate, data, gen)`` (a post-training
                        phase, e.g. a realignment or fine-tuning, one message per phase)
``train.evaluate``      ``evaluate`` of the previous round's model, then ``train`` (the evaluation rides
                        in the next round's training message where the server allows it:
                        ``GridTransport.ride``); one reply holds both
``evaluate``            personalized evaluation on its own test set:
                        ``method.personal_model(eval_payload, cstate, data)`` -> accuracy and group
                        accuracies (what PM aggregates; :mod:`fedlt.engine.flower.sends`)
======================  ==========================================================================

Where the data comes from (the SuperNode's ``--node-config``):

- ``partition-id=K``: client K of the fedlt federation the run's settings describe (dataset, long-tail,
  partition, seed): for trials, the very clients of a simulation.
- ``data-dir=DIR client-id=K``: the client's own data, ``DIR/train.npz`` (arrays ``x``, ``y``) and optionally
  ``DIR/test.npz`` (its personal test set), images shaped like the run's dataset; for real use.
- optional ``state-dir=DIR``: the client state is also written there after every message that changes it,
  so it survives a SuperNode restart and a resumed run; ``device=cuda`` to train on the node's GPU.

``--dp client`` (DP-FedAvg, :mod:`fedlt.core.dp`): the reply to ``train`` leaves clipped to the round's clip (the
message's ``dp-clip``), integer entries as received, with ``num_examples`` 1 and the clipping bit and nothing else
(:func:`fedlt.core.dp.client_reply`); a phase's with ``num_examples`` 1 only (:func:`fedlt.core.dp.phase_reply`);
``describe`` says no label counts, test-set or training-set size. The server adds the noise. Flower 1.42's DP pieces do not fit:
``fixedclipping_mod`` / ``adaptiveclipping_mod`` want one ArrayRecord and one ConfigRecord per message (fedlt's
carry several) and clip every array, integer buffers included, in float32 (not the simulator's clip), and the
adaptive bit marks a *clipped* update (Andrew et al. count the unclipped); the ``DifferentialPrivacy*Clipping``
wrappers wrap a strategy's ``configure_train`` / ``aggregate_train`` (fedlt's rounds run through its driver), use a
fixed client count (no Poisson sampling) and numpy's unseeded noise, and account FedAvg without amplification
only. Both sides run :mod:`fedlt.core.dp`'s functions instead.

``--dp sample`` (DP-SGD, :mod:`fedlt.core.dpsgd`): the client's described steps, in a round and in a phase, run as
DP-SGD here (``SampleDP.on_client``, from the run's settings and the message's ``dp-delta``, ``dp-rounds`` and, once
the server knows it, ``dp-noise``); the reply leaves with the model, ``num_examples`` and the accountant's entries of
this message (``dp_history``), nothing else (``SampleWire.client_reply``); the server keeps every client's accountant.
``describe`` says no label counts, and from a SuperNode with its own data its number of samples (public in DP-SGD's
analysis).

The client state (personal heads, personal models, control variates) lives in ``context.state`` and never
enters a reply. It belongs to the fedlt run (the ``fedlt-run`` id of every message, kept in the run directory),
not to the Flower run that carries it, and every version is tagged with the round it reflects. Each message
says which round the client's state must reflect (``state-round``: the round before a training round, the
server's round for an evaluation), so a run resumed from its checkpoint of round r rolls every client back to
its newest version of round r or earlier; which rounds the server may resume from (``keep``: the rounds of the
checkpoints it keeps), whose versions the ``--state-dir`` keeps; and the round of the last state the server
knows the client kept (``expect``): a client that cannot produce it answers with a one-line error instead of
training a fresh state.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message as FlwrMessage, RecordDict

from ...config import RunConfig
from ...core.dp import STATS_CLIP, class_means, client_reply, phase_reply
from ...core.privacy import engine_match
from ...core.dpsgd import SampleDP, reads_counts, riders
from ...core.finetune import feature_client, feature_federation, input_shape
from ...core.method import Message, Method, RunSpec
from ...core.noise import noise_seed
from ...core.spec import milestones_text
from ...core.state import tree_of
from ...core.steps import PLAIN_STEPS
from ...data.federated import ClientData, Prep
from ...data.partition import partition_settings
from ...core.training import autocast
from ...seeds import Purpose
from ..federation import federation_for
from ..driver import client_generator
from ...errors import ConfigError, DataError
from ...metrics import as_modes, client_reports, client_split
from ...plugins import method_class
from .records import (control, enter_session, from_records, load_client_state, node_noise_key, records_value,
                      save_client_state, to_records)
from .sends import DESCRIBE, REPORTED, SENDS


# ------------------------------------------------------------------------- the run, as the server sent it
@dataclass
class Job:
    """What one server message says about the run: settings, model spec and input normalisation."""

    cfg: RunConfig
    spec: RunSpec
    prep: dict

    @classmethod
    def parse(cls, text: str) -> "Job":
        d = json.loads(text)
        cfg = RunConfig(**d["config"])
        spec_d = dict(d["spec"], in_shape=tuple(d["spec"]["in_shape"]))
        spec_d["lr_milestones"] = milestones_text(spec_d.get("lr_milestones", ""))  # a list from older servers
        spec = RunSpec(**{f.name: spec_d[f.name] for f in fields(RunSpec) if f.name in spec_d})
        return cls(cfg, spec, d["prep"])


def job_text(cfg: RunConfig, spec: RunSpec, prep: Prep) -> str:
    """The ``run`` field of every server message (the counterpart of :meth:`Job.parse`)."""
    spec_d = {f.name: getattr(spec, f.name) for f in fields(RunSpec)}
    spec_d["cache_dir"] = None  # a path on the server means nothing on a client
    return json.dumps({"config": cfg.to_dict(), "spec": spec_d,
                       "prep": {"mean": list(prep.mean), "std": list(prep.std), "augment": prep.augment}},
                      sort_keys=True)


# ------------------------------------------------------------------------- per-process caches
# Deterministic objects only (the method object, data): never a client's state, which is in context.state.
_METHODS: dict[str, Method] = {}
_DATA: dict[tuple, ClientData] = {}  # a client data directory, loaded once per process
_FEDS: dict[str, Any] = {}


def node_setting(context: Context, key: str, default=None):
    v = context.node_config.get(key, default)
    return default if v == "" else v


def _method(job: Job, device: str) -> Method:
    key = json.dumps([job.cfg.method, job.cfg.method_file, job.cfg.params, job.spec.__dict__, device],
                     sort_keys=True, default=str)
    if key not in _METHODS:
        spec = RunSpec(**{**job.spec.__dict__, "device": device, "cache_dir": os.environ.get("FEDLT_CACHE")})
        cls = method_class(job.cfg)  # a method file: the absolute path the server's settings name
        _METHODS[key] = cls(spec, cls.make_params(job.cfg.params, job.cfg.allow_large))
    return _METHODS[key]


def partition_federation(cfg: RunConfig, device: str):
    """The federation the run's settings describe (whose client K a SuperNode with ``partition-id=K`` serves),
    built once per process."""
    key = json.dumps([cfg.dataset, cfg.data_dir, cfg.imbalance_ratio, cfg.lt_profile, cfg.tail_classes, cfg.n_max,
                      cfg.partition, partition_settings(cfg.partition, cfg), cfg.partition_file, cfg.dataset_kw(),
                      cfg.clients, cfg.seed, cfg.client_test_fraction, device], sort_keys=True, default=str)
    if key not in _FEDS:
        _FEDS[key] = federation_for(RunConfig(**{**cfg.to_dict(), "device": device}))
    return _FEDS[key]


def _partition_id(job: Job, pid: int) -> int:
    if not 0 <= pid < job.cfg.clients:
        raise ConfigError(f"partition-id {pid} is outside the run's {job.cfg.clients} clients; use "
                          f"0..{job.cfg.clients - 1}")
    return pid


def _partition_client(job: Job, pid: int, device: str) -> ClientData:
    cfg = job.cfg
    fed = partition_federation(cfg, device)
    if job.spec.finetune == "head":  # the samples as the frozen backbone's features, encoded once (core.finetune)
        key = f"{id(fed)} features"
        fed = _FEDS[key] = _FEDS.get(key) or feature_federation(fed, job.spec)
    return fed.clients[pid]


def load_client_dir(path: str, cid: int, spec: RunSpec, prep: Prep) -> ClientData:
    """A client's own data: ``train.npz`` (and optionally ``test.npz``) with ``x`` (images shaped like the run's
    dataset, uint8 or float) and ``y`` (integer labels)."""
    def read(name, required):
        f = Path(path) / name
        if not f.is_file():
            if required:
                raise DataError(f"{f} not found: a client data directory holds train.npz (arrays x, y) and "
                                f"optionally test.npz")
            return None
        try:
            with np.load(f, allow_pickle=False) as z:  # an object array would be unpickled: refused
                x, y = z["x"], z["y"].astype(np.int64)
        except (OSError, KeyError, ValueError) as e:
            raise DataError(f"{f} is not a readable npz with arrays x and y: {e}") from None
        if x.ndim == 3:
            x = x[:, None]
        if tuple(x.shape[1:]) != input_shape(spec) or len(x) != len(y):
            raise DataError(f"{f}: x has shape {x.shape} and y {y.shape}; the run expects [N, "
                            f"{', '.join(map(str, input_shape(spec)))}] images and N labels")
        if len(y) and (y.min() < 0 or y.max() >= spec.num_classes):
            raise DataError(f"{f}: labels must be in 0..{spec.num_classes - 1}")
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)

    x, y = read("train.npz", True)
    test = read("test.npz", False)
    tx, ty = test if test is not None else (x[:0], y[:0])
    return ClientData(cid, x, y, spec.num_classes, prep, tx, ty, np.arange(len(ty)))


@dataclass
class Node:
    """One SuperNode's view of the run: its client id, data and the method object, and what the message says
    about the client's state (the fedlt run it belongs to, the round it must reflect)."""

    cid: int
    data: ClientData
    method: Method
    job: Job
    state_dir: str | None
    run: str  # the fedlt run's id (kept in its run directory): the client states belong to it
    ctl: Any = None  # the message's fedlt record
    dp: SampleDP | None = None  # --dp sample: this message's DP-SGD (its trainer, the method's step runner; its wire)

    @classmethod
    def of(cls, msg: FlwrMessage, context: Context) -> "Node":
        ctl = control(msg.content)
        job = Job.parse(str(ctl["run"]))
        if job.cfg.threads:
            torch.set_num_threads(job.cfg.threads)
        device = str(node_setting(context, "device", job.spec.device))
        method = _method(job, device)
        pid, data_dir = node_setting(context, "partition-id"), node_setting(context, "data-dir")
        if pid is not None:
            cid = _partition_id(job, int(pid))
            data = _partition_client(job, cid, device)
        elif data_dir is not None:
            if node_setting(context, "client-id") is None:
                raise ConfigError("a SuperNode with data-dir also needs client-id=K in --node-config")
            cid = int(node_setting(context, "client-id"))
            key = ("dir", cid, device, str(data_dir), repr(job.prep), job.spec.in_shape)
            if key not in _DATA:
                prep = Prep(tuple(job.prep["mean"]), tuple(job.prep["std"]), job.prep["augment"], device)
                _DATA[key] = load_client_dir(str(data_dir), cid, method.spec, prep)
                if method.spec.finetune == "head":  # its samples as the frozen backbone's features (core.finetune)
                    _DATA[key] = feature_client(_DATA[key], method.spec)
            data = _DATA[key]
        else:
            raise ConfigError("the SuperNode's --node-config needs partition-id=K (a client of the fedlt "
                              "partition) or data-dir=DIR client-id=K (its own data)")
        run = str(ctl.get("fedlt-run", context.run_id))  # a server of before fedlt run ids: the Flower run's
        state_dir = node_setting(context, "state-dir")
        if state_dir and "session" in ctl:
            enter_session(state_dir, run, int(ctl["session"]))
        # --dp sample: this message's DP-SGD (a train or phase message's; the cached method serves other runs too)
        # (--dp-noise-seed secret: from this SuperNode's own key, records.node_noise_key)
        training = job.cfg.dp == "sample" and msg.metadata.message_type.startswith("train")
        secret = noise_seed(job.cfg.dp_noise_seed, deployed=True) == "secret"  # a server that says none: its own key
        key = node_noise_key(context.state, state_dir, run) if training and secret else None
        dp = SampleDP.on_client(job.cfg, cid, ctl, key, reads_counts(type(method)), riders(type(method))) \
            if training else None
        method.step_runner = dp.trainer if dp is not None else PLAIN_STEPS
        return cls(cid, data, method, job, state_dir, run, ctl, dp)

    def client_state(self, context: Context) -> dict:
        """The client's state as the server expects it: its newest version of the message's ``state-round``
        or earlier (a resumed run rolls the client back to its checkpointed round), else a fresh one -- unless
        the server knows the client kept a state of a later round (``expect``), which is then lost: a one-line
        error (the client is recorded missing), never a silent fresh state."""
        bound = int(self.ctl["state-round"]) if "state-round" in self.ctl else None
        cstate, tag = load_client_state(context.state, self.cid, self.state_dir, self.run, bound)
        expect = int(self.ctl.get("expect", 0))
        if expect and (tag is None or tag < expect):
            where = (f"its --state-dir {self.state_dir} holds " + (f"round {tag}'s" if tag is not None else "none")
                     if self.state_dir else "the SuperNode has no --state-dir and its memory holds none")
            raise ConfigError(f"client {self.cid} has lost its state of round {expect} (fedlt run {self.run}; "
                              f"{where}); restart its SuperNode with the --state-dir it had, or start the run afresh")
        if cstate is None:
            cstate = self.method.init_client(self.cid, self.data)
        return cstate

    def save(self, context: Context, cstate: dict, tag: int) -> None:
        """Keep the client state, tagged with the round it reflects (a phase's: after the last round), and the
        versions of the rounds the server may resume from (``keep``)."""
        keep = [int(r) for r in str(self.ctl.get("keep", "")).split(",") if r]
        save_client_state(context.state, cstate, self.cid, self.state_dir, self.run, tag, keep)

    def privatise(self, reply: Message, ctl, payload: Message | None = None, phase: str | None = None) -> Message:
        """``reply`` as it may leave the SuperNode under the run's --dp: client level, a round's update clipped
        here (its class statistics to their own clip) and a phase's reply as the phase allows; sample level, the
        model DP-SGD trained, its size and the accountant's entries; without DP as it is."""
        if self.job.cfg.dp == "client":
            if phase is not None:
                return phase_reply(phase, f"client {self.cid}", reply)
            if "dp-clip" not in ctl:
                raise ConfigError("--dp client: the train message carries no clip (dp-clip), so the update cannot "
                                  "be clipped here: the server runs another fedlt")
            stats_clip = self.job.cfg.dp_stats_clip or STATS_CLIP  # class statistics (a class-mean method's)
            clipped, _, _ = client_reply(payload.arrays, reply, float(ctl["dp-clip"]), f"client {self.cid}", bit=True,
                                         means=class_means(self.method.sends), stats_clip=stats_clip)
            return clipped
        if self.dp is not None:
            return self.dp.wire.client_reply(self.cid, reply, phase=phase)
        return reply

    def reply(self, msg: FlwrMessage, fm: Message | None = None, **fields_) -> FlwrMessage:
        rd = to_records(fm if fm is not None else Message(), {"client-id": self.cid, **fields_}, "reply", metrics=False)
        return FlwrMessage(rd, reply_to=msg)


# ------------------------------------------------------------------------- handlers
def describe(msg: FlwrMessage, context: Context) -> FlwrMessage:
    """Who it is (its client id, whether it serves the run's partition) and, from a SuperNode holding its own data,
    the facts of it that the engine declares for the run's --dp mode (:mod:`.sends`: its label counts and sizes;
    under --dp client none, under --dp sample its size); a client of the partition sends none of them (the server
    rebuilds it from the run's settings: it answers without building the method or reading the data, which a
    SuperNode's process, started for this message, would do for nothing)."""
    pid = node_setting(context, "partition-id")
    if pid is not None:
        cid = _partition_id(Job.parse(str(control(msg.content)["run"])), int(pid))
        return FlwrMessage(to_records(Message(), {"client-id": cid, "partition": True}, "reply", metrics=False),
                           reply_to=msg)
    node = Node.of(msg, context)
    facts = {"counts": [int(c) for c in node.data.counts], "test-size": len(node.data.test_y),
             "num-examples": len(node.data)}
    said = {k: v for k, v in facts.items() if engine_match(SENDS, DESCRIBE, k, node.job.cfg.dp, True)}
    return node.reply(msg, partition=False, **said)


def train(msg: FlwrMessage, context: Context) -> FlwrMessage:
    node = Node.of(msg, context)
    return _trained(node, msg, context, node.client_state(context))


def train_evaluate(msg: FlwrMessage, context: Context) -> FlwrMessage:
    """A round's training whose message also carries the previous round's evaluation (the server's
    ``GridTransport.ride``): PM as :func:`evaluate` computes it, on the client state the training then starts from
    (a copy: the evaluation changes nothing), and the training as :func:`train`; one reply holds both."""
    node = Node.of(msg, context)
    cstate = node.client_state(context)
    said = _evaluation(node, riding_records(msg.content), control(msg.content), copy.deepcopy(cstate))
    return _trained(node, msg, context, cstate, **said)


def _trained(node: Node, msg: FlwrMessage, context: Context, cstate: dict, **said) -> FlwrMessage:
    """A training message's reply: ``method.local_train`` at the round's generator from ``cstate``, the state
    kept, under --dp client clipped, under --dp sample the accountant's entries; ``said``: further engine fields."""
    ctl = control(msg.content)
    rnd = int(ctl["round"])
    gen = client_generator(node.job.cfg.seed, Purpose.TRAIN, rnd, node.cid)
    payload = from_records(msg.content)
    with autocast(node.method.spec):
        reply, cstate = node.method.local_train(payload, cstate, node.data, gen)
    node.save(context, cstate, rnd)
    return node.reply(msg, node.privatise(reply, ctl, payload), **{"has-state": bool(cstate)}, **said)


def phase(msg: FlwrMessage, context: Context) -> FlwrMessage:
    node = Node.of(msg, context)
    ctl = control(msg.content)
    name, index = str(ctl["phase"]), int(ctl["index"])
    gen = client_generator(node.job.cfg.seed, Purpose.PHASE, index, node.cid)
    with autocast(node.method.spec):
        reply, cstate = node.method.phase_client(name, from_records(msg.content), node.client_state(context),
                                                 node.data, gen)
    node.save(context, cstate, node.job.cfg.rounds + 1 + index)
    return node.reply(msg, node.privatise(reply, ctl, phase=name), **{"has-state": bool(cstate)})


def evaluate(msg: FlwrMessage, context: Context) -> FlwrMessage:
    """PM on the client's own test set; the reports go back as JSON (accuracy, many/medium/few: :mod:`.sends`)."""
    node = Node.of(msg, context)
    return node.reply(msg, **_evaluation(node, msg.content, control(msg.content), node.client_state(context)))


def _evaluation(node: Node, content: RecordDict, ctl, cstate: dict) -> dict:
    """PM of the model that ``content`` (the method's evaluation payload and, for the global model, the records of
    :func:`global_state_records`) and ``cstate`` give, on the client's own test set, split as ``ctl`` says: the
    reply's ``source`` and ``reports``."""
    if len(node.data.test_y) == 0:
        return {"source": "none", "reports": "{}"}
    m = node.method
    pp = m.personal_model(from_records(content), cstate, node.data)
    source = "personal"
    if pp is None:
        if "fedlt.global" not in content:
            return {"source": "needs-global", "reports": "{}"}
        gm = m.global_model(m.server_state(records_value(content["fedlt.global"], content["fedlt.global.arrays"])))
        if gm is None:
            raise ConfigError(f"method {m.name} has neither a global nor a personal model")
        pp, source = {"global": next(iter(as_modes(gm, "global").values()))}, "global"  # main mode, as simulated
    gsplit = {g: np.asarray(v, dtype=np.int64) for g, v in json.loads(str(ctl["gsplit"])).items()}
    csplit = client_split(node.data.counts, str(ctl["split"]), gsplit)
    reports = client_reports(pp, node.data, m.spec.num_classes, csplit)
    # what PM aggregates (the engine's declaration, .sends), not which classes its test set holds
    reports = {mode: {k: rep[k] for k in REPORTED if k in rep} for mode, rep in reports.items()}
    return {"source": source, "reports": json.dumps(reports)}


RIDING = "evaluation."  # the prefix of an evaluation's records riding in a training message (riding_records)


def riding_records(content: RecordDict) -> RecordDict:
    """The evaluation's records inside a ``train.evaluate`` message (the server's ``GridTransport.ride`` prefixes
    them with :data:`RIDING`), as an ``evaluate`` message holds them."""
    return RecordDict({k[len(RIDING):]: v for k, v in content.items() if k.startswith(RIDING)})


def global_state_records(state: dict) -> RecordDict:
    """The server state sent to clients that evaluate PM with the global model (methods without a personal
    model): the records ``fedlt.global`` / ``fedlt.global.arrays``."""
    from .records import value_records

    cfg, arr = value_records(tree_of(state), "server state")
    return RecordDict({"fedlt.global": cfg, "fedlt.global.arrays": arr})


