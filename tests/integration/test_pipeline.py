"""Pipeline parallelism (jaxcolossal.parallel.pipeline_schedule, jaxcolossal.parallel.pipeline_executor): equivalence, schedules, memory, errors.

Equivalence: each pipelined configuration trains 3 steps (fp32, AdamW) on the same random tokens
as the single-device run and matches it in loss and gradient norm (rtol 1e-5) and in the updated
parameters as ``tiny.assert_params_match`` (all but 0.1% of each leaf to rtol 1e-5 / atol 1e-6,
every element to 2% of the learning rate: Adam amplifies the summation-order noise of
microbatches and data shards where a gradient is ~ε).

Memory and bubble: compile-only (nothing executes). 1F1B's compiled temporary memory stays flat
when m grows 4× at a fixed microbatch size, GPipe's grows; the schedule tables' bubble fractions
equal the closed forms and interleaving shrinks the bubble for p > 2.
"""

from __future__ import annotations

import os
import re
import sys

import jax
import numpy as np
import pytest

from jaxcolossal.config import ConfigError, config_from_dict, pipeline_microbatches, validate
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.pipeline_schedule import check_schedule, make_schedule
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import init_state, make_plan
from jaxcolossal.train.step import make_grad_fn, make_train_step

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from bench_pipeline import compile_step, pipeline_config  # noqa: E402
from tiny import assert_params_match  # noqa: E402

MODEL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=64)
TRAINING = dict(batch_size=16, seq_len=32, learning_rate=1e-3, warmup_steps=1, max_steps=10)
STEPS = 3


def make_config(parallel: dict, layers: int = 4, **model):
    return config_from_dict({"model": {**MODEL, "num_layers": layers, **model}, "training": TRAINING,
                             "parallel": parallel})


def train(cfg, devices):
    """3 steps on fixed random tokens: (params on the host, [metrics dict per step])."""
    mesh = make_mesh(cfg.parallel, devices)
    plan = make_plan(cfg, mesh)
    tx = build_optimizer(cfg.training)
    state = init_state(plan, tx, key=jax.random.key(0))
    step = make_train_step(plan, tx)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        x = rng.integers(0, cfg.model.vocab_size, (TRAINING["batch_size"], TRAINING["seq_len"] + 1)).astype(np.int32)
        batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
                 "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
        state, m = step(state, batch)
        out.append({k: float(v) for k, v in m.items()})
    return jax.device_get(state.params), out, plan


@pytest.fixture(scope="module")
def references():
    """Single-device runs of the 4-layer and 8-layer models (computed on first use)."""
    cache = {}

    def get(layers):
        if layers not in cache:
            cache[layers] = train(make_config({"data_parallel_size": 1}, layers), jax.devices()[:1])
        return cache[layers]

    return get


def pp(p, schedule, chunks=1, **extra):
    return {"data_parallel_size": -1, "pipeline_parallel_size": p, "pipeline_schedule": schedule,
            "num_model_chunks": chunks, **extra}


CASES = {
    "pp2_gpipe": (4, pp(2, "gpipe")),
    "pp2_1f1b": (4, pp(2, "1f1b")),
    "pp2_interleaved_v2": (4, pp(2, "interleaved", 2)),
    "pp2_gpipe_circular_v2": (4, pp(2, "gpipe", 2)),
    "pp4_gpipe": (4, pp(4, "gpipe")),
    "pp4_1f1b": (4, pp(4, "1f1b")),
    "pp4_interleaved_v2": (8, pp(4, "interleaved", 2)),
    "dp2_tp2_pp2_zero1": (4, pp(2, "1f1b", data_parallel_size=2, tensor_parallel_size=2, zero_stage=1)),
    "pp2_zero3": (4, pp(2, "1f1b", zero_stage=3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_device(name, references):
    layers, parallel = CASES[name]
    ref_params, ref_metrics = references(layers)[:2]
    params, metrics, plan = train(make_config(parallel, layers), jax.devices())
    assert plan.mesh.size == 8 and plan.mesh_shape["pp"] == parallel["pipeline_parallel_size"]
    for got, want in zip(metrics, ref_metrics):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-5)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert_params_match(params, ref_params)


def test_gpipe_accumulates_microbatch_gradients_in_fp32():
    """bf16, p = 2, m = 8: GPipe's gradients equal 1F1B's, which sums the per-microbatch bf16
    gradients into fp32 buffers explicitly (the per-microbatch gradients are the same bf16 values).
    Max over leaves of max |diff| / max |grad|: measured 8.7e-10 (fp32 summation order) with fp32
    accumulation, 9.0e-3 when the transpose of the tick scan summed them in bf16; bound 1e-5."""
    x = np.random.default_rng(0).integers(0, 256, (8, 9)).astype(np.int32)  # vocab_size 256 (default)
    params, grads = None, {}
    for schedule in ("gpipe", "1f1b"):
        cfg = config_from_dict({"model": {**MODEL, "num_layers": 2}, "precision": {"bf16": True},
                                "training": {**TRAINING, "batch_size": 8, "seq_len": 8},
                                "parallel": pp(2, schedule, num_microbatches=8)})
        plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:2]))
        if params is None:  # the same state layout for both schedules
            params = init_state(plan, build_optimizer(cfg.training), key=jax.random.key(0)).params
        batch = (jax.device_put(a, plan.batch_sharding) for a in (x[:, :-1], x[:, 1:]))
        grads[schedule] = jax.device_get(jax.jit(make_grad_fn(plan))(params, *batch, np.float32(1))[1])
    err = jax.tree.map(lambda g, r: np.abs(g - r).max() / np.abs(r).max(), grads["gpipe"], grads["1f1b"])
    assert max(jax.tree.leaves(err)) < 1e-5, err


def test_state_layout_is_unchanged_by_pp():
    """The layers dimension is sharded on pp, the state stays [L, ...] (checkpoints, HF export)."""
    cfg = make_config(pp(2, "interleaved", 2, tensor_parallel_size=2, zero_stage=3))
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    state = init_state(plan, build_optimizer(cfg.training), key=jax.random.key(0))
    wq = state.params["layers"]["wq"]  # (layers, embed, heads, head_dim)
    assert wq.shape == (4, 64, 4, 16)
    assert tuple(wq.sharding.spec) == ("pp", "fsdp", "tp", None)
    assert tuple(state.params["embed_tokens"].sharding.spec) == ("tp", "fsdp")


# ----------------------------------------------------------------------------- schedule tables


@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_tables_are_valid_and_match_formulas(kind, v, p):
    for m in ([p, 2 * p, 3 * p] if v > 1 else [1, p - 1, p, 2 * p + 1, 5 * p]):
        if m < 1:
            continue
        s = make_schedule(kind, p, m, v)
        check_schedule(s)  # dependencies, once-each, stash never overwritten early
        assert s.bubble_fraction == pytest.approx(s.bubble_formula, abs=1e-12)
        if kind == "gpipe":
            assert s.num_ticks == m * v + p - 1
        else:
            assert s.num_ticks == m * v + (v + 1) * p - 2
            assert s.num_slots == 2 * v * p - 1


def test_1f1b_is_designs_lockstep_form():
    """Lock-step 1F1B: stage s runs forward of t−s and backward of t−(2p−2−s), m+2p−2 ticks."""
    p, m = 4, 8
    s = make_schedule("1f1b", p, m)
    assert s.num_ticks == m + 2 * p - 2
    for t in range(s.num_ticks):
        for d in range(p):
            f, b = s.fwd[t, d], s.bwd[t, d]
            assert bool(f[0]) == (0 <= t - d < m) and (not f[0] or f[1] == t - d)
            assert bool(b[0]) == (0 <= t - (2 * p - 2 - d) < m) and (not b[0] or b[1] == t - (2 * p - 2 - d))
    # stage inputs held at once on stage d: 2(p-1-d)+1 <= 2p-1, independent of m
    for d in range(p):
        live = max(sum(1 for j in range(m) if j + d <= t <= j + 2 * p - 2 - d) for t in range(s.num_ticks))
        assert live == min(m, 2 * (p - 1 - d) + 1)


def test_bubble_claims():
    for p in (3, 4, 8):
        for m in (p, 2 * p, 4 * p, 8 * p):
            g, f, i = (make_schedule(k, p, m, v) for k, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)))
            assert g.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
            assert f.bubble_fraction == pytest.approx((2 * p - 2) / (m + 2 * p - 2))
            assert i.bubble_fraction == pytest.approx((3 * p - 2) / (2 * m + 3 * p - 2))
            assert i.bubble_fraction < f.bubble_fraction
    # p = 2: the lock-step interleaved and 1f1b forms tie ((v-1)(p-2) = 0)
    assert make_schedule("interleaved", 2, 8, 2).bubble_fraction == pytest.approx(
        make_schedule("1f1b", 2, 8).bubble_fraction)


# ----------------------------------------------------------------------------- compiled memory / HLO


def _temp(schedule, m):
    cfg = pipeline_config(schedule, 2, m, dp=4, mbs=2, layers=4)
    return compile_step(cfg).memory_analysis().temp_size_in_bytes


def test_activation_memory_1f1b_flat_gpipe_grows():
    """Fixed microbatch (2 sequences per data shard), p = 2: m = 2p -> 4p. Measured: 1F1B 2,207,224
    -> 2,207,352 bytes; GPipe 9,119,984 -> 14,462,448 (≈ 3.78 MB + 1.34 MB per microbatch; at
    m = 16, 25,147,824)."""
    f4, f8 = _temp("1f1b", 4), _temp("1f1b", 8)
    g4, g8 = _temp("gpipe", 4), _temp("gpipe", 8)
    assert f8 <= 1.05 * f4, (f4, f8)
    assert g8 > 1.4 * g4, (g4, g8)
    assert f8 < g8


def _collectives_by_loop_nesting(hlo: str) -> tuple[dict, dict]:
    """Count collective ops outside and inside while-loop bodies of a compiled HLO module."""
    comps = re.split(r"\n(?=%\S+ |ENTRY )", hlo)
    bodies = set(re.findall(r"body=%([\w.\-]+)", hlo))
    table = {}
    for c in comps:
        name = "ENTRY" if c.startswith("ENTRY") else c.split(" ", 1)[0].lstrip("%")
        kinds = re.findall(r" (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)\(", c)
        subs = re.findall(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)", c)
        subs += [n.strip().lstrip("%") for g in re.findall(r"branch_computations=\{([^}]*)\}", c)
                 for n in g.split(",")]
        table[name] = (kinds, subs)
    outside, inside = {}, {}

    def walk(name, in_loop, seen):
        if name in seen or name not in table:
            return
        kinds, subs = table[name]
        for k in kinds:
            d = inside if in_loop else outside
            d[k] = d.get(k, 0) + 1
        for s in subs:
            walk(s, in_loop or s in bodies, seen | {name})

    walk("ENTRY", False, frozenset())
    return outside, inside


def test_zero3_gathers_once_per_step_and_reduces_once():
    """ZeRO-3 under pp: all weight all-gathers and gradient reduce-scatters sit outside the tick
    loop (once per step, not per microbatch); only the pp sends are inside it."""
    cfg = pipeline_config("1f1b", 2, 4, dp=4, mbs=2, layers=4, zero_stage=3)
    outside, inside = _collectives_by_loop_nesting(compile_step(cfg).as_text())
    assert outside.get("all-gather", 0) >= 12 and outside.get("reduce-scatter", 0) >= 12, outside
    assert set(inside) == {"collective-permute"}, inside


# ----------------------------------------------------------------------------- errors before compiling


def test_layers_not_divisible_by_stages_times_chunks():
    with pytest.raises(ConfigError, match=r"model.num_layers=6 is not divisible by pipeline_parallel_size × "
                                          r"num_model_chunks = 2 × 2 = 4"):
        make_config(pp(2, "interleaved", 2), layers=6)
    with pytest.raises(ConfigError, match=r"model.num_layers=4 is not divisible .* = 3 × 1 = 3"):
        make_config(pp(3, "1f1b"), layers=4)


def test_batch_not_splitting_into_microbatches_per_data_shard():
    # pp=2 on 8 devices -> dp=4; 16 sequences / (4 shards × 8 microbatches) does not split
    cfg = make_config(pp(2, "1f1b", num_microbatches=8))
    with pytest.raises(ConfigError, match=r"training.batch_size=16 does not split into parallel.num_microbatches=8 "
                                          r"pipeline microbatches per data-parallel shard \(data_parallel_size=4\)"):
        validate(cfg, num_devices=8)
    with pytest.raises(ConfigError, match="batch_size=16 is not divisible by parallel.num_microbatches=3"):
        make_config(pp(2, "1f1b", num_microbatches=3))


def test_too_few_microbatches_for_interleaved():
    with pytest.raises(ConfigError, match=r"num_microbatches=2 with 2 model chunks: .* groups of "
                                          r"pipeline_parallel_size=4, so it needs a multiple of 4"):
        make_config(pp(4, "interleaved", 2, num_microbatches=2), layers=8)


def test_schedule_and_chunk_combinations():
    with pytest.raises(ConfigError, match="interleaved needs parallel.num_model_chunks >= 2"):
        make_config(pp(2, "interleaved", 1))
    with pytest.raises(ConfigError, match="num_model_chunks=2 needs parallel.pipeline_schedule interleaved"):
        make_config(pp(2, "1f1b", 2))
    with pytest.raises(ConfigError, match="replace gradient accumulation"):
        config_from_dict({"model": {**MODEL, "num_layers": 4},
                          "training": {**TRAINING, "gradient_accumulation_steps": 2},
                          "parallel": pp(2, "1f1b", num_microbatches=4)})


def test_default_number_of_microbatches():
    assert pipeline_microbatches(make_config(pp(2, "1f1b")), 2) == 4  # 2·pp
    cfg = config_from_dict({"model": {**MODEL, "num_layers": 4},
                            "training": {**TRAINING, "gradient_accumulation_steps": 8},
                            "parallel": pp(2, "1f1b")})
    assert pipeline_microbatches(cfg, 2) == 8  # the accumulation microbatches become pipeline microbatches
    assert pipeline_microbatches(make_config(pp(2, "1f1b", num_microbatches=2)), 2) == 2
