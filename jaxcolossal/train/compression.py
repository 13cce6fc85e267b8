"""Gradient compression for the data-parallel reduction (``parallel.gradient_compression``).

``topk`` (Lin et al., 2018, Deep Gradient Compression; the seed's top-k selection by magnitude):
instead of an all-reduce of each whole fp32 gradient, every data shard keeps the
``k = ceil(compression_ratio · M)`` elements of its gradient (``M`` per leaf) largest in
magnitude, and the shards **all-gather** those values (fp32) and their indices (int32): the bytes
on the wire per leaf fall from ``4·M`` (the all-reduce's result) to ``8·k·N`` (the all-gather's,
N = the data group). Every rank then scatter-adds the ``N·k`` pairs into a dense gradient, so the
optimizer sees the same array everywhere, as after an all-reduce.

**Error feedback** (``parallel.error_feedback``, default on): what a shard did not send stays in
a per-shard fp32 residual (``TrainState.residual``, ``[N, ...]`` sharded over the data group)
and is added to its next step's gradient, so no gradient is lost, only delayed; without it the
unsent part is dropped. The residual is part of the train state: saved, restored, and equal
after a resume.

Data-parallel traffic only (the step applies this where it would all-reduce the gradients once
per step: ``zero_stage`` 0 and 1, without tensor or pipeline parallelism; the config refuses
the rest).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcolossal.sharding import DATA_AXES


def topk_count(size: int, ratio: float) -> int:
    """Elements a shard sends of a leaf with ``size`` elements: ``ceil(ratio · size)``, at least 1."""
    return max(1, min(size, math.ceil(ratio * size)))


def _topk_leaf(g: jax.Array, e: jax.Array | None, ratio: float, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """One leaf: ``g`` fp32 ``[N, *shape]`` per-shard gradients (sharded over the data group on dim
    0), ``e`` the residual of the same shape or ``None``. Returns the dense sum over the shards of
    what they sent (fp32 ``shape``, replicated) and the new residual (``[N, *shape]``)."""
    n, shape = g.shape[0], g.shape[1:]
    m = math.prod(shape)
    k = topk_count(m, ratio)
    rows = P(DATA_AXES, None)
    flat = jax.lax.with_sharding_constraint((g if e is None else g + e).reshape(n, m), NamedSharding(mesh, rows))

    def select(f):  # on each device, its own shard's rows (XLA would gather a global top_k first)
        _, i = jax.lax.top_k(jnp.abs(f), k)
        v = jnp.take_along_axis(f, i, axis=1)
        return v, i, f.at[jnp.arange(f.shape[0])[:, None], i].set(0.0)  # what was not sent

    vals, idx, residual = jax.shard_map(select, mesh=mesh, in_specs=rows, out_specs=(rows, rows, rows))(flat)
    # the exchange: values and indices all-gathered over the data group
    everywhere = NamedSharding(mesh, P())
    vals = jax.lax.with_sharding_constraint(vals, everywhere)
    idx = jax.lax.with_sharding_constraint(idx, everywhere)
    dense = jnp.zeros((m,), jnp.float32).at[idx.reshape(-1)].add(vals.reshape(-1))
    return dense.reshape(shape), residual.reshape(g.shape)


def topk_reduce(grads: Any, residual: Any, ratio: float, mesh: Mesh) -> tuple[Any, Any]:
    """Top-k compressed sum over the data group of per-shard gradients.

    Args:
        grads: fp32 param-shaped tree, each leaf ``[N, ...]`` (N = dp·fsdp), sharded
            ``P(("dp", "fsdp"), ...)``: the step's unreduced per-shard gradient sums.
        residual: the same shapes (error feedback), or ``None`` (none kept).
        ratio: ``parallel.compression_ratio`` in (0, 1].
        mesh: the device mesh.

    Returns:
        ``(summed, new_residual)``: fp32 param-shaped sums (replicated; the caller constrains them
        to the gradient sharding) and the residual tree (``None`` when ``residual`` is ``None``).
    """
    leaves, treedef = jax.tree.flatten(grads)
    res = jax.tree.leaves(residual) if residual is not None else [None] * len(leaves)
    out = [_topk_leaf(g, e, ratio, mesh) for g, e in zip(leaves, res)]
    summed = jax.tree.unflatten(treedef, [s for s, _ in out])
    new_res = jax.tree.unflatten(treedef, [r for _, r in out]) if residual is not None else None
    return summed, new_res


def wire_bytes(shapes: Any, ratio: float, n: int) -> dict[str, int]:
    """Predicted result bytes per step of the gradient exchange: ``{"dense": 4·Σ M}`` (the
    all-reduce's result) and ``{"topk": 8·N·Σ k}`` (values + indices, all-gathered)."""
    sizes = [math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))]
    return {"dense": 4 * sum(sizes), "topk": 8 * n * sum(topk_count(m, ratio) for m in sizes)}
