"""Build the device mesh from the parallel config.

One ``jax.sharding.Mesh`` with named axes ``(pp, dp, fsdp, ep, sp, tp)`` (torchtitan's ParallelDims,
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

MESH_AXES = ("pp", "dp", "fsdp", "ep", "sp", "tp")
"""Mesh axis names, outermost first (``tp`` innermost so it maps to the fastest links, then ``sp``,
whose all-to-alls and ring passes come next in volume; MaxText's data, fsdp, context, tensor)."""

DATA_AXES = ("dp", "fsdp", "ep")
"""The data-parallel group: the batch is split over all three; ZeRO shards over ``fsdp``; a mixture
of experts' routed experts are split over ``ep`` (``parallel.expert_parallel_size``)."""
EP_AXIS = "ep"

ZERO_AXIS = "fsdp"
"""The axis ZeRO shards the state over."""

PP_AXIS, SP_AXIS, TP_AXIS = "pp", "sp", "tp"


def mesh_shape(parallel: ParallelConfig) -> dict[str, int]:
    """``{pp, dp, fsdp, ep, sp, tp: size}`` for a *resolved* parallel config (no ``-1``).

    The data-parallel group ``data_parallel_size`` becomes ``fsdp`` when ``zero_stage > 0``
    (ZeRO shards over it) and ``dp`` otherwise (plain replication, DDP).
    """
    d = parallel.data_parallel_size
    if d < 1:
        raise ConfigError("mesh_shape needs a resolved ParallelConfig; call parallel.resolve(num_devices) first")
    zero = parallel.zero_stage > 0
    ep = getattr(parallel, "expert_parallel_size", 1)
    rest = d // ep  # ep is carved out of the data-parallel group
    return {
        "pp": parallel.pipeline_parallel_size,
        "dp": 1 if zero else rest,
        "fsdp": rest if zero else 1,
        "ep": ep,
        "sp": parallel.sequence_parallel_size,
        "tp": parallel.tensor_parallel_size,
    }


def data_size(shape: dict) -> int:
    """N, the data-parallel group's size (``dp × fsdp × ep``) of a mesh shape dict."""
    return shape.get("dp", 1) * shape.get("fsdp", 1) * shape.get("ep", 1)


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
