"""Issue 45's observability items, without a training run: FLOP rates printed with the digits that
show them, MFU shown only on GPUs of a known peak (decided by the mesh's devices, not the default
backend), the profiler's step range and its trace calls, the device memory profile written when a
step runs out of memory, and the refusal of ``logging.wandb=true`` without the wandb package."""

import ast
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxcolossal import metrics as mx
from jaxcolossal.config import ConfigError, config_from_dict, parse_step_range
from jaxcolossal.errors import DependencyError, exit_status
from jaxcolossal.train import loop, profile, steps
from jaxcolossal.train.guard import StepWatchdog
from jaxcolossal.train.report import bar_fields, step_line
from jaxcolossal.train.run import Run
from jaxcolossal.train.profile import StepProfiler, save_memory_profile

H100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("tflops, text", [
    (41.234, "41.2 TFLOPS"), (989.4, "989 TFLOPS"), (1.0, "1.00 TFLOPS"), (1979.0, "1979 TFLOPS"),
    (0.512, "512 GFLOPS"), (0.00123, "1.23 GFLOPS"), (1.094e-4, "109 MFLOPS"), (1.23e-8, "0.0123 MFLOPS"),
    (0.0, "0 TFLOPS"), (float("nan"), "nan TFLOPS"),
])
def test_flop_rates_print_three_significant_digits(tflops, text):
    assert mx.flops_text(tflops) == text


def _perf(tflops, mfu=None):
    return {"tokens_per_s": 16647.2, "tflops_6n": tflops, "mfu": mfu}


def test_step_line_and_bar_show_the_rate_not_zeros():
    m = {"loss": 5.5547, "lr": 2e-4, "grad_norm": 3.0958}
    line = step_line(2, 6, m, _perf(0.00118))
    assert line == "step 2/6, loss 5.5547, lr 2.000e-04, grad_norm 3.0958, 16,647 tok/s, 1.18 GFLOPS"
    assert bar_fields(m, _perf(0.00118)) == {"loss": "5.555", "tok_s": "16647", "gflops": "1.18"}
    gpu = _perf(407.6, mfu=407.6e12 / 989e12)
    assert step_line(2, 6, m, gpu).endswith("16,647 tok/s, 408 TFLOPS, MFU 41.2%")
    assert bar_fields(m, gpu) == {"loss": "5.555", "tok_s": "16647", "tflops": "408", "mfu": "41.2%"}


def test_mfu_is_shown_on_gpus_of_a_known_peak_only(monkeypatch):
    assert mx.mfu_peak([H100]) == 989e12
    assert mx.mfu_peak([SimpleNamespace(platform="cuda", device_kind="NVIDIA H200")]) == 989e12
    assert mx.mfu_peak([SimpleNamespace(platform="gpu", device_kind="NVIDIA GeForce RTX 3090")]) is None
    assert mx.mfu_peak([SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")]) is None
    # the CPU mesh of a run: no MFU, whatever the default backend says
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    assert mx.mfu_peak(mesh) is None
    cfg = config_from_dict({}).model
    kw = dict(batch_size=8, seq_len=64, step_seconds=0.5, num_devices=1)
    assert mx.throughput(cfg, peak=mx.mfu_peak(mesh), **kw)["mfu"] is None
    gpu = mx.throughput(cfg, peak=mx.mfu_peak([H100]), **kw)
    assert gpu["mfu"] == pytest.approx(gpu["tflops_6n"] * 1e12 / 989e12)


def test_profile_steps_parse_and_must_end_by_max_steps():
    assert parse_step_range("3-5") == (3, 5) and parse_step_range(4) == (4, 4) and parse_step_range("") is None
    assert parse_step_range([3, 4, 5]) == (3, 5)
    for bad in ("5-3", "0", "x", [3, 5], True):
        with pytest.raises(ConfigError, match="logging.profile_steps"):
            parse_step_range(bad, "logging.profile_steps")
    assert config_from_dict({"logging": {"profile_steps": 4}}).logging.profile_steps == "4"
    with pytest.raises(ConfigError, match="training.max_steps=6, before step 8"):
        config_from_dict({"training": {"max_steps": 6}, "logging": {"profile_steps": "3-8"}})


def _traced(monkeypatch, profiler, steps, fail_at=None):
    calls = []
    monkeypatch.setattr(jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    monkeypatch.setattr(jax.profiler, "StepTraceAnnotation", lambda name, step_num: _Note(calls, step_num))
    try:
        for s in steps:
            with profiler.step(s, None) as out:
                if s == fail_at:
                    raise RuntimeError("boom")
                out.append(None)
    finally:
        profiler.close()
    return calls


class _Note:
    def __init__(self, calls, step):
        self.calls, self.step = calls, step

    def __enter__(self):
        self.calls.append(("step", self.step))

    def __exit__(self, *exc):
        return False


def test_the_trace_covers_the_chosen_steps_only(monkeypatch, tmp_path):
    d = str(tmp_path / "profile" / "r1")
    calls = _traced(monkeypatch, StepProfiler((3, 5), d), range(1, 7))
    assert calls == [("start", d), ("step", 3), ("step", 4), ("step", 5), ("stop",)]
    resumed = _traced(monkeypatch, StepProfiler((3, 5), d), range(5, 7))  # a run resumed at step 4
    assert resumed == [("start", d), ("step", 5), ("stop",)]
    assert _traced(monkeypatch, StepProfiler((3, 5), d, enabled=False), range(1, 7)) == []  # not process 0
    with pytest.raises(RuntimeError):  # a step that raises inside the range: the trace is still written
        _traced(monkeypatch, StepProfiler((3, 5), d), range(1, 7), fail_at=4)
    cfg = config_from_dict({"logging": {"run_dir": str(tmp_path), "profile_steps": "3-5"}})
    p = StepProfiler.for_run(cfg, "r1", enabled=True)
    assert (p.steps, p.log_dir) == ((3, 5), d)


def test_memory_profile_path_and_failure(monkeypatch, tmp_path):
    written = []
    monkeypatch.setattr(jax.profiler, "save_device_memory_profile", written.append)
    path = save_memory_profile(str(tmp_path), "r1", 7)
    assert path == written[0] == os.path.join(tmp_path, "profile", "r1", "memory_step7.prof")
    assert os.path.isdir(os.path.dirname(path))

    def fail(path):
        raise OSError("disk full")
    monkeypatch.setattr(jax.profiler, "save_device_memory_profile", fail)
    assert save_memory_profile(str(tmp_path), "r1", 7) is None  # never hides the out-of-memory error


def test_a_step_out_of_memory_writes_the_memory_profile(monkeypatch, tmp_path):
    """The loop's own path: a step that raises RESOURCE_EXHAUSTED gets the planner's explanation
    (which may fail on this fake plan and says so) and the memory profile of the run, then re-raises."""
    written = []
    monkeypatch.setattr(jax.profiler, "save_device_memory_profile", written.append)
    cfg = config_from_dict({"training": {"max_steps": 3}, "logging": {"run_dir": str(tmp_path), "log_every": 1,
                                                                      "progress_bar": False}})

    def step(state, batch):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")
    run = Run(cfg=cfg, plan=SimpleNamespace(cfg=cfg), state=SimpleNamespace(step=0), ckpt=None,
              loader=SimpleNamespace(batch=lambda s: None), evals=[], compiled=step, eval_step=None, compile_s=0.0,
              compiled_peak=0, metrics=mx.MetricsWriter(str(tmp_path), enabled=False), run_id="r1")
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        steps.run_steps(run, StepWatchdog(None), False)
    assert written == [os.path.join(tmp_path, "profile", "r1", "memory_step1.prof")]


def test_wandb_without_the_package_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    cfg = config_from_dict({"logging": {"wandb": True}})
    with pytest.raises(DependencyError) as e:
        loop.preflight(cfg)
    text, code = exit_status(e.value)
    assert code == 2 and "\n" not in text and "logging.wandb=true" in text and "pip install wandb" in text


def test_wandb_is_imported_only_when_enabled():
    out = subprocess.run([sys.executable, "-c", "import sys, jaxcolossal.train.loop, jaxcolossal.metrics; "
                          "print('wandb' in sys.modules)"], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.strip() == "False", out.stderr[-2000:]
    assert profile.profile_dir("runs/x", "r1") == os.path.join("runs/x", "profile", "r1")


def test_wandb_online_without_a_login_is_refused_in_one_line(tmp_path):
    """W&B's own refusal (no API key, online) becomes one config error naming the fixes (a subprocess:
    W&B's settings are read once per process, from a home with no login)."""
    pytest.importorskip("wandb")  # optional: the wandb extra
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "cfg"), JAX_PLATFORMS="cpu")
    code = ("from jaxcolossal import metrics as mx\nfrom jaxcolossal.errors import exit_status\n"
            f"try:\n    mx.WandbSink({str(tmp_path)!r}, 'r1', mode='online')\n"
            "except Exception as e:\n    print(exit_status(e))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         stdin=subprocess.DEVNULL)
    text, status = ast.literal_eval(out.stdout.strip().splitlines()[-1])  # the (line, exit code) printed
    assert status == 2 and "\n" not in text, out.stderr[-2000:]
    assert text.startswith("config error: logging.wandb=true: W&B could not start the run (")
    assert "wandb login" in text and "logging.wandb_mode=offline" in text
