"""GPT-2 (Radford et al., 2019): learned positions, pre-LayerNorm with bias, GELU (tanh), biases.

The same interface as :mod:`jaxcolossal.models.llama` (:class:`jaxcolossal.models.family.Family`) —
:func:`param_shapes_and_axes`, :func:`init_params`, :func:`forward`, :func:`loss_sum` over a params
dict, plus the NNX module :class:`GPT2LMHeadModel` — so the train step, ZeRO and tensor
parallelism apply unchanged. Attention is :mod:`jaxcolossal.models.layers.attention`'s; the remat policies are
:mod:`jaxcolossal.parallel.layer_scan`'s and the embedding and fused LM-head loss :mod:`jaxcolossal.models.layers.vocab`'s. The numerics follow Hugging Face's ``GPT2LMHeadModel`` (``gelu_new``, LayerNorm over
the last dim with ``layer_norm_eps``, scores scaled by 1/sqrt(head_dim)); HF's fused Conv1D
``c_attn`` is stored here as separate q/k/v projections (see :mod:`jaxcolossal.models.hf_io`).

Shapes (b batch, t sequence, d hidden, h heads = kv heads, q head dim, f intermediate, v padded
vocab, P max positions, L layers)::

    wte              [v, d]        (vocab, embed)                    vocab-parallel, tied LM head
    wpe              [P, d]        (seq, embed)
    layers.attn_norm / attn_norm_bias [L, d]  (layers, embed)         ln_1
    layers.wq/wk/wv  [L, d, h, q]  (layers, embed, heads, head_dim)  column-parallel
    layers.bq/bk/bv  [L, h, q]     (layers, heads, head_dim)
    layers.wo        [L, h, q, d]  (layers, heads, head_dim, embed)  row-parallel
    layers.bo        [L, d]        (layers, embed)
    layers.mlp_norm / mlp_norm_bias [L, d]    (layers, embed)         ln_2
    layers.w_fc      [L, d, f]     (layers, embed, mlp)              column-parallel
    layers.b_fc      [L, f]        (layers, mlp)
    layers.w_proj    [L, f, d]     (layers, mlp, embed)              row-parallel
    layers.b_proj    [L, d]        (layers, embed)
    final_norm / final_norm_bias [d]  (embed,)                       ln_f
    lm_head          [d, v]        (embed, vocab)  only when tie_word_embeddings is false

As in LLaMA, initialisation depends only on the seed: the vocabulary rows of ``wte`` (columns
of ``lm_head``) are drawn at the unpadded ``vocab_size`` and the padding is zero
(:func:`jaxcolossal.models.layers.vocab.init_vocab_padded`).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models.layers import vocab
from jaxcolossal.models.layers.attention import attention, write_slots
from jaxcolossal.models.layers.decode_attention import attend_cache
from jaxcolossal.models.layers.linear import column_parallel, row_parallel, tp_overlaps
from jaxcolossal.models.layers.norm import layer_norm
from jaxcolossal.models.layers.vocab import Sharder, embed_lookup, init_vocab_padded, no_shard, padded_vocab_size
from jaxcolossal.parallel.layer_scan import fetch_layer, scan_layers, tag

__all__ = ["param_shapes_and_axes", "init_params", "forward", "loss_sum", "loss_and_stats", "hidden_states",
           "GPT2LMHeadModel"]


def _check(cfg: ModelConfig) -> None:
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise ConfigError(
            f"model.type=gpt2 has no grouped-query attention: model.num_key_value_heads="
            f"{cfg.num_key_value_heads} must equal model.num_attention_heads={cfg.num_attention_heads}")


def param_shapes_and_axes(cfg: ModelConfig, vocab: int) -> dict:
    """``{name: (shape, logical_axes)}`` for every parameter (the table in the module doc).

    Args:
        cfg: the model section (``type: gpt2``).
        vocab: the padded vocabulary size (:func:`jaxcolossal.models.layers.vocab.padded_vocab_size`).

    Raises:
        ConfigError: ``num_key_value_heads != num_attention_heads`` (GPT-2 has no GQA).
    """
    _check(cfg)
    L, d, h, q, f, P = (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.max_position_embeddings)
    vec = ((L, d), ("layers", "embed"))
    layers = {
        "attn_norm": vec, "attn_norm_bias": vec,
        "wq": ((L, d, h, q), ("layers", "embed", "heads", "head_dim")),
        "wk": ((L, d, h, q), ("layers", "embed", "heads", "head_dim")),
        "wv": ((L, d, h, q), ("layers", "embed", "heads", "head_dim")),
        "bq": ((L, h, q), ("layers", "heads", "head_dim")),
        "bk": ((L, h, q), ("layers", "heads", "head_dim")),
        "bv": ((L, h, q), ("layers", "heads", "head_dim")),
        "wo": ((L, h, q, d), ("layers", "heads", "head_dim", "embed")),
        "bo": vec,
        "mlp_norm": vec, "mlp_norm_bias": vec,
        "w_fc": ((L, d, f), ("layers", "embed", "mlp")),
        "b_fc": ((L, f), ("layers", "mlp")),
        "w_proj": ((L, f, d), ("layers", "mlp", "embed")),
        "b_proj": vec,
    }
    out = {"wte": ((vocab, d), ("vocab", "embed")), "wpe": ((P, d), ("seq", "embed")), "layers": layers,
           "final_norm": ((d,), ("embed",)), "final_norm_bias": ((d,), ("embed",))}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((d, vocab), ("embed", "vocab"))
    return out


def _init_leaf(key, name: str, shape, cfg: ModelConfig) -> jax.Array:
    if name.endswith("norm"):
        return jnp.ones(shape, jnp.float32)
    if name.endswith("bias") or name.startswith("b"):
        return jnp.zeros(shape, jnp.float32)
    std = cfg.initializer_range
    if name in ("wo", "w_proj"):  # GPT-2's scaled init of the residual projections (c_proj)
        std = std / math.sqrt(2 * cfg.num_layers)
    return std * jax.random.normal(key, shape, jnp.float32)


class GPT2LMHeadModel(nnx.Module):
    """GPT-2 with its (tied) causal-LM head, as a Flax NNX module.

    Args:
        cfg: the model section of the config (``num_key_value_heads == num_attention_heads``).
        rngs: ``nnx.Rngs`` for initialisation: weights normal(0, initializer_range), residual
            projections (``wo``, ``w_proj``) scaled by 1/sqrt(2L), biases zero, LayerNorm scales one;
            the padded vocabulary rows of ``wte`` and columns of ``lm_head`` zero, the real ones
            drawn at ``vocab_size`` so that they do not depend on ``tp``.
        tp: tensor-parallel size, only to pad the vocabulary (:func:`jaxcolossal.models.layers.vocab.padded_vocab_size`).

    Params are fp32 ``nnx.Param`` with logical ``axes`` metadata. ``__call__(tokens)`` maps
    int32 ``[b, t]`` tokens (t <= max_position_embeddings) to fp32 logits ``[b, t, vocab_size]``
    (padding removed).

    Raises:
        ConfigError: ``num_key_value_heads != num_attention_heads``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, tp: int = 1):
        self.cfg = cfg
        self.vocab = padded_vocab_size(cfg, tp)
        table = param_shapes_and_axes(cfg, self.vocab)
        keys = iter(jax.random.split(rngs.params(), 32))

        def make(name, shape, axes):
            return nnx.Param(init_vocab_padded(_init_leaf, next(keys), name, shape, axes, cfg), axes=axes)

        self.wte = make("wte", *table["wte"])
        self.wpe = make("wpe", *table["wpe"])
        self.layers = nnx.Dict({n: make(n, *sa) for n, sa in table["layers"].items()})
        self.final_norm = make("final_norm", *table["final_norm"])
        self.final_norm_bias = make("final_norm_bias", *table["final_norm_bias"])
        if "lm_head" in table:
            self.lm_head = make("lm_head", *table["lm_head"])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return forward(params, tokens, self.cfg)[..., : self.cfg.vocab_size]


def init_params(cfg: ModelConfig, key: jax.Array, tp: int = 1) -> dict:
    """fp32 params (pure dict) of a fresh :class:`GPT2LMHeadModel`; jit-able.

    Raises:
        ConfigError: ``num_key_value_heads != num_attention_heads``.
    """
    return nnx.to_pure_dict(nnx.state(GPT2LMHeadModel(cfg, rngs=nnx.Rngs(params=key), tp=tp), nnx.Param))


# ----------------------------------------------------------------------------- the computation


QKV_AXES = ("batch", "seq", "heads", "head_dim")


def _project_qkv(x: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder) -> tuple:
    """ln_1 and the q/k/v projections with their biases: x ``[b, t, d]`` -> q, k, v ``[b, t, h, q]``."""
    h = layer_norm(x, lp["attn_norm"], lp["attn_norm_bias"], cfg.layer_norm_eps)
    overlap = tp_overlaps(shard, x.shape[1])  # Megatron-SP's gathers/scatters as ring matmuls
    q, k, v = column_parallel(shard, overlap, h, [("btd,dhq->bthq", lp[w], "h") for w in ("wq", "wk", "wv")],
                              [lp["bq"], lp["bk"], lp["bv"]])
    return (tag(shard(q, QKV_AXES), "query_proj"), tag(shard(k, QKV_AXES), "key_proj"),
            tag(shard(v, QKV_AXES), "value_proj"))


def _attention_output_and_mlp(x: jax.Array, a: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder) -> jax.Array:
    """The rest of the block after attention: the output projection of ``a [b, t, h, q]`` into the
    residual ``x [b, t, d]``, then ln_2 and the GELU MLP with its residual -> ``[b, t, d]``."""
    overlap = tp_overlaps(shard, x.shape[1])
    out = row_parallel(shard, overlap, "bthq,hqd->btd", shard(a, QKV_AXES), lp["wo"], "h", lp["bo"])
    x = shard(x + tag(out, "out_proj"), ("batch", "seq", "embed"))
    h = layer_norm(x, lp["mlp_norm"], lp["mlp_norm_bias"], cfg.layer_norm_eps)
    (u,) = column_parallel(shard, overlap, h, [("btd,df->btf", lp["w_fc"], "f")], [lp["b_fc"]])
    u = tag(shard(u, ("batch", "seq", "mlp")), "mlp_up")
    y = tag(row_parallel(shard, overlap, "btf,fd->btd", jax.nn.gelu(u, approximate=True), lp["w_proj"], "f",
                         lp["b_proj"]), "mlp_down")
    return shard(x + y, ("batch", "seq", "embed"))


def decoder_layer(x: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder = no_shard,
                  segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    """One pre-LN GPT-2 block. x ``[b, t, d]`` in the compute dtype (``positions``: the tokens'
    positions, for sequence-parallel attention's mask)."""
    q, k, v = _project_qkv(x, lp, cfg, shard)
    a = attention(q, k, v, cfg.attention_impl, segment_ids, shard, positions)
    return _attention_output_and_mlp(x, a, lp, cfg, shard)


def hidden_states(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                  vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
                  positions: jax.Array | None = None) -> jax.Array:
    """Final-LayerNorm hidden states ``[b, t, d]`` in the params' dtype for int ``tokens [b, t]``.

    ``t`` must not exceed ``max_position_embeddings`` (the rows of ``wpe``). Packed rows pass
    ``segment_ids``/``positions`` (int ``[b, t]``): attention within a document, positions from 0.
    """
    x = embed_lookup(params["wte"], tokens, shard, vocab_parallel, cfg.embedding_impl)
    t = tokens.shape[1]
    if t > params["wpe"].shape[0]:
        raise ValueError(f"sequence length {t} exceeds max_position_embeddings={params['wpe'].shape[0]}")
    wpe = params["wpe"][:t][None] if positions is None else jnp.take(params["wpe"], positions, axis=0)
    # summed in fp32 (as bf16 + bf16 rounds), so that wpe's gradient is reduced over the batch in fp32
    x = shard((x.astype(jnp.float32) + wpe.astype(jnp.float32)).astype(x.dtype), ("batch", "seq", "embed"))
    x = scan_layers(lambda h, lp: decoder_layer(h, lp, cfg, shard, segment_ids, positions), x, params["layers"],
                    cfg.remat, shard)
    return layer_norm(x, params["final_norm"], params["final_norm_bias"], cfg.layer_norm_eps)


def head_weight(params: dict, cfg: ModelConfig) -> jax.Array:
    """The LM head ``[d, v]``: ``wte.T`` when tied, else ``lm_head``."""
    return params["lm_head"] if "lm_head" in params else params["wte"].T


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
            vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
            positions: jax.Array | None = None) -> jax.Array:
    """Logits ``[b, t, v_padded]`` (fp32) for int ``tokens [b, t]``; padded columns are -1e30.

    The LM head is ``wte.T`` (tied) or ``lm_head`` when ``tie_word_embeddings`` is false. Packed
    rows pass ``segment_ids``/``positions`` as in :func:`hidden_states`.
    """
    h = hidden_states(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions)
    return vocab.logits(h, head_weight(params, cfg), cfg.vocab_size, shard)


head_loss, loss_sum = vocab.lm_loss(hidden_states, head_weight)


# ----------------------------------------------------------------------------- the KV-cached decode path

CACHE_AXES = ("layers", "batch", None, "heads", "head_dim")
"""Logical axes of one cache array ``[L, b, S, h, q]`` (GPT-2's k/v have all the heads)."""


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> dict:
    """An empty KV cache ``{"layers": {"k", "v"}}``, each ``[L, batch, length, h, q]`` zeros of ``dtype``."""
    shape = (cfg.num_layers, batch, length, cfg.num_attention_heads, cfg.head_dim)
    return {"layers": {kv: jnp.zeros(shape, dtype) for kv in "kv"}}


def cache_axes(cfg: ModelConfig) -> dict:
    """The logical axes of :func:`init_cache`'s tree."""
    return {"layers": {kv: CACHE_AXES for kv in "kv"}}


def forward_cached(params: dict, tokens: jax.Array, cache: dict, index: jax.Array, positions: jax.Array,
                   kv_valid: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                   last_only: bool = False) -> tuple[jax.Array, dict]:
    """The forward of ``t`` new tokens against a KV cache, as Hugging Face's ``GPT2LMHeadModel`` with
    ``past_key_values``; arguments, results and padding as
    :func:`jaxcolossal.models.llama.model.forward_cached` (``positions [b, t]`` index ``wpe``, so they
    must stay below ``max_position_embeddings``; beyond it ``jnp.take`` clamps)."""
    x = embed_lookup(params["wte"], tokens, shard, False, cfg.embedding_impl)
    wpe = jnp.take(params["wpe"], positions, axis=0)
    x = shard((x.astype(jnp.float32) + wpe.astype(jnp.float32)).astype(x.dtype), ("batch", "seq", "embed"))

    def body(h, xs):
        lp, kc, vc = xs
        q, k, v = _project_qkv(h, lp, cfg, shard)
        kc = shard(write_slots(kc, k, index), CACHE_AXES[1:])
        vc = shard(write_slots(vc, v, index), CACHE_AXES[1:])
        a = attend_cache(q, kc, vc, index, kv_valid, shard).astype(h.dtype)
        return _attention_output_and_mlp(h, a, lp, cfg, shard), (kc, vc)

    c = cache["layers"]
    x, (ks, vs) = jax.lax.scan(body, x, (fetch_layer(params["layers"]), c["k"], c["v"]))
    h = layer_norm(x[:, -1:] if last_only else x, params["final_norm"], params["final_norm_bias"], cfg.layer_norm_eps)
    return vocab.logits(h, head_weight(params, cfg), cfg.vocab_size, shard), {"layers": {"k": ks, "v": vs}}


def loss_and_stats(params: dict, tokens: jax.Array, targets: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                   vocab_parallel: bool = False, mask: jax.Array | None = None, **aux) -> tuple[jax.Array, dict]:
    """``(loss_sum, {})``: :func:`loss_sum` (summed next-token cross-entropy, nats, fp32 scalar) and
    no statistics (GPT-2 has no router); ``aux``: ``segment_ids``/``positions`` as :func:`loss_sum`."""
    return loss_sum(params, tokens, targets, cfg, shard, vocab_parallel, mask, **aux), {}


def final_norm(params: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The final norm of the last decoder layer's output ``x [b, t, d]`` (``params``: the non-layer leaves
    suffice), what :func:`hidden_states` returns and the LM head reads."""
    return layer_norm(x, params["final_norm"], params["final_norm_bias"], cfg.layer_norm_eps)


def pipeline_stages(cfg: ModelConfig, shard: Sharder = no_shard, vocab_parallel: bool = False,
                    positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None) -> tuple[Callable, Callable, Callable]:
    """The forward cut at a pipeline's stage boundaries, as :func:`jaxcolossal.models.llama.pipeline_stages`:
    ``embed`` (token and position embeddings), ``layer_for(x)``, ``head`` (final LayerNorm, LM head, loss)."""

    def embed(o, tokens):
        x = embed_lookup(o["wte"], tokens, shard, vocab_parallel, cfg.embedding_impl)
        wpe = o["wpe"][: tokens.shape[1]][None] if positions is None else jnp.take(o["wpe"], positions, axis=0)
        return shard(x + wpe.astype(x.dtype), ("batch", "seq", "embed"))

    def layer_for(x):
        return lambda h, p: decoder_layer(h, p, cfg, shard, segment_ids=segment_ids, positions=positions)

    def head(o, x, y):
        return head_loss(o, final_norm(o, x, cfg), y, cfg, shard)
    return embed, layer_for, head
