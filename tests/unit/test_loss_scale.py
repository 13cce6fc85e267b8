"""DynamicGradScaler semantics (Colossal-AI): hysteresis, growth interval, bounds."""

import jax.numpy as jnp
import numpy as np

from jaxcolossal.optim.loss_scale import all_finite, scaler_init, scaler_update


def test_backoff_only_after_hysteresis_overflows():
    s = scaler_init(2.0**16)
    s = scaler_update(s, jnp.asarray(False), hysteresis=2)
    assert float(s.scale) == 2.0**16 and int(s.hysteresis_step) == 1 and int(s.consecutive_skips) == 1
    s = scaler_update(s, jnp.asarray(False), hysteresis=2)
    assert float(s.scale) == 2.0**15 and int(s.consecutive_skips) == 2


def test_growth_after_interval_and_reset_of_skips():
    s = scaler_init(4.0)
    for _ in range(3):
        s = scaler_update(s, jnp.asarray(True), growth_interval=3)
    assert float(s.scale) == 8.0 and int(s.growth_step) == 0 and int(s.consecutive_skips) == 0


def test_scale_stays_finite_and_bounded_over_many_clean_steps():
    s = scaler_init(2.0**16)
    for _ in range(200):
        s = scaler_update(s, jnp.asarray(True), growth_interval=1, max_scale=2.0**24)
    assert np.isfinite(float(s.scale)) and float(s.scale) == 2.0**24
    assert s.scale.dtype == jnp.float32


def test_min_scale_floor():
    s = scaler_init(2.0)
    for _ in range(10):
        s = scaler_update(s, jnp.asarray(False), hysteresis=1, min_scale=1.0)
    assert float(s.scale) == 1.0 and int(s.consecutive_skips) == 10


def test_all_finite():
    assert bool(all_finite({"a": jnp.ones(3), "b": jnp.zeros((2, 2))}))
    assert not bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    assert not bool(all_finite([jnp.array([jnp.nan])]))
