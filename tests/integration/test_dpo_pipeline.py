"""DPO over a pipeline (``parallel.pipeline_parallel_size > 1``, GPipe's schedule): the pipeline runs the
layers, the objective its head (:mod:`jaxcolossal.train.pipeline_objective`). Each layout equals one device
with the same microbatches: loss, gradient norm, every DPO metric and the params after three steps."""

import jax
import numpy as np
import pytest
from test_dpo_train import run_dpo
from tiny import TINY_MODEL, TINY_TRAINING, assert_params_match

from jaxcolossal.config import ConfigError, config_from_dict
from jaxcolossal.posttrain.dpo import DPO_METRICS, TOKEN_METRICS

PIPELINES = {
    "pp2 x dp2 x tp2": {"pipeline_parallel_size": 2, "data_parallel_size": 2, "tensor_parallel_size": 2},
    "pp2 x ZeRO-3 fsdp4": {"pipeline_parallel_size": 2, "data_parallel_size": 4, "zero_stage": 3},
    "pp2 x 2 chunks x dp4 (circular)": {"pipeline_parallel_size": 2, "data_parallel_size": 4, "num_model_chunks": 2},
}


def _config(parallel=None, posttrain=None, layers=4):
    """4 layers (2 per stage, or 1 per chunk), 2 microbatches of the 16 rows on every layout."""
    return config_from_dict({"model": {**TINY_MODEL, "num_layers": layers},
                             "training": {**TINY_TRAINING, "objective": "dpo", "gradient_accumulation_steps": 2},
                             "data": {"format": "preference", "corpus": "unused.jsonl"},
                             "posttrain": {"beta": 0.5, **(posttrain or {})},
                             "parallel": _pipelined(parallel) if parallel else {"data_parallel_size": 1}})


def _pipelined(parallel: dict) -> dict:
    return {**parallel, "pipeline_schedule": "gpipe", "num_microbatches": 2} if "pipeline_parallel_size" in parallel \
        else parallel


def _without_pp(parallel: dict) -> dict:
    return {k: v for k, v in parallel.items() if k not in ("pipeline_parallel_size", "num_model_chunks")}


@pytest.mark.parametrize("layout", list(PIPELINES))
def test_dpo_over_a_pipeline_equals_one_device(layout):
    """Against one device: the loss, gradient norm, pair metrics and params. Against the same data layout
    without the pipeline (whose microbatches hold the same rows): every metric, TRL's token metrics too
    (a microbatch's mean, which another data layout's microbatches, holding other rows, change)."""
    one, m1, _ = run_dpo(_config(), jax.devices()[:1])
    flat = _without_pp(PIPELINES[layout])
    _, mf, _ = run_dpo(_config(flat), jax.devices()[:flat["data_parallel_size"] * flat.get("tensor_parallel_size", 1)])
    par, mp, _ = run_dpo(_config(PIPELINES[layout]))
    for a, b, c in zip(mp, m1, mf):
        for k in ("loss", "grad_norm") + DPO_METRICS:
            np.testing.assert_allclose(a[k], b[k], rtol=2e-5, atol=1e-5, err_msg=k)
        for k in DPO_METRICS + TOKEN_METRICS:
            np.testing.assert_allclose(a[k], c[k], rtol=2e-5, atol=1e-6, err_msg=k)
    assert m1[-1]["rewards/margins"] != 0.0
    assert_params_match(jax.device_get(par.params), jax.device_get(one.params))


def test_one_dpo_step_over_a_pipeline_equals_one_device():
    """The fast check: one step of pp 2 × dp 4 against one device (loss, gradient norm, pair metrics, params)."""
    one, m1, _ = run_dpo(_config(layers=2), jax.devices()[:1], steps=1)
    par, mp, _ = run_dpo(_config({"pipeline_parallel_size": 2, "data_parallel_size": 4}, layers=2), steps=1)
    for k in ("loss", "grad_norm") + DPO_METRICS:
        np.testing.assert_allclose(mp[0][k], m1[0][k], rtol=2e-5, atol=1e-5, err_msg=k)
    assert_params_match(jax.device_get(par.params), jax.device_get(one.params))


def test_what_a_pipeline_does_not_run_with_is_refused():
    with pytest.raises(ConfigError, match="only DPO and GRPO run over a pipeline yet"):
        config_from_dict({"model": TINY_MODEL, "training": {**TINY_TRAINING, "objective": "reward"},
                          "data": {"format": "preference", "corpus": "x.jsonl"},
                          "parallel": {"pipeline_parallel_size": 2, "data_parallel_size": 4}})
    with pytest.raises(ConfigError, match="does not run with a mixture of experts"):
        config_from_dict({"model": {**TINY_MODEL, "num_experts": 4, "num_experts_per_tok": 2},
                          "training": {**TINY_TRAINING, "objective": "dpo", "gradient_accumulation_steps": 4},
                          "data": {"format": "preference", "corpus": "x.jsonl"},
                          "parallel": {"pipeline_parallel_size": 2, "data_parallel_size": 4,
                                       "pipeline_schedule": "gpipe"}})
