"""Fault-tolerance constants shared by the launcher and the training processes (issue 44).

* :data:`HANG_EXIT_CODE` — the exit status of a process whose hang watchdog fired
  (:mod:`jaxcolossal.runtime.watchdog`), so that a launcher can tell a hang from a crash.
* :func:`restart_count` — which attempt of the job this process belongs to, from the launcher's
  environment (0: the first).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

HANG_EXIT_CODE = 75
"""Exit status of a process ended by its hang watchdog (EX_TEMPFAIL: "try again")."""

RESTART_COUNT_VARS = ("JAXCOLOSSAL_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
"""The variables that number a job's restarts: ours (``python -m jaxcolossal.run --max-restarts``),
torchrun's elastic agent's, SLURM's (``--requeue``); the first one set wins."""


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """The restart number of this attempt: the first of :data:`RESTART_COUNT_VARS` set in ``env``
    (default ``os.environ``), as an int; 0 when none is set.

    Raises:
        ValueError: the variable is set but not an integer.
    """
    env = os.environ if env is None else env
    for name in RESTART_COUNT_VARS:
        value = env.get(name)
        if value is not None and value.strip() != "":
            return int(value)
    return 0
