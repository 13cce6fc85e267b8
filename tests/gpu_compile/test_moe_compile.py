"""A mixture of experts on 8 compile-only H200s: Mixtral-8x7B's shape (two layers of it) with the
experts split over ep 8 compiles; its step exchanges tokens by all-to-all, as many bytes as the
planner says; the experts' grouped matmuls are in the program; and with a capacity factor the
planner's memory is within 10% of what XLA:GPU allocates."""

import os

import pytest

from jaxcolossal.aot import fleet, target
from jaxcolossal.config import load_config
from jaxcolossal.memory.budget import need
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
        assert need(cfg, 8, backend="gpu")["total"] == pytest.approx(fc.peak, rel=0.10)
