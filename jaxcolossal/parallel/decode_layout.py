"""The rollout's decode layout: the policy's params resharded once per rollout from the training layout
into one that decodes with no parameter collective (verl's 3D-HybridEngine, NeMo-RL's refit, Tunix's
``reshard.py``).

Training lays the params out for the step: under ZeRO-3 each weight is split over ``fsdp`` and a
sampler on that layout gathers every layer at every decoded token (the Llama-3-8B GRPO shape on 8
H200s: 13.98 GiB of all-gather per decode step and device). The decode layout keeps the same devices
as a second mesh, ``(pp 1, dp N/(tp·ep), fsdp 1, ep, sp 1, tp)`` with the devices in the training
mesh's order (``tp`` innermost, so a tp group stays within a host), and each param split over ``tp``
(and the experts over ``ep``) only: whole over the data axes. The reshard is one jitted program
whose input is the training layout and whose output is the decode layout; XLA's SPMD partitioner
moves the bytes (all-to-alls or all-gathers over the ZeRO group, a slice where tp grows), the stacked
layers one at a time so that the temporaries stay near one layer (Llama-3-8B from ZeRO-3 over 8 H200s
into tp 8: 0.12 GiB, against 1.59 GiB moving the whole tree at once). Its output is the decode copy,
``bf16 params / tp`` a device beside the resident train state, freed after the rollout.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.parallel.layer_scan import fetch_layer
from jaxcolossal.parallel.mesh import EP_AXIS, MESH_AXES, TP_AXIS, ZERO_AXIS, entry_axes

KEPT_AXES = (TP_AXIS, EP_AXIS)
"""The mesh axes a param keeps in the decode layout: tensor parallelism and the experts' split."""


def decode_mesh_shape(num_devices: int, tp: int, ep: int = 1) -> dict[str, int]:
    """The decode layout's ``{axis: size}`` on ``num_devices``: ``tp`` innermost, the training mesh's
    ``ep``, ``dp`` the rest, the other axes 1.

    Raises:
        ValueError: ``tp × ep`` does not divide the devices."""
    if tp < 1 or num_devices % (tp * ep):
        raise ValueError(f"a decode layout of tp {tp} × ep {ep} does not divide {num_devices} devices")
    return {a: 1 for a in MESH_AXES} | {"dp": num_devices // (tp * ep), EP_AXIS: ep, TP_AXIS: tp}


def decode_mesh(mesh: Mesh, tp: int) -> Mesh:
    """The decode layout's mesh (:func:`decode_mesh_shape`) on ``mesh``'s devices, in its order (so that
    one jitted program reads the training layout and writes the decode one).

    Raises:
        ValueError: ``tp × ep`` does not divide the devices."""
    devices = list(mesh.devices.flat)
    shape = decode_mesh_shape(len(devices), tp, int(mesh.shape[EP_AXIS]))
    return Mesh(np.asarray(devices, dtype=object).reshape(tuple(shape[a] for a in MESH_AXES)), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def decode_spec(spec: P, shape: tuple[int, ...], sizes: Mapping[str, int]) -> P:
    """One param's decode spec from its training ``spec`` (or its rules-table spec): each entry loses
    ZeRO's axes (``fsdp`` and what follows it: with expert parallelism ZeRO splits a dense weight over
    ``fsdp × ep``, which is no expert split) and keeps only :data:`KEPT_AXES`; a dimension that those
    axes' ``sizes`` (the decode mesh's shape) do not divide is whole."""
    out = []
    for i, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = entry_axes(entry)
        names = names[:names.index(ZERO_AXIS)] if ZERO_AXIS in names else names
        kept = tuple(a for a in names if a in KEPT_AXES)
        size = int(np.prod([sizes[a] for a in kept], dtype=np.int64))
        out.append(None if not kept or shape[i] % size else kept[0] if len(kept) == 1 else kept)
    return P(*out)


def decode_specs(params: Any, dmesh: Mesh) -> Any:
    """The ``PartitionSpec`` tree of ``params`` (arrays or ``ShapeDtypeStruct`` leaves with shardings, in
    the training layout) in the decode layout on ``dmesh`` (:func:`decode_spec`)."""
    return jax.tree.map(lambda x: decode_spec(x.sharding.spec, tuple(x.shape), dict(dmesh.shape)), params)


def make_reshard(params: Any, dmesh: Mesh) -> tuple[Callable, Any]:
    """``(reshard, specs)``: a jitted ``params -> params`` from the layout of ``params`` (the training
    layout; offloaded leaves are fetched into device memory) to the decode layout ``specs`` on
    ``dmesh`` (same dtypes, same values), and the specs. The input is not donated: training keeps it.

    The stacked layers (``params["layers"]``, ``[L, ...]`` leaves) move one layer at a time
    (:func:`_layer_by_layer`): the decode copy is allocated once and each iteration reshards one layer's
    slice into it, so the temporaries stay near one layer; the other leaves (embedding, head, norms) move
    whole."""
    specs = decode_specs(params, dmesh)
    out = jax.tree.map(lambda s: NamedSharding(dmesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    if not isinstance(params, dict) or not jax.tree.leaves(params.get("layers", {})):
        return jax.jit(fetch_layer, out_shardings=out), specs

    # a stacked leaf whose shards stay on their devices (an expert already over ep) is copied whole; the
    # others move a layer at a time
    flat, tree = jax.tree.flatten(params["layers"])
    moved = [not x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(flat, jax.tree.leaves(out["layers"]))]

    def reshard(p):
        p = fetch_layer(p)
        leaves = jax.tree.leaves(p["layers"])
        looped = iter(_layer_by_layer([a for a, m in zip(leaves, moved) if m],
                                      [s for s, m in zip(jax.tree.leaves(out["layers"]), moved) if m]))
        layers = jax.tree.unflatten(tree, [next(looped) if m else a for a, m in zip(leaves, moved)])
        return {**{k: v for k, v in p.items() if k != "layers"}, "layers": layers}
    return jax.jit(reshard, out_shardings=out), specs


def _layer_by_layer(layers: list, out: list) -> list:
    """The stacked ``layers`` (arrays ``[L, ...]``) in the shardings ``out``, one layer per iteration of a
    ``fori_loop``: the slice of layer ``l`` resharded (its decode spec without the ``L`` dimension), then
    written into the decode copy."""
    if not layers:
        return []
    one = [NamedSharding(s.mesh, P(*tuple(s.spec)[1:])) for s in out]
    copy = [jax.lax.with_sharding_constraint(jnp.zeros(a.shape, a.dtype), s) for a, s in zip(layers, out)]

    def body(i, copy):
        layer = [jax.lax.with_sharding_constraint(jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), s)
                 for a, s in zip(layers, one)]
        return [jax.lax.with_sharding_constraint(jax.lax.dynamic_update_index_in_dim(c, x, i, 0), s)
                for c, x, s in zip(copy, layer, out)]
    return jax.lax.fori_loop(0, layers[0].shape[0], body, copy)
