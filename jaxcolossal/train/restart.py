"""The training loop's start after a restart (issue 44, docs/fault_tolerance.md).

A launcher that restarts a failed job (``python -m jaxcolossal.run --max-restarts``, torchrun's
elastic agent, ``sbatch --requeue``) says so in the environment
(:func:`jaxcolossal.runtime.faults.restart_count`); the restarted run then resumes from the newest
checkpoint, and on fewer devices than planned (``JAXCOLOSSAL_PLANNED_DEVICES``, set by the launcher
after a shrink, or by hand) keeps the global batch. The rules are the config's
(:mod:`jaxcolossal.config.restart`); this module reads the environment and logs what changed.
"""

from __future__ import annotations

from collections.abc import Mapping

from jaxcolossal.config import Config, ConfigError, keep_global_batch, resume_on_restart
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.runtime.faults import planned_devices, restart_count

__all__ = ["after_restart"]


def after_restart(cfg: Config, env: Mapping[str, str], num_devices: int) -> Config:
    """``cfg`` for this start of the job: :func:`resume_on_restart` with the environment's restart
    count, then :func:`keep_global_batch` when ``$JAXCOLOSSAL_PLANNED_DEVICES`` differs from
    ``num_devices``; each change logged in one line (process 0). A first start with the planned
    devices returns ``cfg`` itself.

    Raises:
        ConfigError: a restart-count or planned-devices variable that is not a number, or a layout
            that is not valid on ``num_devices`` (one line each).
    """
    try:
        restarts, planned = restart_count(env), planned_devices(env)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    log = get_dist_logger()
    cfg, line = resume_on_restart(cfg, restarts)
    if line:
        log.warning(line, ranks=[0])
    if planned is not None:
        cfg, line = keep_global_batch(cfg, num_devices, planned)
        if line:
            log.warning(line, ranks=[0])
    return cfg
