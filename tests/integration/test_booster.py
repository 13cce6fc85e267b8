"""The notebook API: Booster + plugins give the same training as the config path.

Tolerances: losses rtol 1e-5; parameters atol 1e-5 (1% of one Adam step at lr 1e-3). Plain
``optax.adamw`` without clipping turns a gradient component near zero into an update of up to
``lr``, so a ~1e-7 relative difference from the reduction order can move one element by ~3e-6.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from tiny import random_batches, tiny_config

import jaxcolossal as jc
from jaxcolossal.config import ConfigError


def _train(plugin, devices, steps=2):
    cfg = tiny_config()
    model = jc.models.LlamaForCausalLM(cfg.model, rngs=nnx.Rngs(0), tp=plugin.parallel.tensor_parallel_size)
    booster = jc.Booster(plugin=plugin, devices=devices)
    state, step = booster.boost(model, optax.adamw(1e-3), batch_size=16)
    losses = []
    for x in random_batches(cfg, steps):
        state, m = step(state, booster.shard_batch({"inputs": x[:, :-1], "targets": x[:, 1:]}))
        losses.append(float(m["loss"]))
    return state, losses


def test_plugins_match_single_device():
    ref_state, ref = _train(jc.DDPPlugin(), jax.devices()[:1])
    for plugin in (jc.LowLevelZeroPlugin(stage=2, precision="fp32"), jc.GeminiPlugin(precision="fp32"),
                   jc.HybridParallelPlugin(tp_size=2, sp_size=2, enable_sequence_parallelism=True,
                                           sequence_parallelism_mode="ring_attn", zero_stage=1, precision="fp32")):
        state, losses = _train(plugin, jax.devices())
        np.testing.assert_allclose(losses, ref, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                     jax.device_get(state.params), jax.device_get(ref_state.params))


def test_pipeline_plugin_with_default_batch():
    cfg = tiny_config()
    model = jc.models.LlamaForCausalLM(cfg.model, rngs=nnx.Rngs(0))
    booster = jc.Booster(plugin=jc.HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, precision="fp32"))
    state, step = booster.boost(model, optax.adamw(1e-3))
    B = booster.plan.cfg.training.batch_size
    assert B == 2 * 4  # dp 2 × 2·pp microbatches
    x = random_batches(cfg, 1)[0][:B]
    state, m = step(state, booster.shard_batch({"inputs": x[:, :-1], "targets": x[:, 1:]}))
    assert np.isfinite(float(m["loss"])) and abs(float(m["loss"]) - np.log(256)) < 0.5


def test_bf16_plugin_keeps_fp32_master():
    """(with Colossal-AI's ``fp8_communication``: the gradient reduction in fp8, trained on)"""
    plugin = jc.LowLevelZeroPlugin(stage=1, precision="bf16", fp8_communication=True)
    assert plugin.parallel.communication_dtype == "fp8"
    state, losses = _train(plugin, jax.devices())
    assert state.params["layers"]["wq"].dtype == jax.numpy.bfloat16
    assert state.master["layers"]["wq"].dtype == jax.numpy.float32
    assert losses[1] < losses[0] + 0.1


def test_plugin_switches_are_bools_and_fp8_is_refused_where_unsupported():
    with pytest.raises(ConfigError, match=r"fp8_communication='false'\): expected True or False"):
        jc.LowLevelZeroPlugin(stage=2, fp8_communication="false")
    with pytest.raises(ConfigError, match="fp8_communication=True\\) is not supported with pp_size=2"):
        jc.HybridParallelPlugin(pp_size=2, fp8_communication=True)


def test_plugin_errors():
    with pytest.raises(ConfigError, match=r"allowed values are \[1, 2\]"):
        jc.LowLevelZeroPlugin(stage=3)
    with pytest.raises(ConfigError, match="precision='int8'"):
        jc.GeminiPlugin(precision="int8")
    with pytest.raises(ConfigError, match="needs enable_sequence_parallelism=True"):
        jc.HybridParallelPlugin(sp_size=2)
    with pytest.raises(ConfigError, match=r"sequence_parallelism_mode='ring'\): allowed values"):
        jc.HybridParallelPlugin(sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="ring")
    cfg = tiny_config()
    model = jc.models.LlamaForCausalLM(cfg.model, rngs=nnx.Rngs(0))
    booster = jc.Booster(plugin=jc.DDPPlugin())
    state, step = booster.boost(model, optax.adamw(1e-3), batch_size=16)
    x = random_batches(cfg, 1)[0][:8]
    with pytest.raises(ValueError, match=r"planned batch_size=16 sequences per step"):
        step(state, booster.shard_batch({"inputs": x[:, :-1], "targets": x[:, 1:]}))
    with pytest.raises(ConfigError, match="tensor_parallel_size=8 does not divide"):
        jc.Booster(plugin=jc.HybridParallelPlugin(tp_size=8, precision="fp32")).boost(model, optax.adamw(1e-3))


def test_shard_batch_refuses_ids_outside_the_vocabulary():
    cfg = tiny_config()
    booster = jc.Booster(plugin=jc.DDPPlugin(), devices=jax.devices()[:1])
    booster.boost(jc.models.LlamaForCausalLM(cfg.model, rngs=nnx.Rngs(0)), optax.adamw(1e-3), batch_size=16)
    x = random_batches(cfg, 1)[0]
    x[3, 5] = cfg.model.vocab_size  # one id past the end
    with pytest.raises(ValueError, match=r"inputs holds token ids in \[\d+, 256\], outside the model's vocabulary"):
        booster.shard_batch({"inputs": x[:, :-1], "targets": x[:, 1:]})
