"""Top-k gradient compression with error feedback (issue 16, ``parallel.gradient_compression=topk``).

Equivalence at ``compression_ratio=1`` (every element sent) against the uncompressed run; bytes on
the wire from the compiled HLO against :func:`jaxcolossal.train.compression.wire_bytes`; the
error-feedback bookkeeping (nothing lost: sent + residual = the gradient); the residual in
checkpoints. Convergence over the 300-step main job is measured by hand (docs/communication.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcolossal import hlo
from jaxcolossal.checkpoint import CheckpointManager
from jaxcolossal.config import ConfigError, validate
from jaxcolossal.mesh import make_mesh
from jaxcolossal.sharding import DATA_AXES
from jaxcolossal.train.compression import topk_count, topk_reduce, wire_bytes
from tiny import random_batches, run_steps, setup, tiny_config


def _cfg(**parallel):
    return tiny_config({"data_parallel_size": 8, **parallel}, None, training={"max_grad_norm": 1.0})


def _batch(plan, x):
    return {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
            "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}


def test_ratio_one_sends_everything_and_equals_the_uncompressed_run():
    base, mb, _ = run_steps(_cfg(zero_stage=1), steps=3)
    state, m, _ = run_steps(_cfg(zero_stage=1, gradient_compression="topk", compression_ratio=1.0), steps=3)
    np.testing.assert_allclose([r["loss"] for r in m], [r["loss"] for r in mb], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(base.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert all(float(jnp.max(jnp.abs(r))) == 0.0 for r in jax.tree.leaves(state.residual))


def test_sent_plus_residual_is_the_gradient():
    """Error feedback loses nothing: Σ_shards (sent) + Σ_shards (new residual) = Σ_shards (g + old
    residual), and each shard sent exactly k elements."""
    mesh = make_mesh(_cfg().parallel)
    rows = NamedSharding(mesh, P(DATA_AXES, None, None))
    rng = np.random.default_rng(0)
    g = {"w": jax.device_put(rng.normal(size=(8, 16, 32)).astype(np.float32), rows)}
    e = {"w": jax.device_put(rng.normal(size=(8, 16, 32)).astype(np.float32) * 0.1, rows)}
    summed, res = jax.jit(lambda g, e: topk_reduce(g, e, 0.05, mesh))(g, e)
    total = np.asarray(g["w"]) + np.asarray(e["w"])
    np.testing.assert_allclose(np.asarray(summed["w"]) + np.asarray(res["w"]).sum(0), total.sum(0), rtol=1e-5,
                               atol=1e-5)
    k = topk_count(16 * 32, 0.05)
    sent = (np.asarray(res["w"]) == 0).reshape(8, -1).sum(1)
    assert list(sent) == [k] * 8
    kept = np.abs(total.reshape(8, -1))  # the k largest magnitudes were the ones sent
    for row, r in zip(kept, np.asarray(res["w"]).reshape(8, -1)):
        assert np.min(row[r == 0]) >= np.max(row[r != 0])


@pytest.mark.parametrize("zero", [0])  # (ZeRO-1's the same exchange, then a local slice: checked by hand)
def test_the_wire_carries_k_values_and_indices_per_shard(zero):
    out = {}
    for comp in ("none", "topk"):
        cfg = _cfg(zero_stage=zero, gradient_compression=comp, compression_ratio=0.01)
        plan, _, state, step = setup(cfg)
        text = step.lower(state, _batch(plan, random_batches(cfg, 1)[0])).compile().as_text()
        out[comp] = hlo.collective_totals(text, min_elements=64)
    shapes = jax.tree.leaves(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple))
    big = [s for s in shapes if 8 * topk_count(int(np.prod(s)), 0.01) >= 64]  # what collective_totals counts
    want = wire_bytes(big, 0.01, 8)
    assert out["none"]["all-reduce"]["bytes"] >= want["dense"]  # the dense gradient all-reduce
    assert "all-reduce" not in out["topk"]  # replaced by the all-gathers of values and indices
    assert out["topk"]["all-gather"]["bytes"] - out["none"].get("all-gather", {"bytes": 0})["bytes"] == want["topk"]


def test_the_residual_is_checkpointed_and_resume_is_bit_exact(tmp_path):
    cfg = _cfg(zero_stage=1, gradient_compression="topk", compression_ratio=0.05)
    plan, tx, state, step = setup(cfg)
    xs = random_batches(cfg, 4)
    fresh = jax.tree.map(lambda x: x.copy(), state)
    for x in xs[:2]:
        state, _ = step(state, _batch(plan, x))
    cm = CheckpointManager(str(tmp_path))
    cm.save(2, state)
    cm.wait()
    assert any(float(jnp.max(jnp.abs(r))) > 0 for r in jax.tree.leaves(state.residual))
    restored = cm.restore(fresh)
    cm.close()
    for a, b in zip(jax.tree.leaves(restored.residual), jax.tree.leaves(state.residual)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    losses = {}
    for name, s in (("through", state), ("resumed", restored)):
        out = []
        for x in xs[2:]:
            s, m = step(s, _batch(plan, x))
            out.append(float(m["loss"]))
        losses[name] = (out, [np.asarray(p) for p in jax.tree.leaves(s.params)])
    assert losses["through"][0] == losses["resumed"][0]
    for a, b in zip(losses["through"][1], losses["resumed"][1]):
        np.testing.assert_array_equal(a, b)


def test_compression_settings_are_checked_before_compiling():
    with pytest.raises(ConfigError, match=r"compression_ratio=0\S*: must be in \(0, 1\]"):
        validate(_cfg(gradient_compression="topk", compression_ratio=0.0))
    with pytest.raises(ConfigError, match="zero_stage 0 or 1"):
        validate(_cfg(gradient_compression="topk", zero_stage=2))
    with pytest.raises(ConfigError, match="without tensor or pipeline parallelism"):
        validate(tiny_config({"data_parallel_size": 4, "tensor_parallel_size": 2, "gradient_compression": "topk"}))
