"""Causal grouped-query attention, shared by every model family: the local form on whole sequences
(XLA einsum with an fp32 softmax, cuDNN, or the Pallas flash kernels) and, when the rules table
splits the sequence, its sequence-parallel forms (:mod:`jaxcolossal.parallel.sequence`: Ulysses,
ring attention). Shapes: q ``[b, t, h, q]``, k/v ``[b, t, k, q]`` (``h % k == 0``)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxcolossal.models.layers.flash_attention import flash_attention
from jaxcolossal.models.layers.logprobs import soft_cap
from jaxcolossal.models.layers.vocab import Sharder, no_shard
from jaxcolossal.parallel import sequence


def attention(q, k, v, impl: str = "xla", segment_ids: jax.Array | None = None, shard: Sharder = no_shard,
              positions: jax.Array | None = None, **options) -> jax.Array:
    """Causal grouped-query attention. q ``[b, t, h, q]``, k/v ``[b, t, k, q]`` -> ``[b, t, h, q]``.

    :func:`local_attention` on whole sequences, or, when ``shard``'s rules split the sequence
    (``parallel.sequence_parallelism_mode`` all_to_all / ring_attn), the sequence-parallel form of
    it (:func:`jaxcolossal.parallel.sequence.attend`; ring attention masks by ``positions`` int ``[b, t]``).
    ``options``: :func:`local_attention`'s ``window``, ``scale``, ``softcap``, ``sinks`` (the config
    refuses ring attention with a window, and Ulysses and ring attention with sinks:
    config/architecture.py).
    """
    local = partial(local_attention, **options) if options else local_attention
    return sequence.attend(q, k, v, shard, local, impl, segment_ids, positions)


@jax.custom_vjp
def softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.softmax(x, axis=-1)`` whose backward pass keeps only its output ``p``
    (``dx = p · (g − Σ g·p)``). Differentiating ``jax.nn.softmax`` itself (JAX's default,
    ``jax_softmax_custom_jvp`` off) saves the masked scores and ``exp`` as well, three
    ``[b, heads, t, t]`` fp32 tensors per layer instead of one."""
    return jax.nn.softmax(x, axis=-1)


def _softmax_fwd(x):
    p = jax.nn.softmax(x, axis=-1)
    return p, p


def _softmax_bwd(p, g):
    return ((g - jnp.sum(g * p, axis=-1, keepdims=True)) * p,)


softmax.defvjp(_softmax_fwd, _softmax_bwd)


def local_attention(q, k, v, impl: str = "xla", segment_ids: jax.Array | None = None, window=0,
                    scale: float | None = None, softcap: float = 0.0, sinks: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention on whole sequences. q ``[b, t, h, dq]``, k ``[b, t, k, dq]``, v
    ``[b, t, k, dv]`` -> ``[b, t, h, dv]`` (``dv`` may differ from ``dq``: multi-head latent attention).

    ``impl="cudnn"`` uses ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, bf16/fp16);
    ``"flash"`` the Pallas flash-attention kernels (:mod:`jaxcolossal.models.layers.flash_attention`:
    Triton on GPU, the Pallas interpreter elsewhere; memory linear in ``t``); ``"xla"`` is an
    explicit einsum with an fp32 softmax that works everywhere. ``segment_ids`` (int ``[b, t]``,
    packed documents): a query attends only to keys of its own segment.

    The options of the model families beyond LLaMA (``xla``; ``flash`` takes all but ``softcap``; the config
    refuses them with cuDNN): ``window`` (int, static or a traced per-layer scalar; 0: none): a query attends
    to itself and the ``window − 1`` keys before it (Mistral, Gemma, GPT-OSS); ``scale``: the softmax
    scale of q·k (default ``dq^-1/2``); ``softcap``: Gemma 2's ``c·tanh(s/c)`` on the scaled scores;
    ``sinks`` fp32 ``[h]``: GPT-OSS's learned logit per head that joins the softmax with no value.
    """
    plain = scale is None and not softcap and sinks is None and isinstance(window, int) and window == 0
    if impl == "flash" and not softcap:
        return flash_attention(q, k, v, segment_ids, causal=True, scale=scale, window=window, sinks=sinks)
    if impl == "cudnn" and plain:
        if segment_ids is not None:
            raise ValueError("segment_ids (data.packing_mask) need model.attention_impl=xla")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = soft_cap(scores * (d ** -0.5 if scale is None else scale), softcap)
    mask = _window_mask(jnp.tril(jnp.ones((t, t), dtype=bool)), window)
    if segment_ids is not None:
        mask = mask[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])  # [b, t, s]
        mask = mask[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = _with_sinks(scores, sinks, kv, softmax).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, v.shape[-1])


def _window_mask(causal: jax.Array, window, offset=0) -> jax.Array:
    """``causal [.., t, S]`` (query ``i`` in slot ``offset + i``, key ``j`` in slot ``j``) limited to the
    keys within ``window`` of the query (``j > offset + i − window``); ``window`` 0: unchanged. ``offset``:
    an int or int32 scalar, or int32 ``[b]`` (one per row, ``causal`` then ``[b, t, S]``)."""
    if isinstance(window, int) and window == 0:
        return causal
    t, s = causal.shape[-2:]
    q_slot = jnp.asarray(offset)[..., None, None] + jnp.arange(t)[:, None]
    near = jnp.arange(s) > q_slot - window
    return causal & (near | (window == 0))


def _with_sinks(scores: jax.Array, sinks: jax.Array | None, kv: int, normalise) -> jax.Array:
    """``normalise(scores)`` over the keys (fp32 ``[b, k, g, t, S]``), or with GPT-OSS's sinks ``[h]``:
    one more logit per head in the softmax whose probability is dropped (``h = k·g``, heads grouped as
    q's reshape groups them)."""
    if sinks is None:
        return normalise(scores)
    b, kh, g, t, _ = scores.shape
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv, g, 1, 1), (b, kh, g, t, 1))
    return normalise(jnp.concatenate([scores, sink], axis=-1))[..., :-1]


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array, scale: float | None = None,
                     softcap: float = 0.0, sinks: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention of new queries over a KV cache in XLA (the decode path of every family; on
    GPU meshes the decode steps run :func:`jaxcolossal.models.layers.decode_attention.attend_cache`'s kernel).

    Args:
        q: ``[b, t, h, dq]``, the ``t`` new tokens' queries (already rotated).
        k_cache, v_cache: ``[b, S, k, dq]`` / ``[b, S, k, dv]``, every slot of the cache, the new tokens'
            keys and values already written (``h % k == 0``).
        mask: bool ``[b, t, S]``: which slots each query may attend to (causal in slot order, within a
            sliding window, and not a pad slot: :func:`cache_mask`). A query with no slot at all (a pad
            query) gets a uniform average, never NaN.
        scale, softcap, sinks: as :func:`local_attention`'s.

    Returns ``[b, t, h, dv]`` in ``v_cache``'s dtype; scores and softmax in fp32, as :func:`local_attention`.
    """
    b, t, h, d = q.shape
    kv = k_cache.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    scores = soft_cap(scores * (d ** -0.5 if scale is None else scale), softcap)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = _with_sinks(scores, sinks, kv, lambda s: jax.nn.softmax(s, axis=-1)).astype(v_cache.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache)
    return out.reshape(b, t, h, v_cache.shape[-1])


def cache_mask(index: jax.Array, t: int, kv_valid: jax.Array, window=0) -> jax.Array:
    """bool ``[b, t, S]``: the query in slot ``index + i`` may attend to slot ``j`` when ``j <= index +
    i``, ``kv_valid [b, S]`` (bool: the slot holds a real token, not padding) says so and, with a
    sliding ``window`` (int or traced scalar; 0: none), ``j > index + i − window`` (left-padded rows
    hold their tokens in consecutive slots, so slots count tokens). ``index``: an int32 scalar (every
    row's queries in the same slots) or int32 ``[b]`` (row ``r``'s in slots ``index[r] + i``: the refilling
    sampler's rows, :mod:`jaxcolossal.generate.refill`)."""
    slots = jnp.arange(kv_valid.shape[1])
    if jnp.ndim(index) == 1:
        causal = slots <= (index[:, None] + jnp.arange(t))[:, :, None]  # [b, t, S]
        return _window_mask(causal, window, index) & kv_valid[:, None, :]
    causal = slots[None, :] <= (index + jnp.arange(t))[:, None]  # [t, S]
    return _window_mask(causal, window, index)[None] & kv_valid[:, None, :]


def write_slots(cache: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """A layer's cache ``[b, S, ...]`` with ``new [b, t, ...]`` (cast to the cache's dtype) written at slots
    ``index .. index + t − 1``: ``index`` an int32 scalar (every row the same slots: one
    ``dynamic_update_slice``, as before) or int32 ``[b]`` (row ``r`` at ``index[r]``: a per-row
    ``dynamic_update_slice``, a scatter; continuous batching's per-slot positions, Orca, Yu et al. 2022)."""
    new = new.astype(cache.dtype)
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache, new, index, axis=1)
    return jax.vmap(lambda c, n, i: jax.lax.dynamic_update_slice_in_dim(c, n, i, axis=0))(cache, new, index)
