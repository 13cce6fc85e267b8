"""Decode attention of the KV-cached sampler: one new query per row against the whole static cache, as a
Pallas flash-decoding kernel on GPUs (Triton), with XLA's :func:`~jaxcolossal.models.layers.attention.cached_attention`
on the CPU, for what the kernel does not take, and whenever it is off.

Flash-Decoding (Dao, Haziza, Massa and Sizov, 2023, "Flash-Decoding for long-context inference"; the
online softmax of FlashAttention-2, Dao, 2023): a decode step has one query per row, too few to fill a
GPU with one program per query block, so the cache's length is split as well. Program ``(row, kv head,
split)`` walks its split's key blocks with the online softmax (running max ``m``, normaliser ``l``,
unnormalised output ``o``, fp32) and writes those three partials; a combine in XLA rescales the splits
to their common max and divides (``out = Σ_j e^{m_j−M} o_j / Σ_j e^{m_j−M} l_j``). Written for this
project's cache layout after JAX's reference kernel (``jax.experimental.pallas.ops.gpu.decode_attention``),
with what the sampler needs on top:

* the cache as the families keep it, ``[b, S, kv, d]`` (no transpose, no copy): a BlockSpec hands a
  program its row's and kv head's slots, and grouped-query attention is one program per kv head holding
  its ``g = h/kv`` query heads (padded to 16 rows, Triton's smallest dot);
* per-row valid slots, left-padded or ragged: the slots a row may attend to (``kv_valid``, causal, a
  sliding window: :func:`~jaxcolossal.models.layers.attention.cache_mask`) come in as a mask, and each
  row's first and last such slot bound the blocks its programs read (splits wholly outside are empty);
* any ``S ≥ 16``: the last key block is moved back to end at slot ``S`` and its slots already seen are
  excluded, so no load leaves the cache and the cache is never padded;
* Gemma 2's soft-capping of the scores and any softmax scale (in the kernel), GPT-OSS's sinks (one
  logit per head that joins the softmax with no value: in the combine).

Masked slots score ``finfo(fp32).min`` as in the XLA path, so even a row with nothing to attend to gets
XLA's answer (a uniform average over the cache). What the kernel does not take falls back to XLA's
attention (:func:`kernel_refusal` says why): a prefill (``t > 1``), different head dims for k and v
(DeepSeek's multi-head latent attention, whose decode path calls the XLA attention directly), a head dim
that is not a power of two ≥ 16, a cache shorter than 16 slots, and on a mesh a batch or heads that the
rules' axes do not divide, or a ``shard_map`` already manual over some axis.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxcolossal.models.layers.attention import cache_mask, cached_attention
from jaxcolossal.models.layers.flash_attention import online_softmax_step
from jaxcolossal.models.layers.logprobs import soft_cap
from jaxcolossal.models.layers.vocab import Sharder, no_shard
from jaxcolossal.parallel.mesh import platform
from jaxcolossal.parallel.sharding import logical_to_spec

MIN_DIM = 16
"""Triton's smallest ``tl.dot`` dimension: the query rows of a program are padded to it, and the head dim
and the cache length must reach it."""

MASKED = float(jnp.finfo(jnp.float32).min)
"""The score of a slot a row may not attend to: the XLA path's (:func:`cached_attention`)."""


def kernel_choice(option: bool | None, mesh) -> bool | None:
    """The sampler's ``decode_kernel`` option resolved for ``mesh``: an explicit ``True``/``False`` stays;
    ``None`` is on for a GPU mesh and off for any other (:func:`jaxcolossal.parallel.mesh.platform`, so a
    compile for a GPU fleet from a CPU host takes it); without a mesh it stays ``None``, decided when
    lowering (``jax.lax.platform_dependent``: the kernel for CUDA, XLA's attention elsewhere)."""
    if option is not None:
        return bool(option)
    if mesh is None:
        return None
    return platform(mesh) == "gpu"


def kernel_refusal(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, shard: Sharder = no_shard) -> str | None:
    """Why :func:`attend_cache` runs XLA's attention rather than the kernel for these shapes on ``shard``'s
    mesh (``None``: the kernel takes them). q ``[b, t, h, dq]``, caches ``[b, S, kv, dq]`` / ``[b, S, kv, dv]``."""
    b, t, h, d = q.shape
    S, kv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    if t != 1:
        return f"{t} new tokens (the kernel decodes one a row; a prefill runs XLA's attention)"
    if k_cache.shape[-1] != d or dv != d:
        return f"head dims q {d}, k {k_cache.shape[-1]}, v {dv} differ (multi-head latent attention)"
    if d < MIN_DIM or d & (d - 1):
        return f"head dim {d} is not a power of two >= {MIN_DIM}"
    if S < MIN_DIM:
        return f"a cache of {S} slots (fewer than {MIN_DIM})"
    if h % kv:
        return f"{h} heads do not group over {kv} kv heads"
    return _mesh_refusal(b, h, kv, shard)


def _mesh_refusal(b: int, h: int, kv: int, shard) -> str | None:
    """Why the kernel cannot run per shard on ``shard``'s mesh (``None`` without a mesh, or when it can)."""
    mesh = getattr(shard, "mesh", None)
    if mesh is None:
        return None
    if any(t == jax.sharding.AxisType.Manual for t in getattr(mesh, "axis_types", ())):
        return "inside a shard_map manual over some mesh axes"
    rules = shard.rules
    if rules.get("heads") != rules.get("kv_heads") or shard.is_sharded("head_dim"):
        return "the rules split the heads and the kv heads differently, or the head dim"
    sizes = {"rows": (b, shard.axis_size("batch")), "heads": (h, shard.axis_size("heads")),
             "kv heads": (kv, shard.axis_size("kv_heads"))}
    for name, (n, ways) in sizes.items():
        if n % ways:
            return f"{n} {name} do not split {ways} ways"
    return None


def row_spans(ok: jax.Array) -> jax.Array:
    """int32 ``[b, 2]``: each row's first slot it may attend to and one past its last (``ok``: bool
    ``[b, S]``); a row with none spans the whole cache (XLA's uniform average over every slot)."""
    S = ok.shape[1]
    some = jnp.any(ok, axis=1)
    lo = jnp.where(some, jnp.argmax(ok, axis=1), 0)
    hi = jnp.where(some, S - jnp.argmax(ok[:, ::-1], axis=1), S)
    return jnp.stack([lo, hi], axis=1).astype(jnp.int32)


def _kernel(q_ref, k_ref, v_ref, ok_ref, span_ref, o_ref, m_ref, l_ref, *, scale: float, softcap: float,
            block_k: int, per_split: int):
    """One program: row ``program_id(0)``, kv head ``program_id(1)``, split ``program_id(2)``. Refs: q
    ``[G, D]`` (the head group, zero-padded), k/v ``[S, D]``, ok int32 ``[S]``, span int32 ``[2]``;
    outputs o fp32 ``[G, D]`` (unnormalised), m and l fp32 ``[G]``."""
    j = pl.program_id(2)
    slots = k_ref.shape[0]
    q = q_ref[...]
    lo, hi = span_ref[0], span_ref[1]
    first = jnp.maximum(j * per_split, jax.lax.div(lo, block_k))
    last = jnp.minimum((j + 1) * per_split, jax.lax.div(hi + block_k - 1, block_k))

    def body(i, carry):
        o, m, l = carry
        start = jnp.minimum(i * block_k, slots - block_k)  # the last block ends at slot S, overlapping the one before
        sl = pl.ds(start, block_k)
        k, v = k_ref[sl, :], v_ref[sl, :]
        idx = start + jnp.arange(block_k)
        inside = (idx >= jnp.maximum(lo, i * block_k)) & (idx < hi)  # this block's own slots within the row's span
        s = jax.lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = soft_cap(s * scale, softcap)
        s = jnp.where((ok_ref[sl] != 0)[None, :], s, MASKED)  # as XLA masks: a score, weighed in
        s = jnp.where(inside[None, :], s, -jnp.inf)  # not this block's to count: no weight at all
        return online_softmax_step(o, m, l, s, v)

    G, D = q.shape  # m starts finite (an empty split keeps o = l = 0 and weighs nothing): no inf - inf anywhere
    init = (jnp.zeros((G, D), jnp.float32), jnp.full((G,), MASKED, jnp.float32), jnp.zeros((G,), jnp.float32))
    o, m, l = jax.lax.fori_loop(first, last, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _triton(interpret: bool, head_dim: int):
    """Triton compiler parameters (``None`` for the interpreter)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton  # heavy: loads the CUDA plugin's Triton bindings
    return pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _partials(q, k_cache, v_cache, ok, span, *, scale, softcap, block_k, per_split, interpret):
    """The kernel's ``pallas_call``: q ``[b, kv, G, D]``, caches ``[b, S, kv, D]``, ok int32 ``[b, S]``, span
    int32 ``[b, 2]`` -> o fp32 ``[b, kv, n, G, D]``, m, l fp32 ``[b, kv, n, G]`` (``n`` splits)."""
    b, kv, G, D = q.shape
    S = k_cache.shape[1]
    n = -(-(-(-S // block_k)) // per_split)
    cache = pl.BlockSpec((None, S, None, D), lambda bi, ki, j: (bi, 0, ki, 0))
    row = lambda width: pl.BlockSpec((None, width), lambda bi, ki, j: (bi, 0))  # noqa: E731
    stat = pl.BlockSpec((None, None, None, G), lambda bi, ki, j: (bi, ki, j, 0))
    kernel = functools.partial(_kernel, scale=scale, softcap=softcap, block_k=block_k, per_split=per_split)
    return pl.pallas_call(
        kernel, grid=(b, kv, n),
        in_specs=[pl.BlockSpec((None, None, G, D), lambda bi, ki, j: (bi, ki, 0, 0)), cache, cache, row(S), row(2)],
        out_specs=[pl.BlockSpec((None, None, None, G, D), lambda bi, ki, j: (bi, ki, j, 0, 0)), stat, stat],
        out_shape=[jax.ShapeDtypeStruct((b, kv, n, G, D), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv, n, G), jnp.float32), jax.ShapeDtypeStruct((b, kv, n, G), jnp.float32)],
        interpret=interpret, compiler_params=_triton(interpret, D), name="flash_decoding",
    )(q, k_cache, v_cache, ok, span)


def _combine(o: jax.Array, m: jax.Array, l: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """The splits' partials (o ``[b, kv, n, G, D]``, m, l ``[b, kv, n, G]``, fp32) into the attention fp32
    ``[b, kv, G, D]``; ``sinks`` fp32 ``[kv, G]``: one more logit per query head, with no value."""
    top = jnp.max(m, axis=2)
    if sinks is not None:
        top = jnp.maximum(top, sinks[None])
    w = jnp.exp(m - top[:, :, None])  # an empty split has o = l = 0: whatever its weight, it adds nothing
    den = jnp.sum(w * l, axis=2)
    if sinks is not None:
        den = den + jnp.exp(sinks[None] - top)
    return jnp.sum(w[..., None] * o, axis=2) / den[..., None]


def flash_decode(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, ok: jax.Array, *, scale: float | None = None,
                 softcap: float = 0.0, sinks: jax.Array | None = None, block_k: int = 64, split: int = 512,
                 interpret: bool | None = None) -> jax.Array:
    """Flash-decoding (module doc) of one query per row over a KV cache, on one device (or one shard).

    Args:
        q: ``[b, 1, h, d]``, the new tokens' queries (rotated).
        k_cache, v_cache: ``[b, S, kv, d]`` (``kv`` divides ``h``; ``d`` a power of two ≥ 16, ``S ≥ 16``),
            the new keys and values already written.
        ok: bool ``[b, S]``: the slots each row may attend to (``cache_mask(index, 1, kv_valid, window)[:, 0]``).
        scale: of q·k (default ``d^-1/2``); softcap: Gemma 2's ``c·tanh(s/c)`` on the scaled scores (0: none);
        sinks: fp32 ``[h]``, GPT-OSS's logit per head that joins the softmax with no value.
        block_k: key slots per block (a power of two ≥ 16, capped by ``S``); split: slots per split (whole blocks).
        interpret: the Pallas interpreter; ``None``: decided when lowering (Triton for CUDA, the interpreter
            elsewhere), so a program exported for CUDA from a CPU holds the Triton kernel.

    Returns ``[b, 1, h, d]`` in ``v_cache``'s dtype, equal to :func:`cached_attention` with
    ``ok[:, None]`` as its mask (fp32 scores, softmax and sums; the probabilities enter ``p·v`` in v's dtype).

    Raises:
        ValueError: shapes the kernel does not take (:func:`kernel_refusal`), or a bad ``block_k``.
    """
    why = kernel_refusal(q, k_cache, v_cache)
    if why is not None:
        raise ValueError(f"flash_decode: {why}")
    if block_k < MIN_DIM or block_k & (block_k - 1):
        raise ValueError(f"flash_decode: block_k={block_k} must be a power of two >= {MIN_DIM}")
    b, _, h, d = q.shape
    S, kv = k_cache.shape[1], k_cache.shape[2]
    g = h // kv
    block_k = min(block_k, 1 << (S.bit_length() - 1))
    G = max(MIN_DIM, pl.next_power_of_2(g))
    dtype = jnp.promote_types(q.dtype, k_cache.dtype)
    qg = jnp.pad(q.reshape(b, kv, g, d).astype(dtype), ((0, 0), (0, 0), (0, G - g), (0, 0)))
    args = (qg, k_cache, v_cache, ok.astype(jnp.int32), row_spans(ok))
    opts = dict(scale=1.0 / math.sqrt(d) if scale is None else float(scale), softcap=float(softcap),
                block_k=block_k, per_split=max(1, split // block_k))

    def run(interp):
        return lambda *a: _partials(*a, **opts, interpret=interp)

    if interpret is None:
        o, m, l = jax.lax.platform_dependent(*args, cuda=run(False), default=run(True))
    else:
        o, m, l = run(bool(interpret))(*args)
    sink = None
    if sinks is not None:
        sink = jnp.pad(sinks.astype(jnp.float32).reshape(kv, g), ((0, 0), (0, G - g)))
    out = _combine(o, m, l, sink)[:, :, :g]
    return out.reshape(b, 1, h, d).astype(v_cache.dtype)


def attend_cache(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, index: jax.Array, kv_valid: jax.Array,
                 shard: Sharder = no_shard, window=0, scale: float | None = None, softcap: float = 0.0,
                 sinks: jax.Array | None = None) -> jax.Array:
    """The cached attention of the families' decode path: :func:`flash_decode` where ``shard.decode_kernel``
    says so and the kernel takes the shapes (:func:`kernel_refusal`), else XLA's :func:`cached_attention`.

    Args:
        q: ``[b, t, h, dq]``; k_cache, v_cache: ``[b, S, kv, dq]`` / ``[b, S, kv, dv]``, the new tokens' keys and
            values written at slots ``index ..``; index: int32 scalar or ``[b]`` (per row); kv_valid: bool ``[b, S]``;
            window: int or traced scalar (0: none); scale, softcap, sinks: as :func:`cached_attention`.
        shard: the activation sharder. ``decode_kernel`` (:meth:`Sharder.with_decode_kernel`): ``False``
            XLA's attention; ``True`` the kernel (Triton for CUDA, the Pallas interpreter elsewhere);
            ``None`` decided when lowering (the kernel for CUDA, XLA's attention elsewhere). On a mesh the
            kernel runs per shard (a ``shard_map``: rows over the ``batch`` axes, heads and kv heads over
            theirs), since XLA's partitioner cannot split a Pallas call.

    Returns ``[b, t, h, dv]`` in ``v_cache``'s dtype.
    """
    mask = cache_mask(index, q.shape[1], kv_valid, window)
    choice = getattr(shard, "decode_kernel", False)
    if choice is False or kernel_refusal(q, k_cache, v_cache, shard) is not None:
        return cached_attention(q, k_cache, v_cache, mask, scale, softcap, sinks)

    def kernel(interpret):
        def local(q, k, v, ok, *s):
            return flash_decode(q, k, v, ok[:, 0], scale=scale, softcap=softcap, sinks=s[0] if s else None,
                                interpret=interpret)
        return lambda q, k, v, ok, *s: _per_shard(local, shard, q, k, v, ok, *s)

    sink = (sinks,) if sinks is not None else ()
    if choice is None:
        xla = lambda q, k, v, ok, *s: cached_attention(q, k, v, ok, scale, softcap, s[0] if s else None)  # noqa: E731
        return jax.lax.platform_dependent(q, k_cache, v_cache, mask, *sink, cuda=kernel(False), default=xla)
    return kernel(None)(q, k_cache, v_cache, mask, *sink)


def _per_shard(local, shard, q, k_cache, v_cache, mask, *sinks) -> jax.Array:
    """``local(q, k, v, mask, *sinks)`` on each device's rows and heads (a ``shard_map`` over ``shard``'s
    mesh: q ``[b, 1, h, d]`` and the caches with the batch on the rules' ``batch`` axes and the heads on
    ``heads``/``kv_heads``, the mask ``[b, 1, S]`` with its rows, sinks ``[h]`` with the heads); without a
    mesh, ``local`` itself."""
    mesh = getattr(shard, "mesh", None)
    if mesh is None:
        return local(q, k_cache, v_cache, mask, *sinks)
    spec = lambda *axes: logical_to_spec(axes, shard.rules)  # noqa: E731
    qspec = spec("batch", None, "heads", None)
    kvspec = spec("batch", None, "kv_heads", None)
    in_specs = (qspec, kvspec, kvspec, spec("batch", None, None)) + (spec("heads"),) * len(sinks)
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=qspec, check_vma=False)
    return fn(q, k_cache, v_cache, mask, *sinks)
