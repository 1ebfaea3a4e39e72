"""Where differential privacy's noise comes from (``--dp-noise-seed``, docs/differential-privacy.md): the run's seed
(reproducible by whoever knows it), or a secret 256-bit key from the operating system. Shared by client-level DP
(:mod:`fedlt.core.dp`, the server's noise) and DP-SGD (:mod:`fedlt.core.dpsgd`, each client's)."""
from __future__ import annotations

import torch

from ..errors import ConfigError

# --dp-noise-seed: where the noise's randomness comes from (docs/differential-privacy.md, "Where the noise comes from")
NOISE_SEEDS = {"run": "run: a function of the run's seed (config.json records it) and the round; whoever knows the "
                      "seed can draw the same noise and subtract it: reproducible, for experiments",
               "secret": "secret: from a 256-bit key drawn from the operating system (secrets.token_hex) when the run "
                         "starts, kept in its checkpoints only (the server's noise; a Flower SuperNode's DP-SGD noise "
                         "from a key of its own, which never leaves it)"}


def new_key() -> str:
    """A fresh secret noise key: 256 bits from the operating system's entropy, as 64 hex digits."""
    import secrets

    return secrets.token_hex(32)


def keyed_seed(key: str, *ints: int) -> int:
    """A 63-bit seed from secret ``key`` (64 hex digits) and ``ints`` (purpose, round, client, ...): the key's eight
    32-bit words and the ints through ``numpy.random.SeedSequence`` (:func:`fedlt.core.method.derive_seed`), so that
    one who lacks the key cannot tell the seed, and two ints give unrelated seeds."""
    from .method import derive_seed

    if len(key) != 64:
        raise ConfigError(f"a DP noise key has 64 hex digits, not {len(key)}: the checkpoint or --state-dir holding it "
                          f"is damaged")
    return derive_seed(*(int(key[i:i + 8], 16) for i in range(0, 64, 8)), *ints)


def noise_key(cfg) -> str | None:
    """A new secret noise key for a run with ``--dp-noise-seed secret`` (a resumed run then takes its checkpoint's),
    else None."""
    return new_key() if getattr(cfg, "dp_noise_seed", "run") == "secret" else None


def noise_generator(key: str | None, seed: int, *ints: int) -> torch.Generator:
    """The generator of a DP noise draw: from the run's ``seed`` and ``ints`` (``--dp-noise-seed run``), or from the
    secret ``key`` and ``ints`` (``secret``)."""
    from .method import derive_seed

    return torch.Generator().manual_seed(derive_seed(seed, *ints) if key is None else keyed_seed(key, *ints))
