"""Smoke tests: scripts/benchmark.py and scripts/compare.py run on tiny sizes and print what they
claim (the markdown row, the ratios, the JSON), and their figures are consistent with each other.

Each script runs as a subprocess, as a user would start it (its own simulated devices)."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(*argv, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script simulates its own devices
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", argv[0]), *argv[1:]], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    return p.stdout, json.loads(last)


def test_benchmark_tiny_prints_row_and_json(tmp_path):
    out_file = tmp_path / "bench.json"
    text, r = run_script("benchmark.py", "--model", "tiny", "--plan", "zero=2,dp=2", "--model-overrides",
                         "num_layers=2,hidden_size=64", "--seq", "32", "--batch-per-dp", "2", "--warmup", "1",
                         "--steps", "2", "--out", str(out_file))
    lines = text.splitlines()
    header = next(l for l in lines if l.startswith("| hardware |"))
    for col in ("devices", "model", "strategy", "batch/DP", "seq", "samples/s", "TFLOPS/dev 6N+attn",
                "TFLOPS/dev Colossal 2N(3+r)", "MFU", "peak mem/dev"):
        assert col in header
    row = next(l for l in lines if l.startswith("| cpu"))
    assert "| 2 | tiny* (" in row and "zero2 dp2" in row and "(compiled)" in row and "| n/a |" in row
    assert json.loads(out_file.read_text()) == r
    assert (r["num_devices"], r["strategy"], r["batch_per_dp"], r["global_batch"], r["seq_len"]) == (2, "zero2 dp2", 2, 4, 32)
    assert r["mfu"] is None and r["peak_memory_source"] == "compiled" and r["peak_memory_bytes"] > 0
    assert r["samples_per_s"] == pytest.approx(4 / r["step_s_median"])
    tokens = 4 * 32
    assert r["tflops_6n"] == pytest.approx(r["flops_per_token"]["6N+attn"] * tokens / r["step_s_median"] / 2 / 1e12)
    assert r["tflops_colossal"] == pytest.approx(r["flops_per_token"]["colossal"] * tokens / r["step_s_median"] / 2 / 1e12)
    assert len(r["step_s_all"]) == 2 and math.isfinite(r["loss_last"])
    assert abs(r["loss_first"] - math.log(256)) < 0.5  # random tokens over a byte vocabulary


def test_benchmark_rejects_bad_plan():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "benchmark.py"), "--plan", "zero=2,bogus=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--plan key 'bogus'" in p.stderr


def test_compare_all_parts_tiny():
    text, r = run_script("compare.py", "--part", "a,b,c,d", "--layers", "2", "--hidden", "32", "--heads", "4",
                         "--vocab", "128", "--batch", "2", "--seq", "16", "--repeats", "1", "--steps", "2",
                         "--warmup", "1", "--compile-repeats", "1", "--zero-hidden", "32", "--zero-layers", "1",
                         "--zero-stages", "1,3")
    assert "overhead ratio (ours / plain) =" in text
    assert "throughput ratio (ours / torch_" in text
    assert "compile ratio (32 / 4 layers) =" in text
    for part in "abcd":
        assert part in r
    # a: the same math as plain JAX + optax
    assert r["a"]["max_abs_dloss"] < 1e-5 and r["a"]["ratio"] > 0
    # the same FLOPs except the non-finite guard: a select per state element keeps the old state when a
    # step is NaN/inf (measured 11 FLOPs per parameter; 0.5% of the step at compare.py's default size)
    cost = r["a"]["compiled_cost"]
    assert 0 < cost["ours"]["flops"] - cost["plain"]["flops"] <= 16 * r["a"]["num_params"]
    # b: transformers computes the same first loss from the same weights
    assert r["b"]["first_loss_torch"] == pytest.approx(r["b"]["first_loss_ours"], abs=1e-4)
    assert r["b"]["ratio"] > 0 and r["b"]["torch_threads"] >= 1 and "jaxcolossal" in r["b"]["tokens_per_s"]
    # c
    assert len(r["c"]["compile_s_4"]) == 1 and r["c"]["ratio"] > 0
    # d: per-device bytes on the ZeRO formulas (+ optax's step counters); ZeRO-1 moves 2Ψ per step
    # (reduce-scatter in CPU form + all-gather), ZeRO-3 between 2Ψ and 3Ψ (docs/performance.md)
    rows = r["d"]["rows"]
    assert [row["zero"] for row in rows] == [1, 3]
    for row in rows:
        assert all(v == pytest.approx(1.0, rel=1e-3) for v in row["bytes_ratio"].values()), row["bytes_ratio"]
    assert rows[0]["volume_over_psi"] == pytest.approx(2.0, rel=0.01), rows[0]["volume_by_kind_over_psi"]
    assert rows[0]["volume_by_kind_over_psi"]["all-reduce (sliced)"] == pytest.approx(1.0, rel=0.01)
    assert 2.0 < rows[1]["volume_over_psi"] <= 3.05
