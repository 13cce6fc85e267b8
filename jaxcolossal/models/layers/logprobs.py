"""Log-probabilities of given tokens under the LM head, never holding more than one chunk of logits.

:func:`token_logprobs` returns ``log softmax(h @ w)[token]`` per position (fp32 ``[b, t]``), for
the responses of preference and policy-gradient training and for the pre-training loss
(:func:`jaxcolossal.models.layers.vocab.lm_head_loss` is minus its masked sum). It follows
Wijmans et al., 2024 (*Cut Your Losses in Large-Vocabulary Language Models*, Apple's
cut-cross-entropy), the Liger kernel's fused linear cross-entropy and tokamax's
``linear_softmax_cross_entropy_loss``, written in JAX for the SPMD partitioner:

* **Chunked over tokens and over the vocabulary.** A ``lax.scan`` runs over chunks of
  ``chunk_tokens`` tokens per device; inside it a second scan runs over chunks of ``chunk_vocab``
  vocabulary columns per device, computing the chunk's fp32 logits ``[chunk_tokens, chunk_vocab]``
  and folding them into an online log-sum-exp (a running max and a running sum of exponentials
  rescaled to it, Milakov & Gimelshein, 2018) and into the target's logit (picked in the chunk
  that holds it). Nothing of size ``tokens × vocab`` exists.
* **Vocab-parallel** (Megatron's vocab-parallel cross-entropy). The head ``w [d, v]`` is on the
  ``tp`` mesh axis in ``v``; it is viewed as ``[d, n, v/n]`` (``n`` = the vocab shards, the middle
  dim on tp) and each vocab chunk is a slice ``[d, n, chunk_vocab]`` of it, so every device
  works on its own columns in every step; the chunk's max, sum and picked logit are reductions
  over ``n`` as well, i.e. all-reduces of ``[b, chunk_tokens]`` over tp.
* **A custom VJP that recomputes.** The forward saves only the log-sum-exp ``[b, t]``; the
  backward recomputes each chunk's logits, forms ``g · (onehot - softmax)`` and contracts it at
  once into ``dh`` and ``dW``, accumulated chunk by chunk in fp32. So the backward also holds one
  chunk of logits; the price is one more ``2·T·v·d`` matmul (``8·T·v·d`` FLOPs for value and
  gradient instead of ``6``), as in cut-cross-entropy and Liger.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

Sharder = Callable[[jax.Array, tuple], jax.Array]

PAD_LOGIT = -1e30
"""Logit given to the padded vocabulary columns (``vocab_pad_multiple``): softmax weight 0."""


def no_shard(x, axes):
    return x


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """Gemma's soft-cap ``cap · tanh(x / cap)`` (fp32 scores or logits; ``cap`` 0: ``x`` unchanged), as
    transformers' Gemma 2 applies it to the attention scores and Gemma 2/3 to the final logits."""
    return x if not cap else cap * jnp.tanh(x / cap)


def vocab_shards(shard: Sharder) -> int:
    """How many ways ``shard``'s rules split the ``vocab`` axis (1 without a mesh)."""
    size = getattr(shard, "axis_size", None)
    return size("vocab") if size is not None else 1


def batch_shards(shard: Sharder, b: int) -> int:
    """How many ways ``shard``'s rules split a batch of ``b`` rows (1 when they do not divide it)."""
    size = getattr(shard, "axis_size", None)
    n = size("batch") if size is not None else 1
    return n if n > 1 and b % n == 0 else 1


def chunk_positions(batch: int, seq: int, chunk_tokens: int) -> int:
    """Sequence positions per chunk: ``chunk_tokens`` tokens spread over ``batch`` rows, in ``[1, seq]``."""
    return max(1, min(seq, math.ceil(chunk_tokens / max(batch, 1))))


def vocab_chunks(local_vocab: int, chunk_vocab: int) -> tuple[int, int]:
    """``(chunks, columns per chunk)`` covering a device's ``local_vocab`` columns in chunks of at
    most about ``chunk_vocab`` (``<= 0``: one chunk). A divisor of ``local_vocab`` is taken when one
    gives chunks of at least ``chunk_vocab / 2`` (128256 in chunks of 8192: 16 × 8016), so the head
    needs no padding; otherwise the last chunk is padded (``chunks × columns >= local_vocab``)."""
    if chunk_vocab <= 0 or chunk_vocab >= local_vocab:
        return 1, local_vocab
    lo = math.ceil(local_vocab / chunk_vocab)
    for k in range(lo, 2 * lo + 1):
        if local_vocab % k == 0:
            return k, local_vocab // k
    return lo, chunk_vocab


def zeros_varying_like(shape, dtype, *refs) -> jax.Array:
    """Zeros that vary over the same manual mesh axes as ``refs`` (inside ``shard_map``, e.g. the
    pipeline's stages), so that a ``lax.scan`` carry keeps one type; plain zeros elsewhere."""
    z = jnp.zeros(shape, dtype)
    axes = set()
    for r in refs:
        aval = jax.typeof(r)
        mat = getattr(aval, "manual_axis_type", None)  # jax 0.10; other releases expose ``aval.vma``
        axes |= set(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())
    if not axes:
        return z
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(z, tuple(sorted(axes)), to="varying")
    return jax.lax.pvary(z, tuple(sorted(axes)))


# ----------------------------------------------------------------------------- the public entry


EXTRAS = ("entropy", "mean_logits", "is_top1")
"""The per-token statistics :func:`token_logprobs` can return beside the log-probs (TRL 1.16's fused LM
head's ``outputs``): the distribution's entropy, the mean of its (tempered) logits over the vocabulary,
and whether the target is the most likely token (the first of equal maxima, as ``argmax``)."""


def token_logprobs(h: jax.Array, head_w: jax.Array, tokens: jax.Array, mask: jax.Array | None, vocab_size: int,
                   shard: Sharder = no_shard, chunk_tokens: int = 1024, chunk_vocab: int = 8192,
                   softcap: float = 0.0, temperature: float = 1.0, extras: tuple[str, ...] = ()):
    """``log softmax(h @ head_w / temperature)[tokens]`` per position: fp32 ``[b, t]``, 0 where ``mask`` is 0;
    with ``extras`` also those of :data:`EXTRAS` (fp32 ``[b, t]`` each, no gradient).

    Args:
        h: ``[b, t, d]`` final-norm hidden states in the compute dtype, sharded ``("batch", "seq", "embed")``.
        head_w: ``[d, v]`` the LM head (``embed_tokens.T`` when tied), ``v`` padded to a multiple
            of the vocab shards, sharded ``("embed", "vocab")``: ``v`` over tp.
        tokens: int32 ``[b, t]`` in ``[0, vocab_size)``: the token whose log-prob is returned at
            each position (the next token, for a causal model's hidden states).
        mask: optional ``[b, t]`` weights (1 = wanted); the result is multiplied by it, so masked
            positions are 0 and send no gradient.
        vocab_size: the real vocabulary; columns ``>= vocab_size`` are excluded from the
            normaliser (their logits are :data:`PAD_LOGIT`).
        shard: the activation sharder (:class:`jaxcolossal.parallel.sharding.Sharder`).
        chunk_tokens: tokens per device per chunk (``model.loss_chunk_tokens``); ``<= 0``
            materialises the fp32 logits ``[b, t, v]`` (the reference path, differentiated by autodiff).
        chunk_vocab: vocabulary columns per device per chunk (``model.loss_chunk_vocab``); ``<= 0``:
            a device's whole vocabulary shard in one chunk.
        softcap: the final logit soft-cap ``c`` (``model.final_logit_softcapping``, Gemma): the logits
            are ``c · tanh(h @ head_w / c)`` (:func:`soft_cap`); 0: none.
        temperature: the logits (soft-capped first) are divided by it, > 0: the sampling distribution
            at that temperature, as TRL's fused LM head computes its log-probs and entropies (trl 1.16
            ``add_fused_lm_head(temperature=...)``).
        extras: names of :data:`EXTRAS` to return as well (0 where ``mask`` is 0), each one more running
            term of the same chunks' online log-sum-exp (no extra pass over the vocabulary).

    Differentiable in ``h`` and ``head_w`` (gradients in their dtypes, formed in fp32 and scaled by
    the incoming cotangent before the cast, see :func:`_chunked_logprobs`). Returns ``lp`` or, with
    ``extras``, ``(lp, {name: [b, t]})``.
    """
    b, t, d = h.shape
    valid = jnp.ones((b, t), jnp.float32) if mask is None else mask.astype(jnp.float32)
    if chunk_tokens <= 0:
        lp, more = full_logprobs(h, head_w, tokens, vocab_size, shard, softcap, temperature, extras=EXTRAS)
        return (lp * valid, {k: more[k] * valid for k in extras}) if extras else lp * valid
    rows = b // batch_shards(shard, b)  # a device's rows: the chunks are sized per device
    c = chunk_positions(rows, t, chunk_tokens)
    n = math.ceil(t / c)
    if n * c != t:  # pad the sequence to whole chunks; padded positions are cut off below
        pad = ((0, 0), (0, n * c - t))
        h, tokens = jnp.pad(h, pad + ((0, 0),)), jnp.pad(tokens, pad)

    def to_chunks(a):  # [b, n*c, ...] -> [n, b, c, ...]: the batch dim keeps its sharding
        return jnp.moveaxis(a.reshape((b, n, c) + a.shape[2:]), 1, 0)

    w3, layout = _vocab_view(head_w, shard, chunk_vocab)
    lp, more = _chunked_logprobs(shard, vocab_size, *layout, softcap, temperature, tuple(extras))(
        to_chunks(h), w3, to_chunks(tokens))

    def back(a):  # [n, b, c] -> [b, t]
        return jnp.moveaxis(a, 0, 1).reshape(b, n * c)[:, :t] * valid

    return (back(lp), {k: back(jax.lax.stop_gradient(more[k])) for k in extras}) if extras else back(lp)


def full_logprobs(h: jax.Array, w: jax.Array, tokens: jax.Array, vocab_size: int,
                  shard: Sharder = no_shard, softcap: float = 0.0, temperature: float = 1.0,
                  extras: tuple[str, ...] = ()):
    """The reference: fp32 logits ``[b, t, v]`` materialised (soft-capped by ``softcap``, 0: not; then
    divided by ``temperature``), ``logits[token] - logsumexp`` (fp32 ``[b, t]``), and with ``extras``
    ``{name: [b, t]}`` of :data:`EXTRAS` (no gradient); vocab-parallel by the partitioner's all-reduces
    over tp."""
    lg = shard(jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32), ("batch", "seq", "vocab"))
    lg = soft_cap(lg, softcap) / temperature
    col = jax.lax.broadcasted_iota(jnp.int32, lg.shape, 2)
    real = col < vocab_size
    if lg.shape[-1] != vocab_size:
        lg = jnp.where(real, lg, PAD_LOGIT)
    picked = jnp.sum(jnp.where(col == tokens[..., None], lg, 0.0), axis=-1)
    lse = jax.nn.logsumexp(lg, axis=-1)
    if not extras:
        return picked - lse
    sg, sp = jax.lax.stop_gradient(lg), jax.lax.stop_gradient(picked)
    p = jax.nn.softmax(sg, axis=-1)
    more = {"entropy": jax.lax.stop_gradient(lse) - jnp.sum(p * jnp.where(real, sg, 0.0), -1),
            "mean_logits": jnp.sum(jnp.where(real, sg, 0.0), -1) / vocab_size,
            "is_top1": ((sp >= jnp.max(sg, -1)) &
                        (sp > jnp.max(jnp.where(col < tokens[..., None], sg, -jnp.inf), -1))).astype(jnp.float32)}
    return picked - lse, {k: more[k] for k in extras}


def _vocab_view(w: jax.Array, shard: Sharder, chunk_vocab: int) -> tuple[jax.Array, tuple[int, int, int, int]]:
    """``w [d, v]`` as ``[d, n, nv·vc]`` (``n`` vocab shards on tp; each shard's ``v/n`` columns
    zero-padded to ``nv`` chunks of ``vc`` when no divisor serves), and ``(n, v/n, nv, vc)``. With
    one vocab shard the view stays ``[d, nv·vc]``: a size-1 middle dim makes XLA:CPU copy the whole
    head into the loop (a layout change of a unit dim), which is the size of the logits' budget."""
    d, v = w.shape
    n = vocab_shards(shard)
    n = n if n > 1 and v % n == 0 else 1
    local = v // n
    nv, vc = vocab_chunks(local, chunk_vocab)
    w = shard(w, ("embed", "vocab"))  # ZeRO-3: gathered once, not in every chunk
    w3 = w if n == 1 else w.reshape(d, n, local)
    if nv * vc != local:
        w3 = jnp.pad(w3, ((0, 0),) * (w3.ndim - 1) + ((0, nv * vc - local),))
    return shard(w3, _head_axes(n)), (n, local, nv, vc)


def _head_axes(n: int) -> tuple:
    """The logical axes of the vocab view (:func:`_vocab_view`) for ``n`` vocab shards."""
    return ("embed", None) if n == 1 else ("embed", "vocab", None)


# ----------------------------------------------------------------------------- the custom VJP


def _chunked_logprobs(shard: Sharder, vocab_size: int, n: int, local: int, nv: int, vc: int, softcap: float = 0.0,
                      temperature: float = 1.0, extras: tuple[str, ...] = ()):
    """The chunked log-probs as a ``custom_vjp`` over ``(h_chunks [m, b, c, d], w3 [d, n, nv·vc],
    tokens [m, b, c])`` -> ``(log-probs, {extra: ...})``, fp32 ``[m, b, c]`` each (``m`` token chunks of
    ``c`` positions; the vocab view of :func:`_vocab_view`); the ``extras`` (:data:`EXTRAS`) take no
    cotangent, and their running terms are only formed when asked for.

    Forward: per token chunk, an online log-sum-exp over the ``nv`` vocab chunks; residuals are
    the inputs and the fp32 log-sum-exp ``[m, b, c]``. Backward: per token chunk and vocab chunk,
    the logits are recomputed and ``dlogits = g · (onehot - softmax)`` contracted into ``dh`` (fp32)
    and into ``dW``'s slice (fp32, each data shard summing its own
    rows, reduced once per vocab chunk; :func:`_backward_scan`). ``g`` is divided by its largest magnitude first, so that
    ``dlogits`` lies in ``[-1, 1]`` when cast to the compute dtype for its two matmuls (which
    accumulate in fp32, as Liger's kernel does), and the magnitude is multiplied back in fp32: an
    fp16 loss scale neither overflows nor underflows the cast. With a ``softcap`` ``c`` each chunk's
    logits are ``c · tanh(u / c)`` of the raw ``u = h @ w`` (:func:`soft_cap`), and ``dlogits`` is
    multiplied by the cap's slope ``1 − (logit / c)²`` before the contraction. With a ``temperature``
    ``τ`` the (capped) logits are divided by ``τ``, and ``dlogits`` by ``τ`` as well. The entropy is
    ``lse - Σ p·logit`` (a running ``Σ exp·logit``), the mean logit a running sum over the real columns,
    and ``is_top1`` compares the target's logit with the running max and with the max of the columns
    before it (TRL's kernel's test).
    """

    def chunk_logits(hc, w3, j):  # [b, c, d], the view, chunk index -> fp32 [b, c, n, vc], col ids, w chunk
        wj = _columns(w3, j * vc, vc)
        if n == 1:
            lg = jnp.einsum("bcd,dk->bck", hc, wj, preferred_element_type=jnp.float32)[:, :, None, :]
        else:
            lg = jnp.einsum("bcd,dnk->bcnk", hc, wj, preferred_element_type=jnp.float32)
        lg = soft_cap(shard(lg, ("batch", "seq", "vocab" if n > 1 else None, None)), softcap)
        if temperature != 1.0:
            lg = lg / temperature
        loc = j * vc + jnp.arange(vc, dtype=jnp.int32)[None, :]
        col = jnp.arange(n, dtype=jnp.int32)[:, None] * local + loc  # [n, vc] global column ids
        keep = (loc < local) & (col < vocab_size)
        return jnp.where(keep, lg, PAD_LOGIT), col, wj

    def forward_chunk(hc, w3, yc):  # one token chunk: (log-prob, lse, {extra}), fp32 [b, c] each
        def body(carry, j):
            m, s, picked, sl, zs, before = carry
            lg, col, _ = chunk_logits(hc, w3, j)
            m_new = jnp.maximum(m, jnp.max(lg, axis=(2, 3)))
            e = jnp.exp(lg - m_new[..., None, None])
            rescale = jnp.exp(m - m_new)
            s = s * rescale + jnp.sum(e, axis=(2, 3))
            real = jnp.where(lg > PAD_LOGIT, lg, 0.0)
            if "entropy" in extras:  # Σ exp·logit, rescaled like s
                sl = sl * rescale + jnp.sum(e * real, axis=(2, 3))
            if "mean_logits" in extras:
                zs = zs + jnp.sum(real, axis=(2, 3))
            if "is_top1" in extras:  # the largest logit of the columns before the target's
                before = jnp.maximum(before, jnp.max(jnp.where(col < yc[..., None, None], lg, -jnp.inf), axis=(2, 3)))
            picked = picked + jnp.sum(jnp.where(col == yc[..., None, None], lg, 0.0), axis=(2, 3))
            return (m_new, s, picked, sl, zs, before), None
        z = zeros_varying_like(yc.shape, jnp.float32, hc, w3, yc)
        (m, s, picked, sl, zs, before), _ = jax.lax.scan(body, (z - jnp.inf, z, z, z, z, z - jnp.inf), jnp.arange(nv))
        lse = m + jnp.log(s)
        more = {"entropy": lse - sl / s, "mean_logits": zs / vocab_size,
                "is_top1": ((picked >= m) & (picked > before)).astype(jnp.float32)}
        return picked - lse, lse, {k: more[k] for k in extras}

    def fwd(hs, w3, ys):
        lp, lse, more = jax.lax.map(lambda xs: forward_chunk(xs[0], w3, xs[1]), (hs, ys))
        return (lp, more), (hs, w3, ys, lse)

    @jax.custom_vjp
    def chunked(hs, w3, ys):
        return fwd(hs, w3, ys)[0]

    def bwd(res, g):
        hs, w3, ys, lse = res
        g = g[0]  # the extras' cotangents are dropped: they carry no gradient
        big = jnp.max(jnp.abs(g))
        big = jnp.where(big > 0, big, 1.0).astype(jnp.float32)
        dh, dw = _backward_scan(chunk_logits, shard, (hs, w3, ys, lse, g / big), big, n, nv, vc, softcap,
                                temperature)
        return dh.astype(hs.dtype), dw, None

    chunked.defvjp(fwd, bwd)
    return chunked


def _backward_scan(chunk_logits: Callable, shard: Sharder, arrays: tuple, big: jax.Array, n: int, nv: int,
                   vc: int, softcap: float = 0.0, temperature: float = 1.0):
    """The backward's two loops, over vocab chunks outside and token chunks inside: ``(dh [m, b, c,
    d]`` fp32, ``dW [d, n, nv·vc]`` in ``w3``'s dtype), for the cotangent ``g [m, b, c]`` divided by
    its largest magnitude ``big`` (see :func:`_chunked_logprobs`). Vocab-outer, so a vocab chunk's
    ``dW`` is summed over all tokens in fp32 (``[d, n, vc]``), multiplied by ``big`` and cast once
    into the result: no fp32 buffer of the whole head's size (the step's own gradient buffer is
    one already); ``dh`` (``tokens × d``) is the one carried whole, in fp32. ``softcap``: the chunks'
    logits are soft-capped, so ``dlogits`` takes the cap's slope ``1 − (logit / c)²`` (0 on the padded
    columns, whose logit is far below ``−c``); ``temperature`` ``τ``: the chunks' logits are the capped
    ones over ``τ``, so the cap's slope reads ``logit·τ`` and ``dlogits`` is divided by ``τ``."""
    hs, w3, ys, lse, g = arrays
    nb = batch_shards(shard, hs.shape[1])

    def per_shard(a):  # [b, ...] -> [nb, b/nb, ...]: each data shard sums its own rows' dW
        return a.reshape((nb, a.shape[0] // nb) + a.shape[1:])

    def token_step(j, dwj, xs):  # one token chunk of vocab chunk j: its dh part, dW_j += its part
        hc, yc, lc, gc = xs
        lg, col, wj = chunk_logits(hc, w3, j)
        p = jnp.exp(lg - lc[..., None, None])
        dlg = gc[..., None, None] * ((col == yc[..., None, None]).astype(jnp.float32) - p)
        if softcap:  # through c·tanh(u/c): d/du = 1 − tanh² = 1 − (logit/c)²; a pad's PAD_LOGIT clips to slope 0
            dlg = dlg * (1.0 - jnp.square(jnp.clip(lg * temperature / softcap, -1.0, 1.0)))
        if temperature != 1.0:  # through logit / τ
            dlg = dlg / temperature
        dlg = shard(dlg.astype(hc.dtype), ("batch", "seq", "vocab" if n > 1 else None, None))
        if n == 1:  # the 2-D view of _vocab_view
            dlg = dlg[:, :, 0, :]
            dh = jnp.einsum("bck,dk->bcd", dlg, wj, preferred_element_type=jnp.float32)
            part = jnp.einsum("ebcd,ebck->edk", per_shard(hc), per_shard(dlg), preferred_element_type=jnp.float32)
        else:
            dh = jnp.einsum("bcnk,dnk->bcd", dlg, wj, preferred_element_type=jnp.float32)
            part = jnp.einsum("ebcd,ebcnk->ednk", per_shard(hc), per_shard(dlg), preferred_element_type=jnp.float32)
        return dwj + shard(part, ("batch",) + _head_axes(n)), shard(dh, ("batch", "seq", "embed"))

    def vocab_step(carry, j):
        dh, dw = carry
        dwj0 = shard(zeros_varying_like((nb,) + w3.shape[:-1] + (vc,), jnp.float32, hs, w3, ys, lse, g),
                     ("batch",) + _head_axes(n))
        dwj, dh_j = jax.lax.scan(lambda acc, xs: token_step(j, acc, xs), dwj0, (hs, ys, lse, g))
        dwj = (jnp.sum(dwj, axis=0) * big).astype(dw.dtype)
        return (dh + dh_j, _set_columns(dw, dwj, j * vc)), None

    dh0 = zeros_varying_like(hs.shape, jnp.float32, hs, w3, ys, lse, g)
    dw0 = shard(zeros_varying_like(w3.shape, w3.dtype, hs, w3, ys, lse, g), _head_axes(n))
    (dh, dw), _ = jax.lax.scan(vocab_step, (dh0, dw0), jnp.arange(nv))
    return dh * big, dw


def _columns(w: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """``w[..., start:start + size]`` for a traced ``start``. A 16-bit float head is sliced as its
    uint16 bits: XLA:CPU computes a bf16 ``dynamic-slice`` in fp32, upcasting the whole head (and
    hoisting the upcast out of the loop: an fp32 copy of the head); on GPUs the bitcasts are free."""
    if jnp.dtype(w.dtype).itemsize != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        return jax.lax.dynamic_slice_in_dim(w, start, size, axis=w.ndim - 1)
    bits = jax.lax.dynamic_slice_in_dim(jax.lax.bitcast_convert_type(w, jnp.uint16), start, size, axis=w.ndim - 1)
    return jax.lax.bitcast_convert_type(bits, w.dtype)


def _set_columns(w: jax.Array, part: jax.Array, start: jax.Array) -> jax.Array:
    """``w`` with ``w[..., start:start + part.shape[-1]] = part``; 16-bit floats as their bits
    (see :func:`_columns`)."""
    if jnp.dtype(w.dtype).itemsize != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        return jax.lax.dynamic_update_slice_in_dim(w, part, start, axis=w.ndim - 1)
    u16 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)  # noqa: E731
    out = jax.lax.dynamic_update_slice_in_dim(u16(w), u16(part), start, axis=w.ndim - 1)
    return jax.lax.bitcast_convert_type(out, w.dtype)
