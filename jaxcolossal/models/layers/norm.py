"""Normalisation layers shared by the model families: RMSNorm (LLaMA, Qwen3's q/k norms) and
LayerNorm with bias (GPT-2). Both compute in fp32 and return ``x.dtype``; shapes ``[..., d]`` with
the scale (and bias) ``[d]``."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, axes: int | tuple = -1, offset: float = 0.0) -> jax.Array:
    """RMSNorm (Zhang & Sennrich, 2019) over ``axes`` (the last; OLMo-2's q/k norm: the last two, with
    ``scale`` shaped as them), computed in fp32, returned in ``x.dtype``; the scale is ``offset + scale``
    (Gemma's ``1 + w``: ``offset=1``)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axes, keepdims=True) + eps)
    return (y * (offset + scale.astype(jnp.float32))).astype(x.dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last dim (biased variance, as torch), in fp32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)

