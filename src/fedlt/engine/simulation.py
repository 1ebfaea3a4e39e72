"""The in-process simulation engine: drives any method's hooks over a federation, round after round.

Nothing here knows a method by name. Every random choice derives from the run seed: the client-sampling
stream is drawn up front from its own generator, and each (round, client) training call gets its own torch
generator, so a run is the same whatever order the clients are visited in (and the Flower engine, which
visits them in another order, reproduces it).
"""
from __future__ import annotations

import random
import time
from functools import partial
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..core.api import Message, Method, derive_seed
from ..core.training import autocast
from ..errors import ConfigError
from ..metrics import evaluate, headline
from .batched import Job, train_batched
from .graphs import StepGraphs

SAMPLING, TRAIN, PHASE = 10, 11, 12


def sampling_schedule(num_clients: int, per_round: int, rounds: int, seed: int) -> list[list[int]]:
    """The clients of every round, drawn up front (uniformly without replacement within a round)."""
    if not 1 <= per_round <= num_clients:
        raise ConfigError(f"clients per round must be between 1 and {num_clients}, got {per_round}")
    rng = np.random.default_rng([seed, SAMPLING])
    return [sorted(rng.choice(num_clients, size=per_round, replace=False).tolist()) for _ in range(rounds)]


def clients_per_round(num_clients: int, participation: float) -> int:
    """participation <= 1 is a fraction of the clients, > 1 a count."""
    if participation <= 0:
        raise ConfigError(f"participation must be > 0, got {participation:g}")
    n = int(round(participation)) if participation > 1 else max(1, int(round(participation * num_clients)))
    if n > num_clients:
        raise ConfigError(f"participation {participation:g} asks for {n} clients per round but there are "
                          f"{num_clients}; use at most {num_clients} or a fraction <= 1")
    return n


def is_eval_round(rnd: int, eval_every: int, rounds: int) -> bool:
    """Rounds that end with an evaluation: every ``eval_every``-th and the last (both engines)."""
    return rnd % eval_every == 0 or rnd == rounds


def client_generator(seed: int, purpose: int, rnd: int, cid: int) -> torch.Generator:
    s = derive_seed(seed, purpose, rnd, cid)
    torch.manual_seed(s)  # methods that draw from the global RNG stay reproducible too
    return torch.Generator().manual_seed(s)


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


@dataclass
class EngineConfig:
    rounds: int = 50
    participation: float = 0.5
    eval_every: int = 5
    seed: int = 0
    split: str = "fedloge"
    progress: bool = True
    client_parallel: str = "auto"  # auto | off | N: clients trained together (engine.batched)
    lr: Callable[[int], float] | None = None  # the local lr of each round (config.lr_at); None: spec.lr as given
    cuda_graphs: bool = False  # batched steps in static mode, replayed as CUDA graphs on CUDA (engine.graphs)

    @classmethod
    def of(cls, cfg, progress: bool = True) -> "EngineConfig":
        """The engine's part of a run configuration (``fedlt.config.RunConfig``)."""
        from ..config import lr_at

        return cls(cfg.rounds, cfg.participation, cfg.eval_every, cfg.seed, cfg.split, progress,
                   str(cfg.client_parallel), lr=partial(lr_at, cfg), cuda_graphs=bool(cfg.cuda_graphs))


class Simulation:
    """Holds the whole run's state (round, server state, client states) so it can be checkpointed."""

    def __init__(self, method: Method, fed, cfg: EngineConfig, log: Callable[[dict], None] | None = None):
        self.method, self.fed, self.cfg = method, fed, cfg
        self.log = log or (lambda rec: None)
        K = len(fed.clients)
        self.schedule = sampling_schedule(K, clients_per_round(K, cfg.participation), cfg.rounds, cfg.seed)
        self.round = 0
        self.state = method.init_server()
        self.client_states: dict[int, dict] = {}
        self.history: list[dict] = []
        self._fitted_chunk: int | None = None  # batched clients: the chunk size that fitted on the GPU
        self.graphs = StepGraphs(capture=torch.device(method.spec.device).type == "cuda") if cfg.cuda_graphs \
            else None  # on a CPU: the static mode's arithmetic without capture
        self.after_round: list[Callable[["Simulation"], None]] = []
        # called with each round's record after training and before its evaluation (a divergence check)
        self.after_train: list[Callable[["Simulation", dict], None]] = []

    # ---------------------------------------------------------------- checkpoint / resume
    def state_dict(self) -> dict:
        """Everything that decides the rest of the run: the round, the server state, every client's state,
        the method instance's own state (Method.state_dict), the history and the global RNG states. The
        sampling schedule and the per-(round, client) generators derive from the seed, so they need no saving.
        The dict refers to live objects: serialise it at once (fedlt.safefile.save_tree)."""
        return {"round": self.round, "state": self.state, "client_states": self.client_states,
                "history": self.history, "method": self.method.state_dict(), "rng": rng_state()}

    def load_state_dict(self, d: dict) -> None:
        """Continue from a :meth:`state_dict`; ``run()`` then goes on with round ``d["round"] + 1``."""
        if d["round"] > self.cfg.rounds:
            raise ConfigError(f"checkpoint is at round {d['round']} but the run has only {self.cfg.rounds} rounds")
        self.round, self.state = int(d["round"]), d["state"]
        self.client_states = dict(d["client_states"])
        self.history = list(d["history"])
        self.method.load_state_dict(d.get("method", {}))
        set_rng_state(d["rng"])

    def client_state(self, cid: int) -> dict:
        if cid not in self.client_states:
            self.client_states[cid] = self.method.init_client(cid, self.fed.clients[cid])
        return self.client_states[cid]

    def _exchange(self, cids, make_payload, client_call, purpose: int, rnd: int):
        replies, up, down = [], 0, 0
        spec = self.method.spec
        for cid in cids:
            payload: Message = make_payload(cid)
            gen = client_generator(self.cfg.seed, purpose, rnd, cid)
            with autocast(spec):
                reply, self.client_states[cid] = client_call(payload, self.client_state(cid), self.fed.clients[cid],
                                                             gen)
            replies.append((cid, reply))
            down += payload.nbytes()
            up += reply.nbytes()
        return replies, _traffic(replies, down, up)

    def parallel_chunk(self) -> int | None:
        """How many clients train together: 0 one after another; None all of a round's that fit (see
        :func:`client_parallel_chunk`)."""
        return client_parallel_chunk(self.cfg.client_parallel, self.method)

    def _train_batched(self, cids, rnd: int, chunk: int | None):
        """The round's clients trained together (engine.batched); the same payloads, generators and replies."""
        m, seed = self.method, self.cfg.seed
        payloads = {c: m.configure(self.state, rnd, c) for c in cids}
        jobs = [Job(m.local_steps(payloads[c], self.client_state(c), self.fed.clients[c]), self.fed.clients[c],
                    lambda c=c: client_generator(seed, TRAIN, rnd, c)) for c in cids]
        trained, fitted = train_batched(m, jobs, chunk, self._fitted_chunk, self.graphs)
        if chunk is None:
            self._fitted_chunk = fitted
        replies = []
        for c, out in zip(cids, trained):
            reply, self.client_states[c] = m.local_reply(payloads[c], self.client_state(c), self.fed.clients[c], out)
            replies.append((c, reply))
        return replies, _traffic(replies, sum(p.nbytes() for p in payloads.values()),
                                 sum(r.nbytes() for _, r in replies))

    def train_round(self) -> dict:
        rnd = self.round + 1
        cids = self.schedule[rnd - 1]
        t0 = time.perf_counter()
        m = self.method
        self._set_lr(rnd)
        chunk = self.parallel_chunk()
        if chunk == 0:
            replies, comm = self._exchange(cids, lambda c: m.configure(self.state, rnd, c), m.local_train, TRAIN, rnd)
        else:
            replies, comm = self._train_batched(cids, rnd, chunk)
        self.state = m.aggregate(self.state, rnd, replies)
        self.round = rnd
        losses = [r.meta["loss"] for _, r in replies if "loss" in r.meta]
        return {"round": rnd, "clients": cids, "train_loss": float(np.mean(losses)) if losses else None,
                "lr": m.spec.lr, "round_time": time.perf_counter() - t0, **comm}

    def _set_lr(self, rnd: int) -> None:
        """The round's learning rate into the method's spec, from which methods build their optimisers."""
        if self.cfg.lr is not None:
            self.method.spec.lr = self.cfg.lr(rnd)

    def run_phase(self, phase: str, index: int = 0) -> dict:
        m = self.method
        cids = list(range(len(self.fed.clients)))
        t0 = time.perf_counter()
        self._set_lr(self.cfg.rounds)
        replies, comm = self._exchange(cids, lambda c: m.phase_configure(phase, self.state, c),
                                       lambda p, s, d, g: m.phase_client(phase, p, s, d, g), PHASE, index)
        self.state = m.phase_aggregate(phase, self.state, replies)
        return {"phase": phase, "time": time.perf_counter() - t0, **comm}

    def evaluate(self) -> dict:
        for c in range(len(self.fed.clients)):
            self.client_state(c)
        t0 = time.perf_counter()
        ev = evaluate(self.method, self.state, self.client_states, self.fed, self.cfg.split)
        ev["eval_time"] = time.perf_counter() - t0
        return ev

    def run(self) -> dict:
        cfg = self.cfg
        bar = _progress(cfg.rounds, self.round, cfg.progress)
        last = {}
        while self.round < cfg.rounds:
            rec = self.train_round()
            for hook in self.after_train:
                hook(self, rec)
            if is_eval_round(self.round, cfg.eval_every, cfg.rounds):
                ev = self.evaluate()
                rec["eval"] = ev
                last = headline(ev)
            self.history.append(rec)
            self.log(rec)
            if bar is not None:
                bar.update(1)
                bar.set_postfix({k: f"{v:.3f}" for k, v in last.items() if v is not None} |
                                {"loss": f"{rec['train_loss'] or 0:.3f}"})
            for hook in self.after_round:
                hook(self)
        if bar is not None:
            bar.close()
        for i, phase in enumerate(self.method.phases):
            rec = self.run_phase(phase, i)
            self.log(rec)
        final = self.evaluate()
        self.log({"final": final})
        return final


def _traffic(replies, down: int, up: int) -> dict:
    n = max(len(replies), 1)
    return {"bytes_down_per_client": down / n, "bytes_up_per_client": up / n}


def client_parallel_chunk(setting, method: Method) -> int | None:
    """``--client-parallel``: "off" (0: one client after another), "auto" (all of a round's clients together,
    chunks halved if the GPU runs out of memory, on CUDA; one after another on a CPU, where vectorising gains
    nothing) or N (chunks of N clients, on any device). Methods with a loop of their own, and fp16 (its gradient
    scaler), always train one client after another."""
    if not method.describes_steps() or method.spec.precision == "fp16":
        return 0
    setting = str(setting)
    if setting == "off":
        return 0
    if setting == "auto":
        return None if torch.device(method.spec.device).type == "cuda" else 0
    return int(setting)


def _progress(total: int, done: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="rounds", unit="rnd", dynamic_ncols=True, leave=False)
