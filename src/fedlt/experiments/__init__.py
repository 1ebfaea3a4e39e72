"""Experiments beyond one run: comparisons and sweeps (methods x settings x seeds) that resume where they were
stopped, and reports that turn run directories into paper-style tables and figures.

Modules: ``runstate`` (what a run directory holds: JSON-lines metrics, TensorBoard, atomic checkpoints,
head-like tensors), ``sweep`` (sweep files, compare, running a plan), ``report`` (tables: Markdown, CSV,
LaTeX, and the report page), ``figures`` (PNG figures; needs the optional ``report`` extra: matplotlib).
Nothing is imported here, so ``fedlt.experiment`` can use ``runstate`` without a cycle.
"""
