"""Build the device mesh from the parallel config.

One ``jax.sharding.Mesh`` with named axes ``(pp, dp, fsdp, sp, tp)`` (torchtitan's ParallelDims,
MaxText's mesh axes). ``tp`` is innermost, ``sp`` (sequence parallelism) next so that tensor-parallel peers are neighbouring devices
(the fastest links); ``pp`` is outermost. All axes are ``AxisType.Auto``: the train step uses
sharding constraints and lets XLA's SPMD partitioner place the collectives.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxcolossal.config import ConfigError, ParallelConfig

MESH_AXES = ("pp", "dp", "fsdp", "sp", "tp")
"""Mesh axis names, outermost first (``tp`` innermost so it maps to the fastest links, then ``sp``,
whose all-to-alls and ring passes come next in volume; MaxText's data, fsdp, context, tensor)."""

DATA_AXES = ("dp", "fsdp")
"""The data-parallel group: the batch is split over both; ZeRO shards over ``fsdp``."""

ZERO_AXIS = "fsdp"
"""The axis ZeRO shards the state over."""

PP_AXIS, SP_AXIS, TP_AXIS = "pp", "sp", "tp"


def mesh_shape(parallel: ParallelConfig) -> dict[str, int]:
    """``{pp, dp, fsdp, sp, tp: size}`` for a *resolved* parallel config (no ``-1``).

    The data-parallel group ``data_parallel_size`` becomes ``fsdp`` when ``zero_stage > 0``
    (ZeRO shards over it) and ``dp`` otherwise (plain replication, DDP).
    """
    d = parallel.data_parallel_size
    if d < 1:
        raise ConfigError("mesh_shape needs a resolved ParallelConfig; call parallel.resolve(num_devices) first")
    zero = parallel.zero_stage > 0
    return {
        "pp": parallel.pipeline_parallel_size,
        "dp": 1 if zero else d,
        "fsdp": d if zero else 1,
        "sp": parallel.sequence_parallel_size,
        "tp": parallel.tensor_parallel_size,
    }


def make_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Create the ``Mesh`` for ``parallel`` over ``devices`` (default: all devices).

    ``-1`` sizes are resolved against the number of devices first.

    Raises:
        ConfigError: the sizes do not multiply to the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    resolved = parallel.resolve(len(devices))
    shape = mesh_shape(resolved)
    sizes = tuple(shape[a] for a in MESH_AXES)
    # Process-major order keeps each host's devices contiguous, so the inner axes (tp, then the
    # data group) stay within a host and only the outer ones cross hosts.
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def platform(mesh: Mesh | jax.sharding.AbstractMesh | Sequence[jax.Device]) -> str:
    """The platform a mesh's devices compile for: ``"gpu"`` for CUDA/ROCm devices (real or
    compile-only), else the devices' own (``"cpu"``, ``"tpu"``). Every GPU-only path (Pallas
    kernels, memory kinds, XLA's GPU flags, the planner's backend) is chosen by this, never by
    ``jax.default_backend()``, so that a deviceless compile for a GPU fleet takes the GPU's paths."""
    if isinstance(mesh, Mesh):
        kind = mesh.devices.flat[0].platform
    elif hasattr(mesh, "abstract_device"):  # an AbstractMesh (inside shard_map): its device kind, if known
        kind = mesh.abstract_device.platform if mesh.abstract_device is not None else "unknown"
    else:
        kind = next(iter(mesh)).platform
    kind = kind.lower()
    return "gpu" if kind in ("gpu", "cuda", "rocm") else kind


def entry_axes(entry) -> tuple:
    """The mesh axis names of one ``PartitionSpec`` entry: ``None`` -> ``()``, ``"tp"`` ->
    ``("tp",)``, ``("dp", "fsdp")`` -> itself."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
