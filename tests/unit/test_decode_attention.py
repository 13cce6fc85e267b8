"""The flash-decoding kernel (jaxcolossal.models.layers.decode_attention) in the Pallas interpreter on the
CPU against XLA's cached attention: ragged left-padded rows, a cache with holes, GQA and MQA, caches
whose length no block divides, many splits (some empty), sliding windows (static and traced), Gemma's
soft-cap and scale, GPT-OSS's sinks, a row with nothing to attend to; fp32, max abs error ≤ 1e-5
(measured ≤ 2.4e-7). Then the families' decode steps (LLaMA, Gemma 2, GPT-OSS, GPT-2) with the kernel
against without (logits within 1e-5), greedy generation token-equal with and without it on one device
and on a tp 2 × fsdp 4 mesh, and what falls back to XLA's attention.

The Triton lowering is exported for CUDA here (``jax.export``) and compiled by XLA's GPU compiler in
tests/gpu_compile/test_decode_compile.py (slow).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxcolossal.config import ModelConfig, ParallelConfig, config_from_dict
from jaxcolossal.generate import generate, make_generator, pad_prompts, training_param_specs
from jaxcolossal.models import get_family
from jaxcolossal.models.layers.attention import cache_mask, cached_attention
from jaxcolossal.models.layers.decode_attention import attend_cache, flash_decode, kernel_choice, kernel_refusal
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.sharding import Sharder, rules_for

TOL = 1e-5

CASES = {  # b, S, h, kv, d, first valid slot per row, index, window, softcap, sinks, scale, block_k, split
    "ragged_gqa": (3, 41, 8, 2, 16, (0, 5, 20), 29, 0, 0.0, False, None, 16, 512),
    "mqa_odd_length": (2, 37, 4, 1, 32, (3, 0), 36, 0, 0.0, False, None, 16, 16),
    "many_splits": (2, 100, 4, 2, 16, (10, 60), 90, 0, 0.0, False, None, 16, 16),
    "window": (3, 41, 4, 2, 16, (0, 5, 20), 29, 7, 0.0, False, None, 16, 16),
    "softcap_scale": (3, 41, 4, 2, 16, (0, 5, 20), 29, 0, 5.0, False, 0.3, 16, 32),
    "sinks_window": (3, 41, 4, 2, 16, (0, 5, 20), 29, 9, 0.0, True, None, 16, 16),
    "head_dim_64": (2, 20, 4, 2, 64, (0, 8), 19, 0, 0.0, False, None, 64, 512),
}


def _inputs(b, S, h, kv, d, starts, index, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, S, kv, d)), jnp.float32) for _ in range(2))
    valid = np.zeros((b, S), bool)
    for r, start in enumerate(starts):
        valid[r, start:index + 1] = True  # left-padded prompt then its decoded slots; the tail not yet written
    return q, k, v, jnp.asarray(valid)


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_equals_xla_cached_attention(name):
    b, S, h, kv, d, starts, index, window, softcap, with_sinks, scale, block_k, split = CASES[name]
    q, k, v, valid = _inputs(b, S, h, kv, d, starts, index)
    sinks = jnp.asarray(np.random.default_rng(1).normal(size=(h,)), jnp.float32) if with_sinks else None
    mask = cache_mask(jnp.int32(index), 1, valid, window)
    got = flash_decode(q, k, v, mask[:, 0], scale=scale, softcap=softcap, sinks=sinks, block_k=block_k, split=split,
                       interpret=True)
    want = cached_attention(q, k, v, mask, scale, softcap, sinks)
    assert got.shape == want.shape == (b, 1, h, d) and got.dtype == want.dtype
    assert float(jnp.max(jnp.abs(got - want))) <= TOL


def test_holes_a_traced_window_and_a_row_with_nothing_to_attend_to():
    """``kv_valid`` with holes (not one run of slots), the window a traced scalar (a layer scan's
    per-layer constant), and a row with no slot at all: XLA's uniform average over the whole cache."""
    q, k, v, valid = _inputs(3, 40, 4, 2, 16, (0, 4, 0), 33)
    valid = valid.at[0, 10:20].set(False).at[1, 30].set(False).at[2].set(False)

    @jax.jit
    def both(window):
        mask = cache_mask(jnp.int32(33), 1, valid, window)
        return flash_decode(q, k, v, mask[:, 0], block_k=16, split=16, interpret=True), cached_attention(q, k, v, mask)

    for window in (0, 5, 25):
        got, want = both(jnp.int32(window))
        assert float(jnp.max(jnp.abs(got - want))) <= TOL, window


def _jaxpr(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


def test_attend_cache_runs_the_kernel_only_where_asked_and_taken():
    """``decode_kernel`` False: XLA's attention; True: the kernel; None: chosen when lowering (on the CPU
    XLA's attention, equal bit for bit). Shapes the kernel does not take run XLA's attention even with True."""
    q, k, v, valid = _inputs(2, 24, 4, 2, 16, (0, 6), 20)
    index = jnp.int32(20)
    want = cached_attention(q, k, v, cache_mask(index, 1, valid))
    for choice, kernel in ((False, False), (True, True), (None, True)):
        shard = Sharder(None).with_decode_kernel(choice)
        fn = lambda q, k, v: attend_cache(q, k, v, index, valid, shard)  # noqa: E731
        assert ("pallas_call" in _jaxpr(fn, q, k, v)) == kernel, choice
        got = jax.jit(fn)(q, k, v)
        assert float(jnp.max(jnp.abs(got - want))) <= (TOL if choice else 0.0), choice
    on = Sharder(None).with_decode_kernel(True)
    refused = {  # q, k, v: what the kernel refuses
        "new tokens": (jnp.concatenate([q, q], axis=1), k, v),
        "head dims": (q, k, v[..., :8]),
        "power of two": (q[..., :12], k[..., :12], v[..., :12]),
        "slots": (q, k[:, :12], v[:, :12]),
    }
    for what, (qq, kk, vv) in refused.items():
        assert what in kernel_refusal(qq, kk, vv, on)
        ok = valid[:, :kk.shape[1]]
        fn = lambda q, k, v: attend_cache(q, k, v, jnp.int32(10), ok, on)  # noqa: E731
        assert "pallas_call" not in _jaxpr(fn, qq, kk, vv), what
        np.testing.assert_array_equal(fn(qq, kk, vv), cached_attention(qq, kk, vv, cache_mask(jnp.int32(10),
                                                                                      qq.shape[1], ok)))


def test_the_choice_follows_the_mesh_platform():
    """``None``: off on a CPU mesh, decided when lowering without a mesh; explicit choices stay (a GPU
    mesh turns it on: tests/gpu_compile/test_decode_compile.py)."""
    mesh = make_mesh(ParallelConfig(tensor_parallel_size=2, zero_stage=3), jax.devices()[:8])
    assert kernel_choice(None, mesh) is False and kernel_choice(None, None) is None
    assert kernel_choice(True, mesh) is True and kernel_choice(False, None) is False
    on = Sharder(mesh, rules_for(ParallelConfig(tensor_parallel_size=2))).with_decode_kernel(True)
    q, k, v, _ = _inputs(4, 24, 4, 2, 16, (0, 0, 0, 0), 20)
    assert kernel_refusal(q[:3], k[:3], v[:3], on) == "3 rows do not split 4 ways"  # over 4 data shards
    assert kernel_refusal(q, k, v, on) is None


BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 64, "initializer_range": 0.2}
FAMILIES = {  # the families on the sampler, with the options of theirs the kernel takes
    "llama": {},
    "gemma2": {"type": "gemma", "query_pre_attn_scalar": 12.0, "sliding_window": 8, "attn_logit_softcapping": 5.0,
               "layer_types": "sliding_attention,full_attention", "tie_word_embeddings": True},
    "gpt_oss": {"type": "gpt_oss", "num_experts": 4, "num_experts_per_tok": 2, "attention_sinks": True,
                "attention_bias": "all", "sliding_window": 8, "layer_types": "sliding_attention,full_attention",
                "router_aux_loss_coef": 0.0},
    "gpt2": {"type": "gpt2", "num_key_value_heads": 4, "attention_head_dim": 0, "tie_word_embeddings": True},
}
PROMPTS = [[5, 9, 13, 2, 7, 30, 41, 3, 8, 60, 61, 62], [3, 8], [60, 61, 62, 63, 1]]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_familys_decode_steps_with_the_kernel_equal_without(name):
    """The family's cached forward, prefilled (XLA's attention), then 8 decode steps with the kernel and
    without (the same tokens fed): fp32 logits within 1e-5 at every step; windows of 8 over 20 slots."""
    cfg = config_from_dict({"model": {**BASE, **FAMILIES[name]}, "training": {"seq_len": 32}}).model
    fam = get_family(cfg)
    params = fam.init_params(cfg, jax.random.key(0))
    tokens, mask = pad_prompts(PROMPTS)
    b, width = tokens.shape
    steps = 8
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    valid = np.zeros((b, width + steps), bool)
    valid[:, :width] = mask
    prefill = jax.jit(lambda p, x, c, pos, v: fam.forward_cached(p, x, c, jnp.int32(0), pos, v, cfg, last_only=True))
    logits, cache = prefill(params, tokens, fam.init_cache(cfg, b, width + steps), positions, valid)
    step = {on: jax.jit(lambda p, x, c, i, pos, v, on=on: fam.forward_cached(
        p, x, c, i, pos, v, cfg, Sharder(None).with_decode_kernel(on))) for on in (False, True)}
    caches = {False: cache, True: cache}
    pos = positions[:, -1:] + 1
    for i in range(steps):
        tok = jnp.argmax(logits[:, -1, :cfg.vocab_size], axis=-1)[:, None].astype(jnp.int32)
        valid[:, width + i] = True
        out = {}
        for on in (False, True):
            out[on], caches[on] = step[on](params, tok, caches[on], jnp.int32(width + i), pos + i, valid)
        assert float(jnp.max(jnp.abs(out[True] - out[False]))) <= TOL, i
        logits = out[False]
    assert "pallas_call" in _jaxpr(step[True], params, tok, caches[True], jnp.int32(width), pos, valid)


TINY = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                   vocab_size=100)


def _params(cfg, tp=1):
    fam = get_family(cfg)
    return fam, jax.tree.map(lambda a: a * 4 if a.ndim >= 2 else a, fam.init_params(cfg, jax.random.key(0), tp=tp))


def test_greedy_generation_with_the_kernel_is_token_equal_on_one_device():
    """LLaMA, 3 left-padded prompts of 12, 2 and 5 tokens, 12 new tokens (24 slots): the same greedy tokens
    with the kernel (interpreted) as with XLA's attention, and the generator really holds the kernel."""
    fam, params = _params(TINY)
    xla = generate(fam, TINY, params, PROMPTS, 12, decode_kernel=False)
    kernel = generate(fam, TINY, params, PROMPTS, 12, decode_kernel=True)
    assert kernel.rows() == xla.rows()
    np.testing.assert_array_equal(kernel.lengths, xla.lengths)
    tokens, mask = pad_prompts(PROMPTS)
    fn = make_generator(fam, TINY, 12, decode_kernel=True)
    assert "pallas_call" in _jaxpr(fn, params, tokens, mask, jax.random.key(0))


def test_greedy_generation_with_the_kernel_on_a_mesh_equals_one_device():
    """tp 2 × fsdp 4 under ZeRO-3 on 8 simulated devices, the kernel per shard (rows over the data axes,
    heads over tp): the same greedy tokens as one device with XLA's attention; ``None`` on this CPU mesh
    is XLA's attention."""
    fam, params = _params(TINY, tp=2)
    prompts = PROMPTS + [[11, 12, 13]]  # 4 rows over the 4 data shards
    one = generate(fam, TINY, params, prompts, 12, decode_kernel=False)
    parallel = ParallelConfig(tensor_parallel_size=2, zero_stage=3)
    mesh = make_mesh(parallel, jax.devices()[:8])
    rules = rules_for(parallel)
    specs = training_param_specs(TINY, mesh, zero_stage=3, rules=rules)
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    many = generate(fam, TINY, placed, prompts, 12, mesh=mesh, param_specs=specs, rules=rules, decode_kernel=True)
    assert many.rows() == one.rows()
    tokens, mask = pad_prompts(prompts)
    args = (placed, tokens, mask, jax.random.key(0))
    for choice, kernel in ((True, True), (None, False)):
        fn = make_generator(fam, TINY, 12, mesh=mesh, param_specs=specs, rules=rules, decode_kernel=choice)
        assert ("pallas_call" in _jaxpr(fn, *args)) == kernel, choice


def test_the_kernel_in_bf16_stays_near_xla():
    """bf16 caches (the sampler's compute dtype): the kernel and XLA's attention differ only by bf16
    rounding of the output (the probabilities enter p·v in bf16 in both, unnormalised in the kernel)."""
    q, k, v, valid = _inputs(3, 41, 8, 2, 16, (0, 5, 20), 29)
    q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
    mask = cache_mask(jnp.int32(29), 1, valid)
    got = flash_decode(q, k, v, mask[:, 0], block_k=16, split=16, interpret=True)
    want = cached_attention(q, k, v, mask)
    assert got.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))) <= 2e-2



def test_exports_for_cuda_with_the_triton_kernel():
    """Lowered for CUDA from this CPU (``jax.export``; XLA:GPU compiles it in tests/gpu_compile): one Triton
    call, bf16 caches of 1537 slots (the 8B GRPO sampler's; the last block moved back), head dim 128,
    GQA 32/8, a traced window, soft-cap and sinks."""
    q = jax.ShapeDtypeStruct((2, 1, 32, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, 1537, 8, 128), jnp.bfloat16)
    args = (q, cache, cache, jax.ShapeDtypeStruct((2, 1537), jnp.bool_), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((32,), jnp.float32))
    on = Sharder(None).with_decode_kernel(None)  # decided when lowering: the kernel for CUDA

    def f(q, k, v, valid, window, sinks):
        return attend_cache(q, k, v, jnp.int32(1500), valid, on, window, softcap=30.0, sinks=sinks)

    exported = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1
