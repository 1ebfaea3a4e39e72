"""The run driver: the one round loop of every engine, over a transport that carries the messages.

What every engine shares lives here once: the client-sampling schedule, the learning rate of each round, the
round loop (train, the ``after_train`` hooks such as the divergence check, evaluation every ``eval_every``
rounds and after the last, the ``after_round`` hooks such as checkpoints), the post-training phases, the final
evaluation, the clients missing from a round, and the state a checkpoint holds (:meth:`Driver.state_dict`).
The run directory around it (config, partition, metrics, checkpoints, resume, summary) is
:func:`fedlt.runner.rundir.run_recorded`, also once for every engine.

How a round's payloads reach the clients and their replies come back is a :class:`Transport`, one engine each,
siblings in this package:

- :class:`fedlt.engine.inprocess.InProcess`: the clients in this process, one after another;
- :class:`fedlt.engine.batched.Batched`: the same, with the clients of a round trained together by the
  batched executor where the method describes its local steps;
- :class:`fedlt.engine.workers.Workers`: the clients of a round in worker processes (``--workers``);
- :class:`fedlt.engine.flower.transport.GridTransport`: Flower messages over a ``Grid`` (in-process, a simulation's
  or the SuperLink's), with clients that may fail or stay silent.

Every random choice derives from the run seed: the sampling stream is drawn up front from its own generator,
and each (round, client) training call gets its own torch generator, so a run is the same whatever order the
clients are visited in, and whichever transport carries it.
"""
from __future__ import annotations

import contextlib
import random
import time
from functools import partial
from typing import Callable, Protocol

import numpy as np
import torch

from ..config import RunConfig, clients_per_round, lr_at, worker_count
from ..core.noise import noise_generator
from ..core.method import Message, Method, derive_seed
from ..core.privacy import sends_check
from ..core.state import snapshot, tree_of, typed
from ..decl import reads_settings, settings_values
from ..errors import ConfigError
from ..seeds import Purpose
from ..metrics import headline
from .faults import Faults, RoundPlan
from .privacy import Privacy

TRAINING = "train"  # the ``kind`` of a training round's exchange; a phase's is its name


def sampling_schedule(num_clients: int, per_round: int, rounds: int, seed: int) -> list[list[int]]:
    """The clients of every round, drawn up front (uniformly without replacement within a round)."""
    if not 1 <= per_round <= num_clients:
        raise ConfigError(f"clients per round must be between 1 and {num_clients}, got {per_round}")
    rng = np.random.default_rng([seed, Purpose.SAMPLING])
    return [sorted(rng.choice(num_clients, size=per_round, replace=False).tolist()) for _ in range(rounds)]


def poisson_schedule(num_clients: int, rate: float, rounds: int, seed: int) -> list[list[int]]:
    """The clients of every round, each one in with probability ``rate`` independently (Poisson sampling: a
    round may have more or fewer clients than ``rate x num_clients``, or none)."""
    rng = np.random.default_rng([seed, Purpose.SAMPLING, 1])
    return [np.flatnonzero(rng.random(num_clients) < rate).tolist() for _ in range(rounds)]


def eval_sample(num_clients: int, eval_clients: float, seed: int) -> list[int]:
    """The clients PM is measured on, the same in every evaluation of a run (and in every run with the seed):
    all of them for ``eval_clients`` 1, else a seeded sample of a fraction (<= 1) or count (> 1) of them."""
    n = clients_per_round(num_clients, eval_clients, "eval-clients")
    if n == num_clients:
        return list(range(num_clients))
    return sorted(np.random.default_rng([seed, Purpose.EVAL_SAMPLE]).choice(num_clients, size=n, replace=False).tolist())


def is_eval_round(rnd: int, eval_every: int, rounds: int) -> bool:
    """Rounds that end with an evaluation: every ``eval_every``-th and the last."""
    return rnd % eval_every == 0 or rnd == rounds


def client_generator(seed: int, purpose: Purpose, rnd: int, cid: int) -> torch.Generator:
    """A client's generator of one exchange, (seed, purpose: TRAIN or PHASE, round or phase index, client); the
    global RNG seeded alike."""
    s = derive_seed(seed, purpose, rnd, cid)
    seed_global(s)  # methods that draw from the global RNG stay reproducible too
    return torch.Generator().manual_seed(s)


_ACCELERATORS = (torch.cuda, torch.xpu, torch.mtia)


def seed_global(seed: int) -> None:
    """``torch.manual_seed(seed)``: the CPU generator and every started accelerator's. torch's own call also
    queues the seed, with a formatted traceback, for each accelerator that is not running (CUDA, XPU, MTIA even
    where none exists): 0.4 - 1.4 ms a call, 10 - 30 % of a 20-client FedAvg round on a CPU and most of a
    post-training phase over 10,000 clients; here 1 us. Where an accelerator is present but not yet started (or
    MPS, or a custom device), torch's call, so that device starts with this seed as it would have."""
    if torch.backends.mps.is_available() or torch._C._get_privateuse1_backend_name() != "privateuseone" or \
            any(dev.is_available() and not dev.is_initialized() for dev in _ACCELERATORS):
        torch.manual_seed(seed)
        return
    for dev in _ACCELERATORS:
        if dev.is_initialized():
            dev.manual_seed_all(seed)
    torch.default_generator.manual_seed(seed)


def rng_state() -> dict:
    """The global RNG states (torch CPU and CUDA, numpy, python), for checkpoints."""
    out = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(d: dict) -> None:
    torch.set_rng_state(d["torch"])
    np.random.set_state(d["numpy"])
    random.setstate(d["python"])
    if "cuda" in d and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(d["cuda"])


@reads_settings(RunConfig, "engine")
class EngineConfig:
    """The engine's part of a run: every setting whose declaration says the engine reads it (``reads=("engine",)``
    in ``fedlt.config.RunConfig``: rounds, participation, seed, client_parallel, cuda_graphs, client_state_memory,
    eval_every, eval_clients, split -- with their declared defaults), then what the run derives for the engine."""

    progress: bool = True
    lr_of_round: Callable[[int], float] | None = None  # each round's local lr (config.lr_at); None: spec.lr, constant
    faults: Faults | None = None  # clients away, dropping out, straggling (engine.faults); None: every one answers
    worker_processes: int = 0  # --workers, resolved (config.worker_count): 0 trains the clients in this process
    deployed: bool = False  # the clients are SuperNodes of a deployment (--dp-noise-seed's default: core.noise)

    @classmethod
    def of(cls, cfg, progress: bool = True, deployed: bool = False) -> "EngineConfig":
        """The engine's part of a run configuration (``fedlt.config.RunConfig``)."""
        return cls(**settings_values(cfg, "engine"), progress=progress, lr_of_round=partial(lr_at, cfg),
                   faults=faults if (faults := Faults.of(cfg)).active else None, worker_processes=worker_count(cfg),
                   deployed=deployed)


Replies = list[tuple[int, Message]]  # (client id, reply), in client-id order


class Transport(Protocol):
    """Carries one exchange of a run to the clients and back."""

    # what its clients do themselves (engine.privacy): apply the DP to their replies (Flower's ClientApp clips,
    # its SuperNodes train by DP-SGD), so the driver checks them instead; run SecAgg+ (Flower's rounds)
    privatises: bool
    secagg: bool

    def reachable(self, cids: list[int]) -> dict[int, str]:
        """Before a round: the clients among ``cids`` that cannot be reached, with why (none in process)."""

    def send_and_receive(self, kind: str, index: int, payloads: dict[int, Message]) -> tuple[Replies, dict[int, str]]:
        """``kind`` "train" (``index`` the round) or a phase's name (``index`` its number): each client runs
        the method's client hook on its payload, with the (purpose, index, client) generator. Returns the
        replies in client order and {client id: why its reply is missing}."""

    def evaluate(self, method: Method, state: dict, split: str, clients: list[int]) -> tuple[dict, dict[int, str]]:
        """GM on the balanced test set and PM on the own test sets of ``clients`` (the run's evaluation
        sample); and the clients missing."""

    # Optional (a transport whose exchanges cost a message each, Flower's): ``rides(method, rnd, clients)`` says
    # whether round ``rnd``'s PM on ``clients`` can go with round rnd+1's training messages; then
    # ``evaluate(..., ride=True)`` returns GM alone and keeps PM's payloads for the next training exchange, after
    # which ``ridden()`` returns ({"personal": ..., "untested": ...}, the clients missing). Driver.run records the
    # round once that part has come back.

    def keep_states_in(self, directory, fresh: bool = False) -> None:
        """The run directory's folder for the client states this transport keeps (spills, checkpoints);
        ``fresh``: a run that starts from round 0 (what an earlier run left there is removed)."""

    def state_dict(self) -> dict:
        """The client states this transport can see (checkpoints: an index of the stored states where they are
        kept in the run directory); {} where they stay on the clients."""

    def load_state_dict(self, d: dict) -> None: ...


class Driver:
    """Holds the whole run's state (round, server state, history) so that it can be checkpointed, and runs the
    rounds over ``transport``."""

    def __init__(self, method: Method, cfg: EngineConfig, transport: Transport, num_clients: int,
                 log: Callable[[dict], None] | None = None):
        self.method, self.cfg, self.transport = method, cfg, transport
        self.log = log or (lambda rec: None)
        self.num_clients = num_clients
        per_round = clients_per_round(num_clients, cfg.participation)
        # --dp, --secagg (engine.privacy): the mechanisms around every exchange, built from the settings
        self.privacy = Privacy(cfg, method, num_clients, per_round, transport)
        # Poisson sampling where the mechanism's accountant assumes it (--dp client: each client in with probability
        # per_round / num_clients); else exactly per_round clients, uniformly without replacement
        self.schedule = poisson_schedule(num_clients, per_round / num_clients, cfg.rounds, cfg.seed) \
            if self.privacy.poisson else sampling_schedule(num_clients, per_round, cfg.rounds, cfg.seed)
        # every client's number of training samples where an engine knows them without the counts (Flower under
        # --dp: its SuperNodes describe their sizes only); None: the counts' row sums (:meth:`sizes`)
        self.client_sizes: Callable[[], np.ndarray] | None = None
        self.privacy.scheduled(self.schedule, self.sizes)
        self.stopped: str | None = None  # why training stopped before its last round (--dp-budget)
        self.eval_clients = eval_sample(num_clients, cfg.eval_clients, cfg.seed)
        self.round = 0
        self.state = typed(method, method.init_server())
        self.history: list[dict] = []
        self.missing: dict[str, list[int]] = {}  # "round 3" / "phase la-fr" / "eval 5" -> client ids
        self.echo: Callable[[str], None] = lambda line: None  # what a missing client prints
        self.said: set[str] = set()  # notes printed once per run (why PM is absent)
        # the post-training phases run: (name, the server state their payloads were made from), and the clients
        # they reached; a client evaluated later that they did not reach is brought through them then
        self.phases_run: list[tuple[str, dict]] = []
        self.phased: set[int] = set()
        # the federation's [K, C] training counts, for availability profiles and simulated times (engine.faults);
        # read when a round first needs them (a Flower run learns them from its SuperNodes)
        self.client_counts: Callable[[], np.ndarray] | None = None
        self.plans: dict[int, RoundPlan] = {}  # each round's, drawn from the seed when first needed
        self.after_round: list[Callable[["Driver"], None]] = []
        # the context in which a finished round is recorded (metrics.jsonl) and its after_round hooks run: the
        # run directory's code makes it preempt.deferred, so that a signal cannot fall between a round's record
        # and its checkpoint (the round is then both logged and saved, or neither)
        self.round_end: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        # called with each round's record after training and before its evaluation (a divergence check)
        self.after_train: list[Callable[["Driver", dict], None]] = []
        # called with (kind, index, replies) as every exchange's replies arrive, rounds and phases alike (what left
        # the clients: core.privacy checks it against the method's declaration, the run directory records it)
        self.on_replies: list[Callable[[str, int, Replies], None]] = [sends_check(method)]
        # a round whose PM rides in the next round's training messages (Transport.rides): its record (GM done),
        # the evaluation's tag and clients and the seconds it took so far; recorded once the next round's replies
        # complete it (a checkpoint keeps it, and a resumed run sends its PM with that round again)
        self.pending: dict | None = None
        self.recorded: list[dict] = []  # the records this round's iteration added to the history (after_round reads)

    @property
    def dp(self):
        """The run's DP mechanism (``fedlt.core.privacy.PrivacyMechanism``), or None (engine.privacy)."""
        return self.privacy.dp

    @property
    def secagg(self):
        """The run's ``--secagg`` (``fedlt.core.secagg.SecAgg``), or None (engine.privacy)."""
        return self.privacy.secagg

    def close(self) -> None:
        """The run is over (finished or stopped): the transport lets go of what it holds (worker processes)."""
        close = getattr(self.transport, "close", None)
        if close is not None:
            close()

    # ---------------------------------------------------------------- checkpoint / resume
    def state_dict(self) -> dict:
        """Everything that decides the rest of the run: the round, the server state, every client's state the
        transport holds, the method instance's own state (Method.state_dict), the history, the missing
        clients and the global RNG states. The sampling schedule and the per-(round, client) generators
        derive from the seed, so they need no saving. The dict refers to live objects: serialise it at once
        (fedlt.safefile.save_tree)."""
        return {"round": self.round, "state": tree_of(self.state), "client_states": self.transport.state_dict(),
                "history": self.history, "missing": self.missing, "method": self.method.state_dict(),
                "rng": rng_state(), **self.privacy.state_dict(),
                **({} if self.pending is None else {"pending": self.pending})}

    def load_state_dict(self, d: dict) -> None:
        """Continue from a :meth:`state_dict`; ``run()`` then goes on with round ``d["round"] + 1``."""
        if d["round"] > self.cfg.rounds:
            raise ConfigError(f"checkpoint is at round {d['round']} but the run has only {self.cfg.rounds} rounds")
        self.round, self.state = int(d["round"]), self.method.server_state(d["state"])
        self.transport.load_state_dict(dict(d["client_states"]))
        self.history = list(d["history"])
        self.missing = {k: list(v) for k, v in d.get("missing", {}).items()}
        self.method.load_state_dict(d.get("method", {}))
        self.pending = d.get("pending")
        if self.pending is not None:  # its PM goes with the next round's training messages, as it would have
            self.transport.evaluate(self.method, self.state, self.cfg.split, self.pending["clients"], ride=True)
        self.privacy.load_state_dict(d)
        set_rng_state(d["rng"])

    # ---------------------------------------------------------------- one exchange
    def round_config(self, kind: str, index: int) -> dict:
        """The per-round values every payload of an exchange carries (``Message.config``; the one place they are
        set): ``lr``, the round's local learning rate (a phase's: the last round's). The method's spec is never
        changed: its ``lr`` stays the run's."""
        rnd = index if kind == TRAINING else self.cfg.rounds
        return {"lr": self.method.spec.lr if self.cfg.lr_of_round is None else self.cfg.lr_of_round(rnd)}

    def payloads(self, kind: str, index: int, cids, make_payload) -> dict[int, Message]:
        """``make_payload(cid)`` (the method's configure hook) for each client, with the exchange's
        :meth:`round_config`."""
        values = self.round_config(kind, index)
        return {c: make_payload(c).with_config(values) for c in cids}

    def exchange(self, kind: str, index: int, tag: str, cids: list[int], make_payload,
                 plan: RoundPlan | None = None) -> tuple[Replies, dict]:
        """Payloads to the reachable clients of ``cids``, the replies back; the record's traffic and missing
        fields. A training round's ``plan`` (engine.faults) decides which of the replies arrive; the others are
        missing like those of a client that failed."""
        why = self.transport.reachable(cids) if cids else {}
        payloads = self.payloads(kind, index, [c for c in cids if c not in why], make_payload)
        # each reply as its client sends it (engine.privacy: under DP clipped where the reply is made)
        carrier = self.privacy.carrier(self.transport)
        replies, lost = carrier.send_and_receive(kind, index, payloads) if payloads else ([], {})
        why.update(lost)
        for hook in self.on_replies:  # what left the clients
            hook(kind, index, replies)
        # where the clients applied the DP themselves (Flower's): checked, what they add for the server kept
        replies, refused = self.privacy.arrived(kind, payloads, replies)
        why.update(refused)
        extra = {}
        if kind == TRAINING:
            extra = {"sampled": len(cids), "trained": len(replies)}
            if plan is not None:
                kept, late, sim_time = self.cfg.faults.arrivals(plan, [c for c, _ in replies])
                replies = [(c, r) for c, r in replies if c not in late]
                why.update(late)
                if plan.online is not None:
                    extra["online"] = plan.online
                if sim_time is not None:
                    extra["sim_time"] = sim_time
            # what SecAgg+ hands the server, where the transport does not run it (engine.privacy)
            replies, halted = self.privacy.unmasked(payloads, replies, self.sizes,
                                                    lambda c: derive_seed(self.cfg.seed, Purpose.SECAGG, index, c))
            why.update(halted)
            extra["arrived"] = len(replies)
        rec = {**extra, "bytes_down_per_client": sum(p.nbytes() for p in payloads.values()) / max(len(cids), 1),
               "bytes_up_per_client": sum(r.nbytes() for _, r in replies) / max(len(replies), 1),
               "missing": sorted(why)}
        if why:
            rec["missing_why"] = {str(c): why[c] for c in sorted(why)}
            self.note_missing(tag, why)
        return replies, rec

    def note_missing(self, tag: str, why: dict[int, str]) -> None:
        self.missing[tag] = sorted(why)
        by_reason: dict[str, list[int]] = {}
        for cid in sorted(why):
            by_reason.setdefault(why[cid], []).append(cid)
        for reason, cids in by_reason.items():
            who = f"client {cids[0]}" if len(cids) == 1 else f"clients {', '.join(map(str, cids))}"
            self.echo(f"{tag}: {who} missing ({reason})")

    def plan(self, rnd: int) -> RoundPlan | None:
        """Round ``rnd``'s clients and who of them is heard (engine.faults); None when every sampled client
        answers (the sampling schedule's clients)."""
        faults = self.cfg.faults
        if faults is None:
            return None
        if rnd not in self.plans:
            per_round = clients_per_round(self.num_clients, self.cfg.participation)
            self.plans[rnd] = faults.plan(rnd, self.schedule[rnd - 1], per_round, self.cfg.seed, self.counts)
        return self.plans[rnd]

    def counts(self) -> np.ndarray:
        if self.client_counts is None:
            raise ConfigError("this engine does not give the clients' counts that --availability size/tail and "
                              "the straggler settings need")
        return np.asarray(self.client_counts())

    def sizes(self) -> np.ndarray:
        """Every client's number of training samples (``client_sizes``, else the counts' row sums)."""
        return np.asarray(self.client_sizes()) if self.client_sizes is not None else self.counts().sum(1)

    def sampled(self, rnd: int) -> list[int]:
        """The clients sent round ``rnd``'s payload."""
        plan = self.plan(rnd)
        return self.schedule[rnd - 1] if plan is None else plan.sampled

    # ---------------------------------------------------------------- the run
    def train_round(self) -> dict:
        rnd = self.round + 1
        plan = self.plan(rnd)
        cids = self.sampled(rnd)
        t0 = time.perf_counter()
        m = self.method
        replies, comm = self.exchange(TRAINING, rnd, f"round {rnd}", cids, lambda c: m.configure(self.state, rnd, c),
                                      plan)
        # the server's noise on the clipped updates' sum (engine.privacy, core.dp), before the method's mean
        replies = self.privacy.before_aggregate(replies, lambda key: noise_generator(key, self.cfg.seed, Purpose.DP_NOISE,
                                                                                     rnd, 0))
        if replies:
            self.state = m.aggregate(self.state, rnd, replies)
        else:  # a round nobody answered leaves the state as it was
            note = "a round without replies leaves the server state as it was (no update)"
            if note not in self.said:  # once per run
                self.said.add(note)
                self.echo(f"note: round {rnd}: {note}")
        self.round = rnd
        losses = [r.meta["loss"] for _, r in replies if "loss" in r.meta]
        dp = self.privacy.record(rnd)
        return {"round": rnd, "clients": cids, "train_loss": float(np.mean(losses)) if losses else None,
                "lr": self.round_config(TRAINING, rnd)["lr"], **comm, **dp, "round_time": time.perf_counter() - t0}

    def phase_clients(self) -> list[int]:
        """The clients a post-training phase reaches: the ones that trained and the evaluation sample -- every
        client when every client is evaluated (what a phase always reached), a few hundred of a population of
        100,000 otherwise. A phase is part of training (CCVR's, RUCR's and SphereFed's statistics, FedLoGe's
        GA-FR) or a client personalising its model for its own use (LA-FR, FedBABU's and FedDr+'s fine-tuning,
        FedETF's personalisation); at cross-device scale the first is done by the clients that took part in
        the run, and the second matters where a personal model is used: here, where it is evaluated. A client
        outside both that is evaluated later is personalised then (:meth:`catch_up`)."""
        if len(self.eval_clients) == self.num_clients:
            return list(range(self.num_clients))
        return sorted(set(self.eval_clients).union(*(self.sampled(r) for r in range(1, self.round + 1))))

    def run_phase(self, phase: str, index: int = 0) -> dict:
        m = self.method
        t0 = time.perf_counter()
        cids = self.phase_clients()
        before = snapshot(self.state)  # phase_aggregate may add to the state it is given
        replies, comm = self.exchange(phase, index, f"phase {phase}", cids,
                                      lambda c: m.phase_configure(phase, self.state, c))
        self.state = m.phase_aggregate(phase, self.state, replies)
        self.phases_run.append((phase, before))
        self.phased.update(cids)
        return {"phase": phase, "phase_clients": len(cids), **comm, "time": time.perf_counter() - t0}

    def catch_up(self, cids: list[int]) -> None:
        """Bring the clients of ``cids`` that the post-training phases did not reach through them now: each
        phase's payload made from the server state that phase started from, with the (phase, client)
        generator, so the client's state ends as it would have had the phase reached it (its reply changes
        nothing: the phase has aggregated)."""
        late = [c for c in cids if c not in self.phased]
        if not late or not self.phases_run:
            return
        m = self.method
        for index, (phase, state) in enumerate(self.phases_run):
            self.exchange(phase, index, f"phase {phase}", late, lambda c: m.phase_configure(phase, state, c))
        self.phased.update(late)

    def evaluate(self, tag: str = "final", clients: list[int] | None = None, ride: bool = False) -> dict:
        """GM, and PM over the evaluation sample (or ``clients``: any clients, brought through the
        post-training phases first where those did not reach them). ``ride``: PM goes with the next round's
        training messages (:meth:`Transport.rides`): GM alone now, :meth:`pending` keeps the rest."""
        t0 = time.perf_counter()
        clients = self.eval_clients if clients is None else sorted(clients)
        self.catch_up(clients)
        if ride:
            ev, _ = self.transport.evaluate(self.method, self.state, self.cfg.split, clients, ride=True)
            self.pending = {"tag": tag, "clients": clients, "time": time.perf_counter() - t0}
            return ev
        ev, why = self.transport.evaluate(self.method, self.state, self.cfg.split, clients)
        return self.evaluated(tag, clients, ev, why, time.perf_counter() - t0)

    def evaluated(self, tag: str, clients: list[int], ev: dict, why: dict[int, str], seconds: float) -> dict:
        """An evaluation's record completed: the clients missing, the sample's size, the notes, its time."""
        if why:
            ev["missing"] = sorted(why)
            self.note_missing(tag, why)
        ev["eval_clients"] = {"sampled": len(clients), "of": self.num_clients}
        self.say_collapsed(tag, ev)
        note = pm_note(ev, len(clients), self.num_clients, len(why))
        if note:
            ev["pm_note"] = note
            if note not in self.said:  # once per run
                self.said.add(note)
                self.echo(f"note: {note}")
        ev["eval_time"] = seconds
        return ev

    def ridden(self) -> dict | None:
        """The pending round's record (:attr:`pending`), completed by the PM that came back with this round's
        training replies; None when no round was pending."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        t0 = time.perf_counter()
        rec = pending["record"]
        part, why = self.transport.ridden()
        rec["eval"].update(part)
        self.evaluated(pending["tag"], pending["clients"], rec["eval"], why,
                       pending["time"] + time.perf_counter() - t0)
        return rec

    def say_collapsed(self, tag: str, ev: dict) -> None:
        """One line, once per run, when a global model predicts one class for every balanced test sample: a run
        that has collapsed (diverged without a non-finite loss) says so, whatever the method; likewise when some
        clients' personal models output non-finite values (their local training diverged: the run's divergence
        check sees the server's state only)."""
        for mode, agg in ev.get("personal", {}).items():
            if agg.get("nonfinite") and "nonfinite" not in self.said:
                self.said.add("nonfinite")
                self.echo(f"warning: {tag} of {self.method.name}: the personal models (PM {mode}) of "
                          f"{agg['nonfinite']} of {len(agg['per_client'])} clients output non-finite values: their "
                          f"local training diverged, and PM counts their arbitrary predictions")
        for mode, rep in ev.get("global", {}).items():
            if "collapsed" in rep and "collapsed" not in self.said:
                self.said.add("collapsed")
                lr = self.cfg.lr_of_round(self.round) if self.cfg.lr_of_round is not None else None
                self.echo(f"warning: {tag} of {self.method.name}: the global model ({mode}) predicts class "
                          f"{rep['collapsed']} for every test sample: training has collapsed to one class"
                          + (f" (a smaller --lr than {lr:g} may avoid it; the method's page names its own "
                             f"stability settings)" if lr else ""))

    def run(self) -> dict:
        cfg = self.cfg
        bar = _progress(cfg.rounds, self.round, cfg.progress)
        last = {}
        try:
            while self.round < cfg.rounds:
                if (why := self.privacy.over_budget(self.round + 1)) is not None:
                    self.stopped = why  # --dp-budget: the run ends here, cleanly (phases, final evaluation)
                    self.echo(why)
                    break
                rec = self.train_round()
                done = self.ridden()  # the previous round, whose PM came back with this round's replies
                self.recorded = []
                if done is not None:
                    last = headline(done["eval"])
                    with self.round_end():
                        self.history.append(done)
                        self.log(done)
                        self.recorded.append(done)
                for hook in self.after_train:
                    hook(self, rec)
                rides = getattr(self.transport, "rides", None)
                if is_eval_round(self.round, cfg.eval_every, cfg.rounds):
                    ride = rides is not None and rides(self.method, self.round, self.eval_clients)
                    rec["eval"] = self.evaluate(f"eval {self.round}", ride=ride)
                    if ride:
                        self.pending["record"] = rec
                    else:
                        last = headline(rec["eval"])
                with self.round_end():
                    if self.pending is None:
                        self.history.append(rec)
                        self.log(rec)
                        self.recorded.append(rec)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix({k: f"{v:.3f}" for k, v in last.items() if v is not None} |
                                        {"loss": f"{rec['train_loss'] or 0:.3f}"})
                    for hook in self.after_round:
                        hook(self)
        finally:  # also when the run stops (diverged, a signal): the bar's line is cleared for what is said next
            if bar is not None:
                bar.close()
        for i, phase in enumerate(self.method.phases):
            self.log(self.run_phase(phase, i))
        if not self.method.phases and self.history and "eval" in self.history[-1]:
            final = self.history[-1]["eval"]  # nothing changed since: no second evaluation (no client messages)
        else:
            final = self.evaluate("final")
        self.log({"final": final})
        return final


def pm_note(ev: dict, sampled: int, population: int, missing: int) -> str | None:
    """Why PM is absent, or taken over fewer clients than the evaluation sample (None: over all of them)."""
    untested = int(ev.get("untested", 0))
    of = f"the {sampled:,} evaluated clients" if sampled == population else \
        f"the {sampled:,} evaluated clients (a sample of {population:,}; --eval-clients)"
    why = []
    if untested:
        why.append(f"{untested:,} have no test sample (their share of the balanced test set rounds to zero; "
                   f"--client-test-fraction F gives every client a test set from its own data)")
    if missing:
        why.append(f"{missing:,} did not answer")
    if not ev.get("personal"):
        return f"no PM: none of {of} could be evaluated: " + "; ".join(why or ["no reply came back"])
    return f"PM over {sampled - untested - missing:,} of {of}: " + "; ".join(why) if why else None


def _progress(total: int, done: int, enabled: bool):
    """The rounds' progress bar: on a terminal (or a notebook's widget) every update; where stderr is a pipe or a
    file, whose log would hold every update one after another, at most one a minute."""
    if not enabled:
        return None
    import sys

    from tqdm import std
    from tqdm.auto import tqdm

    try:
        terminal = bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        terminal = False
    kw = dict(total=total, initial=done, desc="rounds", unit="rnd", dynamic_ncols=True, leave=False)
    if terminal or any(c.__name__ == "tqdm_notebook" for c in tqdm.__mro__):  # a notebook draws a widget
        return tqdm(**kw)

    class Rare(std.tqdm):  # its postfix shown with the next rare update, not drawn on each round's
        def set_postfix(self, ordered_dict=None, refresh=True, **more):
            super().set_postfix(ordered_dict, refresh=False, **more)

    return Rare(mininterval=60.0, maxinterval=600.0, **kw)
