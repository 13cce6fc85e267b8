"""Flash attention: the Pallas kernels (interpret mode on CPU) against plain-XLA attention, in value
and in gradient (with sliding windows, sinks and a softmax scale too), and the models with
``attention_impl=flash`` against ``xla`` (LLaMA; GPT-OSS's sinks and alternating windows; Gemma 3's scale
and windows).

The Triton lowering is checked by exporting for CUDA (``jax.export``), not run: on a GPU,
``scripts/gpu_check.sh`` runs it. Tolerance (fp32): outputs and gradients atol 2e-5 (the
observed differences are ≤ 2e-6; the sums run in another order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcolossal.config import config_from_dict
from jaxcolossal.models import get_family, llama
from jaxcolossal.models.layers.attention import local_attention
from jaxcolossal.models.layers.flash_attention import flash_attention, reference_attention

CASES = {  # (b, t, h, kv, d, causal, segments, block)
    "causal_gqa": (2, 64, 4, 2, 16, True, False, 16),
    "causal_odd_length_mqa": (1, 50, 4, 1, 8, True, False, 16),
    "noncausal": (2, 64, 4, 4, 16, False, False, 32),
    "causal_segments": (2, 48, 4, 2, 16, True, True, 16),
    "noncausal_segments_odd": (1, 37, 2, 2, 16, False, True, 16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_reference_in_value_and_gradient(name):
    b, t, h, kv, d, causal, segments, block = CASES[name]
    rng = np.random.default_rng(0)
    q, w = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32) if segments else None
    flash = lambda q, k, v: flash_attention(q, k, v, seg, causal, block, block)
    ref = lambda q, k, v: reference_attention(q, k, v, seg, causal)
    np.testing.assert_allclose(flash(q, k, v), ref(q, k, v), atol=2e-5)
    grads = [jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=(0, 1, 2))(q, k, v) for f in (flash, ref)]
    for got, want, arg in zip(*grads, "qkv"):
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"d{arg}")


OPTIONS = {  # window (a traced int32 scalar when "traced"), sinks, scale
    "window": (7, False, None), "window_traced": ("traced", False, None), "window_wider_than_t": (64, False, None),
    "sinks": (0, True, None), "window_sinks_scale": (20, True, 0.3), "scale": (0, False, 0.3),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_kernel_options_equal_xla_attention_in_value_and_gradient(name):
    """Windows (static and a layer scan's traced constant), GPT-OSS's sinks and Gemma's scale, against
    :func:`local_attention`'s XLA form (which the HF parity tests check against transformers); GQA, 50
    tokens in blocks of 16; gradients of q, k, v and the sinks."""
    window, with_sinks, scale = OPTIONS[name]
    rng = np.random.default_rng(1)
    q, w = (jnp.asarray(rng.normal(size=(2, 50, 4, 16)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(2, 50, 2, 16)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(rng.normal(size=(4,)), jnp.float32) if with_sinks else None

    def run(impl):
        def f(q, k, v, s, win):
            kw = {"block_q": 16, "block_k": 16} if impl == "flash" else {}
            if impl == "flash":
                return flash_attention(q, k, v, None, True, scale=scale, window=win, sinks=s, **kw)
            return local_attention(q, k, v, "xla", None, window=win, scale=scale, sinks=s)
        win = 7 if window == "traced" else window
        jitted = jax.jit(lambda *a: f(*a, jnp.int32(win)) if window == "traced" else f(*a, win))
        grads = jax.grad(lambda *a: jnp.sum(jitted(*a) * w), argnums=(0, 1, 2, 3) if with_sinks else (0, 1, 2))
        return jitted(q, k, v, sinks), grads(q, k, v, sinks)
    (out, grads), (want, want_grads) = run("flash"), run("xla")
    np.testing.assert_allclose(out, want, atol=2e-5)
    for got, ref, arg in zip(grads, want_grads, ("q", "k", "v", "sinks")):
        np.testing.assert_allclose(got, ref, atol=2e-5, err_msg=f"d{arg}")


def test_bad_shapes_are_refused():
    q = jnp.zeros((1, 16, 4, 8))
    with pytest.raises(ValueError, match="kv dividing h"):
        flash_attention(q, jnp.zeros((1, 16, 3, 8)), jnp.zeros((1, 16, 3, 8)))
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(q, q, q, block_q=24)
    with pytest.raises(ValueError, match="needs causal=True"):
        flash_attention(q, q, q, causal=False, window=4)


def test_model_with_flash_equals_xla():
    """LLaMA's summed loss and its gradient with ``attention_impl=flash`` equal ``xla`` (fp32)."""
    raw = {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "intermediate_size": 128, "max_position_embeddings": 64}, "training": {"seq_len": 24}}
    out = []
    for impl in ("xla", "flash"):
        cfg = config_from_dict({**raw, "model": {**raw["model"], "attention_impl": impl}}).model
        params = llama.init_params(cfg, jax.random.key(0))
        x = jax.random.randint(jax.random.key(1), (1, 25), 0, cfg.vocab_size)  # 24 tokens: padded to a block of 32
        out.append(jax.value_and_grad(llama.loss_sum)(params, x[:, :-1], x[:, 1:], cfg))
    (l0, g0), (l1, g1) = out
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g1, g0)


FAMILIES = {  # the families whose options the kernel takes: GPT-OSS (sinks, alternating windows, biases), Gemma 3
    "gpt_oss": {"type": "gpt_oss", "num_experts": 4, "num_experts_per_tok": 2, "attention_sinks": True,
                "attention_bias": "all", "router_bias": True, "expert_bias": True, "swiglu_limit": 7.0,
                "sliding_window": 8, "layer_types": "sliding_attention,full_attention", "router_aux_loss_coef": 0.0},
    "gemma3": {"type": "gemma", "query_pre_attn_scalar": 24.0, "qk_norm": True, "sliding_window": 8,
               "layer_types": "sliding_attention,full_attention", "tie_word_embeddings": True},
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_with_flash_equals_xla(name):
    """The summed loss and its gradient (fp32) with ``attention_impl=flash`` equal ``xla``: every layer's
    window through the layer scan's traced constant, the sinks' gradient, Gemma's scale; 24 tokens."""
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "attention_head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 64,
            "initializer_range": 0.2}
    out = []
    for impl in ("xla", "flash"):
        cfg = config_from_dict({"model": {**base, **FAMILIES[name], "attention_impl": impl},
                                "training": {"seq_len": 24}}).model
        family = get_family(cfg)
        params = family.init_params(cfg, jax.random.key(0))
        x = jax.random.randint(jax.random.key(1), (2, 25), 0, cfg.vocab_size)
        out.append(jax.value_and_grad(family.loss_sum)(params, x[:, :-1], x[:, 1:], cfg))
    (l0, g0), (l1, g1) = out
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    # fp32 sums in another order: each leaf within 1e-5 of its largest entry (measured: at most 3.4e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.max(jnp.abs(b)))), g1, g0)


def test_exports_for_cuda_with_triton_kernels():
    """Forward and backward lower through Triton for CUDA (bf16, GQA, segment ids), from the CPU."""
    q = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    f = jax.jit(lambda q, k, v, s: jax.grad(
        lambda q, k, v: jnp.sum(flash_attention(q, k, v, s).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v))
    exported = jax.export.export(f, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, k, k, seg)
    text = exported.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 2  # the forward and the backward kernel
    assert 'name = "flash_attention_fwd"' in text and 'name = "flash_attention_bwd"' in text


def test_exports_for_cuda_with_a_traced_window_and_sinks():
    """GPT-OSS's options lower through Triton too: a traced window (the layer scan's) and the sinks."""
    q = jax.ShapeDtypeStruct((1, 256, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((8,), jnp.float32)
    win = jax.ShapeDtypeStruct((), jnp.int32)
    f = jax.jit(lambda q, k, v, s, w: jax.grad(lambda q, k, v, s: jnp.sum(flash_attention(
        q, k, v, window=w, sinks=s).astype(jnp.float32)), argnums=(0, 1, 2, 3))(q, k, v, s))
    exported = jax.export.export(f, platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(q, k, k, sinks, win)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 2
