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
so the remat policies (:mod:`jaxcolossal.parallel.layer_scan`, ``dots`` included) see them as before.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from jaxcolossal.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter, operands


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
    lhs, rhs, out = operands(eq)
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


E4M3 = jnp.float8_e4m3fn
"""Activations and weights in FP8 (Transformer Engine's recipe: more mantissa)."""
E5M2 = jnp.float8_e5m2
"""Gradients in FP8 (more range)."""


def fp8_quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``(x / s in dtype, s)`` with the per-tensor scale ``s = amax(|x|) / dtype's max`` (fp32
    scalar; Transformer Engine's current scaling), so that ``x``'s largest value lands on the
    format's largest; clipped to the format's range (:func:`flax.linen.fp8_ops.quantize`). Under a
    sharding the amax is a max over every shard (one small all-reduce per tensor)."""
    big = jnp.asarray(jnp.finfo(dtype).max, jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x)).astype(jnp.float32), jnp.float32(1e-12)) / big
    return fp8_ops.quantize(x.astype(jnp.float32), dtype, scale, jnp.float32), scale


def project_fp8(eq: str, x: jax.Array, w: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """:func:`project` with its three matmuls in FP8 (``precision.fp8``): forward ``x`` and ``w`` in
    e4m3, backward the output gradient in e5m2, each with its current per-tensor scale
    (:func:`fp8_quantize`), accumulated in fp32 and rescaled; the output in ``x``'s dtype, the
    weight gradient accumulated in fp32 (as :func:`project`'s). The backward reuses the forward's
    FP8 copies of ``x`` and ``w`` (saved in one byte per element). On Hopper and Blackwell XLA:GPU
    compiles each to an FP8 GEMM (cuBLASLt's ``__cublas$lt$matmul$f8``, or a Triton GEMM fusion with
    f8 operands); on other backends the FP8 rounding is emulated.

    Args: as :func:`project` (``x`` and ``w`` bf16). Returns: ``[out]`` in ``x.dtype``.
    """
    y = _project_fp8(eq, x, w)
    return y if bias is None else add_bias(y, bias)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _project_fp8(eq, x, w):
    return _project_fp8_fwd(eq, x, w)[0]


def _project_fp8_fwd(eq, x, w):
    xq, sx = fp8_quantize(x, E4M3)
    wq, sw = fp8_quantize(w, E4M3)
    y = jnp.einsum(eq, xq, wq, preferred_element_type=jnp.float32) * (sx * sw)
    proto = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))  # the dtypes of the cotangents
    return y.astype(x.dtype), (xq, sx, wq, sw, proto)


def _project_fp8_bwd(eq, res, dy):
    xq, sx, wq, sw, (x_proto, w_proto) = res
    lhs, rhs, out = operands(eq)
    gq, sg = fp8_quantize(dy, E5M2)
    dx = jnp.einsum(f"{out},{rhs}->{lhs}", gq, wq, preferred_element_type=jnp.float32) * (sg * sw)
    dw = jnp.einsum(f"{lhs},{out}->{rhs}", xq, gq, preferred_element_type=jnp.float32) * (sx * sg)
    return dx.astype(x_proto.dtype), dw.astype(w_proto.dtype)


_project_fp8.defvjp(_project_fp8_fwd, _project_fp8_bwd)


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


def projection(shard):
    """The projection the layers use under ``shard``: :func:`project_fp8` where its ``fp8`` is set
    (``precision.fp8``, :meth:`jaxcolossal.parallel.sharding.Sharder.with_fp8`), else :func:`project`."""
    return project_fp8 if getattr(shard, "fp8", False) else project


def tp_overlaps(shard, t: int) -> bool:
    """Whether the projections of a ``t``-token sequence run as TP collective matmuls under
    ``shard`` (a :class:`~jaxcolossal.parallel.sharding.Sharder`; the plain functions used without a mesh
    never do)."""
    decide = getattr(shard, "collective_matmul", None)
    return bool(decide is not None and decide(t))


def column_parallel(shard, overlap: bool, x: jax.Array, terms, biases=None) -> list[jax.Array]:
    """Megatron's column-parallel projections of one activation: ``project(eq, x, w, bias)`` per
    ``(eq, w, letter)`` term (``letter``: the weight's dimension on ``tp``). With ``overlap``
    (:meth:`jaxcolossal.parallel.sharding.Sharder.collective_matmul`) ``x`` is sequence-split over ``tp``
    and the all-gather runs as a ring inside the matmuls
    (:func:`jaxcolossal.parallel.collective_matmul.all_gather_matmul`); else XLA places the collectives."""
    biases = biases or [None] * len(terms)
    if not overlap:
        proj = projection(shard)
        return [proj(eq, x, w, b) for (eq, w, _), b in zip(terms, biases)]
    outs = all_gather_matmul(shard, x, terms)
    return [o if b is None else add_bias(o, b) for o, b in zip(outs, biases)]


def row_parallel(shard, overlap: bool, eq: str, x: jax.Array, w: jax.Array, letter: str,
                 bias: jax.Array | None = None) -> jax.Array:
    """Megatron's row-parallel projection ``project(eq, x, w, bias)`` (``letter``: the contracted
    dimension on ``tp``). With ``overlap`` the sum over ``tp`` is reduce-scattered along the
    sequence inside the matmuls (:func:`jaxcolossal.parallel.collective_matmul.matmul_reduce_scatter`)."""
    if not overlap:
        return projection(shard)(eq, x, w, bias)
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
