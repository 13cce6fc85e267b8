"""Dynamic loss scaling for fp16, with Colossal-AI's ``DynamicGradScaler`` semantics.

Pure functions over a small pytree so the scaler lives inside the jitted train step. Defaults
(Colossal-AI 0.5): ``initial_scale=2**16, growth_factor=2, backoff_factor=0.5,
growth_interval=1000, hysteresis=2``. On an overflow (any non-finite gradient on any device — the
check runs on global arrays, so it is all-reduced by construction) the step is skipped on every
device; the scale backs off only after ``hysteresis`` overflows, and grows after
``growth_interval`` clean steps. The scale is fp32 and clamped to ``[min_scale, max_scale]``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class LossScaleState(NamedTuple):
    """fp32 ``scale``; int32 ``growth_step``, ``hysteresis_step`` and ``consecutive_skips``."""

    scale: jax.Array
    growth_step: jax.Array
    hysteresis_step: jax.Array
    consecutive_skips: jax.Array


def scaler_init(initial_scale: float = 2.0**16) -> LossScaleState:
    """Initial scaler state (replicated scalars)."""
    z = jnp.zeros((), jnp.int32)
    return LossScaleState(jnp.asarray(initial_scale, jnp.float32), z, z, z)


def all_finite(tree: Any) -> jax.Array:
    """True when every element of every leaf is finite (a global reduction under SPMD)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def scaler_update(s: LossScaleState, finite: jax.Array, *, growth_factor: float = 2.0,
                  backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                  min_scale: float = 1.0, max_scale: float = 2.0**32) -> LossScaleState:
    """Next scaler state after a step whose gradients were ``finite`` (bool scalar).

    Overflow: ``hysteresis_step += 1``, ``growth_step = 0``; once ``hysteresis_step >= hysteresis``
    the scale is multiplied by ``backoff_factor`` (not below ``min_scale``). Clean step:
    ``growth_step += 1``; at ``growth_interval`` the scale is multiplied by ``growth_factor`` (not
    above ``max_scale``) and both counters reset.
    """
    one = jnp.ones((), jnp.int32)
    # overflow branch
    hyst = s.hysteresis_step + one
    backoff = hyst >= hysteresis
    scale_over = jnp.where(backoff, jnp.maximum(s.scale * backoff_factor, min_scale), s.scale)
    # clean branch
    growth = s.growth_step + one
    grow = growth >= growth_interval
    scale_clean = jnp.where(grow, jnp.minimum(s.scale * growth_factor, max_scale), s.scale)
    return LossScaleState(
        scale=jnp.where(finite, scale_clean, scale_over).astype(jnp.float32),
        growth_step=jnp.where(finite, jnp.where(grow, 0, growth), 0).astype(jnp.int32),
        hysteresis_step=jnp.where(finite, jnp.where(grow, 0, s.hysteresis_step), hyst).astype(jnp.int32),
        consecutive_skips=jnp.where(finite, 0, s.consecutive_skips + one).astype(jnp.int32),
    )
