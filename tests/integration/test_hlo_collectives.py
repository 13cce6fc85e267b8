"""What XLA emitted for the train step, read from the compiled HLO (8 CPU devices, dp only).

With k = 4 accumulation microbatches:
* ZeRO 0/1: no gradient-sized collective inside the microbatch loop; the gradients are
  all-reduced once per step, after it.
* ZeRO 2/3: the persistent gradient buffer (the loop carry) is 1/N of each leaf per device, and
  each microbatch's gradient is reduced into it inside the loop. On the CPU backend this is an
  all-reduce followed by a dynamic-slice of the device's part (XLA's CPU backend has no
  reduce-scatter creator pass; the GPU backend rewrites the pair into a reduce-scatter).
* bf16 compute: every gradient reduction runs in fp32.
"""

import re

import jax
import pytest

from jaxcolossal import hlo
from tiny import random_batches, setup, tiny_config

K = 4


def compiled_text(zero_stage, precision=None):
    cfg = tiny_config({"zero_stage": zero_stage, "data_parallel_size": 8}, precision=precision,
                      training={"gradient_accumulation_steps": K, "batch_size": 32})
    plan, tx, state, step = setup(cfg)
    x = random_batches(cfg, 1)[0]
    batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
             "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
    return step.lower(state, batch).compile().as_text(), plan


def microbatch_loop(text):
    comps, entry = hlo.computations(text)
    loops = hlo.while_loops(comps, entry)
    assert len(loops) == 1, "expected exactly one top-level loop: the microbatch scan"
    return comps, entry, loops[0]


def carry_grad_shapes(carry, plan):
    """The gradient buffers in the loop carry: after the counter and the loss, in leaf order."""
    shapes = [tuple(int(x) for x in dims.split(",") if x) for _, dims in hlo._SHAPE.findall(carry)]
    n = len(jax.tree.leaves(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple)))
    return shapes[2:2 + n]


def shard_shapes(plan, specs, leading=()):
    mesh_shape = plan.mesh_shape
    out = []
    for shape, spec in zip(jax.tree.leaves(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple)),
                           jax.tree.leaves(specs)):
        dims = []
        for size, entry in zip(shape, tuple(spec) + (None,) * len(shape)):
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            n = 1
            for a in names:
                n *= mesh_shape[a]
            dims.append(size // n)
        out.append(tuple(leading) + tuple(dims))
    return out


GRAD_ELEMENTS = 64 * 64  # smaller than every matrix of the tiny model, bigger than any scalar


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_zero01_reduce_gradients_once_per_step(zero_stage):
    text, plan = compiled_text(zero_stage)
    comps, entry, (body, carry) = microbatch_loop(text)
    inside = [c for c in hlo.collectives_in(comps, body) if c.max_elements >= GRAD_ELEMENTS]
    assert inside == [], [c.line[:120] for c in inside]
    outside = [c for c in hlo.top_level_collectives(comps, entry)
               if c.kind == "all-reduce" and c.max_elements >= GRAD_ELEMENTS]
    assert outside, "the gradient all-reduce after the loop is missing"
    # the persistent per-shard buffer is full-size on each device, e.g. f32[1, 256, 64] for the embedding
    assert carry_grad_shapes(carry, plan) == shard_shapes(plan, plan.specs.base, leading=(1,))
    assert carry_grad_shapes(carry, plan)[0] == (1, 256, 64)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_zero23_sharded_persistent_buffer_and_reduction_per_microbatch(zero_stage):
    text, plan = compiled_text(zero_stage)
    comps, entry, (body, carry) = microbatch_loop(text)
    # every gradient buffer is 1/8 of its leaf per device, e.g. the embedding [256, 64] -> [256, 8]
    got = carry_grad_shapes(carry, plan)
    assert got == shard_shapes(plan, plan.specs.grads)
    assert got[0] == (256, 8)
    reductions = [c for c in hlo.collectives_in(comps, body)
                  if c.kind in ("all-reduce", "reduce-scatter") and c.max_elements >= GRAD_ELEMENTS]
    assert reductions, "each microbatch's gradient must be reduced into the sharded buffer"
    if any(c.kind == "all-reduce" for c in reductions):  # CPU form: all-reduce + dynamic-slice
        assert "dynamic-slice" in "\n".join(comps[body]) or any(
            "dynamic-slice" in "\n".join(v) for v in comps.values())


def test_bf16_gradients_are_reduced_in_fp32():
    text, _ = compiled_text(1, precision="bf16")
    comps, entry, (body, _) = microbatch_loop(text)
    grads = [c for c in hlo.top_level_collectives(comps, entry)
             if c.kind in ("all-reduce", "reduce-scatter") and c.max_elements >= GRAD_ELEMENTS]
    assert grads
    for c in grads:
        assert {d for d, _ in c.shapes} <= {"f32"}, c.line[:160]
    # while the parameter all-gather after the ZeRO-1 update gathers bf16 values: each rank casts
    # its master shard first. (XLA's CPU backend has no bf16 collectives, so its float
    # normalization widens the gather itself to f32 around already-rounded bf16 values; on GPU
    # the all-gather is bf16.)
    gathers = [c for c in hlo.top_level_collectives(comps, entry)
               if c.kind == "all-gather" and c.max_elements >= GRAD_ELEMENTS]
    assert gathers
    for c in gathers:
        if {d for d, _ in c.shapes} == {"bf16"}:
            continue
        operand = re.search(r"all-gather\(([^)]*)\)", c.line).group(1).split()[-1]
        producer = next(l for l in comps[entry] if l.strip().startswith(operand + " "))
        callee = re.search(r"calls=%?([\w.\-]+)", producer).group(1)
        assert any("bf16[" in l and "convert(" in l for l in comps[callee]), producer
