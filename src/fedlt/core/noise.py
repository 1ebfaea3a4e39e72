"""Where differential privacy's noise comes from (``--dp-noise-seed``, docs/differential-privacy.md): the run's seed
(reproducible by whoever knows it), or a secret 256-bit key from the operating system. Shared by client-level DP
(:mod:`fedlt.core.dp`, the server's noise) and DP-SGD (:mod:`fedlt.core.dpsgd`, each client's)."""
from __future__ import annotations

import torch

from ..errors import ConfigError
from ..seeds import derive_seed

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
    32-bit words and the ints through ``numpy.random.SeedSequence`` (:func:`fedlt.seeds.derive_seed`), so that
    one who lacks the key cannot tell the seed, and two ints give unrelated seeds."""
    if len(key) != 64:
        raise ConfigError(f"a DP noise key has 64 hex digits, not {len(key)}: the checkpoint or --state-dir holding it "
                          f"is damaged")
    return derive_seed(*(int(key[i:i + 8], 16) for i in range(0, 64, 8)), *ints)


# --dp-noise-seed's default, the engine's: where one process (or Flower's simulation) runs every client, the run's
# seed, for reproducible experiments; where SuperNodes run them (a deployment: fedlt flower run / supernode), the
# secret key, since there the server that chose the seed would otherwise know each SuperNode's DP-SGD noise
ENGINE_DEFAULT = {False: "run", True: "secret"}  # by "deployed"


def noise_seed(choice: str | None, deployed: bool = False) -> str:
    """--dp-noise-seed as a run takes it: the one given, else the engine's default (:data:`ENGINE_DEFAULT`)."""
    return choice or ENGINE_DEFAULT[bool(deployed)]


def noise_key(cfg, deployed: bool = False) -> str | None:
    """A new secret noise key for a run whose noise seed is ``secret`` (:func:`noise_seed`; a resumed run then takes
    its checkpoint's), else None."""
    return new_key() if noise_seed(getattr(cfg, "dp_noise_seed", None), deployed) == "secret" else None


def noise_source(cfg, level: str, deployed: bool = False) -> str:
    """Where a run's DP noise comes from, in the words of its privacy line (``level``: client or sample); on a
    deployment run-seeded noise only where asked for, and said so."""
    seed = noise_seed(getattr(cfg, "dp_noise_seed", None), deployed)
    if seed == "secret":
        if deployed:
            return "each SuperNode's noise drawn from a secret key of its own" if level == "sample" else \
                "noise drawn from the server's secret key"
        return "noise drawn from a secret key"
    if deployed:  # asked for: the default there is secret
        return ("noise drawn from --seed, as --dp-noise-seed run asks: the server knows it and can subtract each "
                "SuperNode's noise" if level == "sample" else
                "noise drawn from --seed, as --dp-noise-seed run asks: whoever knows it can subtract the noise")
    return "noise drawn from --seed (reproducible)"


def noise_generator(key: str | None, seed: int, *ints: int) -> torch.Generator:
    """The generator of a DP noise draw: from the run's ``seed`` and ``ints`` (``--dp-noise-seed run``), or from the
    secret ``key`` and ``ints`` (``secret``)."""
    return torch.Generator().manual_seed(derive_seed(seed, *ints) if key is None else keyed_seed(key, *ints))
