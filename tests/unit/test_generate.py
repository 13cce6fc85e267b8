"""The KV-cached sampler (jaxcolossal.generate): the cached forward equals a full recompute at every
decode step (fp32, 1e-5), for dense LLaMA and a mixture of experts, with left-padded prompts of
different lengths; the sampling warpers behave as Hugging Face's; the batch runs as one jitted
program; bad arguments are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcolossal.config import LoraConfig, ModelConfig, ParallelConfig
from jaxcolossal.generate import (
    Sampling,
    data_shards,
    generate,
    left_align,
    make_generator,
    next_token,
    pad_prompts,
    training_param_specs,
)
from jaxcolossal.models import get_family
from jaxcolossal.models.layers import lora
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.sharding import rules_for

TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                   vocab_size=100)
GPT2 = dataclasses.replace(TINY, type="gpt2", num_key_value_heads=4, tie_word_embeddings=True)
MOE = dataclasses.replace(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_layers=3, first_k_dense=1)
PROMPTS = [[5, 9, 13, 2, 7, 30, 41], [3, 8], [60, 61, 62, 63]]


def _params(cfg, seed=0):
    fam = get_family(cfg)
    params = fam.init_params(cfg, jax.random.key(seed))
    return fam, jax.tree.map(lambda a: a * 4 if a.ndim >= 2 else a, params)  # sharper logits than the init's


WIDTH = 16
"""The recompute's fixed width: rows right-padded to it (causal attention keeps the pads after a
row's last token from changing its logits), so that one compiled forward serves every step."""


def _recompute_last(fam, cfg, params, seqs):
    """fp32 logits ``[b, vocab]`` at each row's last token, from a full forward of each row without
    cache, its real tokens from position 0."""
    x = np.zeros((len(seqs), WIDTH), np.int32)
    for r, seq in enumerate(seqs):
        x[r, : len(seq)] = seq
    full = _full_forward(fam, cfg)(params, jnp.asarray(x))
    return np.stack([np.asarray(full)[r, len(seq) - 1, : cfg.vocab_size] for r, seq in enumerate(seqs)])


_FORWARDS = {}


def _full_forward(fam, cfg):
    key = (cfg.type, cfg.moe, cfg.lora.rank)
    if key not in _FORWARDS:
        _FORWARDS[key] = jax.jit(lambda p, x: fam.forward(p, x, cfg))
    return _FORWARDS[key]


@pytest.mark.parametrize("cfg", [TINY, MOE, GPT2], ids=["llama", "moe", "gpt2"])
def test_cached_logits_equal_a_full_recompute_at_every_step(cfg):
    fam, params = _params(cfg)
    tokens, mask = pad_prompts(PROMPTS)
    b, width = tokens.shape
    steps = 5
    cache = fam.init_cache(cfg, b, width + steps)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    kv_valid = np.zeros((b, width + steps), bool)
    kv_valid[:, :width] = mask
    prefill = jax.jit(lambda p, x, c, i, pos, v: fam.forward_cached(p, x, c, i, pos, v, cfg, last_only=True))
    step = jax.jit(lambda p, x, c, i, pos, v: fam.forward_cached(p, x, c, i, pos, v, cfg))
    logits, cache = prefill(params, tokens, cache, 0, positions, kv_valid)
    seqs = [list(p) for p in PROMPTS]
    for i in range(steps):
        want = _recompute_last(fam, cfg, params, seqs)
        np.testing.assert_allclose(np.asarray(logits)[:, -1, : cfg.vocab_size], want, atol=1e-5, rtol=0,
                                   err_msg=f"step {i}")
        tok = np.argmax(np.asarray(logits)[:, -1, : cfg.vocab_size], -1).astype(np.int32)
        for r in range(b):
            seqs[r].append(int(tok[r]))
        kv_valid[:, width + i] = True
        logits, cache = step(params, tok[:, None], cache, width + i, (positions[:, -1] + 1 + i)[:, None], kv_valid)


def test_greedy_generate_matches_the_step_by_step_recompute_and_stops_at_eos():
    fam, params = _params(TINY)
    seqs = [list(p) for p in PROMPTS]
    for _ in range(6):  # greedy by full recompute
        for seq, tok in zip(seqs, np.argmax(_recompute_last(fam, TINY, params, seqs), -1)):
            seq.append(int(tok))
    ref = [seq[len(p):] for seq, p in zip(seqs, PROMPTS)]
    out = generate(fam, TINY, params, PROMPTS, 6)
    assert out.rows() == ref
    eos = ref[1][2]  # row 1 stops at its third token; the others at their first eos, if any
    out = generate(fam, TINY, params, PROMPTS, 6, eos_id=eos, pad_id=99)
    for r, row in enumerate(ref):
        n = row.index(eos) + 1 if eos in row else 6
        assert out.rows()[r] == row[:n] and out.lengths[r] == n
        assert (out.tokens[r, n:] == 99).all()


def test_lora_adapters_applied_or_merged_give_the_recomputed_greedy_tokens():
    """LoRA on q, v, down (nonzero ``B``): the cached path applies the adapters as the training forward
    does; merged into the weights (PEFT's ``merge_and_unload``) the tokens are the same."""
    cfg = dataclasses.replace(TINY, lora=LoraConfig(rank=4, alpha=8.0, targets="q,v,down"))
    fam, base = _params(cfg)
    shapes = jax.tree.map(lambda x: x[0], lora.adapter_shapes_and_axes(cfg.lora, fam.param_shapes_and_axes(
        cfg, 100)["layers"]), is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple))
    adapters = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(1), a.shape),
                            lora.init_adapters(cfg.lora, shapes, jax.random.key(2)))
    params = lora.merge(base, adapters)
    seqs = [list(p) for p in PROMPTS]
    for _ in range(5):
        for seq, tok in zip(seqs, np.argmax(_recompute_last(fam, cfg, params, seqs), -1)):
            seq.append(int(tok))
    ref = [seq[len(p):] for seq, p in zip(seqs, PROMPTS)]
    assert generate(fam, cfg, params, PROMPTS, 5).rows() == ref
    assert generate(fam, cfg, lora.merged_weights(params, cfg.lora), PROMPTS, 5).rows() == ref
    assert generate(fam, cfg, base, PROMPTS, 5).rows() != ref  # the adapters matter


def test_the_decode_steps_run_in_one_while_loop():
    fam, params = _params(TINY)
    tokens, mask = pad_prompts(PROMPTS)
    fn = make_generator(fam, TINY, 4)
    text = fn.lower(params, tokens, mask, jax.random.key(0)).as_text()
    assert text.count("stablehlo.while") >= 1


def test_sampling_warpers():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 2000)
    draw = jax.vmap(lambda k, s: next_token(logits, k, s), in_axes=(0, None))

    def freq(s):
        return np.bincount(np.asarray(draw(keys, s)).ravel(), minlength=4) / len(keys)

    assert (freq(Sampling(top_k=2))[2:] == 0).all()
    assert (freq(Sampling(top_p=0.7))[2:] == 0).all()  # 0.5 + 0.3 reach 0.7: HF keeps exactly these
    assert (freq(Sampling(top_p=0.4))[1:] == 0).all()  # the most likely token alone
    f = freq(Sampling(temperature=1.0))
    np.testing.assert_allclose(f, [0.5, 0.3, 0.15, 0.05], atol=0.04)
    assert int(next_token(logits, keys[0], Sampling(temperature=0))[0]) == 0


def test_left_align_and_refusals():
    tok, mask = left_align(np.asarray([[4, 5, 6, 0], [7, 0, 0, 0]]), np.asarray([[1, 1, 1, 0], [1, 0, 0, 0]]))
    assert tok.tolist() == [[4, 5, 6], [0, 0, 7]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    fam, _ = _params(TINY)
    with pytest.raises(ValueError, match="at least one token"):
        pad_prompts([[1], []])
    with pytest.raises(ValueError, match="top_p"):
        make_generator(fam, TINY, 4, Sampling(top_p=0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        make_generator(fam, TINY, 0)
    with pytest.raises(ValueError, match="no KV-cached decode path"):
        make_generator(dataclasses.replace(fam, forward_cached=None), TINY, 4)


@pytest.mark.parametrize("cfg, parallel", [
    (TINY, ParallelConfig(tensor_parallel_size=2, zero_stage=3)),
    (MOE, ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2, zero_stage=1)),
], ids=["llama-tp2-fsdp4-zero3", "moe-tp2-ep2-fsdp2-zero1"])
def test_the_same_greedy_tokens_on_one_device_and_on_the_training_mesh(cfg, parallel):
    """The params as training lays them out (tp 2 × fsdp 4 under ZeRO-3; a mixture of experts with ep
    2 too) on 8 simulated devices, the cache constrained to the rules table (kv heads over tp, batch
    over the data axes): the same greedy tokens as on one device."""
    fam = get_family(cfg)
    params = jax.tree.map(lambda a: a * 4 if a.ndim >= 2 else a, fam.init_params(cfg, jax.random.key(0), tp=2))
    prompts = PROMPTS + [[11, 12, 13]]  # the batch divides over the 4 data shards
    one = generate(fam, cfg, params, prompts, 8)
    mesh = make_mesh(parallel, jax.devices()[:8])
    assert dict(mesh.shape)["tp"] == 2 and mesh.size == 8
    rules = rules_for(parallel)
    specs = training_param_specs(cfg, mesh, zero_stage=parallel.zero_stage, rules=rules)
    assert specs["layers"]["wk"] != jax.sharding.PartitionSpec()  # really sharded
    placed = jax.device_put(params, jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    many = generate(fam, cfg, placed, prompts, 8, mesh=mesh, param_specs=specs, rules=rules)
    assert many.rows() == one.rows()


def test_a_list_of_eos_ids_ends_each_row_at_the_first_of_any():
    """``eos_id=[a, b, c]`` (LLaMA 3's ``generation_config.json`` form): a row ends at the first token that
    is any of them, its length counts it, ``pad_id`` fills the rest; a list of one id is that id."""
    fam, params = _params(TINY)
    ref = generate(fam, TINY, params, PROMPTS, 8).rows()
    eos = [ref[0][3], ref[2][1], 97]  # 97: an id no row produces
    out = generate(fam, TINY, params, PROMPTS, 8, eos_id=eos, pad_id=99)
    for r, row in enumerate(ref):
        n = next((i + 1 for i, t in enumerate(row) if t in eos), 8)
        assert out.rows()[r] == row[:n] and out.lengths[r] == n and (out.tokens[r, n:] == 99).all()
    assert min(out.lengths) < 8  # some row did stop early
    one = generate(fam, TINY, params, PROMPTS, 8, eos_id=[ref[0][3]])
    assert one.rows() == generate(fam, TINY, params, PROMPTS, 8, eos_id=ref[0][3]).rows()
    with pytest.raises(ValueError, match="eos_id must be"):
        make_generator(fam, TINY, 4, eos_id=[1, "2"])


@pytest.mark.parametrize("devices", [4, 8], ids=["data2", "data4"])
def test_a_batch_the_data_axes_do_not_divide_is_padded_and_the_pads_dropped(devices):
    """3 prompts on a mesh whose data axes have 2 or 4 shards: the same greedy tokens and lengths as
    without a mesh (no IndivisibleError from JAX), one row per prompt."""
    fam = get_family(TINY)
    params = jax.tree.map(lambda a: a * 4 if a.ndim >= 2 else a, fam.init_params(TINY, jax.random.key(0), tp=2))
    one = generate(fam, TINY, params, PROMPTS, 6, eos_id=[7, 8])
    parallel = ParallelConfig(tensor_parallel_size=2, zero_stage=3)
    mesh = make_mesh(parallel, jax.devices()[:devices])
    rules = rules_for(parallel)
    assert data_shards(mesh, rules) == devices // 2 and len(PROMPTS) % (devices // 2)
    specs = training_param_specs(TINY, mesh, zero_stage=3, rules=rules)
    placed = jax.device_put(params, jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    many = generate(fam, TINY, placed, PROMPTS, 6, eos_id=[7, 8], mesh=mesh, param_specs=specs, rules=rules)
    assert many.tokens.shape == (3, 6) and many.rows() == one.rows()
    np.testing.assert_array_equal(many.lengths, one.lengths)
