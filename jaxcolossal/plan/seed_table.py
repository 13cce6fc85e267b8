"""Colossal-AI's published benchmark rows beside the planner's predictions and its own choice."""

from __future__ import annotations

import copy
import dataclasses
import os

from jaxcolossal.config import ConfigError, load_config
from jaxcolossal.plan.cost import Layout, predict
from jaxcolossal.plan.devices import DEVICES
from jaxcolossal.plan.search import _bytes, search

SEED_TABLE = (
    # (row, preset, device, devices, global batch, parallel overrides or None, published figure)
    ("7B, 8×H200, ZeRO-2 dp8, 36 per DP", "llama2_7b", "h200", 8, 288,
     dict(data_parallel_size=8, tensor_parallel_size=1, pipeline_parallel_size=1, zero_stage=2),
     (17.13, 534.18)),
    ("70B, 16×H200, ZeRO-2 dp16, 2 per DP (batch assumed)", "llama3_70b", "h200", 16, 32,
     dict(data_parallel_size=16, tensor_parallel_size=1, pipeline_parallel_size=1, zero_stage=2),
     (3.27, 469.1)),
    ("7B, B200, ZeRO-1 dp2 tp2 pp4 (2·2·4 = 16 devices), 36 per DP (batch assumed)", "llama2_7b", "b200", 16, 72,
     dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=4, zero_stage=1), None),
    ("70B, 16×B200, 2 per DP (batch assumed)", "llama3_70b", "b200", 16, 32, None, None),
)
"""Colossal-AI's published benchmark rows (its README; docs/planner.md): seq 4096, bf16, activation
checkpointing. The published figures are (samples/s, TFLOPS/GPU in Colossal-AI's ``8N`` convention,
which counts the recomputation); ``None`` where we have no figure. The 70B rows use the
``llama3_70b`` preset (Colossal-AI's 70B runs were LLaMA-2 70B: 128k vs 32k vocabulary)."""


def seed_table(efficiency: float = 0.45) -> str:
    """The planner's prediction for each row of :data:`SEED_TABLE` beside the published figure, and
    the layout it prefers on the same model and devices with its own prediction (markdown)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = ["| row | published | predicted for the row's layout | planner's choice |",
             "|---|---|---|---|"]
    for row, preset, dev_name, n, batch, par, published in SEED_TABLE:
        device = DEVICES[dev_name]
        cfg = load_config(os.path.join(root, "configs", "bench", f"{preset}.yaml"),
                          overrides=["training.seq_len=4096", f"training.batch_size={batch}", "training.micro_batch_size=0",
                                     "model.remat=full", "training.gradient_accumulation_steps=1"])

        def show(lay: Layout) -> str:
            fit = "" if lay.fits else f"; **does not fit**: {_bytes(lay.need['total'])} > {_bytes(0.9 * device.memory)}"
            return (f"{lay.tokens_per_s / 4096:,.2f} samples/s, {lay.tflops:,.0f} TFLOPS, MFU {lay.mfu:.1%}, "
                    f"{_bytes(lay.need['total'])}{fit}")

        mine = "—"
        if par is not None:
            c = copy.deepcopy(cfg)
            c.parallel = dataclasses.replace(c.parallel, **par)
            if par["pipeline_parallel_size"] > 1:
                c.parallel.num_microbatches = max(par["pipeline_parallel_size"],
                                                  batch // par["data_parallel_size"] // 2)
            try:
                mine = show(predict(c, n, device, efficiency))
            except ConfigError as e:
                mine = f"refused: {e}"
        layouts, _ = search(cfg, n, device, efficiency)
        best = next((lay for lay in layouts if lay.fits), None)
        choice = f"{best.strategy()}: {show(best)}" if best else "no layout fits"
        pub = (f"{published[0]:g} samples/s, {published[1]:g} TFLOPS (8N) = {published[1] * 6 / 8:,.0f} (6N)"
               if published else "(no figure in our references)")
        lines.append(f"| {row} | {pub} | {mine} | {choice} |")
    lines.append(f"(TFLOPS per device in the 6N + attention convention, MFU against the bf16 peak; Colossal-AI's "
                 f"8N convention counts the recomputation, so its figures are shown converted to 6N too; efficiency "
                 f"{efficiency:g} of the peak; predictions as in docs/planner.md)")
    return "\n".join(lines)
