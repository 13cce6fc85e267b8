"""One GRPO iteration of a Llama-3-8B shape on 8 compile-only H200s (issue 43's GPU acceptance).

The three programs of an iteration (:mod:`jaxcolossal.posttrain.rollout`), compiled by XLA's GPU compiler
for the training layout of ``configs/bench/llama3_8b.yaml`` (ZeRO-3 over fsdp 8, bf16, ``remat=full``)
with ``training.objective=grpo``, ``beta=0.04`` (the frozen reference in the state), 8 prompts × 8
generations = 64 rows of a 513-token prompt and a 1024-token completion (``seq_len`` 1536):

* the sampler (:func:`jaxcolossal.generate.make_generator` on the bf16 params as ZeRO-3 lays them out,
  the KV cache with its rows over the data axes);
* the old/reference per-token log-probs (:func:`jaxcolossal.posttrain.rollout.rollout_token_logps`);
* the train step (:func:`jaxcolossal.train.step.make_train_step`, as ``--compile-for`` builds it).

Measured (jax 0.10's XLA:GPU, per device; docs/planner.md): the sampler 1.87 GiB arguments (the
params) + 4.33 GiB temporaries (the KV cache, 1.50 GiB, and a second cache-sized buffer of the decode
loop, the prefill's attention scores 0.75 GiB, ZeRO-3's gathered layers); the log-probs 1.87 + 4.13
GiB (the XLA attention's fp32 scores of a layer, 2.25 GiB, the head gathered whole, 0.98 GiB); the step
14.96 GiB arguments (params 1.87 + master and Adam 11.22 + the reference 1.87) + 13.94 GiB temporaries
(fp32 gradients 3.74, saved residuals 3.0, a layer's attention scores) = 28.90 GiB, of 141 GB. The
planner (:mod:`jaxcolossal.memory.rollout`) says 29.41 GiB for the step (+1.8%) and 4.16 GiB for the
sampler's temporaries (-3.8%).
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.aot import fleet, hlo, report, target
from jaxcolossal.config import load_config
from jaxcolossal.config.derived import grpo_prompt_length, holds_reference, rollout_tp
from jaxcolossal.generate import Sampling, make_generator
from jaxcolossal.generate.sampler import training_param_specs
from jaxcolossal.memory.budget import need
from jaxcolossal.memory.rollout import kv_cache_bytes
from jaxcolossal.metrics import param_count
from jaxcolossal.models import param_layout
from jaxcolossal.parallel.decode_layout import decode_mesh, make_reshard
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.sharding import RULES, is_shape, logical_to_spec
from jaxcolossal.posttrain.rollout import rollout_token_logps
from jaxcolossal.train.state import make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 2**30
DEVICES = 8
GRPO_8B = ["model.attention_impl=xla", "training.objective=grpo", "data.format=prompts",
           "data.corpus=configs/data/arith_prompts.jsonl", "training.batch_size=64", "training.micro_batch_size=0",
           "training.seq_len=1536", "posttrain.max_completion_length=1024", "posttrain.num_generations=8",
           "posttrain.beta=0.04"]
"""Llama-3-8B (configs/bench/llama3_8b.yaml: ZeRO-3 over fsdp 8, bf16, remat full) as a GRPO run; XLA
attention, since the rollout rows' segment ids rule out cuDNN's kernel."""


def _memory(compiled) -> dict:
    """``memory_analysis()`` in bytes per device, and ``peak`` = arguments + outputs − aliased + temporaries."""
    ma = compiled.memory_analysis()
    m = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    m["peak"] = m["argument"] + m["output"] - m["alias"] + m["temp"]
    return m


def _report(name: str, m: dict) -> None:
    print(f"\n{name}: " + ", ".join(f"{k} {m[k] / GiB:.3f} GiB" for k in ("argument", "output", "alias", "temp", "peak")))


@pytest.fixture(scope="module")
def grpo_8b():
    """``(cfg, plan, bf16 params as ShapeDtypeStructs in the training layout, the H200 target)``."""
    cfg = load_config(os.path.join(ROOT, "configs/bench/llama3_8b.yaml"), GRPO_8B)
    h200 = target.get_target("h200")
    fleet.check_fleet(cfg, DEVICES, h200.devices_per_host, h200)  # resolves and validates, as --compile-for does
    mesh = make_mesh(cfg.parallel, target.compile_only_devices(h200, DEVICES))
    plan = make_plan(cfg, mesh)
    specs = training_param_specs(cfg.model, mesh, cfg.parallel.zero_stage)
    _, shapes, _ = param_layout(cfg.model, plan.mesh_shape["tp"])
    params = jax.tree.map(lambda s, sp: jax.ShapeDtypeStruct(tuple(s), jnp.bfloat16, sharding=NamedSharding(mesh, sp)),
                          shapes, specs, is_leaf=is_shape)
    return cfg, plan, params, h200


@pytest.fixture(scope="module")
def fleet_8b(grpo_8b):
    """``--compile-for h200x8``'s result: the train step and the rollout's programs."""
    cfg, _, _, h200 = grpo_8b
    return fleet.compile_for(cfg, h200, DEVICES, keep_hlo=False)


@pytest.fixture(scope="module")
def step_memory(fleet_8b):
    return {**fleet_8b.memory, "peak": fleet_8b.peak}


def test_the_train_step_holds_the_reference_and_fits(grpo_8b, step_memory):
    """The step's arguments are the planner's state (params, fp32 master and Adam moments, and the bf16
    reference, 2 bytes a parameter over 8 devices); its peak is the planner's within 10%."""
    cfg, _, _, h200 = grpo_8b
    m, planned = step_memory, need(cfg, DEVICES, backend="gpu")
    _report("train step", m)
    assert holds_reference(cfg)
    n = param_count(cfg.model)["total"]
    assert planned["reference"] == pytest.approx(2 * n / DEVICES, rel=0.01)  # 1.87 GiB
    assert planned["state"] == pytest.approx(m["argument"], rel=0.01)  # 14.96 GiB, the reference included
    assert m["argument"] - (planned["state"] - planned["reference"]) == pytest.approx(planned["reference"], rel=0.02)
    # the state is donated (updated in place); what is not is the rollout batch (its fields the loss reads)
    assert 0 < m["argument"] - m["alias"] <= planned["rollout"]["batch"]
    assert planned["step_total"] == pytest.approx(m["peak"], rel=0.10)  # 29.41 vs 28.90 GiB: +1.8%
    assert m["peak"] <= h200.hbm_bytes


def test_the_sampler_compiles_with_the_kv_cache_over_the_data_axes(grpo_8b, step_memory):
    """The rollout's sampler on the ZeRO-3 bf16 params: its temporaries hold the KV cache (64 rows ×
    1537 slots × 32 layers × 2 × 8 kv heads × 128 × 2 bytes over 8 devices = 1.50 GiB), as per-device
    buffers of 8 rows (never the whole batch's 64), and are the planner's sampler temporaries within
    15%; with the resident train state (the step's arguments) it fits an H200."""
    cfg, plan, params, h200 = grpo_8b
    C = cfg.posttrain.max_completion_length
    B, width = cfg.training.batch_size, grpo_prompt_length(cfg)
    mesh = plan.mesh
    fn = make_generator(plan.family, cfg.model, C, Sampling(temperature=1.0), eos_id=1, pad_id=0, mesh=mesh,
                        param_specs=jax.tree.map(lambda p: p.sharding.spec, params))
    rows = NamedSharding(mesh, logical_to_spec(("batch", None), RULES))
    compiled = fn.lower(params, jax.ShapeDtypeStruct((B, width), jnp.int32, sharding=rows),
                        jax.ShapeDtypeStruct((B, width), jnp.bool_, sharding=rows),
                        jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))).compile()
    m = _memory(compiled)
    _report("sampler", m)
    m_ = cfg.model
    kv = B * (width + C) * m_.num_layers * 2 * m_.num_key_value_heads * m_.head_dim * 2 // DEVICES
    assert kv_cache_bytes(cfg, plan.mesh_shape) == kv  # 1.50 GiB
    assert m["argument"] == pytest.approx(2 * param_count(m_)["total"] / DEVICES, rel=0.01)  # the bf16 params
    assert kv <= m["temp"] <= 3 * kv  # 4.33 GiB: the cache, a second cache-sized buffer, the prefill's scores
    cache_dims = sorted([m_.num_layers, B // DEVICES, width + C, m_.num_key_value_heads, m_.head_dim])
    whole_dims = sorted([m_.num_layers, B, width + C, m_.num_key_value_heads, m_.head_dim])
    shapes = [sorted(int(d) for d in s.split(",")) for s in re.findall(r"bf16\[([\d,]+)\]", compiled.as_text())]
    assert cache_dims in shapes and whole_dims not in shapes
    planned = need(cfg, DEVICES, backend="gpu")["rollout"]
    assert planned["temporaries"] == pytest.approx(m["temp"], rel=0.15)  # 4.16 vs 4.33 GiB
    resident = step_memory["argument"]  # params, master, Adam moments and the reference stay on the device
    assert resident - m["argument"] + m["peak"] <= h200.hbm_bytes


def test_the_old_and_reference_logps_compile_in_chunks(grpo_8b, step_memory):
    """The rollout's per-token log-probs of the 64 rows (the old policy's or the reference's params, bf16
    ZeRO-3): the chunked path never holds a row block's whole fp32 logits (8 rows × 1536 × 128256 × 4 =
    5.9 GiB per device), the program stays below the step's peak, and with the state it fits."""
    cfg, plan, params, h200 = grpo_8b
    B, t = cfg.training.batch_size, cfg.training.seq_len
    fn = jax.jit(lambda *a: rollout_token_logps(plan, *a))

    def arr(dtype):
        return jax.ShapeDtypeStruct((B, t), dtype, sharding=plan.batch_sharding)

    compiled = fn.lower(params, arr(jnp.int32), arr(jnp.int32), arr(jnp.float32), arr(jnp.int32),
                        arr(jnp.int32)).compile()
    m = _memory(compiled)
    _report("log-probs", m)
    whole_logits = (B // DEVICES) * t * cfg.model.vocab_size * np.dtype(np.float32).itemsize
    assert m["temp"] < whole_logits  # 4.13 GiB: a layer's attention scores and the gathered head, no logits
    assert m["output"] == pytest.approx(B * t * 4 / DEVICES, rel=0.01)  # fp32 [B, t] over the data axes
    assert m["peak"] < step_memory["peak"]
    assert step_memory["argument"] - m["argument"] + m["peak"] <= h200.hbm_bytes


def _sampler(plan, cfg, mesh, params):
    """The rollout's sampler compiled for ``params`` (ShapeDtypeStructs with shardings on ``mesh``)."""
    B, width, C = cfg.training.batch_size, grpo_prompt_length(cfg), cfg.posttrain.max_completion_length
    fn = make_generator(plan.family, cfg.model, C, Sampling(temperature=1.0), eos_id=1, pad_id=0, mesh=mesh,
                        param_specs=jax.tree.map(lambda p: p.sharding.spec, params))
    rows = NamedSharding(mesh, logical_to_spec(("batch", None), RULES))
    return fn.lower(params, jax.ShapeDtypeStruct((B, width), jnp.int32, sharding=rows),
                    jax.ShapeDtypeStruct((B, width), jnp.bool_, sharding=rows),
                    jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))).compile()


def test_the_decode_layout_gathers_no_weights_per_token(grpo_8b, step_memory):
    """posttrain.rollout_layout=decode (the default): the ZeRO-3 params (fsdp 8) resharded once into tp 8
    (a host's devices, the 8 kv heads), then decoded. Measured: the reshard moves 1.87 GiB a device
    (all-to-alls; the bf16 params / 8) a layer at a time, with 0.12 GiB of temporaries (under one layer's
    0.41 GiB); a decode step's collectives are
    0.032 GiB of tp all-reduces (activations), against 13.98 GiB of all-gathers on the training layout;
    the sampler's temporaries 3.94 GiB (the flash-decoding kernel's); the rollout's peak (state + decode copy + sampler) fits an
    H200 and is the planner's within 10%."""
    cfg, plan, params, h200 = grpo_8b
    tp = rollout_tp(cfg, DEVICES, h200.devices_per_host)
    dmesh = decode_mesh(plan.mesh, tp)
    reshard, specs = make_reshard(params, dmesh)
    rc = reshard.lower(params).compile()
    moved = sum(t["bytes"] for t in hlo.collective_totals(rc.as_text()).values())
    planned = need(cfg, DEVICES, backend="gpu")["rollout"]
    copy = _memory(rc)["output"]
    _report("reshard", _memory(rc))
    assert tp == 8 and copy == pytest.approx(planned["decode_copy"], rel=0.01)  # 1.87 GiB
    assert moved <= 1.2 * copy
    assert _memory(rc)["temp"] <= 0.25 * GiB  # 0.12 GiB: a layer at a time (1.59 GiB moving the whole tree)
    dparams = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(dmesh, s)),
                           params, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    decode, training = _sampler(plan, cfg, dmesh, dparams), _sampler(plan, cfg, plan.mesh, params)
    per_step = {name: hlo.decode_loop_collectives(c.as_text()) for name, c in (("decode", decode), ("training", training))}
    print("\nper decode step:", {n: {k: round(v["bytes"] / GiB, 4) for k, v in t.items()} for n, t in per_step.items()})
    assert sum(t["bytes"] for t in per_step["decode"].values()) <= 0.05 * GiB  # 0.032 GiB
    assert per_step["decode"].get("all-gather", {}).get("bytes", 0) < 2**20
    assert per_step["training"]["all-gather"]["bytes"] > 10 * GiB  # 13.98 GiB: every layer gathered per token
    m = _memory(decode)
    _report("decode-layout sampler", m)
    resident = step_memory["argument"]  # the train state stays on the device beside the decode copy
    peak = resident + max(_memory(rc)["temp"] + copy, m["peak"])
    assert planned["total"] == pytest.approx(peak, rel=0.10)
    assert peak <= h200.hbm_bytes


def _check_rollout_programs(fc, cfg) -> dict:
    """The rollout programs of a ``--compile-for`` result: a reshard moving at most 1.2× the decode copy, a
    sampler with at most 0.05 GiB of collectives per decode step, the run's peak the planner's within 10%."""
    programs = {r.name: r for r in fc.rollout}
    assert list(programs) == ["reshard", "sampler", "log-probs"]
    reshard, sampler = programs["reshard"], programs["sampler"]
    assert sum(c["bytes"] for c in reshard.collectives.values()) <= 1.2 * reshard.memory["output"]
    assert sum(c["bytes"] for c in sampler.per_decode_step.values()) <= 0.05 * GiB
    planned = need(cfg, DEVICES, backend="gpu")
    assert planned["rollout"]["total"] == pytest.approx(max(r.phase_peak for r in fc.rollout), rel=0.10)
    assert planned["total"] == pytest.approx(fc.run_peak, rel=0.10) and fc.fits
    return programs


def test_compile_for_a_grpo_config_compiles_the_rollout_programs(grpo_8b, fleet_8b):
    """``--compile-for h200x8`` on the 8B GRPO config (ZeRO-3 over fsdp 8): besides the step, the reshard
    (1.87 GiB moved, peak 3.91 GiB), the sampler on the decode layout (32.5 MiB of all-reduce per decode
    step; 20.77 GiB with the state) and the log-probs (19.55 GiB with the state); the report prints them."""
    cfg = grpo_8b[0]
    programs = _check_rollout_programs(fleet_8b, cfg)
    assert programs["sampler"].phase_peak < fleet_8b.peak  # the step (28.90 GiB) is the run's peak
    text = report.text(fleet_8b)
    assert "GRPO rollout programs" in text and "per decode step: all-gather" in text


def test_compile_for_zero1_tp2_training_decodes_at_tp8():
    """ZeRO-1 over fsdp 4 × tp 2 training: the reshard slices and permutes into tp 8 (1.87 GiB), and a
    decode step moves 32.5 MiB of activations, as from ZeRO-3."""
    cfg = load_config(os.path.join(ROOT, "configs/bench/llama3_8b.yaml"),
                      GRPO_8B + ["parallel.zero_stage=1", "parallel.tensor_parallel_size=2", "parallel.data_parallel_size=-1"])
    fc = fleet.compile_for(cfg, target.get_target("h200"), DEVICES, keep_hlo=False)
    programs = _check_rollout_programs(fc, cfg)
    assert "all-gather" not in programs["reshard"].collectives
