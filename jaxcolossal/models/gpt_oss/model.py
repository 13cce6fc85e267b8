"""GPT-OSS (OpenAI, 2025: gpt-oss-20b and gpt-oss-120b): pre-RMSNorm blocks whose attention has q/k/v/o
biases, a learned sink logit per head, YaRN RoPE and alternating sliding-window / full layers, and whose
MLP is a mixture of experts with a biased router (top-k of the logits, softmax over the chosen) and
biased experts with the clamped SwiGLU. The numerics follow transformers' ``modeling_gpt_oss.py``.

The same interface as :mod:`jaxcolossal.models.llama` (:class:`jaxcolossal.models.family.Family`): pure
functions over a params dict with the layers stacked ``[L, ...]`` and run by one ``lax.scan``
(:mod:`jaxcolossal.parallel.layer_scan`; each layer's window is a per-layer constant, :func:`layer_extras`),
the NNX module :class:`GptOssForCausalLM`, a KV-cached decode path. Attention is the shared
:func:`jaxcolossal.models.layers.attention.attention` with ``window`` and ``sinks``; the MoE MLP is
:func:`jaxcolossal.models.layers.moe.moe_mlp` with ``model.router_bias``, ``model.expert_bias`` and
``model.swiglu_limit``. Shapes (b batch, t sequence, d hidden, h heads, k kv heads, q head dim,
E experts, f expert size, v padded vocab, L layers)::

    embed_tokens     [v, d]          (vocab, embed)
    layers.attn_norm [L, d]          (layers, embed)                       input_layernorm
    layers.wq        [L, d, h, q]    (layers, embed, heads, head_dim)      column-parallel; bq [L, h, q]
    layers.wk/wv     [L, d, k, q]    (layers, embed, kv_heads, head_dim)   column-parallel; bk/bv [L, k, q]
    layers.wo        [L, h, q, d]    (layers, heads, head_dim, embed)      row-parallel; bo [L, d]
    layers.sinks     [L, h]          (layers, heads)                       model.attention_sinks
    layers.mlp_norm  [L, d]          (layers, embed)                       post_attention_layernorm
    layers.router [L, d, E], router_bias [L, E]; layers.moe_w_gate/up [L, E, d, f], moe_w_down [L, E, f, d]
        and their biases moe_gate_bias/moe_up_bias [L, E, f], moe_down_bias [L, E, d]   (moe.layer_shapes_and_axes)
    final_norm       [d]             (embed,)
    lm_head          [d, v]          (embed, vocab)  absent when tie_word_embeddings

Initialisation depends only on the seed (the vocabulary rows drawn at ``vocab_size``, the padding
zero: :func:`jaxcolossal.models.layers.vocab.init_vocab_padded`): weights, sinks and the router bias
normal(0, initializer_range) as transformers' ``GptOssPreTrainedModel._init_weights``, the residual
output projections (``wo``, ``moe_w_down``) scaled by ``1/sqrt(2L)`` as the LLaMA family's, the
linear and expert biases zero, the norms one.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcolossal.config import ConfigError, ModelConfig
from jaxcolossal.models.family import stacked_params
from jaxcolossal.models.layers import moe, vocab
from jaxcolossal.models.layers.attention import attention, write_slots
from jaxcolossal.models.layers.decode_attention import attend_cache
from jaxcolossal.models.layers.linear import column_parallel, row_parallel, tp_overlaps
from jaxcolossal.models.layers.lora import DROPOUT_KEY, EQUATIONS, adapt
from jaxcolossal.models.layers.norm import rms_norm
from jaxcolossal.models.layers.rope import apply_rope, rope_tables
from jaxcolossal.models.layers.vocab import Sharder, embed_lookup, no_shard, padded_vocab_size
from jaxcolossal.parallel.layer_scan import fetch_layer, scan_layers, tag

__all__ = ["GptOssForCausalLM", "param_shapes_and_axes", "init_params", "hidden_states", "forward", "loss_sum",
           "loss_and_stats", "pipeline_stages", "init_cache", "cache_axes", "forward_cached"]


def _check(cfg: ModelConfig) -> None:
    """Raises ConfigError: a GPT-OSS model without its mixture of experts, or with q/k/v biases but none on o."""
    if not cfg.moe:
        raise ConfigError("model.type=gpt_oss: every GPT-OSS layer's MLP is a mixture of experts: set "
                          "model.num_experts (32 for gpt-oss-20b, 128 for gpt-oss-120b)")
    if cfg.attention_bias == "qkv":
        raise ConfigError("model.attention_bias=qkv: GPT-OSS's attention has biases on q, k, v and o together: "
                          "set model.attention_bias=all (or none)")


def param_shapes_and_axes(cfg: ModelConfig, vocab: int) -> dict:
    """``{name: (shape, logical_axes)}`` for every parameter (the table in the module doc).

    Raises:
        ConfigError: :func:`_check`'s.
    """
    _check(cfg)
    L, d, h, k, q = cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    layers = {
        "attn_norm": ((L, d), ("layers", "embed")),
        "wq": ((L, d, h, q), ("layers", "embed", "heads", "head_dim")),
        "wk": ((L, d, k, q), ("layers", "embed", "kv_heads", "head_dim")),
        "wv": ((L, d, k, q), ("layers", "embed", "kv_heads", "head_dim")),
        "wo": ((L, h, q, d), ("layers", "heads", "head_dim", "embed")),
        "mlp_norm": ((L, d), ("layers", "embed")),
    }
    if cfg.attention_bias == "all":
        kv = ((L, k, q), ("layers", "kv_heads", "head_dim"))
        layers.update(bq=((L, h, q), ("layers", "heads", "head_dim")), bk=kv, bv=kv, bo=((L, d), ("layers", "embed")))
    if cfg.attention_sinks:
        layers["sinks"] = ((L, h), ("layers", "heads"))
    layers.update(moe.layer_shapes_and_axes(cfg))
    out = {"embed_tokens": ((vocab, d), ("vocab", "embed")), "layers": layers, "final_norm": ((d,), ("embed",))}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ((d, vocab), ("embed", "vocab"))
    return out


ZERO_INIT = ("bq", "bk", "bv", "bo") + moe.EXPERT_BIASES
"""The leaves that start at zero (transformers zeroes the linear and expert biases)."""


def _init_leaf(key, name: str, shape, cfg: ModelConfig) -> jax.Array:
    if name.endswith("norm"):
        return jnp.ones(shape, jnp.float32)
    if name in ZERO_INIT:
        return jnp.zeros(shape, jnp.float32)
    std = cfg.initializer_range
    if name in ("wo", "moe_w_down"):  # GPT-2 / Megatron scaled init of the residual projections
        std = std / math.sqrt(2 * cfg.num_layers)
    return std * jax.random.normal(key, shape, jnp.float32)


class GptOssForCausalLM(nnx.Module):
    """GPT-OSS decoder with a causal-LM head, as a Flax NNX module.

    Args:
        cfg: the model section of the config (``type: gpt_oss``, ``num_experts > 0``).
        rngs: ``nnx.Rngs`` for initialisation (the module doc's).
        tp: tensor-parallel size, only to pad the vocabulary (:func:`padded_vocab_size`).

    Params are fp32 ``nnx.Param`` with logical ``axes`` metadata. ``__call__(tokens)`` maps int32
    ``[b, t]`` tokens to fp32 logits ``[b, t, vocab_size]`` (padding removed).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, tp: int = 1):
        self.cfg = cfg
        self.vocab = padded_vocab_size(cfg, tp)
        stacked_params(self, cfg, param_shapes_and_axes(cfg, self.vocab), rngs.params(), _init_leaf)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        return forward(params, tokens, self.cfg)[..., : self.cfg.vocab_size]


def init_params(cfg: ModelConfig, key: jax.Array, tp: int = 1) -> dict:
    """fp32 params (pure dict) of a fresh :class:`GptOssForCausalLM`; jit-able."""
    return nnx.to_pure_dict(nnx.state(GptOssForCausalLM(cfg, rngs=nnx.Rngs(params=key), tp=tp), nnx.Param))


# ----------------------------------------------------------------------------- the computation

def layer_window(lp: dict, cfg: ModelConfig):
    """This layer's attention window: the per-layer constant ``lp["window"]`` when the layers differ
    (:func:`layer_extras`), else the one window of every layer (a Python int; 0: full attention)."""
    return lp["window"] if "window" in lp else max(cfg.layer_windows, default=0)


def layer_extras(cfg: ModelConfig) -> dict:
    """The per-layer constants for the layer scan (:func:`jaxcolossal.parallel.layer_scan.scan_layers`):
    each layer's window int32 ``[L]`` when the layers' windows differ (GPT-OSS's alternating
    ``sliding_attention`` / ``full_attention``), else none. (The planner traces the first layers of a
    model by lowering ``num_layers`` alone: the windows are cut to it.)"""
    windows = cfg.layer_windows[:cfg.num_layers]
    return {"window": jnp.asarray(windows, jnp.int32)} if len(set(windows)) > 1 else {}


def project_qkv(x: jax.Array, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard) -> tuple:
    """The attention's first phase: the pre-norm, the q/k/v projections with their biases (and LoRA's
    adapters where ``model.lora`` puts them), RoPE. x ``[b, t, d]`` -> q ``[b, t, h, q]``, k/v ``[b, t, k,
    q]`` (compute dtype)."""
    column = partial(column_parallel, shard, tp_overlaps(shard, x.shape[1]))
    lora = partial(adapt, lp=lp, lora=cfg.lora, dropout_key=lp.get(DROPOUT_KEY))
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    biases = [lp["bq"], lp["bk"], lp["bv"]] if "bq" in lp else None
    q, k, v = column(h, [("btd,dhq->bthq", lp["wq"], "h"), ("btd,dkq->btkq", lp["wk"], "k"),
                         ("btd,dkq->btkq", lp["wv"], "k")], biases)
    q, k, v = (lora(EQUATIONS[n], h, y, name=n) for n, y in (("wq", q), ("wk", k), ("wv", v)))
    q = tag(shard(q, ("batch", "seq", "heads", "head_dim")), "query_proj")
    k = tag(shard(k, ("batch", "seq", "kv_heads", "head_dim")), "key_proj")
    v = tag(shard(v, ("batch", "seq", "kv_heads", "head_dim")), "value_proj")
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_output(x: jax.Array, a: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder = no_shard) -> jax.Array:
    """The attention's last phase: the output projection (its bias, LoRA's adapter) of the attended values
    ``a [b, t, h, q]`` added to the residual ``x [b, t, d]`` -> ``[b, t, d]``."""
    row = partial(row_parallel, shard, tp_overlaps(shard, x.shape[1]))
    lora = partial(adapt, lp=lp, lora=cfg.lora, dropout_key=lp.get(DROPOUT_KEY))
    a = shard(a, ("batch", "seq", "heads", "head_dim"))
    o = lora(EQUATIONS["wo"], a, row("bthq,hqd->btd", a, lp["wo"], "h", lp.get("bo")), name="wo")
    return shard(x + tag(o, "out_proj"), ("batch", "seq", "embed"))


def moe_half(x: jax.Array, lp: dict, cfg: ModelConfig, shard: Sharder = no_shard) -> tuple[jax.Array, dict]:
    """The MLP half with its residual: ``x + moe_mlp(rms_norm(x))`` (:func:`jaxcolossal.models.layers.moe.moe_mlp`
    with the router bias, the experts' biases and the clamped SwiGLU). ``([b, t, d], this layer's stats)``."""
    manual = getattr(shard, "manual_experts", None)  # inside a pipeline's shard_map
    mesh = None if manual else getattr(shard, "mesh", None)
    y, stats = moe.moe_mlp(rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps), lp, cfg, mesh, manual)
    return shard(x + y, ("batch", "seq", "embed")), stats


def decoder_layer(carry: tuple, lp: dict, cfg: ModelConfig, cos, sin, shard: Sharder = no_shard,
                  segment_ids: jax.Array | None = None, positions: jax.Array | None = None) -> tuple:
    """One GPT-OSS block (transformers' ``GptOssDecoderLayer``): ``(x [b, t, d], stats) -> (x, stats +
    this layer's)`` (the layer scan's carry). Attention within the layer's window, with its sinks."""
    x, acc = carry
    q, k, v = project_qkv(x, lp, cfg, cos, sin, shard)
    a = attention(q, k, v, cfg.attention_impl, segment_ids, shard, positions, window=layer_window(lp, cfg),
                  sinks=lp.get("sinks"))
    x, stats = moe_half(attention_output(x, a, lp, cfg, shard), lp, cfg, shard)
    return x, jax.tree.map(jnp.add, acc, stats)


def hidden_and_stats(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                     vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None, dropout_key: jax.Array | None = None) -> tuple:
    """:func:`hidden_states` and the MoE layers' statistics (:data:`jaxcolossal.models.layers.moe.STATS`,
    the microbatch's: :func:`jaxcolossal.models.layers.moe.finish`)."""
    layers = params["layers"]
    if dropout_key is not None and cfg.lora.dropout > 0:  # LoRA's dropout: one key per layer
        layers = {**layers, DROPOUT_KEY: jax.random.split(dropout_key, cfg.num_layers)}
    x = shard(embed_lookup(params["embed_tokens"], tokens, shard, vocab_parallel, cfg.embedding_impl),
              ("batch", "seq", "embed"))
    cos, sin = rope_tables(tokens.shape[1], cfg, positions)

    def layer(c, lp):
        return decoder_layer(c, lp, cfg, cos, sin, shard, segment_ids, positions)

    x, stats = scan_layers(layer, (x, moe.zero_stats(cfg)), layers, cfg.remat, shard, layer_extras(cfg))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), moe.finish(stats, cfg)


def hidden_states(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                  vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
                  positions: jax.Array | None = None, dropout_key: jax.Array | None = None) -> jax.Array:
    """Final-norm hidden states ``[b, t, d]`` in the params' dtype for int ``tokens [b, t]``.

    The embedding is :func:`jaxcolossal.models.layers.vocab.embed_lookup` (vocab-parallel when
    ``vocab_parallel``); packed rows pass ``segment_ids`` and ``positions`` (int ``[b, t]``).
    ``dropout_key``: LoRA's dropout in a training step (``model.lora.dropout``; LoRA adapts the attention
    projections only, as with every mixture of experts).
    """
    return hidden_and_stats(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions, dropout_key)[0]


def head_weight(params: dict, cfg: ModelConfig) -> jax.Array:
    """The LM head ``[d, v]``: ``embed_tokens.T`` when tied, else ``lm_head``."""
    return params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]


def forward(params: dict, tokens: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
            vocab_parallel: bool = False, segment_ids: jax.Array | None = None,
            positions: jax.Array | None = None) -> jax.Array:
    """fp32 logits ``[b, t, v_padded]`` (padded columns -1e30, sharded on ``vocab``) for int ``tokens [b, t]``."""
    h = hidden_states(params, tokens, cfg, shard, vocab_parallel, segment_ids, positions)
    return vocab.logits(h, head_weight(params, cfg), cfg.vocab_size, shard)


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
    as the LLaMA family's mixture of experts: ``embed(others, tokens [mb, t]) -> x``, ``layer_for(x) ->
    layer(x, layer_params)``, ``head(others, x, targets) -> summed fp32 loss``. ``x``: the activations
    ``[mb, t, d]``, or with the pooled load-balancing loss ``(activations, stream)``
    (:func:`jaxcolossal.models.layers.moe.pipeline_stream`). Every layer has the same window here
    (config/architecture.py refuses mixed ``layer_types`` in a pipeline)."""
    pooled = cfg.router_aux_loss_form == "pooled"

    def embed(o, tokens):
        x = shard(embed_lookup(o["embed_tokens"], tokens, shard, vocab_parallel, cfg.embedding_impl),
                  ("batch", "seq", "embed"))
        return (x, moe.pipeline_stream(cfg)) if pooled else x

    def layer_for(x):
        cos, sin = rope_tables((x[0] if pooled else x).shape[1], cfg, positions)

        def layer(c, p):  # the per-layer router losses join through their gradient (moe.with_loss_gradient)
            h, stats = decoder_layer((c[0] if pooled else c, moe.zero_stats(cfg)), p, cfg, cos, sin, shard,
                                     segment_ids=segment_ids, positions=positions)
            return (h, moe.add_to_stream(c[1], stats)) if pooled else h
        return layer

    def head(o, x, y):
        h = x[0] if pooled else x
        loss = head_loss(o, final_norm(o, h, cfg), y, cfg, shard)
        return loss + moe.pooled_loss_gradient(x[1], cfg) if pooled else loss
    return embed, layer_for, head


# ----------------------------------------------------------------------------- the KV-cached decode path

CACHE_AXES = ("layers", "batch", None, "kv_heads", "head_dim")
"""Logical axes of one cache array ``[L, b, S, k, q]``: kv heads over ``tp``, the batch over the data
axes, the slots unsplit."""


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> dict:
    """An empty KV cache ``{"layers": {"k", "v"}}``, each ``[L, batch, length, k, q]`` zeros of ``dtype``
    (the compute dtype). Sliding layers keep every slot too (their window is a mask, not a ring buffer)."""
    return {"layers": {kv: jnp.zeros((cfg.num_layers, batch, length, cfg.num_key_value_heads, cfg.head_dim), dtype)
                       for kv in "kv"}}


def cache_axes(cfg: ModelConfig) -> dict:
    """The logical axes of :func:`init_cache`'s tree (:data:`CACHE_AXES` for every leaf)."""
    return {"layers": {kv: CACHE_AXES for kv in "kv"}}


def forward_cached(params: dict, tokens: jax.Array, cache: dict, index: jax.Array, positions: jax.Array,
                   kv_valid: jax.Array, cfg: ModelConfig, shard: Sharder = no_shard,
                   last_only: bool = False) -> tuple[jax.Array, dict]:
    """The forward of ``t`` new tokens against a KV cache (a prefill, or one decode step ``t = 1``), as
    transformers' ``GptOssForCausalLM`` with a cache computes it.

    Args:
        tokens: int ``[b, t]``, written to the cache slots ``index .. index + t - 1`` (left-padded rows
            mark their pads invalid in ``kv_valid``).
        cache: :func:`init_cache`'s tree (sharded as :func:`cache_axes`); index: int32 scalar (or ``[b]``, per
            row), the first slot.
        positions: int ``[b, t]``, the tokens' RoPE positions (a left-padded row starts at 0).
        kv_valid: bool ``[b, S]``: the slots that hold real tokens once these are written.
        last_only: the logits of the last position only.

    Returns:
        ``(fp32 logits [b, t or 1, v_padded], the cache with this call's keys and values written)``.
    """
    x = shard(embed_lookup(params["embed_tokens"], tokens, shard, False, cfg.embedding_impl), ("batch", "seq", "embed"))
    cos, sin = rope_tables(tokens.shape[1], cfg, positions)
    spec = CACHE_AXES[1:]

    def body(h, xs):
        lp, e, kc, vc = xs
        lp = {**lp, **e}
        q, k, v = project_qkv(h, lp, cfg, cos, sin, shard)
        kc = shard(write_slots(kc, k, index), spec)
        vc = shard(write_slots(vc, v, index), spec)
        a = attend_cache(q, kc, vc, index, kv_valid, shard, layer_window(lp, cfg), sinks=lp.get("sinks"))
        a = a.astype(h.dtype)
        h, _ = moe_half(attention_output(h, a, lp, cfg, shard), lp, cfg, shard)
        return h, (kc, vc)

    c = cache["layers"]
    x, (ks, vs) = jax.lax.scan(body, x, (fetch_layer(params["layers"]), layer_extras(cfg), c["k"], c["v"]))
    h = rms_norm(x[:, -1:] if last_only else x, params["final_norm"], cfg.rms_norm_eps)
    return vocab.logits(h, head_weight(params, cfg), cfg.vocab_size, shard), {"layers": {"k": ks, "v": vs}}
