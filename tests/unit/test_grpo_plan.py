"""The planner's GRPO terms (:mod:`jaxcolossal.memory.rollout`): the dry run's GRPO and rollout lines,
the reference copy counted with ``beta > 0``, the sampler's KV cache split as the rules table splits it,
and the plan's peak as the larger of the step's and the rollout's. (Against the GPU compiler:
tests/gpu_compile/test_grpo_compile.py.)"""

import os

import pytest

from jaxcolossal.config import ConfigError, load_config, validate
from jaxcolossal.memory.budget import layout, need, resolve
from jaxcolossal.memory.rollout import ROLLOUT_FIELDS, kv_cache_bytes
from jaxcolossal.metrics import param_count
from jaxcolossal.parallel.mesh import mesh_shape
from jaxcolossal.plan import plan_dry_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO_8B = ["model.attention_impl=xla", "training.objective=grpo", "data.format=prompts",
           "data.corpus=configs/data/arith_prompts.jsonl", "training.batch_size=64", "training.micro_batch_size=0",
           "training.seq_len=1536", "posttrain.max_completion_length=1024", "posttrain.num_generations=8",
           "posttrain.beta=0.04"]
"""Llama-3-8B as a GRPO run: 8 prompts × 8 generations of 1024 tokens after a 513-token prompt."""


def _arith(*overrides):
    return load_config(os.path.join(ROOT, "configs/grpo_arith.yaml"), list(overrides))


def test_the_dry_run_of_grpo_arith_prints_the_reference_kv_cache_and_rollout_batch():
    text = plan_dry_run(_arith(), 8).text
    assert "GRPO       no reference copy (beta 0, 0 B); rollouts of 8 prompts × 8 generations = 64 rows of 9 prompt + " \
           "4 completion tokens" in text
    # 64 rows × 13 slots × 2 layers × 2 × 2 kv heads × 32 × 4 bytes = 832 KiB, over data 4 and tp 2
    assert "KV cache 104.00 KiB per device (64 rows × 13 slots × 2 layers × (k 2×32 + v 2×32) × 4 B, rows over " \
           "data 4, kv heads over tp 2)" in text
    assert "rollout batch 6.75 KiB per device (9 fp32/int32 [64, 12] fields)" in text  # 9 × 64 × 12 × 4 / 4
    assert "the plan's peak is the step's" in text


def test_beta_puts_the_reference_copy_in_the_state_and_the_peak():
    without, with_ref = need(_arith(), 8), need(_arith("posttrain.beta=0.04"), 8)
    ref = param_count(_arith().model)["total"] * 4 // 2  # fp32, like the params: over tp 2 (ZeRO-2 keeps them whole)
    assert without["reference"] == 0
    assert with_ref["reference"] == pytest.approx(ref, rel=0.02)
    assert with_ref["state"] - without["state"] == with_ref["reference"]
    assert with_ref["step_total"] - without["step_total"] >= with_ref["reference"]
    assert with_ref["rollout"]["total"] - without["rollout"]["total"] == with_ref["reference"]
    assert "reference = a frozen copy of the initial params in fp32" in plan_dry_run(_arith("posttrain.beta=0.04"), 8).text


@pytest.mark.parametrize("parallel, data, tp", [
    (["parallel.data_parallel_size=8", "parallel.zero_stage=3"], 8, 1),
    (["parallel.data_parallel_size=2", "parallel.tensor_parallel_size=4", "parallel.zero_stage=1"], 2, 4),
    (["parallel.data_parallel_size=1", "parallel.tensor_parallel_size=8", "parallel.zero_stage=0"], 1, 8),
], ids=["zero3-fsdp8", "zero1-dp2-tp4", "tp8"])
def test_the_kv_cache_is_split_over_the_data_axes_and_kv_heads_over_tp(parallel, data, tp):
    cfg = load_config(os.path.join(ROOT, "configs/bench/llama3_8b.yaml"), GRPO_8B + parallel)
    shape = mesh_shape(cfg.parallel.resolve(8))
    whole = 64 * (513 + 1024) * 32 * 2 * 8 * 128 * 2  # bf16: 12.0 GiB
    assert kv_cache_bytes(cfg, shape) == whole // (data * tp)
    r = need(cfg, 8)["rollout"]
    assert r["batch"] == len(ROLLOUT_FIELDS) * 64 * 1536 * 4 // data
    assert r["temporaries"] >= 2 * r["kv_cache"]


def test_the_grpo_peak_is_the_rollouts_when_the_step_accumulates_microbatches():
    """The sampler generates the whole batch at once; the step differentiates it in microbatches: at 512
    rows in 8 microbatches the rollout's KV cache (48 GiB per device twice) outweighs the step."""
    base = load_config(os.path.join(ROOT, "configs/bench/llama3_8b.yaml"), GRPO_8B)
    n = need(base, 8)
    assert n["total"] == n["step_total"] > n["rollout"]["total"]  # 29.4 GiB step, 19.1 GiB rollout
    big = load_config(os.path.join(ROOT, "configs/bench/llama3_8b.yaml"),
                      GRPO_8B + ["training.batch_size=512", "training.gradient_accumulation_steps=8"])
    m = need(big, 8)
    assert m["rollout"]["kv_cache"] == 8 * n["rollout"]["kv_cache"]
    assert m["total"] == m["rollout"]["total"] > m["step_total"]
    assert "the plan's peak is the rollout's" in plan_dry_run(big, 8).text


def test_grpo_with_cudnn_attention_is_refused_before_compiling():
    """The rollout rows carry segment ids (left-padded prompts), which cuDNN's kernel does not take: found
    compiling the 8B shape of configs/bench/llama3_8b.yaml (attention_impl=cudnn) as a GRPO run."""
    with pytest.raises(ConfigError, match="attention_impl=cudnn: the rollout rows' segment ids"):
        validate(_arith("model.attention_impl=cudnn"), num_devices=8)


def test_a_rollout_over_the_device_limit_names_a_rollout_setting_that_fits():
    """512 completions in one generation (8 microbatches): the rollout's KV cache (2 × 12 GiB a device) puts
    the rollout phase over a 45 GB limit that the step fits; the refusal names refill's slots that fit."""
    cfg = load_config(os.path.join(ROOT, "configs/bench/llama3_8b.yaml"),
                      GRPO_8B + ["training.batch_size=512", "training.gradient_accumulation_steps=8",
                                 "offload.device_memory_limit=45GB"])
    shape, _, shapes, specs = layout(cfg, 8)
    n = need(cfg, 8)
    assert n["step_total"] <= 45e9 < n["rollout"]["total"]  # 41.2 GB step, 50.3 GB rollout
    with pytest.raises(ConfigError) as e:
        resolve(cfg, shapes, specs, shape, backend="gpu")
    assert "posttrain.rollout_slots=256 would fit the rollout phase" in str(e.value) and "\n" not in str(e.value)
    cfg.posttrain.rollout_slots = 256
    assert need(cfg, 8)["rollout"]["kv_cache"] == n["rollout"]["kv_cache"] // 2
