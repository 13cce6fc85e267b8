"""Every GRPO loss type and option over the step's layouts: the summed loss, every metric TRL logs and
the gradient of one step (gradient accumulation 2, off-policy, β > 0) equal one device's, on ZeRO-2 over
dp 4 × tp 2 (each microbatch's gradient taken whole and reduced layer by layer) and on ZeRO-1 over dp 8
(each data shard's gradient taken apart: bnpo's per-microbatch token count, the ``*_min``/``*_max``
metrics and the high-entropy quantile span the shards), the rows placed as GRPO's loader places them
so that each microbatch holds the same rows on every layout. Tolerance: 2e-5 relative (fp32; the
reductions' order differs)."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY_MODEL

from jaxcolossal.config import config_from_dict
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.microbatch_order import microbatch_order
from jaxcolossal.posttrain.grpo import Grpo
from jaxcolossal.models import get_family
from jaxcolossal.train.state import make_plan
from jaxcolossal.train.step import make_grad_fn

B, T, PROMPT = 16, 12, 4
TOL = 2e-5
LAYOUTS = {"zero2_dp4_tp2": {"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2},
           "zero1_dp8": {"data_parallel_size": 8, "zero_stage": 1}}


def _batch():
    """Random rows: a prompt then a completion of 1..T-PROMPT tokens, advantages of both signs, old
    log-probs off the policy's by noise (off-policy), reference log-probs."""
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, 256, (B, T)).astype(np.int32)
    targets = rng.integers(1, 256, (B, T)).astype(np.int32)
    lengths = rng.integers(1, T - PROMPT + 1, B)
    mask = ((np.arange(T)[None] >= PROMPT) & (np.arange(T)[None] < PROMPT + lengths[:, None])).astype(np.float32)
    adv = rng.normal(size=B).astype(np.float32)
    fields = {"advantages": np.repeat(adv[:, None], T, 1),
              "old_logps": (-5.5 + rng.uniform(-0.3, 0.3, (B, T))).astype(np.float32) * mask,
              "ref_logps": (-5.5 + rng.uniform(-0.5, 0.5, (B, T))).astype(np.float32) * mask}
    return inputs, targets, mask, fields


def _config(parallel, post):
    return config_from_dict({
        "model": {**TINY_MODEL, "vocab_size": 256},
        "training": {"objective": "grpo", "batch_size": B, "seq_len": T, "gradient_accumulation_steps": 2},
        "data": {"format": "prompts", "corpus": "prompts.jsonl"},  # a name: nothing is read
        "posttrain": {"num_generations": 4, "max_completion_length": T - PROMPT, "num_iterations": 2,
                      "beta": 0.04, **post},
        "parallel": parallel})


def _step(cfg, devices, params):
    """The step's (loss, metrics, gradients) on ``devices``, the rows in the order GRPO's loader places
    them (:func:`~jaxcolossal.parallel.microbatch_order.microbatch_order`)."""
    plan = make_plan(cfg, make_mesh(cfg.parallel, devices))
    order = microbatch_order(B, plan.data_size, cfg.training.gradient_accumulation_steps)
    inputs, targets, mask, fields = _batch()
    inputs, targets, mask = inputs[order], targets[order], mask[order]
    fields = {k: v[order] for k, v in fields.items()}
    grad_fn = jax.jit(partial(make_grad_fn(plan), with_stats=True))
    loss_sum, g, _, stats = grad_fn(params, inputs, targets, np.float32(1.0), mask, None, None,
                                    fields={k: jnp.asarray(v) for k, v in fields.items()})
    obj = Grpo(plan.family, cfg)
    n = obj.count(inputs, mask)
    return float(loss_sum / n), {k: float(v) for k, v in obj.metrics(stats, n).items()}, jax.device_get(g)


CASES = [{"loss_type": lt} for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")]
CASES += [{"importance_sampling_level": "sequence", "epsilon": 0.03}, {"delta": 1.1}, {"top_entropy_quantile": 0.3},
          {"temperature": 0.7}, {"use_bias_correction_kl": False}]


@pytest.fixture(scope="module")
def params():
    cfg = _config({"data_parallel_size": 1}, {})
    return jax.device_get(get_family(cfg.model).init_params(cfg.model, jax.random.key(0)))


FAST = ({"loss_type": "bnpo"}, {"top_entropy_quantile": 0.3})
"""README's suite runs these on ZeRO-1 dp 8 (the per-microbatch count and the quantile over the per-shard
gradients); the rest, and every case on ZeRO-2 dp 4 × tp 2, is marked slow."""


@pytest.mark.parametrize("layout", ["zero1_dp8", pytest.param("zero2_dp4_tp2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("post", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
                         ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_each_grpo_loss_and_option_equals_one_device(params, layout, post):
    one = _step(_config({"data_parallel_size": 1}, post), jax.devices()[:1], params)
    par = _step(_config(LAYOUTS[layout], post), jax.devices(), params)
    assert abs(par[0] - one[0]) <= TOL * abs(one[0]) + 1e-7, (par[0], one[0])
    assert set(par[1]) == set(one[1])
    for k, v in one[1].items():
        assert abs(par[1][k] - v) <= TOL * abs(v) + 1e-6, (k, par[1], one[1])
    if post.get("top_entropy_quantile"):  # the mask keeps a share of the tokens, not all or none
        assert 0 < one[1]["entropy"]
    worst = max(float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(np.asarray(b)), 1e-30))
                for a, b in zip(jax.tree.leaves(par[2]), jax.tree.leaves(one[2])))
    print(f"{layout} {post}: loss {one[0]:.6g} rel err {abs(par[0] - one[0]) / abs(one[0]):.1e}, worst grad {worst:.1e}")
    assert worst < TOL, worst
