"""The data-parallel gradient reduction in fewer bytes (issue 16): top-k and PowerSGD compression
with error feedback (``parallel.gradient_compression``), and bf16/fp8 communication
(``parallel.communication_dtype``).

Equivalence at ``compression_ratio=1`` (every element sent) against the uncompressed run; the
low-precision reduction against the sum of what was sent, and a short run against fp32; bytes on
the wire from the compiled HLO against the predictions; the error-feedback bookkeeping (nothing
lost: sent + residual = the gradient); PowerSGD exact on low-rank gradients; the compression
state in checkpoints. Convergence over the 300-step main job is measured by hand
(docs/communication.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny import assert_params_match, random_batches, run_steps, setup, tiny_config

from jaxcolossal.aot import hlo
from jaxcolossal.checkpoint import CheckpointManager
from jaxcolossal.config import ConfigError, validate
from jaxcolossal.parallel.compression import (
    lowp_reduce,
    orthonormalize,
    powersgd_reduce,
    powersgd_wire,
    topk_count,
    topk_reduce,
    wire_bytes,
)
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.sharding import DATA_AXES, one_layer_specs, shard_bytes
from jaxcolossal.parallel.wire import WIRE_BYTES, decode, encode, gather_lowp
from jaxcolossal.plan import dp_gradient_bytes
from jaxcolossal.train.report import memory_report
from jaxcolossal.train.state import make_plan, powersgd_views_of


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


def test_momentum_correction_sends_the_top_k_of_error_plus_momentum_and_loses_nothing():
    """DGC's momentum correction (``topk_reduce(..., momentum=β)``): each shard's velocity becomes
    ``β·u + (1 − β)·g``; the k largest of ``error + velocity`` are sent; what is not sent stays in
    the error; the velocity is kept whole (no momentum factor masking)."""
    mesh = make_mesh(_cfg().parallel)
    rows = NamedSharding(mesh, P(DATA_AXES, None, None))
    rng = np.random.default_rng(3)
    arr = lambda scale: {"w": jax.device_put((rng.normal(size=(8, 16, 32)) * scale).astype(np.float32), rows)}  # noqa: E731
    g, e, u = arr(1.0), arr(0.1), arr(0.5)
    beta = 0.9
    summed, out = jax.jit(lambda g, r: topk_reduce(g, r, 0.05, mesh, momentum=beta))(g, {"error": e, "velocity": u})
    vel = beta * np.asarray(u["w"]) + (1 - beta) * np.asarray(g["w"])
    acc = np.asarray(e["w"]) + vel
    err, new_vel = np.asarray(out["error"]["w"]), np.asarray(out["velocity"]["w"])
    np.testing.assert_allclose(np.asarray(summed["w"]) + err.sum(0), acc.sum(0), rtol=1e-5, atol=1e-5)
    sent = err == 0
    assert list(sent.reshape(8, -1).sum(1)) == [topk_count(16 * 32, 0.05)] * 8
    for row, r in zip(np.abs(acc.reshape(8, -1)), sent.reshape(8, -1)):
        assert np.min(row[r]) >= np.max(row[~r])  # the largest were sent
    np.testing.assert_allclose(new_vel, vel, rtol=1e-6)


def test_momentum_correction_at_ratio_one_is_the_uncompressed_run():
    """Every element sent: the shards' velocities sum to Adam's first moment (they start from
    1/N of the optimizer's at the first compressed step), so 2 dense steps then 2 compressed ones
    equal the uncompressed run with the same frozen variance: losses to rtol 1e-6, params to
    ``assert_params_match``."""
    cfg = lambda **p: tiny_config({"data_parallel_size": 8, "zero_stage": 0, **p}, None,  # noqa: E731
                                  training={"max_grad_norm": 1.0, "adam_freeze_step": 2})
    base, mb, _ = run_steps(cfg(), steps=4)
    state, m, _ = run_steps(cfg(gradient_compression="topk", compression_ratio=1.0, momentum_correction=True,
                                compression_warmup_steps=2), steps=4)
    np.testing.assert_allclose([r["loss"] for r in m], [r["loss"] for r in mb], rtol=1e-6)
    assert_params_match(state.params, base.params, lr=cfg().training.learning_rate)
    assert any(float(jnp.max(jnp.abs(v))) > 0 for v in jax.tree.leaves(state.residual["velocity"]))


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


@pytest.mark.parametrize("comp", ["topk", "topk_momentum", "powersgd"])
def test_the_residual_is_checkpointed_and_resume_is_bit_exact(tmp_path, comp):
    """Top-k as recommended, with Adam's variance frozen after step 1 (the resumed steps are past
    the freeze, so the frozen state is restored too); with momentum correction from step 1 (one
    dense step first), the shards' velocity is in the state too."""
    cfg = tiny_config({"data_parallel_size": 8, "zero_stage": 1, "gradient_compression": comp.split("_")[0],
                       "compression_ratio": 0.05, "powersgd_rank": 2, "momentum_correction": comp == "topk_momentum",
                       "compression_warmup_steps": int(comp == "topk_momentum")}, None,
                      training={"max_grad_norm": 1.0, "adam_freeze_step": int(comp.startswith("topk"))})
    plan, tx, state, step = setup(cfg)
    xs = random_batches(cfg, 4)
    fresh = jax.tree.map(lambda x: x.copy(), state)
    for x in xs[:2]:
        state, _ = step(state, _batch(plan, x))
    # the memory table at start: the compression state read from the arrays = its formula
    _, mem = memory_report(plan, state)
    assert mem["compression"]["measured"] == mem["compression"]["formula"] > 0
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
    with pytest.raises(ConfigError, match=r"momentum_correction=true needs parallel.gradient_compression=topk "
                                          r"\(got none\) and training.adam_freeze_step > 0"):
        validate(_cfg(momentum_correction=True))
    cfg = tiny_config({"data_parallel_size": 8, "gradient_compression": "topk", "momentum_correction": True},
                      training={"adam_freeze_step": 10})
    validate(cfg)
    cfg.parallel.error_feedback = False
    with pytest.raises(ConfigError, match="error_feedback=true"):
        validate(cfg)
    with pytest.raises(ConfigError, match="no tensor or pipeline parallelism"):
        validate(tiny_config({"data_parallel_size": 4, "tensor_parallel_size": 2, "gradient_compression": "topk"}))
    with pytest.raises(ConfigError, match=r"zero_stage 0 or 1 \(got 2.*; and no tensor or pipeline"):  # both at once
        validate(tiny_config({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2,
                              "gradient_compression": "powersgd"}))
    with pytest.raises(ConfigError, match=r"powersgd_rank=1000 compresses no parameter.*use a rank below \d+"):
        make_plan(_cfg(gradient_compression="powersgd", powersgd_rank=1000), make_mesh(_cfg().parallel))
    with pytest.raises(ConfigError, match="powersgd is supported with zero_stage 0 or 1"):
        validate(_cfg(gradient_compression="powersgd", zero_stage=3))
    with pytest.raises(ConfigError, match=r"powersgd_rank=0: must be"):
        validate(_cfg(gradient_compression="powersgd", powersgd_rank=0))
    with pytest.raises(ConfigError, match="communication_dtype=bf16 applies to the plain gradient reduction"):
        validate(_cfg(gradient_compression="topk", communication_dtype="bf16"))
    with pytest.raises(ConfigError, match="communication_dtype=fp8 is not supported with pipeline"):
        validate(tiny_config({"data_parallel_size": 4, "pipeline_parallel_size": 2, "communication_dtype": "fp8"}))
    with pytest.raises(ConfigError, match="communication_dtype"):
        validate(_cfg(communication_dtype="fp16"))
    with pytest.raises(ConfigError, match="adam_freeze_step is supported with training.optimizer=adamw"):
        validate(tiny_config(training={"adam_freeze_step": 10, "optimizer": "fused_adamw"}))
    with pytest.raises(ConfigError, match="adam_freeze_step=-1: must be"):
        validate(tiny_config(training={"adam_freeze_step": -1}))


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_low_precision_reduce_sums_in_fp32_what_was_sent(kind):
    """The sum over 8 shards, moved in ``kind``: equal to the fp32 sum of each shard's encoded
    gradient (ZeRO's sharded result: all-to-all only), and to that sum encoded once more where
    every rank gets it all (all-to-all + all-gather). Nothing is summed in the low precision."""
    mesh = make_mesh(_cfg().parallel)  # dp = 8
    rng = np.random.default_rng(1)
    g = rng.normal(size=(8, 16, 12)).astype(np.float32) * np.logspace(-3, 1, 12, dtype=np.float32)
    g[:, :2] = 0.0  # rows no shard touched (unseen tokens' embeddings): a zero chunk must not become 0/0
    gs = jax.device_put(g, NamedSharding(mesh, P(DATA_AXES, None, None)))
    sent = [np.asarray(decode(*encode(jnp.asarray(g[j]), kind), kind)) for j in range(8)]
    want = np.sum(sent, axis=0, dtype=np.float32)
    sharded, whole = jax.jit(lambda a: (lowp_reduce({"w": a}, {"w": P(DATA_AXES, None, None)}, {"w": P("dp", None)},
                                                    kind, mesh),
                                        lowp_reduce({"w": a}, {"w": P(DATA_AXES, None, None)}, {"w": P()},
                                                    kind, mesh)))(gs)
    np.testing.assert_allclose(np.asarray(sharded["w"]), want, rtol=2e-5, atol=1e-6)  # (fp32 FMA vs numpy)
    # the whole sum: each shard's chunk of it encoded (fp8: with that chunk's own scale) and gathered
    chunks = want.reshape(8, -1)
    again = np.concatenate([np.asarray(decode(*encode(jnp.asarray(c), kind), kind)) for c in chunks]).reshape(want.shape)
    np.testing.assert_allclose(np.asarray(whole["w"]), again, rtol=2e-5, atol=1e-6)
    assert np.all(np.isfinite(np.asarray(whole["w"]))) and not np.any(np.asarray(whole["w"])[:2])
    # and how far that is from the exact fp32 sum: bf16 keeps 8 bits of mantissa, e4m3 4
    err = np.max(np.abs(np.asarray(whole["w"]) - g.sum(0))) / np.max(np.abs(g.sum(0)))
    assert err < {"bf16": 2 ** -7, "fp8": 2 ** -3}[kind]


def test_low_precision_communication_trains_like_fp32():
    """ZeRO-2 × tp 2 (a reduce-scatter per microbatch, tp dims untouched): bf16 and fp8 give the
    fp32 losses within 1e-4 over 3 steps (not bit-identical: the gradients are rounded)."""
    par = dict(data_parallel_size=4, tensor_parallel_size=2, zero_stage=2)
    cfg = lambda **p: tiny_config({**par, **p}, None, training={"max_grad_norm": 1.0, "gradient_accumulation_steps": 2})  # noqa: E731
    _, base, _ = run_steps(cfg(), steps=3)
    for kind in ("bf16", "fp8"):
        _, m, _ = run_steps(cfg(communication_dtype=kind), steps=3)
        np.testing.assert_allclose([r["loss"] for r in m], [r["loss"] for r in base], rtol=1e-4)
        np.testing.assert_allclose([r["grad_norm"] for r in m], [r["grad_norm"] for r in base], rtol=2e-2)


def test_gather_lowp_rounds_the_weights_and_passes_the_gradient_straight_through():
    """ZeRO++'s qwZ on one ZeRO-3 weight (rows split over the 8 data shards): the gathered weight
    is the bf16/fp8 encoding of the whole tensor, decoded (one per-tensor scale; to 1 ulp), within
    bf16's / e4m3's rounding of the original; the gradient is the cotangent, unchanged."""
    mesh = make_mesh(_cfg(zero_stage=3).parallel)
    rng = np.random.default_rng(5)
    sharded = P(DATA_AXES, None)
    w = jax.device_put(rng.normal(size=(64, 24)).astype(np.float32), NamedSharding(mesh, sharded))
    ct = rng.normal(size=(64, 24)).astype(np.float32)
    for kind in ("bf16", "fp8"):
        f = jax.jit(lambda w: gather_lowp(w, P(None, None), sharded, mesh, kind))  # noqa: B023
        got, vjp = jax.vjp(f, w)
        u, scale = encode(jnp.asarray(np.asarray(w)), kind)
        np.testing.assert_allclose(np.asarray(got), np.asarray(decode(u, scale, kind)), rtol=1e-6)  # (jit: x·(1/s))
        err = np.max(np.abs(np.asarray(got) - np.asarray(w)) / np.abs(np.asarray(w)))
        assert 0 < err <= {"bf16": 2 ** -8, "fp8": 2 ** -4}[kind] + 1e-7, (kind, err)
        np.testing.assert_array_equal(np.asarray(vjp(ct)[0]), ct)


def test_zero3_gathers_the_layer_weights_in_the_communication_dtype():
    """ZeRO++'s qwZ under ZeRO-3 (dp 4 × tp 2, fp32 compute): the layer scan all-gathers each
    layer's weight shards as uint16 (bf16) / uint8 (fp8), read from the compiled HLO with trip
    counts: exactly the layers' tp-local elements once per step (no remat), so 2× / 4× fewer bytes
    than fp32 for that gather. Over 3 steps with ``remat=full`` (the gather recomputed in the
    backward) the losses stay within 1e-4 of fp32 communication and the grad norms within 1e-2
    (measured: ≤ 5.5e-5 and ≤ 3.5e-4)."""
    par = dict(data_parallel_size=4, tensor_parallel_size=2, zero_stage=3)
    for kind, wire in (("bf16", "u16"), ("fp8", "u8")):
        cfg = tiny_config({**par, "communication_dtype": kind})
        plan, _, state, step = setup(cfg)
        text = step.lower(state, _batch(plan, random_batches(cfg, 1)[0])).compile().as_text()
        moved = sum(times * int(np.prod(dims)) for _, lines, times in hlo.walk_executions(text) for line in lines
                    if " all-gather(" in line or " all-gather-start(" in line
                    for dtype, dims in hlo.result_shapes(line) if dtype == wire)
        gathered, _ = one_layer_specs(plan.specs.params["layers"])
        layers = sum(jax.tree.leaves(jax.tree.map(
            lambda shape, spec: shard_bytes(shape, np.uint8, P(None, *spec), plan.mesh_shape),
            plan.param_shapes["layers"], gathered, is_leaf=lambda x: isinstance(x, tuple))))
        assert moved == layers, (kind, moved, layers)
    cfg = lambda **p: tiny_config({**par, **p}, None, model={"remat": "full"}, training={"max_grad_norm": 1.0})  # noqa: E731
    _, base, _ = run_steps(cfg(), steps=3)
    for kind in ("bf16", "fp8"):
        _, m, _ = run_steps(cfg(communication_dtype=kind), steps=3)
        np.testing.assert_allclose([r["loss"] for r in m], [r["loss"] for r in base], rtol=1e-4)
        np.testing.assert_allclose([r["grad_norm"] for r in m], [r["grad_norm"] for r in base], rtol=1e-2)


def test_bytes_on_the_wire_per_setting():
    """DDP over 8 devices (ZeRO-0), bytes each device sends per step read from the compiled HLO
    (ring algorithms, :attr:`jaxcolossal.aot.hlo.Collective.sent`): bf16 halves the fp32 all-reduce's,
    fp8 quarters it (+ the per-shard scales), PowerSGD sends the factors' all-reduces."""
    sent, totals = {}, {}
    for name, extra in (("fp32", {}), ("bf16", {"communication_dtype": "bf16"}), ("fp8", {"communication_dtype": "fp8"}),
                        ("powersgd", {"gradient_compression": "powersgd", "powersgd_rank": 2})):
        cfg = _cfg(zero_stage=0, **extra)
        plan, _, state, step = setup(cfg)
        text = step.lower(state, _batch(plan, random_batches(cfg, 1)[0])).compile().as_text()
        totals[name] = hlo.collective_totals(text, min_elements=0)
        sent[name] = sum(t["sent"] for t in totals[name].values())
    sizes = [int(np.prod(s)) for s in jax.tree.leaves(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple))]
    m_pad = sum(-(-m // 8) * 8 for m in sizes)  # each leaf padded to a multiple of N
    for kind in ("bf16", "fp8"):  # all-to-all + all-gather of the payload: 2·(N−1)/N·b·M
        payload = 2 * 7 / 8 * WIRE_BYTES[kind] * m_pad
        moved = totals[kind]["all-to-all"]["sent"] + totals[kind]["all-gather"]["sent"]
        scales = 0 if kind == "bf16" else 2 * len(sizes) * 7 / 8 * 4 * 8  # two [N] fp32 all-gathers per leaf
        assert abs(moved - payload - scales) <= 2 * len(sizes)  # (rounding per collective)
    assert 1.99 < sent["fp32"] / sent["bf16"] < 2.01
    assert 3.9 < sent["fp32"] / sent["fp8"] < 4.1
    want = powersgd_wire(powersgd_views_of(plan), plan.param_shapes, 2)
    assert totals["fp32"]["all-reduce"]["bytes"] - 4 == want["dense"]  # (+ the loss scalar)
    assert totals["powersgd"]["all-reduce"]["bytes"] - 4 == want["powersgd"]
    assert sent["fp32"] / sent["powersgd"] > 5
    # the planner's model of the same traffic (jaxcolossal.plan.dp_gradient_bytes): within 1%
    # (fp8's per-shard scales are left out of it; the loss's scalar all-reduce is 7 bytes)
    for name, extra in (("fp32", {}), ("bf16", {"communication_dtype": "bf16"}), ("fp8", {"communication_dtype": "fp8"}),
                        ("powersgd", {"gradient_compression": "powersgd", "powersgd_rank": 2})):
        predicted = dp_gradient_bytes(_cfg(zero_stage=0, **extra), 8)
        assert abs(sent[name] - 7 - predicted) <= 0.01 * predicted, (name, sent[name], predicted)


def test_powersgd_is_exact_on_low_rank_gradients_and_keeps_what_it_did_not_send():
    """Shards whose gradients share rank-2 row and column spaces: one power iteration at rank 2
    gives their sum exactly; on full-rank gradients Σ new errors = Σ (gradient + old error) −
    what was sent (error feedback loses nothing)."""
    mesh = make_mesh(_cfg().parallel)
    rows = NamedSharding(mesh, P(DATA_AXES, None, None))
    rng = np.random.default_rng(2)
    u, v = rng.normal(size=(32, 2)), rng.normal(size=(2, 24))
    low = np.stack([u @ np.diag(rng.normal(size=2)) @ v for _ in range(8)]).astype(np.float32)
    full = rng.normal(size=(8, 32, 24)).astype(np.float32)
    views = {"w": ((32, 24), 0, 32, 24)}
    q = {"w": jnp.asarray(rng.normal(size=(24, 2)), jnp.float32)}
    fn = jax.jit(lambda g, st: powersgd_reduce({"w": g}, st, views, mesh))
    zero = {"q": q, "error": {"w": jax.device_put(np.zeros_like(low), rows)}}
    summed, st = fn(jax.device_put(low, rows), zero)
    np.testing.assert_allclose(np.asarray(summed["w"]), low.sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(st["error"]["w"]).sum(0), 0.0, atol=1e-4)
    old = rng.normal(size=(8, 32, 24)).astype(np.float32) * 0.1
    summed, st = fn(jax.device_put(full, rows), {"q": q, "error": {"w": jax.device_put(old, rows)}})
    np.testing.assert_allclose(np.asarray(summed["w"]) + np.asarray(st["error"]["w"]).sum(0), (full + old).sum(0),
                               rtol=1e-4, atol=1e-4)
    assert np.linalg.matrix_rank(np.asarray(summed["w"]), tol=1e-3) == 2


def test_warmup_steps_reduce_densely_then_compress():
    """``compression_warmup_steps=2``: the first two updates are the uncompressed run's (so the
    losses of steps 1–3 equal it), the third is PowerSGD's."""
    base, mb, _ = run_steps(_cfg(zero_stage=0), steps=3)
    state, m, _ = run_steps(_cfg(zero_stage=0, gradient_compression="powersgd", powersgd_rank=1,
                                 compression_warmup_steps=2), steps=3)
    np.testing.assert_allclose([r["loss"] for r in m], [r["loss"] for r in mb], rtol=1e-6)
    assert max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(base.params))) > 1e-4
    assert any(float(jnp.max(jnp.abs(e))) > 0 for e in jax.tree.leaves(state.residual["error"]))


def test_orthonormalize_spans_the_same_columns():
    """Modified Gram–Schmidt (no LAPACK call in the step): QᵀQ = I on a batch of [n, r], the same
    column space as the input, a zero column stays zero (no 0/0)."""
    rng = np.random.default_rng(3)
    p = rng.normal(size=(3, 40, 6)).astype(np.float32)
    q = np.asarray(orthonormalize(jnp.asarray(p)))
    np.testing.assert_allclose(np.einsum("bnr,bns->brs", q, q), np.broadcast_to(np.eye(6), (3, 6, 6)), atol=1e-5)
    proj = np.einsum("bnr,bmr,bms->bns", q, q, p)  # projecting p onto q's span changes nothing
    np.testing.assert_allclose(proj, p, atol=1e-4)
    p[0, :, 2] = 0.0
    q = np.asarray(orthonormalize(jnp.asarray(p)))
    assert np.all(np.isfinite(q)) and not np.any(q[0, :, 2])
