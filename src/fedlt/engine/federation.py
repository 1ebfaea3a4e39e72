"""What a run's settings make for an engine, before any round: the federation they describe
(:func:`federation_for`) and the method's ``RunSpec`` (:func:`make_spec`). The runner prepares a run with them
(``fedlt.runner.rundir.prepare``); the Flower engine's server and its SuperNodes of the run's partition build the
same from the settings a message carries, without a runner."""
from __future__ import annotations

import os

from ..config import RunConfig
from ..core.finetune import head_spec
from ..core.method import RunSpec
from ..data import Federation, build_federation
from ..data.partition import partition_settings
from ..data.split import default_lt_profile
from ..decl import settings_values


def federation_for(cfg: RunConfig) -> Federation:
    return build_federation(cfg.dataset, cfg.data_dir, cfg.imbalance_ratio, cfg.lt_profile, cfg.tail_classes,
                            cfg.n_max, cfg.partition, cfg.clients, cfg.seed, cfg.device,
                            partition_settings(cfg.partition, cfg), cfg.dataset_kw(), placement_mode=cfg.data_placement, partition_file=cfg.partition_file,
                            client_test_fraction=cfg.client_test_fraction)


def make_spec(cfg: RunConfig, fed: Federation) -> RunSpec:
    """The method's RunSpec: every setting the spec reads (``decl.settings_values``), and what the data says (of
    ``fed`` as loaded: under ``--finetune head`` the spec's input is the frozen backbone's features, which
    ``rundir.prepare`` makes of it)."""
    spec = RunSpec(model=cfg.model or fed.dataset.default_model, in_shape=fed.in_shape, num_classes=fed.num_classes,
                   cache_dir=os.environ.get("FEDLT_CACHE"), **settings_values(cfg, "spec"),
                   data=dict(dataset=cfg.dataset, data_dir=cfg.data_dir, imbalance_ratio=cfg.imbalance_ratio,
                             lt_profile=lt_profile_of(cfg, fed), tail_classes=cfg.tail_classes, n_max=cfg.n_max,
                             seed=cfg.seed, dataset_kw=cfg.dataset_kw(), input_mean=list(fed.prep.mean),
                             input_std=list(fed.prep.std), class_names=list(fed.dataset.class_names),
                             input_shape=list(fed.in_shape)))
    return head_spec(spec) if spec.finetune == "head" else spec  # its models' input: the backbone's features


def lt_profile_of(cfg: RunConfig, fed: Federation) -> str:
    """The long-tail profile the run uses (``cfg.lt_profile`` None: the dataset's default)."""
    return fed.settings.get("lt_profile") or cfg.lt_profile or default_lt_profile(cfg.dataset, cfg.partition,
                                                                                    cfg.partition_file)
