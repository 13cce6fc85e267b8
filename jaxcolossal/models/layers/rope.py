"""Rotary position embeddings (RoFormer, Su et al., 2021) in Hugging Face's rotate-half layout, with
every scaling type of transformers' ``modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (``default``,
``linear``, ``dynamic``, ``yarn``, ``longrope``, ``llama3``), its attention scaling factor, and
partial rotary embeddings (Phi-3, Phi-4-mini): shared by every family that uses RoPE.

Each type gives inverse frequencies ``[r/2]`` (``r`` the rotated dimensions, ``head_dim ×
partial_rotary_factor``) and an attention factor that multiplies cos and sin (so q·k by its square),
as transformers' rotary embedding modules do. ``dynamic`` and ``longrope`` depend on the sequence
being run: transformers recomputes them from ``max(position_ids) + 1`` of each forward
(``dynamic_rope_update``), and so do :func:`rope_tables` here, from the traced positions, so a
prefill and each decode step see the frequencies transformers' ``generate`` gives them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxcolossal.config import ModelConfig, RopeConfig


def rotary_dim(head_dim: int, rope: RopeConfig) -> int:
    """The rotated dimensions of a head: ``int(head_dim × partial_rotary_factor)`` (transformers' ``dim``)."""
    return int(head_dim * rope.partial_rotary_factor)


def _default(theta: float, dim: int) -> jax.Array:
    return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def _llama3(rope: RopeConfig, theta: float, dim: int) -> jax.Array:
    """Llama 3.1's: low frequencies divided by ``factor``, high ones kept, a smooth ramp between."""
    inv = _default(theta, dim)
    old = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 · mscale · ln(scale) + 1`` (1 for ``scale <= 1``; transformers' ``yarn_get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(rope: RopeConfig, max_position_embeddings: int) -> float:
    """YaRN's scale: ``factor``, else ``max_position_embeddings / original_max_position_embeddings``."""
    return rope.factor or max_position_embeddings / rope.original_max_position_embeddings


def _yarn(rope: RopeConfig, theta: float, dim: int, max_pos: int) -> tuple[jax.Array, float]:
    """YaRN (Peng et al., 2023): interpolated low frequencies, extrapolated high ones, a linear ramp
    between the correction dims of ``beta_fast``/``beta_slow`` rotations; attention factor from mscale."""
    factor = yarn_factor(rope, max_pos)
    attn = rope.attention_factor or (
        yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        if rope.mscale and rope.mscale_all_dim else yarn_mscale(factor))
    orig = rope.original_max_position_embeddings

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast or 32), correction_dim(rope.beta_slow or 1)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn)


def _longrope(rope: RopeConfig, theta: float, dim: int, max_pos: int, seq_len) -> tuple[jax.Array, float]:
    """LongRoPE (Phi-3): per-dimension ``short_factor`` up to ``original_max_position_embeddings``
    tokens, ``long_factor`` beyond (chosen by the traced ``seq_len``); attention factor
    ``sqrt(1 + ln(factor) / ln(original))``."""
    orig = rope.original_max_position_embeddings
    factor = rope.factor or max_pos / orig
    attn = rope.attention_factor or (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig)))
    shape = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
    short, long = (jnp.asarray(f, jnp.float32) for f in (rope.short_factors, rope.long_factors))
    ext = jnp.where(seq_len > orig, long, short)
    return 1.0 / (ext * theta ** shape), float(attn)


def _dynamic(rope: RopeConfig, theta: float, dim: int, max_pos: int, seq_len) -> jax.Array:
    """Dynamic NTK: the base grows with the sequence past ``max_position_embeddings`` (the traced ``seq_len``)."""
    seq = jnp.maximum(jnp.asarray(seq_len, jnp.float32), max_pos)
    base = theta * ((rope.factor * seq / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def inverse_frequencies(rope: RopeConfig, head_dim: int, theta: float, max_position_embeddings: int,
                        seq_len=None) -> tuple[jax.Array, float]:
    """``(inv_freq fp32 [r/2], attention_factor)`` of ``rope`` for heads of ``head_dim`` (``r``:
    :func:`rotary_dim`), as transformers' ``ROPE_INIT_FUNCTIONS[rope.type]`` computes them.

    ``seq_len`` (int or traced int scalar): the sequence this forward runs, ``max(positions) + 1``,
    which ``dynamic`` and ``longrope`` depend on (the others ignore it).
    """
    dim = rotary_dim(head_dim, rope)
    kind = rope.type
    if kind == "default":
        return _default(theta, dim), 1.0
    if kind == "linear":
        return _default(theta, dim) / rope.factor, 1.0
    if kind == "llama3":
        return _llama3(rope, theta, dim), 1.0
    if kind == "yarn":
        return _yarn(rope, theta, dim, max_position_embeddings)
    if kind == "longrope":
        return _longrope(rope, theta, dim, max_position_embeddings, seq_len)
    if kind == "dynamic":
        return _dynamic(rope, theta, dim, max_position_embeddings, seq_len), 1.0
    raise ValueError(f"unknown RoPE type {kind!r}")


def rope_tables(seq_len: int, cfg: ModelConfig, positions: jax.Array | None = None, theta: float | None = None,
                head_dim: int | None = None) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[t, r]`` in Hugging Face's rotate-half layout, times the scaling type's attention
    factor; with int ``positions [b, t]`` (packed documents restarting at 0, left-padded rows, a
    decode step) ``[b, t, r]``. ``r``: the rotated dimensions (:func:`rotary_dim`).

    ``cfg``: the model config (``rope``, ``rope_theta``, ``max_position_embeddings``, ``head_dim``);
    ``theta`` / ``head_dim`` override its base (Gemma 3's local layers) and head size (MLA's rotary part).
    """
    head_dim = head_dim or cfg.head_dim
    pos = jnp.arange(seq_len, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    seq = seq_len if positions is None else jnp.max(positions) + 1
    inv, attn = inverse_frequencies(cfg.rope, head_dim, theta or cfg.rope_theta, cfg.max_position_embeddings, seq)
    ang = pos[..., None] * inv
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang) * attn, jnp.sin(ang) * attn


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``r`` dimensions of ``x [b, t, heads, q]`` by position (``cos``/``sin`` ``[t, r]``
    or ``[b, t, r]``, ``r <= q``); the other ``q - r`` pass unchanged (partial rotary, as Phi-3's)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)
    half = r // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.ndim == 2 else (cos[:, :, None, :], sin[:, :, None, :])
    return (xf * c + rot.astype(jnp.float32) * s).astype(x.dtype)
