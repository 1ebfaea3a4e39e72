"""The run's privacy mechanisms around the driver's exchanges: ``--dp client`` (:class:`fedlt.core.dp.ClientDP`),
``--dp sample`` (:class:`fedlt.core.dpsgd.SampleDP`), ``--secagg`` (:class:`fedlt.core.secagg.SecAgg`), built once
from the engine's settings, so that the driver itself has no branch on any of them.

Where each acts in an exchange (:meth:`fedlt.engine.driver.Driver.exchange`):

1. where the reply is made: a transport whose clients do not apply the DP themselves is wrapped
   (:meth:`Privacy.carrier`, :class:`Clipped`): its replies come back as their clients would send them under DP
   (``client_side``: clipped, their meta cut). A transport declares what its clients do themselves
   (:attr:`fedlt.engine.driver.Transport.privatises`: Flower's ClientApp clips, its SuperNodes train by DP-SGD;
   :attr:`~fedlt.engine.driver.Transport.secagg`: Flower's rounds run SecAgg+);
2. where they arrive: the replies of clients that applied it themselves are checked (:meth:`Privacy.arrived`);
3. after the round's faults, what SecAgg+ hands the server, simulated where the transport does not run it
   (:meth:`Privacy.unmasked`);
4. before the method aggregates: the server's noise (:meth:`Privacy.before_aggregate`, DP-FedAvg's noised mean,
   ``fedlt.core.dp.noised_replies``).

The accountant's epsilon, the round's record, the checkpoint's state and the budget's stop go through it too.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..core.dp import ClientDP
from ..core.dpsgd import SampleDP
from ..core.privacy import PrivacyMechanism
from ..core.secagg import SecAgg, largest_client

TRAINING = "train"  # the ``kind`` of a training round's exchange (fedlt.engine.driver.TRAINING)


class Clipped:
    """A transport whose replies come back as their clients send them under DP (``mechanism.client_side`` for a
    training round, ``phase_side`` for a phase): the clipping where the reply is made, for clients that do not
    clip themselves (the in-process engines). Everything else is the transport's."""

    def __init__(self, transport, mechanism: PrivacyMechanism):
        self.inner, self.mechanism = transport, mechanism

    def send_and_receive(self, kind: str, index: int, payloads: dict):
        replies, lost = self.inner.send_and_receive(kind, index, payloads)
        m = self.mechanism
        return (m.client_side(payloads, replies) if kind == TRAINING else m.phase_side(kind, replies)), lost

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Privacy:
    """The run's mechanisms (each None where off): ``dp`` (a :class:`PrivacyMechanism`) and ``secagg``."""

    def __init__(self, cfg, method, num_clients: int, per_round: int, transport):
        # --dp client (core.dp): every client sampled with probability per_round / num_clients, as its accountant
        # assumes (:attr:`poisson`); --dp sample's mechanism needs the schedule (:meth:`scheduled`)
        self.cfg, self.method = cfg, method
        self.dp: PrivacyMechanism | None = ClientDP.of(cfg, method, num_clients, per_round) \
            if cfg.dp == "client" else None
        self.poisson = self.dp is not None
        # --secagg (core.secagg): the server receives a training round's replies as SecAgg+ unmasks them
        self.secagg = SecAgg.of(cfg) if cfg.secagg else None
        self.clients_apply = bool(transport.privatises)  # the clients apply the DP themselves (Flower's)
        self.transport_masks = bool(transport.secagg)  # the transport runs SecAgg+ itself (Flower's)

    def scheduled(self, schedule: list[list[int]], sizes: Callable) -> None:
        """Once the sampling schedule is drawn: ``--dp sample``'s mechanism, an accountant each (``sizes``: every
        client's number of samples), and its DP-SGD the step runner of the clients that train in this process (the
        method's ``step_runner``; a Flower SuperNode selects its own)."""
        if self.cfg.dp == "sample":
            self.dp = SampleDP.of(self.cfg, self.method, schedule, sizes)
            self.method.step_runner = self.dp.trainer

    def carrier(self, transport):
        """``transport`` as the driver's exchange uses it: wrapped where its clients do not apply the DP
        themselves (:class:`Clipped`)."""
        return Clipped(transport, self.dp) if self.dp is not None and not self.clients_apply else transport

    def arrived(self, kind: str, payloads: dict, replies: list) -> tuple[list, dict[int, str]]:
        """The replies of clients that applied the DP themselves, checked (``mechanism.arrived``); others as they
        are."""
        if self.dp is None or not self.clients_apply:
            return replies, {}
        return self.dp.arrived(payloads, replies, None if kind == TRAINING else kind)

    def unmasked(self, payloads: dict, replies: list, sizes: Callable, seed_of: Callable[[int], int]):
        """A training round's replies as SecAgg+ hands them to the server, where the transport does not run it
        (``SecAgg.simulate``; ``sizes()``: the clients' numbers of samples, read only then), and the clients whose
        replies it could not aggregate."""
        if self.secagg is None or self.transport_masks:
            return replies, {}
        return self.secagg.simulate(payloads, replies, largest_client(sizes(), payloads), seed_of)

    def before_aggregate(self, replies: list, gen_of: Callable[[str | None], torch.Generator]) -> list:
        """The round's replies as the method's aggregate receives them: with the server's noise (``gen_of(key)``:
        the round's noise generator for the mechanism's key)."""
        if self.dp is None or not replies:
            return replies
        return self.dp.server_side(replies, gen_of(self.dp.key))

    def over_budget(self, rnd: int) -> str | None:
        return None if self.dp is None else self.dp.over_budget(rnd)

    def record(self, rnd: int) -> dict:
        """The round's privacy fields of metrics.jsonl (none without DP)."""
        return {} if self.dp is None else {"dp_epsilon": self.dp.epsilon(rnd), **self.dp.record()}

    def state_dict(self) -> dict:
        return {} if self.dp is None else {"dp": self.dp.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        if self.dp is not None:
            self.dp.load_state_dict(d.get("dp", {}))
