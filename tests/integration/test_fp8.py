"""``precision.fp8``: the layers' projections in FP8 with current per-tensor scaling
(:func:`jaxcolossal.models.layers.linear.project_fp8`), emulated on the CPU: it tracks bf16, a sharded run
equals one device, the resumed run equals the uninterrupted one bit for bit, and bad input is
refused before anything compiles."""

import os

import jax
import numpy as np
import pytest
from tiny import resumed_and_uninterrupted, run_steps, tiny_config

from jaxcolossal.config import ConfigError, load_config
from jaxcolossal.models.layers.linear import E4M3, E5M2, fp8_quantize, project, project_fp8
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.plan import plan_dry_run
from jaxcolossal.train.start_lines import run_line
from jaxcolossal.train.state import make_plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fp8(parallel):
    cfg = tiny_config(parallel, "bf16")
    cfg.precision.fp8 = True
    return cfg


def test_quantize_lands_the_amax_on_the_formats_largest_value():
    x = jax.numpy.asarray([[-3.0, 0.5], [1.25, 2.0]], jax.numpy.bfloat16)
    for dtype in (E4M3, E5M2):
        q, s = fp8_quantize(x, dtype)
        assert q.dtype == dtype and float(s) == pytest.approx(3.0 / float(jax.numpy.finfo(dtype).max))
        assert float(np.abs(np.asarray(q, np.float32)).max()) == float(jax.numpy.finfo(dtype).max)


def test_fp8_projection_is_close_to_bf16_in_value_and_gradient():
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (2, 16, 64), jax.numpy.bfloat16)
    w = (0.05 * jax.random.normal(kw, (64, 96))).astype(jax.numpy.bfloat16)
    f = lambda proj: (lambda x, w: jax.numpy.sum(proj("btd,df->btf", x, w).astype(jax.numpy.float32) ** 2))  # noqa: E731
    y8, yb = project_fp8("btd,df->btf", x, w), project("btd,df->btf", x, w)
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32))  # noqa: E731
                             / np.linalg.norm(np.asarray(b, np.float32)))
    assert y8.dtype == jax.numpy.bfloat16 and rel(y8, yb) < 0.05  # e4m3: 3 mantissa bits
    g8, gb = jax.grad(f(project_fp8), argnums=(0, 1))(x, w), jax.grad(f(project), argnums=(0, 1))(x, w)
    assert g8[1].dtype == w.dtype and all(rel(a, b) < 0.15 for a, b in zip(g8, gb))  # e5m2: 2 mantissa bits


def test_fp8_tracks_bf16_on_one_device():
    _, bf, _ = run_steps(tiny_config({"data_parallel_size": 1}, "bf16"), jax.devices()[:1], steps=5)
    _, f8, _ = run_steps(_fp8({"data_parallel_size": 1}), jax.devices()[:1], steps=5)
    np.testing.assert_allclose([m["loss"] for m in f8], [m["loss"] for m in bf], rtol=1e-3)
    np.testing.assert_allclose([m["grad_norm"] for m in f8], [m["grad_norm"] for m in bf], rtol=2e-2)


@pytest.mark.parametrize("parallel", [{"zero_stage": 3}, {"data_parallel_size": 4, "tensor_parallel_size": 2,
                                                          "zero_stage": 2}], ids=["zero3_dp8", "zero2_dp4_tp2"])
def test_fp8_sharded_equals_one_device(parallel):
    """Each scale is the amax of the whole tensor (a max over its shards), so every layout
    quantizes alike. Tolerances (3 steps, lr 1e-3): loss rtol 1e-4, gradient norm rtol 5e-3, fp32
    master weights within 1e-2; bf16 alone differs across these layouts by up to 3.3e-3 in the
    master weights, and FP8's coarser rounding flips a few more of Adam's near-zero updates."""
    s1, m1, _ = run_steps(_fp8({"data_parallel_size": 1}), jax.devices()[:1], steps=3)
    s8, m8, _ = run_steps(_fp8(parallel), steps=3)
    np.testing.assert_allclose([m["loss"] for m in m8], [m["loss"] for m in m1], rtol=1e-4)
    np.testing.assert_allclose([m["grad_norm"] for m in m8], [m["grad_norm"] for m in m1], rtol=5e-3)
    for a, b in zip(jax.tree.leaves(jax.device_get(s8.master)), jax.tree.leaves(jax.device_get(s1.master))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-2)


def test_fp8_needs_bf16():
    with pytest.raises(ConfigError, match="precision.fp8=true runs on top of bf16: set precision.bf16=true"):
        load_config(os.path.join(ROOT, "configs/llama_tiny.yaml"), ["precision.fp8=true"])


def test_fp8_resume_is_bit_exact(tmp_path):
    """Current scaling keeps no scale state: a resumed FP8 run equals the uninterrupted one."""
    full, resumed, losses = resumed_and_uninterrupted(tmp_path, ["precision.bf16=true", "precision.fp8=true"])
    assert losses[0] == losses[1] and len(losses[0]) == 6
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(full["state"].master),
                 jax.device_get(resumed["state"].master))


def test_the_start_up_line_and_the_dry_run_say_whether_fp8_is_on():
    """Issue 45 item 11: with precision.fp8=true both said only ``precision bf16``."""
    for cfg, said in ((_fp8({"data_parallel_size": 1}), "bf16 + fp8 projections (e4m3/e5m2, current scaling)"),
                      (tiny_config({"data_parallel_size": 1}, "bf16"), "bf16")):
        mesh = make_mesh(cfg.parallel, jax.devices()[:1])
        assert f"; precision {said}; zero_stage" in run_line(cfg, make_plan(cfg, mesh), mesh)
        assert f"\nprecision  {said}: p=2 g=4 K=12 bytes/param" in plan_dry_run(cfg, 1).text
