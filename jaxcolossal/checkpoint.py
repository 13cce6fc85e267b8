"""Checkpoints with orbax-checkpoint: async, keep-last-N plus the best, resharding restore.

The saved item is the whole :class:`~jaxcolossal.train.state.TrainState` (step, params, fp32
master, optimizer state, loss scaler). The data position needs no saving: batches are a pure
function of ``(seed, step)``, so restoring the step restores the data order.

* **Async**: ``save`` returns while a background thread writes; ``wait`` blocks.
* **Retention**: the last ``max_to_keep`` steps, plus the step with the lowest ``val_loss``
  among saves that carried one (orbax ``LatestN`` ∪ ``BestN``).
* **Atomic**: orbax writes each step into a temporary folder and renames it when complete, so
  a half-written step is never listed. A listed step that fails to restore (corrupt or
  truncated files) is skipped with a warning naming it, and the next older one is tried.
* **Resharding**: ``restore`` takes the *target* shardings from a state (or abstract state), so
  a checkpoint written with one mesh, ZeRO stage or tp restores onto another.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp

_policies = ocp.checkpoint_managers


def abstract_like(state: Any) -> Any:
    """``ShapeDtypeStruct`` tree (with shardings) describing ``state`` — a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


class CheckpointManager:
    """Orbax ``CheckpointManager`` with the retention and recovery rules above.

    Args:
        directory: where step folders go (created; made absolute).
        max_to_keep: how many most recent checkpoints to keep (the best is kept besides).
        async_save: write in a background thread while training continues.
    """

    def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        policy = _policies.AnyPreservationPolicy([
            _policies.LatestN(n=max_to_keep),
            _policies.BestN(get_metric_fn=lambda m: m["val_loss"], reverse=True, n=1,
                            keep_checkpoints_without_metrics=False),
        ])
        options = ocp.CheckpointManagerOptions(preservation_policy=policy, create=True,
                                               best_fn=lambda m: m["val_loss"], best_mode="min",
                                               enable_async_checkpointing=async_save)
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, val_loss: float | None = None, force: bool = False) -> bool:
        """Start saving ``state`` as ``step`` (returns at once when async). ``val_loss``, when
        given, makes the step a candidate for "best"."""
        metrics = None if val_loss is None else {"val_loss": float(val_loss)}
        return self._mngr.save(int(step), args=ocp.args.StandardSave(state), metrics=metrics, force=force)

    def all_steps(self) -> list[int]:
        """Complete steps on disk, oldest first."""
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self._mngr.latest_step()

    def best_step(self) -> int | None:
        """The kept step with the lowest saved ``val_loss``, or None."""
        return self._mngr.best_step()

    def restore(self, target: Any, step: int | None = None) -> Any:
        """Restore ``step`` — by default the newest step that restores cleanly — into the
        shapes, dtypes and shardings of ``target`` (a state or :func:`abstract_like` tree).

        Raises:
            FileNotFoundError: no checkpoint in the directory (or none restores).
        """
        abstract = abstract_like(target)
        if step is not None:
            return self._mngr.restore(int(step), args=ocp.args.StandardRestore(abstract))
        for s in reversed(self.all_steps()):
            try:
                return self._mngr.restore(s, args=ocp.args.StandardRestore(abstract))
            except Exception as e:  # a corrupt or truncated step: fall back to the previous one
                warnings.warn(f"checkpoint step {s} in {self.directory} could not be restored and is skipped: "
                              f"{type(e).__name__}: {str(e)[:200]}", RuntimeWarning, stacklevel=2)
        raise FileNotFoundError(f"no restorable checkpoint in {self.directory}")

    def wait(self) -> None:
        """Block until pending async saves are on disk."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release orbax's threads."""
        self._mngr.wait_until_finished()
        self._mngr.close()
