"""Causal grouped-query attention, shared by every model family: the local form on whole sequences
(XLA einsum with an fp32 softmax, cuDNN, or the Pallas flash kernels) and, when the rules table
splits the sequence, its sequence-parallel forms (:mod:`jaxcolossal.parallel.sequence`: Ulysses,
ring attention). Shapes: q ``[b, t, h, q]``, k/v ``[b, t, k, q]`` (``h % k == 0``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxcolossal.models.layers.flash_attention import flash_attention
from jaxcolossal.models.layers.vocab import Sharder, no_shard
from jaxcolossal.parallel import sequence


def attention(q, k, v, impl: str = "xla", segment_ids: jax.Array | None = None, shard: Sharder = no_shard,
              positions: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention. q ``[b, t, h, q]``, k/v ``[b, t, k, q]`` -> ``[b, t, h, q]``.

    :func:`local_attention` on whole sequences, or, when ``shard``'s rules split the sequence
    (``parallel.sequence_parallelism_mode`` all_to_all / ring_attn), the sequence-parallel form of
    it (:func:`jaxcolossal.parallel.sequence.attend`; ring attention masks by ``positions`` int ``[b, t]``).
    """
    return sequence.attend(q, k, v, shard, local_attention, impl, segment_ids, positions)


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


def local_attention(q, k, v, impl: str = "xla", segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention on whole sequences (shapes as :func:`attention`).

    ``impl="cudnn"`` uses ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, bf16/fp16);
    ``"flash"`` the Pallas flash-attention kernels (:mod:`jaxcolossal.models.layers.flash_attention`:
    Triton on GPU, the Pallas interpreter elsewhere; memory linear in ``t``); ``"xla"`` is an
    explicit einsum with an fp32 softmax that works everywhere. ``segment_ids`` (int ``[b, t]``,
    packed documents): a query attends only to keys of its own segment.
    """
    if impl == "flash":
        return flash_attention(q, k, v, segment_ids, causal=True)
    if impl == "cudnn":
        if segment_ids is not None:
            raise ValueError("segment_ids (data.packing_mask) need model.attention_impl=xla")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    b, t, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    if segment_ids is not None:
        mask = mask[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])  # [b, t, s]
        mask = mask[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = softmax(scores).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, d)



def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention of new queries over a KV cache (the decode path of every family).

    Args:
        q: ``[b, t, h, q]``, the ``t`` new tokens' queries (already rotated).
        k_cache, v_cache: ``[b, S, k, q]``, every slot of the cache, the new tokens' keys and values
            already written (``h % k == 0``).
        mask: bool ``[b, t, S]``: which slots each query may attend to (causal in slot order and not
            a pad slot: :func:`cache_mask`). A query with no slot at all (a pad query) gets a uniform
            average, never NaN.

    Returns ``[b, t, h, q]`` in ``v_cache``'s dtype; scores and softmax in fp32, as :func:`local_attention`.
    """
    b, t, h, d = q.shape
    kv = k_cache.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32) / math.sqrt(d)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache)
    return out.reshape(b, t, h, d)


def cache_mask(index: jax.Array, t: int, kv_valid: jax.Array) -> jax.Array:
    """bool ``[b, t, S]``: the query in slot ``index + i`` may attend to slot ``j`` when ``j <= index +
    i`` and ``kv_valid [b, S]`` (bool: the slot holds a real token, not padding) says so."""
    slots = jnp.arange(kv_valid.shape[1])
    causal = slots[None, :] <= (index + jnp.arange(t))[:, None]  # [t, S]
    return causal[None] & kv_valid[:, None, :]
