"""Flash attention: the Pallas kernels (interpret mode on CPU) against plain-XLA attention, in value
and in gradient, and the model with ``attention_impl=flash`` against ``xla``.

The Triton lowering is checked by exporting for CUDA (``jax.export``), not run: on a GPU,
``scripts/gpu_check.sh`` runs it. Tolerance (fp32): outputs and gradients atol 2e-5 (the
observed differences are ≤ 2e-6; the sums run in another order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcolossal.config import config_from_dict
from jaxcolossal.models import llama
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


def test_bad_shapes_are_refused():
    q = jnp.zeros((1, 16, 4, 8))
    with pytest.raises(ValueError, match="kv dividing h"):
        flash_attention(q, jnp.zeros((1, 16, 3, 8)), jnp.zeros((1, 16, 3, 8)))
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(q, q, q, block_q=24)


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
