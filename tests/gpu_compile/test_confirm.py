"""Search, then confirm (``python -m jaxcolossal.plan ... --confirm K``), ``--dry-run --compile-for``,
and cuDNN attention inside a pipeline with tensor parallelism, all through XLA's GPU compiler."""

import os
import re
import subprocess
import sys

import pytest
from tiny import tiny_config

from jaxcolossal.aot import confirm as C
from jaxcolossal.aot import fleet, target
from jaxcolossal.config import ConfigError, attention_kernel
from jaxcolossal.plan.cli import main as plan_main
from jaxcolossal.plan.devices import DEVICES

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
ROW = re.compile(r"^\| (\d+|-) \| (zero\d dp\d+[^|]*) \| (\d+) \| ([\d.,]+) MB \| ([\d.,]+) MB \| ([+-][\d.]+)% \|")


def test_confirm_compiles_the_top_layouts_and_ranks_them_by_what_compiled(capsys):
    code = plan_main(["--config", os.path.join(ROOT, "configs/llama_tiny.yaml"), "--devices", "8", "--device", "h200",
                      "--confirm", "2"], confirm=C.report)
    assert code == 0
    out = capsys.readouterr().out
    tail = out[out.index("confirmed by XLA's GPU compiler"):]
    rows = [ROW.match(line) for line in tail.splitlines() if line.startswith("| ") and " MB |" in line]
    assert len(rows) == 2 and all(rows), tail
    for r in rows:  # the error column is (predicted - compiled) / compiled
        pred, comp = (float(r.group(i).replace(",", "")) for i in (4, 5))
        assert abs(float(r.group(6)) - (pred - comp) / comp * 100) < 0.5
    assert [r.group(1) for r in rows] == ["1", "2"]  # both fit 90% of an H200
    assert "run the best compiled: python scripts/train.py --config " in tail


def test_confirm_ranks_fitting_layouts_by_the_compiled_schedule():
    cfg = tiny_config({"data_parallel_size": -1})
    rows = C.confirm(cfg, 8, "h200", DEVICES["h200"], 3)
    fitting = [r for r in rows if r.fits]
    assert fitting and [r.step_s for r in fitting] == sorted(r.step_s for r in fitting)
    for r in fitting:
        assert r.step_s >= r.layout.compute_s and r.compiled > 0 and not r.error
        assert r.collectives  # predicted and compiled bytes per kind


def test_confirm_needs_a_compile_target():
    with pytest.raises(ConfigError, match="no GPU compile target for --device 'a100-40'"):
        C.target_for("a100-40")


def test_the_planner_without_the_command_line_has_no_confirm(capsys):
    code = plan_main(["--config", os.path.join(ROOT, "configs/llama_tiny.yaml"), "--devices", "8", "--confirm", "1"])
    assert code == 2 and "--confirm is offered by the command line" in capsys.readouterr().err


def test_dry_run_with_compile_for_prints_the_prediction_against_the_compiled_peak():
    env = {k: v for k, v in os.environ.items() if k != "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"}
    r = subprocess.run([sys.executable, "scripts/train.py", "--dry-run", "--compile-for", "h200x8"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("model      llama")  # the plan first
    last = r.stdout.strip().splitlines()[-1]
    m = re.match(r"memory per device: predicted ([\d.]+) MiB by the planner, compiled ([\d.]+) MiB \(([+-][\d.]+)%\)", last)
    assert m, last
    pred, comp = float(m.group(1)), float(m.group(2))
    assert abs(float(m.group(3)) - (pred - comp) / comp * 100) < 0.2


def test_cudnn_attention_inside_a_pipeline_runs_xlas_attention():
    """cuDNN's partitioner cannot run in the pipeline's partly manual shard_map (with the heads on tp,
    and with tp 1): the step compiles with XLA's attention there, and the memory model traces the same."""
    for tp, dp in ((2, 2), (1, 4)):
        cfg = tiny_config({"data_parallel_size": dp, "tensor_parallel_size": tp, "pipeline_parallel_size": 2,
                           "pipeline_schedule": "1f1b", "num_microbatches": 4}, "bf16", {"attention_impl": "cudnn"})
        fc = fleet.compile_for(cfg, target.get_target("h200"), 8)
        assert not any(k.startswith("__cudnn") for k in fc.custom_calls)
        assert attention_kernel(cfg, {"pp": 2, "tp": tp}) == "xla"
    assert attention_kernel(cfg, {"pp": 1, "tp": 2}) == "cudnn"
