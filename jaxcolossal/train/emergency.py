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
  written once), then a background thread writes their bytes into one file, ``shards.bin`` (raw),
  with a ``meta.json`` (each shard's offset and shape, the step, process count, mesh shape, each
  leaf's shape and dtype, the shard indices, the config, the file's size and its
  :data:`CHECKSUM`) into ``<local_dir>/rank<r>/step_<step>/``, and a replica of that folder into the
  next process's folder, ``<local_dir>/rank<(r+1) mod n>/replica_of_rank<r>/step_<step>/``. Each is
  written under a temporary name; both files and the folder are fsync'ed, then the folder is renamed
  and its parent fsync'ed, so a node crash leaves either a whole step or none. The newest
  :data:`KEEP` steps are kept in each. A write that fails (a full disk, a folder gone) is logged
  once, with ``checkpoint.local_dir``, and training goes on: emergency copies never stop a run or
  its persistent checkpoints.
* **Restore** (:meth:`LocalCheckpoints.restore_newest`, collective): each process lists the steps
  it may restore (its own copy or its replica in the peer's folder, whose layout is this run's: same
  process count, mesh, shard indices, leaf shapes and dtypes, and model/optimizer/precision keys,
  and whose ``shards.bin`` has the saved size); all processes take the newest step every process
  lists (:func:`agree_step`). Each process then reads that step's own copy and verifies its
  checksum, else its replica; a step that some process cannot read whole is dropped by all, and the
  next older common step is tried; with none left, the loop restores the persistent checkpoint.
  Each process logs the copy it restored (path, step, own copy or replica). The arrays go back on
  the same devices from the saved bytes, so the state is bit-exact.

The data position and the RNG need nothing more: batches are a pure function of ``(seed, step)``,
as in the persistent checkpoints (:mod:`jaxcolossal.checkpoint`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax.experimental import multihost_utils

from jaxcolossal.checkpoint import config_diff
from jaxcolossal.runtime.dist_logger import get_dist_logger

KEEP = 2
"""Emergency checkpoints kept per folder (own and replica), newest first."""
PREFIX = "step_"
"""Step folders are ``step_<step>``; unfinished ones ``.tmp-step_<step>-<pid>``."""
SHARDS = "shards.bin"
"""The file of a step folder that holds the shards' bytes (offsets and shapes in ``meta.json``)."""
META = "meta.json"
"""The file of a step folder that describes ``shards.bin`` (layout, offsets, size, checksum)."""
MAX_STEPS_SHARED = 2 * KEEP
"""How many restorable steps each process reports in :func:`agree_step`."""
CHECKSUM = "xxh3_64"
"""The checksum of ``shards.bin``, kept beside it in ``meta.json`` as ``"checksum": ["xxh3_64", <16 hex
digits>]``: xxHash's XXH3 of 64 bits (the ``xxhash`` package, a dependency of jaxcolossal). Measured on
the 2-core CI machine: 6.4 GiB/s on one core, against 2.5 GiB/s for ``zlib.crc32``. It finds flipped,
lost or zeroed blocks, not deliberate tampering (it is not cryptographic)."""


def checksum(data: Any) -> str:
    """The :data:`CHECKSUM` of ``data`` (bytes or any buffer: a ``uint8`` array, a memoryview) as 16
    hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


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


def _bytes(a: np.ndarray) -> memoryview:
    """The bytes of ``a`` in C order (bfloat16, float8: their bytes)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def _write_shards(path: str, host: list[np.ndarray]) -> list[list]:
    """Write the arrays' bytes one after another into ``path`` and fsync it; returns
    ``[[offset, shape], ...]``. Raises OSError."""
    index, offset = [], 0
    with open(path, "wb") as f:
        for a in host:
            f.write(_bytes(a))
            index.append([offset, list(np.shape(a))])
            offset += a.nbytes
        f.flush()
        os.fsync(f.fileno())
    return index


def _fsync_dir(path: str) -> None:
    """fsync the folder ``path`` (its entries: the names created or renamed in it). Raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_step(folder: str, name: str, host: list[np.ndarray], meta: dict) -> None:
    """Write one copy, ``<folder>/<name>/`` (``shards.bin`` and ``meta.json``), under a temporary name:
    both files and that folder fsync'ed, then renamed and ``folder`` fsync'ed, so a crash at any
    point leaves the whole step or none of it; then keep the newest :data:`KEEP` steps of ``folder``.

    Raises:
        OSError: the copy could not be written (the temporary folder is removed first).
    """
    tmp, final = os.path.join(folder, f".tmp-{name}-{os.getpid()}"), os.path.join(folder, name)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        meta = {**meta, "arrays": _write_shards(os.path.join(tmp, SHARDS), host)}
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(folder, KEEP)


def _layout(state: Any, mesh_shape: dict, config: dict) -> dict:
    """The meta of ``state`` on this process: leaves (name, shape, dtype), shard keys, process count, mesh."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return {"process_count": jax.process_count(), "mesh_shape": {k: int(v) for k, v in mesh_shape.items()},
            "leaves": [[jax.tree_util.keystr(p), list(x.shape), jnp.dtype(x.dtype).name] for p, x in flat],
            "shards": [sorted(_wanted(x)) for _, x in flat], "config": config}


@dataclasses.dataclass
class Copy:
    """One copy of a step that :meth:`LocalCheckpoints.load` read whole (its checksum matched)."""

    step: int
    path: str
    """Its step folder."""
    which: str
    """``"its own copy"`` or ``"its replica in process <p>'s folder"``."""
    meta: dict
    raw: np.ndarray
    """The bytes of its ``shards.bin`` (``uint8``)."""


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
        self.failures: list[str] = []
        """The copies that could not be written in this run, one line each (:meth:`_failed`)."""
        self._summarized = False

    def due(self, step: int) -> bool:
        """Whether ``step`` gets an emergency checkpoint."""
        return self.every > 0 and step % self.every == 0

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any) -> None:
        """Copy this process's shards of ``state`` to host memory, then write them in the background
        (the previous write is waited for first). A copy that cannot be written is logged, not raised
        (:meth:`_failed`); raises what else the previous write raised (a bug, not the disk)."""
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
        """Write the copy into the own folder, then the replica into the peer's (:func:`_write_step`),
        with the size and :data:`CHECKSUM` of their ``shards.bin`` in ``meta.json``. A folder that
        cannot be written (OSError) is left out and logged (:meth:`_failed`)."""
        digest = xxhash.xxh3_64()
        for a in host:
            digest.update(_bytes(a))
        meta["nbytes"] = sum(int(a.nbytes) for a in host)
        meta["checksum"] = [CHECKSUM, digest.hexdigest()]
        for folder in (self.own, self.replica):
            try:
                _write_step(folder, f"{PREFIX}{step}", host, meta)
            except OSError as e:
                self._failed(step, folder, e)

    def _failed(self, step: int, folder: str, error: OSError) -> None:
        """Record a copy that could not be written; the first is logged at once (on this process), the
        count at :meth:`close`. The run goes on: the persistent checkpoints do not depend on these."""
        self.failures.append(f"step {step} in {folder}: {error}")
        if len(self.failures) == 1:
            get_dist_logger().warning(
                f"process {jax.process_index()}: emergency checkpoint of step {step} not written in {folder} "
                f"({error}); check checkpoint.local_dir={self.directory!r}. Training goes on, and the persistent "
                "checkpoints (checkpoint.dir) are not affected")

    def wait(self) -> None:
        """Block until the pending write is done. Raises what it raised other than OSError (a bug)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Wait for the pending write, then stop the writer thread; log how many copies could not be
        written in this run when more than one (once)."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if len(self.failures) > 1 and not self._summarized:
                self._summarized = True
                get_dist_logger().warning(
                    f"process {jax.process_index()}: {len(self.failures)} emergency checkpoint copies could not be "
                    f"written in this run (the last: {self.failures[-1]}); checkpoint.local_dir={self.directory!r}")

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

    def _sources(self) -> list[tuple[str, str]]:
        """``(folder, which)`` of this process's copies in the order they are tried: its own folder,
        then its replica in the peer's."""
        peer = (jax.process_index() + 1) % jax.process_count()
        return [(self.own, "its own copy"), (self.replica, f"its replica in process {peer}'s folder")]

    def find(self, step: int, target: Any) -> str | None:
        """The folder of ``step`` that fits ``target`` by its meta and size (own copy first, else the
        replica), or None; its bytes are not read (:meth:`load` checks them)."""
        want = _layout(target, self.mesh_shape, {})
        for folder, _ in self._sources():
            path = os.path.join(folder, f"{PREFIX}{step}")
            if _fits(path, want, self.config):
                return path
        return None

    def available(self, target: Any) -> list[int]:
        """The steps this process may restore into ``target``'s layout (by :meth:`find`), newest first."""
        steps = sorted({s for f, _ in self._sources() for s in _steps(f)}, reverse=True)
        return [s for s in steps if self.find(s, target) is not None]

    def load(self, step: int, target: Any) -> Copy | None:
        """This process's copy of ``step`` that fits ``target`` and whose bytes match their checksum:
        its own copy, else its replica (:meth:`_sources`). Each copy passed over (damaged: truncated,
        wrong bytes, unreadable meta) is named in a warning on this process. None when neither is whole."""
        want, log = _layout(target, self.mesh_shape, {}), get_dist_logger()
        sources = self._sources()
        for i, (folder, which) in enumerate(sources):
            path = os.path.join(folder, f"{PREFIX}{step}")
            if not os.path.isdir(path):
                continue
            try:
                meta, raw = _read(path, want, self.config)
            except Unfit as e:
                then = f"trying {sources[i + 1][1]}" if i + 1 < len(sources) else "no copy of this step is left here"
                log.warning(f"process {jax.process_index()}: emergency step {step}: {which} {path} {e}; {then}")
                continue
            return Copy(step, path, which, meta, raw)
        return None

    def restore(self, step: int, target: Any) -> tuple[Any, str]:
        """``(state, folder)``: ``step``'s state in ``target``'s shardings (bit-exact), read from this
        process's own copy or else its replica (:meth:`load`; ``folder``: the one read).

        Raises:
            FileNotFoundError: no whole copy of ``step`` that fits ``target`` here.
        """
        copy = self.load(step, target)
        if copy is None:
            raise FileNotFoundError(f"no whole emergency checkpoint of step {step} for this process in "
                                    f"{self.directory}")
        return _assemble(copy, target), copy.path

    def restore_newest(self, target: Any, newer_than: int | None = None) -> tuple[Any, Copy] | None:
        """The newest step above ``newer_than`` (the newest persistent step; None: any) that every
        process holds whole, restored into ``target``'s shardings (bit-exact). A collective: every
        process calls it. The steps every process lists (:meth:`available`, :func:`agree_step`) are
        tried newest first: each process reads its own copy, else its replica (:meth:`load`); a step
        that some process cannot read whole is dropped by all, and the next older one tried. Each
        process logs the copy it restored (its path, step, own copy or replica).

        Returns:
            ``(state, copy)``, or None: no such step (the caller restores the persistent checkpoint).
        """
        log, r = get_dist_logger(), jax.process_index()
        steps = [s for s in self.available(target) if newer_than is None or s > newer_than]
        while (step := agree_step(steps)) is not None:
            copy = self.load(step, target)
            if _everywhere(copy is not None):
                log.info(f"process {r}: restored emergency step {step} from {copy.path} ({copy.which})")
                return _assemble(copy, target), copy
            steps = [s for s in steps if s < step]
            log.warning(f"emergency step {step} is not whole on every process (each process's warnings name its "
                        "damaged copies): skipped; an older step, else the persistent checkpoint, is restored",
                        ranks=[0])
        return None


def _assemble(copy: Copy, target: Any) -> Any:
    """The state in ``target``'s shardings from ``copy``'s bytes: each shard put back on this process's
    devices that hold it (offloaded leaves in host memory), bit-exact."""
    flat, treedef = jax.tree.flatten(target)
    out, n = [], 0
    for x, keys in zip(flat, copy.meta["shards"]):
        dtype = jnp.dtype(x.dtype)
        data = {}
        for i, k in enumerate(keys):
            offset, shape = copy.meta["arrays"][n + i]
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            data[k] = copy.raw[offset:offset + size].view(dtype).reshape(shape)
        n += len(keys)
        kind = getattr(x.sharding, "memory_kind", None)  # offloaded leaves go back to host memory
        arrays = [jax.device_put(data[_index_key(idx)], jax.sharding.SingleDeviceSharding(d, memory_kind=kind))
                  for d, idx in x.sharding.addressable_devices_indices_map(x.shape).items()]
        out.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays))
    return jax.tree.unflatten(treedef, out)


def _steps(folder: str) -> list[int]:
    """The complete step folders in ``folder``, oldest first."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(n[len(PREFIX):]) for n in os.listdir(folder)
                  if n.startswith(PREFIX) and n[len(PREFIX):].isdigit())


def _prune(folder: str, keep: int) -> None:
    for s in _steps(folder)[:-keep]:
        shutil.rmtree(os.path.join(folder, f"{PREFIX}{s}"), ignore_errors=True)


class Unfit(Exception):
    """A step folder that cannot be restored into this run; the message says why (``is truncated:
    ...``), to follow the folder's path."""


def _check(path: str, want: dict, config: dict) -> dict:
    """The meta of the step folder ``path`` when its ``shards.bin`` has the saved size and a
    :data:`CHECKSUM`, and it was saved in the layout ``want`` (:func:`_layout`) with the same
    state-shaping config keys as ``config``; its bytes are not read.

    Raises:
        Unfit: why not, e.g. ``is truncated: shards.bin holds 100 bytes of the 4096 saved``.
    """
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
        size, saved = os.path.getsize(os.path.join(path, SHARDS)), int(meta["nbytes"])
        kind, _ = meta.get("checksum") or (None, None)
    except FileNotFoundError as e:
        raise Unfit(f"lacks {os.path.basename(e.filename or '')}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise Unfit(f"has an unreadable {META} ({type(e).__name__}: {e})") from None
    if size != saved:
        what = "truncated" if size < saved else "too long"
        raise Unfit(f"is {what}: {SHARDS} holds {size} bytes of the {saved} saved")
    if kind != CHECKSUM:
        raise Unfit(f"has no {CHECKSUM} checksum of {SHARDS} (saved by an older version: not trusted)")
    same = all(meta.get(k) == want[k] for k in ("process_count", "mesh_shape", "leaves", "shards"))
    if not same or config_diff(meta.get("config", {}), config):
        raise Unfit("was saved in another layout (processes, mesh, leaves) or model/optimizer/precision settings")
    return meta


def _fits(path: str, want: dict, config: dict) -> bool:
    """Whether :func:`_check` passes the step folder ``path`` (its meta and size; not its bytes)."""
    try:
        _check(path, want, config)
    except Unfit:
        return False
    return True


def _read(path: str, want: dict, config: dict) -> tuple[dict, np.ndarray]:
    """``(meta, bytes of shards.bin)`` of the step folder ``path``, checked (:func:`_check`) and its
    bytes verified against the saved :data:`CHECKSUM`.

    Raises:
        Unfit: why it cannot be restored (its checksum differs, it is truncated, ...).
    """
    meta = _check(path, want, config)
    try:
        raw = np.fromfile(os.path.join(path, SHARDS), np.uint8)
    except OSError as e:
        raise Unfit(f"cannot be read ({e})") from None
    got, saved = checksum(raw), meta["checksum"][1]
    if raw.size != meta["nbytes"] or got != saved:
        raise Unfit(f"fails its checksum: {SHARDS} has {CHECKSUM} {got}, {saved} was saved (damaged bytes)")
    return meta, raw


def _everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (a collective over all processes: each calls it)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(np.asarray(multihost_utils.process_allgather(np.array([int(ok)], np.int32)))))


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
