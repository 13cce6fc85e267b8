"""Expert parallelism: the routed tokens of a mixture of experts sent to their experts and back.

:func:`routed_experts` runs in a ``shard_map`` over the whole mesh (without a mesh: on one device).
Each device holds its own tokens (the batch is split over the data group ``dp × fsdp × ep``) and
``E / ep`` of the experts (the ``expert`` dimension on ``ep``; their intermediate dimension on
``tp``, Megatron's tensor parallelism inside each expert, summed over ``tp`` at the end). Two ways
to dispatch, chosen by ``model.capacity_factor``:

* **dropless** (0): the device's ``T·k`` (token, expert) slots are sorted by expert. With ``ep = 1``
  the sorted tokens go straight through the three grouped matmuls (``jax.lax.ragged_dot``, one
  group per expert: megablox's form, no padding, no token dropped; on CPU devices, where XLA
  lowers ``ragged_dot`` densely, as MegaBlocks' blocks instead, :func:`_experts_blocked`). With ``ep > 1`` the slots of
  each destination device are packed into a ``[ep, T·k, d]`` buffer (room for every slot going to
  one device, so none is dropped) and exchanged by ``all_to_all`` over ``ep``; the receiver sorts
  what it got by its local expert, runs the grouped matmuls, and a second ``all_to_all`` returns
  the results.
* **capacity** (> 0, GShard / Switch): each expert takes at most ``C = ceil(capacity_factor · T·k
  / E)`` slots per device, in token order; the rest are dropped (they contribute zero, the
  residual stream carries the token on). The ``[E, C, d]`` buffers are exchanged by ``all_to_all``
  over ``ep`` and run as batched matmuls. With ``C ≥ T·k`` nothing is dropped and the result equals
  the dropless one.

Both return the weighted sum of each token's experts and the number of slots dropped.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcolossal.parallel.mesh import DATA_AXES, EP_AXIS, TP_AXIS, platform

BLOCK_ROWS = 64
"""The rows of one block of :func:`_experts_blocked` (each group padded to a multiple of it)."""


def _experts_grouped(xs: jax.Array, group_sizes: jax.Array, wg, wu, wd, blocked: bool = False) -> jax.Array:
    """SwiGLU of each row of ``xs [M, d]`` by its group's expert (rows sorted by group; rows past
    ``sum(group_sizes)`` come out zero): ``[M, d]``. ``blocked``: :func:`_experts_blocked` in place
    of ``jax.lax.ragged_dot`` (XLA:CPU lowers ``ragged_dot`` as a dense matmul of every row against
    every group's weight, ``E``-fold the work)."""
    if blocked:
        return _experts_blocked(xs, group_sizes, wg, wu, wd)
    g = jax.lax.ragged_dot(xs, wg, group_sizes)
    u = jax.lax.ragged_dot(xs, wu, group_sizes)
    return jax.lax.ragged_dot((jax.nn.silu(g) * u).astype(xs.dtype), wd, group_sizes)


def _block_layout(group_sizes: jax.Array, m: int, block: int) -> tuple[jax.Array, jax.Array, int]:
    """Each group padded to whole blocks of ``block`` rows: ``(dest [m], block_group [nb], nb)``,
    row ``i``'s place in the padded ``[nb·block]`` layout (``nb·block``, out of range, for the
    rows past ``sum(group_sizes)``) and each block's group. ``nb = ceil(m / block) + E`` bounds
    the blocks for any sizes summing to at most ``m``."""
    e = group_sizes.shape[0]
    nb = -(-m // block) + e
    padded = (group_sizes + block - 1) // block * block
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(m), side="right")          # E for the rows past the last group
    g = jnp.minimum(group, e - 1)
    dest = jnp.where(group < e, (jnp.cumsum(padded) - padded)[g] + jnp.arange(m) - (ends - group_sizes)[g], nb * block)
    block_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded) // block, jnp.arange(nb), side="right"), e - 1)
    return dest, block_group, nb


def _experts_blocked(xs: jax.Array, group_sizes: jax.Array, wg, wu, wd, block: int = BLOCK_ROWS) -> jax.Array:
    """:func:`_experts_grouped` as batched matmuls over blocks of rows (MegaBlocks' block-sparse
    form, Gale et al., 2023): each group's rows padded to whole blocks of ``block``, each block
    multiplied by its group's weights (gathered per block). ``(M + E·block)`` rows of work against
    ``ragged_dot``'s ``E·M`` on XLA:CPU. ``[M, d]``, rows past ``sum(group_sizes)`` zero."""
    m, d = xs.shape
    dest, bg, nb = _block_layout(group_sizes, m, block)
    buf = jnp.zeros((nb * block, d), xs.dtype).at[dest].set(xs, mode="drop").reshape(nb, block, d)
    g = jnp.einsum("nbd,ndf->nbf", buf, wg[bg])
    u = jnp.einsum("nbd,ndf->nbf", buf, wu[bg])
    out = jnp.einsum("nbf,nfd->nbd", (jax.nn.silu(g) * u).astype(xs.dtype), wd[bg]).reshape(nb * block, -1)
    return jnp.take(out, dest, axis=0, mode="fill", fill_value=0)


def blocked_on(mesh) -> bool:
    """Whether the dropless grouped matmuls run blocked (:func:`_experts_blocked`): on a mesh of CPU
    devices (:func:`jaxcolossal.parallel.mesh.platform`). Without a mesh (one device outside the
    train step, the planner's traces for GPUs, a pipeline's manual ``shard_map``): ``ragged_dot``.
    The blocked form gathers one expert's weights per block (``nb × d × f``), affordable at the
    sizes a CPU trains."""
    return mesh is not None and platform(mesh) == "cpu"


def _dropless_local(x, flat, k, wg, wu, wd, blocked: bool = False):
    """Every slot through its expert on this device (``ep = 1``): ``[T·k, d]`` in slot order."""
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(flat, wg.shape[0], dtype=jnp.int32), axis=0)
    out = _experts_grouped(x[order // k], sizes, wg, wu, wd, blocked)
    return jnp.zeros_like(out).at[order].set(out)


def _dropless_exchange(x, flat, k, wg, wu, wd, ep: int, blocked: bool = False):
    """:func:`_dropless_local` with the experts split over ``ep``: pack each destination's slots,
    ``all_to_all``, grouped matmuls on the local experts, ``all_to_all`` back. ``[T·k, d]``."""
    n_local = wg.shape[0]
    m = flat.shape[0]
    order = jnp.argsort(flat, stable=True)
    dest = (flat // n_local)[order]                       # sorted by expert, so by destination
    starts = jnp.cumsum(jnp.sum(jax.nn.one_hot(dest, ep, dtype=jnp.int32), axis=0)) - \
        jnp.sum(jax.nn.one_hot(dest, ep, dtype=jnp.int32), axis=0)
    pos = jnp.arange(m) - starts[dest]                    # the slot's place in its destination's block
    send = jnp.zeros((ep, m, x.shape[-1]), x.dtype).at[dest, pos].set(x[order // k])
    send_e = jnp.full((ep, m), n_local, jnp.int32).at[dest, pos].set((flat % n_local)[order])
    recv = jax.lax.all_to_all(send, EP_AXIS, 0, 0).reshape(ep * m, -1)
    recv_e = jax.lax.all_to_all(send_e, EP_AXIS, 0, 0).reshape(-1)   # n_local marks an empty place
    order_r = jnp.argsort(recv_e, stable=True)
    sizes = jnp.sum(jax.nn.one_hot(recv_e, n_local, dtype=jnp.int32), axis=0)
    done = _experts_grouped(recv[order_r], sizes, wg, wu, wd, blocked)
    back = jnp.zeros_like(done).at[order_r].set(done).reshape(ep, m, -1)
    ret = jax.lax.all_to_all(back, EP_AXIS, 0, 0)         # [ep (the device that ran it), m, d]
    out = ret[dest, pos]
    return jnp.zeros_like(out).at[order].set(out)


def _capacity(x, flat, k, wg, wu, wd, ep: int, capacity_factor: float, num_experts: int):
    """GShard's dispatch: ``C`` places per expert, slots in token order, the rest dropped.
    Returns ``([T·k, d] in slot order, dropped slots)``."""
    m = flat.shape[0]
    cap = max(1, math.ceil(capacity_factor * m / num_experts))
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)   # the slot's place at its expert
    keep = pos < cap
    buf = jnp.zeros((num_experts, cap, x.shape[-1]), x.dtype).at[flat, pos].set(x[jnp.arange(m) // k], mode="drop")
    if ep > 1:
        buf = jax.lax.all_to_all(buf.reshape(ep, num_experts // ep, cap, -1), EP_AXIS, 0, 0)
    else:
        buf = buf[None]
    g = jnp.einsum("secd,edf->secf", buf, wg)
    u = jnp.einsum("secd,edf->secf", buf, wu)
    done = jnp.einsum("secf,efd->secd", (jax.nn.silu(g) * u).astype(x.dtype), wd)
    if ep > 1:
        done = jax.lax.all_to_all(done, EP_AXIS, 0, 0)
    done = done.reshape(num_experts, cap, -1)
    out = jnp.where(keep[:, None], done[flat, jnp.minimum(pos, cap - 1)], 0).astype(x.dtype)
    return out, jnp.sum(~keep).astype(jnp.float32)


def _local(x, top_i, top_w, wg, wu, wd, *, num_experts, capacity_factor, ep, tp, blocked=False):
    """One device's part: ``(y [T, d], dropped slots [1])`` for its tokens ``x [T, d]``."""
    t, k = top_i.shape
    flat = top_i.reshape(-1)
    dropped = jnp.zeros((), jnp.float32)
    if capacity_factor > 0:
        out, dropped = _capacity(x, flat, k, wg, wu, wd, ep, capacity_factor, num_experts)
    elif ep > 1:
        out = _dropless_exchange(x, flat, k, wg, wu, wd, ep, blocked)
    else:
        out = _dropless_local(x, flat, k, wg, wu, wd, blocked)
    y = jnp.einsum("tkd,tk->td", out.reshape(t, k, -1).astype(jnp.float32), top_w.astype(jnp.float32))
    if tp > 1:  # each tp rank ran its slice of every expert's intermediate dimension
        y = jax.lax.psum(y, TP_AXIS)
    return y.astype(x.dtype), dropped[None]


def routed_experts(x: jax.Array, top_i: jax.Array, top_w: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array,
                   capacity_factor: float, mesh=None, manual_ep: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The routed experts' output for each token.

    Args:
        x: ``[T, d]`` tokens (compute dtype), split over the data group ``("dp", "fsdp", "ep")``.
        top_i: int32 ``[T, k]``, each token's experts; ``top_w``: ``[T, k]`` their weights (fp32).
        wg, wu: ``[E, d, f]`` the experts' gate and up projections; ``wd``: ``[E, f, d]`` the down
            projection (``E`` on ``ep``, ``f`` on ``tp``; gathered over ``fsdp`` under ZeRO-3).
        capacity_factor: 0 for dropless, else the GShard capacity factor.
        mesh: the run's mesh (``None``: one device, no collectives).
        manual_ep: inside a ``shard_map`` already manual over ``ep`` (a pipeline's): its size; the
            arguments are this device's and the all-to-alls run over it directly (tp 1).

    Returns:
        ``(y [T, d] in x's dtype, dropped)``: ``dropped`` fp32 scalar, the slots (of ``T·k``) no
        expert took (0 when dropless).
    """
    if mesh is None:  # one device, or this device's part inside a manual shard_map
        ep = manual_ep or 1
        y, dropped = _local(x, top_i, top_w, wg, wu, wd, num_experts=wg.shape[0] * ep,
                            capacity_factor=capacity_factor, ep=ep, tp=1, blocked=blocked_on(None))
        return y, dropped[0]
    num_experts = wg.shape[0]
    shape = dict(mesh.shape)
    fn = partial(_local, num_experts=num_experts, capacity_factor=capacity_factor, ep=shape.get(EP_AXIS, 1),
                 tp=shape.get(TP_AXIS, 1), blocked=blocked_on(mesh))
    rows = P(DATA_AXES, None)
    expert_in, expert_out = P(EP_AXIS, None, TP_AXIS), P(EP_AXIS, TP_AXIS, None)
    y, dropped = jax.shard_map(fn, mesh=mesh, in_specs=(rows, rows, rows, expert_in, expert_in, expert_out),
                               out_specs=(rows, P(DATA_AXES)), check_vma=False)(x, top_i, top_w, wg, wu, wd)
    return y, jnp.sum(dropped)
