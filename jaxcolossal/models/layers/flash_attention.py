"""Flash attention as Pallas kernels (``model.attention_impl=flash``), forward and backward.

FlashAttention (Dao et al., 2022; FlashAttention-2, Dao, 2023): the ``[t, t]`` score matrix is
never stored. Each program holds one block of queries and walks the key/value blocks with the
online softmax (running max ``m``, normaliser ``l``, unnormalised output), so memory is linear in
the sequence length. The backward recomputes the scores block by block from the saved
log-sum-exp ``lse = m + log l`` (FlashAttention-2's Algorithm 2): one program per key block
accumulates dK/dV over the query blocks, then, in the same program, one query block's dQ over
the key blocks. Causal programs stop at the diagonal.

Written for this project's layout after JAX's reference Triton kernel
(``jax.experimental.pallas.ops.gpu.attention``), with what the models need on top:

* layout ``[b, t, heads, head_dim]`` as the models compute it (no transposes);
* grouped-query attention: query head ``i`` reads kv head ``i // (h / kv)`` through the
  BlockSpec's index map, with no repeated k/v in memory; dK/dV come out per query head and are
  summed over each group;
* ``segment_ids`` (packed documents): a query sees only keys of its own segment;
* any length: the sequence is padded to whole blocks (padded keys are masked, padded queries
  sliced off) and the head dim to a power of two (zeros, which change no dot product);
* causal or not;
* a sliding window (Mistral, Gemma, GPT-OSS): a query sees itself and the ``window - 1`` keys before
  it; the window is a runtime int32 (a per-layer constant of a layer scan), and the loops skip the
  key/query blocks wholly outside it;
* a softmax scale other than ``1/sqrt(d)`` (Gemma's ``query_pre_attn_scalar``);
* attention sinks (GPT-OSS): one learned logit per head that joins the softmax with no value. The
  forward starts each row's online softmax at the sink (``m = sink``, ``l = 1``), so the saved
  log-sum-exp includes it and the dQ/dK/dV kernels are unchanged; the sink's own gradient is
  ``-Σ_t exp(sink − lse_t) · Δ_t`` (``Δ_t = dO_t · O_t``), summed outside the kernels.

On GPU the kernels lower through Triton; on any other backend they run with the Pallas
interpreter (``interpret=True``), which is how the CPU tests compare them with
:func:`reference_attention` in value and gradient.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
"""Score of a masked entry: finite, so a block with nothing valid yet cannot make NaN; it is
wiped by the correction factor as soon as the row meets a valid key (every causal row has one:
its own position)."""


def reference_attention(q, k, v, segment_ids=None, causal: bool = True) -> jax.Array:
    """Plain-XLA attention with the kernel's contract (fp32 softmax): q ``[b, t, h, d]``, k/v
    ``[b, t, kv, d]``, int ``segment_ids [b, t]`` -> ``[b, t, h, d]`` in ``q.dtype``."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    mask = jnp.ones((t, t), bool)
    if causal:
        mask = jnp.tril(mask)
    mask = jnp.broadcast_to(mask, (b, t, t))
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    s = jnp.where(mask[:, None, None], s, MASK)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def online_softmax_step(o, m, l, s, v):
    """One key block of the online softmax (Milakov & Gimelshein, 2018; FlashAttention's inner loop):
    fp32 ``o [G, D]``, running max ``m [G]`` and sum ``l [G]`` updated with the block's fp32 scores
    ``s [G, K]`` and values ``v [K, D]``. Returns the new ``(o, m, l)``; the caller divides ``o`` by ``l``."""
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = l * corr + jnp.sum(p, axis=-1)
    o = o * corr[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m_new, l


def _mask(qs, ks, q_seg, k_seg, causal: bool, kv_len: int, padded: bool, window=None):
    """Valid entries of a ``[len(qs), len(ks)]`` block (positions ``qs``/``ks``); ``window``: a traced
    int32 scalar (0: no window) or ``None``."""
    valid = None
    if causal:
        valid = qs[:, None] >= ks[None, :]
    if window is not None:
        near = (ks[None, :] > qs[:, None] - window) | (window == 0)
        valid = near if valid is None else valid & near
    if q_seg is not None:
        same = q_seg[:, None] == k_seg[None, :]
        valid = same if valid is None else valid & same
    if padded and not causal:  # causal already hides the padded keys (they are all in the future)
        inside = jnp.broadcast_to(ks[None, :] < kv_len, (qs.shape[0], ks.shape[0]))
        valid = inside if valid is None else valid & inside
    return valid


def _first_block(start, window, block: int):
    """The first block of ``block`` positions that holds a key within ``window`` of the position
    ``start`` (0 without a window: ``window`` ``None`` or 0)."""
    if window is None:
        return 0
    return jnp.where(window > 0, jax.lax.div(jnp.maximum(start - window + 1, 0), block), 0)


def _fwd_kernel(q_ref, k_ref, v_ref, seg_ref, win_ref, sink_ref, o_ref, lse_ref, *, scale, causal, block_q, block_k,
                kv_len, padded):
    qi = pl.program_id(0)
    q = q_ref[...]
    qs = qi * block_q + jnp.arange(block_q)
    q_seg = None if seg_ref is None else seg_ref[pl.ds(qi * block_q, block_q)]
    window = None if win_ref is None else win_ref[0]
    T = k_ref.shape[0]

    def body(j, carry):
        o, m, l = carry
        sl = pl.ds(j * block_k, block_k)
        k, v = k_ref[sl, :], v_ref[sl, :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        valid = _mask(qs, j * block_k + jnp.arange(block_k), q_seg, None if seg_ref is None else seg_ref[sl],
                      causal, kv_len, padded, window)
        if valid is not None:
            s = jnp.where(valid, s, MASK)
        return online_softmax_step(o, m, l, s, v)

    upper = jax.lax.div((qi + 1) * block_q + block_k - 1, block_k) if causal else T // block_k
    if sink_ref is None:
        m0, l0 = jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32)
    else:  # the sink joins every row's softmax: its logit is the running max so far, its exp 1
        m0, l0 = jnp.full((block_q,), sink_ref[0], jnp.float32), jnp.ones((block_q,), jnp.float32)
    init = (jnp.zeros((block_q, q.shape[-1]), jnp.float32), m0, l0)
    o, m, l = jax.lax.fori_loop(_first_block(qi * block_q, window, block_k), upper, body, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _bwd_kernel(q_ref, k_ref, v_ref, seg_ref, win_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, *, scale,
                causal, block, kv_len, padded):
    n = pl.program_id(2)
    T = q_ref.shape[0]
    window = None if win_ref is None else win_ref[0]

    def seg(sl):  # the segment ids of a block (None without them)
        return None if seg_ref is None else seg_ref[sl]

    def scores(q, k, qs, ks, q_sl, k_sl):
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        valid = _mask(qs, ks, seg(q_sl), seg(k_sl), causal, kv_len, padded, window)
        return s if valid is None else jnp.where(valid, s, MASK)

    # dK, dV of key block n: walk the query blocks (causal: from the diagonal on)
    k_sl = pl.ds(n * block, block)
    k, v = k_ref[k_sl, :], v_ref[k_sl, :]
    ks = n * block + jnp.arange(block)

    def dkdv(i, carry):
        dk, dv = carry
        q_sl = pl.ds(i * block, block)
        q, do = q_ref[q_sl, :], do_ref[q_sl, :]
        p = jnp.exp(scores(q, k, i * block + jnp.arange(block), ks, q_sl, k_sl) - lse_ref[q_sl][:, None])
        dv = dv + jax.lax.dot_general(p.astype(do.dtype), do, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[q_sl][:, None]) * scale
        dk = dk + jax.lax.dot_general(ds.astype(q.dtype), q, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
        return dk, dv

    zeros = jnp.zeros((block, k.shape[-1]), jnp.float32)
    last = T // block
    if window is not None:  # the last query block that sees this key block: within the window of its last key
        last = jnp.where(window > 0, jnp.minimum(last, jax.lax.div(n * block + block + window - 2, block) + 1), last)
    dk, dv = jax.lax.fori_loop(n if causal else 0, last, dkdv, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)

    # dQ of query block n: walk the key blocks (causal: up to the diagonal)
    q_sl = pl.ds(n * block, block)
    q, do = q_ref[q_sl, :], do_ref[q_sl, :]
    lse, delta = lse_ref[q_sl], delta_ref[q_sl]
    qs = n * block + jnp.arange(block)

    def dq_step(j, dq):
        kj_sl = pl.ds(j * block, block)
        kj, vj = k_ref[kj_sl, :], v_ref[kj_sl, :]
        p = jnp.exp(scores(q, kj, qs, j * block + jnp.arange(block), q_sl, kj_sl) - lse[:, None])
        dp = jax.lax.dot_general(do, vj, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None]) * scale
        return dq + jnp.dot(ds.astype(kj.dtype), kj, preferred_element_type=jnp.float32)

    dq = jax.lax.fori_loop(_first_block(n * block, window, block), n + 1 if causal else T // block, dq_step,
                           jnp.zeros((block, q.shape[-1]), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _triton(interpret: bool, head_dim: int):
    """Triton compiler parameters (the kernels are written for Triton: whole-block values, ``fori_loop``)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton  # heavy: loads the CUDA plugin's Triton bindings
    return pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _call_fwd(q, k, v, seg, win, sinks, *, causal, block_q, block_k, kv_len, scale, interpret):
    b, T, h, D = q.shape
    g = h // k.shape[2]
    kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal, block_q=block_q, block_k=block_k,
                               kv_len=kv_len, padded=T != kv_len)
    kvspec = pl.BlockSpec((None, T, None, D), lambda i, bi, hi: (bi, 0, hi // g, 0))
    in_specs = [pl.BlockSpec((None, block_q, None, D), lambda i, bi, hi: (bi, i, hi, 0)), kvspec, kvspec,
                None if seg is None else pl.BlockSpec((None, T), lambda i, bi, hi: (bi, 0)),
                None if win is None else pl.BlockSpec((1,), lambda i, bi, hi: (0,)),
                None if sinks is None else pl.BlockSpec((1,), lambda i, bi, hi: (hi,))]
    return pl.pallas_call(
        kernel, grid=(T // block_q, b, h), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, block_q, None, D), lambda i, bi, hi: (bi, i, hi, 0)),
                   pl.BlockSpec((None, None, block_q), lambda i, bi, hi: (bi, hi, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, T), jnp.float32)],
        interpret=interpret, compiler_params=_triton(interpret, D),
        name="flash_attention_fwd")(q, k, v, seg, win, sinks)


def _call_bwd(q, k, v, seg, win, o, lse, do, *, causal, block, kv_len, scale, interpret):
    """dQ, dK, dV (per kv head) and ``Δ = rowsum(dO · O)`` fp32 ``[b, h, T]``."""
    b, T, h, D = q.shape
    g = h // k.shape[2]
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    full = pl.BlockSpec((None, T, None, D), lambda bi, hi, n: (bi, 0, hi, 0))
    kvspec = pl.BlockSpec((None, T, None, D), lambda bi, hi, n: (bi, 0, hi // g, 0))
    row = pl.BlockSpec((None, None, T), lambda bi, hi, n: (bi, hi, 0))
    blk = pl.BlockSpec((None, block, None, D), lambda bi, hi, n: (bi, n, hi, 0))
    kernel = functools.partial(_bwd_kernel, scale=scale, causal=causal, block=block, kv_len=kv_len,
                               padded=T != kv_len)
    dq, dk, dv = pl.pallas_call(
        kernel, grid=(b, h, T // block),
        in_specs=[full, kvspec, kvspec, None if seg is None else pl.BlockSpec((None, T), lambda bi, hi, n: (bi, 0)),
                  None if win is None else pl.BlockSpec((1,), lambda bi, hi, n: (0,)), full, row, row],
        out_specs=[blk, blk, blk],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape, jnp.float32),
                   jax.ShapeDtypeStruct(q.shape, jnp.float32)],
        interpret=interpret, compiler_params=_triton(interpret, D), name="flash_attention_bwd")(
            q, k, v, seg, win, do, lse, delta)
    # per query head -> per kv head: sum each group
    def group(a):
        return a.reshape(b, T, h // g, g, D).sum(axis=3).astype(k.dtype)

    return dq, group(dk), group(dv), delta


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _flash(q, k, v, seg, win, sinks, causal, block_q, block_k, kv_len, scale, interpret):
    return _call_fwd(q, k, v, seg, win, sinks, causal=causal, block_q=block_q, block_k=block_k, kv_len=kv_len,
                     scale=scale, interpret=interpret)[0]


def _flash_fwd(q, k, v, seg, win, sinks, causal, block_q, block_k, kv_len, scale, interpret):
    o, lse = _call_fwd(q, k, v, seg, win, sinks, causal=causal, block_q=block_q, block_k=block_k, kv_len=kv_len,
                       scale=scale, interpret=interpret)
    return o, (q, k, v, seg, win, sinks, o, lse)


def _flash_bwd(causal, block_q, block_k, kv_len, scale, interpret, res, do):
    q, k, v, seg, win, sinks, o, lse = res
    block = min(block_q, block_k)
    dq, dk, dv, delta = _call_bwd(q, k, v, seg, win, o, lse, do, causal=causal, block=block, kv_len=kv_len,
                                  scale=scale, interpret=interpret)
    dsinks = None
    if sinks is not None:  # d sink_h = -Σ_{b,t} p_sink · Δ, p_sink = exp(sink_h − lse); padded rows: Δ = 0
        dsinks = -jnp.sum(jnp.exp(sinks[None, :, None] - lse) * delta, axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, None, None, dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)


def _checked(q, k, v, block_q: int, block_k: int, causal: bool, window) -> None:
    """Raise ValueError for shapes or options the kernels do not take."""
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != t or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"flash_attention: q {q.shape} and k/v {k.shape}/{v.shape} do not fit "
                         "([b, t, h, d] and [b, t, kv, d] with kv dividing h)")
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk < 1 or blk & (blk - 1):
            raise ValueError(f"flash_attention: {name}={blk} must be a power of two")
    if not causal and not (isinstance(window, int) and window == 0):
        raise ValueError("flash_attention: a sliding window needs causal=True")


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None,
                    causal: bool = True, block_q: int = 64, block_k: int = 64,
                    interpret: bool | None = None, *, scale: float | None = None, window=0,
                    sinks: jax.Array | None = None) -> jax.Array:
    """Flash attention (module doc). q ``[b, t, h, d]``, k/v ``[b, t, kv, d]`` (``kv`` divides
    ``h``), optional int ``segment_ids [b, t]``; returns ``[b, t, h, d]`` in ``q.dtype``. Scores and
    softmax in fp32. Differentiable (Pallas backward kernel; the sinks' gradient outside it).

    Args:
        block_q, block_k: query / key block sizes (powers of two; capped at the padded length).
            The backward uses the smaller for both.
        interpret: run with the Pallas interpreter; default (``None``): decided when lowering
            (``jax.lax.platform_dependent``): Triton for CUDA, the interpreter elsewhere, so a
            program exported for CUDA from a CPU holds the Triton kernels.
        scale: the scale of q·k (default ``d^-1/2``).
        window: a query attends to itself and the ``window − 1`` keys before it: an int or a traced
            int32 scalar (a layer scan's per-layer constant); 0: no window. Causal only.
        sinks: fp32 ``[h]``, a learned logit per head that joins the softmax with no value (GPT-OSS).

    Raises:
        ValueError: shapes that do not fit (different head dims, ``kv`` not dividing ``h``, block
            sizes not powers of two), or a window without ``causal``.
    """
    _checked(q, k, v, block_q, block_k, causal, window)
    b, t, h, d = q.shape
    cap = max(16, pl.next_power_of_2(t))
    block_q, block_k = min(block_q, cap), min(block_k, cap)
    blk = max(block_q, block_k)
    T = -(-t // blk) * blk
    D = max(16, pl.next_power_of_2(d))

    def pad(a):
        return jnp.pad(a, ((0, 0), (0, T - t), (0, 0), (0, D - d)))

    seg = None
    if segment_ids is not None:
        seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, T - t)), constant_values=-1)
    win = None if isinstance(window, int) and window == 0 else jnp.reshape(jnp.asarray(window, jnp.int32), (1,))
    sink = None if sinks is None else sinks.astype(jnp.float32)
    args = (pad(q), pad(k), pad(v), seg, win, sink)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def run(interp):
        def call(*a):
            return _flash(*a, causal, block_q, block_k, t, scale, interp)
        return call

    if interpret is None:  # chosen when lowering: Triton for CUDA, the interpreter for any other platform
        out = jax.lax.platform_dependent(*args, cuda=run(False), default=run(True))
    else:
        out = run(bool(interpret))(*args)
    return out[:, :t, :, :d]
