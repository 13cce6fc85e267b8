"""Sequence parallelism (``parallel.sequence_parallelism_mode``): every mode equals one device,
the collectives per layer are those of the method, bad sizes are refused before compiling, and
every mode exports for CUDA.

Tolerance (fp32, 3 steps): loss and grad norm rtol 1e-5; updated params by
:func:`tiny.assert_params_match` (rtol 1e-5 / atol 1e-6 for all but 0.1% of a leaf, all within
0.1·lr).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import assert_params_match, random_batches, run_steps, setup, tiny_config

from jaxcolossal.aot import hlo
from jaxcolossal.aot.hlo import collective_totals
from jaxcolossal.config import ConfigError, validate
from jaxcolossal.data.loader import packing_fields
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.sequence import zigzag_order
from jaxcolossal.train.state import make_plan
from jaxcolossal.train.step import make_eval_step

# 16 heads over 8 kv heads (GQA, head dim 4), so Ulysses and Megatron-SP can split them over up to 8 devices
MODEL = dict(num_attention_heads=16, num_key_value_heads=8)
TRAIN = dict(seq_len=32, batch_size=4)

CASES = {
    "ring_sp8": dict(sequence_parallelism_mode="ring_attn", sequence_parallel_size=8, data_parallel_size=1),
    "ring_sp4_dp2_zero1": dict(sequence_parallelism_mode="ring_attn", sequence_parallel_size=4, data_parallel_size=2,
                               zero_stage=1),
    "ring_sp2_tp2_dp2_zero3": dict(sequence_parallelism_mode="ring_attn", sequence_parallel_size=2,
                                   tensor_parallel_size=2, data_parallel_size=2, zero_stage=3),
    "ulysses_sp8": dict(sequence_parallelism_mode="all_to_all", sequence_parallel_size=8, data_parallel_size=1),
    "ulysses_sp4_dp2_zero1": dict(sequence_parallelism_mode="all_to_all", sequence_parallel_size=4,
                                  data_parallel_size=2, zero_stage=1),
    "ulysses_sp2_tp2_dp2_zero3": dict(sequence_parallelism_mode="all_to_all", sequence_parallel_size=2,
                                      tensor_parallel_size=2, data_parallel_size=2, zero_stage=3),
    # XLA's all-gathers / reduce-scatters (overlap off); the next one with the TP collective matmul
    "megatron_sp_tp8": dict(sequence_parallelism_mode="split_gather", tensor_parallel_size=8, data_parallel_size=1,
                            overlap=False),
    "megatron_sp_tp4_dp2_zero3": dict(sequence_parallelism_mode="split_gather", tensor_parallel_size=4,
                                      data_parallel_size=2, zero_stage=3),
    # ring attention inside the pipeline's shard_map (manual over pp, the data axes and sp)
    "ring_sp2_pp2_dp2_zero1": dict(sequence_parallelism_mode="ring_attn", sequence_parallel_size=2,
                                   pipeline_parallel_size=2, data_parallel_size=2, zero_stage=1, num_microbatches=2),
    "ring_sp2_pp2_tp2_1f1b": dict(sequence_parallelism_mode="ring_attn", sequence_parallel_size=2,
                                  pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1,
                                  pipeline_schedule="1f1b"),
    # model.attention_impl=flash: the kernel runs per device on its rows and heads (no gathered inputs)
    "flash_dp4_tp2_zero1": dict(tensor_parallel_size=2, data_parallel_size=4, zero_stage=1),
}


@pytest.fixture(scope="module")
def reference():
    return run_steps(tiny_config(model=MODEL, training=TRAIN), jax.devices()[:1], steps=3)


@pytest.mark.parametrize("name", list(CASES))
def test_mode_equals_one_device(name, reference):
    ref_state, ref_metrics, _ = reference
    model = dict(MODEL, attention_impl="flash") if name.startswith("flash") else MODEL
    cfg = tiny_config(parallel=CASES[name], model=model, training=TRAIN)
    state, metrics, plan = run_steps(cfg, jax.devices(), steps=3)
    assert plan.mesh.size == 8
    for got, want in zip(metrics, ref_metrics):
        np.testing.assert_allclose([got["loss"], got["grad_norm"]], [want["loss"], want["grad_norm"]], rtol=1e-5)
    assert_params_match(state.params, ref_state.params)


def test_tp_collective_matmul(reference):
    """Megatron-SP with ``parallel.overlap`` (tp 4, 2 layers): the projections' all-gathers and
    reduce-scatters over tp become rings of collective-permutes, 4 per layer for the forward
    (q/k/v in, o out, gate/up in, down out) and 4 for the backward, each (tp − 1) permutes:
    8·3·2 = 48 in the train step, and no sequence all-gather is left. In the compiled HLO every
    permute, in the forward and the backward layer loop, has matmuls that are neither its
    ancestors nor its descendants (:func:`jaxcolossal.aot.hlo.concurrent_matmuls`): the transfer can
    run while they compute. With ``overlap=false`` each of the forward's all-gathers is serial
    with every matmul of the layer. The first step's loss and grad norm equal one device's (rtol
    1e-5); more equality with one device is in ``test_mode_equals_one_device``:
    ``megatron_sp_tp4_dp2_zero3`` with the collective matmul (overlap is on by default),
    ``megatron_sp_tp8`` with XLA's collectives (``overlap=false``)."""
    L, tp = 2, 4
    par = dict(sequence_parallelism_mode="split_gather", tensor_parallel_size=tp, data_parallel_size=2)
    cfg = tiny_config(parallel=par, model=dict(MODEL, num_layers=L), training=TRAIN)
    plan, _, state, step = setup(cfg, jax.devices())
    x = random_batches(cfg, 1)[0]  # run_steps' first batch
    batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
             "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
    compiled = step.lower(state, batch).compile()
    # ZeRO-0 here: the per-data-shard vmap path (megatron_sp_tp4_dp2_zero3 covers the global one)
    _, m = compiled(state, batch)
    want = reference[1][0]
    np.testing.assert_allclose([float(m["loss"]), float(m["grad_norm"])], [want["loss"], want["grad_norm"]],
                               rtol=1e-5)
    text = compiled.as_text()
    totals = collective_totals(text)
    assert totals["collective-permute"]["count"] == 8 * (tp - 1) * L, totals
    assert totals.get("all-gather", {}).get("count", 0) <= 3, totals  # the embedding/head's, not the layers'
    comps, _ = hlo.computations(text)
    bodies = [body for name in comps for body, _ in hlo.while_loops(comps, name)]
    per_loop = {b: hlo.concurrent_matmuls(comps, b, "collective-permute") for b in bodies}
    per_loop = {b: v for b, v in per_loop.items() if v}
    assert len(per_loop) == 2 and all(min(v) > 0 for v in per_loop.values()), per_loop
    # without overlap: XLA's all-gathers in the forward loop, each serial with the matmuls
    off = hlo.computations(_eval_hlo(dict(par, overlap=False), L))[0]
    gathers = [hlo.concurrent_matmuls(off, b, "all-gather") for name in off for b, _ in hlo.while_loops(off, name)]
    assert sum(map(len, gathers)) >= 2 and not any(any(g) for g in gathers), gathers


def test_ring_attention_with_packed_documents():
    """Segment ids and restarting positions travel with the zig-zag reorder: a packed batch gives
    the one-device loss and gradient norm."""
    t = TRAIN["seq_len"]
    lengths = [(5, 11, 16), (20, 12), (32,), (3, 3, 26)]
    rows = [packing_fields(np.cumsum([0, *ls[:-1]]), [0], t) for ls in lengths]
    aux = {k: np.concatenate([r[k] for r in rows]).astype(np.int32) for k in ("segment_ids", "positions", "loss_mask")}
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (4, t + 1)).astype(np.int32)
    out = []
    for par, n in ((None, 1), (dict(CASES["ring_sp4_dp2_zero1"]), 8)):
        cfg = tiny_config(parallel=par, model=MODEL, training=TRAIN)
        plan, _, state, step = setup(cfg, jax.devices()[:n])
        batch = {"inputs": x[:, :-1], "targets": x[:, 1:], **aux}
        _, m = step(state, {k: jax.device_put(v, plan.batch_sharding) for k, v in batch.items()})
        out.append([float(m["loss"]), float(m["grad_norm"])])
    np.testing.assert_allclose(out[1], out[0], rtol=1e-5)


def test_zigzag_order():
    order = zigzag_order(16, 4)  # chunks of 2: device i holds chunks i and 7 - i
    np.testing.assert_array_equal(order.reshape(4, 4), [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                                        [6, 7, 8, 9]])
    assert sorted(order) == list(range(16))


def _eval_hlo(par: dict, layers: int = 3, t: int = 64, impl: str = "xla") -> str:
    cfg = tiny_config(parallel=par, model={**MODEL, "num_layers": layers, "attention_impl": impl},
                      training=dict(TRAIN, seq_len=t))
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()))
    params = jax.eval_shape(lambda: plan.init_model(jax.random.key(0)))
    x = jax.ShapeDtypeStruct((4, t), jnp.int32)
    return make_eval_step(plan).lower(params, x, x).compile().as_text()


def test_collectives_per_layer_forward():
    """In the forward (the eval step, 3 layers): Ulysses has 4 all-to-alls per layer (q, k, v in,
    the output back), ring attention sp − 1 collective-permutes per layer (k and v travel as one
    array) and nothing else; Megatron-SP gathers the sequence before the two column-parallel
    blocks of each layer (``overlap=false``: XLA's collectives) and its layer scan carries the
    residual stream split over tp. The flash
    kernel, opaque to XLA, runs per device: its forward has the all-gathers of XLA attention's."""
    L = 3
    counts = lambda hlo: {k: v["count"] for k, v in collective_totals(hlo).items()}
    assert counts(_eval_hlo(dict(CASES["ulysses_sp4_dp2_zero1"], zero_stage=0), L)) == {"all-to-all": 4 * L}
    ring = counts(_eval_hlo(CASES["ring_sp8"], L))
    assert ring == {"collective-permute": 7 * L}
    hlo = _eval_hlo(dict(sequence_parallelism_mode="split_gather", tensor_parallel_size=2, data_parallel_size=4,
                         overlap=False), L)
    seq_gathers = [ln for ln in hlo.splitlines() if re.search(r" all-gather(-start)?\(", ln)
                   and "dimensions={1}" in ln and re.search(r"f32\[1,64,64\]", ln)]
    assert len(seq_gathers) >= 2  # the attention and the MLP input (inside the layer loop: counted once)
    assert counts(hlo)["all-gather"] >= 2 * L
    # the layer scan's carry: the residual stream [b/N, t/tp, d] = [1, 32, 64] per device
    loops = [ln for ln in hlo.splitlines() if " while(" in ln]
    assert loops and all("f32[1,32,64]" in ln and "f32[1,64,64]" not in ln for ln in loops), loops
    par = dict(tensor_parallel_size=2, data_parallel_size=4, zero_stage=1)
    gathers = [counts(_eval_hlo(par, 1, impl=impl)).get("all-gather", 0) for impl in ("xla", "flash")]
    assert gathers[1] == gathers[0], gathers


@pytest.mark.parametrize("par, match", [
    (dict(sequence_parallel_size=2), "needs parallel.sequence_parallelism_mode"),
    (dict(sequence_parallelism_mode="split_gather"), "needs tensor_parallel_size > 1"),
    (dict(sequence_parallelism_mode="split_gather", tensor_parallel_size=2, sequence_parallel_size=2),
     "set sequence_parallel_size=1"),
    (dict(sequence_parallelism_mode="all_to_all", sequence_parallel_size=8, tensor_parallel_size=2),
     "8 × 2 = 16, which does not divide model.num_key_value_heads=8"),
    (dict(sequence_parallelism_mode="all_to_all", sequence_parallel_size=2, pipeline_parallel_size=2),
     "not supported with pipeline"),
    (dict(sequence_parallelism_mode="ring_attn", sequence_parallel_size=1), "needs sequence_parallel_size > 1"),
    (dict(sequence_parallelism_mode="ring_attn", sequence_parallel_size=2, data_parallel_size=3), "= 6, but"),
])
def test_bad_sequence_settings_are_refused(par, match):
    with pytest.raises(ConfigError, match=match):
        validate(tiny_config(parallel=par, model=MODEL, training=TRAIN), num_devices=8)


def test_flash_with_a_pipeline_is_refused():
    with pytest.raises(ConfigError, match="attention_impl=flash is not supported with pipeline parallelism"):
        validate(tiny_config(parallel=dict(pipeline_parallel_size=2), model=dict(MODEL, attention_impl="flash"),
                             training=TRAIN), num_devices=8)


def test_seq_len_must_split_into_blocks():
    with pytest.raises(ConfigError, match="not divisible by 8.*zig-zag"):
        validate(tiny_config(parallel=dict(sequence_parallelism_mode="ring_attn", sequence_parallel_size=4),
                             model=MODEL, training=dict(TRAIN, seq_len=36)), num_devices=8)


@pytest.mark.parametrize("name, impl", [("ring_sp4_dp2_zero1", "xla"), ("ulysses_sp2_tp2_dp2_zero3", "flash"),
                                        ("megatron_sp_tp4_dp2_zero3", "xla"), ("ring_sp2_pp2_tp2_1f1b", "xla")])
def test_train_step_exports_for_cuda(name, impl):
    """Each mode's bf16 train step lowers for CUDA on the CPU (``jax.export``), flash attention once
    (its Triton kernels inside Ulysses' shard_map), so a GPU lowering error shows up here.
    (``cudnn`` cannot be traced without cuDNN installed: JAX checks its version when tracing.)"""
    cfg = tiny_config(parallel=CASES[name], model=dict(MODEL, attention_impl=impl), training=TRAIN, precision="bf16")
    plan, _, state, step = setup(cfg, jax.devices())
    batch = {k: jax.ShapeDtypeStruct((4, TRAIN["seq_len"]), jnp.int32, sharding=plan.batch_sharding)
             for k in ("inputs", "targets")}
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(step, platforms=["cuda"], disabled_checks=[triton])(abstract, batch)
    text = exported.mlir_module()
    assert ("all_to_all" in text) == ("ulysses" in name)
    # Megatron-SP: the TP collective matmul's ring (parallel.overlap, the default)
    assert ("collective_permute" in text) == ("ring" in name or "pp" in name or "megatron" in name)
    assert ("__gpu$xla.gpu.triton" in text) == (impl == "flash")
