"""Seeding: one run seed drives every random draw, each through a generator of its own keyed by the seed and a
*purpose* (and, where it repeats, the round and the client). :class:`Purpose` names the purposes of the framework's
draws in one place, so that a new draw picks a number no other uses; :func:`derive_seed` turns a key into a seed.

Two ways of keying, both SeedSequence-based: ``np.random.default_rng([seed, purpose, ...])`` for numpy draws, and
``derive_seed(seed, purpose, ...)`` for a torch generator or a numpy one that must match it. A method's own draws
(a head's initialisation, a shuffle) keep their purposes in its file beside its algorithm, numbers of 100 and up
other than :attr:`Purpose.AUX_DRAW` (e.g. fedgpa's ``HEAD_INIT = 0x6A1``; centralized's ``POOL_TRAIN = 21``, a
torch generator's seed ``derive_seed(seed, 21, round)``, predates the rule and draws a stream of its own all the same).

Numbers that two purposes share are aliases in the enum (``Purpose.SAMPLING is Purpose.LOCAL_LONGTAIL``): keyed
with the same tail, they draw the same stream.
"""
from __future__ import annotations

import enum

import numpy as np


class Purpose(enum.IntEnum):
    """What a generator draws. The numbers are part of every run's results: changing one changes the runs."""

    # data: the long tail, the partitions and the clients' test sets (fedlt.data)
    LONGTAIL_KEEP = 1  # which samples of each class the long-tailed training set keeps
    DIRICHLET = 2  # partitions, one purpose each
    SHARDS = 3
    IID = 4
    TAU_SAMPLING = 5
    LOCAL_TEST = 6  # FedLoGe's local test set of a client, [seed, LOCAL_TEST, client]
    TAIL_CLASSES = 7  # the step profile's tail classes
    PATHOLOGICAL = 8
    EXTENDED_DIRICHLET = 9
    LOCAL_LONGTAIL = 10
    NATURAL = 11  # which users of a naturally partitioned dataset become the clients
    OWN_TEST_SPLIT = 14  # LEAF's per-client split, [seed, OWN_TEST_SPLIT, client]

    # the engine (fedlt.engine.driver and its transports)
    # (10, 11 and 14 are also data's: SAMPLING's [seed, 10] is the very stream LOCAL_LONGTAIL's partition draws, a
    # coincidence of the past that runs keep; TRAIN's and DP_NOISE's keys are longer than NATURAL's and
    # OWN_TEST_SPLIT's, so their streams differ)
    SAMPLING = 10  # the clients of every round (Poisson sampling: [seed, SAMPLING, 1])
    TRAIN = 11  # a client's generator in a training round, (seed, TRAIN, round, client)
    PHASE = 12  # a client's generator in a post-training phase, (seed, PHASE, phase index, client)
    EVAL_SAMPLE = 13  # the clients PM is measured on
    DP_NOISE = 14  # --dp client: the server's noise on the sum, (seed, DP_NOISE, round, ...)
    SECAGG = 15  # --secagg: a client's stochastic rounding (core.secagg), the simulator's and its SuperNode's

    # core
    DP_COUNTS = 16  # --dp sample: the noise on a client's class counts (core.dpsgd)

    # the engine's faults and time model (fedlt.engine.faults)
    ONLINE = 20  # which clients are online in a round
    DROP = 21  # which sampled clients drop out
    SPEED = 22  # the clients' speeds
    SELECT = 23  # the clients a round selects among those online

    # core.auxiliary
    AUX_DRAW = 121  # the server's auxiliary (balanced) set drawn from the training set; methods' own start past it


def derive_seed(*keys: int) -> int:
    """A 63-bit seed from a tuple of non-negative ints (run seed, purpose, round, client, ...)."""
    return int(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]).generate_state(2, np.uint64)[0] >> 1)
