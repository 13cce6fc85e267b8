"""``python scripts/train.py --compile-for FLEET``, as a user runs it: the main job's config with the
GPU kernels, a 70B layout that does not fit, and bad input refused in one line before compiling."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def run(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"}  # the CLI sets it
    return subprocess.run([sys.executable, "scripts/train.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_main_jobs_step_compiled_for_h200s_holds_fused_adamw_and_cudnn_attention(tmp_path):
    out = tmp_path / "report.json"
    r = run("--compile-for", "h200x8", "--json", str(out), "training.optimizer=fused_adamw",
            "model.attention_impl=cudnn", "precision.bf16=true")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("compiled for 8 × NVIDIA H200") and lines[1] == "mesh fsdp=4 tp=2"
    assert lines[-1].startswith("fits, ") and lines[-1].endswith(" GiB free")
    assert any(line.lstrip().startswith("reduce-scatter") for line in lines)
    got = json.loads(out.read_text())
    assert got["fits"] and got["memory"]["peak"] == (got["memory"]["argument"] + got["memory"]["output"]
                                                    - got["memory"]["alias"] + got["memory"]["temp"])
    calls = got["custom_calls"]
    assert calls["__gpu$xla.gpu.triton"] == 12  # fused AdamW: one Triton kernel per parameter leaf
    assert calls["__cudnn$fmhaSoftmax"] >= 4 and calls["__cudnn$fmhaSoftmaxBackward"] >= 4
    assert got["collectives"]["reduce-scatter"]["count"] >= 1
    assert 0 <= got["exposure"]["hidden_fraction"] <= 1 and got["compile_s"] > 0


def test_a_70b_under_zero1_over_16_h200s_does_not_fit_and_exits_1():
    r = run("--config", "configs/bench/llama3_70b.yaml", "--compile-for", "h200x16", "parallel.zero_stage=1")
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("does not fit by ") and last.endswith(" GiB")
    assert float(last.split()[4]) > 100  # ZeRO-1 keeps 70.6e9 bf16 params (131 GiB) on every device


def test_bad_fleets_get_one_line_and_exit_2():
    for args, message in ((("--compile-for", "h300x8"), "unknown GPU target 'h300'"),
                          (("--compile-for", "h200x16", "parallel.data_parallel_size=4"), "16"),  # 4 × tp 2
                          (("--compile-for", "h200x8", "--devices-per-host", "3"), "do not split into hosts")):
        r = run(*args, timeout=120)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        err = [line for line in r.stderr.strip().splitlines() if line.startswith("config error")]
        assert len(err) == 1 and message in err[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not r.stdout.strip()


def test_a_fleet_the_sizes_do_not_fit_is_told_the_fleet_that_fits_not_simulated_devices():
    # issue 45 item 15a: the advice was "--devices 8 (simulated CPU devices)", which --compile-for ignores
    for extra in ((), ("--dry-run",)):
        r = run("--compile-for", "h200x7", "parallel.data_parallel_size=4", *extra, timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        err = r.stderr.strip()
        assert err.endswith("set parallel.data_parallel_size=-1 parallel.tensor_parallel_size=1 to use them all, "
                            "or compile for 8 GPUs: --compile-for h200x8"), err
        assert "--devices" not in err and "Traceback" not in err
