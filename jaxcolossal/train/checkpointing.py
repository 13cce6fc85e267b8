"""The loop's persistent and emergency checkpoints: the folder opened (:func:`open_checkpoints`),
``training.resume``'s restore, preferring the emergency checkpoints when they are newer
(:func:`restore`, :func:`restored`), the saves at their intervals and at the end (:func:`save`,
:func:`save_local`), and the last finite state saved on a non-finite stop (:func:`save_last_finite`)."""

from __future__ import annotations

import os
from typing import Any

from jaxcolossal.checkpoint import CheckpointManager, NonFiniteStateError, config_diff, step_dirs
from jaxcolossal.config import Config, ConfigError
from jaxcolossal.runtime.dist_logger import get_dist_logger
from jaxcolossal.train.emergency import LocalCheckpoints, agree_step
from jaxcolossal.train.guard import StopSignals
from jaxcolossal.train.nvme import NvmeTier
from jaxcolossal.train.report import StepClock
from jaxcolossal.train.run import Run


# ----------------------------------------------------------------------------- restore


def open_checkpoints(cfg: Config) -> CheckpointManager | None:
    c = cfg.checkpoint
    if not c.dir:
        return None
    ckpt = CheckpointManager(c.dir, c.max_to_keep, config=cfg.to_dict())
    if c.overwrite and cfg.training.resume is False and step_dirs(c.dir):
        get_dist_logger().warning(f"checkpoint.overwrite=true: deleted steps {ckpt.clear()} in {ckpt.directory}",
                                  ranks=[0])
    return ckpt


SCHEDULE_KEYS = tuple(f"training.{k}" for k in ("learning_rate", "min_learning_rate_ratio", "warmup_steps",
                                                  "max_steps"))
"""Keys that shape the learning-rate schedule; a resume that changes them says so."""


def restore(cfg: Config, ckpt: CheckpointManager | None, state: Any,
             local: LocalCheckpoints | None = None) -> tuple[Any, str]:
    """``training.resume``: true restores the newest step that restores (or fails), auto as
    well when there is one; damaged steps are moved aside by the checkpoint manager. With
    emergency checkpoints (``local``), the newest step every process holds locally
    (:func:`agree_step`, a collective) is restored instead when it is newer than the newest
    persistent step. Returns ``(state, source)``: ``source`` ``"local"``, ``"persistent"``, or
    ``"none"`` with ``state`` itself when it restores nothing (a fresh run also clears ``local``)."""
    if ckpt is None or cfg.training.resume is False:
        if local is not None:
            local.clear()
        return state, "none"
    log = get_dist_logger()
    state, source = _restore_newest(cfg, ckpt, state, local)
    if source == "none":
        return state, source
    step = int(state.step)
    if local is not None:  # newer local steps belong to the history this run replaces
        local.drop_after(step)
    if step >= cfg.training.max_steps:
        raise ConfigError(f"training.max_steps={cfg.training.max_steps}: the checkpoint is already at step {step}, "
                          "so there is nothing to train; max_steps counts all steps, not the steps to add "
                          f"(e.g. training.max_steps={step + cfg.training.max_steps})")
    if source == "persistent":
        changed = config_diff(ckpt.saved_config(step), cfg.to_dict(), SCHEDULE_KEYS)
        if changed:
            log.warning("the learning-rate schedule differs from the saved run's, so the resumed steps "
                        "follow the new one: " + "; ".join(changed), ranks=[0])
    return state, source


def _restore_newest(cfg: Config, ckpt: CheckpointManager, state: Any,
                    local: LocalCheckpoints | None) -> tuple[Any, str]:
    """:func:`restore`'s choice between the emergency and the persistent checkpoints, logged."""
    log = get_dist_logger()
    newest_local = agree_step(local.available(state)) if local is not None else None
    persistent = ckpt.latest_step()
    tried = newest_local is not None and (persistent is None or newest_local > persistent)
    if tried:
        found = local.restore_newest(state, newer_than=persistent)  # each process logs the copy it read
        if found is not None:
            state, copy = found
            log.info(f"resumed from step {copy.step} of the emergency (local) checkpoints in {local.directory} "
                     f"({'no persistent step' if persistent is None else f'newest persistent step {persistent}'} "
                     f"in {ckpt.directory}; process 0 read {copy.path})", ranks=[0])
            return state, "local"
    try:
        state = ckpt.restore(state)
    except FileNotFoundError:
        if cfg.training.resume is True:
            raise
        log.info(f"training.resume=auto: no checkpoint in {ckpt.directory}, starting fresh", ranks=[0])
        return state, "none"
    log.info(f"resumed from step {int(state.step)} in {ckpt.directory} (persistent"
             + ("; no newer emergency step is whole on every process)" if tried else
                f"; newest emergency step every process holds: {newest_local})" if local is not None else ")"),
             ranks=[0])
    return state, "persistent"


def restored(cfg: Config, ckpt: Any, state: Any, tier: NvmeTier | None, stop: StopSignals,
              local: LocalCheckpoints | None = None) -> tuple[Any, int | None, str]:
    """``(state, resumed_from, source)``: ``state`` restored with ``training.resume`` from the
    checkpoint folder or the emergency checkpoints (:func:`restore`; ``resumed_from`` its step, else
    ``None``; ``source`` ``"persistent"``, ``"local"`` or ``"none"``), its NVMe-bound leaves spilled
    to their files.

    Raises:
        StoppedBeforeTraining: a signal arrived while the folder was opened or restored from.
    """
    state, source = restore(cfg, ckpt, state, local)
    resumed_from = None if source == "none" else int(state.step)
    stop.check("opening the checkpoint folder" if resumed_from is None else f"restoring step {resumed_from}")
    if tier is not None:  # the offloaded optimizer state goes to its files; tokens take its places
        state = tier.spill(state)
        get_dist_logger().info(f"NVMe tier: {len(tier.slots)} optimizer-state leaves, "
                               f"{tier.bytes_per_device() / 2**20:.3f} MiB per device, in {tier.path}", ranks=[0])
    return state, resumed_from, source


# ----------------------------------------------------------------------------- save


def save(run: Run, state: Any, val_loss: float | None = None, final: bool = False) -> None:
    """Save ``state`` at its step (a no-op without ``checkpoint.dir``). ``final``: wait for the
    periodic saves and skip a step that is already on disk."""
    if run.ckpt is None:
        return
    step = int(state.step)
    if final:
        run.ckpt.wait()
        if step in run.ckpt.all_steps():
            return
    run.ckpt.save(step, run.full(state), val_loss=val_loss, force=final)
    get_dist_logger().info(f"checkpoint of step {step}: saving to {os.path.join(run.ckpt.directory, str(step))}"
                           + ("" if final else " (in the background)"), ranks=[0])


def save_local(run: Run, state: Any, done: int, m: dict, clock: "StepClock") -> None:
    """The emergency checkpoint of step ``done`` (``checkpoint.local_every``): the host copy here, the
    files in the background (:class:`LocalCheckpoints`); time ``checkpoint_save`` in the goodput."""
    with clock.paused(m):
        run.hang.progress(f"in the emergency checkpoint save at step {done}")
        with run.goodput.phase("checkpoint_save"):
            run.local.save(done, run.full(state))
        run.hang.progress(f"after the emergency checkpoint save at step {done}")


def save_last_finite(run: Run, state: Any) -> None:
    """On a non-finite stop: the state still holds the last finite update (the bad one was not
    applied); save it so that nothing since the last checkpoint is lost."""
    if run.ckpt is None:
        return
    try:
        save(run, state, final=True)
        run.ckpt.close()
        get_dist_logger().warning(f"saved step {int(state.step)} in {run.ckpt.directory}: the last finite state "
                                  "(the step counts the skipped steps; their updates were not applied)", ranks=[0])
    except NonFiniteStateError as e:
        get_dist_logger().warning(str(e), ranks=[0])
