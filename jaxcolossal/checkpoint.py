"""Checkpoints with orbax-checkpoint: async, keep-last-N plus the best, resharding restore.

Each step folder holds two orbax items: ``state``, the whole
:class:`~jaxcolossal.train.state.TrainState` (step, params, fp32 master, optimizer state, loss
scaler), and ``config``, the run's config as JSON (what :func:`config_diff` compares on resume
and what ``scripts/convert_hf.py --to-hf`` reads). The data position needs no saving: batches
are a pure function of ``(seed, step)``, so restoring the step restores the data order.

* **Async**: ``save`` returns while a background thread writes; ``wait`` blocks.
* **Retention**: the last ``max_to_keep`` steps, plus the step with the lowest finite
  ``val_loss`` among saves that carried one (orbax ``LatestN`` ∪ ``BestN``). A NaN or inf
  ``val_loss`` never makes a step "best".
* **Nothing non-finite**: ``save`` refuses a state with a NaN or inf anywhere
  (:class:`NonFiniteStateError`), so retention can never delete finite steps in favour of
  broken ones.
* **Never silent**: a save that orbax refuses (a step at or below the newest on disk) raises
  :class:`CheckpointError` instead of returning quietly.
* **Damaged steps move aside**: orbax writes each step into a temporary folder and renames it
  when complete, but a folder can still be truncated later, or be foreign (an empty ``999/``).
  ``restore`` skips such a step with one log line (the step and :func:`damage_reason`) and moves
  it to ``<dir>/damaged/`` so that it can neither shadow nor block the new saves of the resumed
  run.
* **Mismatch is not damage**: a step whose saved tree differs from the target (another model
  size, optimizer or precision) raises :class:`CheckpointMismatchError` naming the differing
  leaves and config keys, saved vs now. A different *parallel layout* is not a mismatch.
* **Resharding**: ``restore`` takes the *target* shardings from a state (or abstract state), so
  a checkpoint written with one mesh, ZeRO stage or tp restores onto another. A target leaf
  without a sharding is refused (orbax would silently restore it in the saved layout).
"""

from __future__ import annotations

import datetime
import math
import os
import shutil
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxcolossal.errors import CheckpointError, CheckpointMismatchError, CheckpointNotFoundError  # noqa: F401
from jaxcolossal.runtime.dist_logger import get_dist_logger

_policies = ocp.checkpoint_managers

DAMAGED_DIR = "damaged"
"""Subfolder of the checkpoint directory that receives steps which failed to restore."""

LEGACY_ITEM = "default"
"""The item folder of steps written before the ``config`` item existed (one unnamed orbax item);
they restore and export as before, without a saved config."""


class NonFiniteStateError(CheckpointError, FloatingPointError):
    """The state to be saved holds NaN or inf values."""


def damage_reason(error: BaseException) -> str:
    """Why a step failed to restore, in a few words for the log, from the error orbax or
    TensorStore raised (whose text can run to pages): missing files, damaged data, or the error's
    type name."""
    text = str(error)
    if isinstance(error, FileNotFoundError) or any(k in text for k in ("does not exist", "NOT_FOUND", "holds no")):
        return "files are missing (an incomplete or foreign folder)"
    if any(k in text for k in ("DATA_LOSS", "OUT_OF_RANGE", "corrupt", "truncat", "Error reading", "decod")):
        return "its data files are truncated or corrupt"
    return f"it could not be read ({type(error).__name__})"


def step_dirs(directory: str) -> list[int]:
    """Integer-named subfolders of ``directory`` (complete, damaged or foreign), oldest first;
    ``[]`` when the directory does not exist. Reads only folder names (no orbax)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory)
                  if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def _key_name(k) -> str:
    """One key of a tree path as orbax names it: its ``name``, ``key`` or ``idx``."""
    return str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))


def _leaf_name(path) -> str:
    """orbax's flat name of a leaf (``params.layers.wq``, ``opt_state.1.0.mu.embed_tokens``)."""
    return ".".join(_key_name(k) for k in path)


def _has_shape(x: Any) -> bool:
    """The ``is_leaf`` of a tree of array metadata (anything with a ``shape``)."""
    return hasattr(x, "shape")


def _target_layout(target: Any) -> dict[str, tuple]:
    return {_leaf_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(target)[0]}


def _saved_layout(state_meta: Any) -> dict[str, tuple]:
    leaves = jax.tree.leaves(getattr(state_meta, "tree", state_meta), is_leaf=lambda x: hasattr(x, "shape"))
    return {m.name: tuple(m.shape) for m in leaves if hasattr(m, "shape")}


def _flat_config(cfg: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in (cfg or {}).items():
        out.update(_flat_config(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


STATE_KEYS = tuple(f"model.{k}" for k in (
    "type", "num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "max_position_embeddings", "vocab_size", "tie_word_embeddings", "vocab_pad_multiple")) + (
    "training.optimizer", "training.max_grad_norm", "precision.bf16", "precision.fp16")
"""Config keys that shape the saved state (the model's sizes, the optimizer's chain, the precision's
master copy and loss scaler); :func:`config_diff` compares these."""


def config_diff(saved: dict, now: dict, keys=STATE_KEYS) -> list[str]:
    """``["model.hidden_size: saved 64, now 128", ...]`` for the ``keys`` whose values differ."""
    a, b = _flat_config(saved), _flat_config(now)
    return [f"{k}: saved {a.get(k, '(absent)')!r}, now {b.get(k, '(absent)')!r}" for k in keys if a.get(k) != b.get(k)]


def abstract_like(state: Any) -> Any:
    """``ShapeDtypeStruct`` tree (with shardings) describing ``state`` — a restore target.

    Raises:
        ValueError: a leaf carries no sharding (a numpy array, or a ``ShapeDtypeStruct`` made
            without one); the message names the leaves.
    """
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    missing = [_leaf_name(p) for p, x in flat if getattr(x, "sharding", None) is None]
    if missing:
        raise ValueError(
            f"restore target has {len(missing)} leaves without a sharding (e.g. {', '.join(missing[:3])}): "
            "orbax would restore them in the saved layout. Pass the state from init_state (or "
            "jax.eval_shape of it with NamedShardings), so every leaf says where it goes.")
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


@jax.jit
def _all_finite(leaves: list) -> jax.Array:
    checks = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


def _on_main(fn) -> None:
    """Run a file-system change on process 0 only, then wait for every process."""
    if jax.process_index() == 0:
        fn()
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"jaxcolossal checkpoint {fn.__name__}")


class CheckpointManager:
    """Orbax ``CheckpointManager`` with the retention and recovery rules above.

    Args:
        directory: where step folders go (created; made absolute).
        max_to_keep: how many most recent checkpoints to keep (the best is kept besides).
        async_save: write in a background thread while training continues.
        config: the run's config as a plain dict (``Config.to_dict()``), saved with every step.
    """

    def __init__(self, directory: str, max_to_keep: int = 3, async_save: bool = True,
                 config: dict | None = None):
        self.directory = os.path.abspath(directory)
        self.config = config or {}
        policy = _policies.AnyPreservationPolicy([
            _policies.LatestN(n=max_to_keep),
            _policies.BestN(get_metric_fn=lambda m: m["val_loss"], reverse=True, n=1,
                            keep_checkpoints_without_metrics=False),
        ])
        options = ocp.CheckpointManagerOptions(preservation_policy=policy, create=True,
                                               best_fn=lambda m: m["val_loss"], best_mode="min",
                                               enable_async_checkpointing=async_save)
        handlers = {"state": ocp.StandardCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def save(self, step: int, state: Any, val_loss: float | None = None, force: bool = False) -> None:
        """Start saving ``state`` as ``step`` (returns at once when async). ``val_loss``, when
        given and finite, makes the step a candidate for "best".

        Raises:
            NonFiniteStateError: ``state`` holds NaN or inf (nothing is written).
            CheckpointError: orbax refused the step (it is not above the newest step on disk).
        """
        if not bool(_all_finite(jax.tree.leaves(state))):
            raise NonFiniteStateError(
                f"step {step}: the train state holds NaN or inf values; it was not saved to {self.directory}, "
                "so the finite checkpoints there are kept")
        metrics = None
        if val_loss is not None:
            if math.isfinite(val_loss):
                metrics = {"val_loss": float(val_loss)}
            else:
                warnings.warn(f"step {step}: val_loss is {val_loss}; saved without it, so it cannot rank as the "
                              "best checkpoint", RuntimeWarning, stacklevel=2)
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(self.config))
        if not self._mngr.save(int(step), args=args, metrics=metrics, force=force):
            raise CheckpointError(
                f"step {step} was not saved: {self.directory} already holds step {self.latest_step()}, and "
                "orbax writes only steps above the newest one. Resume from there (training.resume=true), "
                "use another checkpoint.dir, or clear it (checkpoint.overwrite=true)")

    def all_steps(self) -> list[int]:
        """Complete steps on disk, oldest first."""
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self._mngr.latest_step()

    def best_step(self) -> int | None:
        """The kept step with the lowest saved ``val_loss``, or None."""
        return self._mngr.best_step()

    def saved_config(self, step: int) -> dict:
        """The config saved with ``step`` (``{}`` for a step saved without one).

        Raises:
            Exception: from orbax, when the step's files cannot be read.
        """
        if self._state_dir(step).endswith(LEGACY_ITEM):
            return {}
        return self._mngr.restore(int(step), args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"] or {}

    def _state_dir(self, step: int) -> str:
        legacy = os.path.join(self.directory, str(step), LEGACY_ITEM)
        return legacy if os.path.isdir(legacy) else os.path.join(self.directory, str(step), "state")

    def _state_metadata(self, step: int) -> Any:
        """The saved state's tree metadata; raises when the step cannot be read (it is damaged)."""
        if self._state_dir(step).endswith(LEGACY_ITEM):
            with ocp.StandardCheckpointer() as c:
                return c.metadata(self._state_dir(step)).item_metadata
        meta = self._mngr.item_metadata(int(step))
        if "state" not in meta.keys() or meta["state"] is None:
            raise CheckpointError(f"step {step} holds no 'state' item")
        return meta["state"]

    def _restore_state(self, step: int, abstract: Any, only: tuple[str, ...] | None = None) -> Any:
        if only is not None:  # a part of the state: the saved arrays of the other fields are never read
            item = {f: getattr(abstract, f) for f in only if getattr(abstract, f) is not None}
            with ocp.PyTreeCheckpointer() as c:
                out = c.restore(self._state_dir(step), args=ocp.args.PyTreeRestore(
                    item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
            return {f: jax.tree.unflatten(jax.tree.structure(v), jax.tree.leaves(out[f])) for f, v in item.items()}
        if self._state_dir(step).endswith(LEGACY_ITEM):
            with ocp.StandardCheckpointer() as c:
                return c.restore(self._state_dir(step), abstract)
        return self._mngr.restore(int(step), args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]

    def _check_layout(self, step: int, target: Any, only: tuple[str, ...] | None = None) -> None:
        """Raise :class:`CheckpointMismatchError` when ``step``'s saved tree differs from ``target``
        (in the top-level fields ``only``, when given); any other failure to read the metadata
        propagates (the step is damaged)."""
        saved, want = _saved_layout(self._state_metadata(step)), _target_layout(target)
        if only is not None:
            saved = {k: v for k, v in saved.items() if k.split(".")[0] in only}
            want = {k: v for k, v in want.items() if k.split(".")[0] in only}
        diff = [f"{k}: saved {saved.get(k, '(absent)')}, now {want.get(k, '(absent)')}"
                for k in sorted(dict.fromkeys([*saved, *want]), key=lambda k: (not k.startswith("params"), k))
                if saved.get(k) != want.get(k)]
        if diff:
            try:
                keys = config_diff(self.saved_config(step), self.config)
            except Exception:  # noqa: BLE001 - the layout difference is the error; keys are a hint
                keys = []
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} does not fit this run. "
                + (f"Config keys that differ: {'; '.join(keys)}. " if keys else "")
                + f"{len(diff)} state arrays differ ({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''}). "
                + "Restore with the saved model, optimizer and precision settings, or start a new "
                  "checkpoint.dir (a different parallel layout is fine).")

    def quarantine(self, step: int) -> str:
        """Move ``step``'s folder to ``<dir>/damaged/<step>-<UTC time>`` so that it no longer counts
        as a step; returns the new path."""
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
        dest = os.path.join(self.directory, DAMAGED_DIR, f"{step}-{stamp}")

        def move_damaged_step():
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.move(os.path.join(self.directory, str(step)), dest)

        _on_main(move_damaged_step)
        self._mngr.reload()
        return dest

    def clear(self) -> list[int]:
        """Delete every step folder (``checkpoint.overwrite``); returns the steps deleted."""
        steps = step_dirs(self.directory)

        def delete_steps():
            for s in steps:
                shutil.rmtree(os.path.join(self.directory, str(s)))

        _on_main(delete_steps)
        self._mngr.reload()
        return steps

    def restore(self, target: Any, step: int | None = None, only: tuple[str, ...] | None = None) -> Any:
        """Restore ``step`` — by default the newest step that restores cleanly — into the
        shapes, dtypes and shardings of ``target`` (a state or :func:`abstract_like` tree).

        ``only``: the top-level fields of ``target`` (a ``TrainState``) to read, e.g. ``("step",
        "params", "frozen")`` to sample from or evaluate the policy of a post-training run; the other
        fields keep ``target``'s values and their saved arrays (a DPO or GRPO run's frozen
        ``reference.*``, the optimizer state) are neither compared nor read.

        Without ``step``, a step that cannot be read (truncated files, an empty or foreign folder)
        is skipped with one warning through the run's logger (the step and :func:`damage_reason`;
        the full error at DEBUG) and moved to ``<dir>/damaged/``; the next older one is tried.

        Raises:
            ValueError: a leaf of ``target`` carries no sharding.
            CheckpointMismatchError: the saved state has other shapes than ``target``.
            CheckpointNotFoundError: no checkpoint in the directory, or none restores (a ``FileNotFoundError``).
        """
        abstract = abstract_like(target)

        def read(s: int) -> Any:
            self._check_layout(s, abstract, only)
            got = self._restore_state(s, abstract, only)
            return got if only is None else target.replace(**got)
        if step is not None:
            return read(step)
        self._mngr.reload()
        for s in reversed(step_dirs(self.directory)):
            try:
                return read(s)
            except CheckpointMismatchError:
                raise
            except Exception as e:  # a corrupt, truncated or foreign step: move it aside, try the previous one
                dest = self.quarantine(s)
                log = get_dist_logger()
                log.warning(f"checkpoint step {s} is skipped: {damage_reason(e)}; it was moved to {dest} and an "
                            "older step is tried", ranks=[0])
                log.debug(f"checkpoint step {s}: {type(e).__name__}: {e}", ranks=[0])
        raise CheckpointNotFoundError(f"no restorable checkpoint in {self.directory}")

    def restore_params(self, step: int | None = None, prefer_master: bool = True) -> tuple[dict, int]:
        """Host (numpy) copy of the model weights of ``step`` (default: the newest), for export.

        Reads only the ``master`` (fp32, in bf16/fp16 runs, when ``prefer_master``) or ``params``
        subtree, on one process with any number of devices; a LoRA run's adapters come merged into
        its frozen base's dict (``layers.wq_lora_a`` ... beside ``layers.wq``, as the model reads them). Returns ``(params, step)``; the
        vocabulary padding is still there.

        Raises:
            CheckpointNotFoundError: no step in the directory (a ``FileNotFoundError``).
        """
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise CheckpointNotFoundError(f"no checkpoint in {self.directory}")
        tree = self._state_metadata(step).tree
        key = "master" if prefer_master and tree.get("master") is not None else "params"
        keys = [key] + (["frozen"] if tree.get("frozen") is not None else [])
        item = {k: jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree[k], is_leaf=_has_shape)
                for k in keys}
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        with ocp.PyTreeCheckpointer() as ckptr:
            out = ckptr.restore(self._state_dir(step), args=ocp.args.PyTreeRestore(item=item, restore_args=as_numpy,
                                                                  partial_restore=True))
        if "frozen" in out:  # LoRA: the trained adapters' layer leaves beside the frozen base's, every layer stack
            frozen = out["frozen"]
            return {**frozen, **{g: {**frozen[g], **leaves} for g, leaves in out[key].items()}}, step
        return out[key], step

    def wait(self) -> None:
        """Block until pending async saves are on disk."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release orbax's threads."""
        self._mngr.wait_until_finished()
        self._mngr.close()
