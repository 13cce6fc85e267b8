"""GRPO over a pipeline (``parallel.pipeline_parallel_size > 1``, GPipe's schedule): the rollout decodes on
the pipeline-free decode layout, the step runs the layers on the pipeline (with each row's segment ids and
positions: left-padded prompts) and GRPO's head after it (:mod:`jaxcolossal.train.pipeline_objective`). The
rollouts are the same as one device's and each step's loss, gradient norm, metrics and params equal."""

import jax
import numpy as np
import pytest
from test_grpo_train import PROMPTS, REWARDS, run_grpo
from tiny import TINY_MODEL, assert_params_match

from jaxcolossal.config import config_from_dict


def grpo_pp_config(parallel=None, posttrain=None):
    """test_grpo_train's GRPO run with 4 layers and 2 microbatches on every layout."""
    par = {**parallel, "pipeline_schedule": "gpipe", "num_microbatches": 2} \
        if parallel and "pipeline_parallel_size" in parallel else parallel or {"data_parallel_size": 1}
    return config_from_dict({"model": {**TINY_MODEL, "vocab_size": 256, "num_layers": 4},
                             "training": {"batch_size": 16, "seq_len": 12, "learning_rate": 1e-3, "warmup_steps": 1,
                                          "max_steps": 10, "objective": "grpo", "gradient_accumulation_steps": 2},
                             "data": {"format": "prompts", "corpus": PROMPTS, "tokenizer": "byte"},
                             "posttrain": {"num_generations": 4, "max_completion_length": 4, "beta": 0.04,
                                           "num_iterations": 2, "epsilon_high": 0.28, **REWARDS, **(posttrain or {})},
                             "parallel": par})


PIPELINES = {"pp2 x dp2 x tp2": {"pipeline_parallel_size": 2, "data_parallel_size": 2, "tensor_parallel_size": 2},
             "pp2 x ZeRO-3 fsdp4": {"pipeline_parallel_size": 2, "data_parallel_size": 4, "zero_stage": 3}}


def _without_pp(parallel: dict) -> dict:
    return {k: v for k, v in parallel.items() if k != "pipeline_parallel_size"}


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_grpo_over_a_pipeline_equals_one_device(layout):
    """Rollouts token-equal, and 4 steps' loss, gradient norm and metrics within 2e-5 of one device's, and
    the params after them. Dynamic sampling keeps only groups with a signal: in a group whose advantages
    are all 0 the gradient of its tokens' embeddings is 0 up to fp32 noise, which Adam's normalisation
    turns into a full-size update that differs between any two layouts."""
    cfg = {"dynamic_sampling": True}
    one, r1 = run_grpo(grpo_pp_config(posttrain=cfg), jax.devices()[:1])
    par, rp = run_grpo(grpo_pp_config(PIPELINES[layout], posttrain=cfg))
    for (b1, m1), (bp, mp) in zip(r1, rp):
        np.testing.assert_array_equal(bp["inputs"], b1["inputs"])  # the same rollouts
        for k in ("loss", "grad_norm", "reward", "kl", "entropy", "clip_ratio/region_mean"):
            np.testing.assert_allclose(mp[k], m1[k], rtol=2e-5, atol=1e-5, err_msg=k)
    assert_params_match(jax.device_get(par.params), jax.device_get(one.params))
