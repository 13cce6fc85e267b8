"""The config of a restarted run (issue 44, docs/fault_tolerance.md): pure functions of the config.

* :func:`resume_on_restart`: a restarted job continues from its newest checkpoint, so
  ``training.resume=false`` is taken as ``auto`` there.
* :func:`keep_global_batch`: a job restarted on fewer devices (a shrunk group) keeps its global
  batch, and each device its microbatch, by raising the gradient accumulation (or the pipeline's
  microbatches) by the factor the data-parallel size fell.

Both return a new config (the argument is not changed) and the line that says what changed
(``""``: nothing).
"""

from __future__ import annotations

import copy

from jaxcolossal.config.derived import pipeline_microbatches
from jaxcolossal.config.schema import Config
from jaxcolossal.errors import ConfigError

__all__ = ["resume_on_restart", "keep_global_batch"]


def resume_on_restart(cfg: Config, restarts: int) -> tuple[Config, str]:
    """``cfg`` for the ``restarts``-th restart of a job (0: the first start, returned as is): with
    ``training.resume=false`` and a ``checkpoint.dir``, ``auto`` instead, so the restarted job resumes
    from the newest checkpoint (and ``checkpoint.overwrite`` does not delete it). Raises nothing."""
    if restarts <= 0 or cfg.training.resume is not False:
        return cfg, ""
    if not cfg.checkpoint.dir:
        return cfg, (f"restart {restarts}: no checkpoint.dir, so the restarted run starts again from step 0 "
                     "(set checkpoint.dir and checkpoint.save_every to resume)")
    out = copy.deepcopy(cfg)
    out.training.resume = "auto"
    return out, f"restart {restarts}: training.resume=false taken as auto (resuming from the newest checkpoint)"


def _data_parallel(cfg: Config, num_devices: int, when: str) -> int:
    """The resolved ``data_parallel_size`` of ``cfg`` on ``num_devices``.

    Raises:
        ConfigError: the layout does not resolve there (``when`` says which device count it is).
    """
    try:
        return cfg.parallel.resolve(num_devices).data_parallel_size
    except ConfigError as e:
        raise ConfigError(f"{when}: {e}") from None


def _scaled_dp(cfg: Config, planned: int, num_devices: int) -> Config:
    """``cfg`` with an explicit ``parallel.data_parallel_size`` scaled by ``num_devices / planned`` (the
    devices a shrink removed come out of the data group; tp, pp, sp and ep stay); ``-1`` is left to
    resolve.

    Raises:
        ConfigError: the explicit size does not scale to a whole number.
    """
    dp = cfg.parallel.data_parallel_size
    if dp == -1 or planned == num_devices:
        return cfg
    if (dp * num_devices) % planned:
        raise ConfigError(f"parallel.data_parallel_size={dp} was set for {planned} devices; on the {num_devices} "
                          f"devices left it does not scale to a whole size: set parallel.data_parallel_size=-1")
    out = copy.deepcopy(cfg)
    out.parallel.data_parallel_size = dp * num_devices // planned
    return out


def keep_global_batch(cfg: Config, num_devices: int, planned: int) -> tuple[Config, str]:
    """``cfg`` for a run on ``num_devices`` devices when it was configured for ``planned`` (a shrunk
    or grown group), keeping the global batch in sequences and each device's microbatch.

    The data-parallel size goes from ``dp_old`` (on ``planned``) to ``dp_new`` (on ``num_devices``;
    an explicit ``parallel.data_parallel_size`` is scaled, the other sizes stay). Without a pipeline
    ``training.gradient_accumulation_steps`` is multiplied by ``dp_old / dp_new``; with one,
    ``parallel.num_microbatches`` (and the accumulation steps when they are set). With
    ``training.micro_batch_size`` > 0 the global batch (``micro × accumulation × dp``) is kept that
    way; with ``batch_size`` it is kept anyway, and the accumulation only when ``batch_size`` divides
    by the new count: otherwise each device's microbatch grows instead (the line says so).

    Returns:
      ``(config, line)``: ``cfg`` itself and ``""`` when ``num_devices == planned`` or the
      data-parallel size is the same.

    Raises:
        ConfigError: one line: the layout (tp, pp, sp, ep sizes) is not valid on ``num_devices``, or
            an explicit data-parallel size does not scale.
    """
    if num_devices == planned:
        return cfg, ""
    where = f"the job was configured for {planned} devices and runs on {num_devices}"
    dp_old = _data_parallel(cfg, planned, f"{where}, but its layout is not valid on {planned}")
    cfg = _scaled_dp(cfg, planned, num_devices)
    dp_new = _data_parallel(cfg, num_devices, f"{where}, and its layout is not valid there")
    if dp_new == dp_old:
        return cfg, ""
    t, pp = cfg.training, cfg.parallel.resolve(num_devices).pipeline_parallel_size
    steps = pipeline_microbatches(cfg, pp) if pp > 1 else t.gradient_accumulation_steps
    global_batch = t.micro_batch_size * t.gradient_accumulation_steps * dp_old if t.micro_batch_size else t.batch_size
    head = f"{where}: data-parallel size {dp_old} -> {dp_new}"
    new = steps * dp_old // dp_new if (steps * dp_old) % dp_new == 0 else 0
    if not new or (not t.micro_batch_size and t.batch_size % (new * dp_new)):
        return cfg, (f"{head}; the global batch stays {global_batch} sequences, but "
                     f"{steps} -> {steps * dp_old / dp_new:g} microbatches does not divide it: each device's "
                     "microbatch grows instead")
    out = copy.deepcopy(cfg)
    if pp > 1:
        out.parallel.num_microbatches = new
        key = "parallel.num_microbatches"
        if t.gradient_accumulation_steps > 1 or t.micro_batch_size:  # the two may not disagree
            out.training.gradient_accumulation_steps = new
    else:
        out.training.gradient_accumulation_steps = new
        key = "training.gradient_accumulation_steps"
    return out, f"{head}; {key} {steps} -> {new} keeps the global batch of {global_batch} sequences"
