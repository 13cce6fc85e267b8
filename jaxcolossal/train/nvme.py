"""The NVMe tier (ZeRO-Infinity): the offloaded optimizer state lives in files, not in memory.

With ``offload.nvme_path`` set, the leaves that ``offload_optim_frac`` offloads (their fp32 master
copy in mixed precision, and Adam's m and v; :mod:`jaxcolossal.memory.placement` picks them) are kept in
files under that folder instead of pinned host memory. Between steps the train state holds, in
their place, a **token** per leaf: an int32 ``[num_devices]`` array (4 bytes a device) that each
step passes on. Inside the step the streamed update (:func:`jaxcolossal.train.offload.make_offload_update`,
``optimizer_device=device``) reads one leaf's shards (``io_callback`` inside ``shard_map``, each
device its own shard), updates it with the (fused) AdamW on the device, and writes it back, one
leaf after the other, so that memory holds about one leaf's optimizer state at a time (Rajbhandari
et al., 2021, ZeRO-Infinity; DeepSpeed's ``offload_optimizer: {device: nvme}``).

**Files.** ``{nvme_path}/gen{g}/p{k:03d}_{j}.d{d:05d}.bin``: parameter leaf ``k`` (in the params'
flatten order), part ``j`` (master, then the optimizer state's leaves in the state's order),
device ``d`` (its row-major position in the mesh), raw little-endian fp32 in the shard's shape.
Each process writes only its own devices' shards, so ``nvme_path`` may be a node-local disk.

**Never a mix of two steps.** There are two generations: the state after ``s`` steps is in
``gen{s % 2}``; step ``s`` reads it and writes ``gen{(s + 1) % 2}``. Each device has a manifest,
``MANIFEST.d{d}.json`` = ``{"step": s, "gen": s % 2}``, replaced atomically (write, fsync,
rename) only once every file of that state is written and fsynced: at the start of the next step
(a callback that takes every leaf's token, so it runs after all the previous step's writes) or
by :meth:`NvmeTier.commit`. A crash in the middle of a step's writes leaves the manifest on the
previous, complete generation, which that step does not touch.

**Checkpoints** hold the whole state: :meth:`NvmeTier.fill` reads the committed generation back
into pinned-host arrays for orbax, and :meth:`NvmeTier.spill` writes a restored state out, so a
checkpoint restores onto another layout or without NVMe, as any other. Both pass the NVMe part
of the state through host memory whole, once (at start and at each save).

Raises :class:`NvmeError` when a file is missing, has the wrong size, or the manifest does not
match the step asked for.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.config import ConfigError
from jaxcolossal.memory.placement import HOST
from jaxcolossal.parallel.sharding import is_named_sharding
from jaxcolossal.train.state import state_shardings

GENERATIONS = 2
"""The state after ``s`` steps is in ``gen{s % 2}``."""
NVME = "nvme"
"""The memory-report key of the NVMe tier (next to ``device`` and ``pinned_host``)."""


class NvmeError(RuntimeError):
    """An NVMe-tier file is missing or damaged, or holds another step than the state's."""


def _fsync_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _count_shardings(tree: Any) -> int:
    """How many ``NamedSharding`` leaves ``tree`` has."""
    return len(jax.tree.leaves(tree, is_leaf=is_named_sharding))


class NvmeTier:
    """The NVMe-resident part of a train state (see the module docstring).

    Args:
        plan: the :class:`~jaxcolossal.train.state.TrainPlan`; ``plan.cfg.offload.nvme_path`` is
            the folder (created if missing), ``plan.placement.optim`` the leaves that go there.
        tx: the optax optimizer whose state the train state holds.

    Attributes:
        shardings: the *runtime* train state's shardings: the full state's, with each NVMe leaf's
            replaced by its token's (int32 ``[num_devices]`` over every mesh axis, device memory).
        slots: ``{flat index in the TrainState: (k, j)}`` for the NVMe leaves.
    """

    def __init__(self, plan: Any, tx: optax.GradientTransformation):
        self.path = os.path.abspath(plan.cfg.offload.nvme_path)
        self.mesh = mesh = plan.mesh
        self.full_shardings = full = state_shardings(plan, tx)
        n_params = len(jax.tree.leaves(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple)))
        index = jax.tree.unflatten(jax.tree.structure(plan.specs.opt, is_leaf=lambda x: isinstance(x, P)),
                                   list(range(n_params)))
        # which parameter leaf each master / optimizer-state leaf belongs to (-1: not param-shaped)
        owner = full.replace(
            step=-1, params=jax.tree.map(lambda _: -1, full.params, is_leaf=is_named_sharding),
            master=index if plan.mixed else None,
            opt_state=optax.tree_map_params(tx, lambda _, k: k, full.opt_state, index,
                                            transform_non_params=lambda _: -1, is_leaf=is_named_sharding),
            scaler=jax.tree.map(lambda _: -1, full.scaler, is_leaf=is_named_sharding),
            residual=jax.tree.map(lambda _: -1, full.residual, is_leaf=is_named_sharding))
        flat_sh, self.treedef = jax.tree.flatten(full, is_leaf=is_named_sharding)
        flat_owner = jax.tree.leaves(owner)
        assert len(flat_sh) == len(flat_owner)
        # the flatten order: step, params, master, opt_state, scaler, residual
        first = 1 + _count_shardings(full.params)
        end = first + _count_shardings(full.master) + _count_shardings(full.opt_state)
        self.slots, parts = {}, {}
        for i, (sh, k) in enumerate(zip(flat_sh, flat_owner)):
            in_state = first <= i < end
            if in_state and k >= 0 and sh.memory_kind == HOST:
                self.slots[i] = (k, parts.get(k, 0))
                parts[k] = parts.get(k, 0) + 1
        self.by_param = {k: sorted((i for i, (kk, _) in self.slots.items() if kk == k), key=lambda i: self.slots[i][1])
                         for k in parts}
        shapes = jax.tree.leaves(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple))
        self.shape = {i: tuple(shapes[k]) for i, (k, _) in self.slots.items()}
        self.local_shape = {i: flat_sh[i].shard_shape(self.shape[i]) for i in self.slots}
        self.leaf_sharding = {i: flat_sh[i] for i in self.slots}
        self.token_sharding = NamedSharding(mesh, P(mesh.axis_names))
        self.shardings = jax.tree.unflatten(self.treedef, [self.token_sharding if i in self.slots else s
                                                           for i, s in enumerate(flat_sh)])
        # device -> row-major position in the mesh (the same number ``_device_index`` computes inside)
        self.position = {d.id: int(i) for i, d in enumerate(mesh.devices.flat)}
        self._check_disk(plan)

    def _check_disk(self, plan: Any) -> None:
        """Create the folders, and check that the disk holds both generations of this process's
        shards (files already there from an earlier run are overwritten, so they count as free).

        Raises:
            ConfigError: the folder cannot be created or written, or the disk is too small.
        """
        key = f"offload.nvme_path={plan.cfg.offload.nvme_path!r}"
        try:
            for g in range(GENERATIONS):
                os.makedirs(os.path.join(self.path, f"gen{g}"), exist_ok=True)
            probe = os.path.join(self.path, f".probe.{os.getpid()}")
            _fsync_write(probe, b"x")
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"{key}: cannot create or write the NVMe tier's folder: {e}") from None
        local = len(self._local_positions())
        need = GENERATIONS * self.bytes_per_device() * local
        existing = sum(os.path.getsize(os.path.join(root, f)) for g in range(GENERATIONS)
                       for root, _, files in os.walk(os.path.join(self.path, f"gen{g}")) for f in files)
        free = shutil.disk_usage(self.path).free + existing
        if need > free:
            raise ConfigError(f"{key}: the NVMe tier needs {need:,} bytes on that disk (2 generations × "
                              f"{self.bytes_per_device():,} bytes × {local} local devices) but {free:,} are free; "
                              "free space, choose another folder or offload less (offload.offload_optim_frac)")

    # ------------------------------------------------------------------ files

    @property
    def active(self) -> bool:
        """True when at least one leaf lives on NVMe."""
        return bool(self.slots)

    def file(self, gen: int, slot: int, device_index: int) -> str:
        k, j = self.slots[slot]
        return os.path.join(self.path, f"gen{gen}", f"p{k:03d}_{j}.d{device_index:05d}.bin")

    def _manifest(self, device_index: int) -> str:
        return os.path.join(self.path, f"MANIFEST.d{device_index:05d}.json")

    def _commit_device(self, device_index: int, step: int) -> None:
        path = self._manifest(device_index)
        tmp = f"{path}.tmp"
        _fsync_write(tmp, json.dumps({"step": int(step), "gen": int(step) % GENERATIONS}).encode())
        os.replace(tmp, path)

    def committed_step(self, device_index: int) -> int | None:
        """The step whose state the device's manifest points to, or ``None`` without a manifest."""
        try:
            with open(self._manifest(device_index)) as f:
                return int(json.load(f)["step"])
        except FileNotFoundError:
            return None

    def _write(self, gen: int, slot: int, device_index: int, x: np.ndarray) -> None:
        _fsync_write(self.file(gen, slot, device_index), np.ascontiguousarray(x, dtype="<f4").tobytes())

    def _read(self, gen: int, slot: int, device_index: int) -> np.ndarray:
        path, shape = self.file(gen, slot, device_index), self.local_shape[slot]
        try:
            x = np.fromfile(path, dtype="<f4")
        except FileNotFoundError:
            raise NvmeError(f"NVMe tier: {path} is missing") from None
        if x.size != int(np.prod(shape)):
            raise NvmeError(f"NVMe tier: {path} holds {x.size} values, expected {int(np.prod(shape))} "
                            f"(shape {shape}); the file is damaged or from another layout")
        return x.reshape(shape).astype(np.float32)

    # ------------------------------------------------------------------ inside the step

    def _device_index(self) -> jax.Array:
        """Inside ``shard_map``: this device's row-major position in the mesh (int32 scalar)."""
        idx = jnp.zeros((), jnp.int32)
        for name in self.mesh.axis_names:
            idx = idx * self.mesh.shape[name] + jax.lax.axis_index(name)
        return idx

    def _token_struct(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((1,), jnp.int32)

    def commit_tokens(self, step: jax.Array, tokens: list) -> jax.Array:
        """Inside the step, before any write: each device's manifest := ``step`` (the state the
        step reads). Depends on every token, so it runs after all of the previous step's writes.
        Returns the token the first read waits for."""
        def cb(s, d, *_):
            self._commit_device(int(d), int(s))
            return np.zeros((1,), np.int32)

        def local(s, *toks):
            return io_callback(cb, self._token_struct(), s, self._device_index(), *toks)

        spec = P(self.mesh.axis_names)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(),) + (spec,) * len(tokens), out_specs=spec,
                             check_vma=False)(step, *tokens)

    def read(self, slots: list[int], step: jax.Array, after: jax.Array) -> list[jax.Array]:
        """Inside the step: the fp32 shards of ``slots`` for the state after ``step`` steps, each
        with its leaf's sharding (device memory), read once ``after`` (a token) exists."""
        def cb(s, d, _):
            gen = int(s) % GENERATIONS
            return tuple(self._read(gen, i, int(d)) for i in slots)

        def local(s, tok):
            out = io_callback(cb, tuple(jax.ShapeDtypeStruct(self.local_shape[i], jnp.float32) for i in slots),
                              s, self._device_index(), tok)
            return list(out)

        specs = [self.leaf_sharding[i].spec for i in slots]
        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P(self.mesh.axis_names)), out_specs=specs,
                             check_vma=False)(step, after)

    def write(self, slots: list[int], step: jax.Array, values: list[jax.Array]) -> list[jax.Array]:
        """Inside the step: write ``values`` (the state after ``step + 1`` steps) into the other
        generation, fsynced. Returns one token per slot (the runtime state's new leaves)."""
        def cb(s, d, *xs):
            gen = (int(s) + 1) % GENERATIONS
            for i, x in zip(slots, xs):
                self._write(gen, i, int(d), np.asarray(x))
            return tuple(np.zeros((1,), np.int32) for _ in slots)

        def local(s, *xs):
            return list(io_callback(cb, tuple(self._token_struct() for _ in slots), s, self._device_index(), *xs))

        spec = P(self.mesh.axis_names)
        in_specs = (P(),) + tuple(self.leaf_sharding[i].spec for i in slots)
        return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=[spec] * len(slots),
                             check_vma=False)(step, *[v.astype(jnp.float32) for v in values])

    # ------------------------------------------------------------------ between steps

    def _tokens(self) -> jax.Array:
        return jax.device_put(np.zeros((self.mesh.size,), np.int32), self.token_sharding)

    def spill(self, state: Any) -> Any:
        """The full train state -> the runtime one: writes the NVMe leaves' shards of this process
        into ``gen{step % 2}``, commits every local device's manifest, and replaces the leaves by
        tokens. The full state's buffers are not donated (the caller drops them)."""
        step = int(state.step)
        gen = step % GENERATIONS
        flat = jax.tree.leaves(state)
        if len(flat) != len(jax.tree.leaves(self.full_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))):
            raise NvmeError("NvmeTier.spill expects the full train state (was it spilled already?)")
        for i in self.slots:
            for sh in flat[i].addressable_shards:
                self._write(gen, i, self.position[sh.device.id], np.asarray(sh.data))
        for d in self._local_positions():
            self._commit_device(d, step)
        # one token array per leaf: the step donates the state, and a buffer cannot be donated twice
        return jax.tree.unflatten(self.treedef, [self._tokens() if i in self.slots else x for i, x in enumerate(flat)])

    def _local_positions(self) -> list[int]:
        return [self.position[d.id] for d in self.mesh.devices.flat if d.process_index == jax.process_index()]

    def commit(self, state: Any) -> None:
        """Wait for ``state`` (runtime form), then point every local device's manifest at its step."""
        jax.block_until_ready(state)
        for d in self._local_positions():
            self._commit_device(d, int(state.step))

    def load(self, step: int) -> dict[int, jax.Array]:
        """The committed NVMe leaves for ``step``, as arrays in pinned host memory with their
        leaves' shardings: ``{slot: array}``.

        Raises:
            NvmeError: a local device's manifest holds another step, or a file is missing or damaged.
        """
        local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        for d in local:
            have = self.committed_step(self.position[d.id])
            if have != step:
                raise NvmeError(f"NVMe tier {self.path}: device {self.position[d.id]}'s manifest holds step {have}, "
                                f"the train state is at step {step}")
        out = {}
        for i in self.slots:
            sh = self.leaf_sharding[i]
            arrays = [jax.device_put(self._read(step % GENERATIONS, i, self.position[d.id]),
                                     SingleDeviceSharding(d, memory_kind=HOST)) for d in local
                      if d in sh.addressable_devices]
            out[i] = jax.make_array_from_single_device_arrays(self.shape[i], sh, arrays)
        return out

    def fill(self, state: Any) -> Any:
        """The runtime train state -> the full one (for a checkpoint or a comparison): commits
        ``state``'s step, then reads the NVMe leaves back into pinned host memory."""
        self.commit(state)
        leaves = self.load(int(state.step))
        flat = jax.tree.leaves(state)
        return jax.tree.unflatten(self.treedef, [leaves.get(i, x) for i, x in enumerate(flat)])

    def bytes_per_device(self) -> int:
        """Bytes of the NVMe leaves' shards of one device (the first of this process)."""
        return sum(4 * int(np.prod(s)) for s in self.local_shape.values())


def nvme_tier(plan: Any, tx: optax.GradientTransformation) -> NvmeTier | None:
    """The :class:`NvmeTier` of ``plan`` (``None`` without ``offload.nvme_path`` or without an
    offloaded optimizer leaf)."""
    if not plan.cfg.offload.nvme_path or plan.placement is None or not plan.placement.any_optim:
        return None
    return NvmeTier(plan, tx)
