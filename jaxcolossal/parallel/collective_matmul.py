"""TP collective matmul: Megatron-SP's all-gather and reduce-scatter over ``tp`` decomposed into
``tp`` partial matmuls interleaved with ``ppermute``s, so that each step's transfer runs while the
previous chunk is multiplied (Wang et al., 2023, "Overlap Communication with Dependent
Computation via Decomposition in Large Deep Learning Models"; the "collective matmul" of JAX's
``shard_map`` guide and of MaxText/PaxML).

Under Megatron sequence parallelism (``parallel.sequence_parallelism_mode=split_gather``) the
residual stream ``[b, t, d]`` is split over ``tp`` along the sequence. A column-parallel layer
(q/k/v, gate/up) needs the whole sequence: XLA all-gathers it, then multiplies. A row-parallel
layer (o, down) produces partial sums of the whole sequence: XLA multiplies, then
reduce-scatters. Both are serial: the matmul waits for the collective or the other way round.

Here, with ``n = tp`` and ``r`` this device's index in the ``tp`` group:

* :func:`all_gather_matmul`: at step ``s = 0 … n−1`` the device multiplies the sequence chunk
  ``(r + s) mod n`` that it holds and passes that chunk to ``r − 1``; the product's rows are
  written at the chunk's place. ``n − 1`` ppermutes of ``[b, t/n, d]``, the bytes of an
  all-gather.
* :func:`matmul_reduce_scatter`: at step ``s`` the device multiplies its rows of chunk
  ``(r − 1 − s) mod n``, adds the partial sum that came from ``r − 1`` and passes it to
  ``r + 1``; after ``n`` steps it holds the full sum of chunk ``r``. ``n − 1`` ppermutes of
  ``[b, t/n, d]``, the bytes of a reduce-scatter.

Each is a ``jax.custom_vjp`` whose backward is the other one (the gradient of an all-gather is a
reduce-scatter), so the backward overlaps too. The weight gradients are contracted in fp32
(``preferred_element_type``, as :mod:`jaxcolossal.models.layers.linear`) from the gathered activation
that the forward assembled as it went by (column-parallel) or the gathered output gradient
(row-parallel). Numerically the forward equals the plain einsum up to the order of the
reduce-scatter's sums.

Active when :meth:`jaxcolossal.parallel.sharding.Sharder.collective_matmul` says so (``split_gather``,
``tp`` > 1, ``parallel.overlap``, sequence ≥ ``parallel.collective_matmul_min_seq`` and divisible by
``tp``, outside another ``shard_map``); otherwise the model's plain projections run.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

TP_AXIS = "tp"
SEQ = "t"
"""The sequence's letter in every einsum the models write (``"btd,dhq->bthq"``)."""


def operands(eq: str) -> tuple[str, str, str]:
    lhs, rest = eq.replace(" ", "").split(",")
    rhs, out = rest.split("->")
    return lhs, rhs, out


def _chunk(a: jax.Array, subs: str, c, size: int) -> jax.Array:
    """Rows ``[c·size, (c+1)·size)`` of ``a``'s sequence axis (``subs``: its einsum letters)."""
    return jax.lax.dynamic_slice_in_dim(a, c * size, size, axis=subs.index(SEQ))


def _place(buf: jax.Array, block: jax.Array, subs: str, c) -> jax.Array:
    axis = subs.index(SEQ)
    return jax.lax.dynamic_update_slice_in_dim(buf, block.astype(buf.dtype), c * block.shape[axis], axis=axis)


def _shift(a: jax.Array, n: int, step: int) -> jax.Array:
    """``a`` passed from each device ``j`` of the tp ring to ``j + step``."""
    return jax.lax.ppermute(a, TP_AXIS, [(j, (j + step) % n) for j in range(n)])


def _gather_multiply(x: jax.Array, eqs: Sequence[str], ws: Sequence[jax.Array], n: int):
    """Local body: ``x`` this device's sequence chunk; returns ``([einsum(eq, x_all, w)], x_all)``
    with ``x_all`` the whole sequence, assembled as the chunks pass by."""
    r = jax.lax.axis_index(TP_AXIS)
    lhs = operands(eqs[0])[0]
    size = x.shape[lhs.index(SEQ)]

    def full(a, subs):  # zeros like ``a`` with the whole sequence (``size * n``) on ``subs``'s SEQ dim
        return jnp.zeros(a.shape[:subs.index(SEQ)] + (size * n,) + a.shape[subs.index(SEQ) + 1:], a.dtype)

    outs, x_all, cur = None, full(x, lhs), x
    for s in range(n):
        c = (r + s) % n
        nxt = _shift(cur, n, -1) if s < n - 1 else None  # issued before this chunk's matmuls
        parts = [jnp.einsum(eq, cur, w) for eq, w in zip(eqs, ws)]
        if outs is None:
            outs = [full(p, operands(eq)[2]) for p, eq in zip(parts, eqs)]
        outs = [_place(o, p, operands(eq)[2], c) for o, p, eq in zip(outs, parts, eqs)]
        x_all = _place(x_all, cur, lhs, c)
        cur = nxt
    return outs, x_all


def _multiply_scatter(eqs: Sequence[str], xs: Sequence[jax.Array], ws: Sequence[jax.Array], n: int) -> jax.Array:
    """Local body: ``sum_i einsum(eqs[i], xs[i], ws[i])`` over the whole sequence, reduce-scattered
    over tp: returns this device's sequence chunk of the sum over the tp group."""
    r = jax.lax.axis_index(TP_AXIS)
    lhs0 = operands(eqs[0])[0]
    size = xs[0].shape[lhs0.index(SEQ)] // n
    acc = None
    for s in range(n):
        c = (r - 1 - s) % n
        part = sum(jnp.einsum(eq, _chunk(x, operands(eq)[0], c, size), w) for eq, x, w in zip(eqs, xs, ws))
        acc = part if acc is None else _shift(acc, n, 1) + part
    return acc


def _transposed(eq: str) -> str:
    """The einsum of the activation's gradient: ``out, w -> x``."""
    lhs, rhs, out = operands(eq)
    return f"{out},{rhs}->{lhs}"


def _weight_grad(eq: str, x: jax.Array, dy: jax.Array, w: jax.Array) -> jax.Array:
    lhs, rhs, out = operands(eq)
    return jnp.einsum(f"{lhs},{out}->{rhs}", x, dy, preferred_element_type=jnp.float32).astype(w.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ag_matmul(eqs, n, x, ws):
    return tuple(_gather_multiply(x, eqs, ws, n)[0])


def _ag_matmul_fwd(eqs, n, x, ws):
    outs, x_all = _gather_multiply(x, eqs, ws, n)
    return tuple(outs), (x_all, ws)


def _ag_matmul_bwd(eqs, n, res, dys):
    x_all, ws = res
    dx = _multiply_scatter([_transposed(eq) for eq in eqs], dys, ws, n).astype(x_all.dtype)
    dws = tuple(_weight_grad(eq, x_all, dy, w) for eq, dy, w in zip(eqs, dys, ws))
    return dx, dws


_ag_matmul.defvjp(_ag_matmul_fwd, _ag_matmul_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mm_rs(eq, n, x, w):
    return _multiply_scatter([eq], [x], [w], n)


def _mm_rs_fwd(eq, n, x, w):
    return _multiply_scatter([eq], [x], [w], n), (x, w)


def _mm_rs_bwd(eq, n, res, dy):
    x, w = res
    (dx,), dy_all = _gather_multiply(dy, [_transposed(eq)], [w], n)
    return dx.astype(x.dtype), _weight_grad(eq, x, dy_all, w)


_mm_rs.defvjp(_mm_rs_fwd, _mm_rs_bwd)


def _spec(subs: str, batch, tp_letter: str | None, seq_on_tp: bool) -> P:
    def axis(c):
        if c == "b":
            return batch
        if c == SEQ:
            return TP_AXIS if seq_on_tp else None
        return TP_AXIS if c == tp_letter else None
    return P(*map(axis, subs))


def all_gather_matmul(shard, x: jax.Array, terms: Sequence[tuple[str, jax.Array, str]]) -> list[jax.Array]:
    """Column-parallel projections of a sequence-sharded activation, all-gather overlapped.

    Args:
        shard: the :class:`~jaxcolossal.parallel.sharding.Sharder` (its mesh and ``batch`` rule).
        x: ``[b, t, d]``, the sequence split over ``tp`` (Megatron-SP's residual stream), the
            batch on the rules' ``batch`` axes; compute dtype.
        terms: ``(eq, w, letter)`` per projection sharing ``x``: an einsum whose first operand is
            ``x`` (``"btd,dhq->bthq"``) and a weight whose dimension ``letter`` (``"h"``) is split
            over ``tp`` (column-parallel). q, k and v (or gate and up) go in one call, so the
            activation crosses the ring once.

    Returns:
        ``einsum(eq, x, w)`` per term, the whole sequence, ``letter`` split over ``tp``; ``x``'s
        dtype. Gradients: the activation's by :func:`matmul_reduce_scatter`'s ring; the
        weights' contracted in fp32 from the gathered activation, returned in the weight's dtype.
    """
    n = int(shard.mesh.shape[TP_AXIS])
    batch = shard.rules["batch"]
    eqs = tuple(eq for eq, _, _ in terms)
    lhs = operands(eqs[0])[0]
    in_specs = (_spec(lhs, batch, None, True),
                tuple(_spec(operands(eq)[1], batch, letter, False) for eq, _, letter in terms))
    out_specs = tuple(_spec(operands(eq)[2], batch, letter, False) for eq, _, letter in terms)
    fn = jax.shard_map(lambda x, ws: _ag_matmul(eqs, n, x, ws), mesh=shard.mesh, in_specs=in_specs,
                       out_specs=out_specs, check_vma=False)
    return list(fn(x, tuple(w for _, w, _ in terms)))


def matmul_reduce_scatter(shard, eq: str, x: jax.Array, w: jax.Array, letter: str) -> jax.Array:
    """A row-parallel projection whose sum over ``tp`` is reduce-scattered along the sequence,
    overlapped with the partial matmuls.

    Args:
        shard: the :class:`~jaxcolossal.parallel.sharding.Sharder`.
        eq: the einsum, activation first (``"btf,fd->btd"``).
        x: the whole sequence, its dimension ``letter`` split over ``tp``; compute dtype.
        w: the weight, its dimension ``letter`` split over ``tp`` (row-parallel).
        letter: the contracted dimension's letter in ``eq`` (``"f"``), split over ``tp`` in both.

    Returns:
        ``einsum(eq, x, w)`` summed over ``tp``, the sequence split over ``tp`` (Megatron-SP's
        residual layout); ``x``'s dtype.
    """
    n = int(shard.mesh.shape[TP_AXIS])
    batch = shard.rules["batch"]
    lhs, rhs, out = operands(eq)
    fn = jax.shard_map(lambda x, w: _mm_rs(eq, n, x, w), mesh=shard.mesh,
                       in_specs=(_spec(lhs, batch, letter, False), _spec(rhs, batch, letter, False)),
                       out_specs=_spec(out, batch, None, True), check_vma=False)
    return fn(x, w)
