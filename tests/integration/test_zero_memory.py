"""Per-device model-state bytes match the ZeRO paper's (docs/zero.md) ZeRO formulas within 5%.

Bytes per parameter: fp32 mode p=4, g=4, K=8 (Adam m, v); bf16 mode p=2, g=4 (gradients are
accumulated and reduced in fp32), K=12 (fp32 master + m + v). Params and optimizer state are
measured from the arrays' shards on device 0; the gradient buffer from its ZeRO spec.
"""

import math
import os

import jax
import pytest
from tiny import tiny_config

from jaxcolossal import metrics as mx
from jaxcolossal.config import load_config
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.train.report import memory_report
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import BYTES_PER_PARAM, init_state, make_plan


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_memory_matches_zero_formula(zero_stage, precision):
    cfg = tiny_config({"data_parallel_size": 8, "zero_stage": zero_stage},
                      precision=None if precision == "fp32" else precision)
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    tx = build_optimizer(cfg.training)
    state = init_state(plan, tx, key=jax.random.key(0))
    got = mx.model_state_bytes(state, plan.specs.grads, plan.param_shapes, plan.mesh_shape)
    psi = sum(math.prod(s) for s in jax.tree.leaves(plan.param_shapes, is_leaf=lambda x: isinstance(x, tuple)))
    want = mx.zero_formula_bytes(psi, 8, zero_stage, **BYTES_PER_PARAM[precision])
    for key in ("params", "grads", "optimizer"):
        assert got[key] == pytest.approx(want[key], rel=0.05), (key, got[key], want[key])
    # and the stage really shrinks what it should
    if zero_stage >= 1:
        assert got["optimizer"] < BYTES_PER_PARAM[precision]["K"] * psi / 4


def test_memory_report_formula_counts_pipeline_stages():
    """The printed table compares against Ψ per model-parallel rank: with pp 2 × tp 2 each device
    holds about a quarter of the layers' parameters before ZeRO (configs/llama_tiny_3d.yaml)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "configs", "llama_tiny_3d.yaml"))
    plan = make_plan(cfg, make_mesh(cfg.parallel))
    state = init_state(plan, build_optimizer(cfg.training, plan), key=jax.random.key(0))
    text, numbers = memory_report(plan, state)
    for key in ("params", "grads", "optimizer"):
        got, want = numbers["measured"][key], numbers["formula"][key]
        assert got == pytest.approx(want, rel=0.01), (key, got, want, text)
    assert "pp=2" in text
