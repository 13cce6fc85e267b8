"""Emergency (local) checkpoints: frequent, cheap copies of the train state beside the persistent
ones (``checkpoint.local_every``, ``checkpoint.local_dir``; docs/fault_tolerance.md).

Why not Orbax's emergency checkpoint manager (orbax-checkpoint 0.12.8,
``orbax.checkpoint.experimental.emergency``, read, not run): its ``CheckpointManager`` keeps local
copies only with at least two *replicas* of the whole state along one mesh axis (multi-slice TPU: a
slice that lost its local copy is restored by broadcast from one that has it); with one replica it
drops the local directory and is a plain persistent manager. A ZeRO layout shards the state over
``fsdp`` and the main job's ``dp`` axis is 1, so it would keep nothing locally. Its
``ReplicatorCheckpointManager`` needs GKE's multi-tier checkpointing replicator service. So each
process keeps its own copy:

* **Save** (every ``local_every`` steps): each process copies the shards it holds of every leaf of
  the state to host memory (one copy per distinct shard index: replicas on its own devices are
  written once), then a background thread writes their bytes into one file, ``shards.bin`` (raw,
  no archive or checksum to compute), with a ``meta.json`` (each shard's offset and shape, the step,
  process count, mesh shape, each leaf's shape and dtype, the shard indices, the config) into
  ``<local_dir>/rank<r>/step_<step>/`` (written under a temporary name, renamed when complete),
  and a replica of that folder into the next process's folder,
  ``<local_dir>/rank<(r+1) mod n>/replica_of_rank<r>/step_<step>/``. The newest
  :data:`KEEP` steps are kept in each.
* **Restore** (:func:`agree_step`, :meth:`LocalCheckpoints.restore`): each process lists the steps it
  can restore (its own copy, else its replica in the peer's folder) whose layout is this run's (same
  process count, mesh, shard indices, leaf shapes and dtypes, and the model/optimizer/precision
  keys); all processes gather these lists and take the newest step every process has. The loop
  restores it when it is newer than the newest persistent checkpoint; the arrays are put back on
  the same devices from the saved bytes, so the state is bit-exact.

The data position and the RNG need nothing more: batches are a pure function of ``(seed, step)``,
as in the persistent checkpoints (:mod:`jaxcolossal.checkpoint`).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxcolossal.checkpoint import config_diff

KEEP = 2
"""Emergency checkpoints kept per folder (own and replica), newest first."""
PREFIX = "step_"
"""Step folders are ``step_<step>``; unfinished ones ``.tmp-step_<step>-<pid>``."""
SHARDS = "shards.bin"
"""The file of a step folder that holds the shards' bytes (offsets and shapes in ``meta.json``)."""
MAX_STEPS_SHARED = 2 * KEEP
"""How many restorable steps each process reports in :func:`agree_step`."""


def default_local_dir(checkpoint_dir: str) -> str:
    """``<tmp>/jaxcolossal-local/<basename>-<8 hex of sha1(abspath)>`` for ``checkpoint.dir``."""
    path = os.path.abspath(checkpoint_dir)
    tag = hashlib.sha1(path.encode()).hexdigest()[:8]
    return os.path.join(tempfile.gettempdir(), "jaxcolossal-local", f"{os.path.basename(path) or 'ckpt'}-{tag}")


def local_dir(cfg) -> str:
    """The run's emergency checkpoint folder: ``checkpoint.local_dir``, else :func:`default_local_dir`."""
    return os.path.abspath(cfg.checkpoint.local_dir or default_local_dir(cfg.checkpoint.dir))


def any_local_steps(directory: str) -> bool:
    """Whether ``directory`` holds a complete emergency checkpoint of any process (folder names only)."""
    if not os.path.isdir(directory):
        return False
    return any(n.startswith(PREFIX) for _, dirs, _ in os.walk(directory) for n in dirs)


def _index_key(index: tuple) -> str:
    """A shard's index (a tuple of slices) as text: ``"0:4,:"``."""
    return ",".join(f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}" for s in index)


def _wanted(leaf: Any) -> dict[str, list]:
    """``{index key: [devices]}``: the shards of ``leaf`` (a jax.Array or abstract array with a
    sharding) that this process holds."""
    out: dict[str, list] = {}
    for dev, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
        out.setdefault(_index_key(index), []).append(dev)
    return out


def _write_shards(path: str, host: list[np.ndarray]) -> list[list]:
    """Write the arrays' bytes one after another into ``path``; returns ``[[offset, shape], ...]``."""
    index, offset = [], 0
    with open(path, "wb") as f:
        for a in host:
            shape = list(np.shape(a))
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)  # bfloat16, float8: their bytes
            index.append([offset, shape])
            offset += a.nbytes
    return index


def _layout(state: Any, mesh_shape: dict, config: dict) -> dict:
    """The meta of ``state`` on this process: leaves (name, shape, dtype), shard keys, process count, mesh."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {"process_count": jax.process_count(), "mesh_shape": {k: int(v) for k, v in mesh_shape.items()},
            "leaves": [[jax.tree_util.keystr(p), list(x.shape), jnp.dtype(x.dtype).name] for p, x in flat],
            "shards": [sorted(_wanted(x)) for _, x in flat], "config": config}


class LocalCheckpoints:
    """One process's emergency checkpoints (see the module's docstring).

    Args:
        directory: ``checkpoint.local_dir`` (resolved: :func:`local_dir`).
        every: ``checkpoint.local_every`` (steps, > 0).
        mesh_shape: the run's mesh shape (``{"dp": 2, ...}``), part of the layout.
        config: the run's config dict (its state keys are compared at restore).
    """

    def __init__(self, directory: str, every: int, mesh_shape: dict, config: dict):
        self.directory, self.every, self.mesh_shape, self.config = directory, every, dict(mesh_shape), config
        r, n = jax.process_index(), jax.process_count()
        self.own = os.path.join(directory, f"rank{r}")
        self.replica = os.path.join(directory, f"rank{(r + 1) % n}", f"replica_of_rank{r}")
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="jaxcolossal-local-ckpt")
        self._pending: concurrent.futures.Future | None = None

    def due(self, step: int) -> bool:
        """Whether ``step`` gets an emergency checkpoint."""
        return self.every > 0 and step % self.every == 0

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any) -> None:
        """Copy this process's shards of ``state`` to host memory, then write them in the background
        (the previous write is waited for first). Raises what the previous write raised."""
        self.wait()
        flat = jax.tree.leaves(state)
        picked = [[(k, devs[0]) for k, devs in sorted(_wanted(x).items())] for x in flat]
        by_dev = [{s.device: s.data for s in x.addressable_shards} for x in flat]
        datas = [by_dev[i][dev] for i, keys in enumerate(picked) for _, dev in keys]
        for d in datas:
            d.copy_to_host_async()
        host = [np.asarray(d) for d in datas]
        meta = {"step": int(step), **_layout(state, self.mesh_shape, self.config)}
        self._pending = self._pool.submit(self._write, int(step), host, meta)

    def _write(self, step: int, host: list[np.ndarray], meta: dict) -> None:
        """Write the copy into the own folder, then the replica into the peer's, each under a
        temporary name renamed when whole; keep the newest :data:`KEEP` in each."""
        name = f"{PREFIX}{step}"
        meta["nbytes"] = sum(int(a.nbytes) for a in host)
        for folder in (self.own, self.replica):
            tmp, final = os.path.join(folder, f".tmp-{name}-{os.getpid()}"), os.path.join(folder, name)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            meta["arrays"] = _write_shards(os.path.join(tmp, SHARDS), host)
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _prune(folder, KEEP)

    def wait(self) -> None:
        """Block until the pending write is on disk. Raises what it raised (OSError)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Wait for the pending write, then stop the writer thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def clear(self) -> None:
        """Delete this process's own and replica step folders (a fresh run, or the end of a run whose
        final persistent checkpoint makes them stale)."""
        self.wait()
        for folder in (self.own, self.replica):
            for s in _steps(folder):
                shutil.rmtree(os.path.join(folder, f"{PREFIX}{s}"), ignore_errors=True)

    def drop_after(self, step: int) -> None:
        """Delete the step folders above ``step`` (after a restore from ``step``: they belong to a
        history that the resumed run replaces)."""
        for folder in (self.own, self.replica):
            for s in _steps(folder):
                if s > step:
                    shutil.rmtree(os.path.join(folder, f"{PREFIX}{s}"), ignore_errors=True)

    # ------------------------------------------------------------------ restore

    def _sources(self) -> list[str]:
        """Where this process's copies are: its own folder, then its replica in the peer's."""
        return [self.own, self.replica]

    def find(self, step: int, target: Any) -> str | None:
        """The folder of ``step`` that fits ``target`` (own copy first, else the replica), or None."""
        want = _layout(target, self.mesh_shape, {})
        for folder in self._sources():
            path = os.path.join(folder, f"{PREFIX}{step}")
            if _fits(path, want, self.config):
                return path
        return None

    def available(self, target: Any) -> list[int]:
        """The steps this process can restore into ``target``'s layout, newest first."""
        steps = sorted({s for f in self._sources() for s in _steps(f)}, reverse=True)
        return [s for s in steps if self.find(s, target) is not None]

    def restore(self, step: int, target: Any) -> tuple[Any, str]:
        """``(state, folder)``: ``step``'s state in ``target``'s shardings (bit-exact), read from this
        process's own copy or else its replica (``folder``: the one read).

        Raises:
            FileNotFoundError: no fitting copy of ``step`` here.
        """
        path = self.find(step, target)
        if path is None:
            raise FileNotFoundError(f"no emergency checkpoint of step {step} for this process in {self.directory}")
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        flat, treedef = jax.tree.flatten(target)
        out, n = [], 0
        raw = np.fromfile(os.path.join(path, SHARDS), np.uint8)
        for x, keys in zip(flat, meta["shards"]):
            dtype = jnp.dtype(x.dtype)
            data = {}
            for i, k in enumerate(keys):
                offset, shape = meta["arrays"][n + i]
                size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                data[k] = raw[offset:offset + size].view(dtype).reshape(shape)
            n += len(keys)
            kind = getattr(x.sharding, "memory_kind", None)  # offloaded leaves go back to host memory
            arrays = [jax.device_put(data[_index_key(idx)], jax.sharding.SingleDeviceSharding(d, memory_kind=kind))
                      for d, idx in x.sharding.addressable_devices_indices_map(x.shape).items()]
            out.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays))
        return jax.tree.unflatten(treedef, out), path


def _steps(folder: str) -> list[int]:
    """The complete step folders in ``folder``, oldest first."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(n[len(PREFIX):]) for n in os.listdir(folder)
                  if n.startswith(PREFIX) and n[len(PREFIX):].isdigit())


def _prune(folder: str, keep: int) -> None:
    for s in _steps(folder)[:-keep]:
        shutil.rmtree(os.path.join(folder, f"{PREFIX}{s}"), ignore_errors=True)


def _fits(path: str, want: dict, config: dict) -> bool:
    """Whether the step folder ``path`` is whole and saved in the layout ``want`` (:func:`_layout`)
    with the same state-shaping config keys as ``config``."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if os.path.getsize(os.path.join(path, SHARDS)) != meta["nbytes"]:  # truncated
            return False
    except (OSError, ValueError, KeyError):
        return False
    same = all(meta.get(k) == want[k] for k in ("process_count", "mesh_shape", "leaves", "shards"))
    return same and not config_diff(meta.get("config", {}), config)


def agree_step(steps: list[int]) -> int | None:
    """The newest step in every process's ``steps`` (a collective over all processes: each calls it),
    or None when there is none."""
    mine = np.full(MAX_STEPS_SHARED, -1, np.int64)
    mine[: min(len(steps), MAX_STEPS_SHARED)] = sorted(steps, reverse=True)[:MAX_STEPS_SHARED]
    rows = np.asarray(multihost_utils.process_allgather(mine)) if jax.process_count() > 1 else mine[None]
    common = set(rows[0].tolist())
    for row in rows[1:]:
        common &= set(row.tolist())
    common.discard(-1)
    return max(common) if common else None
