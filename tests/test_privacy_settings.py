"""Settings that live with their owner (issue 57 item 2): the privacy settings' relations take the method class as an
argument (core.privacy_settings), the adaptive-clipping check is one check for the mechanism and the validation, and
the settings that need the engine's time model are checked one layer up, before any data is loaded."""
from __future__ import annotations

import pytest

pytest.importorskip("dp_accounting")

from fedlt.config import RunConfig, load_config  # noqa: E402
from fedlt.core.dp import split_problem, update_noise  # noqa: E402
from fedlt.core.privacy_settings import relations  # noqa: E402
from fedlt.decl import check_relations  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402

SMALL = {"dataset": "digits", "clients": 4, "rounds": 1}


@pytest.mark.parametrize("noise,count", [(1.0, 0.4), (2.0, 1.0), (0.5, 0.1)])
def test_adaptive_clipping_split_is_one_check_for_the_mechanism_and_the_settings(noise, count):
    """Where the count's noise is at most half the multiplier, the mechanism (update_noise) and the run's validation
    refuse with the same line; just above half, both accept and the update's own noise exceeds the run's."""
    with pytest.raises(ConfigError) as mech:
        update_noise(noise, count)
    with pytest.raises(ConfigError) as cfg:
        load_config(None, {**SMALL, "dp": "client", "dp_clip": 1.0, "dp_noise": noise, "dp_clip_quantile": 0.5,
                           "dp_count_noise": count})
    assert str(mech.value) == str(cfg.value) == split_problem(noise, count)
    above = noise / 2 * 1.01
    assert split_problem(noise, above) is None and update_noise(noise, above) > noise


def test_the_privacy_relations_read_the_method_class_they_are_given():
    """A method class handed to relations() decides the refusal, whatever the configuration's method name says."""
    cfg = RunConfig(**SMALL, dp="client", dp_clip=1.0, dp_noise=1.0)

    class Pooled:
        needs_pool = True
        sends = ()

    check_relations(cfg, [r for r in relations(lambda c: type("Plain", (), {"sends": ()}), lambda c: 0)
                          if r.setting == "dp"])
    with pytest.raises(ConfigError, match="method fedavg trains on the clients' data pooled in one place"):
        check_relations(cfg, relations(lambda c: Pooled, lambda c: 0))


def test_the_time_model_is_checked_before_the_data_is_loaded(monkeypatch):
    """The round deadline against the clients' speeds needs the engine's time model (engine.faults): the settings
    load, and preparing the run refuses it in one line before its federation is built."""
    from fedlt.runner import rundir

    cfg = load_config(None, {**SMALL, "round_deadline": 1e-30})
    monkeypatch.setattr(rundir, "federation_for", lambda *_: pytest.fail("the data was loaded first"))
    with pytest.raises(ConfigError, match="round-deadline 1e-30 s is shorter than any client's round"):
        rundir.prepare(cfg)
