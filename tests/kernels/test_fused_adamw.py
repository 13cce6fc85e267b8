"""Fused AdamW: Pallas kernel (interpret mode on CPU) vs jnp reference vs optax.

The GPU (Triton) lowering of the kernel is NOT exercised here: on CPU the kernel
runs through the Pallas interpreter, which checks the blocking, padding,
aliasing and arithmetic but not the Triton code generation.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.optim import (
    FusedAdam,
    FusedAdamW,
    FusedAdamWState,
    HybridAdam,
    adamw_update,
    adamw_update_kernel,
    adamw_update_reference,
    fused_adamw,
    fused_adamw_apply,
)

HP = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
LR = 3e-3
STEPS = 10
# leaf sizes 1, 7, 1000, 128*3+1 and a 2-D leaf
SHAPES = {"a": (1,), "b": (7,), "c": (1000,), "d": (128 * 3 + 1,), "e": (16, 48)}


def _tree(key, shapes, scale=1.0, dtype=jnp.float32):
    keys = jax.random.split(key, len(shapes))
    return {k: (scale * jax.random.normal(kk, s)).astype(dtype)
            for kk, (k, s) in zip(keys, shapes.items())}


def _grads(step, params):
    """Deterministic per-step grads with the structure of params."""
    key = jax.random.fold_in(jax.random.key(42), step)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [
        jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])


def _run(tx, params, grads_seq, fused_apply=False):
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        if fused_apply:
            return fused_adamw_apply(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for g in grads_seq:
        params, state = step(params, state, g)
    return params, state


def _maxdiff(a, b):
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# ----------------------------------------------------------------- per leaf


@pytest.mark.parametrize("shape", [(1,), (7,), (1000,), (128 * 3 + 1,), (16, 48), (0,)])
def test_leaf_kernel_matches_reference(shape):
    k = jax.random.split(jax.random.key(0), 4)
    p = jax.random.normal(k[0], shape)
    g = jax.random.normal(k[1], shape)
    m = 0.1 * jax.random.normal(k[2], shape)
    v = jnp.abs(jax.random.normal(k[3], shape))
    kw = dict(lr=jnp.float32(1e-3), count=jnp.int32(3), **HP)
    ref = adamw_update_reference(p, g, m, v, **kw)
    ker = adamw_update_kernel(p, g, m, v, interpret=True, block_size=128, **kw)
    for r, o in zip(ref, ker):
        assert o.shape == shape and o.dtype == r.dtype
        np.testing.assert_allclose(o, r, atol=3e-7, rtol=2.5e-7)  # ~2 f32 ulp


def test_leaf_low_precision_grads_and_bf16_params():
    k = jax.random.split(jax.random.key(1), 3)
    p = jax.random.normal(k[0], (300,)).astype(jnp.bfloat16)
    m = jnp.zeros((300,), jnp.float32)
    v = jnp.zeros((300,), jnp.float32)
    for gdt in (jnp.float16, jnp.bfloat16, jnp.float32):
        g = jax.random.normal(k[1], (300,)).astype(gdt)
        kw = dict(lr=1e-2, count=1, **HP)
        ref = adamw_update_reference(p, g, m, v, **kw)
        ker = adamw_update_kernel(p, g, m, v, interpret=True, block_size=64, **kw)
        assert ker[0].dtype == jnp.bfloat16 and ker[1].dtype == ker[2].dtype == jnp.float32
        for r, o in zip(ref, ker):
            np.testing.assert_array_equal(np.asarray(o, np.float32),
                                          np.asarray(r, np.float32))


def test_leaf_errors():
    x = jnp.zeros((8,))
    kw = dict(lr=1e-3, count=1, **HP)
    with pytest.raises(ValueError):
        adamw_update_reference(x, jnp.zeros((9,)), x, x, **kw)
    with pytest.raises(TypeError):
        adamw_update_reference(x, x, x.astype(jnp.bfloat16), x, **kw)
    with pytest.raises(ValueError):
        adamw_update_kernel(x, x, x, x, interpret=True, block_size=100, **kw)
    with pytest.raises(ValueError):
        adamw_update(x, x, x, x, impl="cuda", **kw)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="interpret=True"):
            adamw_update_kernel(x, x, x, x, **kw)
        # auto -> reference off-GPU
        out = adamw_update(x, x, x, x, impl="auto", **kw)
        assert out[0].shape == (8,)
    with pytest.raises(ValueError):
        fused_adamw(1e-3, impl="nope")


# ------------------------------------------------------- vs optax, 10 steps


@pytest.mark.parametrize("schedule", ["constant", "warmup_cosine"])
def test_matches_optax_two_leaf_orders(schedule):
    lr = LR if schedule == "constant" else optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=LR, warmup_steps=3, decay_steps=STEPS,
        end_value=LR / 10)
    params_d = _tree(jax.random.key(0), SHAPES)
    # second order: reversed list of the same leaves
    params_l = [params_d[k] for k in reversed(list(SHAPES))]
    for params in (params_d, params_l):
        grads_seq = [_grads(i, params) for i in range(STEPS)]
        want, want_state = _run(optax.adamw(lr, **HP), params, grads_seq)
        ker, ker_state = _run(
            fused_adamw(lr, **HP, impl="kernel", interpret=True, block_size=256),
            params, grads_seq, fused_apply=True)
        ref, _ = _run(fused_adamw(lr, **HP, impl="reference"), params, grads_seq)
        assert jax.tree.structure(ker) == jax.tree.structure(params)
        assert _maxdiff(ker, want) <= 1e-6
        assert _maxdiff(ref, want) <= 1e-6
        assert _maxdiff(ker, ref) <= 1e-6
        assert _maxdiff(ker_state.mu, want_state[0].mu) <= 1e-6
        assert _maxdiff(ker_state.nu, want_state[0].nu) <= 1e-6
        assert int(ker_state.count) == STEPS
        assert _maxdiff(params, ker) > 1e-3  # params actually moved


def test_mask_respected_and_chain():
    params = _tree(jax.random.key(3), SHAPES)
    mask = {k: len(s) == 2 or s[0] > 8 for k, s in SHAPES.items()}  # c, d, e
    mask_fn = lambda p: jax.tree.map(lambda x: x.ndim == 2 or x.size > 8, p)  # noqa: E731
    grads_seq = [_grads(i, params) for i in range(4)]
    want, _ = _run(optax.chain(optax.clip_by_global_norm(1.0),
                               optax.adamw(LR, **HP, mask=mask)), params, grads_seq)
    for m in (mask, mask_fn):
        got, _ = _run(optax.chain(
            optax.clip_by_global_norm(1.0),
            fused_adamw(LR, **HP, mask=m, impl="kernel", interpret=True,
                        block_size=256)), params, grads_seq)
        assert _maxdiff(got, want) <= 1e-6
    # the mask matters: without it the unmasked leaves differ
    nomask, _ = _run(optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.adamw(LR, **HP)), params, grads_seq)
    assert _maxdiff(nomask, want) > 1e-6


def test_bf16_params_f32_state():
    params32 = _tree(jax.random.key(4), SHAPES)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
    grads_seq = [jax.tree.map(lambda x: x.astype(jnp.bfloat16), _grads(i, params))
                 for i in range(3)]
    tx_k = fused_adamw(LR, **HP, impl="kernel", interpret=True, block_size=256)
    tx_r = fused_adamw(LR, **HP, impl="reference")
    ker, ker_state = _run(tx_k, params, grads_seq, fused_apply=True)
    ref, _ = _run(tx_r, params, grads_seq, fused_apply=True)
    upd, _ = _run(tx_k, params, grads_seq)  # update + optax.apply_updates
    for x in jax.tree.leaves(ker):
        assert x.dtype == jnp.bfloat16
    for x in jax.tree.leaves((ker_state.mu, ker_state.nu)):
        assert x.dtype == jnp.float32
    assert _maxdiff(ker, ref) == 0.0
    # update() returns bf16 deltas new_p - p: exact (Sterbenz) unless p changes
    # by more than 2x (e.g. crosses zero), where the delta itself is rounded;
    # XLA:CPU may also keep bf16 intermediates in f32. Allow one bf16 ulp of p
    # or of the delta (|delta| <~ 2 * LR).
    for a, b in zip(jax.tree.leaves(upd), jax.tree.leaves(ker)):
        np.testing.assert_allclose(np.asarray(a, np.float32),
                                   np.asarray(b, np.float32), rtol=2**-7,
                                   atol=2 * LR * 2**-7)
    # close to an all-f32 optax run within bf16 resolution
    want, _ = _run(optax.adamw(LR, **HP), params32,
                   [jax.tree.map(lambda x: x.astype(jnp.float32), g) for g in grads_seq])
    assert _maxdiff(ker, want) <= 3e-2


def test_api_aliases_and_types():
    assert HybridAdam is fused_adamw and FusedAdam is fused_adamw
    tx = fused_adamw(optax.constant_schedule(1e-3))
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert isinstance(tx, FusedAdamW)
    params = {"w": jnp.ones((4,))}
    state = tx.init(params)
    assert isinstance(state, FusedAdamWState)
    with pytest.raises(ValueError):
        tx.update(params, state)  # params required
    new_p, new_s = tx.apply(params, state, params)
    upd, _ = tx.update(params, state, params)
    np.testing.assert_array_equal(optax.apply_updates(params, upd)["w"], new_p["w"])
    with pytest.raises(TypeError):
        fused_adamw_apply(optax.adamw(1e-3), params, state, params)


# --------------------------------------------- ZeRO: sharded on 8 CPU devices


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_sharded_local_update_no_allgather(impl):
    assert jax.device_count() >= 8
    mesh = jax.make_mesh((8,), ("fsdp",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    shapes = dict(SHAPES, e=(16, 48), f=(64, 24))
    specs = {"a": P(), "b": P(), "c": P("fsdp"), "d": P(), "e": P("fsdp", None),
             "f": P(None, "fsdp")}
    params0 = _tree(jax.random.key(5), shapes)
    grads_seq = [_grads(i, params0) for i in range(3)]
    sched = optax.warmup_cosine_decay_schedule(0.0, LR, 1, 5)

    want, _ = _run(fused_adamw(sched, **HP, impl="reference"), params0, grads_seq)

    kw = dict(impl=impl, interpret=impl == "kernel", block_size=64)
    tx = fused_adamw(sched, **HP, mesh=mesh, param_specs=specs, **kw)
    shard = lambda t: jax.tree.map(  # noqa: E731
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)
    params = shard(params0)
    state = tx.init(params)
    assert state.mu["c"].sharding.spec == P("fsdp")
    step = jax.jit(lambda p, s, g: tx.apply(g, s, p))
    hlo = step.lower(params, state, shard(grads_seq[0])).compile().as_text()
    assert "all-gather" not in hlo
    assert "all-reduce" not in hlo
    if impl == "kernel":
        # negative control: the same kernel WITHOUT shard_map flattens the
        # global (64, 24) P(None, "fsdp") leaf and XLA has to gather it.
        tx_global = fused_adamw(sched, **HP, **kw)
        hlo_g = jax.jit(lambda p, s, g: tx_global.apply(g, s, p)).lower(
            params, state, shard(grads_seq[0])).compile().as_text()
        assert "all-gather" in hlo_g
    for g in grads_seq:
        params, state = step(params, state, shard(g))
    assert params["c"].sharding.spec == P("fsdp")
    assert state.nu["f"].sharding.spec == P(None, "fsdp")
    assert _maxdiff(params, want) <= 1e-6
