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

import math
import re

import jax
import numpy as np
import pytest
from tiny import assert_params_match, random_batches, run_steps, setup, tiny_config

from jaxcolossal.aot import hlo

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


def _defs(lines):
    """name -> defining line, for one computation's lines."""
    out = {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if m:
            out[m.group(1)] = line
    return out


def _rounded_from_bf16(comps, comp, name, depth=0):
    """Whether value ``name`` of computation ``comp`` is a bf16 value widened to f32: a convert
    from bf16, through bitcasts/copies/fusions whose root is one."""
    defs = _defs(comps[comp])
    line = defs.get(name)
    if line is None or depth > 6:
        return False
    rhs = line.split(" = ", 1)[1]
    if rhs.startswith("bf16["):
        return True
    m = re.search(r"\b(convert|bitcast|copy|reshape)\(%?([\w.\-]+)\)", rhs)
    if m and rhs.split("(", 1)[0].split()[-1] in ("convert", "bitcast", "copy", "reshape"):
        return _rounded_from_bf16(comps, comp, m.group(2), depth + 1)
    call = re.search(r"\bfusion\(.*calls=%?([\w.\-]+)", rhs)
    if call:
        callee = call.group(1)
        root = next(l for l in comps[callee] if l.strip().startswith("ROOT"))
        rname = re.match(r"\s*ROOT %?([\w.\-]+) = ", root).group(1)
        if re.search(r"\bparameter\(", root):
            return False
        inner = _rounded_from_bf16(comps, callee, rname, depth + 1)
        if inner:
            return True
        m = re.search(r"= f32\[[\d,]*\]\S* convert\(%?([\w.\-]+)\)", root)
        if m:  # the fusion's root converts one of its parameters: what came in?
            arg = _defs(comps[callee]).get(m.group(1), "")
            return " bf16[" in arg or "= bf16[" in arg
    return False


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_bf16_gradients_are_reduced_in_fp32(zero_stage):
    """Every gradient reduction moves fp32 values computed in fp32, not bf16 values widened to
    f32: ZeRO-1 sums the per-shard fp32 gradients once per step; ZeRO-2/3 reduce each layer's
    weight gradient inside the backward scan, right after its fp32 contraction
    (:mod:`jaxcolossal.models.layers.linear`). XLA's CPU backend has no bf16 collectives and widens them
    to f32, so the test traces each operand back to its producer rather than reading the dtype."""
    text, _ = compiled_text(zero_stage, precision="bf16")
    comps, entry = hlo.computations(text)
    grads = [c for name in comps for c in hlo.collectives_in(comps, name, set())
             if c.kind in ("all-reduce", "reduce-scatter", "all-to-all") and c.max_elements >= GRAD_ELEMENTS]
    assert grads
    for c in {c.line: c for c in grads}.values():
        assert {d for d, _ in c.shapes} <= {"f32"}, c.line[:160]
        args = re.search(r"(?:all-reduce|reduce-scatter|all-to-all)\((.*?)\)", c.line).group(1)
        for arg in re.findall(r"%([\w.\-]+)", args):
            assert not _rounded_from_bf16(comps, c.computation, arg), (zero_stage, arg, c.line[:200])
    if zero_stage != 1:
        return
    comps, entry, (body, _) = microbatch_loop(text)
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


def _uses_in_body(lines):
    """name -> names of the instructions of one computation that read it."""
    users = {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = [^(]*?\b[\w\-]+\((.*)", line)
        if not m:
            continue
        for arg in re.findall(r"%([\w.\-]+)", m.group(2).split("calls=")[0].split("to_apply=")[0]):
            users.setdefault(arg, []).append(m.group(1))
    return users


def _gathers_feed_dots(comps, body):
    """For each large all-gather in loop ``body``: whether its result reaches a matmul (a dot, or a
    fusion that holds one) within the same iteration."""
    lines = comps[body]
    defs = _defs(lines)
    users = _uses_in_body(lines)

    def has_dot(name):
        line = defs[name]
        if re.search(r" dot\(", line):
            return True
        call = re.search(r"calls=%?([\w.\-]+)", line)
        return bool(call) and any(" dot(" in l for l in comps.get(call.group(1), []))

    out = []
    for name, line in defs.items():
        if re.search(r" all-gather(-start)?\(", line) and hlo.result_shapes(line) and \
                max(math.prod(s) for _, s in hlo.result_shapes(line)) >= GRAD_ELEMENTS:
            seen, todo, feeds = set(), [name], False
            while todo:
                n = todo.pop()
                for u in users.get(n, []):
                    if u not in seen:
                        seen.add(u)
                        feeds = feeds or has_dot(u)
                        todo.append(u)
            out.append(feeds)
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_zero3_prefetch_gathers_the_next_layer_ahead(overlap):
    """``parallel.overlap`` under ZeRO-3 (remat full): in the layer loops of the compiled step, every
    weight all-gather's result goes to the loop carry, for the next iteration, and reaches no
    matmul of the iteration that issues it, so the gather can run while that layer computes
    (``parallel/layer_scan.py::prefetched_scan``). Without overlap the gathered weights feed the same
    iteration's matmuls."""
    cfg = tiny_config({"zero_stage": 3, "data_parallel_size": 8, "overlap": overlap}, model={"remat": "full"},
                      training={"batch_size": 32})
    plan, tx, state, step = setup(cfg)
    x = random_batches(cfg, 1)[0]
    batch = {"inputs": jax.device_put(x[:, :-1], plan.batch_sharding),
             "targets": jax.device_put(x[:, 1:], plan.batch_sharding)}
    comps, entry = hlo.computations(step.lower(state, batch).compile().as_text())
    loops = [body for name in comps for body, _ in hlo.while_loops(comps, name)]
    per_loop = {body: _gathers_feed_dots(comps, body) for body in set(loops)}
    per_loop = {b: v for b, v in per_loop.items() if v}  # the loops that gather weights
    assert len(per_loop) >= 2, per_loop  # the forward and the backward layer loops
    if overlap:
        assert not any(any(v) for v in per_loop.values()), per_loop
    else:
        assert all(any(v) for v in per_loop.values()), per_loop


def test_zero3_prefetch_equals_no_prefetch():
    """The prefetched layer scan is the same computation: 3 fp32 steps with ``overlap`` on and off
    give the same losses and grad norms (rtol 1e-5; observed bit-equal) and parameters."""
    out = {}
    for overlap in (False, True):
        cfg = tiny_config({"zero_stage": 3, "data_parallel_size": 8, "overlap": overlap}, model={"remat": "full"})
        out[overlap] = run_steps(cfg, jax.devices(), steps=3)
    (s0, m0, _), (s1, m1, _) = out[False], out[True]
    np.testing.assert_allclose([[m["loss"], m["grad_norm"]] for m in m1], [[m["loss"], m["grad_norm"]] for m in m0],
                               rtol=1e-5)
    assert_params_match(s1.params, s0.params)
