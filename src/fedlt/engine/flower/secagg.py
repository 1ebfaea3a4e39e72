"""``--secagg`` on the Flower engine: a training round through Flower's SecAgg+ -- ``SecAggPlusWorkflow`` on the
server, ``secaggplus_mod`` on the ClientApp's ``train`` handler -- with no cryptography of fedlt's own.

Flower 1.42's workflow drives a *legacy* ``Strategy`` inside a ``LegacyContext``: it calls ``configure_fit`` for
the round's ``FitIns``, runs its four stages (keys, key shares, masked vectors, unmasking) as ``train`` messages
to the round's SuperNodes, and hands ``aggregate_fit`` every surviving client's ``FitRes`` whose parameters it
has replaced by the unmasked weighted mean (weights: each ``FitRes.num_examples`` up to ``max_weight``). So:

- server (:func:`secure_round`, called by ``GridTransport.send_and_receive`` for a training round): each client's
  fedlt message (its payload and the ``fedlt`` control record) becomes one ``FitIns`` (:func:`fitins_of`: its
  arrays as the parameters, the rest as JSON in the config); :class:`RoundStrategy` gives them to the workflow and
  keeps what ``aggregate_fit`` receives; the round's replies are then ``received + mean update`` for each client
  that answered (``fedlt.core.secagg.replies_with_mean``), with the meta each sent in the clear.
- client (:func:`client_mod`, the ``train`` handler's mod): the messages of a SecAgg+ round (they carry
  ``secaggplus_configs``) go through ``secaggplus_mod``; in its masked-vector stage the fedlt payload is unpacked
  from the ``FitIns`` for the ordinary ``train`` handler, whose reply is turned into a ``FitRes``
  (:func:`fitres_of`): the update of every floating-point entry as the parameters (what SecAgg+ masks; under
  ``--dp client`` the clipping bit too, so that adaptive clipping's count is summed securely), its
  ``num_examples`` (the weight) and, in its metrics, in the clear, the meta values, the entries' names and the
  client's id. The stochastic rounding the mod does next draws from the run seed (numpy's global generator,
  seeded here and restored after), so a round's mean is the simulator's, bit for bit.

Whatever SecAgg+ does not mask crosses as before (evaluation, post-training phases, the describe query).
"""
from __future__ import annotations

import json
from functools import partial

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message as FlwrMessage, MetricRecord, RecordDict
from flwr.common import (Code, FitIns, FitRes, Parameters, Status, bytes_to_ndarray, ndarrays_to_parameters,
                         parameters_to_ndarrays)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.server.strategy import Strategy

from ...codec import pack, unpack
from ...core.dp import UNCLIPPED
from ...core.method import Message
from ...core.secagg import masked_keys, not_finite, numpy_seeded, replies_with_mean, update_of, vector
from ...errors import ConfigError
from ...seeds import Purpose, derive_seed
from .records import control, from_records

LAYOUT = "fedlt.layout"  # FitIns.config: where each parameter goes back and the other records (JSON)
BIT = "fedlt.dp-unclipped"  # --dp client's clipping bit: masked with the update (its last entry), not in the clear


# ------------------------------------------------------------------------------------------ server
def fitins_of(rd: RecordDict) -> FitIns:
    """A fedlt message's records as one legacy ``FitIns``: every array of its array records as the parameters (in
    order), its config and metric records as JSON in the config (:func:`records_of` undoes it)."""
    tensors, where, others = [], [], {}
    for name, rec in rd.items():
        if isinstance(rec, ArrayRecord):
            for key in rec:
                where.append([name, key])
                tensors.append(rec[key].data)
            if not len(rec):
                others[name] = ["arrays", {}]
        else:
            others[name] = ["metrics" if isinstance(rec, MetricRecord) else "config", dict(rec)]
    layout = json.dumps({"arrays": where, "records": others})
    return FitIns(Parameters(tensors=tensors, tensor_type="numpy.ndarray"), {LAYOUT: layout})


def records_of(fitins: FitIns) -> RecordDict:
    """The fedlt message's records that :func:`fitins_of` packed."""
    from flwr.app import Array

    layout = json.loads(str(fitins.config[LAYOUT]))
    rd = RecordDict()
    arrays: dict[str, dict] = {}
    for (name, key), data in zip(layout["arrays"], fitins.parameters.tensors, strict=True):
        arrays.setdefault(name, {})[key] = Array(bytes_to_ndarray(data))
    for name, values in arrays.items():
        rd[name] = ArrayRecord(values)
    for name, (kind, values) in layout["records"].items():
        rd[name] = ArrayRecord() if kind == "arrays" else MetricRecord(values) if kind == "metrics" else \
            ConfigRecord(values)
    return rd


class RoundStrategy(Strategy):
    """The legacy Strategy ``SecAggPlusWorkflow`` drives for one fedlt training round: ``configure_fit`` gives each
    sampled client's SuperNode its fedlt message as ``FitIns``; ``aggregate_fit`` keeps what the workflow hands it
    (each surviving client's ``FitRes``, its parameters the unmasked weighted mean) and changes no model: the
    fedlt method aggregates afterwards."""

    def __init__(self, fitins: dict, proxies: dict):
        super().__init__()
        self.fitins, self.proxies = fitins, proxies  # by node id
        self.results: dict | None = None  # node id -> FitRes; None: the workflow halted before aggregate_fit

    def initialize_parameters(self, client_manager):
        return None

    def configure_fit(self, server_round, parameters, client_manager):
        return [(self.proxies[node], ins) for node, ins in self.fitins.items()]

    def aggregate_fit(self, server_round, results, failures):
        self.results = {proxy.node_id: res for proxy, res in results}
        return None, {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def secure_round(transport, rnd: int, payloads: dict[int, Message]) -> tuple[list, dict[int, str]]:
    """Training round ``rnd`` of ``transport`` (a ``GridTransport``) through Flower's SecAgg+: the replies as the
    server sees them (every client that answered: ``received + mean update``, its meta as sent) and the clients
    missing, with why."""
    from flwr.server import ServerConfig, SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow.constant import Key, MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import SecAggPlusWorkflow

    from ...core.secagg import largest_client

    st = transport.st
    driver = st.driver
    # --dp client: every weight is 1, and the SuperNodes send no sizes (driver.counts is not there); --dp sample:
    # their sizes only (Driver.sizes)
    sizes = driver.sizes() if st.cfg.dp == "sample" else None
    largest = 1 if driver.secagg.uniform else largest_client(
        np.asarray(sizes) if sizes is not None else driver.counts().sum(1), payloads)
    p = driver.secagg.round_params(len(payloads), largest)
    if isinstance(p, str):
        return [], {c: p for c in payloads}
    msgs = transport.messages("train", rnd, payloads)
    node = {cid: m.metadata.dst_node_id for cid, m in msgs.items()}
    cid_of = {n: c for c, n in node.items()}
    manager = SimpleClientManager()
    proxies = {n: GridClientProxy(n, transport.grid, 0) for n in cid_of}
    for proxy in proxies.values():
        manager.register(proxy)
    strategy = RoundStrategy({node[c]: fitins_of(m.content) for c, m in msgs.items()}, proxies)
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=st.cfg.rounds), strategy=strategy, client_manager=manager)
    context.state[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: int(rnd)})
    context.state[MAIN_PARAMS_RECORD] = ArrayRecord()
    SecAggPlusWorkflow(p.shares, p.threshold, max_weight=p.max_weight, clipping_range=p.clip_range,
                       quantization_range=p.levels, timeout=st.round_timeout)(transport.grid, context)
    if strategy.results is None:
        return [], {c: f"SecAgg+ halted: fewer than {p.threshold} of a client's share-holders answered a stage "
                       f"(Flower's log says which); the round is not aggregated" for c in payloads}
    got = {cid_of[n]: res for n, res in strategy.results.items() if n in cid_of}
    why = {c: "no masked update reached the server (failed or silent in a SecAgg+ stage; its masks were removed)"
           for c in payloads if c not in got}
    replies, mean = [], None
    for cid in sorted(got):
        m = got[cid].metrics
        keys = json.loads(str(m["fedlt.masked"]))
        if mean is None:
            mean = dict(zip(keys, parameters_to_ndarrays(got[cid].parameters)))
        if keys != list(mean):
            raise ConfigError(f"--secagg: client {cid} sends other entries than the round's other clients; SecAgg+ "
                              f"sums vectors of one shape, so this method cannot run under --secagg")
        arrays = {k: payloads[cid].arrays[k] for k in json.loads(str(m["fedlt.entries"]))}
        replies.append((cid, Message(arrays, unpack(str(m["fedlt.meta"]), {}))))
        if bool(m.get("has-state", True)):
            transport.expect[cid] = rnd
        else:
            transport.expect.pop(cid, None)
    if mean is not None and BIT in mean:  # the count of unclipped updates, securely summed (every weight alike)
        count = int(round(float(mean.pop(BIT)[0]) * len(replies)))
        for i, (_, r) in enumerate(replies):  # bits whose sum is that count: what adaptive clipping reads (core.dp)
            r.meta[UNCLIPPED] = int(i < count)
    return replies_with_mean({c: payloads[c].arrays for c in got}, replies, mean or {}), why


# ------------------------------------------------------------------------------------------ client
def fitres_of(received: RecordDict, reply: RecordDict) -> RecordDict:
    """The ClientApp's reply to a SecAgg+ round's payload, as the ``FitRes`` records ``secaggplus_mod`` masks: the
    update of each floating-point entry (sent - received) as its parameters, ``num_examples`` as its weight, and
    in its metrics, in the clear, the meta values, the names of the entries and the client's id."""
    from flwr.compat.common.recorddict_compat import fitres_to_recorddict

    fm, got = from_records(reply), from_records(received)
    ctl = control(reply)
    keys = masked_keys(fm.arrays)
    who = f"client {ctl.get('client-id', '?')}"
    update = update_of(got.arrays, fm.arrays, who)
    if (wrong := not_finite(update, who)) is not None:  # it would be masked as a wrong finite number: not sent
        raise ConfigError(wrong)
    vec = vector(update, keys)
    meta = dict(fm.meta)
    if UNCLIPPED in meta:  # --dp client's clipping bit: summed with the update (Andrew et al.), not in the clear
        keys, vec = keys + [BIT], vec + [np.array([float(meta.pop(UNCLIPPED))])]
    skeleton, meta_arrays = pack(meta, "reply meta")
    if meta_arrays:
        raise ConfigError(f"--secagg: the reply's meta holds arrays ({', '.join(sorted(meta_arrays)[:3])}), which "
                          f"would cross in the clear; this method cannot run under --secagg")
    metrics = {"fedlt.masked": json.dumps(keys), "fedlt.entries": json.dumps(list(fm.arrays)), "fedlt.meta": skeleton,
               "client-id": int(ctl.get("client-id", -1)), "has-state": bool(ctl.get("has-state", True))}
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(vec), int(meta["num_examples"]), metrics)
    return fitres_to_recorddict(res, keep_input=False)


def _masked_train(msg: FlwrMessage, context: Context, call_next, seed_purpose: int) -> FlwrMessage:
    """The masked-vector stage's call of the ``train`` handler: the fedlt payload unpacked from the ``FitIns``
    into the message, the handler's reply packed as the ``FitRes`` that ``secaggplus_mod`` masks next, with
    numpy's global generator (its stochastic rounding) seeded from the run seed, the round and the client."""
    from flwr.compat.common.recorddict_compat import recorddict_to_fitins

    for name, rec in records_of(recorddict_to_fitins(msg.content, keep_input=True)).items():
        msg.content[name] = rec
    out = call_next(msg, context)
    if out.has_error():
        return out
    ctl = control(msg.content)
    out.content = fitres_of(msg.content, out.content)
    seed = json.loads(str(ctl["run"]))["config"]["seed"]
    np.random.seed(derive_seed(seed, seed_purpose, int(ctl["round"]), int(ctl["client-id"])) % 2 ** 32)
    return out


def client_mod(msg: FlwrMessage, context: Context, call_next) -> FlwrMessage:
    """The ``train`` handler's mod: the messages of a SecAgg+ round through Flower's ``secaggplus_mod`` (its
    masked-vector stage calls the handler through :func:`_masked_train`); every other message as it is. numpy's
    global generator is as it was afterwards."""
    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    from flwr.client.mod import secaggplus_mod

    with numpy_seeded(None):  # restored afterwards; the masked-vector stage seeds it from the run seed
        return secaggplus_mod(msg, context, partial(_masked_train, call_next=call_next, seed_purpose=Purpose.SECAGG))
