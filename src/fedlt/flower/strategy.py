"""The fedlt strategy: one Flower ``Strategy`` that drives any registered method's server hooks.

:meth:`FedltStrategy.run` is the whole protocol of a fedlt run on a Flower ``Grid`` (in-process, or the
SuperLink's), mirroring ``fedlt.engine.Simulation`` step for step:

1. ``query.describe`` to every SuperNode: each says its client id, label counts and test-set size; the run
   waits until the run's ``clients`` distinct ids are there (``wait_timeout``), then writes ``config.json``
   and ``partition.json``. SuperNodes that appear later (a restart) are described at the start of a round.
2. every round: the clients of the simulation's sampling schedule (same seed, same stream) each get
   ``method.configure(state, rnd, cid)`` as a ``train`` message; the replies that come back within
   ``round_timeout`` (failed or silent clients are recorded in ``missing``) are passed, in client-id order,
   to ``method.aggregate``. Every ``eval_every`` rounds: GM on the server (balanced test set), PM on the
   clients (an ``evaluate`` message with ``method.eval_payload``), aggregated as the simulation does.
3. each post-training phase in ``method.phases``: one ``train.phase`` message to every client, then
   ``method.phase_aggregate``.
4. a final evaluation (without phases: the last round's, which it would repeat); ``metrics.jsonl`` and
   ``summary.json`` as a simulation writes them, plus the missing clients of every round.

The classic ``Strategy.start`` also works (training rounds and the per-round evaluation through
``configure_*`` / ``aggregate_*``), but only :meth:`run` does the phases and writes the run directory.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message as FlwrMessage, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from ..config import RunConfig, lr_at
from ..core.api import Message, Method
from ..data import Federation
from ..data.datasets import load_dataset
from ..data.federated import Prep
from ..engine.simulation import clients_per_round, is_eval_round, sampling_schedule
from ..errors import ConfigError, Diverged
from ..experiment import (diverged_error, format_summary, make_spec, run_dir_for, run_summary,
                          write_json, write_partition)
from ..experiments.divergence import DivergenceCheck
from ..experiments.runstate import save_final_state
from ..jsonutil import jsonable
from ..metrics import GROUPS, evaluate as evaluate_global, headline, shot_split, summarize_personal
from ..plugins import method_class
from .client_app import global_state_records, job_text
from .records import control, from_records, to_records


class FedltStrategy(Strategy):
    """Server side of a fedlt run on Flower. ``state`` is the method's server state; nothing about a
    specific method is known here."""

    def __init__(self, cfg: RunConfig, round_timeout: float = 600.0, wait_timeout: float = 300.0,
                 poll_interval: float = 0.5, echo: Callable[[str], None] = print, progress: bool = False):
        self.cfg, self.round_timeout, self.wait_timeout = cfg, float(round_timeout), float(wait_timeout)
        self.poll_interval, self.echo = float(poll_interval), echo
        ds = load_dataset(cfg.dataset, cfg.data_dir, **cfg.dataset_kw())
        self.prep = Prep(ds.mean, ds.std, ds.augment, cfg.device)
        self.fed = Federation(ds, [], np.zeros(ds.num_classes, np.int64), np.zeros((0, ds.num_classes), np.int64),
                              self.prep, {})
        self.spec = make_spec(cfg, self.fed)
        cls = method_class(cfg)
        if getattr(cls, "needs_pool", False):
            raise ConfigError(f"method {cfg.method} trains on all clients' data pooled in one place, which a "
                              f"federation of SuperNodes does not have; run it with `fedlt run`")
        self.method: Method = cls(self.spec, cls.make_params(cfg.params))
        self.job = job_text(cfg, self.spec, self.prep)
        self.state = self.method.init_server()
        K = cfg.clients
        self.schedule = sampling_schedule(K, clients_per_round(K, cfg.participation), cfg.rounds, cfg.seed)
        self.nodes: dict[int, int] = {}  # client id -> node id (the latest SuperNode that said it is that client)
        self.described: set[int] = set()  # node ids that said who they are
        self.failed_nodes: dict[int, str] = {}  # node id -> why its describe failed (it is asked again)
        self.info: dict[int, dict] = {}  # client id -> its describe reply
        self.history: list[dict] = []
        self.missing: dict[str, list[int]] = {}  # "round 3" / "phase la-fr" / "eval 5" -> client ids
        self.log: Callable[[dict], None] = lambda rec: None

    # ------------------------------------------------------------------ messaging
    def _message(self, content: RecordDict | Message, cid: int, mtype: str, ctl: dict, group: str) -> FlwrMessage:
        rd = content if isinstance(content, RecordDict) else to_records(content, what="payload")
        rd["fedlt"] = ConfigRecord({"run": self.job, "client-id": int(cid), **ctl})
        return FlwrMessage(rd, dst_node_id=self.nodes[cid], message_type=mtype, group_id=group,
                           ttl=max(self.round_timeout, 1.0) + 60.0)

    def exchange(self, grid: Grid, msgs: dict[int, FlwrMessage], timeout: float) -> tuple[dict, dict]:
        """Send one message per client and wait (at most ``timeout`` s) for the replies.
        Returns ({cid: reply RecordDict}, {cid: why it is missing})."""
        cids = list(msgs)
        ids = list(grid.push_messages([msgs[c] for c in cids]))
        pending = {mid: cid for mid, cid in zip(ids, cids) if mid}
        why = {cid: "the message could not be pushed" for mid, cid in zip(ids, cids) if not mid}
        got: dict[int, RecordDict] = {}
        end = time.monotonic() + timeout
        while pending:
            for r in grid.pull_messages(list(pending)):
                cid = pending.pop(r.metadata.reply_to_message_id, None)
                if cid is None:
                    continue
                if r.has_error():
                    last = ((r.error.reason or "").strip().splitlines() or [""])[-1]  # a traceback's last line
                    why[cid] = f"error {r.error.code}: {last}"
                else:
                    got[cid] = r.content
            if not pending or time.monotonic() >= end:
                break
            time.sleep(self.poll_interval)
        for cid in pending.values():
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
                got, why = self.exchange(grid, msgs, min(self.round_timeout, max(end - time.monotonic(), 1.0)))
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
                    self.info[cid] = {"counts": [int(c) for c in ctl["counts"]], "test_size": int(ctl["test-size"]),
                                      "num_examples": int(ctl["num-examples"])}
            if not wait or len(self.nodes) >= K:
                return
            if time.monotonic() >= end:
                have = sorted(self.nodes)
                failed = "".join(f"; SuperNode {n}: {r}" for n, r in self.failed_nodes.items() if n not in self.described)
                raise ConfigError(f"only {len(have)} of {K} clients connected within {self.wait_timeout:g} s "
                                  f"(clients {have}); start a SuperNode for each of 0..{K - 1} or raise wait-timeout"
                                  + failed)
            time.sleep(self.poll_interval)

    def _counts(self) -> None:
        K, C = self.cfg.clients, self.fed.num_classes
        counts = np.zeros((K, C), np.int64)
        for cid, inf in self.info.items():
            counts[cid] = inf["counts"]
        self.fed.counts, self.fed.train_counts = counts, counts.sum(0)

    # ------------------------------------------------------------------ Flower Strategy interface
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[FlwrMessage]:
        if not self.nodes:  # called by Strategy.start(): learn the clients first
            self.connect(grid)
            self._counts()
        payloads = self._train_payloads(server_round)
        return [self._message(p, cid, "train", {"round": server_round}, str(server_round)) for cid, p in payloads.items()]

    def _train_payloads(self, rnd: int) -> dict[int, Message]:
        return {cid: self.method.configure(self.state, rnd, cid) for cid in self.schedule[rnd - 1] if cid in self.nodes}

    def aggregate_train(self, server_round: int, replies: Iterable[FlwrMessage]):
        got = {int(control(r.content)["client-id"]): r.content for r in replies if not r.has_error()}
        if got:
            self.state = self.method.aggregate(self.state, server_round,
                                               [(cid, from_records(got[cid])) for cid in sorted(got)])
        w = self.state.get("weights") if isinstance(self.state, dict) else None
        return (ArrayRecord(dict(w)) if w else None), MetricRecord({"clients": len(got)})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[FlwrMessage]:
        c = self.cfg
        if not is_eval_round(server_round, c.eval_every, c.rounds):
            return []
        return list(self._eval_messages(list(self.nodes), with_global=not self.method.personalized).values())

    def _eval_messages(self, cids: list[int], with_global: bool) -> dict[int, FlwrMessage]:
        gsplit = shot_split(self.fed.train_counts, self.cfg.split)
        ctl = {"split": self.cfg.split, "gsplit": json.dumps({g: gsplit[g].tolist() for g in GROUPS})}
        extra = global_state_records(self.state) if with_global else RecordDict()
        msgs = {}
        for cid in cids:
            rd = to_records(self.method.eval_payload(self.state, cid), what="evaluation payload")
            for k, v in extra.items():
                rd[k] = v
            msgs[cid] = self._message(rd, cid, "evaluate", ctl, "evaluate")
        return msgs

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

    def evaluate(self, grid: Grid, tag: str) -> dict:
        """GM on the server's balanced test set, PM on the clients (as ``fedlt.metrics.evaluate``)."""
        t0 = time.perf_counter()
        ev = evaluate_global(self.method, self.state, {}, self.fed, self.cfg.split, personal=False)
        cids = sorted(self.nodes)
        got, why = self.exchange(grid, self._eval_messages(cids, not self.method.personalized), self.round_timeout)
        again = [cid for cid, rd in got.items() if str(control(rd)["source"]) == "needs-global"]
        if again:  # a personalized method without a personal model for these clients: PM with the global model
            more, why2 = self.exchange(grid, self._eval_messages(again, True), self.round_timeout)
            got.update(more)
            why.update(why2)
            for cid in why2:
                got.pop(cid, None)
        ev["personal"] = self._personal(got)
        if why:
            ev["missing"] = sorted(why)
            self._note_missing(tag, why)
        ev["eval_time"] = time.perf_counter() - t0
        return ev

    def _note_missing(self, tag: str, why: dict[int, str]) -> None:
        self.missing[tag] = sorted(why)
        for cid in sorted(why):
            self.echo(f"{tag}: client {cid} missing ({why[cid]})")

    # ------------------------------------------------------------------ the run
    def _send(self, grid: Grid, payloads: dict[int, Message], mtype: str, ctl: dict, group: str):
        """One message per client; returns (replies as fedlt Messages in client order, {cid: why missing},
        bytes sent)."""
        msgs = {cid: self._message(p, cid, mtype, ctl, group) for cid, p in payloads.items()}
        got, why = self.exchange(grid, msgs, self.round_timeout)
        replies = [(cid, from_records(got[cid])) for cid in sorted(got)]
        return replies, why, sum(p.nbytes() for p in payloads.values())

    def _traffic(self, rec: dict, tag: str, n: int, down: int, replies, why: dict[int, str]) -> dict:
        """The communication and missing-client fields of a round's or phase's record."""
        rec.update(bytes_down_per_client=down / max(n, 1),
                   bytes_up_per_client=sum(r.nbytes() for _, r in replies) / max(len(replies), 1),
                   missing=sorted(why))
        if why:
            rec["missing_why"] = {str(c): why[c] for c in sorted(why)}
            self._note_missing(tag, why)
        return rec

    def train_round(self, grid: Grid, rnd: int) -> dict:
        t0 = time.perf_counter()
        self.connect(grid, wait=False)  # SuperNodes that (re)appeared since the last round
        sched = self.schedule[rnd - 1]
        self.method.spec.lr = lr_at(self.cfg, rnd)  # server hooks may read it (SCAFFOLD); clients set their own
        replies, why, down = self._send(grid, self._train_payloads(rnd), "train", {"round": rnd}, str(rnd))
        why.update({cid: "no SuperNode for this client" for cid in sched if cid not in self.nodes})
        if replies:  # a round nobody answered leaves the state as it was
            self.state = self.method.aggregate(self.state, rnd, replies)
        losses = [r.meta["loss"] for _, r in replies if "loss" in r.meta]
        rec = {"round": rnd, "clients": sched, "train_loss": float(np.mean(losses)) if losses else None,
               "lr": self.method.spec.lr}
        self._traffic(rec, f"round {rnd}", len(sched), down, replies, why)
        rec["round_time"] = time.perf_counter() - t0
        return rec

    def run_phase(self, grid: Grid, phase: str, index: int) -> dict:
        t0 = time.perf_counter()
        self.connect(grid, wait=False)
        m = self.method
        m.spec.lr = lr_at(self.cfg, self.cfg.rounds)
        cids = sorted(self.nodes)
        payloads = {cid: m.phase_configure(phase, self.state, cid) for cid in cids}
        replies, why, down = self._send(grid, payloads, "train.phase", {"phase": phase, "index": index},
                                        f"phase-{index}")
        self.state = m.phase_aggregate(phase, self.state, replies)
        rec = self._traffic({"phase": phase}, f"phase {phase}", len(cids), down, replies, why)
        rec["time"] = time.perf_counter() - t0
        return rec

    def run(self, grid: Grid, out: Path | None = None) -> dict:
        """The whole run; writes the run directory (``cfg.out``/``cfg.name``) and returns the summary."""
        cfg = self.cfg
        out = Path(out) if out is not None else run_dir_for(cfg)
        t0 = time.perf_counter()
        self.echo(f"fedlt: waiting for {cfg.clients} SuperNodes (at most {self.wait_timeout:g} s)")
        self.connect(grid)
        self._counts()
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "config.json", {**cfg.to_dict(), "model": self.spec.model,
                                         "lt_profile_used": self.spec.data.get("lt_profile"),
                                         "method_params": vars(self.method.p), "engine": "flower", "flower": {
                                             "round_timeout": self.round_timeout, "wait_timeout": self.wait_timeout,
                                             "nodes": {str(c): n for c, n in sorted(self.nodes.items())}}})
        write_partition(out, self.fed, [self.info[c]["test_size"] for c in sorted(self.info)])
        with open(out / "metrics.jsonl", "w", buffering=1) as metrics:
            def log(rec):
                metrics.write(json.dumps(rec, default=jsonable) + "\n")

            self.log = log
            check = DivergenceCheck(cfg.method, cfg.lr, cfg.on_diverge, cfg.diverge_factor, self.echo)
            for rnd in range(1, cfg.rounds + 1):
                rec = self.train_round(grid, rnd)
                try:
                    check(self, rec)  # the simulation's check: it reads .state and .history, as a Simulation has
                except Diverged as e:
                    log({**rec, "diverged": e.reason})
                    raise diverged_error(out, cfg.method, time.perf_counter() - t0, self.history, e,
                                         check.advice(), engine="flower", missing=self.missing) from None
                if is_eval_round(rnd, cfg.eval_every, cfg.rounds):
                    rec["eval"] = self.evaluate(grid, f"eval {rnd}")
                    self.echo(f"round {rnd}: " + ", ".join(f"{k} {v:.4f}" for k, v in headline(rec["eval"]).items()
                                                         if v is not None))
                else:
                    self.echo(f"round {rnd}: train loss {rec['train_loss']}")
                self.history.append(rec)
                log(rec)
            for i, phase in enumerate(self.method.phases):
                rec = self.run_phase(grid, phase, i)
                self.echo(f"phase {phase}: {rec['time']:.1f} s")
                log(rec)
            if not self.method.phases and "eval" in self.history[-1]:
                final = self.history[-1]["eval"]  # nothing changed since: save every client a message
            else:
                final = self.evaluate(grid, "final")
            log({"final": final})
        summary = run_summary(out, cfg.method, time.perf_counter() - t0, self.history, final, engine="flower",
                              missing=self.missing)
        if check.first is not None:
            summary["diverged_continued"] = check.first  # --on-diverge continue: round and reason
        write_json(out / "summary.json", summary)
        save_final_state(out, self.state)
        self.echo(format_summary(summary))
        return summary
