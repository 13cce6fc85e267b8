"""Choosing the next token from the logits: greedy, temperature, top-k and top-p (nucleus), applied in
Hugging Face transformers' order (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, then a categorical draw)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
        greedy: the argmax (``generate(do_sample=False)``); the other fields are then ignored.
        temperature: > 0; the logits are divided by it. 0 means greedy.
        top_k: keep the ``top_k`` largest logits (0: all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1: all).

    Raises (``check``): ValueError on a negative temperature or top_k, or a top_p outside (0, 1].
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def check(self) -> "Sampling":
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        return self

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def _top_k(logits: jax.Array, k: int) -> jax.Array:
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def _top_p(logits: jax.Array, p: float) -> jax.Array:
    """HF's ``TopPLogitsWarper``: drop the tokens outside the smallest set whose probability reaches
    ``p`` (the most likely token is always kept)."""
    desc = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    keep = before < p
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, -jnp.inf, logits)


def next_token(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """int32 ``[b]`` next tokens from fp32 ``logits [b, v]`` (the real vocabulary only) under ``sampling``."""
    if sampling.is_greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = logits.astype(jnp.float32) / sampling.temperature
    if 0 < sampling.top_k < x.shape[-1]:
        x = _top_k(x, sampling.top_k)
    if sampling.top_p < 1:
        x = _top_p(x, sampling.top_p)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
