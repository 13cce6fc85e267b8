"""The planner's memory model against XLA's GPU compiler: the predicted per-device peak
(:func:`jaxcolossal.memory.budget.need`, ``backend="gpu"``) against the step compiled for 8 H200s
(arguments + outputs − donated + temporaries), for 11 of the 36 layouts of
``scripts/plan_vs_compiler.py``'s sweep. The whole sweep, and the full-size rows (7B to 70B), are in
docs/planner.md."""

import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
GPU_CASES = [0, 5, 10, 12, 14, 16, 18, 21, 22, 33, 34]
"""Sweep rows: ZeRO 0–3, fp32 and bf16, remat none/full/dots, tp 2, GPipe, 1F1B over 2 and 4
stages, interleaved, circular GPipe, from the tiny LLaMA to the medium one."""


@pytest.mark.parametrize("row", GPU_CASES)
def test_predicted_peak_memory_is_within_10_percent_of_xla_gpu(row):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from plan_vs_compiler import SWEEP, measure  # heavy: a script (XLA_FLAGS at import), on sys.path only here
    finally:
        sys.path.pop(0)
    model, par, prec, remat, k = SWEEP[row]
    predicted, compiled, _ = measure(model, par, prec, remat, k, batch=16 if k == 1 else 8 * k, fleet_name="h200x8")
    assert abs(predicted - compiled) / compiled <= 0.10, (predicted, compiled)
