"""The lean step: the fused, chunked LM-head loss and the masked-gather vocab-parallel embedding
equal the paths they replace, alone and inside training on every layout; remat policies by name;
the HLO FLOP count.

Tolerances (fp32): loss and gradients of the loss alone rtol 1e-5 (atol 1e-6, for gradient
elements of O(1) gradients near zero, summed in another order); training runs as ``test_zero_tp_equivalence`` (loss and grad norm rtol 1e-5,
params by ``tiny.assert_params_match``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny import assert_params_match, run_steps, tiny_config

from jaxcolossal.aot import hlo
from jaxcolossal.config import config_from_dict
from jaxcolossal.models import llama
from jaxcolossal.models.layers import vocab
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.sharding import Sharder

RTOL, ATOL = 1e-5, 1e-6


def _mesh_sharder(tp: int) -> Sharder:
    cfg = config_from_dict({"model": {"num_attention_heads": 4, "num_key_value_heads": 4},
                            "parallel": {"data_parallel_size": 8 // tp, "tensor_parallel_size": tp}})
    return Sharder(make_mesh(cfg.parallel, jax.devices()))


def _head_inputs(b=2, t=37, d=16, v=48, vocab_size=45, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)) * 0.3, jnp.float32)
    w = w.at[:, vocab_size:].set(0.0)
    y = jnp.asarray(rng.integers(0, vocab_size, (b, t)), jnp.int32)
    return h, w, y


@pytest.mark.parametrize("chunk", [1, 10, 37, 64])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_loss_equals_autodiff(chunk, masked):
    """Odd length (37 positions, chunks that do not divide it), padded vocabulary (45 of 48), a
    per-token mask: value and gradients equal the unfused path's."""
    h, w, y = _head_inputs()
    mask = jnp.asarray(np.random.default_rng(1).random(y.shape) > 0.3, jnp.float32) if masked else None

    def ref(h, w):
        return vocab.lm_head_loss(h, w, y, 45, chunk_tokens=0, mask=mask)

    def fused(h, w):
        return vocab.lm_head_loss(h, w, y, 45, chunk_tokens=chunk, mask=mask, force_fused=True)

    (lr, gr), (lf, gf) = [jax.value_and_grad(f, argnums=(0, 1))(h, w) for f in (ref, fused)]
    np.testing.assert_allclose(lf, lr, rtol=RTOL)
    for a, b in zip(gf, gr):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
    assert np.all(np.asarray(gf[1])[:, 45:] == 0), "padded vocabulary columns receive no gradient"


def test_fused_loss_scales_before_casting():
    """bf16 inputs under an fp16-style loss scale: the gradient is scaled in fp32 before the cast,
    so it matches the fp32 gradient to bf16 precision (no underflow to zero)."""
    h, w, y = _head_inputs(t=64)
    scale = 2.0 ** 12

    def loss(h, w, chunk):
        return vocab.lm_head_loss(h, w, y, 45, chunk_tokens=chunk, force_fused=True) * scale / 1e6

    g32 = jax.grad(loss, argnums=(0, 1))(h, w, 16)
    g16 = jax.grad(loss, argnums=(0, 1))(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16), 16)
    for a, b in zip(g16, g32):
        assert a.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-2 * np.abs(b).max())  # bf16 inputs, bf16 result
        assert np.all(a[np.abs(b) > 1e-3 * np.abs(b).max()] != 0), "gradient elements underflowed to zero"


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_head_and_embedding(tp):
    """On a dp × tp mesh, with the vocabulary sharded over tp: the fused loss and the masked-gather
    embedding equal the unsharded computations in value and gradient."""
    shard = _mesh_sharder(tp)
    mesh = shard.mesh
    h, w, y = _head_inputs(b=8, t=24, d=16, v=64, vocab_size=61)
    table = jnp.asarray(np.random.default_rng(2).normal(size=(64, 16)), jnp.float32)
    tokens = y
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    batch = ("dp", "fsdp")
    hs, ws, ys = put(h, P(batch)), put(w, P(None, "tp")), put(y, P(batch))
    ts, toks = put(table, P("tp", None)), put(tokens, P(batch))

    def loss_sharded(h, w, table):
        lm = vocab.lm_head_loss(h, w, ys, 61, shard, chunk_tokens=8, force_fused=True)
        emb = vocab.embed_lookup(table, toks, shard, vocab_parallel=True)
        return lm + jnp.sum(jnp.sin(emb) * h)

    def loss_ref(h, w, table):
        lm = vocab.lm_head_loss(h, w, y, 61, chunk_tokens=0)
        return lm + jnp.sum(jnp.sin(jnp.take(table, tokens, axis=0)) * h)

    got = jax.jit(jax.value_and_grad(loss_sharded, argnums=(0, 1, 2)))(hs, ws, ts)
    want = jax.value_and_grad(loss_ref, argnums=(0, 1, 2))(h, w, table)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6)


def test_masked_gather_has_no_one_hot_matmul():
    """The masked-gather embedding adds no matmul FLOPs; the one-hot one adds 2·T·v·d/tp forward and
    again backward (read from the compiled HLO)."""
    shard = _mesh_sharder(2)
    mesh = shard.mesh
    v, d, b, t = 512, 32, 8, 16
    table = jax.device_put(jnp.ones((v, d), jnp.float32), NamedSharding(mesh, P("tp", None)))
    tokens = jax.device_put(jnp.zeros((b, t), jnp.int32), NamedSharding(mesh, P(("dp", "fsdp"))))

    def flops(impl):
        f = jax.jit(jax.grad(lambda tb: jnp.sum(vocab.embed_lookup(tb, tokens, shard, True, impl) ** 2)))
        return hlo.dot_flops(f.lower(table).compile().as_text())["flops"]

    local_tokens = b * t // 4  # dp = 4
    assert flops("gather") == 0
    assert flops("one_hot") == 2 * (2 * local_tokens * (v // 2) * d)


def test_dot_flops_counts_loop_trips():
    """A matmul inside a 5-step scan counts 5 times (XLA's cost_analysis counts the body once)."""
    def f(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0]

    x, w = jnp.ones((8, 16)), jnp.ones((16, 16))
    text = jax.jit(f).lower(x, w).compile().as_text()
    assert hlo.dot_flops(text) == {"flops": 5 * 2 * 8 * 16 * 16, "dots": 5}


LEAN_MODEL = {"num_key_value_heads": 4, "vocab_size": 250, "vocab_pad_multiple": 16, "loss_chunk_tokens": 48,
              "tie_word_embeddings": True}
LAYOUTS = {  # each also runs one remat policy; the reference runs remat none
    "dp4_tp2_zero2_selective": ({"data_parallel_size": 4, "tensor_parallel_size": 2, "zero_stage": 2},
                                {"remat": "selective"}),
    "dp2_tp4_zero3_save_qkv_proj": ({"data_parallel_size": 2, "tensor_parallel_size": 4, "zero_stage": 3},
                                    {"remat": "save_qkv_proj"}),
    "pp2_tp2_dp2_untied": ({"data_parallel_size": 2, "tensor_parallel_size": 2, "pipeline_parallel_size": 2},
                           {"tie_word_embeddings": False}),
}


@pytest.fixture(scope="module")
def references():
    """Single-device runs on the old path, all logits materialized (``loss_chunk_tokens=0``), with
    tied and with untied embeddings (computed when first asked for)."""
    cache = {}

    def get(tied: bool):
        if tied not in cache:
            cfg = tiny_config({"data_parallel_size": 1},
                              model={**LEAN_MODEL, "loss_chunk_tokens": 0, "tie_word_embeddings": tied})
            state, metrics, _ = run_steps(cfg, jax.devices()[:1])
            cache[tied] = (jax.device_get(state.params), metrics)
        return cache[tied]
    return get


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_lean_training_matches_single_device(name, references):
    """3 steps with the fused head (48-token chunks), the masked-gather embedding and a remat
    policy, on each layout, equal the single-device run on the old paths (padded vocabulary; tied
    and untied heads)."""
    parallel, model = LAYOUTS[name]
    cfg = tiny_config(parallel, model={**LEAN_MODEL, **model})
    per_device_tokens = cfg.training.batch_size // parallel["data_parallel_size"] * cfg.training.seq_len
    if parallel.get("pipeline_parallel_size", 1) == 1:  # the pipeline's microbatches are smaller
        assert vocab.fused_pays(per_device_tokens, cfg.model.hidden_size, 48), "the fused path must be exercised"
    state, metrics, _ = run_steps(cfg, jax.devices())
    ref_params, ref_metrics = references(cfg.model.tie_word_embeddings)
    for got, want in zip(metrics, ref_metrics):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-5)
    assert_params_match(jax.device_get(state.params), ref_params)


def test_remat_policies_cost_what_they_say():
    """The compiled matmul FLOPs of the loss gradient order as the policies recompute:
    none < selective = dots < save_qkv_proj < full (compiled only; their numerics are checked above)."""
    flops = {}
    for policy in ("none", "selective", "dots", "save_qkv_proj", "full"):
        cfg = tiny_config({"data_parallel_size": 1}, model={"remat": policy}).model
        params = jax.eval_shape(lambda k: llama.init_params(cfg, k), jax.random.key(0))
        x = jax.ShapeDtypeStruct((4, 32), jnp.int32)
        f = jax.jit(jax.grad(lambda p, x: llama.loss_sum(p, x, x, cfg)))
        flops[policy] = hlo.dot_flops(f.lower(params, x).compile().as_text())["flops"]
    assert flops["none"] < flops["selective"] == flops["dots"] < flops["save_qkv_proj"] < flops["full"], flops
