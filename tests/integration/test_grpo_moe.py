"""GRPO and DPO on a mixture of experts: expert parallelism (ep 2) × ZeRO-2 over 8 simulated devices
gives one device's losses, gradient norms and params; and the rollout routes every token to the
experts that the training forward routes it to (the same router code on the same params), counted
over a rollout's prompt and completion tokens."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dpo_train import dpo_config, run_dpo
from test_grpo_train import PROMPTS, REWARDS, run_grpo
from tiny import TINY_MODEL, assert_params_match, setup

from jaxcolossal.config import config_from_dict
from jaxcolossal.data import get_tokenizer
from jaxcolossal.data.prompts import load_prompts
from jaxcolossal.generate import Sampling, make_generator, pad_prompts
from jaxcolossal.models.layers import moe
from jaxcolossal.posttrain.rollout import row_layout, rollout_token_logps

MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
EP2_ZERO2 = {"data_parallel_size": 8, "expert_parallel_size": 2, "zero_stage": 2}


def grpo_moe(parallel):
    return config_from_dict({"model": {**TINY_MODEL, "vocab_size": 256, **MOE},
                             "training": {"batch_size": 16, "seq_len": 12, "learning_rate": 1e-3, "warmup_steps": 1,
                                          "max_steps": 10, "objective": "grpo"},
                             "data": {"format": "prompts", "corpus": PROMPTS, "tokenizer": "byte"},
                             "posttrain": {"num_generations": 4, "max_completion_length": 4, "beta": 0.04,
                                           "num_iterations": 2, **REWARDS},
                             "parallel": parallel})


def test_grpo_on_experts_ep2_zero2_equals_one_device():
    one, r1 = run_grpo(grpo_moe({"data_parallel_size": 1}), jax.devices()[:1], 2)
    par, r8 = run_grpo(grpo_moe(EP2_ZERO2), None, 2)
    for (h1, m1), (h8, m8) in zip(r1, r8):
        np.testing.assert_array_equal(h8["inputs"], h1["inputs"])
        for k in ("loss", "grad_norm"):
            np.testing.assert_allclose(m8[k], m1[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert_params_match(jax.device_get(par.params), jax.device_get(one.params))


def test_dpo_on_experts_ep2_zero2_equals_one_device():
    one, m1, _ = run_dpo(dpo_config(model=MOE), jax.devices()[:1])
    par, m8, _ = run_dpo(dpo_config(EP2_ZERO2, model=MOE))
    for a, b in zip(m8, m1):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5, atol=1e-6)
    assert_params_match(jax.device_get(par.params), jax.device_get(one.params))


def _recording(monkeypatch) -> list:
    """Every call of the router's choice appends its ``top_i [T, k]`` (host callbacks, in program order)."""
    calls, choose = [], moe.choose_experts

    def spy(scores, cfg, score_bias=None):
        top_i, top_w = choose(scores, cfg, score_bias)
        jax.debug.callback(lambda i: calls.append(np.asarray(i)), top_i, ordered=True)
        return top_i, top_w

    monkeypatch.setattr(moe, "choose_experts", spy)
    return calls


def test_the_rollout_routes_every_token_as_the_training_forward(monkeypatch):
    """A rollout of 16 completions of 4 tokens from the MoE policy (one device): each live token's top-2
    experts in every layer, in the sampler (prefill, then decode steps) and in the training forward of
    the rollout's rows (the old/reference log-prob pass), agree on 100% of the token-layers."""
    cfg = grpo_moe({"data_parallel_size": 1})
    plan, _, state, _ = setup(cfg, jax.devices()[:1])
    data = load_prompts(cfg.data, get_tokenizer("byte"), 9)
    tokens, mask = pad_prompts([data.tokens[i] for i in range(16)])
    L, C, (B, P) = cfg.model.num_layers, cfg.posttrain.max_completion_length, tokens.shape
    calls = _recording(monkeypatch)
    gen = make_generator(plan.family, cfg.model, C, Sampling(temperature=1.0), eos_id=None)
    out, lengths = jax.device_get(gen(state.params, jnp.asarray(tokens), jnp.asarray(mask), jax.random.key(3)))
    sampled = [c.reshape(B, -1, 2) for c in calls]  # prefill: L × [B, P, k]; then each decode step: L × [B, 1, k]
    calls.clear()
    rows = row_layout(tokens, mask, out, lengths)
    jax.block_until_ready(rollout_token_logps(plan, state.params, *(jnp.asarray(rows[k]) for k in (
        "inputs", "targets", "loss_mask", "segment_ids", "positions"))))
    trained = [c.reshape(B, -1, 2) for c in calls]  # L × [B, P + C - 1, k]
    assert len(trained) == L and len(sampled) == L * C  # the prefill and C - 1 decode steps
    decode = [np.concatenate([sampled[layer]] + [sampled[s * L + layer] for s in range(1, C)], axis=1)
              for layer in range(L)]
    live = np.concatenate([mask, np.arange(C - 1)[None, :] < lengths[:, None]], axis=1)  # [B, P + C - 1]
    same = [np.all(np.sort(d, -1) == np.sort(t, -1), axis=-1)[live] for d, t in zip(decode, trained)]
    share = float(np.mean(np.concatenate(same)))
    print(f"\nrouting agreement over {live.sum() * L} token-layers: {share:.2%}")
    assert share == 1.0
