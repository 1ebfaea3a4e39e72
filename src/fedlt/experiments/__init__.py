"""Experiments: many runs. Comparisons and sweeps (methods x settings x seeds) that resume where they were
stopped, on this process, local workers or Ray, reports that turn run directories into paper-style tables and
figures, and a paper's table reproduced. One run -- its directory, checkpoints, divergence check, preemption --
is the layer below (:mod:`fedlt.runner.rundir`, :mod:`fedlt.runner.runstate`, :mod:`fedlt.runner.divergence`, :mod:`fedlt.runner.preempt`).

Modules: ``sweep`` (sweep files, compare, running a plan), ``ray_backend`` (the runs as Ray tasks), ``report``
(tables: Markdown, CSV, LaTeX, and the report page), ``figures`` (PNG figures; needs the optional ``report``
extra: matplotlib), ``reproduce`` (a paper's table as a sweep, reported beside its numbers).
"""
