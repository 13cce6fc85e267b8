"""Checkpoints with orbax-checkpoint: async saves, keep-last-N, restore onto target shardings.

The saved item is the whole :class:`~jaxcolossal.train.state.TrainState` (step, params, fp32
master, optimizer state, loss scaler). The data position needs no saving: batches are a pure
function of ``(seed, step)``. Restoring takes the *target* shardings from an abstract state, so
a checkpoint written with one mesh or ZeRO stage restores onto another.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_like(state: Any) -> Any:
    """``ShapeDtypeStruct`` tree (with shardings) describing ``state`` — a restore target."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


class CheckpointManager:
    """Thin wrapper over ``orbax.checkpoint.CheckpointManager``.

    Args:
        directory: where step folders go (created; made absolute).
        max_to_keep: how many recent checkpoints to keep.
        async_save: write in a background thread while training continues.

    Orbax writes each step to a temporary folder and renames it when complete, so a
    half-written step is never listed by :meth:`latest_step`.
    """

    def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=async_save)
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, force: bool = False) -> bool:
        """Start saving ``state`` as ``step`` (returns at once when async)."""
        return self._mngr.save(int(step), args=ocp.args.StandardSave(state), force=force)

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self._mngr.latest_step()

    def restore(self, target: Any, step: int | None = None) -> Any:
        """Restore ``step`` (default: latest) into the shapes, dtypes and shardings of ``target``
        (a state or :func:`abstract_like` tree).

        Raises:
            FileNotFoundError: no checkpoint in the directory.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        return self._mngr.restore(int(step), args=ocp.args.StandardRestore(abstract_like(target)))

    def wait(self) -> None:
        """Block until pending async saves are on disk."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
