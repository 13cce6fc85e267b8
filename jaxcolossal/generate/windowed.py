"""The first sampler: no KV cache, a fixed window recomputed per token, one prompt at a time, one
dispatch per token. Kept as the baseline of scripts/bench_generate.py; :mod:`jaxcolossal.generate.sampler`
replaces it everywhere else.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def sample_tokens(logits_fn: Callable[[Any, jax.Array], jax.Array], params: Any, prompt: np.ndarray,
                  num_tokens: int, window: int, key: jax.Array, temperature: float = 0.8) -> np.ndarray:
    """Autoregressively extend ``prompt`` (1-D int tokens) by ``num_tokens`` tokens.

    Args:
        logits_fn: ``(params, tokens [1, window]) -> logits [1, window, vocab]`` (jitted).
        window: context length fed to the model (the training ``seq_len``).
        temperature: softmax temperature; 0 means greedy.

    Returns the generated tokens only (1-D int32). Positions after the last real token are
    padding; causal attention keeps them from influencing earlier positions.
    """
    buf = np.zeros((1, window), np.int32)
    ctx = list(np.asarray(prompt, np.int32)[-window:])
    out = []
    for _ in range(num_tokens):
        n = len(ctx)
        buf[0, :n] = ctx
        buf[0, n:] = 0
        logits = logits_fn(params, jnp.asarray(buf))[0, n - 1]
        key, sub = jax.random.split(key)
        if temperature <= 0:
            tok = int(jnp.argmax(logits))
        else:
            tok = int(jax.random.categorical(sub, logits / temperature))
        out.append(tok)
        ctx = (ctx + [tok])[-window:]
    return np.asarray(out, np.int32)
