"""DeepSeek-V3 (DeepSeek-AI, 2024): multi-head latent attention (MLA) and DeepSeek-MoE, as transformers'
``models/deepseek_v3/modeling_deepseek_v3.py`` computes them.

MLA (DeepSeek-V2, 2024) compresses keys and values into one latent per token: ``c = RMSNorm(x·W_kv_a)``
``[b, t, r_kv]`` and a rotary key ``k_r = RoPE(x·W_k_rope)`` ``[b, t, r]`` shared by all heads; each
head's key is ``[c·W_k_b, k_r]`` (``qk_nope_head_dim + qk_rope_head_dim``) and its value ``c·W_v_b``
(``v_head_dim``). Queries come from ``x`` directly (``q_lora_rank`` 0) or through their own latent
(``q_lora_rank``: ``RMSNorm(x·W_q_a)·W_q_b``); RoPE turns only their last ``qk_rope_head_dim``
dimensions. The softmax scale is ``qk_head_dim^-1/2`` times yarn's ``mscale(factor, mscale_all_dim)²``
(:func:`softmax_scale`). The KV cache holds the latent and the rotary key only
(:func:`init_cache`); the decode path absorbs ``W_k_b`` into the queries and ``W_v_b`` into the
output (multi-query attention over the latent, :func:`forward_cached`).

RoPE runs in Hugging Face's rotate-half layout here; DeepSeek's checkpoints lay the rotary dimensions
out in interleaved pairs (``rope_interleave``), which :mod:`jaxcolossal.models.deepseek.hf` permutes on
import and export, so the math is the same.

Params (L layers stacked as ``dense_layers [k]`` for the first ``first_k_dense`` and ``layers``
for the rest, each with its own MLP; b batch, t sequence, d hidden, h heads, q = nope + rope, v
value dims, f intermediate, v padded vocab)::

    embed_tokens [v, d]                  (vocab, embed)
    layers.attn_norm [L, d]              (layers, embed)
    layers.wq_a  [L, d, r_q]             (layers, embed, latent)          q_lora_rank > 0
    layers.q_norm [L, r_q]               (layers, latent)
    layers.wq_b  [L, r_q, h, q]          (layers, latent, heads, head_dim) column-parallel
    layers.wq    [L, d, h, q]            (layers, embed, heads, head_dim)  q_lora_rank 0; column-parallel
    layers.wkv_a [L, d, r_kv]            (layers, embed, latent)
    layers.kv_norm [L, r_kv]             (layers, latent)
    layers.wk_rope [L, d, r]             (layers, embed, head_dim)
    layers.wk_b  [L, r_kv, h, nope]      (layers, latent, heads, head_dim) column-parallel
    layers.wv_b  [L, r_kv, h, v]         (layers, latent, heads, head_dim) column-parallel
    layers.wo    [L, h, v, d]            (layers, heads, head_dim, embed)  row-parallel
    layers.mlp_norm [L, d]               (layers, embed)
    layers.w_gate/w_up [L, d, f], w_down [L, f, d]   a dense SwiGLU, or the mixture of experts of
                                         :func:`jaxcolossal.models.layers.moe.layer_shapes_and_axes`
    final_norm [d]; lm_head [d, v]       (absent when tie_word_embeddings)

The latent is not split over ``tp`` (the ``latent`` axis is replicated): each tp rank expands its
heads from the whole latent, as transformers' tensor-parallel plan does.

LoRA (``model.lora``, :mod:`jaxcolossal.models.layers.lora`) adapts MLA's projections in both stacks:
``wq_a``, ``wq_b`` (or ``wq``), ``wo``, and the fused modules of Hugging Face with one A each,
``kv_a_proj_with_mqa`` over ``wkv_a`` and ``wk_rope`` (added before the latent's norm and RoPE) and
``kv_b_proj`` over ``wk_b`` and ``wv_b``. The cached decode path merges a layer's adapters into its
weights before absorbing them (:func:`_cached_stack`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcolossal.config import ModelConfig
from jaxcolossal.models.family import stacked_params
from jaxcolossal.models.layers import moe, vocab
from jaxcolossal.models.layers.attention import attention, cache_mask, cached_attention, write_slots
from jaxcolossal.models.layers.lora import (DROPOUT_KEY, EQUATIONS, adapt, adapt_fused, merged_layer,
                                            with_dropout_keys)
from jaxcolossal.models.layers.linear import column_parallel, projection, row_parallel, tp_overlaps
from jaxcolossal.models.layers.norm import rms_norm
from jaxcolossal.models.layers.rope import apply_rope, rope_tables, yarn_factor, yarn_mscale
from jaxcolossal.models.layers.vocab import Sharder, embed_lookup, no_shard, padded_vocab_size
from jaxcolossal.parallel.layer_scan import fetch_layer, scan_layers, tag

LATENT_NORM_EPS = 1e-6
"""The epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``: transformers builds them with
``DeepseekV3RMSNorm``'s default, not the config's ``rms_norm_eps``."""

RESIDUAL_OUTPUTS = ("wo", "w_down", "moe_w_down", "shared_w_down")
"""The projections into the residual stream, initialised with ``initializer_range / sqrt(2L)``."""


def qk_head_dim(cfg: ModelConfig) -> int:
    """A query/key head's size: ``qk_nope_head_dim + qk_rope_head_dim``."""
    return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


def softmax_scale(cfg: ModelConfig) -> float:
    """The softmax scale of q·k: ``qk_head_dim^-1/2``, times ``mscale(factor, mscale_all_dim)²`` when
    RoPE is scaled and ``mscale_all_dim`` set (transformers' ``yarn_apply_mscale``)."""
    scale = qk_head_dim(cfg) ** -0.5
    r = cfg.rope
    if r.type != "default" and r.mscale_all_dim:
        factor = yarn_factor(r, cfg.max_position_embeddings) if r.type == "yarn" else r.factor
        m = yarn_mscale(factor, r.mscale_all_dim)
        scale = scale * m * m
    return scale


def _layer_table(cfg: ModelConfig, L: int, experts: bool) -> dict:
    """One stack of ``L`` decoder layers: MLA and norms, then a dense SwiGLU or (``experts``) the MoE MLP."""
    d, h, f = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size
    q, rq, rkv, r = qk_head_dim(cfg), cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    layers = {"attn_norm": ((L, d), ("layers", "embed"))}
    if rq:
        layers.update(wq_a=((L, d, rq), ("layers", "embed", "latent")), q_norm=((L, rq), ("layers", "latent")),
                      wq_b=((L, rq, h, q), ("layers", "latent", "heads", "head_dim")))
    else:
        layers["wq"] = ((L, d, h, q), ("layers", "embed", "heads", "head_dim"))
    layers.update(
        wkv_a=((L, d, rkv), ("layers", "embed", "latent")), kv_norm=((L, rkv), ("layers", "latent")),
        wk_rope=((L, d, r), ("layers", "embed", "head_dim")),
        wk_b=((L, rkv, h, cfg.qk_nope_head_dim), ("layers", "latent", "heads", "head_dim")),
        wv_b=((L, rkv, h, cfg.v_head_dim), ("layers", "latent", "heads", "head_dim")),
        wo=((L, h, cfg.v_head_dim, d), ("layers", "heads", "head_dim", "embed")),
        mlp_norm=((L, d), ("layers", "embed")))
    if experts:
        layers.update(moe.layer_shapes_and_axes(cfg))
    else:
        layers.update(w_gate=((L, d, f), ("layers", "embed", "mlp")), w_up=((L, d, f), ("layers", "embed", "mlp")),
                      w_down=((L, f, d), ("layers", "mlp", "embed")))
    return layers


def param_shapes_and_axes(cfg: ModelConfig, vocab: int) -> dict:
    """``{name: (shape, logical_axes)}`` for every parameter (the table in the module doc): the MoE
    layers as ``layers``, the first ``first_k_dense`` dense ones as ``dense_layers``."""
    d = cfg.hidden_size
    out = {"embed_tokens": ((vocab, d), ("vocab", "embed")),
           "layers": _layer_table(cfg, cfg.moe_layers or cfg.num_layers, cfg.moe),
           "final_norm": ((d,), ("embed",))}
    if cfg.moe and cfg.first_k_dense:
        out["dense_layers"] = _layer_table(cfg, cfg.first_k_dense, False)
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((d, vocab), ("embed", "vocab"))
    return out


def _init_leaf(key, name: str, shape, cfg: ModelConfig) -> jax.Array:
    """Norm scales one, the router's score-correction bias zero, the rest normal(0, initializer_range)
    (the residual outputs' divided by ``sqrt(2L)``)."""
    if name.endswith("norm"):
        return jnp.ones(shape, jnp.float32)
    if name == "router_score_bias":
        return jnp.zeros(shape, jnp.float32)
    std = cfg.initializer_range
    if name in RESIDUAL_OUTPUTS:
        std = std / math.sqrt(2 * cfg.num_layers)
    return std * jax.random.normal(key, shape, jnp.float32)


class DeepseekV3ForCausalLM(nnx.Module):
    """DeepSeek-V3 decoder with a causal-LM head, as a Flax NNX module.

    Args:
        cfg: the model section of the config (``type=deepseek``).
        rngs: ``nnx.Rngs`` for initialisation (:func:`_init_leaf`; the padded vocabulary rows zero:
            :func:`jaxcolossal.models.layers.vocab.init_vocab_padded`).
        tp: tensor-parallel size, only to pad the vocabulary.

    Params are fp32 ``nnx.Param`` with logical ``axes`` metadata. ``__call__(tokens)`` maps int32
    ``[b, t]`` tokens to fp32 logits ``[b, t, vocab_size]``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, tp: int = 1):
        self.cfg = cfg
        self.vocab = padded_vocab_size(cfg, tp)
        stacked_params(self, cfg, param_shapes_and_axes(cfg, self.vocab), rngs.params(), _init_leaf)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return forward(params, tokens, self.cfg)[..., : self.cfg.vocab_size]


def init_params(cfg: ModelConfig, key: jax.Array, tp: int = 1) -> dict:
    """fp32 params (pure dict) of a fresh :class:`DeepseekV3ForCausalLM`; jit-able."""
    return nnx.to_pure_dict(nnx.state(DeepseekV3ForCausalLM(cfg, rngs=nnx.Rngs(params=key), tp=tp), nnx.Param))


# ----------------------------------------------------------------------------- multi-head latent attention


def project_q(h: jax.Array, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard) -> jax.Array:
    """The queries of the normed input ``h [b, t, d]``: through the q latent (``q_lora_rank``) or
    directly (each projection with its LoRA adapter where ``lp`` holds one), their last
    ``qk_rope_head_dim`` dimensions rotated -> ``[b, t, h, q]`` (compute dtype)."""
    column = partial(column_parallel, shard, tp_overlaps(shard, h.shape[1]))
    lora = partial(adapt, lp=lp, lora=cfg.lora, dropout_key=lp.get(DROPOUT_KEY))
    if "wq_a" in lp:
        c = lora(EQUATIONS["wq_a"], h, projection(shard)("btd,dr->btr", h, lp["wq_a"]), name="wq_a")
        c = rms_norm(c, lp["q_norm"], LATENT_NORM_EPS)
        (q,) = column(c, [("btr,rhq->bthq", lp["wq_b"], "h")])
        q = lora(EQUATIONS["wq_b"], c, q, name="wq_b")
    else:
        (q,) = column(h, [("btd,dhq->bthq", lp["wq"], "h")])
        q = lora(EQUATIONS["wq"], h, q, name="wq")
    q = shard(q, ("batch", "seq", "heads", "head_dim"))
    nope = cfg.qk_nope_head_dim
    return jnp.concatenate([q[..., :nope], apply_rope(q[..., nope:], cos, sin)], axis=-1)


def project_latent(h: jax.Array, lp: dict, cfg: ModelConfig, cos, sin,
                   shard: Sharder = no_shard) -> tuple[jax.Array, jax.Array]:
    """What the KV cache holds of the normed input ``h [b, t, d]``: the normed latent ``[b, t, r_kv]``
    (``kv_a_layernorm``, before ``kv_b_proj``) and the rotated shared key ``[b, t, r]``; with LoRA on
    ``kv_a_proj_with_mqa``, its one adapter added to both before the norm and RoPE, as PEFT adds it to
    the fused output."""
    proj = projection(shard)
    c, k_rope = proj("btd,dr->btr", h, lp["wkv_a"]), proj("btd,dr->btr", h, lp["wk_rope"])
    c, k_rope = adapt_fused(h, (c, k_rope), lp, "wkv_a", cfg.lora, lp.get(DROPOUT_KEY))
    c = rms_norm(c, lp["kv_norm"], LATENT_NORM_EPS)
    k_rope = apply_rope(k_rope[:, :, None, :], cos, sin)[:, :, 0, :]
    return shard(c, ("batch", "seq", "latent")), shard(k_rope, ("batch", "seq", "head_dim"))


def expand_kv(c: jax.Array, k_rope: jax.Array, lp: dict, cfg: ModelConfig,
              shard: Sharder = no_shard) -> tuple[jax.Array, jax.Array]:
    """Per-head keys ``[b, t, h, q]`` (the latent's ``kv_b_proj`` nope part, then the shared rotary key)
    and values ``[b, t, h, v]`` of a latent ``c [b, t, r_kv]`` and ``k_rope [b, t, r]`` (with LoRA on
    ``kv_b_proj``, its one adapter over both)."""
    column = partial(column_parallel, shard, tp_overlaps(shard, c.shape[1]))
    k_nope, v = column(c, [("btr,rhk->bthk", lp["wk_b"], "h"), ("btr,rhv->bthv", lp["wv_b"], "h")])
    k_nope, v = adapt_fused(c, (k_nope, v), lp, "wk_b", cfg.lora, lp.get(DROPOUT_KEY))
    k_nope = shard(k_nope, ("batch", "seq", "heads", "head_dim"))
    shared = jnp.broadcast_to(k_rope[:, :, None, :], (*k_nope.shape[:3], k_rope.shape[-1])).astype(k_nope.dtype)
    k = shard(jnp.concatenate([k_nope, shared], axis=-1), ("batch", "seq", "heads", "head_dim"))
    return k, shard(v, ("batch", "seq", "heads", "head_dim"))


def attention_output(x: jax.Array, a: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder = no_shard) -> jax.Array:
    """The output projection (and its LoRA adapter) of the attended values ``a [b, t, h, v]`` added to
    the residual ``x [b, t, d]``."""
    row = partial(row_parallel, shard, tp_overlaps(shard, x.shape[1]))
    a = shard(a, ("batch", "seq", "heads", "head_dim"))
    o = adapt(EQUATIONS["wo"], a, row("bthv,hvd->btd", a, lp["wo"], "h"), lp, "wo", cfg.lora, lp.get(DROPOUT_KEY))
    o = tag(o, "out_proj")
    return shard(x + o, ("batch", "seq", "embed"))


def attention_block(x: jax.Array, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard,
                    segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    """The MLA half of a block with its residual: x ``[b, t, d]`` -> ``[b, t, d]`` (keys and values
    expanded from the latent, then :func:`jaxcolossal.models.layers.attention.attention` with
    :func:`softmax_scale`; ``dv`` may differ from ``dq``)."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = tag(project_q(h, lp, cfg, cos, sin, shard), "query_proj")
    c, k_rope = project_latent(h, lp, cfg, cos, sin, shard)
    k, v = expand_kv(c, k_rope, lp, cfg, shard)
    k, v = tag(k, "key_proj"), tag(v, "value_proj")
    a = attention(q, k, v, cfg.attention_impl, segment_ids, shard, positions, scale=softmax_scale(cfg))
    return attention_output(x, a, lp, cfg, shard)


# ----------------------------------------------------------------------------- the MLPs and the layers


def mlp_block(x: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder = no_shard) -> jax.Array:
    """The dense SwiGLU half of a block with its residual: x ``[b, t, d]`` -> ``[b, t, d]``."""
    overlap = tp_overlaps(shard, x.shape[1])
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    g, u = column_parallel(shard, overlap, h, [("btd,df->btf", lp["w_gate"], "f"), ("btd,df->btf", lp["w_up"], "f")])
    g = tag(shard(g, ("batch", "seq", "mlp")), "mlp_gate")
    u = tag(shard(u, ("batch", "seq", "mlp")), "mlp_up")
    y = tag(row_parallel(shard, overlap, "btf,fd->btd", jax.nn.silu(g) * u, lp["w_down"], "f"), "mlp_down")
    return shard(x + y, ("batch", "seq", "embed"))


def moe_block(x: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder = no_shard) -> tuple[jax.Array, dict]:
    """The mixture-of-experts half of a block with its residual (:func:`jaxcolossal.models.layers.moe.moe_mlp`:
    routed and shared experts): ``(x [b, t, d], this layer's router statistics)``."""
    manual = getattr(shard, "manual_experts", None)  # inside a pipeline's shard_map
    mesh = None if manual else getattr(shard, "mesh", None)
    y, stats = moe.moe_mlp(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp, cfg, mesh, manual)
    return shard(x + y, ("batch", "seq", "embed")), stats


def decoder_layer(x: jax.Array, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard,
                  segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> jax.Array:
    """One block with a dense MLP (DeepSeek's first ``first_k_dense``). x ``[b, t, d]``."""
    x = attention_block(x, lp, cfg, cos, sin, shard, segment_ids, positions)
    return mlp_block(x, lp, cfg, shard)


def moe_decoder_layer(carry: tuple, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard,
                      segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> tuple:
    """One block with a mixture of experts: ``(x [b, t, d], stats) -> (x, stats + this layer's)``."""
    x, acc = carry
    x = attention_block(x, lp, cfg, cos, sin, shard, segment_ids, positions)
    x, stats = moe_block(x, lp, cfg, shard)
    return x, jax.tree.map(jnp.add, acc, stats)


def _rope(t: int, cfg: ModelConfig, positions: jax.Array | None):
    """cos/sin of the rotary dimensions ``[t, r]`` (``[b, t, r]`` with ``positions``)."""
    return rope_tables(t, cfg, positions, head_dim=cfg.qk_rope_head_dim)


def hidden_and_stats(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                     vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None, dropout_key: jax.Array | None = None) -> tuple:
    """:func:`hidden_states` and the MoE layers' statistics (:func:`jaxcolossal.models.layers.moe.finish`;
    ``{}`` for a dense model). ``dropout_key``: LoRA's dropout in a training step (``model.lora.dropout``;
    one key per layer of each stack)."""
    params = with_dropout_keys(params, cfg.lora, dropout_key)
    x = shard(embed_lookup(params["embed_tokens"], tokens, shard, vocab_parallel, cfg.embedding_impl),
              ("batch", "seq", "embed"))
    cos, sin = _rope(tokens.shape[1], cfg, positions)

    def dense(h, lp):
        return decoder_layer(h, lp, cfg, cos, sin, shard, segment_ids, positions)

    stats = {}
    if "dense_layers" in params:  # the first k dense layers, their own stack
        plain = shard.without_layer_specs() if hasattr(shard, "without_layer_specs") else shard
        x = scan_layers(dense, x, params["dense_layers"], cfg.remat, plain)
    if cfg.moe:
        def routed(c, lp):
            return moe_decoder_layer(c, lp, cfg, cos, sin, shard, segment_ids, positions)

        x, stats = scan_layers(routed, (x, moe.zero_stats(cfg)), params["layers"], cfg.remat, shard)
        stats = moe.finish(stats, cfg)
    else:
        x = scan_layers(dense, x, params["layers"], cfg.remat, shard)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), stats


def hidden_states(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                  vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
                  positions: jax.Array | None = None, dropout_key: jax.Array | None = None) -> jax.Array:
    """Final-norm hidden states ``[b, t, d]`` in the params' dtype for int ``tokens [b, t]`` (packed rows:
    ``segment_ids`` and ``positions`` int ``[b, t]``, RoPE restarting at each document; ``dropout_key``:
    LoRA's dropout in a training step)."""
    return hidden_and_stats(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions, dropout_key)[0]


def head_weight(params: dict, cfg: ModelConfig) -> jax.Array:
    """The LM head ``[d, v]``: ``embed_tokens.T`` when tied, else ``lm_head``."""
    return params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]


def logits_from_hidden(params: dict, h: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard) -> jax.Array:
    """fp32 logits ``[b, t, v]`` (padded vocab, sharded on ``vocab``); padded columns are -1e30."""
    return vocab.logits(h, head_weight(params, cfg), cfg.vocab_size, shard)


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
            vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
            positions: jax.Array | None = None) -> jax.Array:
    """Logits ``[b, t, v_padded]`` (fp32) for int ``tokens [b, t]``."""
    h = hidden_states(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions)
    return logits_from_hidden(params, h, cfg, shard)


head_loss, _ = vocab.lm_loss(hidden_states, head_weight)


loss_and_stats, loss_sum = moe.lm_loss_with_router(hidden_and_stats, head_loss)
"""The summed LM loss with the router's losses, and the router statistics
(:func:`jaxcolossal.models.layers.moe.lm_loss_with_router`)."""


def final_norm(params: dict, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The final norm of the last decoder layer's output ``x [b, t, d]`` (``params``: the non-layer leaves
    suffice), what :func:`hidden_states` returns and the LM head reads."""
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def pipeline_stages(cfg: ModelConfig, shard: Sharder = no_shard, vocab_parallel: bool = False,
                    positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None) -> tuple[Callable, Callable, Callable]:
    """The forward cut at a pipeline's stage boundaries (:mod:`jaxcolossal.parallel.pipeline_executor`),
    as the LLaMA family's: ``embed(others, tokens) -> x``, ``layer_for(x) -> layer(x, layer_params)``,
    ``head(others, x, targets) -> summed fp32 loss``; a mixture of experts passes ``(x, stream)`` with the
    pooled load-balancing loss (:func:`jaxcolossal.models.layers.moe.pipeline_stream`). The config refuses
    a pipeline with ``first_k_dense`` layers (a second stack)."""
    pooled = cfg.moe and cfg.router_aux_loss_form == "pooled"

    def embed(o, tokens):
        x = shard(embed_lookup(o["embed_tokens"], tokens, shard, vocab_parallel, cfg.embedding_impl),
                  ("batch", "seq", "embed"))
        return (x, moe.pipeline_stream(cfg)) if pooled else x

    def moe_layer(cos, sin):
        def layer(c, p):
            h, stats = moe_decoder_layer((c[0] if pooled else c, moe.zero_stats(cfg)), p, cfg, cos, sin, shard,
                                         segment_ids=segment_ids, positions=positions)
            return (h, moe.add_to_stream(c[1], stats)) if pooled else h
        return layer

    def layer_for(x):
        cos, sin = _rope((x[0] if pooled else x).shape[1], cfg, positions)
        if cfg.moe:
            return moe_layer(cos, sin)
        return lambda h, p: decoder_layer(h, p, cfg, cos, sin, shard, segment_ids=segment_ids, positions=positions)

    def head(o, x, y):
        h = x[0] if pooled else x
        loss = head_loss(o, final_norm(o, h, cfg), y, cfg, shard)
        return loss + moe.pooled_loss_gradient(x[1], cfg) if pooled else loss
    return embed, layer_for, head


# ----------------------------------------------------------------------------- the KV-cached decode path

CACHE_AXES = {"latent": ("layers", "batch", None, "latent"), "k_rope": ("layers", "batch", None, "head_dim")}
"""Logical axes of the cache's two arrays ``[L, b, S, r_kv]`` / ``[L, b, S, r]``: the batch over the
data axes, the slots unsplit, the latent and the rotary key whole on every tp rank."""


def _stacks(cfg: ModelConfig) -> dict:
    """``{stack name: number of layers}``: ``layers`` and, with first dense layers, ``dense_layers``."""
    out = {"layers": cfg.moe_layers or cfg.num_layers}
    if cfg.moe and cfg.first_k_dense:
        out["dense_layers"] = cfg.first_k_dense
    return out


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> dict:
    """An empty MLA cache: ``{stack: {"latent": [L, batch, length, kv_lora_rank], "k_rope": [L, batch,
    length, qk_rope_head_dim]}}`` zeros of ``dtype``: per token and layer the normed latent and the
    rotated shared key, ``kv_lora_rank + qk_rope_head_dim`` numbers, not per-head keys and values."""
    dims = {"latent": cfg.kv_lora_rank, "k_rope": cfg.qk_rope_head_dim}
    return {name: {k: jnp.zeros((n, batch, length, r), dtype) for k, r in dims.items()}
            for name, n in _stacks(cfg).items()}


def cache_axes(cfg: ModelConfig) -> dict:
    """The logical axes of :func:`init_cache`'s tree (:data:`CACHE_AXES`)."""
    return {name: dict(CACHE_AXES) for name in _stacks(cfg)}


def cached_mla(h: jax.Array, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder, lat: jax.Array,
               kr: jax.Array, index: jax.Array, kv_valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """MLA of the normed input ``h [b, t, d]`` over one layer's cache (``lat [b, S, r_kv]``, ``kr [b, S,
    r]``), the new tokens' latents written at slot ``index``. ``kv_b_proj`` is absorbed: the queries'
    nope part goes into the latent space (``q·W_k_bᵀ``), the scores are one multi-query attention over
    ``[latent, rotary key]``, the attended latent comes out through ``W_v_b``. Returns ``(attended
    values [b, t, h, v], lat, kr)``."""
    proj = projection(shard)
    q = project_q(h, lp, cfg, cos, sin, shard)
    c, k_rope = project_latent(h, lp, cfg, cos, sin, shard)
    lat = shard(write_slots(lat, c, index), CACHE_AXES["latent"][1:])
    kr = shard(write_slots(kr, k_rope, index), CACHE_AXES["k_rope"][1:])
    nope = cfg.qk_nope_head_dim
    q_lat = proj("bthk,rhk->bthr", q[..., :nope], lp["wk_b"])
    qc = jnp.concatenate([q_lat, q[..., nope:]], axis=-1)                      # [b, t, h, r_kv + r]
    kc = jnp.concatenate([lat, kr], axis=-1)[:, :, None, :].astype(qc.dtype)   # [b, S, 1, r_kv + r]
    mask = cache_mask(index, h.shape[1], kv_valid)
    o = cached_attention(qc, kc, lat[:, :, None, :].astype(qc.dtype), mask, scale=softmax_scale(cfg))
    a = proj("bthr,rhv->bthv", o.astype(h.dtype), lp["wv_b"])
    return a, lat, kr


def _cached_stack(x: jax.Array, layers: dict, cache: dict, cfg: ModelConfig, cos, sin, shard: Sharder,
                  index: jax.Array, kv_valid: jax.Array, experts: bool) -> tuple[jax.Array, dict]:
    """One stack of layers over ``x [b, t, d]`` as a ``lax.scan`` over (layer params, layer cache); a
    layer's LoRA adapters are merged into its weights first (:func:`cached_mla` rearranges them).
    Returns ``(x, the stack's updated cache)``."""
    def body(h, xs):
        lp, lat, kr = xs
        lp = merged_layer(lp, cfg.lora)
        a, lat, kr = cached_mla(rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps), lp, cfg, cos, sin, shard, lat, kr,
                                index, kv_valid)
        h = attention_output(h, a, lp, cfg, shard)
        if experts:
            y, _ = moe.moe_mlp(rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps), lp, cfg, getattr(shard, "mesh", None))
            h = shard(h + y, ("batch", "seq", "embed"))
        else:
            h = mlp_block(h, lp, cfg, shard)
        return h, (lat, kr)

    x, (lats, krs) = jax.lax.scan(body, x, (fetch_layer(layers), cache["latent"], cache["k_rope"]))
    return x, {"latent": lats, "k_rope": krs}


def forward_cached(params: dict, tokens: jax.Array, cache: dict, index: jax.Array, positions: jax.Array,
                   kv_valid: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                   last_only: bool = False) -> tuple[jax.Array, dict]:
    """The forward of ``t`` new tokens against the MLA cache: a prefill or one decode step, as
    transformers' ``DeepseekV3ForCausalLM`` with a cache computes it (to rounding: the absorbed form
    of :func:`cached_mla` sums in another order).

    Args:
        tokens: int ``[b, t]``, written to the slots ``index .. index + t − 1`` (left-padded rows, their
            pads marked invalid in ``kv_valid``).
        cache: :func:`init_cache`'s tree (sharded as :func:`cache_axes`).
        index: int32 scalar, the first slot written, or int32 ``[b]``, one per row
            (:func:`~jaxcolossal.models.layers.attention.write_slots`).
        positions: int ``[b, t]``, the tokens' RoPE positions.
        kv_valid: bool ``[b, S]``: the slots that hold real tokens once these are written.
        last_only: the logits of the last position only.

    Returns:
        ``(fp32 logits [b, t or 1, v_padded], cache)``.
    """
    x = shard(embed_lookup(params["embed_tokens"], tokens, shard, False, cfg.embedding_impl), ("batch", "seq", "embed"))
    cos, sin = _rope(tokens.shape[1], cfg, positions)
    out = {}
    if "dense_layers" in params:
        x, out["dense_layers"] = _cached_stack(x, params["dense_layers"], cache["dense_layers"], cfg, cos, sin,
                                               shard, index, kv_valid, False)
    x, out["layers"] = _cached_stack(x, params["layers"], cache["layers"], cfg, cos, sin, shard, index, kv_valid,
                                     cfg.moe)
    h = rms_norm(x[:, -1:] if last_only else x, params["final_norm"], cfg.rms_norm_eps)
    return logits_from_hidden(params, h, cfg, shard), out
