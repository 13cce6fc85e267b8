"""The optimizer's parts: Adam with a frozen variance (``training.adam_freeze_step``, 1-bit Adam's
``freeze_step``) against ``optax``'s Adam."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcolossal.config import TrainingConfig
from jaxcolossal.train.optimizer import build_optimizer, scale_by_adam_frozen_variance


def _grads(n, seed=0):
    keys = jax.random.split(jax.random.key(seed), n)
    return [{"w": jax.random.normal(k, (3, 5)) * (i + 1), "b": jax.random.normal(k, (5,))} for i, k in enumerate(keys)]


def test_until_the_freeze_it_is_optax_adam_bit_for_bit_then_the_variance_stays():
    b1, b2, eps, freeze = 0.9, 0.95, 1e-8, 3
    ours, ref = scale_by_adam_frozen_variance(b1, b2, eps, freeze), optax.scale_by_adam(b1, b2, eps)
    params = {"w": jnp.zeros((3, 5)), "b": jnp.zeros((5,))}
    s_ours, s_ref = ours.init(params), ref.init(params)
    grads = _grads(6)
    for t, g in enumerate(grads, start=1):
        u_ours, s_ours = ours.update(g, s_ours)
        u_ref, s_ref = ref.update(g, s_ref)
        if t <= freeze:  # the same computation
            for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_ref)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            frozen_nu = s_ours.nu
        else:  # nu frozen at step `freeze`, bias-corrected with that count; mu keeps moving
            for a, b in zip(jax.tree.leaves(s_ours.nu), jax.tree.leaves(frozen_nu)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(s_ours.mu["w"]), np.asarray(s_ref.mu["w"]))
            want = (s_ref.mu["w"] / (1 - b1 ** t)) / (jnp.sqrt(frozen_nu["w"] / (1 - b2 ** freeze)) + eps)
            np.testing.assert_allclose(np.asarray(u_ours["w"]), np.asarray(want), rtol=1e-6)
    assert int(s_ours.count) == len(grads)


def test_momentum_step_takes_the_incoming_gradient_as_the_first_moment():
    """DGC's momentum correction: from update ``momentum_step + 1`` on, ``mu`` is the gradient
    that arrived (it carries the shards' momentum already); before it, Adam's own ``mu``."""
    b1, b2, eps = 0.9, 0.95, 1e-8
    ours = scale_by_adam_frozen_variance(b1, b2, eps, freeze_step=2, momentum_step=3)
    plain = scale_by_adam_frozen_variance(b1, b2, eps, freeze_step=2)
    params = {"w": jnp.zeros((3, 5)), "b": jnp.zeros((5,))}
    s_ours, s_plain = ours.init(params), plain.init(params)
    for t, g in enumerate(_grads(6), start=1):
        u_ours, s_ours = ours.update(g, s_ours)
        u_plain, s_plain = plain.update(g, s_plain)
        if t <= 3:
            for a, b in zip(jax.tree.leaves((u_ours, s_ours)), jax.tree.leaves((u_plain, s_plain))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            np.testing.assert_array_equal(np.asarray(s_ours.mu["w"]), np.asarray(g["w"]))
            want = (g["w"] / (1 - b1 ** t)) / (jnp.sqrt(s_ours.nu["w"] / (1 - b2 ** 2)) + eps)
            np.testing.assert_allclose(np.asarray(u_ours["w"]), np.asarray(want), rtol=1e-6)


def test_an_element_unseen_before_the_freeze_takes_its_variance_from_its_first_gradient():
    """An embedding row of a token not met before the freeze has ``nu = 0``: frozen there, its
    first step would be ``mu/eps`` (~1e6 here). It takes ``(1 − b2)·g²`` from its first gradient
    instead, then stays frozen; elements seen before the freeze never move their ``nu``."""
    b1, b2, eps, freeze = 0.9, 0.95, 1e-8, 2
    tx = scale_by_adam_frozen_variance(b1, b2, eps, freeze)
    state = tx.init({"w": jnp.zeros((2,))})
    for g in ([1.0, 0.0], [1.0, 0.0]):  # element 1 sees nothing before the freeze
        _, state = tx.update({"w": jnp.asarray(g)}, state)
    frozen = float(state.nu["w"][0])
    u, state = tx.update({"w": jnp.asarray([1.0, 0.5])}, state)
    assert float(state.nu["w"][0]) == frozen
    assert float(state.nu["w"][1]) == np.float32(1 - b2) * 0.25
    assert abs(float(u["w"][1])) < 1.0  # not mu/eps
    _, state = tx.update({"w": jnp.asarray([1.0, 2.0])}, state)
    assert float(state.nu["w"][1]) == np.float32(1 - b2) * 0.25  # frozen from there


def test_frozen_variance_makes_the_update_linear_in_the_gradient():
    """Why error feedback needs it: past the freeze, sending a gradient late moves the weights by
    the same total (momentum decays to zero) as sending it on time; Adam's live variance would not."""
    params = {"w": jnp.zeros((3, 5)), "b": jnp.zeros((5,))}
    g = _grads(1, seed=2)[0]
    zero = jax.tree.map(jnp.zeros_like, g)
    half = jax.tree.map(lambda a: a / 2, g)
    warm = _grads(2, seed=1) + [zero] * 80  # past the freeze (2); mu's bias correction ≈ 1 from here
    on_time, late = [g] + [zero] * 5 + [zero] * 300, [half] + [zero] * 4 + [half] + [zero] * 300

    def total(tx, seq):
        s = tx.init(params)
        for x in warm:
            _, s = tx.update(x, s)
        out = jax.tree.map(jnp.zeros_like, params)
        for x in seq:
            u, s = tx.update(x, s)
            out = jax.tree.map(jnp.add, out, u)
        return np.asarray(out["w"])

    frozen = scale_by_adam_frozen_variance(0.9, 0.95, 1e-8, 2)
    a = total(frozen, on_time)
    np.testing.assert_allclose(total(frozen, late), a, rtol=1e-4)
    live = optax.scale_by_adam(0.9, 0.95, 1e-8)  # the late half is normalized again: another total
    assert np.abs(total(live, on_time) - total(live, late)).max() > 0.1 * np.abs(a).max()


def test_build_optimizer_picks_the_frozen_variant_and_adamw_otherwise():
    params = {"w": jnp.ones((3, 5)), "norm": jnp.ones((5,))}
    g = {"w": jnp.full((3, 5), 0.5), "norm": jnp.full((5,), 0.5)}
    outs = {}
    for freeze in (0, 100):
        tx = build_optimizer(TrainingConfig(adam_freeze_step=freeze, max_steps=10, warmup_steps=2), None)
        s = tx.init(params)
        u, s = tx.update(g, s, params)
        outs[freeze] = u
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[100])):  # before the freeze: optax.adamw
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
