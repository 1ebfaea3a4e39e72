"""``--dp sample`` on Flower (:mod:`fedlt.core.dpsgd`): each SuperNode trains its own client by DP-SGD and sends,
beside its model and ``num_examples``, its accountant's new entries (:data:`HISTORY`: ``(z_i, q_i, steps)``, which
follow from ``n_i`` and the run's settings); the server checks them against the client's size and the run's
settings and keeps every client's accountant from them (:class:`fedlt.core.dpsgd_accounts.SampleAccounts`). What a
message tells the SuperNode (``dp-delta``, ``dp-rounds``, ``dp-noise``, ``dp-counted``) and what its reply keeps
are here, in one place.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .dpsgd_accounts import SampleAccounts, batches_per_epoch

HISTORY = "dp_history"  # a client's accountant entries [(z, q, steps)] of one message, sent beside num_examples


def phase_replies(phase: str, replies: list) -> list:
    """A post-training phase's replies as their clients send them under DP-SGD: ``num_examples`` only (what such a
    phase may send is its size and statistics, :func:`fedlt.core.dp.unprotected`)."""
    from .method import Message

    for cid, reply in replies:
        if reply.arrays:
            raise ConfigError(f"--dp sample: client {cid} sends {', '.join(sorted(reply.arrays)[:3])} in phase "
                              f"{phase}, which DP-SGD did not train; this method cannot run under --dp sample")
    return [(cid, Message({}, {k: r.meta[k] for k in ("num_examples",) if k in r.meta})) for cid, r in replies]


def entries_of(cid: int, meta: dict) -> list | str:
    """The accountant entries a client's reply carries (:data:`HISTORY`), or why they are not usable."""
    raw = meta.get(HISTORY)
    if not isinstance(raw, list) or not all(isinstance(e, (list, tuple)) and len(e) == 3 for e in raw):
        return (f"client {cid} sent no DP-SGD accountant entries ({HISTORY}): its SuperNode trained without "
                f"DP-SGD or runs another fedlt")
    entries = [(float(z), float(q), int(n)) for z, q, n in raw]
    if any(not (z >= 0 and 0 < q <= 1 and n >= 0) for z, q, n in entries):
        return f"client {cid} sent accountant entries outside their ranges (noise >= 0, 0 < rate <= 1, steps >= 0)"
    return entries


class SampleWire:
    """``--dp sample``'s Flower wire protocol: what a message tells a SuperNode's DP-SGD (:meth:`control`, read by
    :meth:`fedlt.core.dpsgd.SampleDP.on_client`), what its reply carries as it leaves (:meth:`client_reply`: the model,
    its size, the riders and its accountant's entries of this message, :data:`HISTORY`), and the server's check of those
    entries against the client's size and the run's settings (:meth:`arrived`), into the client's accountant
    (``accounts``). ``keep``: the meta a round's reply keeps (``num_examples`` and the method's
    :func:`fedlt.core.dpsgd.riders`)."""

    def __init__(self, accounts: SampleAccounts, keep: tuple[str, ...]):
        self.accounts, self.keep = accounts, keep

    def kept(self, phase: str | None = None) -> tuple[str, ...]:
        """The meta a reply keeps as it leaves: in a round, ``num_examples`` and the riders; in a phase, its size."""
        return self.keep if phase is None else ("num_examples",)

    def control(self, cid: int) -> dict:
        """What a message to client ``cid`` says for its DP-SGD on a SuperNode
        (:meth:`fedlt.core.dpsgd.SampleDP.on_client`)."""
        a = self.accounts
        out = {"dp-delta": a.delta, "dp-rounds": a.rounds_of.get(cid, 1),
               **({"dp-counted": 1} if a.counts_noise is not None and cid in a.histories else {})}
        return {**out, "dp-noise": a.noises[cid]} if cid in a.noises else out

    def client_reply(self, cid: int, reply, phase: str | None = None):
        """A SuperNode's reply as it leaves under --dp sample: the model DP-SGD trained (a phase's: no arrays), its
        ``num_examples`` and the accountant entries of this message (:data:`HISTORY`); nothing else."""
        from .method import Message

        if phase is not None:
            reply = phase_replies(phase, [(cid, reply)])[0][1]
        keep = {k: reply.meta[k] for k in self.kept(phase) if k in reply.meta}
        return Message(reply.arrays, {**keep, HISTORY: [list(h) for h in self.accounts.histories.get(int(cid), [])]})

    def arrived(self, replies: list, phase: str | None = None) -> tuple[list, dict[int, str]]:
        """The replies of clients that trained by DP-SGD themselves (:meth:`client_reply`): each one's accountant
        entries added to its accountant here; a reply without usable entries, or with other meta, is not used and
        says why."""
        out, why = [], {}
        for cid, reply in replies:
            entries = entries_of(cid, reply.meta)
            extra = sorted(set(reply.meta) - {*self.kept(phase), HISTORY})
            if isinstance(entries, str):
                why[cid] = entries
            elif extra:
                why[cid] = f"client {cid} sent {', '.join(extra)} beside its model, which DP-SGD does not cover"
            elif entries and (wrong := self.disagrees(cid, entries)):
                why[cid] = wrong
            if cid in why:
                continue
            if entries:
                self.accounts.received(cid, entries)
            out.append((cid, reply))
        return out, why

    def disagrees(self, cid: int, entries: list) -> str | None:
        """Why a client's accountant entries of one message are not what its size and the run's settings give (its
        sampling rate ``1 / L``, whole epochs of ``L`` steps, the noise multiplier
        :meth:`fedlt.core.dpsgd_accounts.SampleAccounts.noise_of` gives for them; first, where the method's loss reads
        class counts and the client has no history here, their release,
        :meth:`fedlt.core.dpsgd_accounts.SampleAccounts.prefix`), or None: the accountant takes no sampling rate or
        noise on a client's word."""
        a = self.accounts
        L = batches_per_epoch(int(np.asarray(a.sizes())[cid]), a.batch_size)
        rest = list(entries)
        if a.prefix() and cid not in a.histories:
            z0, q0, _ = a.prefix()[0]
            if not rest or (rest[0][0], rest[0][1]) != (z0, q0):
                return (f"client {cid}'s accountant entries {entries} do not begin with the release of its class "
                        f"counts ({z0:g}, {q0:g}, 1): its SuperNode runs another fedlt or other settings")
            # the release, then the steps (the ledger merges steps of the same noise and rate into one entry)
            rest = ([(z0, q0, rest[0][2] - 1)] if rest[0][2] > 1 else []) + rest[1:]
        steps = sum(n for _, _, n in rest)
        if any(q != 1.0 / L for _, q, _ in rest) or steps % L:
            return (f"client {cid}'s accountant entries {entries} do not sample at 1/{L} in whole epochs of {L} steps, "
                    f"as its size gives: its SuperNode runs another fedlt or other settings")
        z = a.noise_of(cid, 1.0 / L, steps, keep=False) if steps else None
        if any(e[0] != z for e in rest):
            return (f"client {cid}'s accountant entries {entries} do not have the noise multiplier {z:g} its size and "
                    f"the run's settings give: its SuperNode runs another fedlt or other settings")
        return None
