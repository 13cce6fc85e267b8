"""Rotary position embeddings (RoFormer, Su et al., 2021) in Hugging Face's rotate-half layout,
shared by the families that use them (LLaMA, Mixtral, Qwen3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_tables(seq_len: int, head_dim: int, theta: float, positions: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[t, q]`` in Hugging Face's rotate-half layout (RoFormer, Su et al., 2021); with
    int ``positions [b, t]`` (packed documents, each restarting at 0) ``[b, t, q]``."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    pos = jnp.arange(seq_len, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    ang = pos[..., None] * inv
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [b, t, heads, q]`` by position (``cos``/``sin`` ``[t, q]`` or ``[b, t, q]``)."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.ndim == 2 else (cos[:, :, None, :], sin[:, :, None, :])
    return (xf * c + rot.astype(jnp.float32) * s).astype(x.dtype)

