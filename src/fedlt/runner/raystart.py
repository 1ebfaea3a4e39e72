"""How fedlt starts (or joins) Ray: ``fedlt flower simulate``'s runtime and ``fedlt sweep --backend ray``.

Two things differ from a bare ``ray.init``:

- The workers run at the caller's priority. Ray lowers its workers to niceness 15 (``RAY_worker_niceness``),
  which is right where they are helpers of a busy driver; here they are the work itself (the clients' training,
  the sweep's runs), and at niceness 15 any other busy process takes nearly all the CPU from them: on a 2-core
  machine with other jobs running, a 4-client ``fedlt flower simulate`` had not described its clients after
  300 s, and finished in 120 s at niceness 0. A ``RAY_worker_niceness`` of the user's own is kept; a cluster
  joined (``--ray-address``) keeps the niceness its nodes were started with.
- The scheduler's signals come back to fedlt (``ray.init`` installs a SIGTERM handler that aborts the process;
  :func:`fedlt.runner.preempt.retake`), so a preempted run stops with its checkpoint.
"""
from __future__ import annotations

import os

from .preempt import retake

NICENESS = "RAY_worker_niceness"


def start_ray(ray, **init_args) -> None:
    """``ray.init(**init_args)`` with the workers at normal priority (unless ``RAY_worker_niceness`` says
    otherwise), then fedlt's signal handlers back."""
    os.environ.setdefault(NICENESS, "0")  # read by the raylet ray.init starts, and by the workers it forks
    ray.init(**init_args)
    retake()
