"""What XLA's GPU compiler emits for the tiny model's real train step on 8 compile-only H200s:
the collectives of each layout, the GPU kernels (fused AdamW's Triton call, cuDNN attention, the
Pallas flash kernels), offload's host buffers, and the schedule that ``parallel.overlap`` makes.

Each assertion reads the compiled (scheduled) HLO, so it holds for the program a GPU runs."""

import re

import pytest
from tiny import TINY_MODEL, TINY_TRAINING, tiny_config

from jaxcolossal.aot import fleet, hlo, report, target
from jaxcolossal.aot.fleet import memory_kinds_supported
from jaxcolossal.aot.target import compile_only_devices
from jaxcolossal.config import ConfigError

FOUR_LAYERS = {"num_layers": 4, "remat": "full"}  # a layer loop that XLA keeps as a loop


def kinds(fc) -> dict:
    return {k: v["count"] for k, v in fc.collectives.items()}


def test_ddp_all_reduces_the_gradients_once(compile_tiny):
    fc = compile_tiny({"data_parallel_size": 8, "zero_stage": 0})
    assert kinds(fc) == {"all-reduce": 1}  # XLA combined every gradient into one all-reduce
    # the whole fp32 gradient, and the loss: the tiny model has 106,816 parameters
    assert fc.collectives["all-reduce"]["elements"] == 106_816 + 1


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_reduce_scatter_on_the_gpu(compile_tiny, stage):
    """XLA:GPU writes reduce-scatter where XLA:CPU writes all-reduce + dynamic-slice."""
    fc = compile_tiny({"zero_stage": stage})
    k = kinds(fc)
    assert k.get("reduce-scatter", 0) >= 1 and "all-reduce" not in k, k
    assert k.get("all-gather", 0) >= 1  # ZeRO 1/2: the new params; 3: also the layer weights
    if stage == 3:
        assert k["all-gather"] > kinds(compile_tiny({"zero_stage": 2}))["all-gather"]


def test_tensor_parallelism_all_reduces_activations(compile_tiny):
    fc = compile_tiny({"tensor_parallel_size": 2, "zero_stage": 1})
    assert kinds(fc)["all-reduce"] >= 8  # Megatron's forward and backward all-reduces per layer


def test_pipeline_1f1b_sends_activations_between_stages(compile_tiny):
    fc = compile_tiny({"pipeline_parallel_size": 2, "pipeline_schedule": "1f1b", "num_microbatches": 4,
                       "zero_stage": 1})
    assert kinds(fc)["collective-permute"] >= 2 * 4  # an activation and a gradient per tick, 5 ticks


def test_ring_attention_passes_kv_around_the_ring(compile_tiny):
    fc = compile_tiny({"sequence_parallel_size": 2, "sequence_parallelism_mode": "ring_attn", "zero_stage": 1})
    permutes = [p for p in fc.pairs if p.kind == "collective-permute"]
    assert permutes and all(p.group is None or p.group <= 8 for p in permutes)
    assert any(p.asynchronous and p.flops_between > 0 for p in permutes)  # k/v move while a block computes


# fused AdamW's Triton kernel and cuDNN attention: tests/gpu_compile/test_cli.py, in the main job's step


def test_flash_attention_is_the_pallas_triton_kernels(compile_tiny):
    fc = compile_tiny({"zero_stage": 2}, "bf16", {"attention_impl": "flash"})
    assert fc.custom_calls["__gpu$xla.gpu.triton"] == 4  # forward and backward, 2 layers
    assert not any(k.startswith("__cudnn") for k in fc.custom_calls)


OFFLOAD = {"offload_optim_frac": 1.0}


def test_offload_on_compile_only_devices_is_reported_as_this_jaxlibs_limit(compile_tiny):
    """jaxlib 0.10's compile-only devices report no memories, so a ``pinned_host`` sharding loses its
    kind and the offloaded optimizer state compiles as device buffers: the report says so
    (docs/gpu.md has the reproduction)."""
    devices = compile_only_devices("h200", 1)
    if memory_kinds_supported(devices):
        pytest.skip("this jaxlib represents memory kinds on compile-only devices: the next test checks them")
    assert devices[0].addressable_memories() == []
    fc = compile_tiny({"zero_stage": 2}, offload=OFFLOAD)
    assert fc.offloaded and not fc.memory_kinds
    assert fc.memory["host_argument"] == fc.memory["host_temp"] == 0
    assert "compiled as device memory" in report.text(fc)


def test_offload_compiles_host_buffers_where_the_jaxlib_can(compile_tiny):
    """Where compile-only devices carry memory kinds (a newer jaxlib), the offloaded optimizer
    state is a host argument of the compiled step."""
    if not memory_kinds_supported(compile_only_devices("h200", 1)):
        pytest.skip("jaxlib 0.10's compile-only devices have no memory kinds (docs/gpu.md)")
    fc = compile_tiny({"zero_stage": 2}, offload=OFFLOAD)
    assert fc.memory["host_argument"] > 0 and fc.memory_kinds


@pytest.mark.parametrize("precision,size", [(None, 4), ("bf16", 2)])
def test_activation_offload_compiles_host_buffers(compile_tiny, precision, size):
    """``model.remat=offload`` moves the saved projections to host memory inside the step, so even
    compile-only devices keep the kind: the GPU compile holds them as pinned-host temporaries, one
    per saved projection output of every layer (``S(5)`` in the HLO). The MLP's down projection is
    tagged but not saved: the residual add after it needs nothing from it in the backward pass."""
    fc = compile_tiny({"zero_stage": 2}, precision, {"remat": "offload"})
    m = TINY_MODEL
    head = m["hidden_size"] // m["num_attention_heads"]
    widths = (m["num_attention_heads"] * head, 2 * m["num_key_value_heads"] * head,  # q; k and v
              m["hidden_size"], 2 * m["intermediate_size"])  # attention out; MLP gate and up
    tokens = TINY_TRAINING["batch_size"] // 8 * TINY_TRAINING["seq_len"]  # per device (dp 8)
    assert fc.memory["host_temp"] == m["num_layers"] * tokens * sum(widths) * size
    assert "S(5)" in fc.hlo_text


def test_the_update_writes_the_optimizer_state_in_place(compile_tiny):
    """A non-finite step must leave the state unchanged; on XLA:GPU the step selects new or old
    inside each leaf's update kernel, which writes the donated buffers in place. (A cond returned its
    branch's results in new buffers: a whole copy of master, m and v among the temporaries; here
    the temporaries were 33.1 MB against 12Ψ = 26.8 MB, and are 15.7 MB with the select.)"""
    model = {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 4}
    fc = compile_tiny({"zero_stage": 0}, "bf16", model, {"batch_size": 8, "seq_len": 16})
    h, f, v, n = 256, 1024, 256, TINY_MODEL["num_layers"]
    psi = n * (4 * h * h + 3 * h * f + 2 * h) + 2 * v * h + h  # attention, MLP, norms; embedding, head, final norm
    assert "conditional(" not in fc.hlo_text
    assert fc.memory["temp"] < 12 * psi  # no second copy of the fp32 master, m and v


@pytest.mark.parametrize("remat,per_layer", [("none", 21), ("full", 27)])
def test_fp8_runs_every_projection_as_an_fp8_gemm(compile_tiny, remat, per_layer):
    """``precision.fp8``: the 7 projections of every layer, forward and both backward matmuls (and
    under ``remat=full`` the recomputed forward of all but the MLP's down projection), compile to
    matmuls with FP8 operands; attention and the LM head stay bf16. Without autotuning XLA:GPU
    makes them GEMM fusions (Triton); ``--xla_gpu_enable_triton_gemm=false`` makes each a cuBLASLt
    FP8 GEMM (docs/gpu.md)."""
    fc = compile_tiny({"zero_stage": 2}, "bf16", {"remat": remat}, fp8=True)
    assert fc.matmuls["fp8"] == per_layer * TINY_MODEL["num_layers"]
    assert fc.matmuls["fp8"] == fc.matmuls["cublaslt"] + fc.matmuls["fusion"]
    assert fc.matmuls["other"] > 0  # attention's and the LM head's matmuls, in bf16


def test_fp8_on_a100s_is_refused_before_compiling():
    cfg = tiny_config({"zero_stage": 2}, "bf16")
    cfg.precision.fp8 = True
    with pytest.raises(ConfigError, match="compute capability 8.0.*has no FP8 tensor cores"):
        fleet.compile_for(cfg, target.get_target("a100"), 8)


# ----------------------------------------------------------------------------- overlap


def _windows(fc, kind: str) -> list:
    return [p for p in fc.pairs if p.kind == kind and p.sent >= 4096]


@pytest.mark.parametrize("stage, kind", [(3, "all-gather"), (3, "reduce-scatter"), (2, "reduce-scatter")])
def test_overlap_puts_layer_compute_inside_the_collectives(compile_tiny, stage, kind):
    """``parallel.overlap=true``: ZeRO-3's weight all-gathers and ZeRO-2/3's gradient reduce-scatters
    are async, with matmuls scheduled between start and done; off, their windows hold none."""
    on = compile_tiny({"zero_stage": stage, "overlap": True}, "bf16", FOUR_LAYERS)
    off = compile_tiny({"zero_stage": stage, "overlap": False}, "bf16", FOUR_LAYERS)
    assert any(p.asynchronous and p.flops_between > 0 for p in _windows(on, kind)), _windows(on, kind)
    assert sum(p.flops_between * p.executions for p in _windows(off, kind)) < \
        sum(p.flops_between * p.executions for p in _windows(on, kind))
    assert on.exposure.hidden_fraction > off.exposure.hidden_fraction


def test_the_next_layers_gather_is_issued_before_this_layers_matmuls(compile_tiny):
    """ZeRO-3 with the prefetching layer scan: in the forward layer loop's body the all-gather of the
    next layer's weights starts before the body's first matmul and completes after one."""
    fc = compile_tiny({"zero_stage": 3, "overlap": True}, "bf16", FOUR_LAYERS)
    comps, _ = hlo.computations(fc.hlo_text)
    shapes = hlo.instruction_shapes(comps)
    found = []
    for name, lines in comps.items():
        starts = [i for i, line in enumerate(lines) if " all-gather-start(" in line]
        matmuls = [i for i, line in enumerate(lines) if _matmul(comps, shapes, name, line)]
        if starts and matmuls:
            done = [i for i, line in enumerate(lines) if " all-gather-done(" in line]
            found.append((name, min(starts) < min(matmuls) < max(done)))
    assert found and any(ok for _, ok in found), found


def _matmul(comps, shapes, name, line) -> bool:
    if hlo.instruction_flops(shapes[name], line):
        return True
    call = re.search(r"calls=%?([\w.\-]+)", line)
    return bool(call) and any(hlo.instruction_flops(shapes.get(call.group(1), {}), x)
                              for x in comps.get(call.group(1), []))
