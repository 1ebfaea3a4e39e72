"""fedlt on Flower: the same methods on a SuperLink and SuperNodes (``pip install 'fedlt[flower]'``). These are the
apps that run the Flower engine (:mod:`fedlt.engine.flower`, which imports no runner) as a fedlt run, above the
runner:

- :mod:`fedlt.flower.server_app` -- ``app``, the one generic ServerApp (reads the run settings, runs the strategy)
- :mod:`fedlt.flower.client_app` -- ``app``, the one generic ClientApp (runs any method's client hooks)
- :mod:`fedlt.flower.strategy` -- ``FedltStrategy``, any method's server hooks as a Flower strategy; its ``run``
  records the run directory as every engine's run does
- :mod:`fedlt.flower.inprocess` -- the same apps in one process (no SuperLink, no Ray, no network)
- :mod:`fedlt.flower.simulation` -- the same apps in Flower's Ray simulation
- :mod:`fedlt.flower.deploy` -- ``fedlt flower superlink|supernode|app|run``: processes and app directories
- :mod:`fedlt.flower.settings` -- a RunConfig <-> Flower's flat run config
- :mod:`fedlt.flower.datasets` -- ``LongTailPartitioner``: fedlt's long-tailed clients for Flower Datasets

Their paths under ``fedlt.engine.flower`` (where app directories written before name them) still import
(``fedlt.moved``).
"""
