"""One run: its directory and files (:mod:`~fedlt.runner.rundir`, :mod:`~fedlt.runner.runstate`), checkpoints and
signals (:mod:`~fedlt.runner.preempt`), the divergence check (:mod:`~fedlt.runner.divergence`) and the experiment
trackers it reports to (:mod:`~fedlt.runner.trackers`): the layer between the engines, which run rounds, and the
many-runs layer (``fedlt.experiments``), which runs many of these."""
