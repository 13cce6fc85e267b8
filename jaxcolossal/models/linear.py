"""The two ops through which every weight enters a model: a projection and a row lookup, each
with a backward pass that computes the weight's gradient in fp32.

Why: the data-parallel reduction of a weight gradient is inserted by XLA's SPMD partitioner
right after the op that contracts over the (batch-sharded) tokens, in that op's output dtype.
JAX's transpose of a bf16 ``einsum`` is a bf16 ``einsum``, so under ZeRO-2/3, where the step
takes the gradient of the whole microbatch and lets XLA reduce(-scatter) each layer's gradient
inside the backward layer scan (:func:`jaxcolossal.train.step.make_grad_fn`), the reduction would
run in bf16 (fp16 with loss scaling: in fp16). Here the weight-gradient contraction accumulates
and outputs fp32 (``preferred_element_type``), so the reduction that follows it is fp32 (PyTorch
FSDP's ``reduce_dtype=float32``, Megatron's ``accumulate_allreduce_grads_in_fp32``); the reduced
sum is then rounded once to the weight's dtype, as a cotangent must be. The forward and the
input gradient are unchanged: compute-dtype matmuls. In fp32 runs both ops are the plain ones.

Both are ``jax.custom_vjp``; their forward outputs are ordinary ``dot_general``/``gather`` results,
so the remat policies (:mod:`jaxcolossal.models.remat`, ``dots`` included) see them as before.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxcolossal.parallel.collective_matmul import _operands, all_gather_matmul, matmul_reduce_scatter


def project(eq: str, x: jax.Array, w: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``einsum(eq, x, w) (+ bias)`` in ``x``'s dtype, with the gradients of ``w`` and ``bias``
    accumulated in fp32 (then cast to their dtypes).

    Args:
        eq: a two-operand einsum, activation first, e.g. ``"btd,dhq->bthq"``; every index of the
            weight must appear in the activation or the output (true of every projection).
        x: activations (compute dtype), any sharding.
        w: the weight (compute dtype).
        bias: optional, shaped as the output's trailing dims (GPT-2's biases).

    Returns:
        ``[out]`` in ``x.dtype``.
    """
    if bias is None:
        return _project(eq, x, w)
    return _project_bias(eq, x, w, bias)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _project(eq, x, w):
    return jnp.einsum(eq, x, w)


def _project_fwd(eq, x, w):
    return jnp.einsum(eq, x, w), (x, w)


def _project_bwd(eq, res, dy):
    x, w = res
    lhs, rhs, out = _operands(eq)
    dx = jnp.einsum(f"{out},{rhs}->{lhs}", dy, w).astype(x.dtype)
    dw = jnp.einsum(f"{lhs},{out}->{rhs}", x, dy, preferred_element_type=jnp.float32)
    return dx, dw.astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _project_bias(eq, x, w, bias):
    return jnp.einsum(eq, x, w) + bias


def _project_bias_fwd(eq, x, w, bias):
    return jnp.einsum(eq, x, w) + bias, (x, w, bias)


def _project_bias_bwd(eq, res, dy):
    x, w, bias = res
    dx, dw = _project_bwd(eq, (x, w), dy)
    lead = tuple(range(dy.ndim - bias.ndim))
    db = jnp.sum(dy.astype(jnp.float32), axis=lead).astype(bias.dtype)
    return dx, dw, db


_project_bias.defvjp(_project_bias_fwd, _project_bias_bwd)


@jax.custom_vjp
def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]`` (rows of ``table [v, d]`` for int ``ids [...]``: ``[..., d]``), whose
    gradient is scatter-added into an fp32 ``[v, d]`` (then cast to ``table``'s dtype), so that
    the repeated ids of a batch and the data-parallel reduction both sum in fp32.

    ``ids`` must be in ``[0, v)`` (the caller clips or masks them)."""
    return jnp.take(table, ids, axis=0)


def _take_fwd(table, ids):
    # a zero-size [v, 0] array carries v and the dtype (not the table: under ZeRO-3 that would
    # keep the gathered table alive until the backward)
    return jnp.take(table, ids, axis=0), (jnp.zeros((table.shape[0], 0), table.dtype), ids)


def _take_bwd(res, dy):
    proto, ids = res
    dt = jnp.zeros((proto.shape[0], dy.shape[-1]), jnp.float32).at[ids].add(dy.astype(jnp.float32), mode="promise_in_bounds")
    return dt.astype(proto.dtype), None


take_rows.defvjp(_take_fwd, _take_bwd)


def tp_overlaps(shard, t: int) -> bool:
    """Whether the projections of a ``t``-token sequence run as TP collective matmuls under
    ``shard`` (a :class:`~jaxcolossal.sharding.Sharder`; the plain functions used without a mesh
    never do)."""
    decide = getattr(shard, "collective_matmul", None)
    return bool(decide is not None and decide(t))


def column_parallel(shard, overlap: bool, x: jax.Array, terms, biases=None) -> list[jax.Array]:
    """Megatron's column-parallel projections of one activation: ``project(eq, x, w, bias)`` per
    ``(eq, w, letter)`` term (``letter``: the weight's dimension on ``tp``). With ``overlap``
    (:meth:`jaxcolossal.sharding.Sharder.collective_matmul`) ``x`` is sequence-split over ``tp``
    and the all-gather runs as a ring inside the matmuls
    (:func:`jaxcolossal.parallel.collective_matmul.all_gather_matmul`); else XLA places the collectives."""
    biases = biases or [None] * len(terms)
    if not overlap:
        return [project(eq, x, w, b) for (eq, w, _), b in zip(terms, biases)]
    outs = all_gather_matmul(shard, x, terms)
    return [o if b is None else add_bias(o, b) for o, b in zip(outs, biases)]


def row_parallel(shard, overlap: bool, eq: str, x: jax.Array, w: jax.Array, letter: str,
                 bias: jax.Array | None = None) -> jax.Array:
    """Megatron's row-parallel projection ``project(eq, x, w, bias)`` (``letter``: the contracted
    dimension on ``tp``). With ``overlap`` the sum over ``tp`` is reduce-scattered along the
    sequence inside the matmuls (:func:`jaxcolossal.parallel.collective_matmul.matmul_reduce_scatter`)."""
    if not overlap:
        return project(eq, x, w, bias)
    out = matmul_reduce_scatter(shard, eq, x, w, letter)
    return out if bias is None else add_bias(out, bias)


@jax.custom_vjp
def add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
    """``y + bias`` (``bias`` shaped as ``y``'s trailing dims), whose bias gradient is summed in
    fp32 (then cast to the bias dtype), as :func:`project`'s."""
    return y + bias


def _add_bias_fwd(y, bias):
    return y + bias, jnp.zeros((0,) * bias.ndim, bias.dtype)  # carries the bias's rank and dtype


def _add_bias_bwd(proto, dy):
    lead = tuple(range(dy.ndim - proto.ndim))
    return dy, jnp.sum(dy.astype(jnp.float32), axis=lead).astype(proto.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)
