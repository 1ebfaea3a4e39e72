"""The Flower engine's server side: :class:`GridServer` runs a fedlt run's exchanges on a Flower ``Grid`` (in-process,
or the SuperLink's) for the run driver (``fedlt.engine.driver``), the one round loop of every engine, with
:class:`GridTransport` carrying its messages:

1. ``query.describe`` to every SuperNode: each says its client id and whether it serves a client of the run's
   partition (whose label counts and sizes the server rebuilds from the run's settings); only one holding its own
   data says its label counts and sizes, and under ``--dp`` less (:mod:`.sends` declares each form:
   :meth:`GridServer._info`, :meth:`GridServer._counts`); the run waits until the run's ``clients`` distinct ids
   are there (``wait_timeout``). SuperNodes that appear later (a restart) are described at the start of a round.
2. every round, phase and evaluation of the driver: one message per client (``train`` with the round's lr,
   ``train.phase``, ``evaluate`` with ``method.eval_payload``; where :meth:`GridTransport.rides` allows, a round's
   evaluation goes with the next round's training message, ``train.evaluate``); the replies that come back within
   ``round_timeout`` count, failed or silent clients are recorded as missing. GM is computed on the server
   (balanced test set), PM on the clients, aggregated as the simulation does.

The run itself -- the run directory, checkpoints and resume as for every engine -- is the Flower app's
(``fedlt.flower.strategy.FedltStrategy.run``, above the runner); this module imports no runner.

The classic ``Strategy.start`` also works (training rounds and the per-round evaluation through
``configure_*`` / ``aggregate_*``), but only the run does the phases, ``--secagg`` (Flower's SecAgg+ in the
training rounds: ``fedlt.engine.flower.secagg``), ``--dp client`` (the ClientApp clips, the driver checks each reply
and adds the noise: ``fedlt.core.dp``), ``--dp sample`` (each SuperNode trains by DP-SGD and sends its accountant's
entries, the driver keeps every client's accountant: ``fedlt.core.dpsgd``) and writes the run directory.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Iterable
from typing import Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message as FlwrMessage, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ...config import RunConfig
from ...core.finetune import feature_federation
from ...core.method import Message, Method
from ...core.noise import noise_seed
from ...core.privacy import engine_record
from ...core.state import tree_of
from ...data import Federation
from ...data.datasets import load_dataset
from ...data.federated import Prep
from ..clientstate import ClientStates
from ..driver import TRAINING, Driver, EngineConfig, is_eval_round
from ..federation import make_spec
from . import TIMING
from ...errors import ConfigError
from ...metrics import GROUPS, evaluate as evaluate_global, shot_split, summarize_personal
from ...plugins import method_class
from .client import RIDING, global_state_records, job_text, partition_federation
from .records import control, from_records, load_client_state, save_client_state, state_tag, to_records
from .sends import (DESCRIBE, ENGINE, EVALUATE, PHASE as PHASE_REPLY, SENDS, TRAIN as TRAIN_REPLY, TRAIN_EVALUATE,
                    WHERE, fields_of)


RESTART_LOOK = 2.0  # s between a round's looks for restarted SuperNodes (GridServer.exchange)
WIRE = {"counts": "counts", "test-size": "test_size", "num-examples": "num_examples"}  # describe's fields -> info's


class GridServer(Strategy):
    """Server side of a fedlt run on Flower, as a Flower ``Strategy``: the run's method and driver, its SuperNodes
    and its exchanges with them. ``state`` is the method's server state; nothing about a specific method is known
    here. The run's entry, which records it in a run directory, is ``fedlt.flower.strategy.FedltStrategy``."""

    def __init__(self, cfg: RunConfig, round_timeout: float = TIMING["round-timeout"],
                 wait_timeout: float = TIMING["wait-timeout"],
                 poll_interval: float = TIMING["poll-interval"], echo: Callable[[str], None] = print,
                 progress: bool = False, deployed: bool = False):
        self.cfg, self.round_timeout, self.wait_timeout = cfg, float(round_timeout), float(wait_timeout)
        self.poll_interval, self.echo = float(poll_interval), echo
        ds = load_dataset(cfg.dataset, cfg.data_dir, **cfg.dataset_kw())
        self.prep = Prep(ds.mean, ds.std, ds.augment, cfg.device)
        self.fed = Federation(ds, [], np.zeros(ds.num_classes, np.int64), np.zeros((0, ds.num_classes), np.int64),
                              self.prep, {})
        self.spec = make_spec(cfg, self.fed)
        if self.spec.finetune == "head":  # the server's test set as the frozen backbone's features (core.finetune)
            self.fed = feature_federation(self.fed, self.spec)
        cls = method_class(cfg)
        if getattr(cls, "needs_pool", False):
            raise ConfigError(f"method {cfg.method} trains on all clients' data pooled in one place, which a "
                              f"federation of SuperNodes does not have; run it with `fedlt run`")
        self.method: Method = cls(self.spec, cls.make_params(cfg.params, cfg.allow_large))
        if cfg.dp == "sample":  # DP-SGD cannot bound a sample's influence through BatchNorm: one line (core.dpsgd)
            from ...core.dpsgd import check_counts_release, check_model

            check_model(self.method.new_model(), self.spec.model)
            check_counts_release(cfg, cls)  # with --dp-delta; else the SuperNode solving its noise says it
        # the clients learn the noise seed resolved (deployed: the SuperNodes' own keys unless run was asked for)
        self.job = job_text(dataclasses.replace(cfg, dp_noise_seed=noise_seed(cfg.dp_noise_seed, deployed)), self.spec,
                            self.prep)
        self.transport = GridTransport(self)
        self.driver = Driver(self.method, EngineConfig.of(cfg, progress=False, deployed=deployed), self.transport,
                             cfg.clients)
        self.driver.echo = echo
        # known once the SuperNodes have described themselves; under --dp they do not say them
        self.driver.client_counts = None if cfg.dp != "off" else lambda: self.fed.counts
        if cfg.dp == "sample":  # each client's number of samples (public in DP-SGD's analysis: its sampling rate)
            self.driver.client_sizes = lambda: np.array([self.info[c]["num_examples"] for c in range(cfg.clients)])
        if cfg.dp != "off" and self.driver.cfg.faults is not None:
            raise ConfigError(f"--speed-sigma and --speed-file time each client's round by its label counts, which "
                              f"under --dp {cfg.dp} the SuperNodes do not send: drop them, or use `fedlt run`")
        self.nodes: dict[int, int] = {}  # client id -> node id (the latest SuperNode that said it is that client)
        self.described: set[int] = set()  # node ids that said who they are
        self.failed_nodes: dict[int, str] = {}  # node id -> why its describe failed (it is asked again)
        self.info: dict[int, dict] = {}  # client id -> its describe reply

    # the run's state is the driver's
    state = property(lambda self: self.driver.state, lambda self, v: setattr(self.driver, "state", v))
    history = property(lambda self: self.driver.history)
    schedule = property(lambda self: self.driver.schedule)

    # ------------------------------------------------------------------ messaging
    def _message(self, content: RecordDict | Message, cid: int, mtype: str, ctl: dict, group: str) -> FlwrMessage:
        rd = content if isinstance(content, RecordDict) else to_records(content, what="payload")
        rd["fedlt"] = ConfigRecord({"run": self.job, "client-id": int(cid), **ctl})
        return FlwrMessage(rd, dst_node_id=self.nodes[cid], message_type=mtype, group_id=group,
                           ttl=max(self.round_timeout, 1.0) + 60.0)

    def exchange(self, grid: Grid, msgs: dict[int, FlwrMessage], timeout: float,
                 resend: bool = True) -> tuple[dict, dict]:
        """Send one message per client and wait (at most ``timeout`` s) for the replies.
        Returns ({cid: reply RecordDict}, {cid: why it is missing}). With ``resend``, a client whose SuperNode
        restarts meanwhile (it comes back as a new node and says it is that client) is sent its message again
        there, so a SuperNode killed in the middle of a round and restarted with its ``--state-dir`` still
        answers that round."""
        cids = list(msgs)
        ids = list(grid.push_messages([msgs[c] for c in cids]))
        pending = {mid: cid for mid, cid in zip(ids, cids) if mid}
        why = {cid: "the message could not be pushed" for mid, cid in zip(ids, cids) if not mid}
        sent_to = {cid: msgs[cid].metadata.dst_node_id for cid in cids}
        node_of = {mid: sent_to[cid] for mid, cid in pending.items()}  # where each copy went
        got: dict[int, RecordDict] = {}
        end = time.monotonic() + timeout
        look = time.monotonic() + RESTART_LOOK
        while pending:
            for r in grid.pull_messages(list(pending)):
                cid = pending.pop(r.metadata.reply_to_message_id, None)
                if cid is None or cid in got:
                    continue
                stale = node_of[r.metadata.reply_to_message_id] != sent_to[cid]
                if r.has_error() and stale and cid in pending.values():
                    continue  # the dead node's copy failed (its heartbeat stopped); the copy re-sent is awaited
                for mid in [m for m, c in pending.items() if c == cid]:  # an earlier copy's reply no longer counts
                    del pending[mid]
                if r.has_error():
                    last = ((r.error.reason or "").strip().splitlines() or [""])[-1]  # a traceback's last line
                    why[cid] = f"error {r.error.code}: {last}"
                else:
                    got[cid] = r.content
                    why.pop(cid, None)
            if not pending or time.monotonic() >= end:
                break
            if resend and time.monotonic() >= look:
                look = time.monotonic() + RESTART_LOOK
                self.connect(grid, wait=False)
                again = {cid: m for cid, m in msgs.items() if cid in pending.values() and
                         self.nodes.get(cid, sent_to[cid]) != sent_to[cid]}
                for cid, m in again.items():
                    sent_to[cid] = self.nodes[cid]
                    self.echo(f"client {cid} is back on SuperNode {sent_to[cid]}: its message is sent again")
                    copy = FlwrMessage(m.content, dst_node_id=sent_to[cid], message_type=m.metadata.message_type,
                                       group_id=m.metadata.group_id, ttl=m.metadata.ttl)
                    for mid in grid.push_messages([copy]):
                        if mid:
                            pending[mid] = cid
                            node_of[mid] = sent_to[cid]
            time.sleep(self.poll_interval)
        for cid in set(pending.values()):
            why[cid] = f"no reply within {timeout:g} s"
        return got, why

    def connect(self, grid: Grid, wait: bool = True) -> None:
        """Describe the SuperNodes not asked yet; with ``wait``, until all the run's clients are known."""
        K = self.cfg.clients
        end = time.monotonic() + self.wait_timeout
        while True:
            new = [n for n in grid.get_node_ids() if n not in self.described]
            if new:
                msgs = {}
                for i, n in enumerate(new):  # keyed by a placeholder until the node says who it is
                    rd = RecordDict({"fedlt": ConfigRecord({"run": self.job})})
                    msgs[-1 - i] = FlwrMessage(rd, dst_node_id=n, message_type="query.describe", group_id="describe",
                                               ttl=self.wait_timeout + 60.0)
                got, why = self.exchange(grid, msgs, min(self.round_timeout, max(end - time.monotonic(), 1.0)),
                                         resend=False)
                for key, reason in why.items():
                    self.failed_nodes[new[-1 - key]] = reason
                for key, rd in got.items():
                    node = new[-1 - key]
                    ctl = control(rd)
                    cid = int(ctl["client-id"])
                    if not 0 <= cid < K:
                        raise ConfigError(f"SuperNode {node} says it is client {cid}, but the run has {K} clients "
                                          f"(0..{K - 1}); fix its partition-id / client-id or the run's clients")
                    self.described.add(node)
                    if cid in self.nodes and self.nodes[cid] != node:
                        self.echo(f"client {cid} is now on SuperNode {node} (was {self.nodes[cid]})")
                    self.nodes[cid] = node
                    self.info[cid] = self._info(cid, ctl)
                self.transport.record(DESCRIBE, {}, got.values())
            if not wait or len(self.nodes) >= K:
                return
            if time.monotonic() >= end:
                have = sorted(self.nodes)
                failed = "".join(f"; SuperNode {n}: {r}" for n, r in self.failed_nodes.items() if n not in self.described)
                raise ConfigError(f"only {len(have)} of {K} clients connected within {self.wait_timeout:g} s "
                                  f"(clients {have}); start a SuperNode for each of 0..{K - 1} or raise wait-timeout"
                                  + failed)
            time.sleep(self.poll_interval)

    def _info(self, cid: int, ctl) -> dict:
        """What the server knows of client ``cid`` from its describe reply ``ctl``: whether it serves a client of the
        run's partition, and its label counts and sizes (each where the run has them, as :mod:`.sends` declares):
        from the reply of a SuperNode holding its own data, from the run's settings for a client of the partition
        (which sends none), its counts and test-set size there only without --dp."""
        if not bool(ctl.get("partition", False)):
            return {"partition": False, **{key: (list(map(int, ctl[f])) if key == "counts" else int(ctl[f]))
                                           for f, key in WIRE.items() if f in ctl}}
        fed = partition_federation(self.cfg, self.spec.device)
        client = fed.clients[cid]
        info = {"partition": True, "num_examples": len(client)}
        if self.cfg.dp == "off":
            info.update(counts=[int(c) for c in fed.counts[cid]], test_size=len(client.test_y))
        return info

    def _counts(self) -> None:
        """The federation's label counts: a client's of the run's partition from the run's settings, a SuperNode's
        with its own data from its describe reply (:meth:`_info`). Under ``--dp`` the latter send
        none: the server knows the class totals only (which define many/medium/few), from the run's settings where
        every SuperNode serves a client of the run's partition (``partition-id``: the simulator's federation); with
        SuperNodes holding their own data (``data-dir``) not at all, and GM's group accuracies are left out (a
        note says so). The clients' own counts stay unknown (``partition.json`` has none)."""
        K, C = self.cfg.clients, self.fed.num_classes
        if self.cfg.dp != "off":
            if all(inf["partition"] for inf in self.info.values()):
                self.fed.train_counts = partition_federation(self.cfg, self.spec.device).train_counts
                return
            if self.cfg.split != "fedloge":
                raise ConfigError(f"--split {self.cfg.split} takes its groups from the federation's class totals, "
                                  f"which under --dp {self.cfg.dp} SuperNodes holding their own data (data-dir) do "
                                  f"not send; use --split fedloge (each client's groups from its own counts)")
            self.echo(f"note: under --dp {self.cfg.dp} SuperNodes with their own data (data-dir) send no label "
                      f"counts: the federation's class totals are unknown, so GM has no many/medium/few accuracies")
            return
        counts = np.zeros((K, C), np.int64)
        for cid, inf in self.info.items():
            counts[cid] = inf["counts"]
        self.fed.counts, self.fed.train_counts = counts, counts.sum(0)

    # ------------------------------------------------------------------ Flower Strategy interface
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[FlwrMessage]:
        if self.cfg.secagg:  # SecAgg+ runs in the driver's rounds (GridTransport), not in Strategy.start's
            raise ConfigError("--secagg runs through FedltStrategy.run (fedlt flower ...), not Strategy.start")
        if self.cfg.dp != "off":  # the noise and the check of the clipped replies are the driver's
            raise ConfigError("--dp runs through FedltStrategy.run (fedlt flower ...), not Strategy.start")
        if not self.nodes:  # called by Strategy.start(): learn the clients first
            self.connect(grid)
            self._counts()
        cids = [c for c in self.driver.sampled(server_round) if c in self.nodes]
        payloads = self.driver.payloads(TRAINING, server_round, cids,
                                        lambda c: self.method.configure(self.state, server_round, c))
        return list(self.transport.messages(TRAINING, server_round, payloads).values())

    def aggregate_train(self, server_round: int, replies: Iterable[FlwrMessage]):
        got = {int(control(r.content)["client-id"]): r.content for r in replies if not r.has_error()}
        plan = self.driver.plan(server_round)
        if plan is not None:  # the replies the run's faults lose (engine.faults), as the driver's rounds do
            kept, _, _ = self.driver.cfg.faults.arrivals(plan, sorted(got))
            got = {c: got[c] for c in kept}
        if got:
            self.state = self.method.aggregate(self.state, server_round,
                                               [(cid, from_records(got[cid])) for cid in sorted(got)])
        tree = tree_of(self.state)
        w = tree.get("weights") if isinstance(tree, dict) else None
        return (ArrayRecord(dict(w)) if w else None), MetricRecord({"clients": len(got)})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[FlwrMessage]:
        c = self.cfg
        if not is_eval_round(server_round, c.eval_every, c.rounds):
            return []
        return list(self._eval_messages(list(self.nodes), with_global=not self.method.personalized).values())

    def _eval_content(self, cids: list[int], with_global: bool) -> tuple[dict[int, RecordDict], dict]:
        """What an evaluation tells each client of ``cids``: the method's evaluation payload (and with
        ``with_global`` the server state: PM with the global model), and the split of its test set (the fields of
        the ``fedlt`` record)."""
        gsplit = shot_split(self.fed.train_counts, self.cfg.split)
        ctl = {"split": self.cfg.split, "gsplit": json.dumps({g: gsplit[g].tolist() for g in GROUPS})}
        extra = global_state_records(self.state) if with_global else RecordDict()
        contents = {}
        for cid in cids:
            rd = to_records(self.method.eval_payload(self.state, cid), what="evaluation payload")
            for k, v in extra.items():
                rd[k] = v
            contents[cid] = rd
        return contents, ctl

    def _eval_messages(self, cids: list[int], with_global: bool) -> dict[int, FlwrMessage]:
        contents, ctl = self._eval_content(cids, with_global)
        return {cid: self._message(rd, cid, "evaluate", {**ctl, **self.transport.state_control(cid)}, "evaluate")
                for cid, rd in contents.items()}

    def aggregate_evaluate(self, server_round: int, replies: Iterable[FlwrMessage]) -> MetricRecord | None:
        got = {int(control(r.content)["client-id"]): r.content for r in replies if not r.has_error()}
        pm = self._personal(got)
        first = next(iter(pm.values()), None)
        return MetricRecord({"PM": first["acc"]}) if first else None

    def summary(self) -> None:
        self.echo(f"fedlt strategy: method {self.cfg.method}, {self.cfg.clients} clients, {self.cfg.rounds} rounds")

    # ------------------------------------------------------------------ evaluation
    @staticmethod
    def _personal(got: dict[int, RecordDict]) -> dict:
        per_mode: dict[str, list] = {}
        source = "personal"
        for cid in sorted(got):
            ctl = control(got[cid])
            if str(ctl["source"]) == "global":
                source = "global"
            for mode, rep in json.loads(str(ctl["reports"])).items():
                per_mode.setdefault(mode, []).append(rep)
        return summarize_personal(per_mode, source)

    def evaluate(self, grid: Grid, clients: list[int] | None = None, ride: bool = False) -> tuple[dict, dict[int, str]]:
        """GM on the server's balanced test set, PM on ``clients`` (None: every client; as
        ``fedlt.metrics.evaluate``); and the clients whose PM is missing, with why. ``ride``: GM alone, PM's
        payloads (with the global model) kept for the next round's training messages (:meth:`GridTransport.ride`)."""
        ev = evaluate_global(self.method, self.state, {}, self.fed, self.cfg.split, personal=False)
        cids = sorted(self.nodes) if clients is None else [c for c in clients if c in self.nodes]
        if ride:
            self.transport.riding = self._eval_content(cids, True)
            return ev, {}
        got, why = self.exchange(grid, self._eval_messages(cids, not self.method.personalized), self.round_timeout)
        again = [cid for cid, rd in got.items() if str(control(rd)["source"]) == "needs-global"]
        if again:  # a personalized method without a personal model for these clients: PM with the global model
            more, why2 = self.exchange(grid, self._eval_messages(again, True), self.round_timeout)
            got.update(more)
            why.update(why2)
            for cid in why2:
                got.pop(cid, None)
        at = {"round": self.driver.round} if self.transport.at <= self.cfg.rounds else {"phase": "evaluation"}
        self.transport.record(EVALUATE, at, got.values())
        return {**ev, **self._pm(got)}, why

    def _pm(self, got: dict[int, RecordDict]) -> dict:
        """An evaluation record's PM part from the clients' replies ``got``."""
        return {"personal": self._personal(got), "untested": sum(str(control(rd)["source"]) == "none"
                                                                for rd in got.values())}

class GridTransport:
    """The driver's transport over a Flower ``Grid``: one message per client (``train`` with the round and,
    in its config, the round's lr; ``train.phase``, ``evaluate``), replies within ``round_timeout``; clients that
    fail or stay silent are missing.

    Client states stay on the clients (in ``context.state`` and a SuperNode's ``--state-dir``); they belong to
    the fedlt run, whose id (``run``) a checkpoint keeps, so that a resumed run (a new Flower run) finds them.
    Every message says which round the client's state must reflect and which rounds the server may resume from
    (:meth:`state_control`), so that a run resumed from its checkpoint of round r rolls each client back to the
    version of round r. On an :class:`~fedlt.flower.inprocess.InProcessGrid`, whose nodes live in this process,
    the states are also read for checkpoints and written back on resume."""

    def __init__(self, strategy: GridServer, grid: Grid | None = None):
        self.st, self.grid = strategy, grid
        self.store: ClientStates | None = None  # the run directory's copy of the client states (checkpoints)
        self.run = uuid.uuid4().hex[:16]  # the fedlt run's id; a resumed run takes its checkpoint's
        self.session = 0  # how many times the run was resumed: messages of an earlier start are refused
        self.at = 0  # the round the clients' newest states reflect (a phase's: after the last round)
        self.expect: dict[int, int] = {}  # client -> the round of its last state the server knows it kept
        self.checkpointed: list[int] = []  # the rounds of the checkpoints the run directory keeps (newest last)
        self.sent = None  # the run directory's sent.jsonl (record_to); until then its rows are kept in unrecorded
        self.unrecorded: list[dict] = []
        # an evaluation riding in the next round's training messages (rides): its contents per client and fields;
        # then the replies that came back with them and the clients missing (ridden)
        self.riding: tuple[dict[int, RecordDict], dict] | None = None
        self.rode: tuple[dict[int, RecordDict], dict[int, str]] = ({}, {})

    def record(self, message: str, at: dict, replies: Iterable[RecordDict]) -> None:
        """The engine's own fields of a ``message`` exchange's replies (:mod:`.sends`) into the run's ``sent.jsonl``
        (kept until :meth:`record_to` gives it; with ``FEDLT_CHECK_SENDS=1`` an undeclared one stops the run)."""
        st, fields = self.st, []
        for rd in replies:
            ctl = dict(control(rd))
            cid = int(ctl["client-id"])
            own = not bool(ctl["partition"] if "partition" in ctl else st.info.get(cid, {}).get("partition", True))
            fields.append((cid, fields_of(message, ctl), own))
        rows = engine_record(ENGINE, SENDS, message, at, fields, st.cfg.dp, WHERE)
        if self.sent is not None:
            self.sent.write(rows)
        else:
            self.unrecorded += rows

    def record_to(self, sent) -> None:
        """The run directory's ``sent.jsonl`` (a :class:`fedlt.core.privacy.SentLog`): what was kept is written now
        (the describe replies, which come before the run directory), the rest as it arrives."""
        self.sent = sent
        sent.write(self.unrecorded)
        self.unrecorded = []

    def reachable(self, cids) -> dict[int, str]:
        self.st.connect(self.grid, wait=False)  # SuperNodes that (re)appeared since the last round
        return {cid: "no SuperNode for this client" for cid in cids if cid not in self.st.nodes}

    def state_control(self, cid: int, bound: int | None = None) -> dict:
        """What a message tells client ``cid`` about its state: the fedlt run and its start (``session``), the
        round the state must reflect (``state-round``; default: the newest), the round of the last state the
        server knows it kept (``expect``) and the rounds the server may resume from (``keep``)."""
        bound = self.at if bound is None else bound
        expect = self.expect.get(cid, 0)
        return {"fedlt-run": self.run, "session": self.session, "state-round": int(bound),
                "expect": int(expect if expect <= bound else 0), "keep": ",".join(map(str, self.checkpointed))}

    def _tag(self, kind: str, index: int) -> tuple[int, int]:
        """(the round a client's state must reflect before this exchange, the round of the states it writes)."""
        written = index if kind == TRAINING else self.st.cfg.rounds + 1 + index
        return (index - 1 if kind == TRAINING else self.st.cfg.rounds + index), written

    def messages(self, kind: str, index: int, payloads: dict[int, Message]) -> dict[int, FlwrMessage]:
        """One Flower message per client: a round's ``train`` (its round, and under ``--dp client`` the round's
        clip, ``dp-clip``, which adaptive clipping moves) or a phase's ``train.phase`` (its name and index), under
        ``--dp sample`` what the client's DP-SGD needs (``SampleWire.control``), what the ClientApp's two handlers read;
        the round's lr is in each payload's config."""
        st, dp = self.st, self.st.driver.dp
        ctl = {"round": index} if kind == TRAINING else {"phase": kind, "index": index}
        if kind == TRAINING and st.cfg.dp == "client":
            ctl["dp-clip"] = float(dp.clip)
        mtype, group = ("train", str(index)) if kind == TRAINING else ("train.phase", f"phase-{index}")
        bound, _ = self._tag(kind, index)
        riding = self.riding if kind == TRAINING else None
        msgs = {}
        for cid, p in payloads.items():
            c = {**ctl, **(dp.wire.control(cid) if st.cfg.dp == "sample" else {}), **self.state_control(cid, bound)}
            if riding is not None and cid in riding[0]:  # the previous round's evaluation goes with it
                rd = to_records(p, what="payload")
                for k, v in riding[0][cid].items():
                    rd[RIDING + k] = v
                msgs[cid] = st._message(rd, cid, TRAIN_EVALUATE, {**c, **riding[1]}, group)
            else:
                msgs[cid] = st._message(p, cid, mtype, c, group)
        return msgs

    def rides(self, method: Method, rnd: int, clients: list[int]) -> bool:
        """Whether round ``rnd``'s PM on ``clients`` goes with round rnd+1's training messages (``train.evaluate``)
        instead of an exchange of its own, which costs a SuperNode's poll and a process start: where the method's
        PM is the global model's (not ``personalized``: the evaluation reads no client state, so it is the same
        before the next training as after the round), every client evaluated trains in round rnd+1, and nothing
        else has its say on the training replies (no ``--dp``, ``--secagg`` or simulated faults)."""
        cfg = self.st.cfg
        return (cfg.dp == "off" and not cfg.secagg and self.st.driver.cfg.faults is None and not method.personalized
                and rnd < cfg.rounds and set(clients) <= set(self.st.driver.sampled(rnd + 1)))

    def ridden(self) -> tuple[dict, dict[int, str]]:
        """The riding evaluation's PM part (as :meth:`GridServer.evaluate` makes it) and its clients missing."""
        (got, why), self.rode = self.rode, ({}, {})
        return self.st._pm(got), why

    @property
    def privatises(self) -> bool:
        """Whether the clients apply the DP themselves (the ClientApp: ``--dp client`` clips,
        :func:`fedlt.core.dp.client_reply`; ``--dp sample`` trains by DP-SGD, ``SampleWire.client_reply``), so that the
        driver checks their replies instead (``ClientDP.arrived``, ``SampleDP.arrived``)."""
        return self.st.cfg.dp != "off"

    @property
    def secagg(self) -> bool:
        """Whether the training rounds run Flower's SecAgg+ (``--secagg``: :func:`.secagg.secure_round`), which the
        driver then does not simulate."""
        return bool(self.st.cfg.secagg)

    def send_and_receive(self, kind: str, index: int, payloads: dict[int, Message]):
        if kind == TRAINING and self.secagg:
            from .secagg import secure_round

            replies, why = secure_round(self, index, payloads)
            self.at = index
            return replies, why
        msgs = self.messages(kind, index, payloads)
        got, why = self.st.exchange(self.grid, msgs, self.st.round_timeout)
        rode = {c for c, m in msgs.items() if m.metadata.message_type == TRAIN_EVALUATE}
        if kind == TRAINING and self.riding is not None:
            self.rode = ({c: got[c] for c in sorted(rode) if c in got}, {c: why[c] for c in sorted(rode) if c in why})
            self.riding = None
        at = {"round": index} if kind == TRAINING else {"phase": kind}
        self.record(TRAIN_REPLY if kind == TRAINING else PHASE_REPLY, at, [got[c] for c in got if c not in rode])
        if rode:
            self.record(TRAIN_EVALUATE, at, [got[c] for c in got if c in rode])
        _, written = self._tag(kind, index)
        self.at = written
        for cid, rd in got.items():
            if bool(control(rd).get("has-state", True)):
                self.expect[cid] = written
            else:
                self.expect.pop(cid, None)
        return [(cid, from_records(got[cid])) for cid in sorted(got)], why

    def evaluate(self, method: Method, state: dict, split: str, clients: list[int] | None = None, ride: bool = False):
        return self.st.evaluate(self.grid, clients, ride)

    @property
    def client_states(self) -> dict:
        """The client states within reach (an in-process grid's nodes), by client id."""
        ctxs = self._contexts()
        states = {cid: load_client_state(ctxs[n].state, cid)[0] for cid, n in sorted(self.st.nodes.items())
                  if n in ctxs}
        return {cid: s for cid, s in states.items() if s is not None}

    def _contexts(self) -> dict:
        if getattr(self.grid, "remote", False):
            return {}
        return getattr(self.grid, "contexts", {})  # in-process nodes; a SuperLink's are out of reach

    def keep_states_in(self, directory, fresh: bool = False) -> None:
        """Checkpoints of an in-process grid's client states go to ``directory``, incrementally: a state is
        copied there when its round tag changed since the last checkpoint."""
        self.store = ClientStates(budget=0)
        self.store.attach(directory, fresh)

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the clients (it is called as one is written): the run's id, its start,
        the rounds of the clients' states the server knows of and the checkpointed rounds -- and, on an
        in-process grid, an index of the states copied into the run directory."""
        self.checkpointed = (self.checkpointed + [self.st.driver.round])[-2:]
        out = {"run": self.run, "session": self.session, "at": self.at,
               "expect": {str(c): t for c, t in sorted(self.expect.items())}, "checkpointed": list(self.checkpointed)}
        ctxs, store = self._contexts(), self.store
        if not ctxs:
            return out
        if store is None:
            return {**out, "states": self.client_states}
        for cid, n in sorted(self.st.nodes.items()):
            tag = state_tag(ctxs[n].state, cid) if n in ctxs else None
            if tag is not None and (cid not in store or store.tag_of(cid) != tag):
                store.tag = tag
                store[cid] = load_client_state(ctxs[n].state, cid)[0]
        return {**out, **store.commit()}

    def load_state_dict(self, d: dict) -> None:
        ctxs, d = self._contexts(), dict(d)
        if "run" in d:  # the fedlt run's own record (older checkpoints: the client states alone)
            self.run, self.session = str(d.pop("run")), int(d.pop("session", -1)) + 1
            self.at = int(d.pop("at", self.st.driver.round))
            self.expect = {int(c): int(t) for c, t in dict(d.pop("expect", {})).items()}
            self.checkpointed = [int(r) for r in d.pop("checkpointed", [])]
        else:
            self.at = self.st.driver.round
        if "versions" in d:  # an index of the run directory's store
            self.store.restore(d)
            states = {cid: (self.store[cid], self.store.tag_of(cid)) for cid in self.store}
        else:
            states = {int(cid): (cstate, 0) for cid, cstate in d.get("states", d).items()}
        for cid, (cstate, tag) in states.items():
            node = self.st.nodes.get(int(cid))
            if node in ctxs:
                save_client_state(ctxs[node].state, cstate, int(cid), run=self.run, tag=tag)
