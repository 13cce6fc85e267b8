"""Refill (continuous batching over the static KV cache, jaxcolossal.generate.refill): the per-row cache
write and mask equal the scalar ones row by row; greedy completions decoded in fewer slots than prompts
are token-equal to the static batch's (LLaMA; Gemma 2 and GPT-OSS with sliding windows, soft-capping and
sinks; DeepSeek's latent cache; on one device and over 8 simulated devices with ZeRO-3 and tp 2), with the
lengths and the decode-slot utilisation that the schedule implies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcolossal.config import ModelConfig, ParallelConfig, config_from_dict
from jaxcolossal.generate import generate, make_generator, training_param_specs
from jaxcolossal.models import get_family
from jaxcolossal.models.layers.attention import cache_mask, write_slots
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.sharding import rules_for

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                   vocab_size=100)
BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 64, "initializer_range": 0.2}
WINDOWED = {
    "gemma2": {"type": "gemma", "query_pre_attn_scalar": 12.0, "sliding_window": 4, "attn_logit_softcapping": 5.0,
               "layer_types": "sliding_attention,full_attention", "tie_word_embeddings": True},
    "gpt_oss": {"type": "gpt_oss", "num_experts": 4, "num_experts_per_tok": 2, "attention_sinks": True,
                "attention_bias": "all", "sliding_window": 4, "layer_types": "sliding_attention,full_attention",
                "router_aux_loss_coef": 0.0},
    "deepseek_mla": {"type": "deepseek", "num_key_value_heads": 4, "attention_head_dim": 0, "intermediate_size": 128,
                     "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                     "v_head_dim": 12},
}
PROMPTS = [[5, 9, 13, 2, 7, 30, 41], [3, 8], [60, 61, 62, 63], [11], [4, 4, 4, 4, 4, 4, 4, 4, 4], [70, 2, 9],
           [21, 22], [90, 1, 2, 3, 4]]
NEW = 10


def _params(cfg, tp=1):
    fam = get_family(cfg)
    return fam, jax.tree.map(lambda a: a * 4 if a.ndim >= 2 else a, fam.init_params(cfg, jax.random.key(0), tp=tp))


def _eos(rows):
    """Ids that end the static batch's rows at different lengths: token ``k`` of row ``r`` for a spread of ``k``."""
    return sorted({row[k % len(row)] for k, row in zip([1, 6, 0, 3, 8, 2, 5, 4], rows)})


def test_the_per_row_write_and_mask_equal_the_scalar_ones_row_by_row():
    key = jax.random.key(1)
    cache = jax.random.normal(key, (3, 12, 2, 4))
    new = jax.random.normal(jax.random.key(2), (3, 2, 2, 4))
    index = jnp.asarray([0, 5, 10], jnp.int32)
    valid = jax.random.bernoulli(jax.random.key(3), 0.8, (3, 12))
    got = write_slots(cache, new, index)
    for window in (0, 3, jnp.int32(3)):
        mask = cache_mask(index, 2, valid, window)
        for r in range(3):
            one = write_slots(cache[r:r + 1], new[r:r + 1], index[r])
            np.testing.assert_array_equal(got[r], one[0])
            np.testing.assert_array_equal(mask[r], cache_mask(index[r], 2, valid[r:r + 1], window)[0])
    assert write_slots(cache, new, jnp.int32(4)).shape == cache.shape


@pytest.mark.parametrize("slots", [1, 3, 5])
def test_greedy_completions_in_fewer_slots_equal_the_static_batch(slots):
    fam, params = _params(TINY)
    eos = _eos(generate(fam, TINY, params, PROMPTS, NEW).rows())
    ref = generate(fam, TINY, params, PROMPTS, NEW, eos_id=eos)
    assert len(set(ref.lengths.tolist())) > 3  # a real length mix
    got = generate(fam, TINY, params, PROMPTS, NEW, eos_id=eos, slots=slots)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    assert got.slots == slots and ref.slots == len(PROMPTS) and ref.decode_steps == max(ref.lengths) - 1
    assert got.decode_steps >= int(np.sum(ref.lengths - 1)) // slots
    if slots == 1:
        assert got.utilisation == 1.0
    assert got.utilisation > ref.utilisation


@pytest.mark.parametrize("name", list(WINDOWED))
def test_sliding_windows_sinks_and_softcaps_refill_token_equal(name):
    cfg = config_from_dict({"model": {**BASE, **WINDOWED[name]}, "training": {"seq_len": 32}}).model
    fam, params = _params(cfg)
    eos = _eos(generate(fam, cfg, params, PROMPTS, NEW).rows())
    ref = generate(fam, cfg, params, PROMPTS, NEW, eos_id=eos)
    got = generate(fam, cfg, params, PROMPTS, NEW, eos_id=eos, slots=3)
    np.testing.assert_array_equal(got.tokens, ref.tokens)
    np.testing.assert_array_equal(got.lengths, ref.lengths)


def test_refill_over_eight_devices_with_zero3_and_tp2_equals_one_device():
    """tp 2 × fsdp 4 under ZeRO-3: the slots over the 4 data shards (5 slots rounded up to 8 would be the
    whole batch, so 3 rounds up to 4), the same tokens as the static batch on one device."""
    fam, params = _params(TINY, tp=2)
    eos = _eos(generate(fam, TINY, params, PROMPTS, NEW).rows())
    one = generate(fam, TINY, params, PROMPTS, NEW, eos_id=eos)
    parallel = ParallelConfig(tensor_parallel_size=2, zero_stage=3)
    mesh = make_mesh(parallel, jax.devices()[:8])
    rules = rules_for(parallel)
    specs = training_param_specs(TINY, mesh, zero_stage=3, rules=rules)
    placed = jax.device_put(params, jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    many = generate(fam, TINY, placed, PROMPTS, NEW, eos_id=eos, mesh=mesh, param_specs=specs, rules=rules, slots=3)
    assert many.slots == 4
    np.testing.assert_array_equal(many.tokens, one.tokens)
    np.testing.assert_array_equal(many.lengths, one.lengths)


def test_refusals_and_the_static_path_for_enough_slots():
    fam, params = _params(TINY)
    with pytest.raises(ValueError, match="slots must be >= 1"):
        make_generator(fam, TINY, 4, slots=0)
    out = generate(fam, TINY, params, PROMPTS[:3], 4, slots=8)  # slots >= prompts: the static batch
    assert out.slots == 3 and out.decode_steps == 3
