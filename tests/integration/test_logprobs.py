"""Per-token log-probs and the LM loss chunked over tokens and vocabulary
(:mod:`jaxcolossal.models.layers.logprobs`): equal to the full-logits computation in value and in
the gradients w.r.t. the hidden states and the head, on one device and vocab-parallel under tp 2;
and the compiled temporaries that are the point of it (issue 42, section 3).

Tolerances (fp32): values rtol 1e-5; gradients rtol 1e-5, atol 1e-6 (elements near zero of O(1)
gradients, summed in another order), as ``test_lean_step``'s fused-loss tests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcolossal.config import config_from_dict
from jaxcolossal.models.layers import logprobs, vocab
from jaxcolossal.parallel.mesh import make_mesh
from jaxcolossal.parallel.sharding import Sharder
from jaxcolossal.train.optimizer import build_optimizer
from jaxcolossal.train.state import init_state, make_plan
from jaxcolossal.train.step import make_train_step

RTOL, ATOL = 1e-5, 1e-6


def _inputs(b=2, t=37, d=16, v=48, vocab_size=45, seed=0):
    """fp32 hidden ``[b, t, d]``, head ``[d, v]`` (columns ``>= vocab_size`` zero, as padded),
    targets ``[b, t]``, and a 0/1 mask ``[b, t]``."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)) * 0.3, jnp.float32).at[:, vocab_size:].set(0.0)
    y = jnp.asarray(rng.integers(0, vocab_size, (b, t)), jnp.int32)
    mask = jnp.asarray(rng.random((b, t)) > 0.3, jnp.float32)
    return h, w, y, mask


def _value_and_grads(f, h, w, cot):
    """``f(h, w) -> [b, t]``, its value and the gradients of ``sum(f · cot)`` w.r.t. ``h`` and ``w``."""
    return f(h, w), jax.grad(lambda h, w: jnp.sum(f(h, w) * cot), argnums=(0, 1))(h, w)


def _assert_close(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("chunk_tokens,chunk_vocab,v", [(10, 7, 48), (37, 16, 48), (1, 0, 48), (64, 10, 47),
                                                       (16, 100, 48)])
def test_logprobs_equal_full_logits(chunk_tokens, chunk_vocab, v):
    """Odd length (37 positions; token chunks that do not divide it), padded vocabulary (45 real
    of 48; of 47, whose chunks of 10 need the head padded too), a mask, and a random cotangent per
    token: the chunked log-probs equal the full fp32 logits' ``log_softmax[token]`` in value and
    gradient, and the padded columns get no gradient."""
    h, w, y, mask = _inputs(v=v)
    cot = jnp.asarray(np.random.default_rng(3).normal(size=y.shape), jnp.float32)

    def ref(h, w):
        return jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w[:, :45]), axis=-1)[
            jnp.arange(2)[:, None], jnp.arange(37)[None], y] * mask

    def chunked(h, w):
        return logprobs.token_logprobs(h, w, y, mask, 45, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)

    got = _value_and_grads(chunked, h, w, cot)
    _assert_close(got, _value_and_grads(ref, h, w, cot))
    assert np.all(np.asarray(got[0])[np.asarray(mask) == 0] == 0), "masked positions are 0"
    assert np.all(np.asarray(got[1][1])[:, 45:] == 0), "padded vocabulary columns receive no gradient"


@pytest.mark.parametrize("chunk_vocab", [0, 7, 16])
def test_loss_equals_full_logits(chunk_vocab):
    """``lm_head_loss`` on the chunked path (token chunks of 10, vocab chunks of ``chunk_vocab``)
    equals the unchunked loss with a mask, in value and gradient."""
    h, w, y, mask = _inputs()

    def loss(chunk):
        return lambda h, w: vocab.lm_head_loss(h, w, y, 45, chunk_tokens=chunk, mask=mask, force_fused=True,
                                               chunk_vocab=chunk_vocab)

    got, want = [jax.value_and_grad(loss(c), argnums=(0, 1))(h, w) for c in (10, 0)]
    _assert_close(got, want)


@pytest.mark.parametrize("chunk_tokens,chunk_vocab", [(10, 7), (37, 0), (0, 0)])
def test_softcapped_logprobs_equal_full_logits(chunk_tokens, chunk_vocab):
    """Gemma's final soft-cap (``softcap`` 2, where logits of about ±3 bend hard): the chunked log-probs
    (and the unchunked reference path, ``chunk_tokens`` 0) equal ``log_softmax(2·tanh(h @ w / 2))[token]``
    in value and gradient (the custom VJP's ``1 − (logit/c)²`` slope), and the padded columns get no
    gradient; the loss through ``lm_head_loss`` likewise."""
    h, w, y, mask = _inputs()
    cot = jnp.asarray(np.random.default_rng(3).normal(size=y.shape), jnp.float32)

    def ref(h, w):
        lg = 2.0 * jnp.tanh(jnp.einsum("btd,dv->btv", h, w[:, :45]) / 2.0)
        return jax.nn.log_softmax(lg, axis=-1)[jnp.arange(2)[:, None], jnp.arange(37)[None], y] * mask

    def chunked(h, w):
        return logprobs.token_logprobs(h, w, y, mask, 45, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab,
                                       softcap=2.0)

    got = _value_and_grads(chunked, h, w, cot)
    _assert_close(got, _value_and_grads(ref, h, w, cot))
    assert np.all(np.asarray(got[1][1])[:, 45:] == 0), "padded vocabulary columns receive no gradient"
    loss = jax.value_and_grad(lambda h, w: vocab.lm_head_loss(h, w, y, 45, chunk_tokens=chunk_tokens, mask=mask,
                                                              force_fused=True, chunk_vocab=chunk_vocab, softcap=2.0),
                              argnums=(0, 1))(h, w)
    _assert_close(loss, jax.value_and_grad(lambda h, w: -jnp.sum(ref(h, w)), argnums=(0, 1))(h, w))


def test_vocab_parallel_tp2():
    """dp 4 × tp 2 on the 8 simulated devices, the head's vocabulary over tp (each shard's 32
    columns in vocab chunks of 8, the last shard holding the 3 padded ones): log-probs and loss
    equal the unsharded full-logits computation in value and gradient."""
    cfg = config_from_dict({"model": {"num_attention_heads": 4, "num_key_value_heads": 4},
                            "parallel": {"data_parallel_size": 4, "tensor_parallel_size": 2}})
    shard = Sharder(make_mesh(cfg.parallel, jax.devices()))
    h, w, y, mask = _inputs(b=8, t=24, v=64, vocab_size=61)
    cot = jnp.asarray(np.random.default_rng(3).normal(size=y.shape), jnp.float32)
    put = lambda x, spec: jax.device_put(x, NamedSharding(shard.mesh, spec))  # noqa: E731
    batch = ("dp", "fsdp")
    hs, ws, ys, ms, cs = put(h, P(batch)), put(w, P(None, "tp")), put(y, P(batch)), put(mask, P(batch)), put(cot, P(batch))

    def lp_sharded(h, w):
        return logprobs.token_logprobs(h, w, ys, ms, 61, shard, chunk_tokens=8, chunk_vocab=8)

    def lp_ref(h, w):
        return logprobs.full_logprobs(h, w, y, 61) * mask

    got = jax.jit(lambda h, w: _value_and_grads(lp_sharded, h, w, cs))(hs, ws)
    _assert_close(got, _value_and_grads(lp_ref, h, w, cot))
    loss = jax.jit(jax.value_and_grad(lambda h, w: vocab.lm_head_loss(h, w, ys, 61, shard, 8, ms, True, 8),
                                      argnums=(0, 1)))(hs, ws)
    _assert_close(loss, jax.value_and_grad(lambda h, w: vocab.lm_head_loss(h, w, y, 61, mask=mask),
                                           argnums=(0, 1))(h, w))
    capped = jax.jit(jax.value_and_grad(lambda h, w: vocab.lm_head_loss(h, w, ys, 61, shard, 8, ms, True, 8, 2.0),
                                        argnums=(0, 1)))(hs, ws)  # Gemma's final soft-cap, vocab-parallel
    _assert_close(capped, jax.value_and_grad(lambda h, w: vocab.lm_head_loss(h, w, y, 61, mask=mask, softcap=2.0),
                                             argnums=(0, 1))(h, w))


# ----------------------------------------------------------------------------- memory (compiled, CPU)

VOCAB, HIDDEN, BATCH, SEQ = 128256, 256, 2, 1024
FP32_LOGITS = BATCH * SEQ * VOCAB * 4  # the batch's fp32 logits, bytes


def test_pretraining_step_temporaries_under_half_the_logits():
    """Issue 42's figure: the bf16 pre-training step of a 1-layer LLaMA (hidden 256, vocab 128256,
    batch 2 × seq 1024, 1 device) holds temporaries under 0.5× its fp32 logits (1.35× with the
    loss chunked over tokens only; its fp32 embedding and head gradients alone are 0.25×)."""
    model = dict(type="llama", num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=512, max_position_embeddings=SEQ, vocab_size=VOCAB)
    cfg = config_from_dict({"model": model, "training": {"batch_size": BATCH, "seq_len": SEQ},
                            "parallel": {"data_parallel_size": 1}, "precision": {"bf16": True}})
    plan = make_plan(cfg, make_mesh(cfg.parallel, jax.devices()[:1]))
    tx = build_optimizer(cfg.training, plan)
    state = jax.eval_shape(lambda k: init_state(plan, tx, key=k), jax.random.key(0))
    x = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32, sharding=plan.batch_sharding)
    temp = make_train_step(plan, tx).lower(state, {"inputs": x, "targets": x}).compile().memory_analysis().temp_size_in_bytes
    assert temp < 0.5 * FP32_LOGITS, f"{temp / FP32_LOGITS:.3f}× the fp32 logits"


def test_logprobs_temporaries_at_128k_vocab():
    """The log-probs of a batch (2 × 1024 tokens, hidden 256, bf16) at vocab 128256, alone and with
    their gradient w.r.t. the hidden states and the head, hold temporaries of at most 0.25× the
    batch's fp32 logits (default chunks: 1024 tokens × 8016 columns)."""
    h = jax.ShapeDtypeStruct((BATCH, SEQ, HIDDEN), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((HIDDEN, VOCAB), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)

    def lp(h, w, y):
        return logprobs.token_logprobs(h, w, y, None, VOCAB)

    def with_grad(h, w, y):
        return jax.value_and_grad(lambda h, w: jnp.sum(lp(h, w, y)), argnums=(0, 1))(h, w)

    for f in (lp, with_grad):
        temp = jax.jit(f).lower(h, w, y).compile().memory_analysis().temp_size_in_bytes
        assert temp <= 0.25 * FP32_LOGITS, f"{f.__name__}: {temp / FP32_LOGITS:.3f}× the fp32 logits"


@pytest.mark.parametrize("temperature,softcap", [(1.0, 0.0), (0.7, 5.0)])
def test_the_extras_equal_the_materialised_logits(temperature, softcap):
    """Entropy, mean logit and top-1 (TRL's fused head's extra outputs) from the chunked path (token and vocab
    chunks, a padded vocabulary of 45 in 50 columns) equal those of the whole logits, and carry no gradient."""
    k = jax.random.split(jax.random.key(0), 3)
    h, w = jax.random.normal(k[0], (3, 13, 16)), jax.random.normal(k[1], (16, 50)) * 0.5
    y = jax.random.randint(k[2], (3, 13), 0, 45)
    y = y.at[0].set(jnp.argmax(jnp.einsum("btd,dv->btv", h, w)[0, :, :45], -1))  # row 0: every target the top-1
    mask = (jnp.arange(13)[None] < jnp.array([[13], [7], [3]])).astype(jnp.float32)
    lg = logprobs.soft_cap(jnp.einsum("btd,dv->btv", h, w), softcap)[..., :45] / temperature
    lps = jax.nn.log_softmax(lg, -1)
    want = {"entropy": -jnp.sum(jnp.exp(lps) * lps, -1) * mask, "mean_logits": lg.mean(-1) * mask,
            "is_top1": (jnp.argmax(lg, -1) == y).astype(jnp.float32) * mask}
    _, got = logprobs.token_logprobs(h, w, y, mask, 45, chunk_tokens=8, chunk_vocab=8, softcap=softcap,
                                     temperature=temperature, extras=logprobs.EXTRAS)
    for name, v in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(v), atol=3e-6, err_msg=name)
    assert float(got["is_top1"][0].sum()) == 13
    g = jax.grad(lambda h: sum(jnp.sum(v) for v in logprobs.token_logprobs(
        h, w, y, mask, 45, chunk_tokens=8, chunk_vocab=8, extras=logprobs.EXTRAS)[1].values()))(h)
    assert float(jnp.abs(g).max()) == 0.0
