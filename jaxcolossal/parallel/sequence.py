"""Sequence (context) parallelism: how attention runs when the sequence is split over devices.

``parallel.sequence_parallelism_mode`` (Colossal-AI's ``HybridParallelPlugin`` names); the rules
table does the rest (:func:`jaxcolossal.parallel.sharding.rules_for`), so model code is the same in
every mode: it calls :func:`attend` through the model's ``attention``.

* ``split_gather`` (Megatron-SP, Korthikanti et al., 2022): the residual stream (norms,
  residual adds, dropout) is split along the sequence over the ``tp`` group. Only rules change:
  XLA all-gathers the sequence before the column-parallel q/k/v and gate/up matmuls and turns
  the all-reduce after the row-parallel o/down matmuls into a reduce-scatter. Attention itself
  sees the full sequence, with its heads on ``tp``, as without SP.
* ``all_to_all`` (DeepSpeed-Ulysses, Jacobs et al., 2023): every activation is split along the
  sequence over ``sp``. Around attention, q/k/v are resharded from sequence-split to
  head-split over ``sp`` (an all-to-all each), attention runs on the full sequence for
  ``h/(tp·sp)`` heads, and the output goes back (one more all-to-all): 4 per layer forward.
  The heads and the kv heads must divide by ``tp·sp``.
* ``ring_attn`` (Ring Attention, Liu et al., 2023): every activation is split along the sequence
  over ``sp``; each device keeps its block of queries and the k/v blocks travel around the ``sp``
  ring (``ppermute``, ``sp − 1`` hops per layer forward, k and v in one array), and the partial
  softmax results are combined online (the FlashAttention recurrence: running max ``m``,
  normaliser ``l``, unnormalised output ``o``). For causal balance the step puts the sequence in
  **zig-zag order** first (:func:`zigzag_order`, as in the zig-zag ring of Brandon et al., 2023 and
  Llama 3's context parallelism): device ``i`` holds the chunks ``i`` and ``2·sp − 1 − i`` of
  ``2·sp``, so that on every hop after the first each device computes exactly half of the
  block pair (the other half is entirely in the future) and no device idles. RoPE and the causal
  mask use the tokens' original positions; the loss is a sum over tokens, so the order does not
  change it.

The backward of every mode is JAX's autodiff of the forward (the ``ppermute`` transposes to
the reverse ring, the all-to-alls to all-to-alls).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxcolossal.parallel.mesh import platform

SP_AXIS = "sp"
MODES = ("none", "split_gather", "all_to_all", "ring_attn")


def zigzag_order(t: int, sp: int) -> np.ndarray:
    """The permutation of ``range(t)`` that gives device ``i`` (contiguous block ``i`` of ``t/sp``)
    the chunks ``i`` and ``2·sp − 1 − i`` of ``2·sp`` equal chunks. int32 ``[t]``.

    Raises:
        ValueError: ``t`` not divisible by ``2·sp``.
    """
    if t % (2 * sp):
        raise ValueError(f"a zig-zag split of {t} tokens over sp={sp} needs a multiple of {2 * sp}")
    chunks = np.arange(t, dtype=np.int32).reshape(2 * sp, t // (2 * sp))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * sp - 1 - i]]) for i in range(sp)])


def zigzag_batch(inputs, targets, mask=None, segment_ids=None, positions=None, sp: int = 1):
    """``(inputs, targets, mask, segment_ids, positions)`` (``[B, t]`` each) put in zig-zag order
    along the sequence; ``positions`` (the RoPE positions; ``arange(t)`` when ``None``) travel with
    the tokens, so the model sees every token at its original position. Identity for ``sp == 1``."""
    if sp == 1:
        return inputs, targets, mask, segment_ids, positions
    B, t = inputs.shape
    order = jnp.asarray(zigzag_order(t, sp))

    def take(a):
        return None if a is None else jnp.take(a, order, axis=1)

    if positions is None:
        positions = jnp.broadcast_to(order, (B, t))
    else:
        positions = take(positions)
    return take(inputs), take(targets), take(mask), take(segment_ids), positions


def _per_shard(body: Callable, shard, seq, q, k, v, *rows) -> jax.Array:
    """``body(q, k, v, *rows)`` in a ``shard_map`` over the sharder's mesh: q/k/v ``[b, t, heads,
    d]`` with the batch on the rules' ``batch`` axes, the sequence on ``seq`` (``None`` or ``sp``)
    and the heads on ``heads``/``kv_heads``; each of ``rows`` (int ``[b, t]``: positions, segment
    ids) with its batch split and its sequence whole. Returns q's layout."""
    rules, batch = shard.rules, shard.rules["batch"]
    qspec, kvspec = P(batch, seq, rules["heads"], None), P(batch, seq, rules["kv_heads"], None)
    fn = jax.shard_map(body, mesh=shard.mesh, in_specs=(qspec, kvspec, kvspec) + (P(batch, None),) * len(rows),
                       out_specs=qspec, check_vma=False)
    return fn(q, k, v, *rows)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, shard, local: Callable, impl: str,
           segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    """Causal attention of q ``[b, t, h, d]``, k/v ``[b, t, kv, d]`` -> ``[b, t, h, d]`` under the
    sharder's sequence-parallel mode; ``local(q, k, v, impl, segment_ids)`` is the attention on
    whole sequences (the model's). Falls back to ``local`` when the sequence is not split (no
    mesh, mode ``none``/``split_gather``) or does not divide (sampling one token at a time)."""
    mode = getattr(shard, "sequence_mode", "none")
    mesh = getattr(shard, "mesh", None)
    if impl == "cudnn" and mesh is not None and (platform(mesh) != "gpu" or _in_pipeline(shard)):
        impl = "xla"  # cuDNN's fused attention: on GPUs only, and not where its partitioner cannot run
    if mode == "ring_attn" and _manual_over_sp(mesh):
        return ring_attention_manual(q, k, v, positions, segment_ids, bool(getattr(shard, "zigzag", False)))
    if mesh is None or mode not in ("all_to_all", "ring_attn") or not shard.is_sharded("seq"):
        if mesh is not None and impl == "flash":
            return per_device_attention(q, k, v, shard, local, impl, segment_ids)
        return local(q, k, v, impl, segment_ids)
    sp = int(mesh.shape[SP_AXIS])
    t = q.shape[1]
    if mode == "all_to_all":
        if t % sp:
            return local(q, k, v, impl, segment_ids)
        return ulysses_attention(q, k, v, shard, local, impl, segment_ids)
    zigzag = bool(getattr(shard, "zigzag", False))
    if t % (2 * sp if zigzag else sp):
        return local(q, k, v, impl, segment_ids)
    return ring_attention(q, k, v, shard, segment_ids, positions, zigzag)


def per_device_attention(q: jax.Array, k: jax.Array, v: jax.Array, shard, local: Callable, impl: str,
                         segment_ids: jax.Array | None = None) -> jax.Array:
    """``local(q, k, v, impl, segment_ids)`` on each device's own rows and heads (a ``shard_map``
    with the batch on the rules' ``batch`` axes and the heads on ``heads``/``kv_heads``; the
    sequence whole). A Pallas kernel is opaque to XLA's partitioner, which would otherwise gather
    its inputs and run it on the whole batch on every device. Falls back to ``local`` when the
    batch or heads do not divide (sampling one row), and inside another ``shard_map``."""
    sizes = {"batch": shard.axis_size("batch"), "heads": shard.axis_size("heads"),
             "kv_heads": shard.axis_size("kv_heads")}
    if (_partly_manual(shard.mesh) or q.shape[0] % sizes["batch"] or q.shape[2] % sizes["heads"]
            or k.shape[2] % sizes["kv_heads"]):
        # inside the pipeline's shard_map (manual over pp and the data axes) each device already
        # holds its own rows; only tp stays with the partitioner there
        return local(q, k, v, impl, segment_ids)
    segs = (segment_ids,) if segment_ids is not None else ()
    return _per_shard(lambda q, k, v, *seg: local(q, k, v, impl, seg[0] if seg else None), shard, None, q, k, v,
                      *segs)


def _partly_manual(mesh) -> bool:
    """Whether the code runs inside a ``shard_map`` that is manual over some of the mesh's axes."""
    return any(t == jax.sharding.AxisType.Manual for t in getattr(mesh, "axis_types", ()))


def _in_pipeline(shard) -> bool:
    """Whether attention runs inside a partly manual ``shard_map`` (the pipeline's). cuDNN's
    attention is a ``custom_partitioning`` op, whose partitioner fails there on jax 0.10 (with the
    heads on tp: "'GSPMDSharding' object has no attribute 'spec'"; with tp 1 an assertion on the
    sharded shapes), and a nested ``shard_map`` over tp fails Shardy's verifier; XLA's attention
    runs instead (:func:`jaxcolossal.config.attention_kernel` says so for the memory model)."""
    mesh = getattr(shard, "mesh", None)
    return mesh is not None and _partly_manual(mesh)


def _seq_to_heads(a: jax.Array) -> jax.Array:
    """Ulysses' first all-to-all over ``sp``: a sequence block of all heads -> the whole sequence of
    ``1/sp`` of the heads."""
    return jax.lax.all_to_all(a, SP_AXIS, split_axis=2, concat_axis=1, tiled=True)


def _heads_to_seq(a: jax.Array) -> jax.Array:
    """The inverse of :func:`_seq_to_heads`: the whole sequence of some heads -> a sequence block of all."""
    return jax.lax.all_to_all(a, SP_AXIS, split_axis=1, concat_axis=2, tiled=True)


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, shard, local: Callable, impl: str,
                      segment_ids: jax.Array | None = None) -> jax.Array:
    """DeepSpeed-Ulysses attention over the mesh axis ``sp`` (module doc). q ``[b, t, h, d]``, k/v
    ``[b, t, kv, d]`` sharded ``("batch", "seq", "heads", "head_dim")`` with ``seq`` on ``sp``;
    returns ``[b, t, h, d]`` sharded the same way.

    Inside, each device swaps its sequence block of all its (``tp``-local) heads for the whole
    sequence of ``1/sp`` of those heads: one ``all_to_all`` for each of q, k, v, then
    ``local(q, k, v, impl, segment_ids)`` on the full sequence, then one ``all_to_all`` back. Head
    block ``r`` of q and kv block ``r`` go to the same device, so grouped-query heads stay with their
    kv head (``h`` and ``kv`` divisible by ``tp·sp``, checked by the config).
    """
    def body(q, k, v, *seg):
        return _heads_to_seq(local(_seq_to_heads(q), _seq_to_heads(k), _seq_to_heads(v), impl,
                                   seg[0] if seg else None))

    segs = (segment_ids,) if segment_ids is not None else ()
    return _per_shard(body, shard, SP_AXIS, q, k, v, *segs)


def _block_update(carry, q, k, v, q_pos, k_pos, q_seg, k_seg):
    """One step of the online softmax: fold the block ``k/v [b, s, kv, d]`` into the running
    ``(m, l, o)`` of the queries ``q [b, tq, kv, g, d]`` (all fp32 ``[b, kv, g, tq]``, ``o`` with
    a trailing ``d``). Masked entries (future positions, other segments) count as −inf; a row
    with no valid key in the block keeps its running values."""
    m, l, o = carry
    d = q.shape[-1]
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    valid = q_pos[:, :, None] >= k_pos[:, None, :]                        # [b, tq, s]
    if q_seg is not None:
        valid = valid & (q_seg[:, :, None] == k_seg[:, None, :])
    valid = valid[:, None, None]                                           # [b, 1, 1, tq, s]
    s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)                     # rows with nothing valid yet
    p = jnp.where(valid, jnp.exp(s - safe[..., None]), 0.0)
    corr = jnp.where(jnp.isfinite(m), jnp.exp(m - safe), 0.0)
    l_new = l * corr + jnp.sum(p, axis=-1)
    o_new = o * corr[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
    return m_new, l_new, o_new


def _ring_body(q, k, v, pos, seg, sp: int, zigzag: bool):
    """One device's part of :func:`ring_attention`, inside a computation that is manual over ``sp``:
    q/k/v are this device's sequence block ``[b, t/sp, heads, d]``; ``pos`` (and ``seg``, or
    ``None``) int ``[b, t]`` are the whole sequence's positions (segment ids) in device order."""
    i = jax.lax.axis_index(SP_AXIS)
    d = q.shape[-1]
    ring = [(r, (r + 1) % sp) for r in range(sp)]
    bl, tl, hl, _ = q.shape
    kl = k.shape[2]
    qg = q.reshape(bl, tl, kl, hl // kl, d)

    def block(a, j):  # sequence block j of a whole-sequence [b, t] row
        return jax.lax.dynamic_slice_in_dim(a, j * tl, tl, axis=1)

    q_pos = block(pos, i)
    q_seg = block(seg, i) if (seg is not None) else None
    shape = (bl, kl, hl // kl, tl)
    carry = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
             jnp.zeros(shape + (d,), jnp.float32))
    kv = jnp.stack([k, v])
    half = tl // 2
    for s in range(sp):
        if s:
            kv = jax.lax.ppermute(kv, SP_AXIS, ring)
        j = (i - s) % sp
        kb, vb = kv[0], kv[1]
        k_pos, k_seg = block(pos, j), (block(seg, j) if (seg is not None) else None)
        if not zigzag or s == 0:
            carry = _block_update(carry, qg, kb, vb, q_pos, k_pos, q_seg, k_seg)
            continue
        # zig-zag, j != i: if j < i every query sees only the block's early half; if j > i only
        # the late half of the queries sees anything (the whole block)
        def lo(a):
            return None if a is None else a[:, :half]

        def hi(a):
            return None if a is None else a[:, half:]

        def early_keys(c):
            return _block_update(c, qg, lo(kb), lo(vb), q_pos, lo(k_pos), q_seg, lo(k_seg))

        def late_queries(c):
            m, l, o = c
            part = tuple(x[:, :, :, half:] for x in c)
            m2, l2, o2 = _block_update(part, qg[:, half:], kb, vb, hi(q_pos), k_pos, hi(q_seg), k_seg)
            return (m.at[:, :, :, half:].set(m2), l.at[:, :, :, half:].set(l2),
                    o.at[:, :, :, half:].set(o2))

        carry = jax.lax.cond(j < i, early_keys, late_queries, carry)
    m, l, o = carry
    out = o / l[..., None]                                              # [b, kv, g, tq, d]
    return jnp.moveaxis(out.reshape(bl, hl, tl, d), 2, 1).astype(v.dtype)


def _manual_over_sp(mesh) -> bool:
    """Whether the code runs inside a ``shard_map`` that is manual over an ``sp`` axis of size > 1
    (the pipeline's, with ring attention): each device then holds its own sequence block."""
    if mesh is None or SP_AXIS not in getattr(mesh, "axis_names", ()) or int(mesh.shape[SP_AXIS]) < 2:
        return False
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
    return types.get(SP_AXIS) == jax.sharding.AxisType.Manual


def _gather_seq(a: jax.Array | None) -> jax.Array | None:
    """An int ``[b, t/sp]`` block row all-gathered over ``sp`` into int32 ``[b, t]`` (``None`` stays)."""
    return None if a is None else jax.lax.all_gather(a.astype(jnp.int32), SP_AXIS, axis=1, tiled=True)


def ring_attention_manual(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                          segment_ids: jax.Array | None = None, zigzag: bool = False) -> jax.Array:
    """:func:`ring_attention` where the caller is already manual over ``sp`` (the pipeline's
    ``shard_map``): q ``[b, t/sp, h, d]``, k/v ``[b, t/sp, kv, d]`` and ``positions`` (int
    ``[b, t/sp]``, required: the block's original positions) are this device's sequence block.
    The positions (and segment ids) of the whole sequence are all-gathered over ``sp`` once per
    call (int32 ``[b, t]``), then the ring runs as in the ``shard_map`` form."""
    sp = int(jax.sharding.get_abstract_mesh().shape[SP_AXIS])
    return _ring_body(q, k, v, _gather_seq(positions), _gather_seq(segment_ids), sp, zigzag)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, shard, segment_ids: jax.Array | None = None,
                   positions: jax.Array | None = None, zigzag: bool = False) -> jax.Array:
    """Ring attention over the mesh axis ``sp`` (module doc). q ``[b, t, h, d]``, k/v
    ``[b, t, kv, d]`` sharded ``("batch", "seq", "heads", "head_dim")`` with ``seq`` on ``sp``;
    returns ``[b, t, h, d]`` in ``v.dtype``, sharded the same way.

    ``positions`` (int ``[b, t]``, default ``arange(t)``) give the causal order (a query sees the
    keys at positions ``<=`` its own, within its segment when ``segment_ids`` are given). With
    ``zigzag`` the sequence is in :func:`zigzag_order` and the hops after the first skip the
    half of the block pair that is entirely in the future (an exact saving: those entries are
    masked anyway).
    """
    mesh = shard.mesh
    sp = int(mesh.shape[SP_AXIS])
    b, t, h, d = q.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def body(q, k, v, pos, *seg):
        return _ring_body(q, k, v, pos, seg[0] if seg else None, sp, zigzag)

    segs = (segment_ids,) if segment_ids is not None else ()
    return _per_shard(body, shard, SP_AXIS, q, k, v, positions.astype(jnp.int32), *segs)
