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

Both return the weighted sum of each token's experts and the number of slots dropped. The experts
are SwiGLU MLPs; as options (GPT-OSS) they carry biases (gate and up added per row by its expert,
the down projection's once per kept slot after the ``tp`` sum) and the clamped SwiGLU of
:func:`gated` (``model.swiglu_limit``).
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


SWIGLU_ALPHA = 1.702
"""The sigmoid gain of GPT-OSS's clamped SwiGLU (transformers' ``GptOssConfig.swiglu_alpha``)."""


def gated(g: jax.Array, u: jax.Array, limit: float = 0.0) -> jax.Array:
    """The experts' gated activation of the gate and up projections ``g``, ``u`` (same shape): SwiGLU
    ``silu(g) · u``, or with a ``limit`` > 0 GPT-OSS's clamped form (transformers'
    ``GptOssExperts._apply_gate``): ``g`` clamped above at ``limit``, ``u`` to ``[−limit, limit]``,
    ``g · sigmoid(1.702 · g) · (u + 1)``."""
    if not limit:
        return jax.nn.silu(g) * u
    g = jnp.minimum(g, limit)
    u = jnp.clip(u, -limit, limit)
    return g * jax.nn.sigmoid(g * SWIGLU_ALPHA) * (u + 1)


def _row_groups(group_sizes: jax.Array, m: int) -> jax.Array:
    """int32 ``[m]``: each row's group for rows sorted by group (the last group for rows past them): the
    group ends at or before the row, counted by a scatter and a cumulative sum (``jnp.searchsorted``
    trips over the varying manual axes of a pipeline's ``shard_map``)."""
    ends = jnp.zeros((m,), jnp.int32).at[jnp.cumsum(group_sizes)].add(1, mode="drop")
    return jnp.minimum(jnp.cumsum(ends), group_sizes.shape[0] - 1)


def _experts_grouped(xs: jax.Array, group_sizes: jax.Array, wg, wu, wd, blocked: bool = False, bg=None, bu=None,
                     limit: float = 0.0) -> jax.Array:
    """SwiGLU of each row of ``xs [M, d]`` by its group's expert (rows sorted by group; rows past
    ``sum(group_sizes)`` come out zero): ``[M, d]``. ``blocked``: :func:`_experts_blocked` in place
    of ``jax.lax.ragged_dot`` (XLA:CPU lowers ``ragged_dot`` as a dense matmul of every row against
    every group's weight, ``E``-fold the work). ``bg``, ``bu``: the gate and up projections' biases
    ``[E, f]`` (GPT-OSS); ``limit``: :func:`gated`'s."""
    if blocked:
        return _experts_blocked(xs, group_sizes, wg, wu, wd, bg=bg, bu=bu, limit=limit)
    g = jax.lax.ragged_dot(xs, wg, group_sizes)
    u = jax.lax.ragged_dot(xs, wu, group_sizes)
    if bg is not None:  # rows past the groups get the last group's bias: the down matmul zeroes them anyway
        rows = _row_groups(group_sizes, xs.shape[0])
        g, u = g + bg[rows].astype(g.dtype), u + bu[rows].astype(u.dtype)
    return jax.lax.ragged_dot(gated(g, u, limit).astype(xs.dtype), wd, group_sizes)


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


def _experts_blocked(xs: jax.Array, group_sizes: jax.Array, wg, wu, wd, block: int = BLOCK_ROWS, bg=None, bu=None,
                     limit: float = 0.0) -> jax.Array:
    """:func:`_experts_grouped` as batched matmuls over blocks of rows (MegaBlocks' block-sparse
    form, Gale et al., 2023): each group's rows padded to whole blocks of ``block``, each block
    multiplied by its group's weights (gathered per block). ``(M + E·block)`` rows of work against
    ``ragged_dot``'s ``E·M`` on XLA:CPU. ``[M, d]``, rows past ``sum(group_sizes)`` zero."""
    m, d = xs.shape
    dest, groups, nb = _block_layout(group_sizes, m, block)
    buf = jnp.zeros((nb * block, d), xs.dtype).at[dest].set(xs, mode="drop").reshape(nb, block, d)
    g = jnp.einsum("nbd,ndf->nbf", buf, wg[groups])
    u = jnp.einsum("nbd,ndf->nbf", buf, wu[groups])
    if bg is not None:
        g, u = g + bg[groups][:, None].astype(g.dtype), u + bu[groups][:, None].astype(u.dtype)
    out = jnp.einsum("nbf,nfd->nbd", gated(g, u, limit).astype(xs.dtype), wd[groups]).reshape(nb * block, -1)
    return jnp.take(out, dest, axis=0, mode="fill", fill_value=0)


def blocked_on(mesh) -> bool:
    """Whether the dropless grouped matmuls run blocked (:func:`_experts_blocked`): on a mesh of CPU
    devices (:func:`jaxcolossal.parallel.mesh.platform`). Without a mesh (one device outside the
    train step, the planner's traces for GPUs, a pipeline's manual ``shard_map``): ``ragged_dot``.
    The blocked form gathers one expert's weights per block (``nb × d × f``), affordable at the
    sizes a CPU trains."""
    return mesh is not None and platform(mesh) == "cpu"


@jax.custom_vjp
def move(x: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
    """Rows of ``x [M, ...]`` moved to new places: ``y[j] = x[src[j]]`` (zero where ``src[j]`` is out of
    range), where ``dst`` is the inverse map (``dst[src[j]] = j``; out of range for a row that goes
    nowhere). A gather forward, and a gather backward (``dx[i] = dy[dst[i]]``) in place of the
    scatter-add that autodiff of a gather makes: XLA:GPU lowers a scatter into a zero buffer of the
    operand's size (and, for 16-bit floats, a u32 one beside it) that it hoists out of the layer loop
    and holds for the whole step. int32 ``src [N]``, ``dst [M]``; ``y [N, ...]``."""
    return jnp.take(x, src, axis=0, mode="fill", fill_value=0)


def _move_fwd(x, src, dst):
    return move(x, src, dst), (src, dst)


def _move_bwd(res, g):
    src, dst = res
    return jnp.take(g, dst, axis=0, mode="fill", fill_value=0), None, None


move.defvjp(_move_fwd, _move_bwd)


def _inverse(perm: jax.Array) -> jax.Array:
    """The inverse of the permutation ``perm`` int32 ``[M]``."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def _dropless_local(x, flat, k, wg, wu, wd, blocked: bool = False, **opts):
    """Every slot through its expert on this device (``ep = 1``): ``[T·k, d]`` in slot order.
    ``opts``: :func:`_experts_grouped`'s biases and limit."""
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inv = _inverse(order)
    sizes = jnp.sum(jax.nn.one_hot(flat, wg.shape[0], dtype=jnp.int32), axis=0)
    out = _experts_grouped(move(jnp.repeat(x, k, axis=0), order, inv), sizes, wg, wu, wd, blocked, **opts)
    return move(out, inv, order)


def _exchange_places(flat: jax.Array, n_local: int, ep: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each slot goes in the ``[ep·m]`` send buffer (each destination's block of ``m`` places, its
    slots sorted by expert): ``(to [m], back [ep·m], local_expert [ep·m])``: slot ``i``'s place, each
    place's slot (``m``, out of range, for an empty place) and the local expert of each place
    (``n_local`` for an empty place). int32 ``flat [m]``: each slot's expert."""
    m = flat.shape[0]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    dest = (flat // n_local)[order]                       # sorted by expert, so by destination
    counts = jnp.sum(jax.nn.one_hot(dest, ep, dtype=jnp.int32), axis=0)
    pos = jnp.arange(m, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[dest]
    to = jnp.zeros((m,), jnp.int32).at[order].set(dest * m + pos)
    back = jnp.full((ep * m,), m, jnp.int32).at[to].set(jnp.arange(m, dtype=jnp.int32))
    local = jnp.take(flat % n_local, back, mode="fill", fill_value=n_local)
    return to, back, local


def _dropless_exchange(x, flat, k, wg, wu, wd, ep: int, blocked: bool = False, **opts):
    """:func:`_dropless_local` with the experts split over ``ep``: pack each destination's slots,
    ``all_to_all``, grouped matmuls on the local experts, ``all_to_all`` back. ``[T·k, d]``."""
    n_local, m = wg.shape[0], flat.shape[0]
    to, back, local = _exchange_places(flat, n_local, ep)
    send = move(jnp.repeat(x, k, axis=0), back, to).reshape(ep, m, -1)
    recv = jax.lax.all_to_all(send, EP_AXIS, 0, 0).reshape(ep * m, -1)
    recv_e = jax.lax.all_to_all(local.reshape(ep, m), EP_AXIS, 0, 0).reshape(-1)   # n_local marks an empty place
    order_r = jnp.argsort(recv_e, stable=True).astype(jnp.int32)
    inv_r = _inverse(order_r)
    sizes = jnp.sum(jax.nn.one_hot(recv_e, n_local, dtype=jnp.int32), axis=0)
    done = _experts_grouped(move(recv, order_r, inv_r), sizes, wg, wu, wd, blocked, **opts)
    ret = jax.lax.all_to_all(move(done, inv_r, order_r).reshape(ep, m, -1), EP_AXIS, 0, 0)  # [ep (ran it), m, d]
    return move(ret.reshape(ep * m, -1), to, back)


def _capacity(x, flat, k, wg, wu, wd, ep: int, capacity_factor: float, num_experts: int, bg=None, bu=None,
              limit: float = 0.0):
    """GShard's dispatch: ``C`` places per expert, slots in token order, the rest dropped.
    Returns ``([T·k, d] in slot order, bool [T·k]: the slots kept)``."""
    m = flat.shape[0]
    cap = max(1, math.ceil(capacity_factor * m / num_experts))
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)   # the slot's place at its expert
    keep = pos < cap
    # each kept slot's place in the [E·cap] buffer (E·cap, out of range, for a dropped one) and each
    # place's slot (m for an empty place): rows moved by gathers both ways (:func:`move`)
    to = jnp.where(keep, flat * cap + pos, num_experts * cap).astype(jnp.int32)
    back = jnp.full((num_experts * cap,), m, jnp.int32).at[to].set(jnp.arange(m, dtype=jnp.int32), mode="drop")
    buf = move(jnp.repeat(x, k, axis=0), back, to).reshape(num_experts, cap, -1)
    if ep > 1:
        buf = jax.lax.all_to_all(buf.reshape(ep, num_experts // ep, cap, -1), EP_AXIS, 0, 0)
    else:
        buf = buf[None]
    g = jnp.einsum("secd,edf->secf", buf, wg)
    u = jnp.einsum("secd,edf->secf", buf, wu)
    if bg is not None:
        g, u = g + bg[None, :, None].astype(g.dtype), u + bu[None, :, None].astype(u.dtype)
    done = jnp.einsum("secf,efd->secd", gated(g, u, limit).astype(x.dtype), wd)
    if ep > 1:
        done = jax.lax.all_to_all(done, EP_AXIS, 0, 0)
    out = move(done.reshape(num_experts * cap, -1), to, back).astype(x.dtype)
    return out, keep


def _local(x, top_i, top_w, wg, wu, wd, *biases, num_experts, capacity_factor, ep, tp, blocked=False, limit=0.0):
    """One device's part: ``(y [T, d], dropped slots [1])`` for its tokens ``x [T, d]``. ``biases``:
    none, or the gate and up biases (this device's experts, ``[E/ep, f/tp]``) and the down bias of
    every expert ``[E, d]``, added once per kept slot after the ``tp`` sum."""
    t, k = top_i.shape
    flat = top_i.reshape(-1)
    opts = dict(bg=biases[0], bu=biases[1], limit=limit) if biases else dict(limit=limit)
    keep = jnp.ones(flat.shape, bool)
    if capacity_factor > 0:
        out, keep = _capacity(x, flat, k, wg, wu, wd, ep, capacity_factor, num_experts, **opts)
    elif ep > 1:
        out = _dropless_exchange(x, flat, k, wg, wu, wd, ep, blocked, **opts)
    else:
        out = _dropless_local(x, flat, k, wg, wu, wd, blocked, **opts)
    y = jnp.einsum("tkd,tk->td", out.reshape(t, k, -1).astype(jnp.float32), top_w.astype(jnp.float32))
    if tp > 1:  # each tp rank ran its slice of every expert's intermediate dimension
        y = jax.lax.psum(y, TP_AXIS)
    if biases:  # the down projection's bias, weighted as its slot
        kept_w = jnp.where(keep.reshape(t, k), top_w, 0).astype(jnp.float32)
        y = y + jnp.einsum("tkd,tk->td", biases[2][top_i].astype(jnp.float32), kept_w)
    return y.astype(x.dtype), jnp.sum(~keep).astype(jnp.float32)[None]


def routed_experts(x: jax.Array, top_i: jax.Array, top_w: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array,
                   capacity_factor: float, mesh=None, manual_ep: int | None = None, biases: tuple | None = None,
                   swiglu_limit: float = 0.0) -> tuple[jax.Array, jax.Array]:
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
        biases: ``None``, or GPT-OSS's expert biases ``(gate [E, f], up [E, f], down [E, d])`` (``E``
            on ``ep``, ``f`` on ``tp``; the down bias is gathered whole on every device).
        swiglu_limit: GPT-OSS's clamped SwiGLU (:func:`gated`); 0: the plain SwiGLU.

    Returns:
        ``(y [T, d] in x's dtype, dropped)``: ``dropped`` fp32 scalar, the slots (of ``T·k``) no
        expert took (0 when dropless).
    """
    biases = tuple(biases or ())
    if mesh is None:  # one device, or this device's part inside a manual shard_map
        ep = manual_ep or 1
        if biases and ep > 1:  # every expert's down bias, for the slots this device's tokens send out
            biases = (*biases[:2], jax.lax.all_gather(biases[2], EP_AXIS, axis=0, tiled=True))
        y, dropped = _local(x, top_i, top_w, wg, wu, wd, *biases, num_experts=wg.shape[0] * ep,
                            capacity_factor=capacity_factor, ep=ep, tp=1, blocked=blocked_on(None), limit=swiglu_limit)
        return y, dropped[0]
    num_experts = wg.shape[0]
    shape = dict(mesh.shape)
    fn = partial(_local, num_experts=num_experts, capacity_factor=capacity_factor, ep=shape.get(EP_AXIS, 1),
                 tp=shape.get(TP_AXIS, 1), blocked=blocked_on(mesh), limit=swiglu_limit)
    rows = P(DATA_AXES, None)
    expert_in, expert_out = P(EP_AXIS, None, TP_AXIS), P(EP_AXIS, TP_AXIS, None)
    bias_specs = (P(EP_AXIS, TP_AXIS), P(EP_AXIS, TP_AXIS), P(None, None))[:len(biases)]
    in_specs = (rows, rows, rows, expert_in, expert_in, expert_out, *bias_specs)
    y, dropped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                               out_specs=(rows, P(DATA_AXES)), check_vma=False)(x, top_i, top_w, wg, wu, wd, *biases)
    return y, jnp.sum(dropped)
