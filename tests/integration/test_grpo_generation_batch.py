"""GRPO's generation batch as TRL 1.16 defines it (posttrain.steps_per_generation, generation_batch_size):
one rollout of k × batch_size completions feeds k optimizer steps, a slice each, in order; the steps after
the first train off-policy on the sampling policy's kept log-probs; the two keys give the same run; the
planner's KV cache holds the whole generation; bad values are refused in one line."""
import jax
import numpy as np
import pytest
from test_grpo_train import GRPO_JOB, ROOT, grpo_config
from tiny import setup

from jaxcolossal.config import ConfigError, load_config
from jaxcolossal.data import get_tokenizer
from jaxcolossal.data.prompts import load_prompts
from jaxcolossal.config.checks import validate
from jaxcolossal.config.derived import grpo_generation_batch, grpo_off_policy
from jaxcolossal.memory.budget import need
from jaxcolossal.posttrain.rollout import Rollouts


def run(cfg, steps, devices=jax.devices()[:1]):
    """Each step's batch (host arrays) and metrics, on one device (or ``devices``; None: all)."""
    plan, _, state, step_fn = setup(cfg, devices)
    ro = Rollouts(cfg, plan, load_prompts(cfg.data, get_tokenizer("byte"), 9), get_tokenizer("byte"), plan.batch_sharding)
    out = []
    for s in range(steps):
        batch = ro.batch(s, state)
        state, m = step_fn(state, batch)
        out.append(({k: np.asarray(v) for k, v in batch.items()}, {k: float(v) for k, v in m.items()} | ro.metrics))
    return out


def test_one_generation_feeds_two_steps_in_order():
    cfg = grpo_config(posttrain={"num_iterations": 1, "steps_per_generation": 2})
    assert grpo_generation_batch(cfg) == 32 and grpo_off_policy(cfg)
    (h0, m0), (h1, m1), (h2, _) = run(cfg, 3)
    assert h0["inputs"].shape == (16, 12) and not np.array_equal(h0["inputs"], h1["inputs"])  # two slices ...
    assert m0["reward"] == m1["reward"] and m0["time/rollout_s"] == m1["time/rollout_s"]  # ... of one rollout
    assert not np.array_equal(h1["inputs"], h2["inputs"])  # a new rollout at step 2
    # the first step is on-policy (the kept log-probs are the policy's: no ratio clipped), the second is not
    assert np.all(h0["old_logps"][h0["loss_mask"] > 0] < 0) and np.all(h1["old_logps"][h1["loss_mask"] > 0] < 0)
    assert m0["clip_ratio/region_mean"] == 0 and m0["kl"] == 0


def test_generation_batch_size_equals_steps_per_generation():
    a = run(grpo_config(posttrain={"num_iterations": 1, "steps_per_generation": 2}), 2)
    b = run(grpo_config(posttrain={"num_iterations": 1, "generation_batch_size": 32}), 2)
    for (ha, ma), (hb, mb) in zip(a, b):
        for k in ha:
            np.testing.assert_array_equal(ha[k], hb[k], err_msg=k)
        assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]


def test_the_planner_sizes_the_kv_cache_by_the_generation():
    base = load_config(f"{ROOT}/configs/llama_tiny.yaml", GRPO_JOB)
    double = load_config(f"{ROOT}/configs/llama_tiny.yaml", GRPO_JOB + ["posttrain.steps_per_generation=2"])
    assert need(double, 8)["rollout"]["kv_cache"] == 2 * need(base, 8)["rollout"]["kv_cache"]


@pytest.mark.parametrize("override, message", [
    (["posttrain.steps_per_generation=2", "posttrain.generation_batch_size=32"], "can not both be set"),
    (["posttrain.steps_per_generation=3", "training.gradient_accumulation_steps=2"],
     "posttrain.steps_per_generation=3 microbatches is not a whole number"),
    (["posttrain.generation_batch_size=24"], "posttrain.generation_batch_size=24 is not a multiple of"),
])
def test_bad_generation_settings_are_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        validate(load_config(f"{ROOT}/configs/llama_tiny.yaml", GRPO_JOB + override), 8)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_refilled_rollouts_equal_the_static_batch():
    """posttrain.rollout_slots=4 (refill) against the static batch of 32, with top_k 1 (greedy draws): the
    same completions, losses and gradient norms, on ZeRO-3 over 8 devices decoding at tp 2."""
    def cfg(slots):
        return grpo_config({"data_parallel_size": 8, "zero_stage": 3},
                           {"num_iterations": 1, "steps_per_generation": 2, "top_k": 1, "rollout_slots": slots})
    plan_runs = [run(cfg(s), 2, devices=None) for s in (0, 4)]
    for (ha, ma), (hb, mb) in zip(*plan_runs):
        for k in ("inputs", "loss_mask", "advantages"):
            np.testing.assert_array_equal(ha[k], hb[k], err_msg=k)
        np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-5, atol=1e-6)
